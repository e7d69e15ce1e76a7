"""The explicit origin API: carry "where this work was created" to where it runs and fails.

``wrap(fn)`` snapshots the creating line now and runs ``fn`` later with that snapshot as
the *current origin* (a ``ContextVar``: each thread and asyncio task has its own), so
snapshots taken inside link to it and an exception escaping ``fn`` gets it attached.
``attach`` stores the origin on the exception and adds a plain-text PEP 678 note, so any
tool that prints exceptions shows it; ``format_exception``/``print_exception`` render the
traceback plus the origin chain through the one formatting core, with colour.

Nothing here may break the host program: an exception that refuses attributes or notes
keeps its origin in a side table; hostile ``__str__``/``__repr__`` never stop a report.
"""

from __future__ import annotations

import sys
import weakref
from typing import IO, Any, Callable, Optional, TypeVar

from . import _capture, _format
from ._colorize import resolve
from ._snapshot import CURRENT_ORIGIN, Snapshot

_T = TypeVar("_T")

#: Attribute holding an exception's origin (also travels with a pickled exception).
ORIGIN_ATTR = "__monstack_origin__"
#: The heading of the PEP 678 note added by :func:`attach`.
NOTE_HEADING = _format.ORIGIN_HEADING

#: Origins of exceptions that refuse attributes: id(exc) -> (weakref(exc), snapshot).
_SIDE: dict[int, tuple] = {}


def _snap() -> Snapshot:
    """A snapshot of the nearest tracked caller (monstack's own frames are never tracked)."""
    return _capture.snapshot()


class _WithOrigin:
    """``fn`` run with ``snap`` as the current origin; its exception gets ``snap`` attached.

    Picklable when ``fn`` is (process pools): the snapshot travels as plain records.
    """

    __slots__ = ("__wrapped__", "_snap", "_sent")

    def __init__(self, fn: Callable[..., Any], snap: Snapshot) -> None:
        self.__wrapped__ = fn
        self._snap = snap
        self._sent: Optional[bytes] = None

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        snap = self._snap
        token = CURRENT_ORIGIN.set(snap)
        try:
            return self.__wrapped__(*args, **kwargs)
        except Exception as exc:
            _attach_if_absent(exc, snap)
            _drop_own_entry(exc, sys._getframe())
            raise
        except BaseException as exc:  # KeyboardInterrupt, SystemExit...: no note, same traceback
            _drop_own_entry(exc, sys._getframe())
            raise
        finally:
            try:
                CURRENT_ORIGIN.reset(token)
            except Exception:  # entered another context in between: leave it be
                pass

    def __getattr__(self, name: str) -> Any:
        # __name__, __qualname__ and plain attributes come from the wrapped callable, so
        # Thread names, reprs and introspection keep working.
        if name.startswith("__") and name not in ("__name__", "__qualname__"):
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)

    def __repr__(self) -> str:
        try:
            inner = repr(self.__wrapped__)
        except Exception:
            inner = f"<{type(self.__wrapped__).__name__} object>"
        return f"<monstack.wrap of {inner}>"

    def __reduce__(self) -> tuple:
        # One wrapper is pickled once per task of a pool's map/imap (chunksize 1: once
        # per item). Pickling a 20-frame snapshot and unpickling it cost ~20 us each, so
        # the snapshot is pickled once, travels as bytes, and the receiving process
        # unpickles each distinct one once (_received).
        sent = self._sent
        if sent is None:
            import pickle

            sent = self._sent = pickle.dumps(self._snap)
        return (_received, (self.__wrapped__, sent))


#: Snapshots unpickled from _WithOrigin pickles, by their bytes: a pool's worker gets
#: the same one with every task of a map (bounded: cleared when full).
_RECEIVED: dict = {}
_RECEIVED_MAX = 64


def _received(fn: Callable[..., Any], data: bytes) -> "_WithOrigin":
    """Unpickle a _WithOrigin: its snapshot travels pickled, once per distinct one."""
    snap = _RECEIVED.get(data)
    if snap is None:
        import pickle

        snap = pickle.loads(data)
        if not isinstance(snap, Snapshot):
            raise TypeError(f"monstack: a pickled origin must be a Snapshot, got {type(snap).__name__}")
        if len(_RECEIVED) >= _RECEIVED_MAX:
            _RECEIVED.clear()
        _RECEIVED[data] = snap
    return _WithOrigin(fn, snap)


def wrap(fn: Callable[..., _T]) -> Callable[..., _T]:
    """Snapshot the calling line now; return a callable that runs ``fn`` with it as origin.

    Call the result later, on any thread: snapshots taken inside link to the creating
    line, and an exception escaping ``fn`` carries it (see :func:`origin_of`). It costs
    one O(1) snapshot. Without ``install()`` the snapshot walks the real frames.
    """
    if not callable(fn):
        raise TypeError(f"monstack.wrap() needs a callable, got {_type_name(fn)}")
    return _WithOrigin(fn, _snap())


class origin:
    """``with monstack.origin(snap):`` runs the block with ``snap`` as the current origin.

    For code that runs work it did not create (a framework's worker loop): snapshots in
    the block link to ``snap``, and an exception leaving the block carries it unless it
    already has an origin. ``origin(None)`` runs the block with no origin.
    """

    __slots__ = ("_snap", "_token")

    def __init__(self, snap: Optional[Snapshot]) -> None:
        if snap is not None and not isinstance(snap, Snapshot):
            raise TypeError(f"monstack.origin() needs a Snapshot or None, got {_type_name(snap)}")
        self._snap = snap
        self._token: Any = None

    def __enter__(self) -> Optional[Snapshot]:
        if self._token is not None:
            raise RuntimeError("this monstack.origin() block is already entered")
        self._token = CURRENT_ORIGIN.set(self._snap)
        return self._snap

    def __exit__(self, typ: Any, exc: Optional[BaseException], tb: Any) -> None:
        token, self._token = self._token, None
        if isinstance(exc, Exception) and self._snap is not None:
            _attach_if_absent(exc, self._snap)
        if token is not None:
            try:
                CURRENT_ORIGIN.reset(token)
            except Exception:
                pass


def current_origin() -> Optional[Snapshot]:
    """The origin of the work running now (None outside propagated work)."""
    return CURRENT_ORIGIN.get()


# -- exceptions ------------------------------------------------------------------------------


def attach(exc: BaseException, snap: Snapshot) -> BaseException:
    """Record ``snap`` as where the work that raised ``exc`` was created; returns ``exc``.

    Stores it as ``exc.__monstack_origin__`` and adds (or replaces) one PEP 678 note
    headed "Work created at (most recent call last):", so the default excepthook, pytest,
    logging and IPython all show it. Attaching again never duplicates the note. An
    exception that refuses attributes or notes keeps its origin in a side table
    (:func:`origin_of` and :func:`format_exception` still see it).
    """
    if not isinstance(exc, BaseException):
        raise TypeError(f"monstack.attach() needs an exception instance, got {_type_name(exc)}")
    if not isinstance(snap, Snapshot):
        raise TypeError(f"monstack.attach() needs a Snapshot, got {_type_name(snap)}")
    _store(exc, snap)
    _set_note(exc, snap)
    return exc


def origin_of(exc: BaseException) -> Optional[Snapshot]:
    """The snapshot attached to ``exc`` (see :func:`attach`), or None."""
    if not isinstance(exc, BaseException):
        raise TypeError(f"monstack.origin_of() needs an exception instance, got {_type_name(exc)}")
    return _lookup(exc)


def format_exception(exc: BaseException, color: Optional[bool] = None) -> str:
    """The traceback of ``exc`` (as CPython prints it) followed by its origin chain.

    ``color=None``: as suits ``sys.stderr`` (CPython's rules). Never raises for hostile
    exceptions (failing ``__str__``/``__repr__``, refused attributes).
    """
    if not isinstance(exc, BaseException):
        raise TypeError(f"monstack.format_exception() needs an exception instance, got {_type_name(exc)}")
    return _format.format_exception(exc, _lookup(exc), resolve(color, sys.stderr))


def print_exception(exc: BaseException, file: Optional[IO[str]] = None, color: Optional[bool] = None) -> None:
    """Write :func:`format_exception` to ``file`` (default ``sys.stderr``).

    ``color=None``: decided for ``file`` by CPython's rules.
    """
    if not isinstance(exc, BaseException):
        raise TypeError(f"monstack.print_exception() needs an exception instance, got {_type_name(exc)}")
    if file is None:
        file = sys.stderr
    if file is None:  # no stderr (pythonw): nowhere to write
        return
    file.write(_format.format_exception(exc, _lookup(exc), resolve(color, file)))


def _drop_own_entry(exc: BaseException, frame: Any) -> None:
    """Take a wrapper's own entry off the head of ``exc``'s traceback, as importlib does
    for its frames: the traceback is then the one a direct call of the job would give
    (from whatever ran it straight to the job; ending at that caller's line when the job
    is a C function or the call itself failed). A bare ``raise`` after this re-raises
    without adding the entry back."""
    try:
        tb = exc.__traceback__
        if tb is not None and tb.tb_frame is frame:
            exc.__traceback__ = tb.tb_next
    except Exception:
        pass


def _attach_if_absent(exc: BaseException, snap: Snapshot) -> None:
    """Automatic attach: the first (innermost) origin wins; never raises."""
    try:
        if _lookup(exc) is None:
            _store(exc, snap)
            _set_note(exc, snap)
    except Exception:
        pass


def _store(exc: BaseException, snap: Snapshot) -> None:
    try:
        setattr(exc, ORIGIN_ATTR, snap)
    except Exception:
        pass
    else:
        try:
            if getattr(exc, ORIGIN_ATTR, None) is snap:
                _SIDE.pop(id(exc), None)
                return
        except Exception:
            pass
    _side_put(exc, snap)


def _side_put(exc: BaseException, snap: Snapshot) -> None:
    key = id(exc)

    def _forget(_ref: Any, key: int = key) -> None:
        entry = _SIDE.get(key)
        if entry is not None and entry[0] is _ref:
            _SIDE.pop(key, None)

    try:
        ref = weakref.ref(exc, _forget)
    except TypeError:  # pragma: no cover - every BaseException supports weak references
        return
    _SIDE[key] = (ref, snap)


def _lookup(exc: BaseException) -> Optional[Snapshot]:
    try:
        snap = getattr(exc, ORIGIN_ATTR, None)
    except Exception:
        snap = None
    if isinstance(snap, Snapshot):
        return snap
    entry = _SIDE.get(id(exc))
    if entry is not None and entry[0]() is exc:
        return entry[1]
    return None


def _set_note(exc: BaseException, snap: Snapshot) -> None:
    """Add the plain-text note once; replace monstack's earlier note if there is one."""
    try:
        note = "".join(_format.format_origin(snap, color=False)).rstrip("\n")
    except Exception:
        note = NOTE_HEADING + "\n  (monstack: the origin could not be formatted)"
    try:
        notes = getattr(exc, "__notes__", None)
    except Exception:
        return
    if isinstance(notes, list):
        for i, old in enumerate(notes):
            if _format.is_origin_note(old):
                try:
                    notes[i] = note
                except Exception:
                    pass
                return
    elif notes is not None:
        return  # __notes__ is not a list: add_note would refuse too
    try:
        exc.add_note(note)
    except Exception:  # refuses notes/attributes: the side table still has the origin
        pass


def _type_name(obj: Any) -> str:
    try:
        return type(obj).__qualname__
    except Exception:  # pragma: no cover
        return "object"
