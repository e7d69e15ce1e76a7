"""Automatic propagation of origins: threads, executors, asyncio.

``install(propagate=...)`` names the points to patch (``PROPAGATION_POINTS``):

- ``"threading"``: ``threading.Thread.start`` (so ``Timer`` too). The new thread runs
  with the starter's snapshot as its origin; an exception ending it carries the origin,
  so ``threading.excepthook`` prints it (as a PEP 678 note).
- ``"thread_pool"`` / ``"process_pool"``: ``ThreadPoolExecutor.submit`` /
  ``ProcessPoolExecutor.submit`` (``map`` goes through ``submit``). The exception that
  ``future.result()`` raises carries the submitting line; for process pools the origin
  travels to the child pickled and comes back on the pickled exception, and the parent
  attaches it again if the exception lost it on the way.
- ``"asyncio_tasks"``: ``asyncio.BaseEventLoop.create_task``, through which
  ``asyncio.create_task``, ``loop.create_task``, ``ensure_future``, ``gather`` and
  ``TaskGroup`` create tasks. It sits in front of whatever task factory the loop has,
  so user factories keep working (and their tasks inherit the origin) and every loop is
  covered, including loops that existed before ``install()``.
- ``"asyncio_executor"``: ``loop.run_in_executor`` and ``asyncio.to_thread``.
- ``"process"``: ``multiprocessing``'s ``Process.start`` (every start method). The
  process's target runs with the starter's snapshot as its origin (it travels pickled
  under spawn/forkserver), so the traceback the child prints when the target fails
  carries a "Work created at" note. Processes that override ``run()`` instead of taking
  a ``target``, and the worker processes of pools and managers, are left alone.
- ``"mp_pool"``: ``multiprocessing.pool.Pool``'s ``apply_async``, ``_map_async`` and
  ``imap``/``imap_unordered`` (so ``apply``, ``map``, ``starmap`` and their ``_async``
  forms, for process pools and ``ThreadPool``). Each job runs with the calling line as
  its origin; the exception ``get()`` raises carries it (pickled back with the
  exception, and attached again in the parent by an error callback if pickling lost it).

Each replacement checks whether its point is still on and otherwise calls straight
through, so a patch that somebody else wrapped after us is harmless after ``stop()``;
``stop()`` puts the identical original objects back wherever ours is still in place.
The snapshot is the only cost on the creating side (O(1) with a tracking backend).
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable, Optional

from . import _snapshot
from ._errors import warn
from ._origin import _attach_if_absent, _drop_own_entry, _snap, _WithOrigin
from ._settings import PROPAGATION_POINTS
from ._snapshot import CURRENT_ORIGIN

#: Points switched on now (read by the replacements on every call).
_ON: set = set()
#: Applied patches: (owner, attribute name, original object, replacement).
_PATCHES: list[tuple[Any, str, Any, Any]] = []


def check_points(value: Any) -> frozenset:
    if value is True:
        return frozenset(PROPAGATION_POINTS)
    if value is False or value is None:
        return frozenset()
    if isinstance(value, str):
        names = frozenset([value])
    else:
        try:
            names = frozenset(value)
        except TypeError:
            raise ValueError(
                f"propagate must be True, False or names from {list(PROPAGATION_POINTS)}, got {value!r}"
            ) from None
    bad = sorted(str(n) for n in names if n not in PROPAGATION_POINTS)
    if bad:
        raise ValueError(f"unknown propagation point(s) {bad}; valid choices: {list(PROPAGATION_POINTS)}")
    return names


def check_chain_limit(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"chain_limit must be a positive int, got {value!r}")
    return value


def start(options: dict) -> None:
    """Apply the patches named in ``options["propagate"]``; set the chain cap."""
    stop()
    FAILED.clear()
    _snapshot.set_chain_limit(options.get("chain_limit", _snapshot.DEFAULT_CHAIN_LIMIT))
    points = options.get("propagate", frozenset())
    try:
        for name in PROPAGATION_POINTS:
            if name in points:
                _ON.add(name)
                trigger = _TRIGGERS[name]
                if trigger in sys.modules:
                    _APPLY[name]()
                else:  # patch when the program imports it: install() stays cheap
                    _PENDING.setdefault(trigger, []).append(name)
        if _PENDING and _HOOK not in sys.meta_path:
            sys.meta_path.insert(0, _HOOK)
    except BaseException:
        stop()
        raise


def stop() -> None:
    """Undo every patch ``start`` made: the original objects are put back (identity)."""
    _ON.clear()
    _PENDING.clear()
    try:
        sys.meta_path.remove(_HOOK)
    except ValueError:
        pass
    while _PATCHES:
        owner, attr, original, replacement = _PATCHES.pop()
        try:
            if owner.__dict__.get(attr) is replacement:
                setattr(owner, attr, original)
            # else: somebody patched over us; our replacement now just calls through.
        except Exception:
            pass
    _snapshot.set_chain_limit(_snapshot.DEFAULT_CHAIN_LIMIT)


def patched() -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, original)`` of every patch in place (for tests and ``info``)."""
    return [(owner, attr, original) for owner, attr, original, _r in _PATCHES]


def _patch(owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
    original = owner.__dict__[attr]
    replacement = make(original)
    try:
        functools.update_wrapper(replacement, original)
    except Exception:
        pass
    setattr(owner, attr, replacement)
    _PATCHES.append((owner, attr, original, replacement))


def _take() -> Optional[Any]:
    """A snapshot for new work, or None if that fails (never break the host program)."""
    try:
        return _snap()
    except Exception:
        return None


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

    _patch(threading.Thread, "start", make)


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
                CURRENT_ORIGIN.reset(token)
                _unbind_thread(thread, bound)
                thread = bound = run = None  # type: ignore[assignment]  # no cycle through this closure: the Thread is freed by refcount

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
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def submit(self: Any, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            if point not in _ON or type(fn) is _WithOrigin:
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
            future = original(self, _WithOrigin(fn, snap), *args, **kwargs)
            if point == "process_pool":
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


# Each class is patched in the module that defines it (the trigger in _TRIGGERS), never
# through ``concurrent.futures``: on 3.15 that package's names are lazy imports (PEP 810)
# that cannot be resolved while the defining module's own import finishes.
def _apply_thread_pool() -> None:
    import concurrent.futures.thread as cf_thread

    _patch(cf_thread.ThreadPoolExecutor, "submit", _make_submit("thread_pool"))


def _apply_process_pool() -> None:
    import concurrent.futures.process as cf_process

    _patch(cf_process.ProcessPoolExecutor, "submit", _make_submit("process_pool"))


# -- multiprocessing.Process ----------------------------------------------------------------------

#: Targets that run many jobs (pool and manager processes): no single origin is theirs.
_INTERNAL_TARGET_MODULES = ("multiprocessing.", "concurrent.futures.")


def _apply_process() -> None:
    # `import a.b as c` (IMPORT_FROM) also works while the post-import hook runs inside
    # multiprocessing/__init__'s own import of .process; `a.b.X` attribute access does not.
    import multiprocessing.process as mp_process

    def make(original: Callable[..., None]) -> Callable[..., None]:
        def start(self: Any) -> None:
            if "process" not in _ON:
                return original(self)
            target = _wrap_process_target(self)
            wrapper = self.__dict__.get("_target") if target is not None else None
            try:
                return original(self)  # fork copies, spawn pickles, the wrapped target
            finally:
                # start() deletes _target on success (bpo-30775); put it back only if
                # start() failed before that
                if target is not None:
                    try:
                        if self.__dict__.get("_target") is wrapper:
                            self._target = target
                    except Exception:
                        pass

        return start

    _patch(mp_process.BaseProcess, "start", make)


def _wrap_process_target(process: Any) -> Optional[Any]:
    """Give ``process`` a target that runs the real one with an origin; the real one, or
    None when left alone (no callable target, a subclass with its own ``run()``, a
    pool's or manager's process, already wrapped)."""
    try:
        target = getattr(process, "_target", None)
        if target is None or isinstance(target, _WithOrigin) or not callable(target):
            return None
        base = sys.modules["multiprocessing.process"].BaseProcess
        if getattr(type(process), "run", None) is not base.run:  # run() overridden: its business
            return None
        if str(getattr(target, "__module__", "") or "").startswith(_INTERNAL_TARGET_MODULES):
            return None
        snap = _take()
        if snap is None:
            return None
        process._target = _WithOrigin(target, snap)
        return target
    except Exception:
        return None


# -- multiprocessing.pool ---------------------------------------------------------------------


def _apply_mp_pool() -> None:
    import multiprocessing.pool as mp_pool

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
            if "mp_pool" not in _ON or type(func) is _WithOrigin:
                return original(self, func, args, kwds, callback, error_callback)
            snap = _take()
            if snap is None:
                return original(self, func, args, kwds, callback, error_callback)
            return original(self, _WithOrigin(func, snap), args, kwds, callback,
                            with_error_callback(snap, error_callback))

        return apply_async

    def make_map_async(original: Callable[..., Any]) -> Callable[..., Any]:
        def _map_async(self: Any, func: Any, iterable: Any, mapper: Any, chunksize: Any = None,
                       callback: Any = None, error_callback: Any = None) -> Any:
            if "mp_pool" not in _ON or type(func) is _WithOrigin:
                return original(self, func, iterable, mapper, chunksize, callback, error_callback)
            snap = _take()
            if snap is None:
                return original(self, func, iterable, mapper, chunksize, callback, error_callback)
            return original(self, _WithOrigin(func, snap), iterable, mapper, chunksize, callback,
                            with_error_callback(snap, error_callback))

        return _map_async

    def make_imap(original: Callable[..., Any]) -> Callable[..., Any]:
        def imap(self: Any, func: Any, iterable: Any, chunksize: int = 1) -> Any:
            if "mp_pool" not in _ON or type(func) is _WithOrigin:
                return original(self, func, iterable, chunksize)
            snap = _take()
            if snap is None:
                return original(self, func, iterable, chunksize)
            return original(self, _WithOrigin(func, snap), iterable, chunksize)

        return imap

    _patch(Pool, "apply_async", make_apply_async)
    _patch(Pool, "_map_async", make_map_async)
    _patch(Pool, "imap", make_imap)
    _patch(Pool, "imap_unordered", make_imap)


# -- asyncio -------------------------------------------------------------------------------------


def _apply_asyncio_tasks() -> None:
    import asyncio.base_events

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def create_task(self: Any, coro: Any, *args: Any, **kwargs: Any) -> Any:
            # An explicit context (asyncio.run's main task, user code) is left alone:
            # setting our variable in it would change the caller's context object.
            if "asyncio_tasks" not in _ON or kwargs.get("context") is not None:
                return original(self, coro, *args, **kwargs)
            snap = _take()
            if snap is None:
                return original(self, coro, *args, **kwargs)
            token = CURRENT_ORIGIN.set(snap)  # the task copies the current context
            try:
                task = original(self, coro, *args, **kwargs)
            finally:
                CURRENT_ORIGIN.reset(token)
            try:
                if task.done():
                    # An eager task (eager_task_factory, 3.12+) that finished inside
                    # create_task: a done callback would only be scheduled, and the
                    # creator may await the task before it runs.
                    _task_done(snap, task)
                else:
                    task.add_done_callback(functools.partial(_task_done, snap))
            except Exception:
                pass
            return task

        return create_task

    _patch(asyncio.base_events.BaseEventLoop, "create_task", make)


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


def _apply_asyncio_executor() -> None:
    import asyncio
    import asyncio.base_events
    import asyncio.threads

    def make_rie(original: Callable[..., Any]) -> Callable[..., Any]:
        def run_in_executor(self: Any, executor: Any, func: Any, *args: Any) -> Any:
            if "asyncio_executor" not in _ON or _has_origin(func):
                return original(self, executor, func, *args)
            snap = _take()
            if snap is None:
                return original(self, executor, func, *args)
            return original(self, executor, _WithOrigin(func, snap), *args)

        return run_in_executor

    _patch(asyncio.base_events.BaseEventLoop, "run_in_executor", make_rie)

    def make_to_thread(original: Callable[..., Any]) -> Callable[..., Any]:
        async def to_thread(func: Any, /, *args: Any, **kwargs: Any) -> Any:
            # The body runs when awaited: the snapshot is the awaiting line.
            if "asyncio_executor" in _ON and not _has_origin(func):
                snap = _take()
                if snap is not None:
                    func = _WithOrigin(func, snap)
            return await original(func, *args, **kwargs)

        return to_thread

    _patch(asyncio.threads, "to_thread", make_to_thread)
    # ``asyncio.to_thread`` is the same object re-exported by the package.
    if asyncio.__dict__.get("to_thread") is _PATCHES[-1][2]:
        replacement = _PATCHES[-1][3]
        original = _PATCHES[-1][2]
        asyncio.to_thread = replacement
        _PATCHES.append((asyncio, "to_thread", original, replacement))


def _has_origin(func: Any) -> bool:
    """Already wrapped (directly, or as ``to_thread``'s ``partial(ctx.run, wrapped, ...)``)."""
    if type(func) is _WithOrigin:
        return True
    if type(func) is functools.partial and func.args and type(func.args[0]) is _WithOrigin:
        return True
    return False


_APPLY: dict[str, Callable[[], None]] = {
    "threading": _apply_threading,
    "thread_pool": _apply_thread_pool,
    "process_pool": _apply_process_pool,
    "asyncio_tasks": _apply_asyncio_tasks,
    "asyncio_executor": _apply_asyncio_executor,
    "process": _apply_process,
    "mp_pool": _apply_mp_pool,
}


# -- patching modules when they are first imported ---------------------------------------------

#: The module whose import makes each point patchable (the patched class lives there).
_TRIGGERS: dict[str, str] = {
    "threading": "threading",
    "thread_pool": "concurrent.futures.thread",
    "process_pool": "concurrent.futures.process",
    "asyncio_tasks": "asyncio",
    "asyncio_executor": "asyncio",
    "process": "multiprocessing.process",
    "mp_pool": "multiprocessing.pool",
}
#: Trigger module -> points waiting for it to be imported.
_PENDING: dict[str, list[str]] = {}


class _PostImportHook:
    """A meta path finder that patches a trigger module right after it first executes.

    Importing asyncio or concurrent.futures.process just to patch them would cost a
    program that never uses them ~100 ms at start-up (``MONSTACK=1``). The finder only
    answers for pending trigger modules; it wraps their loader for that one import and
    puts the original loader back on the module afterwards.
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _PENDING:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module"):
            spec.loader = _PatchingLoader(loader, fullname)
        return spec


class _PatchingLoader:
    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._loader, attr)

    def create_module(self, spec: Any) -> Any:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: Any) -> None:
        try:
            spec = module.__spec__
            if spec is not None and spec.loader is self:
                spec.loader = self._loader
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._loader
        except Exception:
            pass
        self._loader.exec_module(module)
        for name in _PENDING.pop(self._name, ()):
            if name in _ON:
                try:
                    _APPLY[name]()
                except Exception as exc:  # never break the program's import; but say so
                    _patch_failed(name, exc)
        if not _PENDING:
            try:
                sys.meta_path.remove(_HOOK)
            except ValueError:
                pass


def _patch_failed(name: str, exc: BaseException) -> None:
    """A point could not be patched when its module was imported: the program goes on,
    that point's work gets no origin, and the user is told (a MonstackWarning, or a line
    on stderr where warnings are errors: never an exception inside their import)."""
    FAILED[name] = f"{type(exc).__name__}: {exc}"
    try:
        warn(f"monstack: could not patch propagation point {name!r} ({FAILED[name]}); "
             "work it creates gets no origin")
    except Exception:
        pass


#: Points whose patch failed when their module was imported: name -> error (for tests, info).
FAILED: dict[str, str] = {}

_HOOK = _PostImportHook()
