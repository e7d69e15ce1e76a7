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
    from typing import Any, Callable, Optional

    from ._origin import _attach_if_absent, _drop_own_entry, _snap

# ``_origin`` (and the formatting it brings) loads with the first patch that needs it
# (_load_origin), and most points' code (``_points``) with the first of them: not at
# install(), so MONSTACK=1 start-up stays light.
_ThreadStart: Any = None


def _load_origin() -> None:
    """Bind what the replacements here use from ``_origin`` (once)."""
    global _attach_if_absent, _drop_own_entry, _snap, _ThreadStart
    if _ThreadStart is not None:
        return
    from . import _origin

    _attach_if_absent, _drop_own_entry, _snap = _origin._attach_if_absent, _origin._drop_own_entry, _origin._snap
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


def _point(function: str) -> Callable[[], None]:
    """How to apply a point whose code is in ``_points`` (imported with the first of them)."""

    def apply() -> None:
        from . import _points

        _points.bind(_ON, _PATCHES, _patch, _take)
        getattr(_points, function)()

    return apply


#: Each point: (the module whose import makes it patchable, how to patch it there), for
#: each part of it.
_APPLY: dict[str, tuple[tuple[str, Callable[[], None]], ...]] = {
    "threading": (("threading", _point("_apply_threading")),),
    "start_new_thread": (("_thread", _apply_start_new_thread),),
    "thread_pool": (("concurrent.futures.thread", _point("_apply_thread_pool")),),
    "process_pool": (("concurrent.futures.process", _point("_apply_process_pool")),),
    "asyncio_tasks": (("asyncio", _point("_apply_asyncio_tasks")), ("uvloop", _point("_apply_uvloop_tasks"))),
    "asyncio_executor": (("asyncio", _point("_apply_asyncio_executor")), ("uvloop", _point("_apply_uvloop_executor"))),
    "process": (("multiprocessing.process", _point("_apply_process")),),
    "mp_pool": (("multiprocessing.pool", _point("_apply_mp_pool")),),
    "trio": (("trio", _point("_apply_trio")),),
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
