"""The ``rq`` propagation point: an RQ job shows the line that enqueued it.

Applied when the program imports ``rq.job`` (never imported here: monstack has no
dependencies; RQ's modules are taken from ``sys.modules``). Two patches on
``rq.job.Job`` (custom ``job_class``es that inherit them or call them are covered), and
one on the forking ``Worker`` (below):

- ``Job.create`` (a classmethod): the one path ``Queue.enqueue``, ``enqueue_call``,
  ``enqueue_many`` (``prepare_data``), ``enqueue_at``/``enqueue_in`` and
  ``@job``-decorated ``.delay`` create jobs through. The new job's ``meta`` gets
  :data:`META_KEY`: the creating snapshot in its portable form as one JSON text with a
  key naming that encoding (the ``celery`` point's header value, the same code), plain
  strings that RQ's pickle and JSON serializers both store. A meta that has the key
  already (a caller's) is kept; the caller's dict is never changed (the job gets a copy).
- ``Job.perform``: what every worker runs the job through (the forking ``Worker``'s work
  horse, ``SimpleWorker`` in the worker's process, ``SpawnWorker``'s spawned horse, a
  synchronous queue). The job runs with the decoded snapshot as its current origin
  (``WithOrigin``), and its exception carries the "Work created at" note before RQ
  formats ``exc_string``: the stored traceback (``job.latest_result().exc_string``,
  ``job.exc_info``, dashboards) and the worker's log show the enqueue line.

The forking ``Worker`` decodes the snapshot before it forks (``Worker.fork_work_horse``,
applied when the program imports ``rq.worker``), once per distinct line, so that its
horses find it decoded.

A job without the key (enqueued by a client without monstack, or with the point off)
runs exactly as before; a key that cannot be read runs the job without an origin. Any
other failure inside the point does the same, with one ``MonstackWarning``.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Optional

from .._errors import warn_once
from .._origin import drop_own_entry, WithOrigin
from .._snapshot import Snapshot
from . import MIN_VERSIONS, ON, CannotEnable, binder, patch, update_wrapper
from .celery import decode_header, header_value, publishing_snapshot

#: The key of ``job.meta`` carrying the creating snapshot (RQ's own ``job.origin`` is the
#: queue's name; the ``celery`` point's header has this name too).
META_KEY = "monstack_origin"
POINT = "rq"


def _version_text() -> str:
    """RQ's version. ``rq.job`` is imported while ``rq/__init__`` runs, before it sets
    ``rq.__version__``: ``rq.version`` (a constant, no imports) says it then."""
    text = getattr(sys.modules.get("rq"), "__version__", None)
    if not text:
        module = sys.modules.get("rq.version")
        if module is None:
            try:
                __import__("rq.version")
                module = sys.modules.get("rq.version")
            except Exception:
                module = None
        text = getattr(module, "VERSION", None)
    return str(text or "")


def _check_version() -> str:
    text = _version_text()
    try:
        version = tuple(int(p) for p in text.split(".")[:2])
    except ValueError:
        version = ()
    minimum = MIN_VERSIONS["rq"]
    if len(version) < 2 or version < minimum:
        raise CannotEnable(f"rq {text or '(unknown version)'} is not supported "
                           f"(needs rq >= {'.'.join(map(str, minimum))})")
    return text


def recognise(job_mod: Any) -> Any:
    """Check that ``rq.job`` is one the patch knows (version, internals); raise
    :class:`CannotEnable` otherwise. Returns ``Job``."""
    text = _check_version()
    try:
        Job = job_mod.Job
        create = Job.__dict__.get("create")
        if not isinstance(create, classmethod):
            raise CannotEnable("Job.create is not a classmethod")
        if "meta" not in inspect.signature(create.__func__).parameters:
            raise CannotEnable("Job.create has no meta")
        perform = Job.__dict__.get("perform")
        if not callable(perform) or list(inspect.signature(perform).parameters) != ["self"]:
            raise CannotEnable("Job.perform(self) changed")
    except CannotEnable as exc:
        raise CannotEnable(f"rq {text}: {exc}") from None
    except Exception as exc:
        raise CannotEnable(f"rq {text}: {type(exc).__name__}: {exc}") from None
    return Job


def _internal_error(where: str, exc: BaseException) -> None:
    warn_once("monstack-point-failed", f"the rq point failed in {where} ({type(exc).__name__}: {exc}); "
              "jobs run without an origin there")


def _mark(job: Any) -> None:
    """Give a new job the creating snapshot in its meta (a copy of the caller's dict)."""
    meta = job.meta
    if not isinstance(meta, dict) or META_KEY in meta:
        return
    snap = publishing_snapshot()
    if snap is None:
        return
    job.meta = {**meta, META_KEY: header_value(snap)}


def origin_of_job(job: Any) -> Optional[Snapshot]:
    """The snapshot a job's meta carries, or None (none there, or not one of ours)."""
    meta = getattr(job, "meta", None)
    if not isinstance(meta, dict):
        return None
    value = meta.get(META_KEY)
    if value is None:
        return None
    try:
        return decode_header(value)
    except (ValueError, TypeError):
        return None


def _note_for_report(exc: BaseException, run: Any) -> None:
    try:
        from .._origin import stored_origin, set_note

        snap = stored_origin(exc) or getattr(run, "_snap", None)
        if snap is not None:
            set_note(exc, snap)
    except Exception:
        pass


def apply() -> None:
    Job = recognise(sys.modules["rq.job"])
    on = ON

    def make_create(original: Any) -> Any:
        # A classmethod (or whatever stands there): called as ``cls.create(...)`` calls it,
        # through its ``__get__`` with no instance and the class it is called on.
        get = type(original).__get__

        def create(cls: Any, *args: Any, **kwargs: Any) -> Any:
            job = get(original, None, cls)(*args, **kwargs)
            if POINT in on:
                try:
                    _mark(job)
                except Exception as exc:
                    _internal_error("Job.create", exc)
            return job

        update_wrapper(create, original.__func__)  # (its signature and docs)
        return classmethod(create)

    def make_perform(original: Callable[..., Any]) -> Callable[..., Any]:
        call = binder(original)  # call(job): as job.perform() would

        def perform(self: Any) -> Any:
            run = call
            if POINT in on:
                try:
                    snap = origin_of_job(self)
                    if snap is not None:
                        run = WithOrigin(call, snap)
                except Exception as exc:
                    _internal_error("Job.perform", exc)
            try:
                return run(self)
            except BaseException as exc:
                drop_own_entry(exc, sys._getframe())  # the job's traceback as RQ's own
                if run is not call:
                    # RQ catches this in the worker and stores its formatted text (what
                    # latest_result().exc_string and dashboards show): a report, so the
                    # origin goes in as a note whatever the notes mode (no program
                    # catches this exception object).
                    _note_for_report(exc, run)
                raise

        return perform

    patch(Job, "create", make_create)
    patch(Job, "perform", make_perform)


def apply_worker() -> None:
    """The forking ``Worker`` decodes a job's snapshot before it forks the work horse:
    decoded once per distinct line in the worker (cached by key), the horse inherits it.
    Decoding in each new horse instead costs ~300 us a job (its first allocations after
    fork()), against ~50 us in a warm process."""
    text = _check_version()
    Worker = getattr(sys.modules["rq.worker"], "Worker", None)
    if Worker is None or not callable(Worker.__dict__.get("fork_work_horse")):
        raise CannotEnable(f"rq {text}: Worker.fork_work_horse is missing")
    on = ON

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        call = binder(original)  # call(worker, ...): as worker.fork_work_horse(...) would

        def fork_work_horse(self: Any, job: Any, *args: Any, **kwargs: Any) -> Any:
            if POINT in on:
                try:
                    origin_of_job(job)  # (the horse finds it decoded)
                except Exception:
                    pass
            return call(self, job, *args, **kwargs)

        return fork_work_horse

    patch(Worker, "fork_work_horse", make)
