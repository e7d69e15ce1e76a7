"""``install()`` / ``uninstall()`` / ``snapshot()``: the state of monstack in this process.

One lock serialises install and uninstall; the hot paths (callbacks, ``snapshot``) read
module globals without it.
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Any, Callable, Optional, Sequence

from . import _backend, _propagate, _stack
from ._policy import Policy, make_policy
from ._snapshot import CURRENT_ORIGIN, Snapshot


class MonstackWarning(RuntimeWarning):
    """monstack hit an internal error and turned itself off; the program goes on."""


class _State:
    __slots__ = ("backend", "policy", "reason", "options")

    def __init__(self, backend: Any, policy: Policy, reason: str, options: dict) -> None:
        self.backend = backend
        self.policy = policy
        self.reason = reason
        self.options = options


_lock = threading.RLock()
_state: Optional[_State] = None
#: (tracked file names, file -> decision, TLS) of the running tracking backend, for
#: snapshot()'s fast path.
_fast: Optional[tuple] = None
#: The native whole-snapshot function (``_accel.snapshot_new``) of the running install, or
#: None: snapshot()'s first test, kept apart from ``_fast`` to save it a few bytecodes.
_native_snapshot: Optional[Callable[[], Any]] = None
_default_walk: Any = None
_failure_reported = False
#: Hooks run after a backend starts / before it stops (propagation, logging, ...).
_start_hooks: list = []
_stop_hooks: list = []


def install(
    *,
    backend: Optional[str] = None,
    track: str = "user",
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    propagate: Any = True,
    chain_limit: int = 8,
    accelerator: Optional[bool] = None,
) -> str:
    """Start keeping per-thread shadow stacks. Returns the name of the backend in use.

    ``backend``: ``"auto"`` (default, or ``MONSTACK_BACKEND``), ``"monitoring"``,
    ``"evalframe"`` or ``"walk"``. ``track``: ``"user"`` (default: not the standard
    library, site-packages or monstack) or ``"all"``. ``include``/``exclude``: module
    names or path prefixes; the longest matching rule wins.

    Idempotent: calling it again with the same options does nothing; with other options
    it reinstalls. Thread-safe.

    ``propagate``: True (default: every propagation point), False, or an iterable of
    the names in ``monstack.PROPAGATION_POINTS``. ``chain_limit``: how many origin hops
    a snapshot keeps (default 8). ``accelerator`` (``monitoring`` backend): None (default)
    uses the native callbacks where they can run unless ``MONSTACK_ACCELERATOR=0``; False
    uses the pure-Python ones; True requires the native ones (RuntimeError otherwise).
    """
    if accelerator is not None and not isinstance(accelerator, bool):
        raise ValueError(f"accelerator must be None, True or False, got {accelerator!r}")
    global _state, _failure_reported
    options = {
        "backend": backend,
        "track": track,
        "include": tuple(include) if not isinstance(include, str) else (include,),
        "exclude": tuple(exclude) if not isinstance(exclude, str) else (exclude,),
        "propagate": _propagate.check_points(propagate),
        "chain_limit": _propagate.check_chain_limit(chain_limit),
        "accelerator": accelerator,
    }
    _backend.check_choice(backend)  # ValueError before touching anything
    policy = make_policy(track, options["include"], options["exclude"])
    with _lock:
        if _state is not None:
            if _state.options == options:
                return _state.backend.name
            _uninstall_locked()
        cls, reason = _backend.choose(backend)
        _failure_reported = False  # each installation reports its own failure, once
        if cls.name == "monitoring":
            instance = cls(policy, _on_internal_error, accelerator=accelerator)
        else:
            instance = cls(policy, _on_internal_error)
        instance.start()
        _state = _State(instance, policy, reason, options)
        _set_fast()
        try:
            _propagate.start(options)
            for hook in list(_start_hooks):
                hook(_state)
        except BaseException:
            _uninstall_locked()
            raise
        return instance.name


def uninstall() -> None:
    """Stop tracking and undo everything ``install()`` changed. Idempotent, thread-safe."""
    with _lock:
        _uninstall_locked()


def disable_fast_path() -> None:
    """Make every ``snapshot()`` go through ``backend.capture()`` until the next install.

    For backends that learn the shadow stack can no longer be trusted (another tool
    replaced the eval_frame function) or that have an error to report from ``capture()``.
    """
    global _fast, _native_snapshot
    _fast = _native_snapshot = None
    state = _state
    retire = getattr(state.backend, "retire_fast", None) if state is not None else None
    if retire is not None:
        retire()


def _set_fast() -> None:
    global _fast, _native_snapshot
    state = _state
    if state is not None and state.backend.tracking:
        from . import _stack

        _native_snapshot = getattr(state.backend, "snapshot_native", None)
        _fast = (state.policy.tracked_set(), state.policy.tracked_files(), _stack.TLS)
    else:
        _fast = _native_snapshot = None


def _uninstall_locked() -> None:
    global _state, _fast, _native_snapshot
    state = _state
    if state is None:
        return
    _state = None
    _fast = _native_snapshot = None
    try:
        for hook in list(reversed(_stop_hooks)):
            try:
                hook(state)
            except Exception as exc:  # keep undoing the rest
                _warn(f"monstack: an uninstall step failed: {exc!r}")
        try:
            _propagate.stop()
        except Exception as exc:
            _warn(f"monstack: undoing propagation failed: {exc!r}")
    finally:
        state.backend.stop()


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
        from ._walk import WalkBackend

        walker = _default_walk = WalkBackend(Policy("user"))
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
        while code.co_filename not in tracked:
            if hops == _FILTERED_HOPS or by_file.get(code.co_filename) is not False:
                f = None
                break
            f = f.f_back
            if f is None:
                break
            code = f.f_code
            hops += 1
        if f is not None:
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
            _on_internal_error(exc)
        node, lasti = _walker().capture(frame)
    return _new_snapshot(node, lasti, _get_origin())


def _forget_thread_stack() -> None:
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

    With the native accelerator (CPython 3.12/3.13) it is a C function with no Python
    frame of its own, about 0.1 us cheaper per call than ``snapshot()``; otherwise it is
    ``snapshot`` itself. It belongs to the current install: after ``uninstall()`` or
    another ``install()`` it still returns correct snapshots (through ``snapshot()``),
    only without the saving -- ask again after installing.
    """
    state = _state
    fn = getattr(state.backend, "capture_native", None) if state is not None and _fast is not None else None
    return fn if fn is not None else snapshot


#: Filtered frames snapshot()'s inline path looks through (the native one: 16 too).
_FILTERED_HOPS = 16
_getframe = sys._getframe
_new_snapshot = Snapshot._new
_tuple_new = tuple.__new__
_get_origin = CURRENT_ORIGIN.get


def _warn(message: str) -> None:
    try:
        warnings.warn(MonstackWarning(message), stacklevel=2)
    except Exception:  # warnings turned into errors: still say it, never raise
        try:
            sys.stderr.write(f"MonstackWarning: {message}\n")
        except Exception:
            pass


def _on_internal_error(exc: BaseException) -> None:
    """A callback failed: say so once, then turn tracking off cleanly.

    Except a ``RecursionError``: the thread is at its recursion limit, where any Python
    call fails, monstack's included; that is no fault of monstack's. The event it missed
    may have left this thread's shadow stack wrong, so the stack is forgotten (the next
    event or snapshot rebuilds it from the real frames) and tracking stays on."""
    if isinstance(exc, RecursionError):
        _forget_thread_stack()
        return
    global _failure_reported
    try:  # off first: the warnings machinery runs Python code that would fail again
        uninstall()
    except Exception:
        pass
    if not _failure_reported:
        _failure_reported = True
        _warn(f"monstack: internal error in tracking ({type(exc).__name__}: {exc}); tracking turned off")
