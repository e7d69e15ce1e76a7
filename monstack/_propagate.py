"""Automatic propagation of origins: threads, executors, asyncio, multiprocessing, trio.

``install(propagate=...)`` names the points to patch (``PROPAGATION_POINTS``):

- ``"threading"``: ``threading.Thread.start`` (so ``Timer`` too). The new thread runs
  with the starter's snapshot as its origin; an exception ending it carries the origin,
  so ``threading.excepthook`` prints it (as a PEP 678 note).
- ``"start_new_thread"``: ``_thread.start_new_thread`` (and its alias ``start_new``). The
  function runs with the starting line as its origin; its failure carries it to
  ``sys.unraisablehook``, and where that is the default one on 3.11-3.14 (which does not
  print notes) the report is printed with the note, as 3.15's default hook prints it.
- ``"thread_pool"`` / ``"process_pool"``: ``ThreadPoolExecutor.submit`` /
  ``ProcessPoolExecutor.submit`` (``map`` goes through ``submit``). The exception that
  ``future.result()`` raises carries the submitting line; for process pools the origin
  travels to the child pickled and comes back on the pickled exception, and the parent
  attaches it again if the exception lost it on the way.
- ``"asyncio_tasks"``: ``asyncio.BaseEventLoop.create_task`` (and ``uvloop.Loop``'s),
  through which ``asyncio.create_task``, ``loop.create_task``, ``ensure_future``,
  ``gather`` and ``TaskGroup`` create tasks. It sits in front of whatever task factory
  the loop has, so user factories keep working (and their tasks inherit the origin) and
  every loop is covered, including loops that existed before ``install()``. A task given
  an explicit ``context=`` runs in that context untouched: its failure gets the origin
  from a done callback, but code inside it does not see it as the current origin.
- ``"asyncio_executor"``: ``loop.run_in_executor`` (``BaseEventLoop``'s and
  ``uvloop.Loop``'s), any executor, and so ``asyncio.to_thread``.
- ``"process"``: ``multiprocessing``'s ``Process.start`` (every start method). The
  process's ``run()`` (its target, or a subclass's own ``run()``) runs with the starter's
  snapshot as its origin (travelling pickled under spawn/forkserver), so the traceback
  the child prints when it fails carries a "Work created at" note. The worker processes
  of pools and managers are left alone.
- ``"mp_pool"``: ``multiprocessing.pool.Pool``'s ``apply_async``, ``_map_async`` and
  ``imap``/``imap_unordered`` (so ``apply``, ``map``, ``starmap`` and their ``_async``
  forms, for process pools and ``ThreadPool``). Each job runs with the calling line as
  its origin; the exception ``get()`` raises carries it (pickled back with the
  exception, and attached again in the parent by an error callback if pickling lost it).
- ``"celery"``: Celery tasks (``delay``, ``apply_async``, canvas, eager ``apply``) run
  under the publishing line and fail with it, on the worker and in ``AsyncResult.get()``;
  the snapshot travels in the message's headers. Patched only once the program imports
  Celery (see ``monstack._celery``).
- ``"dask"``: ``distributed.Client.submit`` and ``Client.map`` (clients made inside
  tasks too): the task runs on the worker under the submitting line, whose failure note
  travels back with the exception; the client attaches it again to exceptions that
  arrive without it (a dead worker's ``KilledWorker``, errors Dask replaced). Patched
  only once the program imports ``distributed``; the code is in ``_dask``.
- ``"trio"``: tasks started with ``nursery.start_soon``/``nursery.start`` (trio's
  ``Runner.spawn_impl``: the task's own context gets the origin; the exception it exits
  with gets it attached) and ``trio.to_thread.run_sync``. Patched only once the program
  imports trio.

The callable a library receives answers as the user's does (``_origin._WithOrigin``), and
callables no wrapper can stand in for (coroutine and generator functions, non-callables)
are passed on unwrapped (``_origin.carry``).

Each replacement checks whether its point is still on and otherwise calls straight
through, so a patch that somebody else wrapped after us is harmless after ``stop()``;
``stop()`` puts the identical original objects back wherever ours is still in place.
The snapshot is the only cost on the creating side (O(1) with a tracking backend).
"""

from __future__ import annotations

import _thread
import sys

from . import _snapshot
from ._errors import warn
from ._settings import PROPAGATION_POINTS
from ._snapshot import CURRENT_ORIGIN

# Nothing here imports ``threading`` (or ``typing``, ``functools``...) at start-up: a
# program that must run before threading is imported (gevent's monkey-patching, say)
# still can under MONSTACK=1; the ``threading`` point is patched when it is imported.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import threading
    from typing import Any, Callable, Optional

    from ._origin import _attach_if_absent, _drop_own_entry, _snap, _WithOrigin

# ``_origin`` (and the formatting it brings) and ``_threads`` load with the first patch
# that needs them (_load_origin), not at install(): MONSTACK=1 start-up stays light.
_LOOPS: dict = {}
_ThreadStart: Any = None


def _load_origin() -> None:
    """Bind what the replacements use from ``_origin`` and ``_threads`` (once)."""
    global _attach_if_absent, _drop_own_entry, _snap, _WithOrigin, _LOOPS, _ThreadStart
    if _ThreadStart is not None:
        return
    from . import _origin, _threads

    _attach_if_absent, _drop_own_entry, _snap = _origin._attach_if_absent, _origin._drop_own_entry, _origin._snap
    _WithOrigin = _origin._WithOrigin  # type: ignore[misc]  # (bound here, typed by the import above)
    _LOOPS = _threads.LOOPS
    _ThreadStart = _define_thread_start(_origin._WithOrigin)

#: Points switched on now (read by the replacements on every call).
_ON: set = set()
#: In ``_ON`` while installed: greenlet switches swap shadow stacks (not a point of its own).
_GREENLETS = "(greenlet switches)"
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
                for trigger, apply in _APPLY[name]:
                    if trigger in sys.modules:
                        _apply(name, apply)
                    else:  # patch when the program imports it: install() stays cheap
                        _PENDING.setdefault(trigger, []).append((name, apply))
        # not a propagation point: each greenlet gets its own shadow stack (_greenlet)
        _ON.add(_GREENLETS)
        if "greenlet" in sys.modules:
            _start_greenlets()
        else:
            _PENDING.setdefault("greenlet", []).append((_GREENLETS, _start_greenlets))
        if _PENDING and _HOOK not in sys.meta_path:
            sys.meta_path.insert(0, _HOOK)
    except BaseException:
        stop()
        raise


def stop() -> None:
    """Undo every patch ``start`` made: the original objects are put back (identity)."""
    _ON.clear()
    greenlet_mod = sys.modules.get(f"{__package__}._greenlet")
    if greenlet_mod is not None:
        greenlet_mod.stop()
    _PENDING.clear()
    try:
        sys.meta_path.remove(_HOOK)
    except ValueError:
        pass
    while _PATCHES:
        owner, attr, original, replacement = _PATCHES.pop()
        try:
            if owner.__dict__.get(attr) is replacement:
                if (owner, attr) in _INHERITED:
                    delattr(owner, attr)  # it was the base class's: show that one again
                else:
                    setattr(owner, attr, original)
            # else: somebody patched over us; our replacement now just calls through.
        except Exception:
            pass
    _INHERITED.clear()
    dask_mod = sys.modules.get(f"{__package__}._dask")
    if dask_mod is not None:
        dask_mod.forget()
    _snapshot.set_chain_limit(_snapshot.DEFAULT_CHAIN_LIMIT)


def _start_greenlets() -> None:
    from . import _greenlet

    _greenlet.start()


def _apply(name: str, apply: Callable[[], None]) -> None:
    """Patch one part of point ``name`` (the origin machinery loaded first, except for
    ``_thread``'s patch, applied at every install: it loads it on its first call)."""
    if name != "start_new_thread":
        _load_origin()
    apply()


def patched() -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, original)`` of every patch in place (for tests and ``info``)."""
    return [(owner, attr, original) for owner, attr, original, _r in _PATCHES]


#: (owner, attribute) patched on a class that only inherited it (uvloop.Loop).
_INHERITED: set = set()


def _patch(owner: Any, attr: str, make: Callable[[Any], Any], inherited: bool = False) -> None:
    if inherited and attr not in owner.__dict__:
        original = getattr(owner, attr)
        _INHERITED.add((owner, attr))
    else:
        original = owner.__dict__[attr]
    replacement = make(original)
    try:
        _update_wrapper(replacement, original)
    except Exception:
        pass
    setattr(owner, attr, replacement)
    _PATCHES.append((owner, attr, original, replacement))


def _update_wrapper(wrapper: Any, wrapped: Any) -> None:
    """``functools.update_wrapper``; without importing functools before the program does
    (``_thread``'s patch, at start-up, is on builtins: there it copies the same)."""
    functools = sys.modules.get("functools")
    if functools is not None:
        functools.update_wrapper(wrapper, wrapped)
        return
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        try:
            setattr(wrapper, attr, getattr(wrapped, attr))
        except AttributeError:
            pass
    wrapper.__dict__.update(getattr(wrapped, "__dict__", {}))
    wrapper.__wrapped__ = wrapped


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


# -- _thread.start_new_thread --------------------------------------------------------------------


def _apply_start_new_thread() -> None:
    import _thread

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def start_new_thread(function: Any, args: Any, *kwargs: Any) -> Any:
            if "start_new_thread" not in _ON or _threading_bootstrap(function):
                return original(function, args, *kwargs)
            from ._origin import _opaque, has_origin  # (loaded on the first call: see _apply)

            if has_origin(function) or _opaque(function):
                return original(function, args, *kwargs)
            _load_origin()
            snap = _take()
            if snap is None:
                return original(function, args, *kwargs)
            return original(_ThreadStart(function, snap), args, *kwargs)

        return start_new_thread

    _patch(_thread, "start_new_thread", make)
    if "start_new" in _thread.__dict__:  # the obsolete synonym (its own builtin)
        _patch(_thread, "start_new", make)


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
            snap = self._snap
            token = CURRENT_ORIGIN.set(snap)
            ident = _thread.get_ident()
            _snapshot.RUNNING[ident] = snap  # (a new thread: nothing ran before)
            try:
                return self.__wrapped__(*args, **kwargs)
            except Exception as exc:
                _attach_if_absent(exc, snap)
                _drop_own_entry(exc, sys._getframe())
                if _report_unraisable(exc, self):
                    return None
                raise
            except BaseException as exc:
                _drop_own_entry(exc, sys._getframe())
                raise
            finally:
                _snapshot.RUNNING.pop(ident, None)
                try:
                    CURRENT_ORIGIN.reset(token)
                except Exception:
                    pass

        def __repr__(self) -> str:
            try:
                return repr(self.__wrapped__)
            except Exception:
                return base.__repr__(self)

    ThreadStart.__name__ = ThreadStart.__qualname__ = "_ThreadStart"
    return ThreadStart


def _report_unraisable(exc: BaseException, function: Any) -> bool:
    """The default ``sys.unraisablehook`` of 3.11-3.14 prints no notes: print its report
    ourselves, with the note (what 3.15's default hook prints). True if printed; any
    other hook (yours, pytest's) gets the exception as usual, note attached."""
    from . import _env

    if _env.PYVERSION[:2] >= (3, 15) or sys.unraisablehook is not sys.__unraisablehook__:
        return False
    try:
        import traceback

        if _env.PYVERSION[:2] >= (3, 13):
            head = f"Exception ignored in thread started by {function!r}:\n"
        else:
            head = f"Exception ignored in thread started by: {function!r}\n"
        text = head + "".join(traceback.format_exception(exc))
        stderr = sys.stderr
        if stderr is None:
            return True
        stderr.write(text)
        stderr.flush()
        return True
    except Exception:
        return False


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


# -- dask (the code lives in _dask; imported only when distributed is) -----------------------------


def _apply_dask() -> None:
    from . import _dask

    client_mod = sys.modules["distributed.client"]
    try:
        _dask.recognise(client_mod)
    except Exception as exc:  # a distributed this patch does not know: say so, run on
        _patch_failed("dask", exc)
        return
    for owner, attr, make in _dask.make_patches(client_mod, lambda: "dask" in _ON, _take):
        _patch(owner, attr, make)


# -- celery (the code lives in _celery; imported only when Celery is) --------------------------------


def _celery_part(part: str) -> Callable[[], None]:
    """Patch one Celery module (signals, app.trace, result); a Celery the patch does not
    know is reported (once) and the program runs on unchanged."""

    def apply() -> None:
        from . import _celery

        try:
            if part == "signals":
                _celery.apply_signals(_ON, _take)
            elif part == "trace":
                _celery.apply_trace(_patch, _ON)
            else:
                _celery.apply_result(_patch, _ON)
        except Exception as exc:
            _patch_failed("celery", exc)

    return apply


#: Each point: (the module whose import makes it patchable, how to patch it there), for
#: each part of it.
_APPLY: dict[str, tuple[tuple[str, Callable[[], None]], ...]] = {
    "threading": (("threading", _apply_threading),),
    "start_new_thread": (("_thread", _apply_start_new_thread),),
    "thread_pool": (("concurrent.futures.thread", _apply_thread_pool),),
    "process_pool": (("concurrent.futures.process", _apply_process_pool),),
    "asyncio_tasks": (("asyncio", _apply_asyncio_tasks), ("uvloop", _apply_uvloop_tasks)),
    "asyncio_executor": (("asyncio", _apply_asyncio_executor), ("uvloop", _apply_uvloop_executor)),
    "process": (("multiprocessing.process", _apply_process),),
    "mp_pool": (("multiprocessing.pool", _apply_mp_pool),),
    "trio": (("trio", _apply_trio),),
    "celery": (("celery.signals", _celery_part("signals")), ("celery.app.trace", _celery_part("trace")),
               ("celery.result", _celery_part("result"))),
    "dask": (("distributed.client", _apply_dask),),
}


# -- patching modules when they are first imported ---------------------------------------------

#: Trigger module -> (point, patch) waiting for it to be imported.
_PENDING: dict[str, list[tuple[str, Callable[[], None]]]] = {}


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
        for name, apply in _PENDING.pop(self._name, ()):
            if name in _ON:
                try:
                    _apply(name, apply)
                except Exception as exc:  # never break the program's import; but say so
                    _patch_failed(name, exc)
        if not _PENDING:
            try:
                sys.meta_path.remove(_HOOK)
            except ValueError:
                pass


def describe() -> dict[str, str]:
    """The propagation part of ``monstack.status()`` (and ``info``): the points on, the
    modules whose import will patch (points are patched when the program imports their
    module), and the points whose patch failed, with why."""
    on = [name for name in PROPAGATION_POINTS if name in _ON]
    out = {"propagation": ", ".join(on) if on else "off"}
    waiting = sorted(trigger for trigger, entries in _PENDING.items()
                     if any(name in PROPAGATION_POINTS for name, _ in entries))
    if waiting:
        out["patched at import of"] = ", ".join(waiting)
    if FAILED:
        out["propagation failed"] = "; ".join(f"{name} ({why})" for name, why in FAILED.items())
    return out


def _patch_failed(name: str, exc: BaseException) -> None:
    """A point could not be patched when its module was imported: the program goes on,
    that point's work gets no origin, and the user is told (a MonstackWarning, or a line
    on stderr where warnings are errors: never an exception inside their import), once
    per point and install (a point patched in several modules fails in each)."""
    if name in FAILED:
        return
    FAILED[name] = f"{type(exc).__name__}: {exc}"
    try:
        warn(f"monstack: could not patch propagation point {name!r} ({FAILED[name]}); "
             "work it creates gets no origin")
    except Exception:
        pass


#: Points whose patch failed when their module was imported: name -> error (for tests, info).
FAILED: dict[str, str] = {}

_HOOK = _PostImportHook()
