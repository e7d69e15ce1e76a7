"""The ``threading`` and ``start_new_thread`` points (see ``monstack._propagate``).

``start_new_thread``'s patch is applied at ``install()`` (``_thread`` is always imported) by
``monstack._points.apply_start_new_thread``, which loads this module (and
``monstack._origin``) with the first thread started that way; ``threading``'s patch loads
both when applied (the formatting loads with the first note). Nothing here imports
``threading``: a program that must run before it is imported (gevent's monkey-patching)
still can under MONSTACK=1.
"""

from __future__ import annotations

import sys

from .. import _env
from . import ON, binder, drop_own_entry, patch, take

TYPE_CHECKING = False
if TYPE_CHECKING:
    import threading
    from typing import Any, Callable, Optional

    from .._origin import attach_if_absent, opaque, has_origin

#: Targets that run many jobs (pool and manager processes, trio's cached worker threads):
#: no single origin is theirs.
INTERNAL_TARGET_MODULES = ("multiprocessing.", "concurrent.futures.", "trio._core._thread_cache")

# What the replacements use from ``_origin``: bound by _load_origin().
_ThreadStart: Any = None
_ThreadRun: Any = None
_METHOD_TYPE: Any = None
# drop_own_entry: _points' until _origin is loaded, then _origin's (the same code)


def _load_origin() -> None:
    """Bind what the replacements here use from ``_origin`` (once)."""
    global attach_if_absent, drop_own_entry, opaque, has_origin, _ThreadStart, _ThreadRun, _METHOD_TYPE
    if _ThreadStart is not None:
        return
    from .. import _origin

    attach_if_absent, drop_own_entry = _origin.attach_if_absent, _origin.drop_own_entry
    opaque, has_origin = _origin.opaque, _origin.has_origin
    _METHOD_TYPE = _origin._METHOD_TYPE
    _ThreadRun = _define_thread_run(_origin.WithOrigin)
    _ThreadStart = _define_thread_start(_origin.WithOrigin)


# -- threading.Thread.start ------------------------------------------------------------------


def apply_thread_start() -> None:
    _load_origin()

    def make(original: Callable[..., None]) -> Callable[..., None]:
        call = binder(original)  # calls it as Python would: through __get__

        def start(self: threading.Thread) -> None:
            try:
                if "threading" not in ON:
                    return call(self)
                bound = _bind_thread(self)
                try:
                    return call(self)
                except BaseException:
                    if bound:
                        _unbind_thread(self, bound)
                    raise
            except BaseException as exc:  # (the traceback a direct call gives)
                drop_own_entry(exc, sys._getframe())
                raise

        return start

    # (inherited: under gevent's monkey.patch_all(), threading.Thread is gevent's subclass)
    patch(sys.modules["threading"].Thread, "start", make, inherited=True)


def _bind_thread(thread: threading.Thread) -> Optional[tuple]:
    """Give ``thread`` an instance-level ``run`` that runs the real one with an origin.

    Not for the threads of pools (a ThreadPoolExecutor's workers, a multiprocessing
    ThreadPool's workers and the handler threads of its pools): they run many jobs, each
    with its own origin, and whichever call happened to start one is no origin of the
    others.
    """
    try:
        target = getattr(thread, "_target", None)
        pool_mod = sys.modules.get("concurrent.futures.thread")
        if pool_mod is not None and target is getattr(pool_mod, "_worker", None):
            return None
        if target is not None and str(getattr(target, "__module__", "") or "").startswith(INTERNAL_TARGET_MODULES):
            return None
        snap = take()
        if snap is None:
            return None
        had = "run" in thread.__dict__
        previous = thread.__dict__.get("run")
        wrapper = _ThreadRun(thread.run, snap, thread)
        # A bound method, as ``thread.run`` is without us: tools that call
        # ``thread.run.__func__(thread)`` (Sentry's threading integration) run ours too.
        method = _METHOD_TYPE(wrapper, thread)
        bound = (method, had, previous)
        wrapper._bound = bound
        thread.run = method  # type: ignore[method-assign]
        return bound
    except Exception:
        return None


def _unbind_thread(thread: threading.Thread, bound: tuple) -> None:
    """Remove our instance ``run`` (restoring one the user set) so nothing is kept alive."""
    wrapper, had, previous = bound
    try:
        if thread.__dict__.get("run") is wrapper:
            if had:
                thread.__dict__["run"] = previous
            else:
                del thread.__dict__["run"]
    except Exception:
        pass


def _define_thread_run(base: Any) -> Any:
    """The class of a thread's instance-level ``run`` (defined once ``_origin`` is loaded)."""

    class ThreadRun(base):
        # The thread's ``run`` (bound, as it was at ``start()``) run with the starter's
        # snapshot as its origin; afterwards it takes itself off the thread.

        __doc__ = base.__dict__["__doc__"]  # (the property: answers as the run() it stands for)

        __slots__ = ("_thread", "_bound")

        def __init__(self, run: Any, snap: Any, thread: Any) -> None:
            base.__init__(self, run, snap)
            self._thread = thread
            self._bound: Any = None

        def __call__(self, _owner: Any = None, /) -> None:  # type: ignore[override]
            # (called as a method of the thread: ``_owner`` is it; the run it calls is bound)
            try:
                base.__call__(self)
            except BaseException as exc:
                drop_own_entry(exc, sys._getframe())
                raise
            finally:
                thread, bound = self._thread, self._bound
                self._thread = self._bound = None
                if bound is not None:
                    _unbind_thread(thread, bound)

    ThreadRun.__name__ = ThreadRun.__qualname__ = "_ThreadRun"
    return ThreadRun


# -- _thread.start_new_thread --------------------------------------------------------------------


def start_new_thread_for(original: Callable[..., Any]) -> Callable[..., Any]:
    """What ``_thread.start_new_thread``'s replacement (``monstack._points.apply_start_new_thread``,
    applied at ``install()``) calls once a thread is started while the point is on:
    ``original`` with the starter's snapshot as the new thread's origin. ``_origin`` loads
    now (at interpreter shutdown that import fails: the thread then meets CPython's own
    error, without an origin)."""

    def start_new_thread(function: Any, args: Any, *kwargs: Any) -> Any:
        try:
            if (_threading_bootstrap(function) or not _origin_loaded() or has_origin(function)
                    or opaque(function)):
                return original(function, args, *kwargs)
            snap = take()
            if snap is None:
                return original(function, args, *kwargs)
            return original(_ThreadStart(function, snap), args, *kwargs)
        except BaseException as exc:  # (the traceback a direct call gives)
            drop_own_entry(exc, sys._getframe())
            raise

    return start_new_thread


def _origin_loaded() -> bool:
    """:func:`_load_origin`, False where it fails (at interpreter shutdown imports do)."""
    if _ThreadStart is None:
        try:
            _load_origin()
        except Exception:
            return False
    return True


def _threading_bootstrap(function: Any) -> bool:
    """``Thread.start`` on 3.11/3.12 (``threading._start_new_thread``, which is ours when
    threading was imported after install()): the ``threading`` point's business."""
    threading_mod = sys.modules.get("threading")
    return threading_mod is not None and isinstance(getattr(function, "__self__", None), threading_mod.Thread)


def _define_thread_start(base: Any) -> Any:
    """The ``start_new_thread`` wrapper class (defined once ``_origin`` is loaded)."""

    class ThreadStart(base):
        """A ``start_new_thread`` function with an origin. The thread machinery hands it to
        ``sys.unraisablehook`` as the failed object, so its repr is the function's."""

        __slots__ = ()

        def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
            try:
                return base.__call__(self, *args, **kwargs)
            except Exception as exc:
                drop_own_entry(exc, sys._getframe())
                if _report_unraisable(exc, self):
                    return None
                raise
            except BaseException as exc:
                drop_own_entry(exc, sys._getframe())
                raise

        def __repr__(self) -> str:
            try:
                return repr(self.__wrapped__)
            except Exception:
                return base.__repr__(self)

    ThreadStart.__name__ = ThreadStart.__qualname__ = "_ThreadStart"
    return ThreadStart


def _report_unraisable(exc: BaseException, function: Any) -> bool:
    """Where ``sys.unraisablehook`` is the default one, print its report ourselves, with
    the origin where it prints notes. True if printed; any other hook (yours, pytest's)
    gets the exception as usual (``monstack.origin_of`` knows its origin). Imports nothing
    (``_origin`` was loaded when the point was applied)."""
    _origin = sys.modules.get("monstack._origin")
    if _origin is None or sys.unraisablehook is not sys.__unraisablehook__ or _origin.stored_origin(exc) is None:
        return False
        return False
    try:
        if _env.FORMAT_UNRAISABLE:
            head = f"Exception ignored in thread started by {function!r}:\n"
        else:
            head = f"Exception ignored in thread started by: {function!r}\n"
        text = head + "".join(_origin._fmt()._traceback_lines(exc, False, True, _origin.stored_origin, top=True))
        stderr = sys.stderr
        if stderr is None:
            return True
        stderr.write(text)
        stderr.flush()
        return True
    except Exception:
        return False
