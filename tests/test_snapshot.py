"""Snapshots: O(1) handles read lazily (their layout: test_format.py; colour: test_colorize.py)."""

from __future__ import annotations

import pickle
import sys
import traceback

import pytest
from conftest import tracking
from stackcheck import shadow_records

import monstack
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


def test_snapshot_works_in_every_thread_and_without_tracked_frames():
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(monstack.snapshot()))
    t.start()
    t.join()
    assert len(out[0]) >= 1  # the lambda (defined here) is tracked
    assert sys._getframe().f_code.co_name == "test_snapshot_works_in_every_thread_and_without_tracked_frames"
