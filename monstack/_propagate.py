"""Automatic propagation of origins: threads, executors, asyncio, multiprocessing, trio.

``install(propagate=...)`` names the points to patch (``PROPAGATION_POINTS``):

- ``"threading"``: ``threading.Thread.start`` (so ``Timer`` too). The new thread runs
  with the starter's snapshot as its origin; an exception ending it carries the origin,
  which ``threading.excepthook``'s report shows (``_points.reports``).
- ``"start_new_thread"``: ``_thread.start_new_thread`` (and its alias ``start_new``). The
  function runs with the starting line as its origin; its failure carries it to
  ``sys.unraisablehook``, and where that is the default one the report is printed with
  the origin where that hook prints notes.
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
  the child prints when it fails shows "Work created at". The worker processes
  of pools and managers are left alone.
- ``"mp_pool"``: ``multiprocessing.pool.Pool``'s ``apply_async``, ``_map_async`` and
  ``imap``/``imap_unordered`` (so ``apply``, ``map``, ``starmap`` and their ``_async``
  forms, for process pools and ``ThreadPool``). Each job runs with the calling line as
  its origin; the exception ``get()`` raises carries it (pickled back with the
  exception, and attached again in the parent by an error callback if pickling lost it).
- ``"celery"``: Celery tasks (``delay``, ``apply_async``, canvas, eager ``apply``) run
  under the publishing line and fail with it, on the worker and in ``AsyncResult.get()``;
  the snapshot travels in the message's headers. Patched only once the program imports
  Celery (see ``monstack._points.celery``).
- ``"dask"``: ``distributed.Client.submit`` and ``Client.map`` (clients made inside
  tasks too): the task runs on the worker under the submitting line, whose failure origin
  travels back with the exception; the client attaches it again to exceptions that
  arrive without it (a dead worker's ``KilledWorker``, errors Dask replaced). Patched
  only once the program imports ``distributed``; the code is in ``_points.dask``.
- ``"rq"``: RQ's ``Job.create`` (every enqueue) puts the creating line in the job's
  ``meta``; ``Job.perform`` runs the job under it on any worker, and the stored
  traceback carries it. Patched only once the program imports ``rq.job``; the code is
  in ``_points.rq``.
- ``"trio"``: tasks started with ``nursery.start_soon``/``nursery.start`` (trio's
  ``Runner.spawn_impl``: the task's own context gets the origin; the exception it exits
  with gets it attached) and ``trio.to_thread.run_sync``. Patched only once the program
  imports trio.

The callable a library receives answers as the user's does (``_origin.WithOrigin``), and
callables no wrapper can stand in for (coroutine and generator functions, non-callables)
are passed on unwrapped (``_origin.carry``).

The points' code is in ``monstack._points``, one module per family, each imported when
the program imports a module its points patch (the registry, ``_points.REGISTRY``, names
them by dotted name; ``_points`` also holds the contract they follow and their shared
state). This module switches them on and off.

Each replacement checks whether its point is still on and otherwise calls straight
through, so a patch that somebody else wrapped after us is harmless after ``stop()``;
``stop()`` puts the identical original objects back wherever ours is still in place.
The snapshot is the only cost on the creating side (O(1) with a tracking backend).
"""

from __future__ import annotations

import sys

from . import _points, _snapshot
from ._errors import warn
from ._points import GREENLET_PARTS, GREENLETS, ON, PATCHES, REGISTRY, REPORT_PARTS, REPORTS, CannotEnable
from ._settings import PROPAGATION_POINTS

# Nothing here imports ``threading`` (or ``typing``, ``functools``...) at start-up: a
# program that must run before threading is imported (gevent's monkey-patching, say)
# still can under MONSTACK=1; the ``threading`` point is patched when it is imported.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def check_points(value: Any) -> frozenset:
    if value is True:
        return frozenset(PROPAGATION_POINTS)
    if value is False or value is None:
        return frozenset()
    if isinstance(value, str):
        if value == "all":  # as MONSTACK_PROPAGATE=all says
            return frozenset(PROPAGATION_POINTS)
        if value == "none":
            return frozenset()
        names = frozenset([value])
    else:
        try:
            names = frozenset(value)
        except TypeError:
            raise ValueError(
                f"propagate must be True, False, \"all\", \"none\" or names from {list(PROPAGATION_POINTS)}, "
                f"got {value!r}"
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
                ON.add(name)
                _arm(name, REGISTRY[name])
        # not a propagation point: each greenlet gets its own shadow stack (_points.greenlet)
        ON.add(GREENLETS)
        _arm(GREENLETS, GREENLET_PARTS)
        # nor this: the hooks that report uncaught failures show origins (_points.reports)
        ON.add(REPORTS)
        _arm(REPORTS, REPORT_PARTS)
        if _PENDING and _HOOK not in sys.meta_path:
            sys.meta_path.insert(0, _HOOK)
    except BaseException:
        stop()
        raise


def _arm(name: str, parts: tuple[tuple[str, str], ...]) -> None:
    for trigger, where in parts:
        if trigger in sys.modules:
            _apply(name, where)
        else:  # patch when the program imports it: install() stays cheap
            _PENDING.setdefault(trigger, []).append((name, where))


def stop() -> None:
    """Undo every patch ``start`` made: the original objects are put back (identity)."""
    ON.clear()
    _PENDING.clear()
    try:
        sys.meta_path.remove(_HOOK)
    except ValueError:
        pass
    for family in _FAMILIES:  # each loaded family's own stop()
        family_stop = getattr(sys.modules.get(f"{_points.__name__}.{family}"), "stop", None)
        if family_stop is not None:
            try:
                family_stop()
            except Exception:
                pass
    _points.undo()
    _snapshot.set_chain_limit(_snapshot.DEFAULT_CHAIN_LIMIT)


#: The families, by module name in ``monstack._points``.
_FAMILIES = tuple(dict.fromkeys(where.rpartition(".")[0] for parts in (*REGISTRY.values(), GREENLET_PARTS, REPORT_PARTS)
                                for _trigger, where in parts if "." in where))


def _apply(name: str, where: str) -> None:
    """Apply one part of point ``name``: ``where`` is ``"family.function"`` in
    ``monstack._points`` (the family imported now, with what its points need), or
    ``"function"`` of ``monstack._points`` itself. A
    :class:`CannotEnable` is reported (once) and the program runs on without the point."""
    family, _, function = where.rpartition(".")  # (no family: a function of _points itself)
    module = _points.family(family) if family else _points
    try:
        getattr(module, function)()
    except CannotEnable as exc:
        _patch_failed(name, exc)


def patched() -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, original)`` of every patch in place (for tests and ``info``)."""
    return [(owner, attr, original) for owner, attr, original, _r in PATCHES]


# -- patching modules when they are first imported ---------------------------------------------

#: Trigger module -> (point, "family.function") waiting for it to be imported.
_PENDING: dict[str, list[tuple[str, str]]] = {}


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
        for name, where in _PENDING.pop(self._name, ()):
            if name in ON:
                try:
                    _apply(name, where)
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
    on = [name for name in PROPAGATION_POINTS if name in ON]
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
        warn("monstack-patch-failed", f"could not patch propagation point {name!r} ({FAILED[name]}); "
             "work it creates gets no origin")
    except Exception:
        pass


#: Points whose patch failed when their module was imported: name -> error (for tests, info).
FAILED: dict[str, str] = {}

_HOOK = _PostImportHook()
