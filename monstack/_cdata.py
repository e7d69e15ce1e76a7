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
Each type and prototype is a class (~0.1-0.2M instructions to make): only ``c_void_p`` and
``py_object`` are made at import, every other name at first use (the loader needs no
other: see ``_native.api_word``).

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

# -- the simple types (ctypes' definitions) ------------------------------------------------
# Only these two are made at import: the loader reads and writes every word of memory and
# passes every argument as a ``c_void_p`` (see ``_native.api_word``). Each type costs
# ~0.15-0.2M instructions to create, so the others are made at first use.

class py_object(_SimpleCData):
    _type_ = "O"


class c_void_p(_SimpleCData):
    _type_ = "P"


# Made at first use (module ``__getattr__``): start-up needs none of them.
_LAZY_TYPES = {"c_char": "c", "c_char_p": "z", "c_ubyte": "B", "c_uint8": "B", "c_int": "i", "c_long": "l",
               "c_ulong": "L"}
#: Those ctypes picks by size: as ctypes does, long long is long where both are 64 bits
#: (LP64: 64-bit Linux, macOS), and size_t/ssize_t are the unsigned/signed type of a
#: pointer's size. name -> (the type it is where the sizes agree, the ``_type_`` code of
#: the one it is made as otherwise, the type whose size must match).
_SIZED = {"c_longlong": ("c_long", "q", 8), "c_ulonglong": ("c_ulong", "Q", 8),
          "c_int64": ("c_longlong", "", 0), "c_uint64": ("c_ulonglong", "", 0),
          "c_size_t": ("c_ulong", "", -1), "c_ssize_t": ("c_long", "", -1)}
c_char: Any
c_char_p: Any
c_ubyte: Any
c_uint8: Any
c_int: Any
c_long: Any
c_ulong: Any
c_longlong: Any
c_ulonglong: Any
c_int64: Any
c_uint64: Any
c_size_t: Any
c_ssize_t: Any


def __getattr__(name: str) -> Any:
    if name in _SIZED:
        return _sized(name)
    if name == "memmove":
        return _memmove()
    code = _LAZY_TYPES.get(name)
    if code is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name == "c_uint8":
        return __getattr__("c_ubyte")
    return _simple(name, code)


def _simple(name: str, code: str) -> Any:
    class simple(_SimpleCData):
        _type_ = code

    simple.__name__ = simple.__qualname__ = name
    globals()[name] = simple
    if name == "c_ubyte":
        globals()["c_uint8"] = simple
    return simple


def _sized(name: str) -> Any:
    base_name, code, size = _SIZED[name]
    base = __getattr__(base_name)
    if size == -1:  # size_t, ssize_t: unsigned/signed long where it has a pointer's size
        if sizeof(base) != sizeof(c_void_p):  # pragma: no cover (LLP64: Windows)
            base = __getattr__(base_name.replace("long", "longlong"))
    elif size and sizeof(base) != size:  # pragma: no cover (LLP64: Windows)
        base = _simple(name, code)
    globals()[name] = base
    return base


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

def _memmove() -> Any:
    """``memmove(dst, src, n)``: ``void *memmove(void *, const void *, size_t)`` (made at
    first use: the loader copies its code with ``_native.libc_word``'s prototype)."""
    fn = globals()["memmove"] = CFUNCTYPE(c_void_p, c_void_p, c_void_p, __getattr__("c_size_t"))(_memmove_addr)
    return fn


memmove: Any
_cast: Any = None


def cast(obj: Any, typ: Any) -> Any:
    """``ctypes.cast``: ``obj`` (an address or a ctypes instance) as a ``typ``. (Its C
    helper's function object is made at the first call: the 3.12+ loader never casts.)"""
    global _cast
    if _cast is None:
        _cast = PYFUNCTYPE(py_object, c_void_p, py_object, py_object)(_cast_addr)
    return _cast(obj, obj, typ)


_string_at: Any = None


def string_at(ptr: int, size: int = -1) -> bytes:
    """``ctypes.string_at``: ``size`` bytes at ``ptr`` (-1: up to its NUL). (Its function
    object is made at the first call: a trusted start-up reads no string.)"""
    global _string_at
    if _string_at is None:
        _string_at = PYFUNCTYPE(py_object, c_void_p, __getattr__("c_int"))(_string_at_addr)
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
