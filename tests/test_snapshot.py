"""Snapshots: O(1) handles read lazily; formatting in CPython's layout; colour rules."""

from __future__ import annotations

import io
import os
import pickle
import sys
import traceback

import pytest
from conftest import tracking
from stackcheck import shadow_records

import monstack
from monstack import _colorize, _format
from monstack._snapshot import Snapshot


def take():
    return monstack.snapshot()


def test_frames_are_a_stacksummary_like_extract_stack(installed):
    snap, real = take(), traceback.extract_stack()
    frames = snap.frames
    assert isinstance(frames, traceback.StackSummary)
    assert [(f.filename, f.name) for f in frames][-1] == (__file__, "take")
    tracked_real = [f for f in real if f.filename == __file__]
    assert [(f.filename, f.lineno, f.name) for f in frames if f.filename == __file__][:-1] == [
        (f.filename, f.lineno, f.name) for f in tracked_real
    ]
    assert frames[-1].line == "return monstack.snapshot()"  # looked up lazily
    assert len(snap) == len(frames)


def test_snapshot_is_immutable_and_cannot_be_built_directly(installed):
    snap = take()
    with pytest.raises(TypeError):
        Snapshot()
    with pytest.raises(AttributeError):
        snap.foo = 1  # type: ignore[attr-defined]


def test_str_format_and_repr(installed):
    snap = take()
    text = str(snap)
    assert f'File "{__file__}", line' in text and "in take" in text
    assert "    return monstack.snapshot()" in text
    assert text == snap.format(color=False)
    assert "\x1b[" in snap.format(color=True)
    assert repr(snap).startswith("<monstack.Snapshot: ") and "in take" in repr(snap)


def test_pickle_round_trip_keeps_records(installed):
    snap = take()
    clone = pickle.loads(pickle.dumps(snap))
    assert clone == snap
    assert clone.records() == snap.records()
    assert str(clone) == str(snap)
    assert len(clone) == len(snap)


@tracking
def test_snapshot_is_o1_shares_nodes_and_survives_caller_moving_on(installed):
    def a():
        s1 = take()
        s2 = take()
        return s1, s2

    s1, s2 = a()
    # same parent chain object: nodes are shared, not copied
    assert s1._node[1] is s2._node[1]
    assert shadow_records(s1)[-2][1] + 1 == shadow_records(s2)[-2][1]


def test_missing_source_file_shows_frame_without_line(tmp_path):
    path = tmp_path / "gone.py"
    path.write_text("import monstack\ndef f():\n    return monstack.snapshot()\n")
    ns: dict = {"__name__": "gone"}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    snap = ns["f"]()
    os.remove(path)
    import linecache

    linecache.checkcache(str(path))
    text = snap.format(color=False)
    assert f'File "{path}", line 3, in f\n' in text
    assert "return monstack.snapshot()" not in text


def test_recursion_is_collapsed_like_cpython():
    recs = [("a.py", 1, "main", None, None, None)] + [("a.py", 5, "rec", None, None, None)] * 50
    lines = _format.format_records(recs, color=False)
    assert sum(1 for line in lines if "in rec" in line) == 3
    assert "  [Previous line repeated 47 more times]\n" in lines


def test_recursion_collapse_matches_traceback_module():
    def rec(n):
        if n == 0:
            return traceback.extract_stack()
        return rec(n - 1)

    summary = rec(10)
    ours = "".join(_format.format_records([(f.filename, f.lineno, f.name) for f in summary], limit=0))
    theirs = "".join(traceback.StackSummary.from_list(summary).format())
    def strip(text):  # CPython 3.11+ may add caret lines; compare the rest
        return [line for line in text.splitlines() if line.strip() and set(line.strip()) - set("^~")]

    assert strip(ours) == strip(theirs)


def test_long_stacks_elide_the_middle_and_count():
    recs = [(f"f{i}.py", i + 1, f"fn{i}", None, None, None) for i in range(300)]
    lines = _format.format_records(recs, color=False, limit=10)
    text = "".join(lines)
    assert "fn0" in text and "fn4" in text and "fn5" not in text
    assert "fn295" in text and "fn299" in text and "fn294" not in text
    assert "  ... 290 frames omitted ...\n" in lines


@pytest.mark.parametrize(
    "env, isatty, expected",
    [
        ({}, True, True),
        ({}, False, False),
        ({"NO_COLOR": "1"}, True, False),
        ({"FORCE_COLOR": "1"}, False, True),
        ({"TERM": "dumb"}, True, False),
        ({"PYTHON_COLORS": "0", "FORCE_COLOR": "1"}, True, False),
        ({"PYTHON_COLORS": "1", "NO_COLOR": "1"}, False, True),
    ],
)
def test_colour_rules_follow_cpython(monkeypatch, env, isatty, expected):
    for var in ("PYTHON_COLORS", "NO_COLOR", "FORCE_COLOR", "TERM"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    class Stream(io.StringIO):
        def isatty(self):
            return isatty

        def fileno(self):
            raise io.UnsupportedOperation

    assert _colorize.can_colorize(Stream()) is expected


def test_colour_uses_cpython_magenta_layout():
    line = _format.format_frame(("x.py", 3, "f"), color=True)
    assert line.startswith('  File \x1b[35m"x.py"\x1b[0m, line \x1b[35m3\x1b[0m, in \x1b[35mf\x1b[0m\n')


def test_snapshot_works_in_every_thread_and_without_tracked_frames():
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(monstack.snapshot()))
    t.start()
    t.join()
    assert len(out[0]) >= 1  # the lambda (defined here) is tracked
    assert sys._getframe().f_code.co_name == "test_snapshot_works_in_every_thread_and_without_tracked_frames"
