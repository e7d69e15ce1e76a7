"""The ``thread_pool`` and ``process_pool`` points: ``concurrent.futures`` executors'
``submit`` (see ``monstack._propagate``)."""

from __future__ import annotations

import sys

from . import ON, capture_snapshot, binder, drop_own_entry, patch, take

from .. import _capture
from .._origin import (CO_KINDS, FUNCTION_TYPE, WithOrigin, attach_if_absent, carry, forget_reused, has_origin,
                       native_carrier, native_vectorcall)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable


def _make_submit(point: str) -> Callable[[Any], Any]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        call = binder(original)  # calls it as Python would: through __get__
        on = ON
        # [capture, carrier constructor, the native submit's holder]: where the install
        # runs native code the native submit (_native_submit) reads the last from this cell
        fast = [*_fast, None]
        fast_class = _FAST_CLASSES.get(point)

        def submit(self: Any, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            try:
                if point not in on:
                    return call(self, fn, *args, **kwargs)
                if type(fn) is FUNCTION_TYPE and type(self) is fast_class and not fn.__code__.co_flags & CO_KINDS:
                    # The common case, kept short (it runs per job): a plain function
                    # submitted to the pool class itself (no subclass: not an interpreter
                    # pool) gets what carry() would give it, without the general checks.
                    # (Where the install runs native code, ms_submit does this in C: this
                    # code then runs only for what it leaves, see _native_submit.)
                    attrs = fn.__dict__
                    if not attrs or (attrs.get("_is_coroutine_marker") is None and attrs.get("_is_coroutine") is None):
                        capture, new, _ = fast
                        try:
                            snap = capture()
                        except Exception:
                            return call(self, fn, *args, **kwargs)
                        if new is not None:  # the native carrier: its __call__ is C
                            return call(self, new(fn, snap), *args, **kwargs)
                        carried = _new_with_origin(WithOrigin)
                        carried.__wrapped__ = fn
                        carried._snap = snap
                        carried._sent = None
                        return call(self, carried, *args, **kwargs)
                if has_origin(fn):
                    return call(self, fn, *args, **kwargs)
                taken = take()
                if taken is None:
                    return call(self, fn, *args, **kwargs)
                snap = taken
                if crosses_interpreters(self):
                    # 3.14+: the callable must be shareable with another interpreter as the
                    # user gave it (a wrapper is not): it runs unwrapped, and the exception
                    # it raised gets the origin in this interpreter, when the future fails.
                    future = call(self, fn, *args, **kwargs)
                    _attach_when_done(future, snap)
                    return future
                carried = carry(fn, snap)
                future = call(self, carried, *args, **kwargs)
                if point == "process_pool" or carried is fn:  # fn unwrapped: a coroutine function...
                    _attach_when_done(future, snap)
                return future
            except BaseException as exc:  # (the traceback a direct call gives)
                drop_own_entry(exc, _getframe())
                raise

        if point == "thread_pool":
            _native_submit(submit, call)
        return submit

    return make


def _native_submit(submit: Callable[..., Any], call: Callable[..., Any]) -> bool:
    """Where the install runs native code: ``submit``'s calls run ``ms_submit``
    (``native/carrier.h``: its short path in C, with no Python call per job; the rest by
    evaluating ``submit``'s code) instead of its code (its vectorcall)."""
    capture, new = _fast
    backend = getattr(_capture.running(), "backend", None)
    pool_class = _FAST_CLASSES.get("thread_pool")
    if new is None or pool_class is None or capture is not getattr(backend, "capture_native", None):
        return False
    items = (call, capture, ON, sys.intern("thread_pool"), pool_class, FUNCTION_TYPE, dict,
             sys.intern("_is_coroutine_marker"), sys.intern("_is_coroutine"))
    return native_vectorcall(getattr(backend, "native_blob", None), "ms_submit", submit, "fast", items)


#: The pool class whose plain-function jobs take the short path, per point (set when the
#: point is applied; a process pool's jobs always take the general one).
_FAST_CLASSES: dict = {}
_new_with_origin = object.__new__
#: The short path's [capture, carrier constructor], set when the thread pool point is
#: applied, from the install's native code: its ``snapshotter()`` function (a snapshot
#: of its caller, as ``snapshot()`` takes it, with no Python frame) and the native
#: carrier's constructor (``_origin.native_carrier``); ``snapshot`` and None without
#: native code (pure-Python callbacks, the walk backend).
_fast: list = [capture_snapshot, None]
_getframe = sys._getframe


def crosses_interpreters(executor: Any) -> bool:
    """An ``InterpreterPoolExecutor`` (3.14+; a ThreadPoolExecutor subclass)?"""
    module = sys.modules.get("concurrent.futures.interpreter")
    cls = getattr(module, "InterpreterPoolExecutor", None) if module is not None else None
    return cls is not None and isinstance(executor, cls)


def _attach_when_done(future: Any, snap: Any) -> None:
    """Parent side of a process or interpreter pool: attach the origin to the exception
    the future fails with, if it does not carry it yet.

    A process pool's child normally attaches it before the exception is pickled back;
    this catches exceptions whose pickling drops attributes, and an interpreter pool's
    work, which runs unwrapped. While the future is pending its ``set_exception`` is an
    instance attribute that attaches first, so a caller woken by ``result()`` already sees
    the origin; a done callback covers a worker that looked the method up just before
    (it attaches a moment after the wake-up) and removes the instance attribute.
    """
    set_exception = future.set_exception

    def attach_then_set(exception: BaseException) -> None:
        try:
            if isinstance(exception, Exception):
                attach_if_absent(exception, snap)
        except Exception:
            pass
        set_exception(exception)

    def done(fut: Any) -> None:
        try:
            fut.__dict__.pop("set_exception", None)  # also breaks fut -> closure -> fut
            if not fut.cancelled():
                exc = fut._exception  # not .exception(): never wait, never mark anything
                if isinstance(exc, Exception):
                    attach_if_absent(exc, snap)
        except Exception:
            pass

    try:
        future.set_exception = attach_then_set
        future.add_done_callback(done)
    except Exception:
        pass


# Each class is patched in the module that defines it (its trigger in _APPLY), never
# through ``concurrent.futures``: on 3.15 that package's names are lazy imports (PEP 810)
# that cannot be resolved while the defining module's own import finishes.
def apply_thread_pool() -> None:
    import concurrent.futures.thread as cf_thread

    _FAST_CLASSES["thread_pool"] = cf_thread.ThreadPoolExecutor
    backend = getattr(_capture.running(), "backend", None)
    new = native_carrier(getattr(backend, "native_blob", None))
    _fast[:] = [getattr(backend, "capture_native", None) or capture_snapshot, new]
    patch(cf_thread.ThreadPoolExecutor, "submit", _make_submit("thread_pool"))


def stop() -> None:
    """The points are undone: the native submit's kept carrier (and its job's function)
    is let go of."""
    forget_reused()


def apply_process_pool() -> None:
    import concurrent.futures.process as cf_process

    patch(cf_process.ProcessPoolExecutor, "submit", _make_submit("process_pool"))
