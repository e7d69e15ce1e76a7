"""The propagation points' code for threads, executors, multiprocessing, asyncio, trio.

What each point does is described in :mod:`monstack._propagate`, which switches them on and
off, keeps the patches and imports this module with the first of its points to be patched
(the program's import of ``threading``, ``asyncio``...), not at ``install()``: MONSTACK=1
start-up stays light. ``_propagate`` hands it the shared state through :func:`bind` (this
module does not import ``_propagate``: layers import downward, lazily too).
"""

from __future__ import annotations

import _thread
import sys

from . import _snapshot, _threads
from ._origin import _attach_if_absent, _drop_own_entry, _WithOrigin
from ._snapshot import CURRENT_ORIGIN

TYPE_CHECKING = False
if TYPE_CHECKING:
    import threading
    from typing import Any, Callable, Optional

_LOOPS = _threads.LOOPS

#: ``_propagate``'s points switched on, its applied patches, its ``_patch`` and its
#: ``_take`` (set by :func:`bind` before any point here is applied).
_ON: set = set()
_PATCHES: list = []


def _patch(owner: Any, attr: str, make: Callable[[Any], Any], inherited: bool = False) -> None:
    raise RuntimeError("monstack._points used before bind()")


def _take() -> Optional[Any]:
    return None


def bind(on: set, patches: list, patch: Callable[..., None], take: Callable[[], Optional[Any]]) -> None:
    global _ON, _PATCHES, _patch, _take
    _ON, _PATCHES, _patch, _take = on, patches, patch, take  # type: ignore[assignment]


# -- threading -------------------------------------------------------------------------------


def _apply_threading() -> None:
    def make(original: Callable[..., None]) -> Callable[..., None]:
        def start(self: threading.Thread) -> None:
            if "threading" not in _ON:
                return original(self)
            bound = _bind_thread(self)
            try:
                return original(self)
            except BaseException:
                if bound:
                    _unbind_thread(self, bound)
                raise

        return start

    # (inherited: under gevent's monkey.patch_all(), threading.Thread is gevent's subclass)
    _patch(sys.modules["threading"].Thread, "start", make, inherited=True)


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
        if target is not None and str(getattr(target, "__module__", "") or "").startswith(_INTERNAL_TARGET_MODULES):
            return None
        snap = _take()
        if snap is None:
            return None
        had = "run" in thread.__dict__
        previous = thread.__dict__.get("run")
        run = thread.run
        bound: Any = None

        def run_with_origin() -> None:
            nonlocal thread, bound, run
            token = CURRENT_ORIGIN.set(snap)
            ident = _thread.get_ident()
            _snapshot.RUNNING[ident] = snap  # (a new thread: nothing ran before)
            try:
                run()
            except Exception as exc:
                _attach_if_absent(exc, snap)
                _drop_own_entry(exc, sys._getframe())
                raise
            except BaseException as exc:  # SystemExit...: no note, same traceback
                _drop_own_entry(exc, sys._getframe())
                raise
            finally:
                _snapshot.RUNNING.pop(ident, None)
                CURRENT_ORIGIN.reset(token)
                _unbind_thread(thread, bound)
                thread = bound = run = None  # type: ignore[assignment]  # no cycle through this closure: the Thread is freed by refcount

        try:  # answers as the bound run() it stands for
            run_with_origin.__name__ = run.__name__
            run_with_origin.__qualname__ = run.__qualname__
            run_with_origin.__doc__ = run.__doc__
            run_with_origin.__wrapped__ = run  # type: ignore[attr-defined]
        except Exception:
            pass
        bound = (run_with_origin, had, previous)
        thread.run = run_with_origin  # type: ignore[method-assign]
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


# -- concurrent.futures ------------------------------------------------------------------------


def _make_submit(point: str) -> Callable[[Any], Any]:
    from ._origin import carry, has_origin

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def submit(self: Any, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            if point not in _ON or has_origin(fn):
                return original(self, fn, *args, **kwargs)
            snap = _take()
            if snap is None:
                return original(self, fn, *args, **kwargs)
            if _crosses_interpreters(self):
                # 3.14+: the callable must be shareable with another interpreter as the
                # user gave it (a wrapper is not): it runs unwrapped, and the exception
                # it raised gets the origin in this interpreter, when the future fails.
                future = original(self, fn, *args, **kwargs)
                _attach_when_done(future, snap)
                return future
            carried = carry(fn, snap)
            future = original(self, carried, *args, **kwargs)
            if point == "process_pool" or carried is fn:  # fn unwrapped: a coroutine function...
                _attach_when_done(future, snap)
            return future

        return submit

    return make


def _crosses_interpreters(executor: Any) -> bool:
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
                _attach_if_absent(exception, snap)
        except Exception:
            pass
        set_exception(exception)

    def done(fut: Any) -> None:
        try:
            fut.__dict__.pop("set_exception", None)  # also breaks fut -> closure -> fut
            if not fut.cancelled():
                exc = fut._exception  # not .exception(): never wait, never mark anything
                if isinstance(exc, Exception):
                    _attach_if_absent(exc, snap)
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
def _apply_thread_pool() -> None:
    import concurrent.futures.thread as cf_thread

    _patch(cf_thread.ThreadPoolExecutor, "submit", _make_submit("thread_pool"))


def _apply_process_pool() -> None:
    import concurrent.futures.process as cf_process

    _patch(cf_process.ProcessPoolExecutor, "submit", _make_submit("process_pool"))


# -- multiprocessing.Process ----------------------------------------------------------------------

#: Targets that run many jobs (pool and manager processes, trio's cached worker threads):
#: no single origin is theirs.
_INTERNAL_TARGET_MODULES = ("multiprocessing.", "concurrent.futures.", "trio._core._thread_cache")


def _apply_process() -> None:
    # `import a.b as c` (IMPORT_FROM) also works while the post-import hook runs inside
    # multiprocessing/__init__'s own import of .process; `a.b.X` attribute access does not.
    import multiprocessing.process as mp_process

    def make(original: Callable[..., None]) -> Callable[..., None]:
        def start(self: Any) -> None:
            if "process" not in _ON:
                return original(self)
            run = _bind_process_run(self)
            try:
                return original(self)  # fork copies, spawn and forkserver pickle, our run()
            finally:
                if run is not None:  # the parent's object is as it was
                    try:
                        if self.__dict__.get("run") is run:
                            del self.__dict__["run"]
                    except Exception:
                        pass

        return start

    _patch(mp_process.BaseProcess, "start", make)


def _bind_process_run(process: Any) -> Optional[Any]:
    """Give ``process`` an instance ``run`` that runs its class's ``run()`` (the target,
    or the subclass's own) with the starter's snapshot as origin, in the child; return
    it, or None when the process is left alone (a pool's or manager's process, a target
    that already carries an origin, an instance-level ``run`` of the user's)."""
    try:
        from ._origin import _RunOf

        if "run" in process.__dict__:
            return None
        run = getattr(type(process), "run", None)
        base = sys.modules["multiprocessing.process"].BaseProcess
        if run is base.run:
            target = getattr(process, "_target", None)
            if target is None or isinstance(target, _WithOrigin) or not callable(target):
                return None
            if str(getattr(target, "__module__", "") or "").startswith(_INTERNAL_TARGET_MODULES):
                return None
        elif str(getattr(run, "__module__", "") or "").startswith(_INTERNAL_TARGET_MODULES):
            return None
        snap = _take()
        if snap is None:
            return None
        bound = _RunOf(process, snap)
        process.__dict__["run"] = bound
        return bound
    except Exception:
        return None


# -- multiprocessing.pool ---------------------------------------------------------------------


def _apply_mp_pool() -> None:
    import multiprocessing.pool as mp_pool

    from ._origin import carry, has_origin

    Pool = mp_pool.Pool

    def with_error_callback(snap: Any, user: Optional[Callable[[Any], Any]]) -> Callable[[Any], Any]:
        # Runs in the pool's result thread before get() is woken: attach the origin if
        # the exception lost it when pickled back (the child normally attached it).
        def error_callback(exc: Any) -> Any:
            try:
                if isinstance(exc, Exception):
                    _attach_if_absent(exc, snap)
            except Exception:
                pass
            if user is not None:
                return user(exc)
            return None

        return error_callback

    def make_apply_async(original: Callable[..., Any]) -> Callable[..., Any]:
        def apply_async(self: Any, func: Any, args: Any = (), kwds: Any = {},  # noqa: B006 (the original's default)
                        callback: Any = None, error_callback: Any = None) -> Any:
            if "mp_pool" not in _ON or has_origin(func):
                return original(self, func, args, kwds, callback, error_callback)
            snap = _take()
            if snap is None:
                return original(self, func, args, kwds, callback, error_callback)
            return original(self, carry(func, snap), args, kwds, callback,
                            with_error_callback(snap, error_callback))

        return apply_async

    def make_map_async(original: Callable[..., Any]) -> Callable[..., Any]:
        def _map_async(self: Any, func: Any, iterable: Any, mapper: Any, chunksize: Any = None,
                       callback: Any = None, error_callback: Any = None) -> Any:
            if "mp_pool" not in _ON or has_origin(func):
                return original(self, func, iterable, mapper, chunksize, callback, error_callback)
            snap = _take()
            if snap is None:
                return original(self, func, iterable, mapper, chunksize, callback, error_callback)
            return original(self, carry(func, snap), iterable, mapper, chunksize, callback,
                            with_error_callback(snap, error_callback))

        return _map_async

    def make_imap(original: Callable[..., Any]) -> Callable[..., Any]:
        def imap(self: Any, func: Any, iterable: Any, chunksize: int = 1) -> Any:
            if "mp_pool" not in _ON or has_origin(func):
                return original(self, func, iterable, chunksize)
            snap = _take()
            if snap is None:
                return original(self, func, iterable, chunksize)
            return original(self, carry(func, snap), iterable, chunksize)

        return imap

    _patch(Pool, "apply_async", make_apply_async)
    _patch(Pool, "_map_async", make_map_async)
    _patch(Pool, "imap", make_imap)
    _patch(Pool, "imap_unordered", make_imap)


# -- asyncio ------------------------------------------------------------------------------------


def _make_create_task(original: Callable[..., Any]) -> Callable[..., Any]:
    def create_task(self: Any, coro: Any, *args: Any, **kwargs: Any) -> Any:
        if "asyncio_tasks" not in _ON:
            return original(self, coro, *args, **kwargs)
        if id(self) not in _LOOPS:
            from ._threads import note_loop

            note_loop(self)
        if kwargs.get("context") is not None:
            return _create_task_in_context(original, self, coro, args, kwargs)
        snap = _take()
        if snap is None:
            return original(self, coro, *args, **kwargs)
        token = CURRENT_ORIGIN.set(snap)  # the task copies the current context
        try:
            task = original(self, coro, *args, **kwargs)
        finally:
            CURRENT_ORIGIN.reset(token)
        _when_task_done(task, snap)
        return task

    return create_task


def _create_task_in_context(original: Callable[..., Any], loop: Any, coro: Any, args: tuple, kwargs: dict) -> Any:
    """A task with an explicit context runs in that very Context object, which must not
    gain our variable (the caller may share it or read it afterwards), so code inside
    the task does not see the origin; its failure still gets it, from a done callback.
    asyncio.run's (a Runner's) main task is left alone: its exception comes straight
    out of asyncio.run(), under the line that called it."""
    try:
        if sys._getframe(2).f_globals.get("__name__") == "asyncio.runners":
            return original(loop, coro, *args, **kwargs)
    except Exception:
        pass
    snap = _take()
    task = original(loop, coro, *args, **kwargs)
    if snap is not None:
        _when_task_done(task, snap)
    return task


def _when_task_done(task: Any, snap: Any) -> None:
    try:
        if task.done():
            # An eager task (eager_task_factory, 3.12+) that finished inside
            # create_task: a done callback would only be scheduled, and the
            # creator may await the task before it runs.
            _task_done(snap, task)
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
        _task_done(self._snap, task)


def _apply_asyncio_tasks() -> None:
    import asyncio.base_events

    _patch(asyncio.base_events.BaseEventLoop, "create_task", _make_create_task)


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
            _attach_if_absent(exc, snap)
    except Exception:
        pass


def _make_run_in_executor(original: Callable[..., Any]) -> Callable[..., Any]:
    from ._origin import carry, has_origin

    def run_in_executor(self: Any, executor: Any, func: Any, *args: Any) -> Any:
        # Any executor: it receives a callable that answers as func does. Coroutine
        # functions (and non-callables) reach the loop's own checks unwrapped, so
        # asyncio's debug mode (uvloop: always) still refuses them with TypeError.
        # asyncio.to_thread arrives here with partial(ctx.run, func): func is wrapped
        # inside it (so `from asyncio import to_thread` before install() is covered too).
        if "asyncio_executor" not in _ON or has_origin(func) or _crosses_interpreters(executor):
            # (an InterpreterPoolExecutor needs func as it is: thread_pool's submit
            # attaches its origin when the future fails)
            return original(self, executor, func, *args)
        snap = _take()
        if snap is None:
            return original(self, executor, func, *args)
        return original(self, executor, carry(func, snap), *args)

    return run_in_executor


def _apply_asyncio_executor() -> None:
    import asyncio.base_events

    _patch(asyncio.base_events.BaseEventLoop, "run_in_executor", _make_run_in_executor)


# uvloop's loop is compiled, but ``uvloop.Loop`` (what ``uvloop.new_event_loop()``,
# ``uvloop.run()`` and its policy create) is a Python subclass of it: the same
# replacements are set on that subclass, in front of the compiled methods.
# Third-party modules are taken from sys.modules (their import is what triggered the
# patch), never imported here: monstack has no dependencies.
def _apply_uvloop_tasks() -> None:
    uvloop = sys.modules["uvloop"]
    _patch(uvloop.Loop, "create_task", _make_create_task, inherited=True)


def _apply_uvloop_executor() -> None:
    uvloop = sys.modules["uvloop"]
    _patch(uvloop.Loop, "run_in_executor", _make_run_in_executor, inherited=True)


# -- trio ------------------------------------------------------------------------------------------

#: trio tasks spawned with an origin -> that origin (attached when the task fails).
_TRIO_TASKS: Any = None


def _apply_trio() -> None:
    import weakref

    from ._origin import carry, has_origin

    trio_run = sys.modules["trio._core._run"]  # loaded by trio's own import, as is:
    trio_threads = sys.modules["trio._threads"]

    global _TRIO_TASKS
    if _TRIO_TASKS is None:
        _TRIO_TASKS = weakref.WeakKeyDictionary()
    tasks = _TRIO_TASKS
    Runner = trio_run.Runner

    def make_spawn(original: Callable[..., Any]) -> Callable[..., Any]:
        def spawn_impl(self: Any, async_fn: Any, args: Any, nursery: Any, *rest: Any, **kwargs: Any) -> Any:
            # Not system tasks, not the main task (its exception comes out of trio.run();
            # the init task spawns it, in a nursery of its own), not a task given its own
            # context.
            if ("trio" not in _ON or kwargs.get("system_task") or kwargs.get("context") is not None
                    or nursery is None or getattr(nursery, "parent_task", None) is getattr(self, "init_task", None)):
                return original(self, async_fn, args, nursery, *rest, **kwargs)
            snap = _take()
            task = original(self, async_fn, args, nursery, *rest, **kwargs)
            if snap is not None:
                try:
                    # the task's own context (a fresh copy): its code sees the origin
                    task.context.run(CURRENT_ORIGIN.set, snap)
                    tasks[task] = snap
                except Exception:
                    pass
            return task

        return spawn_impl

    def make_exited(original: Callable[..., Any]) -> Callable[..., Any]:
        def task_exited(self: Any, task: Any, outcome: Any, *rest: Any, **kwargs: Any) -> Any:
            if tasks:
                try:
                    snap = tasks.pop(task, None)
                    if snap is not None:
                        exc = getattr(outcome, "error", None)
                        if isinstance(exc, Exception):
                            _attach_if_absent(exc, snap)
                except Exception:
                    pass
            return original(self, task, outcome, *rest, **kwargs)

        return task_exited

    def make_run_sync(original: Callable[..., Any]) -> Callable[..., Any]:
        async def run_sync(sync_fn: Any, *args: Any, **kwargs: Any) -> Any:
            # The body runs when awaited: the snapshot is the awaiting line.
            if "trio" in _ON and not has_origin(sync_fn):
                snap = _take()
                if snap is not None:
                    sync_fn = carry(sync_fn, snap)
            return await original(sync_fn, *args, **kwargs)

        return run_sync

    _patch(Runner, "spawn_impl", make_spawn)
    _patch(Runner, "task_exited", make_exited)
    _patch(trio_threads, "to_thread_run_sync", make_run_sync)
    original, replacement = _PATCHES[-1][2], _PATCHES[-1][3]
    to_thread = sys.modules.get("trio.to_thread")
    if to_thread is not None and to_thread.__dict__.get("run_sync") is original:
        setattr(to_thread, "run_sync", replacement)
        _PATCHES.append((to_thread, "run_sync", original, replacement))
