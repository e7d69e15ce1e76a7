"""The ``ray`` propagation point: a failed Ray task or actor call raises on the driver with
the ``.remote()`` line that submitted it.

Applied when the program imports ``ray`` (never imported here: the engine's modules are
taken from ``sys.modules``). Everything happens in the process that submits, which owns
the task's results:

- ``RemoteFunction._remote``, ``ActorClass._remote`` and ``ActorMethod._remote`` (what
  ``f.remote()``, ``f.options(...).remote()``, ``Actor.remote()`` and
  ``actor.method.remote()`` call) take the submitting snapshot and keep it under each
  returned ``ObjectRef``'s id (an actor's creation snapshot under its actor id). Nothing is
  added to the task: its arguments, signature and exported function stay Ray's own.
- ``Worker.deserialize_objects``, which turns every result into a value (``ray.get``,
  ``await ref`` and ``ref.future()`` all go through it), gives a ``RayError`` whose ref has
  a snapshot that origin before Ray raises it: on the error and on its ``cause`` (the
  user's exception, which the ``RayTaskError(ValueError)`` Ray raises forwards its
  attributes to, and which travels pickled when a task re-raises it). An actor whose
  ``__init__`` failed gets its creation line. A result fetched without error drops its
  ref's snapshot; at most :data:`MAX_REFS` are kept (the oldest go first).
- Nesting: a worker with monstack on (``MONSTACK=1``) does the same for the tasks it
  submits, so the exception of a nested failure arrives with the inner ``.remote()``
  line (taken in the worker, with no origin below it: Ray gives no per-call channel to
  the worker but the arguments); the driver then links its own submit line below that
  chain's oldest hop ("Which ran in work created at"). Inside a task,
  ``monstack.current_origin()`` stays None.

The origin is kept in the exceptions' ``__dict__`` only (``str()``, the worker's text that
``RayTaskError`` carries and ``__notes__`` stay Ray's); notes mode adds one note on the
driver, never in a worker (the worker's text would carry it and the driver show it twice).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Optional

from .._errors import warn_once
from .._origin import has_frames, stored_origin, set_note, store_origin, notes_on
from .._snapshot import Snapshot
from . import ON, CannotEnable, binder, check_version, patch, take

POINT = "ray"

#: Live refs' snapshots (``ObjectRef.binary()`` -> snapshot) and actors' creation
#: snapshots (actor id hex -> snapshot); past the limit the oldest are dropped.
MAX_REFS = 65_536
MAX_ACTORS = 4096
_REFS: dict = {}
_ACTORS: dict = {}

#: What the patch needs from Ray, found by ``recognise``.
_RAY: dict[str, Any] = {}


def recognise() -> None:
    """Check that Ray is a version with the internals the patch knows; raise CannotEnable."""
    check_version("ray")
    version = getattr(sys.modules.get("ray"), "__version__", "?")
    try:
        worker_mod = sys.modules["ray._private.worker"]
        exceptions = sys.modules["ray.exceptions"]
        Worker = worker_mod.Worker
        deserialize = Worker.__dict__.get("deserialize_objects")
        if not callable(deserialize):
            raise CannotEnable("Worker.deserialize_objects is missing")
        if list(inspect.signature(deserialize).parameters)[:3] != ["self", "serialized_objects", "object_refs"]:
            raise CannotEnable("Worker.deserialize_objects(serialized_objects, object_refs) changed")
        owners = {"RemoteFunction": sys.modules["ray.remote_function"].RemoteFunction,
                  "ActorClass": sys.modules["ray.actor"].ActorClass,
                  "ActorMethod": sys.modules["ray.actor"].ActorMethod}
        for name, owner in owners.items():
            if not callable(owner.__dict__.get("_remote")):
                raise CannotEnable(f"{name}._remote is missing")
        for name in ("RayError", "RayTaskError", "RayActorError"):
            if not isinstance(getattr(exceptions, name, None), type):
                raise CannotEnable(f"ray.exceptions.{name} is missing")
        if "cause" not in inspect.signature(exceptions.RayTaskError).parameters:
            raise CannotEnable("RayTaskError has no cause")
        ObjectRef = sys.modules["ray._raylet"].ObjectRef
        mode = worker_mod.WORKER_MODE
    except CannotEnable as exc:
        raise CannotEnable(f"ray {version}: {exc}") from None
    except Exception as exc:
        raise CannotEnable(f"ray {version}: {type(exc).__name__}: {exc}") from None
    _RAY.update(Worker=Worker, owners=owners, ObjectRef=ObjectRef, worker_mode=mode,
                RayError=exceptions.RayError, RayTaskError=exceptions.RayTaskError,
                RayActorError=exceptions.RayActorError)


def _internal_error(where: str, exc: BaseException) -> None:
    warn_once("monstack-point-failed", f"the ray point failed in {where} ({type(exc).__name__}: {exc}); "
              "its tasks' failures show no origin there")


def _keep(table: dict, key: Any, snap: Snapshot, limit: int) -> None:
    if len(table) >= limit:
        try:
            del table[next(iter(table))]
        except (StopIteration, KeyError, RuntimeError):  # (another thread got there)
            pass
    table[key] = snap


def _remember(result: Any, snap: Snapshot) -> None:
    """Keep ``snap`` for the refs a submit returned (one, a list, a generator's)."""
    ObjectRef = _RAY["ObjectRef"]
    if isinstance(result, ObjectRef):
        _keep(_REFS, result.binary(), snap, MAX_REFS)
    elif type(result) is list:
        for ref in result:
            if isinstance(ref, ObjectRef):
                _keep(_REFS, ref.binary(), snap, MAX_REFS)
    else:  # ObjectRefGenerator (streaming): the generator task's own ref
        ref = getattr(result, "_generator_ref", None)
        if isinstance(ref, ObjectRef):
            _keep(_REFS, ref.binary(), snap, MAX_REFS)


def stop() -> None:
    """Drop every kept snapshot (the point is being unpatched)."""
    _REFS.clear()
    _ACTORS.clear()


def _linked(carried: Snapshot, base: Snapshot) -> Snapshot:
    """``carried`` (an origin made in the worker, nothing below it) with ``base`` linked
    below its oldest hop; ``carried`` itself where its chain was cut (it then says so)."""
    hops: list[Snapshot] = []
    snap: Optional[Snapshot] = carried
    while snap is not None and len(hops) < 1000:
        hops.append(snap)
        snap = snap._origin
    if snap is not None or hops[-1]._dropped:
        return carried
    linked = base
    for hop in reversed(hops):
        if hop._records is not None:  # (restored from the worker's pickle: its records)
            linked = Snapshot._from_records(hop._records, linked)
        else:
            linked = Snapshot._new(hop._node, hop._lasti, linked)
    return linked


def _give(value: Any, snap: Snapshot, in_worker: bool) -> None:
    """Record ``snap`` as the origin of the error ``value`` and of its cause."""
    if not has_frames(snap):
        return
    cause = getattr(value, "cause", None) if isinstance(value, _RAY["RayTaskError"]) else None
    if not isinstance(cause, BaseException):
        cause = None
    carried = stored_origin(cause) if cause is not None else stored_origin(value)
    if carried is not None:
        snap = _linked(carried, snap)
    for target in (cause, value):
        if target is not None:
            store_origin(target, snap)
    if not in_worker and notes_on():
        # The RayTaskError(...) Ray raises forwards __notes__ to the cause; the error
        # itself is raised where its cause's class cannot be subclassed.
        for target in (cause, value):
            if target is not None:
                set_note(target, snap)


def apply() -> None:
    recognise()
    on = ON
    refs = _REFS
    actors = _ACTORS
    ObjectRef = _RAY["ObjectRef"]
    RayError = _RAY["RayError"]
    RayActorError = _RAY["RayActorError"]
    worker_mode = _RAY["worker_mode"]

    def make_submit(original: Callable[..., Any]) -> Callable[..., Any]:
        call = binder(original)  # calls it as Python would: through __get__

        def _remote(self: Any, *args: Any, **kwargs: Any) -> Any:
            if POINT not in on:
                return call(self, *args, **kwargs)
            snap = take()
            result = call(self, *args, **kwargs)
            if snap is not None:
                try:
                    _remember(result, snap)
                except Exception as exc:
                    _internal_error("submit", exc)
            return result

        return _remote

    def make_create(original: Callable[..., Any]) -> Callable[..., Any]:
        call = binder(original)

        def _remote(self: Any, *args: Any, **kwargs: Any) -> Any:
            if POINT not in on:
                return call(self, *args, **kwargs)
            snap = take()
            handle = call(self, *args, **kwargs)
            if snap is not None:
                try:
                    actor_id = getattr(handle, "_ray_actor_id", None)
                    if actor_id is not None:
                        _keep(actors, actor_id.hex(), snap, MAX_ACTORS)
                except Exception as exc:
                    _internal_error("actor creation", exc)
            return handle

        return _remote

    def make_deserialize(original: Callable[..., Any]) -> Callable[..., Any]:
        call = binder(original)

        def deserialize_objects(self: Any, serialized_objects: Any, object_refs: Any, *args: Any, **kwargs: Any) -> Any:
            values = call(self, serialized_objects, object_refs, *args, **kwargs)
            if refs and POINT in on:
                try:
                    in_worker = None
                    for ref, value in zip(object_refs, values):
                        if not isinstance(ref, ObjectRef):
                            continue
                        if not isinstance(value, RayError):
                            refs.pop(ref.binary(), None)
                            continue
                        snap = refs.get(ref.binary())
                        if isinstance(value, RayActorError) and getattr(value, "_actor_init_failed", False):
                            snap = actors.get(getattr(value, "actor_id", None)) or snap
                        if snap is not None:
                            if in_worker is None:
                                in_worker = getattr(self, "mode", None) == worker_mode
                            _give(value, snap, in_worker)
                except Exception as exc:
                    _internal_error("Worker.deserialize_objects", exc)
            return values

        return deserialize_objects

    owners = _RAY["owners"]
    patch(owners["RemoteFunction"], "_remote", make_submit)
    patch(owners["ActorMethod"], "_remote", make_submit)
    patch(owners["ActorClass"], "_remote", make_create)
    patch(_RAY["Worker"], "deserialize_objects", make_deserialize)
