"""The part of ``ctypes`` monstack's native loader uses, made from ``_ctypes`` directly.

Why: start-up cost. ``MONSTACK=1`` loads the native code at interpreter start-up, and
``import ctypes`` costs ~9.6M instructions there (CPython 3.13: the package defines every
C type, loads ``struct``, ``types``, ``ctypes._endian``..., and 3.14 also ``sysconfig``
and with it ``threading``), where ``import _ctypes``, the C extension all of it is built
on, costs ~1.2M. This module defines only the types and helpers ``_native``, ``_accel``
and ``_evalframe`` use, each exactly as ``Lib/ctypes/__init__.py`` defines it (3.11 to
3.15 agree on all of them): the same ``_type_`` codes, the same prototype classes and
flags, ``memmove``/``string_at``/``cast`` from the same C helpers. Objects made here are
interchangeable with ``ctypes``' own (``_ctypes`` checks ``_type_`` codes, not classes).

Not here: ``Structure`` subclasses with ``_fields_`` (on 3.14+ ``_ctypes`` computes their
layout in ``ctypes._layout``, which imports the package: ``_native`` lays its one struct
out by hand), ``POINTER`` (not in ``_ctypes`` on 3.14+) and the library loaders.

If ``_ctypes`` cannot be imported (3.12: an isolated subinterpreter), importing this
module raises ``ImportError``, as ``import ctypes`` would.
"""

from __future__ import annotations

import sys

from _ctypes import FUNCFLAG_CDECL, FUNCFLAG_PYTHONAPI, FUNCFLAG_USE_ERRNO, RTLD_LOCAL, CFuncPtr
from _ctypes import _SimpleCData, addressof, get_errno, sizeof
from _ctypes import _cast_addr, _memmove_addr, _string_at_addr  # type: ignore[attr-defined]  # (not in typeshed)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, Optional, Tuple

# -- the simple types (ctypes' definitions; those it picks by size below) -----------------

class py_object(_SimpleCData):
    _type_ = "O"


class c_long(_SimpleCData):
    _type_ = "l"


class c_ulong(_SimpleCData):
    _type_ = "L"


class c_int(_SimpleCData):
    _type_ = "i"


class c_void_p(_SimpleCData):
    _type_ = "P"


# ctypes picks these by size. Each type costs ~0.2M instructions to create (3.13), so,
# as ctypes does, long long is long where both are 64 bits (LP64: 64-bit Linux, macOS).
if sizeof(c_long) == 8:
    c_longlong: Any = c_long
    c_ulonglong: Any = c_ulong
else:  # pragma: no cover (LLP64: Windows)

    class c_longlong(_SimpleCData):  # type: ignore[no-redef]
        _type_ = "q"

    class c_ulonglong(_SimpleCData):  # type: ignore[no-redef]
        _type_ = "Q"


c_int64 = c_longlong
c_uint64 = c_ulonglong
c_size_t: Any = c_ulong if sizeof(c_ulong) == sizeof(c_void_p) else c_ulonglong
c_ssize_t: Any = c_long if sizeof(c_long) == sizeof(c_void_p) else c_longlong


# Made at first use (module ``__getattr__``): the loader needs none of them at start-up.
_LAZY_TYPES = {"c_char": "c", "c_char_p": "z", "c_ubyte": "B", "c_uint8": "B"}
c_char: Any
c_char_p: Any
c_ubyte: Any
c_uint8: Any


def __getattr__(name: str) -> Any:
    code = _LAZY_TYPES.get(name)
    if code is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name == "c_uint8":
        return __getattr__("c_ubyte")

    class simple(_SimpleCData):
        _type_ = code

    simple.__name__ = simple.__qualname__ = name
    globals()[name] = simple
    if name == "c_ubyte":
        globals()["c_uint8"] = simple
    return simple


# -- function prototypes -----------------------------------------------------------------

_c_functype_cache: Dict[Tuple[Any, Tuple[Any, ...], int], Any] = {}


def CFUNCTYPE(restype: Any, *argtypes: Any, use_errno: bool = False) -> Any:
    """``ctypes.CFUNCTYPE``: a prototype for a C function (the GIL released around calls);
    one class per signature, cached."""
    flags = FUNCFLAG_CDECL | (FUNCFLAG_USE_ERRNO if use_errno else 0)
    try:
        return _c_functype_cache[(restype, argtypes, flags)]
    except KeyError:
        pass

    class CFunctionType(CFuncPtr):
        _argtypes_ = argtypes
        _restype_ = restype
        _flags_ = flags

    _c_functype_cache[(restype, argtypes, flags)] = CFunctionType
    return CFunctionType


def PYFUNCTYPE(restype: Any, *argtypes: Any) -> Any:
    """``ctypes.PYFUNCTYPE``: a prototype for a C-API function (GIL held, Python errors
    checked). Cached per signature like ``CFUNCTYPE``'s (ctypes makes a new class each
    time: ~0.17M instructions on 3.13, and the loader's checks repeat signatures)."""
    flags = FUNCFLAG_CDECL | FUNCFLAG_PYTHONAPI
    try:
        return _c_functype_cache[(restype, argtypes, flags)]
    except KeyError:
        pass

    class CFunctionType(CFuncPtr):
        _argtypes_ = argtypes
        _restype_ = restype
        _flags_ = flags

    _c_functype_cache[(restype, argtypes, flags)] = CFunctionType
    return CFunctionType


class DLL:
    """A loaded library as ``_ctypes`` needs one: an object with ``_handle``, for
    ``prototype((name, dll))`` and ``<type>.in_dll(dll, name)`` (ctypes' ``CDLL`` minus
    the attribute access that makes and caches a function object per name)."""

    def __init__(self, name: Optional[str], handle: Optional[int] = None) -> None:
        self._name = name
        # (typeshed misses that dlopen takes None: the program's own symbols)
        self._handle: int = handle if handle is not None else _dlopen(name, RTLD_LOCAL)  # type: ignore[arg-type]


if sys.platform == "win32":  # pragma: no cover (monstack's machine code is Linux's)
    pythonapi = DLL("python dll", sys.dllhandle)
else:
    from _ctypes import dlopen as _dlopen
    from _ctypes import dlsym

    #: ``ctypes.pythonapi`` (``PyDLL(None)``: the symbols of the running interpreter).
    pythonapi = DLL(None)


# -- memory ------------------------------------------------------------------------------

#: ``memmove(dst, src, n)``: ``void *memmove(void *, const void *, size_t)``.
memmove = CFUNCTYPE(c_void_p, c_void_p, c_void_p, c_size_t)(_memmove_addr)

_cast: Any = None


def cast(obj: Any, typ: Any) -> Any:
    """``ctypes.cast``: ``obj`` (an address or a ctypes instance) as a ``typ``. (Its C
    helper's function object is made at the first call: the 3.12+ loader never casts.)"""
    global _cast
    if _cast is None:
        _cast = PYFUNCTYPE(py_object, c_void_p, py_object, py_object)(_cast_addr)
    return _cast(obj, obj, typ)


_string_at = PYFUNCTYPE(py_object, c_void_p, c_int)(_string_at_addr)


def string_at(ptr: int, size: int = -1) -> bytes:
    """``ctypes.string_at``: ``size`` bytes at ``ptr`` (-1: up to its NUL)."""
    return _string_at(ptr, size)


def create_string_buffer(init: bytes | int) -> Any:
    """``ctypes.create_string_buffer(bytes_or_size)``: a zeroed ``c_char`` array, of
    ``len(init) + 1`` bytes holding ``init`` or of ``init`` bytes."""
    char = __getattr__("c_char")
    if isinstance(init, bytes):
        size = len(init) + 1
        sys.audit("ctypes.create_string_buffer", init, size)
        buf: Any = (char * size)()
        buf.value = init
        return buf
    if isinstance(init, int):
        sys.audit("ctypes.create_string_buffer", None, init)
        return (char * init)()
    raise TypeError(init)
