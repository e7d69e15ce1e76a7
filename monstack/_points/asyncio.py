"""The ``asyncio_tasks`` and ``asyncio_executor`` points: the event loop's
``create_task`` and ``run_in_executor``, asyncio's and uvloop's (see
``monstack._propagate``)."""

from __future__ import annotations

import gc
import sys
import types
import weakref
from _contextvars import Context

from . import ON, capture_snapshot, binder, drop_own_entry, patch, take
from .. import _capture, _threads
from .._backend import COROUTINE_EXIT, EXITS_REPORTED
from .._origin import attach_if_absent, carry, has_origin, native_vectorcall
from .._snapshot import CURRENT_ORIGIN
from .futures import crosses_interpreters

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable

_LOOPS = _threads.LOOPS
_note_loop = _threads.note_loop


def _make_create_task(original: Callable[..., Any]) -> Callable[..., Any]:
    call = binder(original)  # calls it as Python would: through __get__
    on, loops, note_loop = ON, _LOOPS, _note_loop
    # [capture, the native create_task's holder]: where the install runs native code the
    # native create_task (_native_create_task) reads the last from this cell
    _native: list = [capture_snapshot, None]
    set_origin, reset_origin = CURRENT_ORIGIN.set, CURRENT_ORIGIN.reset
    exits, coroutine_type = EXITS_REPORTED, types.CoroutineType

    # The hot path of every task where no native code runs (where it runs, the native
    # create_task does the same in C, or passes the task a context it made that carries
    # the origin, and evaluates this code off its common path: docs/native.md): no
    # helper calls beyond the snapshot and the context variable's set/reset around the
    # creation (the task copies the current context); everything else is bound here,
    # once. Where the backend reports coroutine exits, a failed task's exception gets its
    # origin from _task_exit (the failure path only); elsewhere, and for a task that runs
    # no Python coroutine, from a done callback.
    def create_task(self: Any, coro: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            if "asyncio_tasks" not in on:
                return call(self, coro, *args, **kwargs)
            if id(self) not in loops:
                note_loop(self)
            if kwargs and kwargs.get("context") is not None:
                return _create_task_in_context(call, self, coro, args, kwargs)
            try:
                snap = _native[0]()
            except Exception:
                return call(self, coro, *args, **kwargs)
            token = set_origin(snap)
            try:
                task = call(self, coro, *args, **kwargs)
            finally:
                reset_origin(token)
            try:
                if task.done():
                    # An eager task (eager_task_factory, 3.12+) that finished inside
                    # create_task: a done callback would only be scheduled, and the
                    # creator may await the task before it runs.
                    _task_done(snap, task)
                elif not exits[0] or type(coro) is not coroutine_type:
                    task.add_done_callback(_TaskDone(snap))
            except Exception:
                pass
            return task
        except BaseException as exc:  # (the traceback a direct call gives)
            drop_own_entry(exc, _getframe())
            tb = exc.__traceback__
            if tb is not None and tb.tb_frame.f_code is _IN_CONTEXT_CODE:
                exc.__traceback__ = tb.tb_next
            raise

    _native_create_task(create_task, call)
    return create_task


def _native_create_task(create_task: Callable[..., Any], call: Callable[..., Any]) -> bool:
    """Where the install runs native code: ``create_task``'s calls run ``ms_create_task``
    (``native/carrier.h``: its common path in C, with no Python call per task; the rest by
    evaluating ``create_task``'s code) instead of its code (its vectorcall)."""
    backend = getattr(_capture.running(), "backend", None)
    capture = getattr(backend, "capture_native", None)
    if capture is None:
        return False
    import asyncio.tasks

    blob = getattr(backend, "native_blob", None)
    name, context = sys.intern("name"), sys.intern("context")
    items = (call, capture, _after_create, EXITS_REPORTED, types.CoroutineType, _LOOPS, _note_loop,
             ON, sys.intern("asyncio_tasks"), name, context, sys.intern("done"), True,
             _is_asyncios(call) and _contexts_laid_out(blob), sys.intern("_task_factory"), (context,), (name, context),
             vars(asyncio.tasks), sys.intern("Task"), getattr(asyncio.tasks, "_CTask", None), getattr(asyncio.tasks, "_PyTask", None))
    return native_vectorcall(blob, "ms_create_task", create_task, "_native", items)


def _is_asyncios(original: Any) -> bool:
    """``original`` is asyncio's own ``BaseEventLoop.create_task`` (not a wrapper another
    library put there first): the one the native create_task may pass ``context=`` to."""
    import asyncio.base_events

    code = getattr(original, "__code__", None)
    return (type(original) is types.FunctionType and code is not None
            and getattr(original, "__globals__", None) is vars(asyncio.base_events)
            and code.co_name == "create_task")


def _contexts_laid_out(blob: Any) -> bool:
    """The blob makes tasks' contexts (``native/carrier.h``, "The task's context") and
    reads a Context's variables where this interpreter keeps them: the word at the offset
    it was compiled with is the object the collector finds a new Context referring to."""
    try:
        from .. import _cdata as C

        off = C.c_int64.from_address(blob.addr("ms_task_context_layout")).value
        ctx = Context()
        refs = gc.get_referents(ctx)
        return len(refs) == 1 and C.c_void_p.from_address(id(ctx) + off).value == id(refs[0])
    except Exception:
        return False


def _after_create(snap: Any, task: Any, coro: Any) -> None:
    """The native create_task's tail off its common path: what ``create_task`` does after
    the task is made (an eager task done already; a done callback where the failure is
    not reported as a coroutine exit)."""
    try:
        if task.done():
            _task_done(snap, task)
        elif not EXITS_REPORTED[0] or type(coro) is not types.CoroutineType:
            task.add_done_callback(_TaskDone(snap))
    except Exception:
        pass


def _create_task_in_context(call: Callable[..., Any], loop: Any, coro: Any, args: tuple, kwargs: dict) -> Any:
    """A task with an explicit context runs in that very Context object, which must not
    gain our variable (the caller may share it or read it afterwards), so code inside
    the task does not see the origin; its failure still gets it, from a done callback.
    asyncio.run's (a Runner's) main task is left alone: its exception comes straight
    out of asyncio.run(), under the line that called it."""
    try:
        if sys._getframe(2).f_globals.get("__name__") == "asyncio.runners":
            return call(loop, coro, *args, **kwargs)
    except Exception:
        pass
    snap = take()
    task = call(loop, coro, *args, **kwargs)
    if snap is not None:
        _when_task_done(task, snap)
        try:
            _IN_CONTEXT.add(task)  # (its context may hold another origin: _task_exit skips it)
        except Exception:
            pass
    return task


_IN_CONTEXT_CODE = _create_task_in_context.__code__
#: Tasks created with an explicit ``context=``: their done callback attaches the origin.
_IN_CONTEXT: weakref.WeakSet = weakref.WeakSet()


def _when_task_done(task: Any, snap: Any) -> None:
    try:
        if task.done():
            _task_done(snap, task)  # an eager task that finished inside create_task
        else:
            task.add_done_callback(_TaskDone(snap))
    except Exception:
        pass


class _TaskDone:
    """The done callback of a task: ``_task_done(snap, task)``."""

    __slots__ = ("_snap",)

    def __init__(self, snap: Any) -> None:
        self._snap = snap

    def __call__(self, task: Any) -> None:
        # (_task_done inlined: this runs once per task)
        try:
            if task.cancelled():
                return
            exc = task._exception
            if isinstance(exc, Exception):
                attach_if_absent(exc, self._snap)
        except Exception:
            pass


# monstack._dump finds a task's origin by this class's name and module (the module it
# had before the points became a package).
_TaskDone.__module__ = "monstack._points"


def _task_exit(code: Any, exc: BaseException) -> None:
    """``COROUTINE_EXIT``'s handler: an exception leaves a coroutine frame that nothing
    awaits. When that frame is the current task's own coroutine, the task is failing with
    ``exc``: attach the origin its creation set in the task's context (the current one),
    before anything awaiting the task sees the exception and before "Task exception was
    never retrieved" can be logged -- what ``_task_done`` does from a done callback, with
    no callback per task. ``StopIteration`` becomes the task's ``RuntimeError`` after this
    frame (PEP 479): that one still gets a done callback. Never raises."""
    try:
        try:
            task = _current_task[0]()
        except RuntimeError:  # no running loop: a coroutine driven by hand
            return
        if task is None or task.get_coro().cr_code is not code or task in _IN_CONTEXT:
            return
        snap = _get_origin(None)
        if snap is None:
            return
        if isinstance(exc, StopIteration):
            task.add_done_callback(_TaskDone(snap))
        else:
            attach_if_absent(exc, snap)
    except Exception:
        pass


_get_origin = CURRENT_ORIGIN.get
_getframe = sys._getframe
#: asyncio.current_task, bound when the point is applied
_current_task: list = [None]


def apply_tasks() -> None:
    import asyncio.base_events
    import asyncio.tasks

    _current_task[0] = asyncio.tasks.current_task
    patch(asyncio.base_events.BaseEventLoop, "create_task", _make_create_task)
    COROUTINE_EXIT[0] = _task_exit


def stop() -> None:
    """Propagation stops: coroutine exits are no longer looked at."""
    COROUTINE_EXIT[0] = None


def _task_done(snap: Any, task: Any) -> None:
    """Attach the creation site to a failed task's exception.

    Registered when the task is created, so it runs before the callbacks of anything
    awaiting the task (awaiters, gather, TaskGroup) and before "Task exception was never
    retrieved" can be logged. Reads ``_exception`` rather than calling ``exception()``,
    which would mark the exception retrieved and silence that message.
    """
    try:
        if task.cancelled():
            return
        exc = task._exception
        if isinstance(exc, Exception):
            attach_if_absent(exc, snap)
    except Exception:
        pass


def _make_run_in_executor(original: Callable[..., Any]) -> Callable[..., Any]:
    call = binder(original)  # calls it as Python would: through __get__

    def run_in_executor(self: Any, executor: Any, func: Any, *args: Any) -> Any:
        # Any executor: it receives a callable that answers as func does. Coroutine
        # functions (and non-callables) reach the loop's own checks unwrapped, so
        # asyncio's debug mode (uvloop: always) still refuses them with TypeError.
        # asyncio.to_thread arrives here with partial(ctx.run, func): func is wrapped
        # inside it (so `from asyncio import to_thread` before install() is covered too).
        if "asyncio_executor" not in ON or has_origin(func) or crosses_interpreters(executor):
            # (an InterpreterPoolExecutor needs func as it is: thread_pool's submit
            # attaches its origin when the future fails)
            return call(self, executor, func, *args)
        snap = take()
        if snap is None:
            return call(self, executor, func, *args)
        return call(self, executor, carry(func, snap), *args)

    return run_in_executor


def apply_executor() -> None:
    import asyncio.base_events

    patch(asyncio.base_events.BaseEventLoop, "run_in_executor", _make_run_in_executor)


# uvloop's loop is compiled, but ``uvloop.Loop`` (what ``uvloop.new_event_loop()``,
# ``uvloop.run()`` and its policy create) is a Python subclass of it: the same
# replacements are set on that subclass, in front of the compiled methods.
# Third-party modules are taken from sys.modules (their import is what triggered the
# patch), never imported here: monstack has no dependencies.
def apply_uvloop_tasks() -> None:
    uvloop = sys.modules["uvloop"]
    patch(uvloop.Loop, "create_task", _make_create_task, inherited=True)


def apply_uvloop_executor() -> None:
    uvloop = sys.modules["uvloop"]
    patch(uvloop.Loop, "run_in_executor", _make_run_in_executor, inherited=True)
