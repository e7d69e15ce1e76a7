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
    # no newline after the last line: print(snap.format()) prints no empty line
    for color in (False, True):
        assert not snap.format(color=color).endswith("\n")
    assert repr(snap).startswith("<monstack.Snapshot: ") and "in take" in repr(snap)


def test_pickle_round_trip_keeps_records(installed):
    snap = take()
    clone = pickle.loads(pickle.dumps(snap))
    assert clone == snap
    assert clone.records() == snap.records()
    assert str(clone) == str(snap)
    assert len(clone) == len(snap)


def test_portable_round_trip_keeps_records_lines_and_chain(installed):
    import json

    from conftest import chain_of

    snap = chain_of(3)
    data = snap.to_portable()
    assert json.loads(json.dumps(data)) == data  # plain JSON-safe data
    assert data["v"] == 1 and len(data["chain"]) == 4 and data["dropped"] == 0
    frame = data["chain"][0][-1]
    assert frame[:3] == [snap.records()[-1][0], snap.records()[-1][1], snap.records()[-1][2]]
    assert frame[6] == snap.source_lines()[-1] and frame[6]
    back = Snapshot.from_portable(json.loads(json.dumps(data)))
    assert back == snap and back.records() == snap.records()
    assert back.source_lines() == snap.source_lines()
    assert str(back) == str(snap)
    assert back.chain() == snap.chain() or [h.records() for h in back.chain()[0]] == [
        h.records() for h in snap.chain()[0]
    ]
    assert back.to_portable() == data  # a restored snapshot carries what it was given


def test_portable_form_carries_the_chain_limit_and_dropped_hops(installed):
    from conftest import chain_of

    monstack.uninstall()
    monstack.install(chain_limit=2)
    snap = chain_of(5)
    data = snap.to_portable()
    shown, dropped = snap.chain()
    assert len(data["chain"]) == 1 + len(shown) and data["dropped"] == dropped > 0
    back = Snapshot.from_portable(data)
    assert back.chain(limit=10)[1] == dropped + len(shown) - len(back.chain(limit=10)[0])
    assert back.chain()[1] == snap.chain()[1]


def test_pickle_carries_the_portable_form(installed):
    snap = take()
    clone = pickle.loads(pickle.dumps(snap))
    assert clone._records is not None  # restored: shows only what it carries
    assert clone.source_lines()[-1] == "    return monstack.snapshot()"  # as in the file
    assert clone.to_portable() == snap.to_portable()


def test_pickles_of_earlier_versions_still_load_without_lines():
    from monstack._snapshot import _restore

    old = _restore((("x.py", 1, "f", None, None, None),), None, 2)
    assert old.records() == (("x.py", 1, "f", None, None, None),)
    assert old.source_lines() == (None,) and old.chain() == ((), 2)


@pytest.mark.parametrize("bad", [
    None, 42, "text", [], {}, {"v": 2, "chain": [[]]}, {"v": True, "chain": [[]]},
    {"v": 1}, {"v": 1, "chain": []}, {"v": 1, "chain": "ab"}, {"v": 1, "chain": [[]], "dropped": -1},
    {"v": 1, "chain": [[]], "dropped": 1.5}, {"v": 1, "chain": [["not a frame"]]},
    {"v": 1, "chain": [[["f.py", 1, "f", None, None, None]]]},
    {"v": 1, "chain": [[["f.py", "1", "f", None, None, None, None]]]},
    {"v": 1, "chain": [[["f.py", True, "f", None, None, None, None]]]},
    {"v": 1, "chain": [[[b"f.py", 1, "f", None, None, None, None]]]},
    {"v": 1, "chain": [[["f.py", 1, None, None, None, None, None]]]},
    {"v": 1, "chain": [[["f.py", 1, "f", None, None, None, 3]]]},
    {"v": 1, "chain": [[["f.py", 10**30, "f", None, None, None, None]]]},
    {"v": 1, "chain": [[["x" * 100000, 1, "f", None, None, None, None]]]},
    {"v": 1, "chain": [[]] * 5000},
])
def test_from_portable_rejects_malformed_input_with_valueerror_only(bad):
    with pytest.raises(ValueError):
        Snapshot.from_portable(bad)


def test_from_portable_turns_hostile_objects_into_valueerror():
    class Hostile(dict):
        def get(self, *args):
            raise RuntimeError("hostile")

    class Weird(list):
        def __iter__(self):
            raise MemoryError("no")

    with pytest.raises(ValueError):
        Snapshot.from_portable(Hostile(v=1))
    with pytest.raises(ValueError):
        Snapshot.from_portable({"v": 1, "chain": Weird([[]])})


def test_from_portable_accepts_frames_without_positions_or_text():
    snap = Snapshot.from_portable({"v": 1, "chain": [[["f.py", None, "f", None, None, None, None]], []]})
    assert snap.records() == (("f.py", None, "f", None, None, None),)
    assert len(snap.chain()[0]) == 1 and len(snap.chain()[0][0]) == 0


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
