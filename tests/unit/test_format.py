"""monstack._format: snapshots, origin chains and exceptions in CPython's traceback layout
(recursion collapsed, long stacks elided, colour only when asked)."""

from __future__ import annotations

import os
import sys
import traceback
import types

import pytest

from conftest import FakeStream, chain_of

import monstack
from monstack import _format, _snapshot
from monstack._colorize import ANSI

ORIGIN = _format.ORIGIN_HEADING + "\n"
HOP = _format.HOP_HEADING + "\n"


def _recs(*names: str) -> list:
    """One frame record per name (a file that does not exist: no source lines)."""
    return [(f"{name}.py", i + 1, name, None, None, None) for i, name in enumerate(names)]




class _Hop:
    """Just what format_origin reads of a snapshot: records(), chain(), _chain_limit()."""

    def __init__(self, records=(), older=(), broken=False) -> None:
        self._recs, self._older, self._broken = tuple(records), tuple(older), broken

    def records(self):
        if self._broken:
            raise RuntimeError("a record that cannot be read")
        return self._recs

    _display_records = records

    def chain(self, limit):
        shown = self._older[:limit]
        return shown, len(self._older) - len(shown)

    @staticmethod
    def _chain_limit():
        return _snapshot.DEFAULT_CHAIN_LIMIT




def _failed(note=None) -> Exception:
    try:
        raise KeyError("formatted")
    except KeyError as exc:
        if note is not None:
            exc.add_note(note)
        return exc


def test_missing_source_file_shows_frame_without_line(tmp_path):
    path = tmp_path / "gone.py"
    path.write_text("import monstack\ndef f():\n    return monstack.snapshot()\n")
    ns: dict = {"__name__": "gone"}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    snap = ns["f"]()
    os.remove(path)
    import linecache

    linecache.checkcache(str(path))
    text = snap.format(color=False) + "\n"
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


def test_colour_uses_cpython_magenta_layout():
    line = _format.format_frame(("x.py", 3, "f"), color=True)
    assert line.startswith('  File \x1b[35m"x.py"\x1b[0m, line \x1b[35m3\x1b[0m, in \x1b[35mf\x1b[0m\n')

# -- source lines and frames ------------------------------------------------------------------


def test_source_line_needs_a_line_number_and_survives_a_failing_lookup(monkeypatch):
    here = sys._getframe().f_lineno
    assert _format.source_line(__file__, here) == "here = sys._getframe().f_lineno"
    assert _format.source_line(__file__, 0) == ""
    assert _format.source_line(__file__, None) == ""

    def broken(*args, **kwargs):
        raise OSError("the loader failed")

    monkeypatch.setattr(_format, "linecache", types.SimpleNamespace(getline=broken))  # only _format's
    assert _format.source_line(__file__, here) == ""
    assert _format.format_frame((__file__, here, "f")) == f'  File "{__file__}", line {here}, in f\n'


def _restored_elsewhere(tmp_path, source_here):
    """A snapshot of line 3 of a file, pickled, the file then replaced (or removed) here."""
    import pickle

    path = tmp_path / "remote.py"
    path.write_text("import monstack\ndef f():\n    return monstack.snapshot()  # made there\n")
    ns: dict = {"__name__": "remote"}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    data = pickle.dumps(ns["f"]())
    if source_here is None:
        os.remove(path)
    else:
        path.write_text(source_here)
    import linecache

    linecache.checkcache(str(path))
    return path, pickle.loads(data)


def test_a_restored_snapshot_shows_its_carried_line_when_its_file_is_missing_here(tmp_path):
    path, snap = _restored_elsewhere(tmp_path, None)
    text = snap.format(color=False) + "\n"
    assert f'File "{path}", line 3, in f\n    return monstack.snapshot()  # made there\n' in text


def test_a_restored_snapshot_never_shows_a_different_local_file_at_its_path(tmp_path):
    import linecache

    marker = "LOCAL-" + "ONLY"  # (not spelt out: the test's own line is in the snapshot)
    path, snap = _restored_elsewhere(tmp_path, f"a\nb\n{marker}\n")
    assert linecache.getline(str(path), 3).strip() == marker
    text = snap.format(color=False) + "".join(_format.format_origin(snap))
    assert marker not in text and "# made there" in text
    assert snap.frames[-1].line == "return monstack.snapshot()  # made there"


def test_a_restored_snapshot_without_text_shows_no_line_and_reads_no_file(tmp_path, monkeypatch):
    from monstack._snapshot import Snapshot

    path = tmp_path / "here.py"
    path.write_text("one\ntwo\n")
    snap = Snapshot.from_portable({"v": 1, "chain": [[[str(path), 2, "f", 2, 0, 3, None]]], "dropped": 0})
    import linecache

    def no_reads(*args, **kwargs):
        raise AssertionError("a restored snapshot read a local file")

    monkeypatch.setattr(linecache, "getline", no_reads)
    monkeypatch.setattr(linecache, "getlines", no_reads)
    assert _format.format_snapshot(snap, color=False) == f'  File "{path}", line 2, in f'
    assert snap.frames[0].line == ""
    import traceback

    assert traceback.format_list(snap.frames) == [f'  File "{path}", line 2, in f\n']


def test_format_frame_shows_a_carried_line_and_never_looks_one_up():
    assert _format.format_frame((__file__, 1, "f", None, None, None, "  carried  ")) == (
        f'  File "{__file__}", line 1, in f\n    carried\n'
    )
    assert _format.format_frame((__file__, 1, "f", None, None, None, None)) == f'  File "{__file__}", line 1, in f\n'


# -- format_records(): recursion and elision ---------------------------------------------


def test_recursion_cutoff_boundary_and_singular():
    three = _format.format_records(_recs("a") * 3)
    assert three == ['  File "a.py", line 1, in a\n'] * 3  # at the cutoff: nothing collapsed
    four = _format.format_records(_recs("a") * 4)
    assert four == ['  File "a.py", line 1, in a\n'] * 3 + ["  [Previous line repeated 1 more time]\n"]


def test_each_run_is_collapsed_where_it_ends():
    a, b = _recs("a", "b")
    lines = _format.format_records([a] * 5 + [b] * 6 + [a])
    assert lines == (
        ['  File "a.py", line 1, in a\n'] * 3
        + ["  [Previous line repeated 2 more times]\n"]
        + ['  File "b.py", line 2, in b\n'] * 3
        + ["  [Previous line repeated 3 more times]\n"]
        + ['  File "a.py", line 1, in a\n']
    )


def test_default_limit_is_max_frames_and_one_omitted_frame_is_singular():
    n = _format.MAX_FRAMES
    recs = _recs(*(f"fn{i}" for i in range(n + 1)))
    assert not any("omitted" in line for line in _format.format_records(recs[:n]))
    for lines in (_format.format_records(recs), _format.format_records(recs, limit=None)):
        assert "  ... 1 frame omitted ...\n" in lines
        assert sum(1 for line in lines if line.startswith("  File ")) == n


@pytest.mark.parametrize("limit", [0, -1])
def test_a_limit_below_one_shows_every_frame(limit):
    recs = _recs(*(f"fn{i}" for i in range(3 * _format.MAX_FRAMES)))
    lines = _format.format_records(recs, limit=limit)
    assert len(lines) == len(recs) and not any("omitted" in line for line in lines)


def test_elision_counts_the_frames_a_collapsed_run_stood_for():
    a, b, c, d = _recs("a", "b", "c", "d")
    lines = _format.format_records([a] + [b] * 10 + [c, d], limit=2)
    assert lines == ['  File "a.py", line 1, in a\n', "  ... 11 frames omitted ...\n", '  File "d.py", line 4, in d\n']


def test_elided_line_is_grey_when_coloured():
    lines = _format.format_records(_recs(*(f"fn{i}" for i in range(12))), color=True, limit=10)
    assert f"{ANSI.GREY}  ... 2 frames omitted ...{ANSI.RESET}\n" in lines


# -- format_snapshot() ---------------------------------------------------------------------


def _outer() -> monstack.Snapshot:
    return _middle()


def _middle() -> monstack.Snapshot:
    return _inner()


def _inner() -> monstack.Snapshot:
    return monstack.snapshot()


@pytest.mark.parametrize(
    "env, color, tty, coloured",
    [
        ({}, None, False, False),
        ({}, None, True, True),
        ({"MONSTACK_COLOR": "always"}, None, False, True),
        ({"MONSTACK_COLOR": "never"}, None, True, False),
        ({"FORCE_COLOR": "1"}, False, True, False),
        ({"NO_COLOR": "1"}, True, False, True),
    ],
)
def test_format_snapshot_decides_colour_for_the_given_file(monkeypatch, env, color, tty, coloured):
    for var in ("PYTHON_COLORS", "NO_COLOR", "FORCE_COLOR", "TERM", "MONSTACK_COLOR"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    text = _format.format_snapshot(_inner(), color=color, file=FakeStream(tty))
    assert ("\x1b[35m" in text) is coloured
    assert "_inner" in text


def test_format_snapshot_passes_the_frame_limit():
    snap = _outer()  # this test > _outer > _middle > _inner
    assert "omitted" not in _format.format_snapshot(snap, color=False)
    text = _format.format_snapshot(snap, color=False, limit=2)
    assert text.count("  File ") == 2 and "  ... 2 frames omitted ...\n" in text
    assert "in _inner" in text and "in _outer" not in text


# -- format_origin() ---------------------------------------------------------------------


def test_format_origin_lists_the_hops_newest_first():
    lines = _format.format_origin(_Hop(_recs("new"), older=[_Hop(_recs("mid")), _Hop(_recs("old"))]))
    assert lines == [ORIGIN, '  File "new.py", line 1, in new\n', HOP, '  File "mid.py", line 1, in mid\n',
                     HOP, '  File "old.py", line 1, in old\n']
    snap = chain_of(2)
    lines = _format.format_origin(snap)
    assert [line for line in lines if line in (ORIGIN, HOP)] == [ORIGIN, HOP, HOP]
    assert not any("dropped" in line for line in lines)
    hops = [snap] + list(snap.chain()[0])
    blocks = "".join(lines).split(HOP)
    for block, hop in zip(blocks, hops):
        assert "".join(_format.format_records(hop.records())) in block


@pytest.mark.parametrize("limit, shown, last", [
    (2, 2, "[4 more hops dropped (chain_limit=2)]\n"),
    (5, 5, "[1 more hop dropped (chain_limit=5)]\n"),
    (0, 1, "[5 more hops dropped (chain_limit=1)]\n"),  # below one: the origin itself
    (6, 6, None),
])
def test_format_origin_drops_older_hops_and_says_how_many(limit, shown, last):
    # the origin and its 5 older hops: ``limit`` of those 6 shown (the origin counts)
    lines = _format.format_origin(chain_of(5), limit=limit)
    assert sum(1 for line in lines if line in (ORIGIN, HOP)) == shown
    if last is None:
        assert not any("dropped" in line for line in lines)
    else:
        assert lines[-1] == last and sum("dropped" in line for line in lines) == 1


def test_format_origin_in_colour():
    lines = _format.format_origin(chain_of(3), color=True, limit=2)
    assert lines[0] == f"{ANSI.BOLD}{_format.ORIGIN_HEADING}{ANSI.RESET}\n"
    assert f"{ANSI.BOLD}{_format.HOP_HEADING}{ANSI.RESET}\n" in lines
    assert lines[-1] == f"{ANSI.GREY}[2 more hops dropped (chain_limit=2)]{ANSI.RESET}\n"


def test_format_origin_default_limit_is_the_installed_chain_limit():
    monstack.install(chain_limit=3)
    lines = _format.format_origin(chain_of(5))  # 6 snapshots: 3 shown
    assert sum(1 for line in lines if line in (ORIGIN, HOP)) == 3
    assert lines[-1] == "[3 more hops dropped (chain_limit=3)]\n"
    monstack.uninstall()  # back to the default
    n = _snapshot.DEFAULT_CHAIN_LIMIT
    lines = _format.format_origin(chain_of(n + 1))  # n + 2 snapshots: n shown
    assert sum(1 for line in lines if line in (ORIGIN, HOP)) == n
    assert lines[-1] == f"[2 more hops dropped (chain_limit={n})]\n"


def test_format_origin_hops_without_frames_or_with_broken_records():
    # An origin with no frames to show is not shown at all (no heading alone), even when
    # older hops have frames; an older hop without frames is left out of the chain.
    assert _format.format_origin(_Hop((), older=[_Hop(broken=True), _Hop(_recs("x"))])) == []
    assert not _format.has_frames(_Hop(())) and not _format.has_frames(_Hop(broken=True))
    lines = _format.format_origin(_Hop(_recs("a"), older=[_Hop(broken=True), _Hop(()), _Hop(_recs("x"))]))
    assert lines == [ORIGIN, '  File "a.py", line 1, in a\n', HOP, '  File "x.py", line 1, in x\n']
    assert _format.has_frames(_Hop(_recs("a")))


def test_format_origin_passes_the_frame_limit():
    lines = _format.format_origin(_Hop(_recs(*(f"fn{i}" for i in range(10)))), frame_limit=4)
    assert "  ... 6 frames omitted ...\n" in lines


# -- exceptions -------------------------------------------------------------------------------


@pytest.mark.parametrize("note, ours", [
    (_format.ORIGIN_HEADING + "\n  File \"x.py\", line 1, in x", True),
    (_format.ORIGIN_HEADING, True),
    ("see: " + _format.ORIGIN_HEADING, False),
    ("an ordinary note", False),
    (None, False),
    (b"Work created at (most recent call last):", False),
])
def test_is_origin_note(note, ours):
    assert _format.is_origin_note(note) is ours


def test_format_traceback_is_cpythons_without_our_note_only():
    exc = _failed(_format.ORIGIN_HEADING + "\n  (no tracked frames)")
    exc.add_note("another note")
    text = _format.format_traceback(exc)
    assert "another note" in text and _format.ORIGIN_HEADING not in text
    exc.__notes__ = ["another note"]
    assert text == "".join(traceback.format_exception(exc))


def test_format_exception_keeps_our_note_without_an_origin_and_replaces_it_with_one():
    exc = _failed(_format.ORIGIN_HEADING + "\n  (no tracked frames)")
    assert _format.format_exception(exc).count(_format.ORIGIN_HEADING) == 1
    origin = chain_of(0)
    text = _format.format_exception(exc, origin)
    assert text.count(_format.ORIGIN_HEADING) == 1
    assert text.endswith("".join(_format.format_origin(origin)))
    assert "  (no tracked frames)" not in text


def test_format_exception_survives_an_origin_that_cannot_be_formatted():
    class Unreadable:
        def _chain_limit(self):
            raise RuntimeError("no")

    exc = _failed()
    text = _format.format_exception(exc, Unreadable())
    assert text.startswith("".join(traceback.format_exception(exc)))
    assert text.endswith("(monstack: the origin of this exception could not be formatted)\n")


def test_hostile_exceptions_fall_back_to_name_and_text(monkeypatch):
    def broken(*args):
        raise RuntimeError("traceback could not render it")

    class Hostile(Exception):
        def __str__(self):
            raise ValueError("no str")

    monkeypatch.setattr(_format, "_traceback_lines", broken)
    assert _format.format_traceback(KeyError("k")) == "KeyError: 'k'\n"
    assert _format.format_traceback(KeyError()) == "KeyError\n"
    assert _format.format_traceback(Hostile()) == f"{Hostile.__qualname__}: <exception str() failed>\n"
    assert _format.format_exception(Hostile()) == f"{Hostile.__qualname__}: <exception str() failed>\n"


def test_the_traceback_part_is_coloured_only_where_cpython_colours_it():
    exc = _failed()
    assert "\x1b[" not in _format.format_traceback(exc, color=False)
    coloured = _format.format_traceback(exc, color=True)
    if sys.version_info >= (3, 13):
        assert "\x1b[" in coloured
    else:  # CPython's own rendering, uncoloured (not a fallback)
        assert coloured == _format.format_traceback(exc, color=False) == "".join(traceback.format_exception(exc))
    assert "\x1b[" in _format.format_exception(exc, chain_of(0), color=True)  # our part always
