"""The ``process`` and ``mp_pool`` points: ``multiprocessing``'s ``Process.start`` and
``Pool``'s job methods (see ``monstack._propagate``)."""

from __future__ import annotations

import sys

from . import ON, binder, patch, take
from .._origin import attach_if_absent, RunOf, WithOrigin, carry, has_origin
from .threading import INTERNAL_TARGET_MODULES

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional


def apply_process() -> None:
    # `import a.b as c` (IMPORT_FROM) also works while the post-import hook runs inside
    # multiprocessing/__init__'s own import of .process; `a.b.X` attribute access does not.
    import multiprocessing.process as mp_process

    def make(original: Callable[..., None]) -> Callable[..., None]:
        call = binder(original)  # calls it as Python would: through __get__

        def start(self: Any) -> None:
            if "process" not in ON:
                return call(self)
            run = _bind_process_run(self)
            try:
                return call(self)  # fork copies, spawn and forkserver pickle, our run()
            finally:
                if run is not None:  # the parent's object is as it was
                    try:
                        if self.__dict__.get("run") is run:
                            del self.__dict__["run"]
                    except Exception:
                        pass

        return start

    patch(mp_process.BaseProcess, "start", make)


def _bind_process_run(process: Any) -> Optional[Any]:
    """Give ``process`` an instance ``run`` that runs its class's ``run()`` (the target,
    or the subclass's own) with the starter's snapshot as origin, in the child; return
    it, or None when the process is left alone (a pool's or manager's process, a target
    that already carries an origin, an instance-level ``run`` of the user's)."""
    try:
        if "run" in process.__dict__:
            return None
        run = getattr(type(process), "run", None)
        base = sys.modules["multiprocessing.process"].BaseProcess
        if run is base.run:
            target = getattr(process, "_target", None)
            if target is None or isinstance(target, WithOrigin) or not callable(target):
                return None
            if str(getattr(target, "__module__", "") or "").startswith(INTERNAL_TARGET_MODULES):
                return None
        elif str(getattr(run, "__module__", "") or "").startswith(INTERNAL_TARGET_MODULES):
            return None
        snap = take()
        if snap is None:
            return None
        bound = RunOf(process, snap)
        process.__dict__["run"] = bound
        return bound
    except Exception:
        return None


# -- multiprocessing.pool ---------------------------------------------------------------------


def apply_pool() -> None:
    import multiprocessing.pool as mp_pool

    Pool = mp_pool.Pool

    def with_error_callback(snap: Any, user: Optional[Callable[[Any], Any]]) -> Callable[[Any], Any]:
        # Runs in the pool's result thread before get() is woken: attach the origin if
        # the exception lost it when pickled back (the child normally attached it).
        def error_callback(exc: Any) -> Any:
            try:
                if isinstance(exc, Exception):
                    attach_if_absent(exc, snap)
            except Exception:
                pass
            if user is not None:
                return user(exc)
            return None

        return error_callback

    def make_apply_async(original: Callable[..., Any]) -> Callable[..., Any]:
        call = binder(original)  # calls it as Python would: through __get__

        def apply_async(self: Any, func: Any, args: Any = (), kwds: Any = {},  # noqa: B006 (the original's default)
                        callback: Any = None, error_callback: Any = None) -> Any:
            if "mp_pool" not in ON or has_origin(func):
                return call(self, func, args, kwds, callback, error_callback)
            snap = take()
            if snap is None:
                return call(self, func, args, kwds, callback, error_callback)
            return call(self, carry(func, snap), args, kwds, callback,
                            with_error_callback(snap, error_callback))

        return apply_async

    def make_map_async(original: Callable[..., Any]) -> Callable[..., Any]:
        call = binder(original)  # calls it as Python would: through __get__

        def _map_async(self: Any, func: Any, iterable: Any, mapper: Any, chunksize: Any = None,
                       callback: Any = None, error_callback: Any = None) -> Any:
            if "mp_pool" not in ON or has_origin(func):
                return call(self, func, iterable, mapper, chunksize, callback, error_callback)
            snap = take()
            if snap is None:
                return call(self, func, iterable, mapper, chunksize, callback, error_callback)
            return call(self, carry(func, snap), iterable, mapper, chunksize, callback,
                            with_error_callback(snap, error_callback))

        return _map_async

    def make_imap(original: Callable[..., Any]) -> Callable[..., Any]:
        call = binder(original)  # calls it as Python would: through __get__

        def imap(self: Any, func: Any, iterable: Any, chunksize: int = 1) -> Any:
            if "mp_pool" not in ON or has_origin(func):
                return call(self, func, iterable, chunksize)
            snap = take()
            if snap is None:
                return call(self, func, iterable, chunksize)
            return call(self, carry(func, snap), iterable, chunksize)

        return imap

    patch(Pool, "apply_async", make_apply_async)
    patch(Pool, "_map_async", make_map_async)
    patch(Pool, "imap", make_imap)
    patch(Pool, "imap_unordered", make_imap)
