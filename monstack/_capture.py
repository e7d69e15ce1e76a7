"""The running install's state and ``snapshot()``: "where am I now", O(1) when tracking.

``_install`` sets the state (``set_state``); everything that captures reads it here
(``_origin``, ``_propagate``, the faces). The hot paths read module globals without a lock.
"""

from __future__ import annotations

import sys

from . import _stack
from ._backend import Host
from ._policy import Policy
from ._snapshot import CURRENT_ORIGIN, Snapshot

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional

    from ._backend import Backend


class State:
    """One installation: its backend, policy, why that backend, the options it was
    installed with, and where its internal errors go.

    (A plain class: a NamedTuple's ``__new__`` is compiled from a ``<string>`` file that
    the tracking policy counts as user code, so building one right after the backend
    started would push a frame.)"""

    __slots__ = ("backend", "policy", "reason", "options", "on_error")

    def __init__(
        self, backend: "Backend", policy: Policy, reason: str, options: dict, on_error: Callable[[BaseException], None]
    ) -> None:
        self.backend = backend
        self.policy = policy
        self.reason = reason
        self.options = options
        self.on_error = on_error


_state: Optional[State] = None
#: (tracked file names, file -> decision, TLS) of the running tracking backend, for
#: snapshot()'s fast path.
_fast: Optional[tuple] = None
#: The native whole-snapshot function (``_accel.snapshot_new``) of the running install, or
#: None: snapshot()'s first test, kept apart from ``_fast`` to save it a few bytecodes.
_native_snapshot: Optional[Callable[[], Any]] = None
_default_walk: Any = None


def running() -> Optional[State]:
    """The running install, or None."""
    return _state


def set_state(new: Optional[State]) -> None:
    """Make ``new`` the running install (None: none), fast paths included."""
    global _state
    _state = new
    set_fast()


def disable_fast_path() -> None:
    """Make every ``snapshot()`` go through ``backend.capture()`` until the next install.

    For backends that learn the shadow stack can no longer be trusted (another tool
    replaced the eval_frame function) or that have an error to report from ``capture()``.
    """
    global _fast, _native_snapshot
    _fast = _native_snapshot = None
    state = _state
    if state is not None:
        state.backend.retire_fast()


def set_fast() -> None:
    """Point snapshot()'s fast paths at the running install (None: no fast path)."""
    global _fast, _native_snapshot
    state = _state
    if state is not None and state.backend.tracking:
        _native_snapshot = state.backend.snapshot_native
        _fast = (state.policy.tracked_set(), state.policy.tracked_files(), _stack.TLS)
    else:
        _fast = _native_snapshot = None


def active_backend() -> Optional[str]:
    """``"monitoring"``, ``"evalframe"``, ``"walk"``, or None when not installed."""
    state = _state
    return state.backend.name if state is not None else None


def current_policy() -> Policy:
    state = _state
    if state is not None:
        return state.policy
    return _walker().policy


def status() -> dict[str, Any]:
    """What ``python -m monstack info`` prints: backend, reason, policy, backend details."""
    state = _state
    if state is None:
        return {"backend": None}
    out: dict[str, Any] = {
        "backend": state.backend.name,
        "reason": state.reason,
        "policy": state.policy.describe(),
    }
    out.update(state.backend.describe())
    return out


def _walker() -> Any:
    global _default_walk
    walker = _default_walk
    if walker is None:
        from ._walk import WalkBackend  # (here: start-up with a tracking backend never needs it)

        walker = _default_walk = WalkBackend(Policy("user"), _WALK_HOST)
    return walker


def snapshot() -> Snapshot:
    """Where the calling thread is now: O(1) with a tracking backend, never raises.

    Without ``install()`` it walks the real frames (the ``walk`` backend, default policy).
    """
    native = _native_snapshot
    if native is not None:  # reads *this* function's caller; None: the paths below
        snap = native()
        if snap is not None:
            return snap
    try:
        frame = _getframe(1)  # after the native path: materialising a frame object costs
    except ValueError:  # called straight from C with no Python frame (a bare _thread start)
        frame = None
    fast = _fast
    if fast is not None and frame is not None:  # inline fast path of _stack.make_capture
        tracked, by_file, tls = fast
        f: Any = frame
        code = f.f_code
        hops = 0
        # A framework taking the snapshot for its user: look through frames of files
        # already decided filtered, as the native path does; anything else: capture().
        filtered_only = False
        while code.co_filename not in tracked:
            if by_file.get(code.co_filename) is not False:
                f = None
                break
            if hops == _FILTERED_HOPS:
                f = None
                filtered_only = True
                break
            f = f.f_back
            if f is None:
                filtered_only = True
                break
            code = f.f_code
            hops += 1
        if filtered_only:
            # Only filtered code on the stack (the user's code excluded by the policy, a
            # framework's thread), or as far as the look goes: when the thread's shadow
            # stack is empty too, that is the empty snapshot capture() would build after
            # walking every frame (the same trust as the fast path's: the shadow stack is
            # right below the frames it checks).
            try:
                empty = tls.cell[0] is None
            except AttributeError:
                empty = False
            if empty:
                return _new_snapshot(None, _UNKNOWN, _get_origin())
        elif f is not None:
            try:
                top = tls.cell[0]
            except AttributeError:
                top = None
            if top is not None and top[0] is code and top[2] != -1:
                origin = _get_origin()
                if origin is None:  # Snapshot._new inlined for the common case
                    return _tuple_new(Snapshot, (top, f.f_lasti, None, None, 0))
                return _new_snapshot(top, f.f_lasti, origin)
    state = _state
    backend = state.backend if state is not None else _walker()
    try:
        try:
            node, lasti = backend.capture(frame)
        except RecursionError:
            # The caller is near the recursion limit (no fault of ours): again, from a
            # fresh stack, with room for monstack's own few calls (the limit is raised
            # for the capture and put back; inline: a helper's call may not fit).
            try:
                del _stack.TLS.cell
            except AttributeError:
                pass
            _stack.STATS["recursion"] += 1
            limit = sys.getrecursionlimit()
            sys.setrecursionlimit(limit + 200)
            try:
                node, lasti = backend.capture(frame)
            finally:
                sys.setrecursionlimit(limit)
    except Exception as exc:
        if state is not None:
            state.on_error(exc)
        node, lasti = _walker().capture(frame)
    return _new_snapshot(node, lasti, _get_origin())


def forget_thread_stack() -> None:
    """After a RecursionError inside monstack: drop this thread's shadow stack (no
    Python calls: the thread may still be at its limit)."""
    try:
        del _stack.TLS.cell
    except Exception:
        pass
    _stack.STATS["recursion"] += 1


def snapshotter() -> Callable[[], Snapshot]:
    """A function equivalent to ``snapshot()``, for code that captures very often (a
    framework taking a snapshot per op): bind it once, call it per op.

    With the native accelerator (CPython 3.12-3.15) it is a C function with no Python
    frame of its own, about 0.1 us cheaper per call than ``snapshot()``; otherwise it is
    ``snapshot`` itself. It belongs to the current install: after ``uninstall()`` or
    another ``install()`` it still returns correct snapshots (through ``snapshot()``),
    only without the saving -- ask again after installing.
    """
    state = _state
    fn = state.backend.capture_native if state is not None and _fast is not None else None
    return fn if fn is not None else snapshot


#: Filtered frames snapshot()'s inline path looks through (the native one: 16 too).
_FILTERED_HOPS = 16
_UNKNOWN = _stack.UNKNOWN
_getframe = sys._getframe
_new_snapshot = Snapshot._new
_tuple_new = tuple.__new__
_get_origin = CURRENT_ORIGIN.get


def _ignore_error(exc: BaseException) -> None:
    pass


def _no_distrust() -> None:
    pass


#: The host of the walk backend that answers snapshots before any install (it has no
#: fast path to distrust and no error to report: snapshot() falls back to it).
_WALK_HOST = Host(_ignore_error, _no_distrust, snapshot)
