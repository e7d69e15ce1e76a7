"""The ``dask`` propagation point: ``distributed.Client.submit`` and ``Client.map``.

Applied when the program imports ``distributed.client`` (never imported here: the
engine's modules are taken from ``sys.modules``). What it does:

- ``submit``/``map`` hand Dask the user's function wrapped (``_Submitted``) with the
  snapshot of the submitting line. Dask names tasks ``funcname(func)-token(func, args)``
  and deduplicates pure tasks by that key, so the wrapper answers both questions as the
  function does: its ``__name__`` is Dask's ``funcname`` of the function and its
  ``__dask_tokenize__`` is the function's own token. Keys, and so ``pure=`` sharing, do
  not change (two identical pure submits share one future: the first one's origin).
- The wrapper travels pickled (the snapshot in its portable form, source lines included,
  unpickled once per distinct snapshot) to the scheduler and the worker, where it runs the function with the snapshot as the
  current origin and attaches it (the "Work created at" note) to a failure before the
  worker serialises the exception: ``future.result()`` raises it with the note.
- The process keeps each live key's snapshot (dropped when a client releases the key)
  and attaches it, as the future is marked failed (``FutureState.set_error``), to an exception that arrives without
  one: a worker that died (``KilledWorker``), an error longer than
  ``distributed.admin.max-error-length`` or one that could not be pickled (Dask replaces
  those), a coroutine function (run unwrapped, like actors).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

from .._origin import attach_if_absent, opaque, sent_bytes, WithOrigin
from .._origin import carrier_from_bytes as _origin_received
from . import ON, CannotEnable, binder, patch, take

#: Live keys' snapshots (key -> snapshot), for every client of this process: keys name
#: tasks cluster-wide, and one key is one task. Dropped when a client releases the key;
#: past MAX_KEYS live keys only the newest keep theirs (the worker-side note does not
#: need this map; only exceptions that arrive without it do).
MAX_KEYS = 100_000
_ORIGINS: dict = {}

#: What the patch needs from Dask, found by ``recognise``.
_DASK: dict[str, Any] = {}


def recognise(client_mod: Any) -> None:
    """Check that ``distributed.client`` looks as the patch expects; raise CannotEnable."""
    version = getattr(sys.modules.get("distributed"), "__version__", "?")
    try:
        Client = client_mod.Client
        for name in ("submit", "map", "_release_key"):
            if not callable(Client.__dict__.get(name)):
                raise CannotEnable(f"Client.{name} is missing")
        state_cls = client_mod.FutureState
        if not callable(state_cls.__dict__.get("set_error")):
            raise CannotEnable("FutureState.set_error is missing")
        for name, needed in (("submit", {"func", "key", "pure", "actor", "actors"}),
                             ("map", {"func", "key", "pure", "actor", "actors", "batch_size"})):
            params = set(inspect.signature(Client.__dict__[name]).parameters)
            if not needed <= params:
                raise CannotEnable(f"Client.{name} has no {sorted(needed - params)}")
        names = list(inspect.signature(state_cls.__dict__["set_error"]).parameters)
        if names != ["self", "exception", "traceback"] or "key" not in getattr(state_cls, "__slots__", ("key",)):
            raise CannotEnable("FutureState.set_error(exception, traceback) changed")
        core = sys.modules.get("distributed.core")
        tokenize_mod = sys.modules.get("dask.tokenize") or sys.modules.get("dask.base")
        utils = sys.modules.get("dask.utils")
        clean = getattr(core, "clean_exception", None)
        normalize = getattr(tokenize_mod, "normalize_token", None)
        funcname = getattr(utils, "funcname", None)
        if not (callable(clean) and callable(normalize) and callable(funcname)):
            raise CannotEnable("clean_exception, normalize_token or funcname is missing")
    except CannotEnable as exc:
        raise CannotEnable(f"distributed {version}: {exc}") from None
    except Exception as exc:
        raise CannotEnable(f"distributed {version}: {type(exc).__name__}: {exc}") from None
    _DASK.update(clean_exception=clean, normalize_token=normalize, funcname=funcname)


class _Submitted(WithOrigin):
    """The user's function with the submitting snapshot, as Dask sees it: named and
    tokenized as the function itself, on the client and wherever it is unpickled (the
    scheduler, the workers), so no token Dask takes of it differs from the function's."""

    __slots__ = ("_name",)

    def __init__(self, fn: Callable[..., Any], snap: Any, name: str) -> None:
        WithOrigin.__init__(self, fn, snap)
        self._name = name

    def __getattr__(self, name: str) -> Any:
        if name == "__name__":
            return self._name
        return WithOrigin.__getattr__(self, name)

    def __dask_tokenize__(self) -> Any:
        return _normalize_token()(self.__wrapped__)

    def __reduce__(self) -> tuple:
        return (_received, (self.__wrapped__, sent_bytes(self), self._name))


def _normalize_token() -> Callable[[Any], Any]:
    """Dask's ``normalize_token`` (also where the point is not installed: a worker
    without MONSTACK=1 that unpickled a task)."""
    normalize = _DASK.get("normalize_token")
    if normalize is None:
        module = sys.modules.get("dask.tokenize") or sys.modules.get("dask.base")
        normalize = _DASK["normalize_token"] = module.normalize_token  # type: ignore[union-attr]
    return normalize


def _received(fn: Callable[..., Any], data: bytes, name: str) -> _Submitted:
    """Unpickle a _Submitted: the snapshot unpickled once per distinct one (as pools')."""
    snap = _origin_received(fn, data)._snap
    received = _Submitted(fn, snap, name)
    received._sent = data
    return received


def _carried(fn: Any, snap: Any) -> Any:
    """``fn`` wrapped for Dask, or ``fn`` itself where it must travel as it is."""
    if isinstance(fn, WithOrigin) or opaque(fn):
        return fn
    try:
        name = _DASK["funcname"](fn)
    except Exception:
        return fn
    return _Submitted(fn, snap, name)


def _remember(keys: Any, snap: Any) -> None:
    """Keep ``snap`` for each key there now is a future for (the first kept wins)."""
    try:
        origins = _ORIGINS
        for key in keys:
            if key not in origins:
                if len(origins) >= MAX_KEYS:
                    del origins[next(iter(origins))]
                origins[key] = snap
    except Exception:
        pass


def stop() -> None:
    """Drop every kept snapshot (the point is being unpatched)."""
    _ORIGINS.clear()


def _keys_of(result: Any) -> list:
    try:
        if isinstance(result, list):
            return [f.key for f in result]
        return [result.key]
    except Exception:
        return []


def apply() -> None:
    client_mod = sys.modules["distributed.client"]
    recognise(client_mod)

    def make_submitter(original: Callable[..., Any]) -> Callable[..., Any]:
        call = binder(original)  # calls it as Python would: through __get__
        # submit(self, func, *args, key=..., pure=..., ...) and map(self, func, *iterables, ...)
        def submit(self: Any, *args: Any, **kwargs: Any) -> Any:
            if ("dask" not in ON or not args or kwargs.get("actor") or kwargs.get("actors")
                    or isinstance(args[0], WithOrigin)):
                return call(self, *args, **kwargs)
            snap = take()
            if snap is None:
                return call(self, *args, **kwargs)
            result = call(self, _carried(args[0], snap), *args[1:], **kwargs)
            _remember(_keys_of(result), snap)
            return result

        return submit

    def make_set_error(original: Callable[..., Any]) -> Callable[..., Any]:
        call = binder(original)  # calls it as Python would: through __get__
        # Every failure a client learns of (task-erred, KilledWorker from the scheduler)
        # is set here, before the future's waiters are woken.
        def set_error(self: Any, exception: Any, traceback: Any) -> Any:
            if _ORIGINS:
                try:
                    snap = _ORIGINS.get(self.key)
                    if snap is not None:
                        # Dask's own deserialisation (set_error does it again: idempotent)
                        _, exc, tb = _DASK["clean_exception"](exception, traceback)
                        if isinstance(exc, Exception):
                            attach_if_absent(exc, snap)
                            exception, traceback = exc, tb
                except Exception:
                    pass
            return call(self, exception, traceback)

        return set_error

    def make_release(original: Callable[..., Any]) -> Callable[..., Any]:
        call = binder(original)  # calls it as Python would: through __get__

        def _release_key(self: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                _ORIGINS.pop(key, None)
            except Exception:
                pass
            return call(self, key, *args, **kwargs)

        return _release_key

    Client = client_mod.Client
    patch(Client, "submit", make_submitter)
    patch(Client, "map", make_submitter)
    patch(Client, "_release_key", make_release)
    patch(client_mod.FutureState, "set_error", make_set_error)
