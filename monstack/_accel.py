"""Native ``sys.monitoring`` callbacks (CPython 3.12-3.15, GIL builds, Linux x86-64/aarch64).

The machine code (``native/sysmon.c``, built by ``native/build.py`` into
``monstack/_native/sysmon3XX-<arch>.bin``, loaded by ``_native``) keeps exactly the
shadow stack of the pure-Python callbacks of ``_sysmon._callbacks``: same nodes, same
``TLS.cell``, same resync rules, same per-file policy decision and DISABLE for filtered
code. Its hot path (tracked push/pop) runs no Python code; the policy is consulted in
Python once per undecided file, and seeding/resync call the same ``_stack.build`` as
the Python callbacks. PY_THROW (a throw into a generator: rare, never per call) keeps the
pure-Python callback unless asked otherwise, so its delegating-generator repair rules
are the Python ones by construction.

Loading checks every layout the code relies on against the running interpreter (struct
offsets it was compiled with, observed through ctypes' types from ``_cdata`` and through
a native probe compared with ``sys._getframe``) and refuses, with a reason, on any
difference; once per interpreter binary and blob: later processes trust the verdict the
first one recorded (``_native.trusted``/``remember``):

    why = unavailable()                # None: they can run here; else the reason
    callbacks(policy, tls, on_error)   # {event: callable}, like _sysmon._callbacks
"""

from __future__ import annotations

import _thread
import sys

from . import _cdata as C
from . import _env, _native, _stack
from ._backend import COROUTINE_EXIT

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional

MAGIC = 0x6D6F6E73796D6F6E  # "monsymon", struct ms_api in native/sysmon.c
STATE_NAME = b"monstack.sysmon_native.state"
COUNTERS = ("push_known", "push_unknown", "pop", "seed", "resync", "decide", "errors", "cache_miss", "events",
            "linked", "reused", "unwind_filtered")

_lock = _thread.allocate_lock()
#: None before the first check, then "" (the native callbacks can run) or why not.
_why: Optional[str] = None
_blob: Optional[_native.Blob] = None
_fns: Dict[str, Callable] = {}
#: co_extra index for the per-code decision cache (one per process), -1 if refused.
_extra_index = -1
_epoch = 0


def blob_name() -> str:
    return "sysmon" + _env.VERSION_TAG.replace(".", "")


def unavailable() -> Optional[str]:
    """None when the native callbacks can run here, else why not (shown by ``info``).

    The first call loads and verifies the machine code (a few ms); later calls are free.
    """
    global _why
    why = _why
    if why is None:
        with _lock:
            why = _why
            if why is None:
                try:
                    _load_and_verify()
                    why = ""
                except _native.NativeUnavailable as exc:
                    why = str(exc) or "unavailable"
                except Exception as exc:  # never let a check crash install()
                    why = f"verification failed ({type(exc).__name__}: {exc})"
                _why = why
    return why or None


def _require() -> None:
    """Raise ``NativeUnavailable`` (with the reason) unless the native code can run."""
    why = unavailable()
    if why:
        raise _native.NativeUnavailable(why)


def _refusal(build_variables: bool = True) -> Optional[str]:
    """Why the native callbacks cannot run on this interpreter, or None. Without
    ``build_variables``: not the tail-calling interpreter check, which reads a build
    variable (~0.2 ms: see ``_env.config_vars``) and which a trusted verdict (same binary)
    has already passed."""
    # what the build is (free-threaded, debug) before its version: no version of the
    # native code runs on such a build
    if not _env.CPYTHON:
        return f"needs CPython (this is {_env.IMPLEMENTATION})"
    if _env.FREE_THREADED:
        return "free-threaded build (no GIL): not supported by the native callbacks"
    if _env.DEBUG_BUILD:
        return "debug build of CPython: not supported by the native callbacks"
    if not _env.NATIVE_CALLBACKS_FOR_VERSION:
        names = [f"{a}.{b}" for a, b in _env.NATIVE_CALLBACK_VERSIONS]
        known = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        return f"native callbacks exist for CPython {known} (this is {_env.VERSION_TAG})"
    if build_variables and _env.TAIL_CALL_INTERP:
        return ("tail-calling interpreter build: the native callbacks read the interpreter's frames and "
                "were tested only with the classic interpreter")
    if not _env.LINUX:
        return f"native callbacks are built for Linux only (this is {sys.platform})"
    if _native.machine() not in ("x86_64", "aarch64"):
        return f"no native callbacks for {_native.machine()} (x86_64 and aarch64 only)"
    if _env.POINTER_BITS != 64:
        return "needs a 64-bit interpreter"
    return None


def _load_and_verify() -> None:
    """Load the blob and check it against this interpreter; or, where an earlier
    process did that for this very interpreter and blob (``_native.trusted``), load it
    and take that process's findings (~1.5M instructions less at every start-up)."""
    global _blob, _extra_index, _vectorcall_field, direct_calls_refused
    why = _refusal(build_variables=False)
    if why:
        raise _native.NativeUnavailable(why)
    name = blob_name()
    manifest, info = _native.arch_entry(name)
    facts = _native.trusted(name, info, __file__)
    if facts is None:
        why = _refusal()
        if why:
            raise _native.NativeUnavailable(why)
    blob = _native.load(name, manifest, verify=facts is None)
    if facts is None:
        _verify_table(blob)
        _verify_layout(blob)
    else:
        _extra_index = _request_extra_index()
    fns = {
        "new_state": blob.function("ms_new_state", "new_state"),
        "counters": blob.function("ms_counters", "counters"),
        "probe": blob.function("ms_probe", "probe"),
    }
    if facts is None:
        _verify_runtime(fns["probe"])
    _fns.update(fns)
    _blob = blob
    if facts is None:
        _verify_direct_calls(blob)
        _native.remember(name, {"vectorcall_field": _vectorcall_field, "direct_calls_refused": direct_calls_refused})
    else:
        _vectorcall_field, direct_calls_refused = facts["vectorcall_field"], facts["direct_calls_refused"]


#: Offset of PyCFunctionObject.vectorcall when writing the callbacks' vectorcall
#: entry points into it was checked at load (``_verify_direct_calls``), else None.
_vectorcall_field: Optional[int] = None
#: Why the callbacks are called through CPython's cfunction_vectorcall_FASTCALL
#: instead ("" when they are not).
direct_calls_refused = "not loaded"


def _verify_direct_calls(blob: _native.Blob) -> None:
    """May the callbacks' builtin-function objects get the blob's vectorcall entry
    points (ms_vc_*)? Then CPython's event dispatch calls them directly, skipping
    cfunction_vectorcall_FASTCALL (a second thread-state lookup and a recursion count,
    ~50 instructions per event). Checked on probe objects; a refusal only keeps the
    ordinary call path (the native callbacks are used either way)."""
    global _vectorcall_field, direct_calls_refused
    import builtins

    _vectorcall_field = None

    lay = _layout(blob)
    off_self, off_vc = lay["cfunc_m_self"], lay["cfunc_vectorcall"]
    builtin = type(len)
    word = C.c_void_p.from_address
    checks = (
        (bool(builtin.__flags__ & lay["TPFLAGS_HAVE_VECTORCALL"]), "builtin functions are not vectorcall"),
        (_word(id(builtin) + lay["tp_vectorcall_offset"]) == off_vc,
         "PyCFunctionObject.vectorcall is not the type's vectorcall slot"),
        (word(id(len) + off_self).value == id(builtins), "PyCFunctionObject.m_self"),
    )
    for ok, why in checks:
        if not ok:
            direct_calls_refused = why
            return
    marker = object()
    probe = _native.cached_function(blob, "ms_noop", "monstack_vectorcall_probe", self_obj=marker)
    plain = _native.cached_function(blob, "ms_noop", "monstack_vectorcall_probe", self_obj=None)
    before = word(id(probe) + off_vc).value
    if word(id(probe) + off_self).value != id(marker) or not before or before != word(id(plain) + off_vc).value:
        direct_calls_refused = "PyCFunctionObject.vectorcall does not hold the FASTCALL entry"
        return
    word(id(probe) + off_vc).value = blob.addr("ms_vc_probe")
    if list(map(probe, [0])) != [probe] or list(map(plain, [0])) != [None]:
        direct_calls_refused = "a vectorcall entry written into a builtin is not the one its calls reach"
        return
    _vectorcall_field = off_vc
    direct_calls_refused = ""


def _direct(fn: Any, blob: _native.Blob, symbol: str) -> Any:
    """``fn`` (a callback made from the blob) with the vectorcall entry ``symbol``
    written into it, when ``_verify_direct_calls`` allowed that."""
    if _vectorcall_field is not None:
        C.c_void_p.from_address(id(fn) + _vectorcall_field).value = blob.addr(symbol)
    return fn


def _verify_table(blob: _native.Blob) -> None:
    """The blob's own table header (magic, slot count, slot names) describes the slots
    the loader filled from the manifest."""
    at = blob.symbols["ms_table"]
    magic, nslots = _u64s(blob.read("ms_table", 16))
    if magic != MAGIC:
        raise _native.NativeUnavailable(f"{blob.name}: table magic {magic:#x}, expected {MAGIC:#x}")
    names = blob.cstrings("ms_table_names")
    slots = {name: at + 16 + 8 * i for i, name in enumerate(names)}
    if len(names) != nslots or slots != blob.info["table"]:
        raise _native.NativeUnavailable(f"{blob.name}: the manifest's table differs from the blob's")


def _u64s(raw: bytes) -> List[int]:
    """``raw`` as uint64s in this machine's byte order (the blob's: it runs here)."""
    return memoryview(raw).cast("Q").tolist()


def _pointer(addr: int) -> Optional[int]:
    """The word at ``addr``, unsigned (None for 0), as ``c_void_p`` reads it."""
    return C.c_void_p.from_address(addr).value


def _word(addr: int) -> int:
    """The word at ``addr`` as a signed integer (a ``Py_ssize_t``), read through
    ``c_void_p``: the checks make no other C type (see ``_native.api_word``)."""
    return _native.signed(C.c_void_p.from_address(addr).value)


def _byte(addr: int) -> int:
    """The byte at ``addr``, read as the first of a word (for a field inside a header
    at least a word long past it)."""
    return (C.c_void_p.from_address(addr).value or 0).to_bytes(8, sys.byteorder)[0]


def _layout(blob: _native.Blob) -> Dict[str, int]:
    names = blob.cstrings("ms_layout_names")
    raw = blob.read("ms_layout", 8 * len(names))
    return dict(zip(names, _u64s(raw)))


def _verify_layout(blob: _native.Blob) -> None:
    """Compare the offsets the code was compiled with against what ctypes reads."""
    lay = _layout(blob)

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise _native.NativeUnavailable(f"interpreter layout differs from the native code's: {what}")

    need(lay["PY_VERSION_HEX"] >> 16 == sys.hexversion >> 16,
         f"compiled for {lay['PY_VERSION_HEX']:#x}, running {sys.hexversion:#x}")
    need(lay["sizeof_PyObject"] == object.__basicsize__, "sizeof(PyObject)")
    need(lay["tuple_ob_item"] == tuple.__basicsize__, "PyTupleObject.ob_item")
    t = (object(), 1)
    need(C.c_void_p.from_address(id(t) + lay["tuple_ob_item"]).value == id(t[0]), "tuple items")
    need(_word(id(t) + lay["var_ob_size"]) == 2, "PyVarObject.ob_size")
    lst = [t]
    items = C.c_void_p.from_address(id(lst) + lay["list_ob_item"]).value
    need(items is not None and C.c_void_p.from_address(items).value == id(t), "PyListObject.ob_item")
    need(_word(id(lst) + lay["var_ob_size"]) == 1, "list size")
    code = _verify_layout.__code__
    need(C.c_void_p.from_address(id(code) + lay["co_filename"]).value == id(code.co_filename),
         "PyCodeObject.co_filename")
    need(lay["sizeof_PyMethodDef"] == _native.SIZEOF_PYMETHODDEF, "sizeof(PyMethodDef)")
    need(lay["ml_meth"] == _native.ML_METH and lay["ml_flags"] == _native.ML_FLAGS, "PyMethodDef fields")
    # The state capsule's pointer is read right after the object header.
    # (the name as a word: a bytes argument passes its buffer, as c_char_p would)
    new = _native.api_object("PyCapsule_New", 3)
    get = _native.api_word("PyCapsule_GetPointer", 2)
    marker = C.c_void_p(7)
    cap = new(C.addressof(marker), STATE_NAME, None)
    need(get(id(cap), STATE_NAME) == C.addressof(marker), "PyCapsule_GetPointer")
    need(C.c_void_p.from_address(id(cap) + lay["sizeof_PyObject"]).value == C.addressof(marker),
         "PyCapsule pointer field")
    del cap
    # the opcodes ms_linked_suspended compares: YIELD_VALUE and RESUME seen in compiled
    # code (not through the `opcode` module: 1.5 ms of import at every install); their
    # instrumented and specialised forms are fixed per minor version, checked above
    # (as the pair a yield compiles to: YIELD_VALUE then the RESUME after it; 3.14
    # numbers RESUME 8 above YIELD_VALUE, so a set of opcodes would not tell them apart)
    # (a generator function of this module, not compile(): the first compile() of a
    # process builds the AST types, ~3 ms of start-up)
    ops = _yield_one.__code__.co_code[0::2]
    need((lay["op_YIELD_VALUE"], lay["op_RESUME"]) in set(zip(ops, ops[1:])), "opcodes YIELD_VALUE/RESUME")
    _verify_type_fields(lay, need)
    _verify_code_extra(lay, need)
    if "ma_version_tag" in lay:
        _verify_dict_version(lay, need)
    else:
        _verify_dict_entries(lay, need)
        _verify_tuple_hash(lay, need)


def _yield_one() -> Any:
    """Never run: its code holds the YIELD_VALUE/RESUME pair a yield compiles to."""
    yield 1


def _verify_type_fields(lay: Dict[str, int], need: Callable[[bool, str], None]) -> None:
    """The PyTypeObject fields snapshot_setup/snapshot_new read (and the GC flag)."""

    Sub = _Plain  # (a tuple subclass as a class statement makes it)

    class Final:  # (a __dict__, weak references and a finalizer)
        def __del__(self) -> None:
            pass

    def word(obj: Any, key: str, kind: Any = _word) -> Any:
        return kind(id(obj) + lay[key])

    need(word(tuple, "tp_basicsize") == tuple.__basicsize__, "PyTypeObject.tp_basicsize")
    need(word(tuple, "tp_itemsize") == tuple.__itemsize__, "PyTypeObject.tp_itemsize")
    need(word(Sub, "tp_flags", _pointer) == Sub.__flags__, "PyTypeObject.tp_flags")  # (unsigned long)
    need(word(Sub, "tp_base", _pointer) == id(tuple), "PyTypeObject.tp_base")
    need(word(Final, "tp_dictoffset") == Final.__dictoffset__, "PyTypeObject.tp_dictoffset")
    need(word(Final, "tp_weaklistoffset") == Final.__weakrefoffset__, "PyTypeObject.tp_weaklistoffset")
    alloc = _native.resolve("f:PyType_GenericAlloc")
    need(word(Sub, "tp_alloc", _pointer) == alloc, "PyTypeObject.tp_alloc")
    need(lay["TPFLAGS_HAVE_GC"] == 1 << 14 and bool(tuple.__flags__ & lay["TPFLAGS_HAVE_GC"]), "Py_TPFLAGS_HAVE_GC")
    # snapshot_setup adopts the Snapshot class's tp_dealloc (ms_snap_dealloc) only while
    # its tp_free is CPython's PyObject_GC_Del, and frees natively allocated instances
    # past a PyGC_Head of the compiled size (sys.getsizeof counts it).
    gc_del = _native.resolve("f:PyObject_GC_Del")
    need(word(Sub, "tp_free", _pointer) == gc_del, "PyTypeObject.tp_free")
    probe = Sub((1, 2))
    need(sys.getsizeof(probe) - Sub.__basicsize__ - 2 * Sub.__itemsize__ == lay["sizeof_PyGC_Head"],
         "sizeof(PyGC_Head)")
    # ... and its tp_dealloc (subtype_dealloc, not exported: same in every class
    # statement's class, not tuple's own), checking tp_finalize and tp_del are empty.

    class Other(tuple):
        __slots__ = ()

    need(lay["tp_dealloc"] == lay["tp_itemsize"] + 8, "PyTypeObject.tp_dealloc")  # (a Py_ssize_t later)
    sub_dealloc = word(Sub, "tp_dealloc", _pointer)
    need(sub_dealloc is not None and sub_dealloc == word(Other, "tp_dealloc", _pointer)
         and sub_dealloc != word(tuple, "tp_dealloc", _pointer), "PyTypeObject.tp_dealloc")
    need(word(Sub, "tp_finalize", _pointer) is None and word(Final, "tp_finalize", _pointer) is not None,
         "PyTypeObject.tp_finalize")
    # (tp_del: tp_version_tag and its padding before tp_finalize, in 3.12 to 3.15)
    need(lay["tp_finalize"] - lay["tp_del"] == 16 and word(Sub, "tp_del", _pointer) is None,
         "PyTypeObject.tp_del")


def _request_extra_index() -> int:
    """A new co_extra index (the caller keeps it in ``_extra_index``: one per process)."""
    req = _native.api_word("PyUnstable_Eval_RequestCodeExtraIndex", 1)  # (Py_ssize_t)
    index = _native.signed(req(None))
    if index < 0:
        raise _native.NativeUnavailable("no free co_extra index (PyUnstable_Eval_RequestCodeExtraIndex)")
    return index


def _verify_code_extra(lay: Dict[str, int], need: Callable[[bool, str], None]) -> None:
    """Request our co_extra index and check the layout the native code reads."""
    global _extra_index
    setx = _native.api_word("PyUnstable_Code_SetExtra", 3)  # (int)
    index = _request_extra_index()
    code = _verify_code_extra.__code__.replace()  # a fresh code object (not compile(): see above)
    need(_native.int32(setx(id(code), index, 0x5A5A0)) == 0, "PyUnstable_Code_SetExtra failed")
    extra = C.c_void_p.from_address(id(code) + lay["co_extra"]).value
    need(extra is not None, "PyCodeObject.co_extra")
    assert extra is not None  # need() raised otherwise
    need(_word(extra) > index, "co_extra size")
    need(C.c_void_p.from_address(extra + 8 + 8 * index).value == 0x5A5A0, "co_extra slot")
    _extra_index = index


def _verify_dict_version(lay: Dict[str, int], need: Callable[[bool, str], None]) -> None:
    """The version tag of a thread's ``_thread._local`` dict must move on every change."""
    local = type(_stack.TLS)()  # (the real _thread._local, also under gevent's patch_all)
    local.cell = [None]
    d = local.__dict__
    at = id(d) + lay["ma_version_tag"]
    seen = [_pointer(at)]
    for step in (lambda: setattr(local, "other", 1), lambda: setattr(local, "cell", [None]),
                 lambda: delattr(local, "cell"), lambda: setattr(local, "cell", None)):
        step()
        v = _pointer(at)
        need(v not in seen, "PyDictObject.ma_version_tag does not change with the dict")
        seen.append(v)


def _verify_dict_entries(lay: Dict[str, int], need: Callable[[bool, str], None]) -> None:
    """3.14+ (no dict version tag): the native TLS.cell cache finds "cell" in the thread's
    ``_thread._local`` dict by reading its keys object (combined, str-keyed: an index
    table of ``1 << dk_log2_index_bytes`` bytes, then the entries). Read it the same way
    here, before and after the dict is resized, and compare with what Python holds."""
    local = type(_stack.TLS)()
    local.other = 1
    cell = local.cell = [None]
    d = local.__dict__

    def word(addr: int, kind: Any = _pointer) -> Any:
        return kind(addr)

    def entries() -> list:
        keys = word(id(d) + lay["ma_keys"])
        need(keys is not None and word(id(d) + lay["ma_values"]) is None, "PyDictObject.ma_keys/ma_values")
        need(_byte(keys + lay["dk_kind"]) != lay["DICT_KEYS_GENERAL"], "PyDictKeysObject.dk_kind")
        n = word(keys + lay["dk_nentries"], _word)
        need(n == len(d), "PyDictKeysObject.dk_nentries")
        first = keys + lay["dk_indices"] + (1 << _byte(keys + lay["dk_log2_index_bytes"]))
        size = lay["sizeof_PyDictUnicodeEntry"]
        return [(word(first + i * size + lay["me_key"]), word(first + i * size + lay["me_value"])) for i in range(n)]

    need(entries() == [(id("other"), id(1)), (id("cell"), id(cell))], "dict entries (PyDictUnicodeEntry)")
    for i in range(12):  # resized (8 slots, then 32): a new keys object, a larger index table
        setattr(local, f"k{i}", i)
    got = entries()
    need(got[:2] == [(id("other"), id(1)), (id("cell"), id(cell))] and len(got) == 14,
         "dict entries after a resize")


def _verify_tuple_hash(lay: Dict[str, int], need: Callable[[bool, str], None]) -> None:
    """3.14+ caches a tuple's hash in the tuple (-1: not computed): the native code
    resets it in the node tuples it reuses and the snapshots it allocates."""
    t = tuple([object(), 2])
    at = id(t) + lay["tuple_ob_hash"]
    need(lay["tuple_ob_hash"] + 8 == lay["tuple_ob_item"] and _word(at) == -1,
         "PyTupleObject.ob_hash (not computed)")
    h = hash(t)
    need(_word(at) == h, "PyTupleObject.ob_hash (computed)")


def _verify_runtime(probe: Callable) -> None:
    """Run the native probe (it reads the thread state and frames exactly as the
    callbacks do) and compare with what Python reports."""
    fn = _native.api_word
    ts_get = fn("PyThreadState_Get", 0)
    interp_get = fn("PyInterpreterState_Get", 0)
    dict_get = fn("PyThreadState_GetDict", 0)  # (a borrowed reference, as an address)
    get_id = fn("PyThreadState_GetID", 1)  # (uint64_t)

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise _native.NativeUnavailable(f"native probe disagrees with the interpreter: {what}")

    def check_thread(out: list) -> None:
        try:
            ts = ts_get()
            d = dict_get()
            p = probe()
            out.append((p[7] == ts, p[4] == (get_id(ts) or 0), p[5] == interp_get(), p[6] == d))
        except Exception as exc:  # pragma: no cover - reported below
            out.append(exc)

    # (This thread only: install() may run at interpreter startup, where starting a
    # thread to check another one would be unwelcome. tests/unit/test_accel.py checks more.)
    for where in ("this thread",):
        out: list = []
        check_thread(out)
        need(len(out) == 1 and not isinstance(out[0], Exception), f"probe failed in {where}: {out}")
        ok_ts, ok_id, ok_interp, ok_dict = out[0]
        need(ok_ts, "PyThreadState address")
        need(ok_id, "PyThreadState.id")
        need(ok_interp, "PyThreadState.interp")
        need(ok_dict, "PyThreadState.dict")

    getframe = sys._getframe

    def inner():
        p = probe()
        here = getframe(0)
        return p, here.f_code, here.f_lasti, getframe(1).f_code, getframe(1).f_lasti

    def outer():
        return inner()

    p, code, lasti_after, ccode, clasti = outer()
    need(p[0] is code, "current frame's code object")
    need(p[2] is ccode, "caller frame's code object")
    need(p[3] == clasti, f"caller frame's f_lasti ({p[3]} != {clasti})")
    need(0 <= p[1] < lasti_after, f"current frame's f_lasti ({p[1]} vs {lasti_after})")

    def gen():
        yield probe(), getframe(0).f_code, getframe(1).f_code, getframe(1).f_lasti

    def drive():
        return next(gen())

    p, gcode, ccode, clasti = drive()
    need(p[0] is gcode, "generator frame's code object")
    need(p[2] is ccode and p[3] == clasti, "generator's caller frame")

    # called through C (map): the frame before the callee's is the interpreter's entry
    # frame (FRAME_OWNED_BY_CSTACK up to 3.13, FRAME_OWNED_BY_INTERPRETER from 3.14),
    # which the probe skips as frame.f_back does
    def through_c():
        return list(map(lambda _: (probe(), getframe(0).f_code), [0]))[0]

    def via():
        return through_c(), getframe(0).f_code

    (p, lcode), vcode = via()
    need(p[0] is lcode, "code object of a frame called from C")
    need(p[2] is through_c.__code__, "caller past a C entry frame")


def _fn(name: str) -> Callable:
    _require()
    return _fns[name]


def callbacks(
    policy: Any,
    tls: Any,
    on_error: Callable[[BaseException], None],
    py_callbacks: Callable,
    native_throw: bool = False,
) -> dict:
    """The six sys.monitoring callbacks as ``{event: callable}``, native except PY_THROW.

    Same contract as ``_sysmon._callbacks(policy, tls, on_error)``. Raises
    ``_native.NativeUnavailable`` when ``unavailable()`` says why not. PY_THROW stays the
    pure-Python callback unless ``native_throw`` (the native one implements today's
    Python rule; tests run both). ``py_callbacks``: the pure-Python factory it comes
    from (``_sysmon._callbacks``, passed in: this module sits below ``_sysmon``).
    """
    new_state = _fn("new_state")
    blob = _blob
    assert blob is not None
    mon = sys.monitoring
    getframe = sys._getframe
    is_tracked = policy.is_tracked
    build = _stack.build
    register = _stack.register
    linked = _stack.linked_suspended
    stats = _stack.STATS

    # Slow-path helpers, called from native code (which has no Python frame):
    # frame 0 is the helper, 1 the frame of the event, 2 that frame's caller.
    def decide(code):
        return is_tracked(code, getframe(1).f_globals.get("__name__"))

    def caller_of_event():
        # frames: 0 this, 1 seed/resync, 2 the event's frame, 3 its caller (None when
        # the event's frame is a thread's first frame)
        try:
            return getframe(3)
        except ValueError:
            return None

    # (frames gen.throw() linked in get unverified nodes, as in _stack.rebuild)
    def seed():
        tls.cell = [build(caller_of_event(), policy, linked, None, None, True)[0]]
        register(tls)
        stats["seed"] += 1

    def resync():
        tls.cell = [build(caller_of_event(), policy, linked, None, None, True)[0]]
        register(tls)
        stats["resync"] += 1

    global _epoch
    with _lock:
        _epoch += 1
        epoch = _epoch
    state = new_state(
        tls, policy.tracked_files(), decide, seed, resync, on_error,
        mon.DISABLE, _stack.UNKNOWN, "cell", "__dict__", COROUTINE_EXIT, _extra_index, epoch,
    )
    def fn(blob: _native.Blob, symbol: str, name: str, self_obj: Any) -> Any:
        return _direct(_native.cached_function(blob, symbol, name, self_obj=self_obj), blob,
                       symbol.replace("ms_on_", "ms_vc_"))

    on_start = fn(blob, "ms_on_start", "monstack_on_start", self_obj=state)
    if native_throw:
        on_throw = fn(blob, "ms_on_throw", "monstack_on_throw", self_obj=state)
    else:
        # PY_THROW (a throw into a generator or coroutine: rare, never per call) keeps the
        # pure-Python callback itself, so its repair rules for delegating generators
        # are the Python ones by construction. It shares TLS.cell with the native ones.
        on_throw = py_callbacks(policy, tls, on_error)[mon.events.PY_THROW]
    on_return = fn(blob, "ms_on_return", "monstack_on_return", self_obj=state)
    on_yield = fn(blob, "ms_on_yield", "monstack_on_yield", self_obj=state)
    on_unwind = fn(blob, "ms_on_unwind", "monstack_on_unwind", self_obj=state)
    E = mon.events
    return {
        E.PY_START: on_start,
        E.PY_RESUME: on_start,
        E.PY_THROW: on_throw,
        E.PY_RETURN: on_return,
        E.PY_YIELD: on_yield,
        E.PY_UNWIND: on_unwind,
    }


def snapshot_fast(callback: Any) -> Callable[[], Optional[tuple]]:
    """The native O(1) snapshot for the state behind ``callback`` (one of the functions
    ``callbacks()`` returned): a no-argument callable, to be called from inside
    ``monstack.snapshot()`` itself, returning ``(top, lasti)`` for snapshot()'s caller
    when the thread's top node is that caller's with a known call site, else None (then
    take the Python path)."""
    _require()
    assert _blob is not None
    return _native.cached_function(_blob, "ms_snapshot_fast", "snapshot_fast", self_obj=callback.__self__)


class _Plain(tuple):
    """What snapshot_setup compares the Snapshot class with: deallocated and freed as
    every class statement's instances are, before the native code adopts that."""

    __slots__ = ()


_PLAIN = _Plain()


def snapshot_new(
    callback: Any, fallback: Callable[[], Any], cls: Any = None, origin_var: Any = None
) -> Optional[Callable[[], Any]]:
    """The whole O(1) case of ``monstack.snapshot()``, natively, or None if unusable.

    Returns a no-argument callable, to be called from inside ``snapshot()`` itself:
    it returns the finished ``Snapshot`` of snapshot()'s caller when the fast case holds
    (top node = the caller's code, call site known; no origin, or an origin whose chain
    is not due to be shortened), else None (take the Python path). Before handing it
    out, checks that what it builds equals ``Snapshot._new(top, lasti, origin)``; returns
    None if the Snapshot layout changed. ``fallback`` (``monstack.snapshot``) answers
    whatever the native case does not cover.
    """
    from ._snapshot import CURRENT_ORIGIN, Snapshot

    cls = Snapshot if cls is None else cls
    origin_var = CURRENT_ORIGIN if origin_var is None else origin_var
    _require()
    assert _blob is not None
    from . import _snapshot

    try:
        if cls.__base__ is not tuple or cls._new(None, 7, None) != (None, 7, None, None, 0):
            return None
        # under an origin: (node, lasti, origin, None, origin's meta + 1), hops in the
        # low 32 bits (the native code's MS_HOP_BITS)
        first = cls._new(None, 7, None)
        if tuple.__getitem__(cls._new(None, 8, first), slice(None)) != (None, 8, first, None, 1):
            return None
        if _snapshot._HOP_BITS != 32:
            return None
    except Exception:
        return None
    state = callback.__self__
    _native.cached_function(_blob, "ms_snapshot_setup", "snapshot_setup", self_obj=state)(
        cls, origin_var, fallback, _PLAIN, _snapshot._SHORTEN_CELL)
    return _native.cached_function(_blob, "ms_snapshot_new", "snapshot_new", self_obj=state)


def capture_function(callback: Any) -> Callable[[], Any]:
    """``monstack.snapshotter()``'s native function for the state behind ``callback``
    (after ``snapshot_new`` set it up): the snapshot of *its own* caller, with no Python
    frame in between; whatever the native case does not cover, and everything once
    ``retire`` ran, goes to ``monstack.snapshot``."""
    assert _blob is not None
    return _native.cached_function(_blob, "ms_capture", "snapshot", self_obj=callback.__self__)


def retire(callback: Any) -> None:
    """Uninstall (or a distrusted shadow stack): the native snapshot paths of this state
    decline from now on; functions handed out keep working through ``monstack.snapshot``."""
    assert _blob is not None
    _native.cached_function(_blob, "ms_snapshot_setup", "snapshot_setup", self_obj=callback.__self__)(
        None, None, None, None, None)


def empty_callback() -> Callable:
    """A native callback that does nothing (returns None): for benchmarks, the cost of
    CPython's event machinery alone, to compare the real callbacks with."""
    _require()
    assert _blob is not None
    return _native.cached_function(_blob, "ms_noop", "monstack_empty_callback")


def counters(callback: Any) -> Dict[str, int]:
    """Event counters of the native state behind one of ``callbacks()``' functions."""
    values = _fn("counters")(callback.__self__)
    return dict(zip(COUNTERS, values))


def is_native(callback: Any) -> bool:
    owner = type(getattr(callback, "__self__", None))
    return type(callback).__name__ == "builtin_function_or_method" and owner.__name__ == "PyCapsule"


def loaded_blob() -> Optional[_native.Blob]:
    """The loaded and verified blob of the native callbacks, or None (before
    ``unavailable()`` said they can run)."""
    return _blob if _why == "" else None
