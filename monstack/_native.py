"""Load relocation-free machine code built by ``compat/build_native.py`` (generic).

A blob is ``monstack/_native/<name>.bin`` plus its manifest ``<name>.json`` (symbol
offsets, size, sha256, CPython version of the headers it was compiled against). It
names no external symbol: the functions and objects of the C API it uses go through
an address table inside the blob (symbol ``ms_table``: a magic, a slot count, then one
pointer per slot; ``ms_table_names``: the slots' names, NUL-separated, each
``f:<symbol>`` = a function's address, ``o:<symbol>`` = an object's address,
``p:<symbol>`` = the value of a pointer variable such as ``PyExc_TypeError``).

Loading: map anonymous memory read-write, copy the blob, fill the table from ctypes,
then switch the pages to read+execute (never writable and executable at once). The
pages are never unmapped: a thread may still be running the code after whatever used
it is gone. Functions in the blob become Python callables through a ``PyMethodDef``
kept alive for the life of the process and ``PyCFunction_NewEx``.

Only ``ctypes`` is needed: no compiler on the user's machine.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import platform
import struct
import sys
import threading
from typing import Any, Callable, Dict, List, Optional

from . import _env

NATIVE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_native")

#: PyMethodDef flags.
METH_VARARGS = 0x0001
METH_NOARGS = 0x0004
METH_O = 0x0008
METH_FASTCALL = 0x0080

_PROT_READ = getattr(mmap, "PROT_READ", 1)
_PROT_WRITE = getattr(mmap, "PROT_WRITE", 2)
_PROT_EXEC = getattr(mmap, "PROT_EXEC", 4)
_MAP_PRIVATE = getattr(mmap, "MAP_PRIVATE", 2)
_MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0x20)


class NativeUnavailable(RuntimeError):
    """The blob cannot be used here; ``str()`` says why (shown by ``info``)."""


_MACHINE: Optional[str] = None


def machine() -> str:
    global _MACHINE
    if _MACHINE is None:
        try:
            m = os.uname().machine.lower()
        except AttributeError:  # pragma: no cover - not POSIX
            m = platform.machine().lower()
        _MACHINE = {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)
    return _MACHINE


class PyMethodDef(ctypes.Structure):
    _fields_ = [
        ("ml_name", ctypes.c_char_p),
        ("ml_meth", ctypes.c_void_p),
        ("ml_flags", ctypes.c_int),
        ("ml_doc", ctypes.c_char_p),
    ]


#: Everything that must live as long as the process: mappings, method defs, names.
_FOREVER: List[Any] = []
_lock = threading.Lock()
_loaded: Dict[str, "Blob"] = {}


class Blob:
    """A loaded blob: ``base`` address, ``symbols`` (name -> offset), ``manifest``."""

    def __init__(self, name: str, base: int, size: int, manifest: dict) -> None:
        self.name = name
        self.base = base
        self.size = size
        self.manifest = manifest
        self.symbols: Dict[str, int] = manifest["symbols"]

    def addr(self, symbol: str) -> int:
        try:
            return self.base + self.symbols[symbol]
        except KeyError:
            raise NativeUnavailable(f"{self.name}: no symbol {symbol!r} in the blob") from None

    def read(self, symbol: str, size: int, offset: int = 0) -> bytes:
        return ctypes.string_at(self.addr(symbol) + offset, size)

    def cstrings(self, symbol: str) -> List[str]:
        """A NUL-separated list of names ending with an empty string (C ``"a\\0b\\0"``)."""
        out = []
        at = self.addr(symbol)
        while True:
            s = ctypes.string_at(at)
            if not s:
                return out
            out.append(s.decode("ascii"))
            at += len(s) + 1

    def function(self, symbol: str, name: str, flags: int = METH_FASTCALL, self_obj: Any = None,
                 doc: Optional[str] = None) -> Callable:
        """A builtin function running ``symbol`` with ``self_obj`` as its ``self``."""
        return make_function(self.addr(symbol), name, flags, self_obj, doc)


def manifest_path(name: str) -> str:
    return os.path.join(NATIVE_DIR, name + ".json")


def read_manifest(name: str) -> dict:
    path = manifest_path(name)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise NativeUnavailable(f"no native code for this platform ({name} not shipped)") from None
    except (OSError, ValueError) as exc:
        raise NativeUnavailable(f"{path}: unreadable manifest ({exc})") from None


def resolve(entry: str) -> int:
    """Address for one table slot (``f:``/``o:``/``p:`` + symbol), from the running Python."""
    kind, _, sym = entry.partition(":")
    api = ctypes.pythonapi
    try:
        if kind == "f":
            return ctypes.cast(getattr(api, sym), ctypes.c_void_p).value or 0
        if kind == "o":
            return ctypes.addressof(ctypes.c_char.in_dll(api, sym))
        if kind == "p":
            return ctypes.c_void_p.in_dll(api, sym).value or 0
    except (AttributeError, ValueError) as exc:
        raise NativeUnavailable(f"the interpreter does not export {sym} ({exc})") from None
    raise NativeUnavailable(f"bad table entry {entry!r}")


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.restype = ctypes.c_int
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def load(name: str, expect_table_magic: Optional[int] = None) -> Blob:
    """Load ``name`` once per process (later calls return the same Blob)."""
    with _lock:
        blob = _loaded.get(name)
        if blob is None:
            blob = _loaded[name] = _load(name, expect_table_magic)
        return blob


def _load(name: str, expect_table_magic: Optional[int]) -> Blob:
    if not sys.platform.startswith("linux"):
        raise NativeUnavailable(f"native code is built for Linux only (this is {sys.platform})")
    manifest = read_manifest(name)
    if manifest.get("format") != 1:
        raise NativeUnavailable(f"{name}: unknown manifest format {manifest.get('format')!r}")
    if manifest.get("arch") != machine():
        raise NativeUnavailable(f"{name} is {manifest.get('arch')} code, this machine is {machine()}")
    try:
        with open(os.path.join(NATIVE_DIR, name + ".bin"), "rb") as f:
            data = f.read()
    except OSError as exc:
        raise NativeUnavailable(f"{name}.bin unreadable ({exc})") from None
    if _env.sha256_hex(data) != manifest.get("sha256"):
        raise NativeUnavailable(f"{name}.bin does not match its manifest (sha256)")
    size = int(manifest["size"])
    if size < len(data):
        raise NativeUnavailable(f"{name}: manifest size smaller than the blob")
    page = mmap.PAGESIZE
    mapsize = (size + page - 1) // page * page
    libc = _libc()
    base = libc.mmap(None, mapsize, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
    if base is None or base == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise NativeUnavailable(f"cannot map memory for native code ({os.strerror(err)})")
    _FOREVER.append(("mapping", name, base, mapsize))  # never unmapped
    ctypes.memmove(base, data, len(data))
    blob = Blob(name, base, size, manifest)
    _fill_table(blob, expect_table_magic)
    if libc.mprotect(base, mapsize, _PROT_READ | _PROT_EXEC) != 0:
        err = ctypes.get_errno()
        raise NativeUnavailable(f"the OS refuses executable memory (mprotect: {os.strerror(err)})")
    if machine() == "aarch64":
        _clear_icache(base, base + len(data))
    return blob


def _clear_icache(start: int, end: int) -> None:
    """aarch64: make the instruction cache see the code just copied (libgcc's
    ``__clear_cache``; the data and instruction caches are not coherent there)."""
    for lib in ("libgcc_s.so.1", None):
        try:
            fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(("__clear_cache", ctypes.CDLL(lib)))
        except (OSError, AttributeError):
            continue
        fn(start, end)
        return
    raise NativeUnavailable("cannot flush the instruction cache (no __clear_cache in libgcc_s.so.1)")


def _fill_table(blob: Blob, expect_magic: Optional[int]) -> None:
    table = blob.addr("ms_table")
    magic, nslots = struct.unpack("<QQ", ctypes.string_at(table, 16))
    if expect_magic is not None and magic != expect_magic:
        raise NativeUnavailable(f"{blob.name}: table magic {magic:#x}, expected {expect_magic:#x}")
    names = blob.cstrings("ms_table_names")
    if len(names) != nslots:
        raise NativeUnavailable(f"{blob.name}: {len(names)} table names for {nslots} slots")
    ptr = ctypes.sizeof(ctypes.c_void_p)
    for i, entry in enumerate(names):
        address = resolve(entry)
        if not address:
            raise NativeUnavailable(f"{blob.name}: {entry} resolves to NULL")
        ctypes.c_void_p.from_address(table + 16 + i * ptr).value = address


def api_function(name: str, restype: Any, *argtypes: Any) -> Any:
    """A private ctypes prototype for a C-API function (GIL held, Python errors
    checked), so that setting ``restype``/``argtypes`` never changes the shared
    ``ctypes.pythonapi.<name>`` other code may use."""
    try:
        return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))
    except AttributeError:
        raise NativeUnavailable(f"the interpreter does not export {name}") from None


_PyCFunction_NewEx = None


def make_function(address: int, name: str, flags: int, self_obj: Any, doc: Optional[str] = None) -> Callable:
    """A builtin function object for the C function at ``address`` (its def lives forever)."""
    global _PyCFunction_NewEx
    if _PyCFunction_NewEx is None:
        _PyCFunction_NewEx = api_function(
            "PyCFunction_NewEx", ctypes.py_object, ctypes.c_void_p, ctypes.py_object, ctypes.c_void_p
        )
    ml_name = ctypes.create_string_buffer(name.encode("ascii"))
    ml_doc = ctypes.create_string_buffer(doc.encode("utf-8")) if doc else None
    mdef = PyMethodDef()
    mdef.ml_name = ctypes.cast(ml_name, ctypes.c_char_p)
    mdef.ml_meth = address
    mdef.ml_flags = flags
    mdef.ml_doc = ctypes.cast(ml_doc, ctypes.c_char_p) if ml_doc is not None else None
    _FOREVER.append((mdef, ml_name, ml_doc))
    return _PyCFunction_NewEx(ctypes.addressof(mdef), self_obj, None)


def cached_function(blob: Blob, symbol: str, name: str, flags: int = METH_FASTCALL, self_obj: Any = None) -> Callable:
    """Like ``Blob.function`` but one def per (blob, symbol, name, flags) for the process:
    use it for functions made repeatedly (one per install) so defs do not pile up."""
    key = (blob.name, symbol, name, flags)
    with _lock:
        mdef = _DEFS.get(key)
        if mdef is None:
            fn = make_function(blob.addr(symbol), name, flags, self_obj)
            _DEFS[key] = _FOREVER[-1][0]
            return fn
    return _PyCFunction_NewEx(ctypes.addressof(mdef), self_obj, None)


_DEFS: Dict[tuple, PyMethodDef] = {}
