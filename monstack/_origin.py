"""The explicit origin API: carry "where this work was created" to where it runs and fails.

``wrap(fn)`` snapshots the creating line now and runs ``fn`` later with that snapshot as
the *current origin* (a ``ContextVar``: each thread and asyncio task has its own), so
snapshots taken inside link to it and an exception escaping ``fn`` gets it attached.
``attach`` records the origin without changing what the exception looks like (its
``str()``, ``args`` and ``__notes__`` stay as they were: a program or test that catches it
sees what it would see without monstack); the origin shows where exceptions are reported
(``monstack._points.reports``: the excepthooks, asyncio's handler; pytest's report;
``monstack.logging``; ``format_exception``/``print_exception``, which render the traceback
plus the origin chain through the one formatting core, with colour). Only the opt-in notes
mode (``install(notes=True)``, ``MONSTACK_NOTES=1``; never under pytest) also adds it as a
plain-text PEP 678 note, for tools that print exceptions themselves.

Where the origin is kept: in the exception's ``__dict__``, as ``__monstack_origin__``. The
exceptions of built-in types (ValueError, KeyError, ...) cannot be weakly referenced, so
a table beside them could only keep them (their tracebacks, frames and locals) alive or
guess at reused ids; the attribute lives exactly as long as the exception, follows it
wherever it is re-raised (``future.result()`` in another thread), and travels with it when
it is pickled (process pools, Celery, Dask). It shows in ``vars(exc)``, nowhere else.

Nothing here may break the host program: an exception that refuses attributes or notes
keeps its origin in a side table; hostile ``__str__``/``__repr__`` never stop a report.
"""

from __future__ import annotations

import _thread
import sys
from _contextvars import Context
from _weakref import ref as _weakref

from . import _capture
from ._snapshot import CURRENT_ORIGIN, RUNNING, Snapshot, running_cell

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Any, Callable, Optional, TypeVar

    _T = TypeVar("_T")

#: Attribute holding an exception's origin (also travels with a pickled exception).
ORIGIN_ATTR = "__monstack_origin__"


def _fmt() -> Any:
    """The formatting core (``_format``, ``_colorize``): loaded with the first note or
    report, not with this module, which the ``start_new_thread`` point loads at start-up."""
    from . import _format

    return _format


def __getattr__(name: str) -> Any:
    if name == "NOTE_HEADING":  # the heading of the PEP 678 note added by attach()
        return _fmt().ORIGIN_HEADING
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: Origins of exceptions that refuse attributes: id(exc) -> (weakref(exc), snapshot).
_SIDE: dict[int, tuple] = {}


_get_ident = _thread.get_ident
_running_get = RUNNING.get
_set_origin = CURRENT_ORIGIN.set
_reset_origin = CURRENT_ORIGIN.reset


def _snap() -> Snapshot:
    """A snapshot of the nearest tracked caller (monstack's own frames are never tracked)."""
    return _capture.snapshot()


#: Dunder attributes a wrapper answers from the callable it wraps (plain attributes are
#: always forwarded). ``__module__`` and ``__doc__`` are properties: the class has its own.
_FORWARDED = frozenset(("__name__", "__qualname__", "__annotations__", "__type_params__",
                        "__defaults__", "__kwdefaults__", "__text_signature__"))


class WithOrigin:
    """``fn`` run with ``snap`` as the current origin; its exception gets ``snap`` attached.

    Its ``__call__`` is the one place that runs work under an origin: every carrier (the
    propagation points', ``wrap()``'s, a process's ``run``) is this class or a subclass
    (no helper call in between: no traceback entry, no cost per call; the wrapper's own
    entry is taken off the traceback, as importlib does for its frames).

    Answers questions about itself as ``fn`` does (``__name__``, ``__qualname__``,
    ``__module__``, ``__doc__``, ``inspect.signature`` through ``__wrapped__``, plain
    attributes), so names, reprs of threads and tasks and libraries' checks keep working;
    callables a wrapper could not stand in for are never wrapped (see :func:`carry`).
    Picklable when ``fn`` is (process pools): the snapshot travels as plain records.
    """

    __slots__ = ("__wrapped__", "_snap", "_sent")

    def __init__(self, fn: Callable[..., Any], snap: Snapshot) -> None:
        self.__wrapped__ = fn
        self._snap = snap
        self._sent: Optional[bytes] = None

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        snap = self._snap
        cell = _running_get(_get_ident())  # (for other threads: threads(), dump())
        if type(cell) is not list or len(cell) != 1:
            cell = running_cell()
        token = _set_origin(snap)
        prev = cell[0]
        cell[0] = snap
        try:
            return self.__wrapped__(*args, **kwargs)
        except Exception as exc:
            attach_if_absent(exc, snap)
            drop_own_entry(exc, sys._getframe())
            raise
        except BaseException as exc:  # KeyboardInterrupt, SystemExit...: no note, same traceback
            drop_own_entry(exc, sys._getframe())
            raise
        finally:
            try:
                cell[0] = prev
            except IndexError:  # (emptied meanwhile: left as it is)
                pass
            try:
                _reset_origin(token)
            except Exception:  # entered another context in between: leave it be
                pass

    def __getattr__(self, name: str) -> Any:
        # Plain attributes and the names in _FORWARDED come from the wrapped callable, so
        # Thread names, reprs and introspection keep working.
        if name.startswith("__") and name not in _FORWARDED:
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)

    # The class's own __module__ and __doc__ would answer before __getattr__.
    @property  # type: ignore[misc]
    def __module__(self) -> Any:  # type: ignore[override]
        return getattr(self.__wrapped__, "__module__", None)

    @property  # type: ignore[misc]
    def __doc__(self) -> Any:  # type: ignore[override]
        return getattr(self.__wrapped__, "__doc__", None)

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
        # unpickles each distinct one once (carrier_from_bytes).
        return (carrier_from_bytes, (self.__wrapped__, sent_bytes(self)))


class NativeCarrier(WithOrigin):
    # A WithOrigin whose __call__ is native code (native/carrier.h: the same steps, in C,
    # so no Python frame and no traceback entry of its own), made only by the function
    # native_carrier() returns, for a pool's plain-function jobs. It answers everything
    # else as WithOrigin does (repr, __wrapped__, attributes, pickling: a WithOrigin
    # arrives). Its one more slot, the native table, is not visible from Python.
    __slots__ = ("_native_table",)
    __module__ = WithOrigin.__dict__["__module__"]  # (a class body sets its own)
    __doc__ = WithOrigin.__dict__["__doc__"]  # type: ignore[assignment]

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("monstack: a native carrier is made by the native code only (use monstack.wrap)")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        raise TypeError("monstack: a native carrier cannot be subclassed")


#: The table slot's descriptor, taken off the class (C reads the slot at the end of the
#: instance: tp_basicsize - one pointer); the loader and the tests use it.
_TABLE_SLOT: Any = NativeCarrier.__dict__["_native_table"]
delattr(NativeCarrier, "_native_table")

#: [the carrier the native submit made last, or None]: it hands that one out again to a
#: job of the same function with the same snapshot, and lets go of it when one of its
#: calls ends (native/carrier.h). Emptied when the propagation points are undone.
REUSED: list = [None]


def forget_reused() -> None:
    """Let go of the carrier the native submit keeps for reuse (uninstall)."""
    REUSED[:] = [None]


def sent_bytes(holder: Any) -> bytes:
    """The pickled snapshot of a wrapper, made once per wrapper."""
    sent = holder._sent
    if sent is None:
        import pickle

        sent = holder._sent = pickle.dumps(holder._snap)
    return sent


class _HasMethod:
    def method(self) -> None:  # pragma: no cover - only its type is used
        pass


_METHOD_TYPE: Any = type(_HasMethod().method)
_CODE_TYPE = type(sent_bytes.__code__)
FUNCTION_TYPE: Any = type(sent_bytes)
_BUILTIN_TYPE: Any = type(len)
# co_flags of functions whose call only creates a generator or coroutine.
CO_KINDS = 0x20 | 0x80 | 0x100 | 0x200  # GENERATOR, COROUTINE, ITERABLE_COROUTINE, ASYNC_GENERATOR


def opaque(fn: Any) -> bool:
    """True where no wrapper can answer as ``fn`` does, so ``fn`` must travel unwrapped.

    That is anything not callable (a coroutine object handed over by mistake: asyncio's
    debug check must still see it) and callables whose kind libraries test: coroutine,
    generator and async generator functions (``inspect.iscoroutinefunction`` and the like
    look at the function's code flags, through methods and ``functools.partial``, and at
    the markers ``inspect.markcoroutinefunction`` and asyncio's old decorator set). Their
    call only creates the coroutine or generator, so the body never runs in the worker
    anyway: nothing is lost by not carrying an origin.
    """
    kind = type(fn)
    if kind is FUNCTION_TYPE:  # the common case, kept short (every submit asks)
        return bool(fn.__code__.co_flags & CO_KINDS) or _marked(fn)
    if kind is _BUILTIN_TYPE:
        return False
    try:
        if not callable(fn):
            return True
        functools = sys.modules.get("functools")
        partial = functools.partial if functools is not None else ()
        f: Any = fn
        for _ in range(100):  # methods and partials, as inspect unwraps them
            if type(f) is _METHOD_TYPE:
                f = f.__func__
            elif isinstance(f, partial):
                f = f.func
            else:
                break
        if type(f) is FUNCTION_TYPE:
            return bool(f.__code__.co_flags & CO_KINDS) or _marked(f)
        if type(f) is _BUILTIN_TYPE:
            return False
        code = getattr(f, "__code__", None)  # function-like (Cython)
        if type(code) is _CODE_TYPE and code.co_flags & CO_KINDS:
            return True
        return (getattr(f, "_is_coroutine_marker", None) is not None
                or getattr(fn, "_is_coroutine", None) is not None)
    except Exception:
        return True


def _marked(function: Any) -> bool:
    """Marked a coroutine function (``inspect.markcoroutinefunction``, asyncio's old
    decorator): attributes in the function's ``__dict__``."""
    attrs = function.__dict__
    return bool(attrs) and (attrs.get("_is_coroutine_marker") is not None or attrs.get("_is_coroutine") is not None)


def carry(fn: Any, snap: Snapshot) -> Any:
    """``fn`` wrapped to run with ``snap`` as its origin, or ``fn`` itself where a wrapper
    could not answer as it does (:func:`opaque`). ``functools.partial(ctx.run, f, ...)``
    (what ``asyncio.to_thread`` and trio hand over: ``f`` run in a copied context) gets
    ``f`` wrapped inside the ``ctx.run``, so the origin is current where ``f`` runs."""
    if type(fn) is FUNCTION_TYPE:
        return fn if fn.__code__.co_flags & CO_KINDS or _marked(fn) else WithOrigin(fn, snap)
    functools = sys.modules.get("functools")
    if functools is not None and type(fn) is functools.partial and fn.args and _is_context_run(fn.func):
        inner = fn.args[0]
        if opaque(inner) or type(inner) in CARRIER_TYPES:
            return fn
        return functools.partial(fn.func, WithOrigin(inner, snap), *fn.args[1:], **fn.keywords)
    if opaque(fn):
        return fn
    return WithOrigin(fn, snap)


def has_origin(fn: Any) -> bool:
    """Already carries an origin (a wrapper, or a ``partial(ctx.run, wrapper, ...)``)."""
    if type(fn) in CARRIER_TYPES:
        return True
    functools = sys.modules.get("functools")
    return (functools is not None and type(fn) is functools.partial and bool(fn.args)
            and type(fn.args[0]) in CARRIER_TYPES)


#: The classes of the carriers the points make.
CARRIER_TYPES = frozenset((WithOrigin, NativeCarrier))


# -- the native carrier ----------------------------------------------------------------------

#: [carrier_new] once the native carrier is set up for this process, [None] if refused.
_NATIVE: list = []
#: Why the native carrier was refused ("" when it is set up; None before any attempt).
native_carrier_why: Optional[str] = None


def native_carrier(blob: Any) -> Optional[Callable[[Callable[..., Any], Snapshot], WithOrigin]]:
    """``carrier_new(fn, snap)``, which makes a :class:`NativeCarrier` (a carrier whose
    ``__call__`` is native code), from ``blob`` (the verified blob of the running native
    backend, ``native/carrier.h``); None where ``blob`` is None or the carrier cannot be
    set up. Set up once per process (the first blob's code serves every later install:
    mappings are never unmapped); never raises."""
    global native_carrier_why
    if blob is None:
        return None
    if _NATIVE:
        return _NATIVE[0]  # type: ignore[no-any-return]
    with _NATIVE_LOCK:
        if not _NATIVE:
            try:
                new: Any = _set_up_native(blob)
                native_carrier_why = ""
            except Exception as exc:
                new = None
                native_carrier_why = f"{type(exc).__name__}: {exc}"
            _NATIVE.append(new)
    return _NATIVE[0]  # type: ignore[no-any-return]


_NATIVE_LOCK = _thread.allocate_lock()
_CARRIER_MAGIC = 0x6D6F6E6361727279  # "moncarry"


def _set_up_native(blob: Any) -> Callable[..., Any]:
    """Fill the native carrier's table (``struct mc_ctx``) by the names the blob lists,
    check the layouts it was compiled with, make ``NativeCarrier.__call__`` the native
    method and return ``carrier_new``."""
    from . import _cdata as C
    from . import _native

    ptr = C.sizeof(C.c_void_p)
    at = blob.addr("ms_carrier_layout")
    magic, size, bytes_data, off_basicsize, off_alloc, off_call = (
        C.c_int64.from_address(at + 8 * i).value for i in range(6))
    names = blob.cstrings("ms_carrier_names")
    if magic != _CARRIER_MAGIC or size != ptr * (1 + len(names)):
        raise RuntimeError("the blob's carrier table is not the one this module fills")
    if bytes_data != _native._BYTES_DATA:
        raise RuntimeError("bytes objects are not laid out as the native carrier expects")
    cls = NativeCarrier
    if (C.c_ssize_t.from_address(id(cls) + off_basicsize).value != cls.__basicsize__
            or C.c_void_p.from_address(id(cls) + off_alloc).value != _native.resolve("f:PyType_GenericAlloc")):
        raise RuntimeError("type objects are not laid out as the native carrier expects")
    # where each slot is: set it to a marker and find the marker's address in the instance
    probe = object.__new__(cls)
    markers = {name: object() for name in ("off_wrapped", "off_snap", "off_sent")}
    slots: Any = vars(WithOrigin)
    for name, slot in (("off_wrapped", "__wrapped__"), ("off_snap", "_snap"), ("off_sent", "_sent")):
        slots[slot].__set__(probe, markers[name])
    table_marker = object()
    _TABLE_SLOT.__set__(probe, table_marker)
    words = [C.c_void_p.from_address(id(probe) + i).value for i in range(0, cls.__basicsize__, ptr)]
    offsets = {name: words.index(id(m)) * ptr for name, m in markers.items() if words.count(id(m)) == 1}
    if len(offsets) != 3 or words[-1] != id(table_marker):
        raise RuntimeError("carrier instances are not laid out as the native carrier expects")
    del probe
    objects = {"var": CURRENT_ORIGIN, "cell_here": running_cell, "cell_key": sys.intern(f"monstack.running_cell.{id(RUNNING):x}"),
               "list": list, "attach": attach_if_absent, "exception": Exception, "none": None,
               "type_error": TypeError, "attribute_error": AttributeError, "cls": cls, "reused": REUSED,
               "context_type": Context}
    order = sys.byteorder
    fields = bytearray(size)
    fields[0:8] = _CARRIER_MAGIC.to_bytes(8, order)
    for i, name in enumerate(names, 1):
        kind, _, key = name.partition(":")
        if kind == "f":
            value = _native.resolve(name)
        elif kind == "o" and key in objects:
            value = id(objects[key])
        elif kind == "i" and key in offsets:
            value = offsets[key]
        else:
            value = 0
        if not value and kind != "i":
            raise RuntimeError(f"no value for the native carrier's {name}")
        fields[i * ptr:(i + 1) * ptr] = value.to_bytes(ptr, order)
    table = bytes(fields)
    _native.buffer_address(table)  # (checks the bytes layout once)
    _native._FOREVER.append((table, objects))
    call = _native.make_method(cls, blob.addr("ms_carrier_call"), "__call__",
                               _native.METH_FASTCALL | _native.METH_KEYWORDS)
    new = _native.make_function(blob.addr("ms_carrier_new"), "carrier_new", _native.METH_FASTCALL, table)
    # the whole path once, before any job takes it
    ran = new(_probe_job, Snapshot._new(None, 0, None))
    type.__setattr__(cls, "__call__", call)
    if type(ran) is not cls or ran(1, k=2) != (1, 2) or ran.__wrapped__ is not _probe_job:
        raise RuntimeError("the native carrier did not run as expected")
    # a call of an instance: the native code straight away, not slot_tp_call looking
    # __call__ up and calling the method (the class's __call__ stays that method)
    tp_call = C.c_void_p.from_address(id(cls) + off_call)
    if tp_call.value:
        tp_call.value = blob.addr("ms_carrier_tp_call")
        if ran(1, k=2) != (1, 2) or ran(*(5,), **{"k": 6}) != (5, 6):
            raise RuntimeError("the native carrier did not run as expected")
    return new  # type: ignore[no-any-return]


def native_vectorcall(blob: Any, symbol: str, replacement: Any, cell_name: str, items: tuple) -> bool:
    """Make the native replacement ``symbol`` of ``blob`` (``native/carrier.h``:
    ``ms_create_task``, ``ms_submit``) the vectorcall of ``replacement``, the Python
    replacement it does the common path of, whose closure cell ``cell_name`` holds a list
    ending with None: the native code's holder tuple (the carrier's table, then ``items``
    as that file lists them, with ``replacement``'s code, that list and a plain function
    after the first) goes in the list's last item. False, with ``replacement`` as it was,
    where the native carrier is not set up or objects are not laid out as the native code
    reads them. Never raises."""
    new: Any = native_carrier(blob)
    if new is None or type(replacement) is not FUNCTION_TYPE:
        return False
    try:
        from . import _cdata as C
        from . import _native

        at = blob.addr(symbol + "_layout")
        (size, tuple_items, list_items, cell, holder_at, off_code, off_dict, off_closure, off_vectorcall,
         off_version, off_flags, off_cell, kinds) = (C.c_int64.from_address(at + 8 * i).value for i in range(13))
        code, closure = replacement.__code__, replacement.__closure__
        if closure is None or len(closure) <= cell or code.co_freevars[cell] != cell_name:
            return False
        fast = closure[cell].cell_contents
        if type(fast) is not list or len(fast) != holder_at + 1 or fast[holder_at] is not None:
            return False
        holder = (new.__self__, items[0], code, fast, _probe_job) + tuple(items[1:])
        word = C.c_void_p.from_address
        ptr = C.sizeof(C.c_void_p)
        default = word(id(_probe_job) + off_vectorcall).value
        if (size != len(holder) or tuple_items != tuple.__basicsize__ or kinds != CO_KINDS
                or word(id(replacement) + off_code).value != id(code)
                or word(id(replacement) + off_closure).value != id(closure)
                or word(id(closure[cell]) + off_cell).value != id(fast)
                or word(word(id(fast) + list_items).value + ptr * holder_at).value != id(None)
                or C.c_int.from_address(id(code) + off_flags).value != code.co_flags
                or not default or word(id(replacement) + off_vectorcall).value != default
                or not _dict_at(off_dict)):
            return False
        fast[holder_at] = holder
        address = blob.addr(symbol)
        try:
            set_vectorcall = _native.api_word("PyFunction_SetVectorcall", 2)
        except Exception:
            set_vectorcall = None
        if set_vectorcall is not None:
            set_vectorcall(id(replacement), address)  # (it also drops the function's version)
        else:  # (3.11: what it does there, by hand: a version 0 is never specialized)
            C.c_int.from_address(id(replacement) + off_version).value = 0
            word(id(replacement) + off_vectorcall).value = address
        _VECTORCALL_AT[:] = [off_vectorcall]
        return True
    except Exception:
        return False


def _dict_at(off_dict: int) -> bool:
    """A function's ``__dict__`` is where the native replacements read it."""
    from . import _cdata as C

    def probe() -> None:
        pass

    attrs = probe.__dict__  # (made now: a function's __dict__ is made on first use)
    return C.c_void_p.from_address(id(probe) + off_dict).value == id(attrs)


#: [where a function's vectorcall is] once native_vectorcall set one
_VECTORCALL_AT: list = []


def vectorcall_of(fn: Any) -> Optional[int]:
    """The address of a Python function's vectorcall, once :func:`native_vectorcall` ran
    (the tests: which code runs a call)."""
    from . import _cdata as C

    if not _VECTORCALL_AT or type(fn) is not FUNCTION_TYPE:
        return None
    return C.c_void_p.from_address(id(fn) + _VECTORCALL_AT[0]).value  # type: ignore[no-any-return]


def _probe_job(a: Any, k: Any = None) -> tuple:
    return (a, k)


def _is_context_run(func: Any) -> bool:
    """``ctx.run`` of some ``contextvars.Context``."""
    return type(func) is _BUILTIN_TYPE and type(func.__self__) is Context and func.__name__ == "run"


class RunOf(WithOrigin):
    """An instance-level ``run`` for a ``multiprocessing`` process: calls its class's
    ``run()`` (the target, or a subclass's own ``run()``) with ``snap`` as the current
    origin, in the child. Travels with the process object (fork copies it, spawn and
    forkserver pickle it, with a reference back to the process) and costs the parent
    nothing after ``start()``, which takes it off again."""

    __slots__ = ("_owner",)

    def __init__(self, owner: Any, snap: Snapshot) -> None:
        # the class's run() bound to the process: what type(owner).run(owner) calls
        WithOrigin.__init__(self, type(owner).run.__get__(owner, type(owner)), snap)
        self._owner = owner

    def __getattr__(self, name: str) -> Any:
        # Answers as the bound run() it stands for.
        if name.startswith("__") and name not in _FORWARDED and name != "__func__":
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        try:
            return WithOrigin.__call__(self, *args, **kwargs)
        except Exception as exc:
            drop_own_entry(exc, sys._getframe())
            # Leaving the child's run() for BaseProcess._bootstrap, which prints it (with
            # notes) and exits: nothing of the program sees it any more, so that report is
            # where the origin shows.
            try:
                if sys._getframe(1).f_code.co_name == "_bootstrap":
                    snap = stored_origin(exc)
                    if snap is not None:
                        set_note(exc, snap)
            except Exception:
                pass
            raise

    def __reduce__(self) -> tuple:
        return (_run_received, (self._owner, sent_bytes(self)))


#: Snapshots unpickled from WithOrigin pickles, by their bytes: a pool's worker gets
#: the same one with every task of a map (bounded: cleared when full).
_RECEIVED: dict = {}
_RECEIVED_MAX = 64


def carrier_from_bytes(fn: Callable[..., Any], data: bytes) -> WithOrigin:
    """Unpickle a WithOrigin: its snapshot travels pickled, once per distinct one."""
    snap = _RECEIVED.get(data)
    if snap is None:
        import pickle

        snap = pickle.loads(data)
        if not isinstance(snap, Snapshot):
            raise TypeError(f"monstack: a pickled origin must be a Snapshot, got {type(snap).__name__}")
        if len(_RECEIVED) >= _RECEIVED_MAX:
            _RECEIVED.clear()
        _RECEIVED[data] = snap
    received = WithOrigin(fn, snap)
    received._sent = data  # sent on again (Dask: scheduler -> worker) as it came
    return received


def _run_received(owner: Any, data: bytes) -> RunOf:
    """Unpickle a RunOf (``owner`` may still be half-built: it is only called later)."""
    return RunOf(owner, carrier_from_bytes(len, data)._snap)


def wrap(fn: Callable[..., _T]) -> Callable[..., _T]:
    """Snapshot the calling line now; return a callable that runs ``fn`` with it as origin.

    Call the result later, on any thread: snapshots taken inside link to the creating
    line, and an exception escaping ``fn`` carries it (see :func:`origin_of`). It costs
    one O(1) snapshot. Without ``install()`` the snapshot walks the real frames.
    """
    if not callable(fn):
        raise TypeError(f"monstack.wrap() needs a callable, got {_type_name(fn)}")
    return WithOrigin(fn, _snap())


class origin:
    """``with monstack.origin(snap):`` runs the block with ``snap`` as the current origin.

    For code that runs work it did not create (a framework's worker loop): snapshots in
    the block link to ``snap``, and an exception leaving the block carries it unless it
    already has an origin. ``origin(None)`` runs the block with no origin.
    """

    __slots__ = ("_snap", "_token", "_prev")

    def __init__(self, snap: Optional[Snapshot]) -> None:
        if snap is not None and not isinstance(snap, Snapshot):
            raise TypeError(f"monstack.origin() needs a Snapshot or None, got {_type_name(snap)}")
        self._snap = snap
        self._token: Any = None
        self._prev: Any = None

    def __enter__(self) -> Optional[Snapshot]:
        if self._token is not None:
            raise RuntimeError("this monstack.origin() block is already entered")
        self._token = CURRENT_ORIGIN.set(self._snap)
        cell = running_cell()
        self._prev = (cell, cell[0])
        cell[0] = self._snap
        return self._snap

    def __exit__(self, typ: Any, exc: Optional[BaseException], tb: Any) -> None:
        token, self._token = self._token, None
        prev, self._prev = self._prev, None
        if prev is not None:
            try:
                prev[0][0] = prev[1]
            except IndexError:  # (emptied meanwhile: left as it is)
                pass
        if isinstance(exc, Exception) and self._snap is not None:
            attach_if_absent(exc, self._snap)
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

    Stores it as ``exc.__monstack_origin__`` (an exception that refuses attributes keeps
    it in a side table): :func:`origin_of` returns it and the reporting edges (the
    excepthooks while installed, pytest's report, ``monstack.logging``,
    :func:`format_exception`) show it. ``str(exc)`` and ``exc.__notes__`` are left alone,
    except in notes mode (``install(notes=True)``, never under pytest), which adds (or
    replaces) one PEP 678 note headed "Work created at (most recent call last):".
    """
    if not isinstance(exc, BaseException):
        raise TypeError(f"monstack.attach() needs an exception instance, got {_type_name(exc)}")
    if not isinstance(snap, Snapshot):
        raise TypeError(f"monstack.attach() needs a Snapshot, got {_type_name(snap)}")
    store_origin(exc, snap)
    if notes_on():
        set_note(exc, snap)
    return exc


def origin_of(exc: BaseException) -> Optional[Snapshot]:
    """The snapshot attached to ``exc`` (see :func:`attach`), or None."""
    if not isinstance(exc, BaseException):
        raise TypeError(f"monstack.origin_of() needs an exception instance, got {_type_name(exc)}")
    return stored_origin(exc)


def format_exception(exc: BaseException, color: Optional[bool] = None) -> str:
    """The traceback of ``exc`` (as CPython prints it) followed by its origin chain.

    ``color=None``: as suits ``sys.stderr`` (CPython's rules). Never raises for hostile
    exceptions (failing ``__str__``/``__repr__``, refused attributes).
    """
    if not isinstance(exc, BaseException):
        raise TypeError(f"monstack.format_exception() needs an exception instance, got {_type_name(exc)}")
    _format = _fmt()
    from ._colorize import resolve

    return _format.format_exception(exc, stored_origin(exc), resolve(color, sys.stderr), stored_origin)


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
    _format = _fmt()
    from ._colorize import resolve

    file.write(_format.format_exception(exc, stored_origin(exc), resolve(color, file), stored_origin))


def drop_own_entry(exc: BaseException, frame: Any) -> None:
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


def has_frames(snap: Snapshot) -> bool:
    """True if ``snap`` has a frame to show (``_format.has_frames``, without loading the
    formatting: this runs on every failure that leaves propagated work)."""
    try:
        return bool(snap._display_records())
    except Exception:
        return False


def attach_if_absent(exc: BaseException, snap: Snapshot) -> None:
    """Automatic attach: the first (innermost) origin with a frame to show wins (one with
    none says nothing: an outer one may); the exception looks as it did (a note only in
    notes mode). Never raises."""
    try:
        if stored_origin(exc) is None and has_frames(snap):
            store_origin(exc, snap)
            if notes_on():
                set_note(exc, snap)
    except Exception:
        pass


def notes_on() -> bool:
    """Notes mode: installed with ``notes=True`` (``MONSTACK_NOTES=1``), and not under
    pytest (whose ``raises(match=)`` matches notes too: its report shows origins)."""
    try:
        state = _capture.running()
        return (state is not None and bool(state.options.get("notes"))
                and sys.modules.get("_pytest") is None)
    except Exception:
        return False


def origins_in(exc: BaseException, limit: int = 100) -> list:
    """``(exception, origin)`` for ``exc`` and the exceptions chained to it or grouped in
    it, outermost first, where the origin has a frame to show."""
    found: list = []
    seen: set = set()
    todo: list = [exc]
    while todo and len(seen) < 1000 and len(found) < limit:
        e = todo.pop(0)
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        snap = stored_origin(e)
        if snap is not None and has_frames(snap):
            found.append((e, snap))
        try:
            todo.append(e.__cause__)
            if not e.__suppress_context__:
                todo.append(e.__context__)
            members = getattr(e, "exceptions", None)
            if isinstance(members, (list, tuple)):
                todo.extend(members)
        except Exception:
            pass
    return found


class notes_shown:
    """``with notes_shown(exc):`` gives ``exc`` and the exceptions chained to or grouped in
    it a note with their origin, for a report printed by code that shows notes (another
    tool's excepthook, asyncio's handler), and takes exactly those notes off again after
    (a ``__notes__`` that did not exist is removed)."""

    __slots__ = ("_exc", "_added")

    def __init__(self, exc: BaseException) -> None:
        self._exc = exc
        self._added: list = []

    def __enter__(self) -> None:
        try:
            found = origins_in(self._exc)
        except Exception:
            return
        for e, snap in found:
            try:  # (each on its own: one exception's odd __notes__ stops no other's note)
                if "__notes__" in type(e).__dict__:
                    continue  # a __notes__ of its class's own (a property...): left alone
                notes = e.__dict__.get("__notes__")
                if notes is None:
                    had = False
                elif isinstance(notes, list):
                    if any(_fmt().is_origin_note(n) for n in notes):
                        continue  # notes mode put it there already
                    had = True
                else:
                    continue
                note = _fmt().origin_note(snap)
                if not note:
                    continue
                if had:
                    notes.append(note)
                else:
                    e.__notes__ = [note]
                self._added.append((e, note, had))
            except Exception:
                pass

    def __exit__(self, *exc_info: Any) -> None:
        added, self._added = self._added, []
        for e, note, had in added:
            try:
                notes = e.__dict__.get("__notes__")
                if isinstance(notes, list):
                    for i in range(len(notes) - 1, -1, -1):
                        if notes[i] is note:
                            del notes[i]
                            break
                    if not had and not notes:
                        del e.__notes__
            except Exception:
                pass


def store_origin(exc: BaseException, snap: Snapshot) -> None:
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
        ref = _weakref(exc, _forget)
    except TypeError:  # pragma: no cover - every BaseException supports weak references
        return
    _SIDE[key] = (ref, snap)


def stored_origin(exc: BaseException) -> Optional[Snapshot]:
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


def set_note(exc: BaseException, snap: Snapshot) -> None:
    """Add the plain-text note once; replace monstack's earlier note if there is one."""
    _format = _fmt()
    note = _format.origin_note(snap)
    if not note:
        return  # no frames to show
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
