"""Every thread's stack and the origin of the work it runs: ``monstack.threads()``.

A thread's shadow stack lives in its own ``_stack.TLS`` dict and its current origin in a
context variable, both invisible from other threads; ``_stack.REGISTRY`` (each thread's
TLS dict, registered when the thread first uses it) and ``_snapshot.RUNNING`` (each
thread's cell, set by the wrappers that run work with an origin) make them readable.
Reading never writes to another thread's state and takes no lock: a thread's cell is read
with one list read, and what it disagrees with is answered from the real frames instead.
"""

from __future__ import annotations

import _thread
import sys
from _weakref import ref as _weakref

TYPE_CHECKING = False
if TYPE_CHECKING:  # (nothing here imports typing: _propagate imports this at start-up)
    from types import FrameType
    from typing import Any, Optional

from . import _capture, _stack
from ._policy import Policy
from ._snapshot import CURRENT_ORIGIN, Snapshot, running_origin

_UNKNOWN = _stack.UNKNOWN

#: Event loops the ``asyncio_tasks`` point saw create tasks (id -> weak reference), for
#: dumps: on 3.14+ tasks live in per-thread native lists reached only through their loop,
#: and a loop whose ``run_forever`` has no Python frame (uvloop) is found only here.
LOOPS: dict[int, Any] = {}


def note_loop(loop: Any) -> None:
    """Remember ``loop`` weakly (one dict lookup when already known)."""
    key = id(loop)
    if key in LOOPS:
        return

    def forget(_ref: Any, key: int = key) -> None:
        LOOPS.pop(key, None)

    try:
        LOOPS[key] = _weakref(loop, forget)
    except TypeError:
        pass


def _copy(d: dict) -> dict:
    """A copy of a dict other threads write to (a size change during the copy: again)."""
    for _ in range(100):
        try:
            return dict(d)
        except RuntimeError:
            continue
    return {}


def _active_threads() -> dict:
    """``threading._active`` (ident -> Thread), copied without its lock; {} when threading
    was never imported (nothing is imported here)."""
    threading = sys.modules.get("threading")
    active = getattr(threading, "_active", None)
    return _copy(active) if isinstance(active, dict) else {}


def top_of(entry: Optional[tuple], frame: Optional[FrameType], policy: Policy, owner: Any) -> tuple:
    """``(node, lasti)`` of a thread whose innermost frame is ``frame``: from its
    registered cell when that agrees with the frames (O(1) with call sites known at push;
    unknown ones are filled from the frames, without writing them back), else built from
    the frames (O(depth): the ``walk`` backend, a thread not seeded yet)."""
    f = _stack.first_tracked(frame, policy)
    if f is None:
        return None, _UNKNOWN
    if entry is not None:
        ldict, owner_ref = entry
        # an ident reused by a thread that has not used TLS yet: its entry is a dead one's
        if owner_ref is None or owner_ref() is owner:
            cell = ldict.get("cell")
            if type(cell) is list and cell:
                top = cell[0]
                if top is not None and top[0] is f.f_code:
                    if top[2] != _UNKNOWN:
                        return top, f.f_lasti
                    hit = _FILLED.get(id(top))  # (see _stack.FILLED)
                    if hit is not None and hit[0] is top:
                        return hit[1], f.f_lasti
                    filled = _stack._fill(top, f, policy)
                    if filled is not None and filled is not _stack.LINKED:
                        _remember(top, filled)
                        return filled, f.f_lasti
    return _stack.build(f, policy)


def _remember(top: Any, filled: Any) -> None:
    if len(_FILLED) >= _stack.FILLED_CACHE_SIZE:
        try:
            del _FILLED[next(iter(_FILLED))]
        except (StopIteration, KeyError, RuntimeError):
            pass
    _FILLED[id(top)] = (top, filled)


_FILLED = _stack.FILLED


def threads() -> dict[int, Snapshot]:
    """Every live thread's stack, keyed by thread ident, as ``snapshot()`` would give it
    in that thread: the tracked frames, the innermost at its current line, linked to the
    origin of the work the thread runs now (the line that started the thread or submitted
    the pool job it is running, with its chain).

    O(1) per thread with the native callbacks and the 3.11 shim (plus the library frames
    above the thread's innermost tracked one); the pure-Python callbacks' unknown call
    sites are filled from the frames; the ``walk`` backend (and no install, as
    ``snapshot()``) builds each stack from the frames. Never raises for a thread: one that
    cannot be read gets an empty snapshot.
    """
    frames = sys._current_frames()
    me = _thread.get_ident()
    state = _capture.running()
    policy = _capture.current_policy()
    tracking = state is not None and state.backend.tracking
    registry = _stack.registered(frames) if tracking else {}
    active = _active_threads()
    out: dict[int, Snapshot] = {}
    for ident, frame in frames.items():
        try:
            node, lasti = top_of(registry.get(ident), frame, policy, active.get(ident))
            origin = CURRENT_ORIGIN.get() if ident == me else running_origin(ident)
            out[ident] = Snapshot._new(node, lasti, origin)
        except Exception:
            out[ident] = Snapshot._new(None, _UNKNOWN, None)
    del frames
    return out
