"""The one loader of monstack's machine code (built by ``native/build.py``).

A blob ``<name>`` is its manifest plus one ``<name>-<arch>.bin`` per architecture. The
manifest is stored twice: ``monstack/_native/<name>.json`` (canonical, human-readable,
what reviews and tests read) and ``<name>.manifest``, the same dict as
``marshal.dumps(manifest, 4)``, which is what this loader reads (``marshal`` is built
into every interpreter: no import at start-up, unlike ``json``). A blob names no
external symbol: the functions and objects of the C API it uses go through an address
table the loader fills in. The manifest (format 3) says, per architecture: the image's
size, sha256 and checksum, its global symbols (name -> offset), the table's slots
(``f:<symbol>`` = a function's address, ``o:<symbol>`` = an object's address,
``p:<symbol>`` = the value of a pointer variable such as ``PyExc_TypeError``; each ->
its offset from the start of the mapping), an optional data area (``{"offset", "size",
"align"}``: zeroed pages right after the code, read-write for good), the layout the
code was compiled with, compiler and flags; and, for all, the CPython version of the
headers and the sha256 of each C source.

The image is checked at load against its entry's ``size`` and ``checksum``:
``int.from_bytes(image, "little") % 1073741789``, which needs no import and catches a
corrupted, truncated or mismatched image (a ``.bin`` from another build than its
manifest). The ``sha256`` is not checked at load: it stays in the manifest for
provenance and the tests. A digest at load would add no protection against tampering
(whoever can write the image can write its manifest; pip checks every installed file's
hash against ``RECORD``), and it cost ~1.5-1.6M instructions at every start-up.

Loading: map anonymous memory read-write, copy the image, fill the table, then switch
the code pages to read+execute (never writable and executable at once; a data area
stays read-write); on aarch64, flush the instruction cache. The pages are never
unmapped: a thread may still be running the code after whatever used it is gone.
Functions in the blob become Python callables through a ``PyMethodDef`` kept alive for
the life of the process and ``PyCFunction_NewEx``.

Only ``_ctypes`` is needed, through ``_cdata`` (the part of ``ctypes`` used here,
without importing ``ctypes``: start-up cost): no compiler on the user's machine.
Users (``_accel``, ``_evalframe``) turn ``NativeUnavailable`` into their "why not"
string.
"""

from __future__ import annotations

import _thread
import marshal
import os
import sys

from . import _cdata as C
from . import _env

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple


NATIVE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_native")
#: The manifest format this loader reads (``native/build.py`` writes it). 3: each
#: architecture's entry has a ``checksum``, and a marshal copy (``<name>.manifest``)
#: sits beside the JSON.
FORMAT = 3
#: ``checksum(image)`` is the image as a little-endian integer modulo this prime.
CHECKSUM_MODULUS = 1073741789  # the largest prime below 2**30 (one CPython int digit: a fast modulo)

#: PyMethodDef flags.
METH_VARARGS = 0x0001
METH_NOARGS = 0x0004
METH_O = 0x0008
METH_FASTCALL = 0x0080
METH_KEYWORDS = 0x0002

#: Linux's mmap/mprotect constants (the same on x86-64 and aarch64; a test checks them
#: against the ``mmap`` module, which is not imported for these alone).
_PROT_READ = 1
_PROT_WRITE = 2
_PROT_EXEC = 4
_MAP_PRIVATE = 2
_MAP_ANONYMOUS = 0x20
_MAP_FAILED = (1 << 64) - 1  # ((void *) -1, read as a c_void_p)


class NativeUnavailable(RuntimeError):
    """The blob cannot be used here; ``str()`` says why (shown by ``info``)."""


def machine() -> str:
    """This machine's architecture as the manifests name it (x86_64, aarch64...)."""
    return _env.MACHINE


#: ``struct PyMethodDef {const char *ml_name; PyCFunction ml_meth; int ml_flags; const
#: char *ml_doc;}`` as C lays it out: each field at its size's alignment, the whole
#: padded to a pointer's (laid out here: a ``Structure`` with ``_fields_`` imports
#: ``ctypes`` on 3.14+, see ``_cdata``; tests compare with one).
_PTR = C.sizeof(C.c_void_p)
_INT = 4  # (a C int: 32 bits on every platform CPython runs on)
ML_NAME = 0
ML_METH = _PTR
ML_FLAGS = 2 * _PTR
ML_DOC = -(-(ML_FLAGS + _INT) // _PTR) * _PTR
SIZEOF_PYMETHODDEF = ML_DOC + _PTR


#: Everything that must live as long as the process: mappings, method defs, names.
_FOREVER: List[Any] = []
_lock = _thread.allocate_lock()
_loaded: Dict[str, "Blob"] = {}


class Blob:
    """A loaded blob: mapped at ``base`` (``size`` bytes of code, ``map_size`` with the
    data area), its ``manifest``, this architecture's entry ``info`` (``symbols``,
    ``layout``...), and ``data`` (address of the data area, 0 if it has none)."""

    def __init__(self, name: str, base: int, manifest: dict, info: dict, map_size: int) -> None:
        self.name = name
        self.base = base
        self.manifest = manifest
        self.info = info
        self.size: int = info["size"]
        self.map_size = map_size
        self.symbols: Dict[str, int] = info["symbols"]
        self.layout: Dict[str, Any] = info["layout"]
        data = info.get("data")
        self.data: int = base + data["offset"] if data else 0

    def addr(self, symbol: str) -> int:
        try:
            return self.base + self.symbols[symbol]
        except KeyError:
            raise NativeUnavailable(f"{self.name}: no symbol {symbol!r} in the blob") from None

    def read(self, symbol: str, size: int, offset: int = 0) -> bytes:
        return read_bytes(self.addr(symbol) + offset, size)

    def cstrings(self, symbol: str) -> List[str]:
        """A NUL-separated list of names ending with an empty string (C ``"a\\0b\\0"``)."""
        at = self.addr(symbol)
        if not self.base <= at < self.base + self.size:
            raise NativeUnavailable(f"{self.name}: the name list {symbol!r} is outside the code")
        raw = read_bytes(at, self.base + self.size - at)  # one read, to the code's end
        end = raw.find(b"\0\0") if not raw.startswith(b"\0") else 0
        if end < 0:
            raise NativeUnavailable(f"{self.name}: the name list {symbol!r} has no end")
        return raw[:end].decode("ascii").split("\0") if end else []

    # the data area (offsets from its start), read-write for the life of the process
    def put_ptr(self, offset: int, value: int) -> None:
        C.c_void_p.from_address(self._data_at(offset)).value = value

    def put_i64(self, offset: int, value: int) -> None:
        C.c_void_p.from_address(self._data_at(offset)).value = value  # (a negative value: two's complement)

    def get_i64(self, offset: int) -> int:
        return signed(C.c_void_p.from_address(self._data_at(offset)).value)

    def _data_at(self, offset: int) -> int:
        data = self.info.get("data")
        if not data or not 0 <= offset <= data["size"] - 8:
            raise IndexError(f"{self.name}: offset {offset} is outside the data area")
        return self.data + offset

    def function(self, symbol: str, name: str, flags: int = METH_FASTCALL, self_obj: Any = None,
                 doc: Optional[str] = None) -> Callable:
        """A builtin function running ``symbol`` with ``self_obj`` as its ``self``."""
        return make_function(self.addr(symbol), name, flags, self_obj, doc)


def manifest_path(name: str) -> str:
    """The manifest the loader reads: ``<name>.manifest`` (``<name>.json`` in marshal form)."""
    return os.path.join(NATIVE_DIR, name + ".manifest")


def read_manifest(name: str) -> dict:
    """The manifest of blob ``name`` (format checked)."""
    path = manifest_path(name)
    try:
        with open(path, "rb") as f:
            manifest = marshal.loads(f.read())
    except FileNotFoundError:
        raise NativeUnavailable(f"no native code for this platform ({name} not shipped)") from None
    except (OSError, EOFError, ValueError, TypeError) as exc:  # marshal: EOFError/ValueError/TypeError
        raise NativeUnavailable(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise NativeUnavailable(f"{name}: unknown manifest format {got!r}")
    return manifest


def checksum(image: bytes) -> int:
    """The manifest's ``checksum`` of an image (no import needed, unlike a digest)."""
    return int.from_bytes(image, "little") % CHECKSUM_MODULUS


def arch_entry(name: str, manifest: Optional[dict] = None) -> Tuple[dict, dict]:
    """(manifest, its entry for this machine) of blob ``name``."""
    if manifest is None:
        manifest = read_manifest(name)
    arches = manifest.get("arches", {})
    info = arches.get(machine())
    if info is None:
        raise NativeUnavailable(f"no {name} code for {machine()} (built for: {', '.join(sorted(arches)) or 'none'})")
    return manifest, info


def read_image(name: str, manifest: Optional[dict] = None, verify: bool = True) -> Tuple[dict, dict, bytes]:
    """(manifest, entry, image bytes) of blob ``name`` for this machine, the bytes
    checked against the manifest (size, and checksum unless ``verify`` is false: an
    image a trusted verdict vouches for, see ``trusted``)."""
    manifest, info = arch_entry(name, manifest)
    try:
        with open(os.path.join(NATIVE_DIR, info["blob"]), "rb") as f:
            image = f.read()
    except OSError as exc:
        raise NativeUnavailable(f"{info['blob']} unreadable ({exc})") from None
    if verify and checksum(image) != info.get("checksum"):
        raise NativeUnavailable(f"{info['blob']} does not match its manifest (checksum)")
    if len(image) != info.get("size"):
        raise NativeUnavailable(f"{info['blob']}: size differs from the manifest's")
    return manifest, info, image


def resolve(entry: str) -> int:
    """Address for one table slot (``f:``/``o:``/``p:`` + symbol), from the running Python:
    ``dlsym`` on the interpreter, the lookup ``ctypes.pythonapi.<sym>`` makes."""
    kind, _, sym = entry.partition(":")
    if kind not in ("f", "o", "p"):
        raise NativeUnavailable(f"bad table entry {entry!r}")
    try:
        address = C.dlsym(C.pythonapi._handle, sym)
    except OSError as exc:
        raise NativeUnavailable(f"the interpreter does not export {sym} ({exc})") from None
    if kind == "p":
        return C.c_void_p.from_address(address).value or 0 if address else 0
    return address or 0


def _mprotect_impl(addr: int, size: int, prot: int) -> int:
    """0, or the errno of a refusal."""
    if int32(libc_word("mprotect", 3)(addr, size, prot)) != 0:
        return C.get_errno() or 1
    return 0


#: indirection so that tests can simulate an OS that refuses executable memory
_mprotect = _mprotect_impl


def load(name: str, manifest: Optional[dict] = None, verify: bool = True) -> Blob:
    """Blob ``name`` for this machine, mapped once per process (later calls return the
    same Blob). For code whose data area holds per-copy state, see ``load_copy``."""
    with _lock:
        blob = _loaded.get(name)
        if blob is None:
            blob = _loaded[name] = load_copy(name, manifest, verify=verify)
        return blob


def load_copy(name: str, manifest: Optional[dict] = None, verify: bool = True, image: Optional[bytes] = None) -> Blob:
    """A new mapping of blob ``name`` for this machine: checked, copied, its table
    filled, its code made read+execute. Raises ``NativeUnavailable`` with the reason.
    ``image``: its bytes, already read and checked by ``read_image`` with ``manifest``."""
    if not sys.platform.startswith("linux"):
        raise NativeUnavailable(f"native code is built for Linux only (this is {sys.platform})")
    if image is None or manifest is None:
        manifest, info, image = read_image(name, manifest, verify)
    else:
        manifest, info = arch_entry(name, manifest)
    page = os.sysconf("SC_PAGE_SIZE")
    code_span = -(-len(image) // page) * page
    data = info.get("data")
    total = code_span
    if data:
        if data["offset"] % page or data["offset"] < len(image):
            raise NativeUnavailable(f"{name}: data area at {data['offset']:#x} is not page aligned after the code")
        total = -(-(data["offset"] + data["size"]) // page) * page
    base = libc_word("mmap", 6)(None, total, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
    if base is None or base == _MAP_FAILED:
        err = C.get_errno()
        raise NativeUnavailable(f"cannot map memory for native code ({os.strerror(err)})")
    _FOREVER.append(("mapping", name, base, total))  # never unmapped
    libc_word("memmove", 3)(base, image, len(image))
    blob = Blob(name, base, manifest, info, total)
    _fill_table(blob)
    err = _mprotect(base, code_span, _PROT_READ | _PROT_EXEC)
    if err:
        raise NativeUnavailable(f"the OS refused executable memory (mprotect: {os.strerror(err)})")
    if machine() == "aarch64":
        _clear_icache(base, base + len(image))
    return blob


def _clear_icache(start: int, end: int) -> None:
    """aarch64: make the instruction cache see the code just copied (libgcc's
    ``__clear_cache``; the data and instruction caches are not coherent there)."""
    for lib in ("libgcc_s.so.1", None):
        try:
            fn = libc_word("__clear_cache", 2, lib)
        except (OSError, AttributeError):
            continue
        fn(start, end)
        return
    raise NativeUnavailable("cannot flush the instruction cache (no __clear_cache in libgcc_s.so.1)")


def _fill_table(blob: Blob) -> None:
    """Write the address of every slot's symbol at its offset (the pages are still
    writable); a symbol the interpreter does not export refuses the blob."""
    end = blob.map_size - C.sizeof(C.c_void_p)
    for entry, offset in blob.info["table"].items():
        if not 0 <= offset <= end:
            raise NativeUnavailable(f"{blob.name}: table slot {entry} at {offset} is outside the blob")
        address = resolve(entry)
        if not address:
            raise NativeUnavailable(f"{blob.name}: {entry} resolves to NULL")
        C.c_void_p.from_address(blob.base + offset).value = address


def api_function(name: str, restype: Any, *argtypes: Any) -> Any:
    """A private ctypes prototype for a C-API function (GIL held, Python errors
    checked), as ``ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))``
    makes it. One per signature, made once. (The loader itself calls through
    ``api_word``/``api_object``: fewer prototypes.)"""
    key = (name, restype, argtypes)
    fn = _API.get(key)
    if fn is None:
        try:
            fn = _API[key] = C.PYFUNCTYPE(restype, *argtypes)((name, C.pythonapi))
        except AttributeError:
            raise NativeUnavailable(f"the interpreter does not export {name}") from None
    return fn


_API: Dict[tuple, Any] = {}

# The loader's prototypes. Each ctypes prototype is a class (~0.1M instructions to make)
# and each C type another (~0.2M), and the loader and its checks call C functions of a
# dozen signatures. So the loader makes two prototypes, one for C-API functions and
# one for libc's, with no argument types; each function object gets its own (every
# argument a machine word, ``c_void_p``: ``argtypes`` and ``restype`` set on the object,
# as on a function of ``ctypes.CDLL``). An object is passed as its address (``id``: the
# caller holds a reference for the call); a result is a word (``signed``/``int32`` read
# it signed), or a new reference (``api_object``). Exact on the only platforms that
# call them, x86-64 and aarch64 Linux (``_accel._refusal``, ``_evalframe``): their
# calling conventions pass every argument here in a 64-bit register, an ``int`` in its
# low half, and return an ``int`` in the low half of one.


def api_word(name: str, nargs: int) -> Any:
    """C-API function ``name`` (GIL held, Python errors checked) taking ``nargs`` words
    and returning a word (None for 0; a borrowed reference as an address)."""
    return _bound(name, nargs, C.c_void_p, True)


def api_object(name: str, nargs: int) -> Any:
    """C-API function ``name`` taking ``nargs`` words and returning a new reference
    (NULL: the Python error it set is raised)."""
    return _bound(name, nargs, C.py_object, True)


def libc_word(name: str, nargs: int, lib: Optional[str] = None) -> Any:
    """C function ``name`` of ``lib`` (None: the process's symbols, libc's among them)
    as ``ctypes.CDLL(lib, use_errno=True).<name>`` calls it (the GIL released, errno
    kept), taking ``nargs`` words and returning a word."""
    return _bound(name, nargs, C.c_void_p, False, lib)


def _bound(name: Any, nargs: int, restype: Any, api: bool, lib: Optional[str] = None) -> Any:
    key = (name, nargs, restype, api, lib)
    fn = _WORD_FNS.get(key)
    if fn is None:
        if api:
            try:
                fn = C.PYFUNCTYPE(C.c_void_p)(name if type(name) is int else (name, C.pythonapi))
            except AttributeError:
                raise NativeUnavailable(f"the interpreter does not export {name}") from None
        else:  # (a missing symbol: AttributeError, as ctypes raises it)
            fn = C.CFUNCTYPE(C.c_void_p, use_errno=True)((name, C.DLL(lib)))
        fn.argtypes = (C.c_void_p,) * nargs
        fn.restype = restype
        _WORD_FNS[key] = fn
    return fn


_WORD_FNS: Dict[tuple, Any] = {}


def read_bytes(address: int, size: int) -> bytes:
    """``size`` bytes at ``address`` (``ctypes.string_at``, through the C-API prototype)."""
    return _bound(C._string_at_addr, 2, C.py_object, True)(address, size)


def signed(result: Optional[int]) -> int:
    """A word (a ``c_void_p`` value: None for 0) as the 64-bit signed integer it holds."""
    value = result or 0
    return value - (1 << 64) if value >= 1 << 63 else value


def int32(result: Optional[int]) -> int:
    """A word result of a C function returning ``int``: the signed low 32 bits."""
    value = (result or 0) & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


_PyCFunction_NewEx: Any = None


#: Where a bytes object's data starts (``PyBytesObject.ob_sval``: the basic size counts
#: its terminating NUL). Checked by ``buffer_address`` before first use.
_BYTES_DATA = bytes.__basicsize__ - 1
_bytes_checked = False


def buffer_address(data: bytes) -> int:
    """The address of ``data``'s bytes, which never move (CPython does not move objects):
    how the loader points C at names and method defs without a ctypes buffer type."""
    global _bytes_checked
    if not _bytes_checked:
        probe = b"monstack: bytes layout"
        at = id(probe) + _BYTES_DATA  # (inside the object whatever the layout: a safe read)
        # (its first two words, read as words: no string type or prototype to make)
        words = [C.c_void_p.from_address(at + i).value for i in (0, _PTR)]
        if words != [int.from_bytes(probe[i:i + _PTR], sys.byteorder) for i in (0, _PTR)] or at % _PTR:
            raise NativeUnavailable("bytes objects are not laid out as expected (PyBytesObject.ob_sval)")
        _bytes_checked = True
    return id(data) + _BYTES_DATA


def make_function(address: int, name: str, flags: int, self_obj: Any, doc: Optional[str] = None) -> Callable:
    """A builtin function object for the C function at ``address`` (its def lives forever)."""
    global _PyCFunction_NewEx
    if _PyCFunction_NewEx is None:
        _PyCFunction_NewEx = api_object("PyCFunction_NewEx", 3)  # (self as an address)
    return _PyCFunction_NewEx(_method_def(address, name, flags, doc), id(self_obj), None)


def make_method(cls: type, address: int, name: str, flags: int, doc: Optional[str] = None) -> Any:
    """A method descriptor of class ``cls`` for the C function at ``address``, as a C
    type's ``tp_methods`` entry makes it (``PyDescr_NewMethod``; its def lives forever)."""
    return api_object("PyDescr_NewMethod", 2)(id(cls), _method_def(address, name, flags, doc))


def _method_def(address: int, name: str, flags: int, doc: Optional[str]) -> int:
    """The address of a new ``PyMethodDef`` for ``address``, kept for the process."""
    # The def and its NUL-terminated strings are bytes objects made with their final
    # content and kept forever (CPython only reads a PyMethodDef): no ctypes array or
    # char-pointer type to create (~0.4M instructions of start-up).
    order = sys.byteorder
    ml_name = name.encode("ascii") + b"\0"
    ml_doc = doc.encode("utf-8") + b"\0" if doc else None
    fields = bytearray(SIZEOF_PYMETHODDEF)  # ml_doc stays NULL unless set
    fields[ML_NAME:ML_NAME + _PTR] = buffer_address(ml_name).to_bytes(_PTR, order)
    fields[ML_METH:ML_METH + _PTR] = address.to_bytes(_PTR, order)
    fields[ML_FLAGS:ML_FLAGS + _INT] = flags.to_bytes(_INT, order)
    if ml_doc is not None:
        fields[ML_DOC:ML_DOC + _PTR] = buffer_address(ml_doc).to_bytes(_PTR, order)
    mdef = bytes(fields)
    at = buffer_address(mdef)
    _FOREVER.append((at, mdef, ml_name, ml_doc))
    return at


def cached_function(blob: Blob, symbol: str, name: str, flags: int = METH_FASTCALL, self_obj: Any = None) -> Callable:
    """Like ``Blob.function`` but one def per (blob, symbol, name, flags) for the process:
    use it for functions made repeatedly (one per install) so defs do not pile up."""
    key = (blob.name, symbol, name, flags)
    with _lock:
        at = _DEFS.get(key)
        if at is None:
            fn = make_function(blob.addr(symbol), name, flags, self_obj)
            _DEFS[key] = _FOREVER[-1][0]
            return fn
    return _PyCFunction_NewEx(at, id(self_obj), None)


#: (blob, symbol, name, flags) -> the address of its method def (kept forever)
_DEFS: Dict[tuple, int] = {}


# -- verdicts: what an earlier process checked, for this very interpreter and blob -------

#: The verdict file's layout.
VERDICT_FORMAT = 1
#: Exported symbols whose distances from the first identify the interpreter's binary
#: (any rebuild that changes code or data moves some of them; ASLR moves none).
_FINGERPRINT = ("f:Py_Initialize", "f:PyType_GenericAlloc", "f:PyObject_GC_Del", "f:PyEval_EvalCode",
                "f:PyThreadState_Get", "f:PyCFunction_NewEx", "o:PyTuple_Type", "o:_Py_NoneStruct")
#: blob name -> how this process's load was checked: "at load" or "by an earlier process (<file>)"
checked: Dict[str, str] = {}
_verdict_keys: Dict[str, tuple] = {}


def verdict_path(name: str) -> str:
    """Where blob ``name``'s verdict lives: ``__pycache__/monstack_<name>.<cache
    tag>.verdict`` in the directory that holds the package (site-packages), as the
    start-up cache; ``PYTHONPYCACHEPREFIX`` and ``-O`` apply as to bytecode. (Not inside
    the package: a file pip does not know of would keep ``monstack/`` after ``pip
    uninstall``, and ``import monstack`` would then find a namespace package.)"""
    parent = os.path.dirname(os.path.dirname(NATIVE_DIR))
    external = sys.modules["_frozen_importlib_external"]
    cached = external.cache_from_source(os.path.join(parent, "monstack_" + name + ".py"))
    return cached[: cached.rfind(".")] + ".verdict"


def _verdict_key(name: str, info: dict, checker: str) -> tuple:
    """What a verdict is valid for: this interpreter (its version and build string,
    and where its exported symbols lie relative to each other), the blob's files and
    the module that checks it (each file's size and modification time)."""
    where = [resolve(entry) for entry in _FINGERPRINT]
    files = (manifest_path(name), os.path.join(NATIVE_DIR, info["blob"]), checker)
    stats = tuple((st.st_mtime_ns, st.st_size) for st in map(os.stat, files))
    return (VERDICT_FORMAT, name, sys.version, sys.hexversion, sys.executable,
            tuple(a - where[0] for a in where), stats)


def trusted(name: str, info: dict, checker: str) -> Optional[dict]:
    """The facts an earlier process recorded (``remember``) after ``checker`` verified
    blob ``name`` against this very interpreter, or None: then verify, and remember.
    Never raises; remembers the key for ``remember``."""
    checked[name] = "at load"
    try:
        key = _verdict_keys[name] = _verdict_key(name, info, checker)
        path = verdict_path(name)
        with open(path, "rb") as f:
            stored_key, facts = marshal.loads(f.read())
    except Exception:  # no file, unreadable, another layout, no cache tag
        return None
    if stored_key != key or not isinstance(facts, dict):
        return None
    checked[name] = f"by an earlier process ({path})"
    return facts


def remember(name: str, facts: dict) -> None:
    """Record that blob ``name`` passed every check here, with ``facts`` (marshallable)
    that ``trusted`` gives back; written as bytecode is (not under ``-B``), never raises."""
    key = _verdict_keys.get(name)
    if key is None or sys.dont_write_bytecode:
        return
    tmp = ""
    try:
        path = verdict_path(name)
        tmp = "%s.%d.tmp" % (path, os.getpid())
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(marshal.dumps((key, facts)))
        os.replace(tmp, path)
    except Exception:  # a read-only install, a full disk: the next process checks again
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass
