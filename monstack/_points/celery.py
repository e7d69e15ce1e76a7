"""The ``celery`` propagation point: a task shows the line that published it.

Loaded only once the program imports Celery (never imported here: monstack has no
dependencies). Three parts, each applied when its Celery module is imported, each
checking that the point is still on:

- publish (``celery.signals``): a ``before_task_publish`` receiver puts the publishing
  snapshot in the message's headers under :data:`HEADER`, as plain JSON-safe records
  (``Snapshot.to_portable()``: file names, line numbers, function names and the lines'
  text; no locals) written as one JSON text, only when the headers do not have it yet. A
  retry re-publishes the task with its own request's headers, so it keeps the client's
  origin; any other task published inside a task (from its body: chains the parent's
  origin; by Celery after the body: chain steps, callbacks, chord bodies: the parent's
  origin itself) links to the origin the parent runs under. The publishing process remembers what it published
  (a bounded map by task id, the ids of the chain members, callbacks and chord body the
  message carries included).
- run (``celery.signals``): ``task_prerun``/``task_postrun`` receivers make the header's
  snapshot the current origin while the task runs. An eager task (``task_always_eager``,
  ``Task.apply``) has no message: its origin is the line that applied it, put in its
  request's headers so that its retries keep it.
- fail (``celery.app.trace``): ``TraceInfo.handle_failure`` attaches the current origin
  (the "Work created at" note) to the exception before the worker logs it and the result
  backend serializes it; with the pickle result serializer it travels back with it.
- get (``celery.result``): ``AsyncResult.get()`` attaches the origin the publishing
  process remembers to the exception it raises when that exception lost it on the way
  (the JSON result serializer rebuilds exceptions without notes).

Signals rather than patches for publishing and running: the tracer Celery builds for each
task (worker pools, eager ``apply``) reads the receivers list when the task runs, so the
receivers work whenever monstack was installed (before or after the worker built its
tracers; ``monstack.install()`` in the app module), in eager mode, in the prefork
children (forked with the receivers) and in the solo pool, and a retry's headers are
seen as published. ``before_task_publish`` cannot see eager tasks, which are never
published: ``task_prerun`` covers them. ``task_failure`` comes after the result is
stored, too late for the note: that one part patches ``TraceInfo.handle_failure``.
The receivers stay connected after ``uninstall()`` (doing nothing while the point is
off); a later install reuses them (one ``dispatch_uid``).
"""

from __future__ import annotations

import json
import sys
import threading
from collections import OrderedDict
from typing import Any, Callable, Optional

from .. import _snapshot
from .._origin import attach_if_absent, drop_own_entry
from .._snapshot import CURRENT_ORIGIN, Snapshot
from . import ON, binder, check_version, patch, take

#: The message header carrying the publishing snapshot (Celery's own ``origin`` header
#: names the publishing host).
HEADER = "monstack_origin"
POINT = "celery"
#: What the publishing process published: task id -> snapshot (for ``AsyncResult.get()``),
#: oldest first. An OrderedDict: at the bound, dropping the oldest is O(1) (a dict's first
#: key, after deletions at its front, is found past every deleted slot: ~3.6 us per
#: publish at 4096 entries against ~0.3 us).
SUBMITTED: OrderedDict[str, Snapshot] = OrderedDict()
SUBMITTED_MAX = 4096
_DISPATCH_UID = "monstack.celery"

_per_thread = threading.local()


# -- publish and run: signal receivers ----------------------------------------------------------


def apply_signals() -> None:
    check_version("celery")
    on = ON
    signals = sys.modules["celery.signals"]
    publish, prerun, postrun = signals.before_task_publish, signals.task_prerun, signals.task_postrun

    def before_publish(sender: Any = None, body: Any = None, headers: Any = None, **_: Any) -> None:
        if POINT not in on or not isinstance(headers, dict):
            return
        if HEADER in headers:  # a retry (or a caller) that has one: kept
            held = headers[HEADER]
            if isinstance(held, Snapshot):  # an eager task's, in a message: encoded
                try:
                    headers[HEADER] = header_value(held)
                except Exception:
                    del headers[HEADER]
            return
        try:
            snap = publishing_snapshot()
            if snap is None:
                return
            headers[HEADER] = header_value(snap)
            _remember(headers.get("id"), snap)
            _remember_embedded(body, snap)
        except Exception:
            pass

    def task_prerun(sender: Any = None, task_id: Any = None, task: Any = None, **_: Any) -> None:
        if POINT not in on:
            return
        try:
            request = task.request
            snap = _request_origin(request)
            if snap is None:
                if not getattr(request, "is_eager", False):
                    return
                snap = take()  # the line that applied it (Celery's frames are not tracked)
                if snap is None:
                    return
                _give_eager_header(request, snap)
            stack = getattr(_per_thread, "tokens", None)
            if stack is None:
                stack = _per_thread.tokens = []
            stack.append((task_id, CURRENT_ORIGIN.set(snap)))
        except Exception:
            pass

    def task_postrun(sender: Any = None, task_id: Any = None, **_: Any) -> None:
        stack = getattr(_per_thread, "tokens", None)
        if not stack or stack[-1][0] != task_id:
            return
        try:
            CURRENT_ORIGIN.reset(stack.pop()[1])
        except Exception:
            pass

    publish.connect(before_publish, weak=False, dispatch_uid=_DISPATCH_UID)
    prerun.connect(task_prerun, weak=False, dispatch_uid=_DISPATCH_UID)
    postrun.connect(task_postrun, weak=False, dispatch_uid=_DISPATCH_UID)


def publishing_snapshot() -> Optional[Snapshot]:
    """The publishing line, linked to the origin it runs under; where no tracked code
    published (Celery after a task's body: chain steps, callbacks), that origin itself."""
    snap = take()
    if snap is not None and len(snap) == 0:
        current = CURRENT_ORIGIN.get()
        return current if current is not None else None
    return snap


#: Header values of recent snapshots: key -> (snapshot, header value). A loop publishing
#: from one line takes equal snapshots (the same shadow-stack node and offset, the same
#: origin; key ``(id(node), offset, id(origin), chain limit)``), and Celery re-publishes a
#: task's origin object itself (chain steps; key ``id(snapshot)``): each is encoded once
#: (~100 us for 20 frames). Holding the snapshot keeps the ids from being reused; bounded.
_SENT: dict[tuple, tuple] = {}
_SENT_MAX = 64
#: Snapshots decoded from header values, by their ``key`` (the worker side): a worker
#: gets the same one with every task a loop published. Bounded.
_RECEIVED: dict[str, Snapshot] = {}
_RECEIVED_MAX = 256
_prefix: list = []
_counter = iter(range(1 << 62))


def header_value(snap: Snapshot) -> dict:
    """``{"key": ..., "snapshot": snap.to_portable()}``: the key names this encoding (a
    random per-process prefix and a counter), so a receiver decodes each one once."""
    node = snap._node
    if node is None:  # restored, or an origin re-published as it is
        key: tuple = (id(snap),)
    else:
        key = (id(node), snap._lasti, id(snap._origin), _snapshot.CHAIN_LIMIT)
    entry = _SENT.get(key)
    if entry is not None and entry[0]._node is node and entry[0]._origin is snap._origin and (
            node is not None or entry[0] is snap):
        return entry[1]
    if not _prefix:
        import os

        _prefix.append(os.urandom(8).hex())
    # The records as one JSON text: the broker's serializer then handles one string per
    # message instead of ~200 small values (for 20 frames: ~70 us less per round trip,
    # bench/celery_cost.py), and a worker parses each key's text once.
    text = json.dumps(snap.to_portable(), separators=(",", ":"))
    value = {"key": f"{_prefix[0]}-{next(_counter)}", "snapshot": text}
    if len(_SENT) >= _SENT_MAX:
        try:
            del _SENT[next(iter(_SENT))]
        except Exception:
            pass
    _SENT[key] = (snap, value)
    return value


def decode_header(value: Any) -> Snapshot:
    """The snapshot of a header value; ValueError if malformed."""
    if type(value) is not dict:
        raise ValueError("not a monstack_origin header value")
    key = value.get("key")
    if type(key) is str:
        snap = _RECEIVED.get(key)
        if snap is not None:
            return snap
    data = value.get("snapshot")
    if type(data) is str:  # the JSON text header_value sends
        try:
            data = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"the monstack_origin header's snapshot is not JSON ({exc})") from None
    snap = Snapshot.from_portable(data)  # (a dict of records is accepted as well)
    if type(key) is str and len(key) <= 64:
        if len(_RECEIVED) >= _RECEIVED_MAX:
            try:
                del _RECEIVED[next(iter(_RECEIVED))]
            except Exception:
                pass
        _RECEIVED[key] = snap
    return snap


def _remember(task_id: Any, snap: Snapshot) -> None:
    if not isinstance(task_id, str):
        return
    try:
        while len(SUBMITTED) >= SUBMITTED_MAX:
            SUBMITTED.popitem(last=False)  # the oldest
    except Exception:
        pass
    SUBMITTED[task_id] = snap


def _remember_embedded(body: Any, snap: Snapshot) -> None:
    """The ids of the work a message carries (protocol 2's body ``(args, kwargs, embed)``):
    chain members, callbacks, errbacks and the chord body fail with the same exception
    (Celery marks a chain's remaining members failed) or are this origin's work."""
    if not isinstance(body, (tuple, list)) or len(body) < 3 or not isinstance(body[2], dict):
        return
    embed = body[2]
    for key in ("chain", "callbacks", "errbacks"):
        for sig in embed.get(key) or ():
            _remember_signature(sig, snap)
    _remember_signature(embed.get("chord"), snap)


def _remember_signature(sig: Any, snap: Snapshot) -> None:
    if isinstance(sig, dict):
        options = sig.get("options")
        if isinstance(options, dict):
            _remember(options.get("task_id"), snap)


def _request_origin(request: Any) -> Optional[Snapshot]:
    """The snapshot a task's request carries: top-level in a worker's request (custom
    headers are merged into it), in ``request.headers`` for an eager one."""
    data = request.__dict__.get(HEADER)
    if data is None:
        headers = getattr(request, "headers", None)
        if isinstance(headers, dict):
            data = headers.get(HEADER)
    if data is None:
        return None
    if isinstance(data, Snapshot):  # eager: in this process, never serialized
        return data
    try:
        return decode_header(data)
    except (ValueError, TypeError):
        return None


def _give_eager_header(request: Any, snap: Snapshot) -> None:
    """An eager task's retry is applied with its request's headers: put the origin there."""
    headers = getattr(request, "headers", None)
    if headers is None:
        request.headers = {HEADER: snap}
    elif isinstance(headers, dict):
        headers.setdefault(HEADER, snap)


# -- fail: the note before the exception is stored --------------------------------------------


def apply_trace() -> None:
    check_version("celery")
    on = ON
    trace = sys.modules["celery.app.trace"]

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        call = binder(original)  # calls it as Python would: through __get__

        def handle_failure(self: Any, task: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
            if POINT in on:
                try:
                    exc = self.retval
                    snap = CURRENT_ORIGIN.get()
                    if snap is not None and isinstance(exc, Exception):
                        attach_if_absent(exc, snap)
                except Exception:
                    pass
            return call(self, task, req, *args, **kwargs)

        return handle_failure

    patch(trace.TraceInfo, "handle_failure", make)


# -- get: what the publishing process submitted --------------------------------------------------


def apply_result() -> None:
    check_version("celery")
    on = ON
    result = sys.modules["celery.result"]

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        call = binder(original)  # calls it as Python would: through __get__

        def get(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return call(self, *args, **kwargs)
            except Exception as exc:
                if POINT in on and SUBMITTED:
                    try:
                        snap = SUBMITTED.get(self.id)
                        if snap is not None:
                            attach_if_absent(exc, snap)
                    except Exception:
                        pass
                drop_own_entry(exc, sys._getframe())
                raise

        return get

    patch(result.AsyncResult, "get", make)
