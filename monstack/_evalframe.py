"""The ``evalframe`` backend: a native PEP 523 eval_frame shim keeps the stacks (CPython 3.11).

CPython 3.11 has no ``sys.monitoring``. This backend installs machine code (built from
``native/shim311.c`` by ``native/build.py``, stored in ``monstack/_native/``) as the
interpreter's frame-evaluation function with ``_PyInterpreterState_SetEvalFrameFunc``.
The shim pushes and pops the nodes of ``monstack._stack`` natively for every frame of
tracked code; filtered code costs one cached check. No compiler is needed here: the
code is relocation-free, and every function and object it uses is reached through an
address table.

Two parts:

- loading: ``_native.load_copy`` maps the code, fills its address table and makes the
  code pages read+execute (its data area, ``struct ms_data``, stays read-write); this
  module writes the data area's fields, once it has checked that this interpreter is
  one the code was built for (version, architecture, every struct offset the code
  relies on, probed from real frames and thread states);
- ``EvalFrameBackend``: installs, uninstalls, and notices when another PEP 523 user
  replaces the shim.
"""

from __future__ import annotations

import _thread
import os
import sys

from . import _cdata as C
from . import _env, _stack
from . import _native as _loader
from ._backend import COROUTINE_EXIT, EXITS_REPORTED
from ._errors import warn
from ._policy import Policy

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import CodeType, FrameType
    from typing import Any, Callable, Dict, List, Optional

    from ._backend import Host

#: ``MS_LASTI_INTS`` of native/shim311.h (a test reads it there): call-site offsets below
#: 2 * LASTI_INTS get an int the shim makes at first use and keeps (no allocation per push).
LASTI_INTS = 2048

#: The blob's name (manifest ``monstack/_native/evalframe311.json``).
BLOB = "evalframe311"

#: C stack kept in reserve below each thread's stack end (the shim raises
#: RecursionError instead of starting a Python frame within this distance).
STACK_MARGIN = 256 * 1024


#: A C-API function taking and returning machine words, through the loader's shared
#: prototype (GIL held, errors checked): see ``_native.api_word``.
_api_fn = _loader.api_word


def _rd_ptr(addr: int) -> int:
    return C.c_void_p.from_address(addr).value or 0


# --------------------------------------------------------------------------------------
# Checking the interpreter against the offsets the code was built with
# --------------------------------------------------------------------------------------


class _SafeMemory:
    """Reads of this process's memory that fail instead of crashing on a bad address.

    Probing offsets that may be wrong means following pointers that may be garbage:
    reads go through ``/proc/self/mem`` (an unmapped address is an OSError there);
    a failed read gives -1, which matches nothing. Without /proc, reads are refused.
    """

    def __init__(self) -> None:
        try:
            self.fd: Optional[int] = os.open("/proc/self/mem", os.O_RDONLY)
        except OSError:
            self.fd = None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def bytes(self, addr: int, n: int) -> Optional[bytes]:
        if self.fd is None or addr <= 0 or addr >= 1 << 63:
            return None
        try:
            data = os.pread(self.fd, n, addr)
        except (OSError, OverflowError, ValueError):
            return None
        return data if len(data) == n else None

    def read_int(self, addr: int, n: int, signed: bool = False) -> int:
        data = self.bytes(addr, n)
        return -1 if data is None else int.from_bytes(data, sys.byteorder, signed=signed)

    def ptr(self, addr: int) -> int:
        return self.read_int(addr, 8)

    def i32(self, addr: int) -> int:
        return self.read_int(addr, 4, signed=True)

    def i64(self, addr: int) -> int:
        return self.read_int(addr, 8, signed=True)

    def u8(self, addr: int) -> int:
        return self.read_int(addr, 1)


def _probe_interp_offsets(off: Dict[str, int]) -> List[str]:
    """Compare each struct offset the shim relies on with the running interpreter.

    Every value is checked against something observable from Python (thread-state
    dict, ids, frame objects, recursion counters, a trace function...). Returns the
    list of disagreements (empty: all good).
    """
    mem = _SafeMemory()
    if mem.fd is None:
        return ["cannot read /proc/self/mem to check the interpreter's layout safely"]
    try:
        return _probe_with(mem, off)
    finally:
        mem.close()


def _probe_with(mem: "_SafeMemory", off: Dict[str, int]) -> List[str]:
    problems: List[str] = []
    # every read below may follow a wrong offset: fault-tolerant reads only
    _rd_ptr, _rd_i32, _rd_i64, _rd_u8 = mem.ptr, mem.i32, mem.i64, mem.u8  # noqa: N806

    def check(name: str, ok: bool, detail: str = "") -> None:
        if not ok:
            problems.append(f"{name} (offset {off.get(name)}){': ' + detail if detail else ''}")

    ts_get = _api_fn("PyThreadState_Get", 0)
    interp_get = _api_fn("PyInterpreterState_Get", 0)
    # a word, not an object: ctypes treats a py_object result as a new reference, and
    # this function returns a borrowed one.
    ts_dict = _api_fn("PyThreadState_GetDict", 0)
    ts_id = _api_fn("PyThreadState_GetID", 1)  # (uint64_t)
    ts = ts_get()
    interp = interp_get()

    check("ts_interp", _rd_ptr(ts + off["ts_interp"]) == interp)
    check("ts_dict", _rd_ptr(ts + off["ts_dict"]) == ts_dict())
    check("ts_id", mem.read_int(ts + off["ts_id"], 8) == (ts_id(ts) or 0))
    check("ts_recursion_limit", _rd_i32(ts + off["ts_recursion_limit"]) == sys.getrecursionlimit())

    def remaining() -> int:
        return _rd_i32(ts + off["ts_recursion_remaining"])

    def nested() -> int:
        return remaining()

    outer = remaining()
    inner = nested()
    check("ts_recursion_remaining", outer - inner == 1, f"{outer} then {inner} one frame deeper")

    # frames: the probe's own frame and its caller (stable while we read it)
    me = sys._getframe()
    caller = me.f_back
    f_frame = off["frameobj_f_frame"]
    my_if = _rd_ptr(id(me) + f_frame)
    check("frameobj_f_frame", my_if != 0 and _rd_ptr(my_if + off["if_frame_obj"]) == id(me))
    check("if_code", _rd_ptr(my_if + off["if_code"]) == id(me.f_code))
    check("if_globals", _rd_ptr(my_if + off["if_globals"]) == id(me.f_globals))
    check("if_owner", _rd_u8(my_if + off["if_owner"]) == 0, "a running function frame must be owned by the thread")
    cframe = _rd_ptr(ts + off["ts_cframe"])
    # read inline (os.pread is C): inside a Python helper, the helper's frame would be current
    try:
        raw_current = (
            os.pread(mem.fd, 8, cframe + off["cframe_current_frame"])
            if mem.fd is not None and 0 < cframe < 1 << 63 else b""
        )
    except (OSError, OverflowError, ValueError):
        raw_current = b""
    current = int.from_bytes(raw_current, sys.byteorder) if len(raw_current) == 8 else -1
    check("ts_cframe", cframe not in (0, -1))
    check("cframe_current_frame", current == my_if)
    if caller is not None:
        caller_if = _rd_ptr(id(caller) + f_frame)
        check("if_previous", _rd_ptr(my_if + off["if_previous"]) == caller_if)
        prev_instr = _rd_ptr(caller_if + off["if_prev_instr"])
        code_start = id(caller.f_code) + off["co_code_adaptive"]
        check("if_prev_instr/co_code_adaptive",
              (prev_instr - code_start) // off["sizeof_codeunit"] * 2 == caller.f_lasti,
              f"{prev_instr - code_start} vs f_lasti {caller.f_lasti}")

    def gen():
        yield 1

    g = gen()
    next(g)
    gen_if = _rd_ptr(id(g.gi_frame) + f_frame)
    check("owner_generator", _rd_u8(gen_if + off["if_owner"]) == off["owner_generator"])

    # code objects: adaptive code of a never-run code object is its co_code
    # (a fresh code object, not compile(): the first compile() of a process builds the
    # AST types, ~3 ms of start-up)
    fresh = _probe_code_extra.__code__.replace()
    raw = mem.bytes(id(fresh) + off["co_code_adaptive"], len(fresh.co_code))
    check("co_code_adaptive", raw == fresh.co_code)

    def outer_fn():
        a = 1

        def inner_fn():
            return a

        return inner_fn

    # the opcode numbers from _env's table (not the opcode module: ~2M instructions of
    # start-up), checked as the pair a yield compiles to: YIELD_VALUE then RESUME
    yield_value, resume = _env.OPCODES["YIELD_VALUE"], _env.OPCODES["RESUME"]
    gen_ops = gen.__code__.co_code[::2]
    check("op_yield_value", off["op_yield_value"] == yield_value
          and (yield_value, resume) in set(zip(gen_ops, gen_ops[1:])))
    for code in (outer_fn.__code__, outer_fn().__code__, gen.__code__):
        ops = code.co_code[::2]
        expected = ops.index(resume) if resume in ops else -1
        got = _rd_i32(id(code) + off["co_firsttraceable"])
        check("co_firsttraceable", got == expected, f"{code.co_name}: {got} != {expected}")
        check("co_flags", _rd_i32(id(code) + off["co_flags"]) == code.co_flags)

    # plain object layouts
    lst = [object()]
    tup = (object(), 2)
    check("ob_type", _rd_ptr(id(lst) + off["ob_type"]) == id(list))
    check("ob_refcnt", _rd_i64(id(lst) + off["ob_refcnt"]) == sys.getrefcount(lst) - 1)
    check("var_ob_size", _rd_i64(id(tup) + off["var_ob_size"]) == 2)
    check("list_ob_item", _rd_ptr(_rd_ptr(id(lst) + off["list_ob_item"])) == id(lst[0]))
    check("tuple_ob_item", _rd_ptr(id(tup) + off["tuple_ob_item"]) == id(tup[0]))
    check("sizeof_codeunit", off["sizeof_codeunit"] == 2)
    # dict version tags: change on every modification, not on reads
    dct: Dict[str, int] = {}

    def version() -> int:
        return mem.read_int(id(dct) + off["dict_version"], 8)

    v1 = version()
    dct["a"] = 1
    v2 = version()
    _ = dct["a"]
    v3 = version()
    dct["a"] = 2
    v4 = version()
    check("dict_version", -1 < v1 < v2 == v3 < v4, f"{v1} {v2} {v3} {v4}")

    # tstate->tracing: 1 inside a trace function, 0 outside (in a fresh thread, whose
    # trace function we may set without disturbing anybody)
    seen: List[int] = []

    def thread_body() -> None:
        t = ts_get()
        seen.append(_rd_i32(t + off["ts_tracing"]))

        def tracer(frame, event, arg):
            seen.append(_rd_i32(t + off["ts_tracing"]))
            return None

        sys.settrace(tracer)
        try:
            (lambda: None)()
        finally:
            sys.settrace(None)
        seen.append(mem.read_int(t + off["ts_id"], 8) == (ts_id(t) or 0))

    # A bare thread (not threading's: nothing of monstack imports threading before the
    # program does), joined through a lock its body releases last.
    done = _thread.allocate_lock()
    done.acquire()

    def probe_thread() -> None:
        try:
            thread_body()
        except Exception:  # the checks below report what is missing
            pass
        finally:
            done.release()

    _thread.start_new_thread(probe_thread, ())
    done.acquire()
    check("ts_tracing", seen[:2] == [0, 1], f"read {seen[:2]}")
    check("ts_id (second thread)", seen[2:] == [True])
    return problems


def _probe_code_extra(off: Dict[str, int], index: int) -> List[str]:
    set_extra = _api_fn("_PyCode_SetExtra", 3)  # (int)
    code = _probe_code_extra.__code__.replace()
    if _loader.int32(set_extra(id(code), index, 0x5A5A5A5A)) != 0:
        return ["_PyCode_SetExtra failed"]
    mem = _SafeMemory()
    try:
        ex = mem.ptr(id(code) + off["co_extra"])
        ok = ex not in (0, -1) and mem.i64(ex) > index and mem.ptr(ex + 8 + 8 * index) == 0x5A5A5A5A
    finally:
        mem.close()
    return [] if ok else [f"co_extra (offset {off['co_extra']}) / its layout"]


def _find_tls_key(tls: Any) -> tuple:
    """(key, dummy type, offset of localdict) of ``tls`` in this thread's state dict.

    ``_thread._local`` keeps, in each thread-state dict, a small "dummy" object that
    points at the thread's local dict; the shim follows the same path. Found by value:
    the dummy whose pointer is ``tls.__dict__``.
    """
    ldict = tls.__dict__  # creates this thread's dummy if needed
    addr = _api_fn("PyThreadState_GetDict", 0)()  # borrowed
    # the object at that address, a new, counted reference (as ctypes.cast(addr,
    # py_object).value, without a prototype for cast's helper)
    holder = C.c_void_p(addr)  # (kept while read: the object is read from its memory)
    tdict = C.py_object.from_address(C.addressof(holder)).value
    # dict.copy() runs no Python code while copying; iterating tdict itself could see a
    # _thread._local of this thread dying (GC, weakref callback) and change size.
    for key, value in tdict.copy().items():
        if type(value).__name__ == "_localdummy":
            for offset in (16,):
                if _rd_ptr(id(value) + offset) == id(ldict):
                    return key, type(value), offset
    raise LookupError("cannot find the thread-local key of monstack's TLS in the thread-state dict")


# --------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------


class _Native:
    """The loaded shim (one per process), or why it cannot be used."""

    def __init__(self) -> None:
        self.reason: Optional[str] = None
        self.blob: Optional[_loader.Blob] = None
        #: the manifest, and this architecture's entry with its layout's keys
        #: (fields, counters, interp_offsets...) at top level
        self.meta: Dict[str, Any] = {}
        self.arch: Dict[str, Any] = {}
        self.entry = 0
        self.default = 0
        self.interp = 0
        self.extra_index = -1
        self.gen = 0
        self.epoch = 0
        self.keep: tuple = ()  # objects the shim points at, alive for the process


_native: Optional[_Native] = None
_native_lock = _thread.allocate_lock()


def _static_reason() -> Optional[str]:
    if not _env.CPYTHON:
        return f"needs CPython (this is {_env.IMPLEMENTATION})"
    if _env.DEBUG_BUILD:
        return "a debug build of CPython (reference-count debugging) is not supported"
    if not _env.EVALFRAME_FOR_VERSION:
        return f"the eval_frame shim is for CPython 3.11 (this is {_env.VERSION_TEXT})"
    if not _env.EVALFRAME_SEES_GETITEM:
        return (f"CPython {_env.VERSION_TEXT} does not call eval_frame for __getitem__ frames "
                "(gh-104405, fixed in 3.11.4)")
    if not _env.LINUX:
        return f"no shim code for {sys.platform} (Linux only)"
    if _env.POINTER_BITS != 64:
        return "no shim code for 32-bit interpreters"
    return None


def _load() -> _Native:
    """Load and check the shim once per process (the result, or the reason, is kept)."""
    global _native
    with _native_lock:
        if _native is not None:
            return _native
        nat = _Native()
        try:
            nat.reason = _static_reason() or _load_into(nat)
        except Exception as exc:  # any surprise while probing: refuse, with the reason
            nat.reason = f"loading the shim failed: {type(exc).__name__}: {exc}"
        _native = nat
        return nat


def _load_into(nat: _Native) -> Optional[str]:
    """Load the shim and check this interpreter against it (probes, a thread among
    them); or, where an earlier process did that for this very interpreter and blob
    (``_native.trusted``), load it and skip the probes."""
    try:
        meta, info = _loader.arch_entry(BLOB)
        trusted = _loader.trusted(BLOB, info, __file__) is not None
        # read and checked before probing anything (the checksum: unless trusted)
        meta, info, image = _loader.read_image(BLOB, meta, verify=not trusted)
    except _loader.NativeUnavailable as exc:
        return str(exc)
    arch = dict(info, **info["layout"])
    nat.meta, nat.arch = meta, arch
    off = arch["interp_offsets"]
    problems = [] if trusted else _probe_interp_offsets(off)
    if problems:
        return "interpreter layout differs from the one the shim was built for: " + "; ".join(problems)
    request = _api_fn("_PyEval_RequestCodeExtraIndex", 1)  # (Py_ssize_t)
    index = _loader.signed(request(None))
    if index < 0:
        return "no free co_extra index (another tool took them all)"
    problems = [] if trusted else _probe_code_extra(off, index)
    if problems:
        return "interpreter layout differs from the one the shim was built for: " + "; ".join(problems)
    nat.extra_index = index
    nat.interp = _api_fn("PyInterpreterState_Get", 0)()
    try:
        nat.default = _loader.resolve("f:_PyEval_EvalFrameDefault")
    except _loader.NativeUnavailable as exc:
        return str(exc)
    if not trusted:
        mem = _SafeMemory()
        try:
            field = mem.ptr(nat.interp + off["interp_eval_frame"])
        finally:
            mem.close()
        if field != 0 and _current_eval(nat) == nat.default:
            return f"interpreter layout differs: PyInterpreterState.eval_frame (offset {off['interp_eval_frame']})"
    try:
        # a copy of its own: the data area holds this interpreter's state
        blob = _loader.load_copy(BLOB, meta, image=image)
    except _loader.NativeUnavailable as exc:
        return str(exc)
    f = arch["fields"]
    blob.put_i64(arch["magic_offset"], 0x6D6F6E7374616B31)
    blob.put_ptr(f["py_none"], id(None))
    blob.put_ptr(f["py_true"], id(True))
    blob.put_ptr(f["py_false"], id(False))
    blob.put_ptr(f["exc_recursion"], id(RecursionError))
    blob.put_ptr(f["exc_type_error"], id(TypeError))
    blob.put_ptr(f["exc_exception"], id(Exception))
    blob.put_ptr(f["coro_exit"], id(COROUTINE_EXIT))
    blob.put_ptr(f["str_type"], id(str))
    blob.put_ptr(f["eval_slot"], nat.interp + off["interp_eval_frame"])
    blob.put_ptr(f["list_type"], id(list))
    blob.put_ptr(f["tuple_type"], id(tuple))
    blob.put_ptr(f["long_type"], id(int))
    blob.put_ptr(f["interp"], nat.interp)
    blob.put_i64(f["extra_index"], index)
    blob.put_i64(f["margin"], STACK_MARGIN)
    nat.blob = blob
    nat.entry = blob.addr("ms_eval_frame")
    if not trusted:
        _loader.remember(BLOB, {})
    return None


def _current_eval(nat: _Native) -> int:
    get = _api_fn("_PyInterpreterState_GetEvalFrameFunc", 1)
    return get(nat.interp) or 0


def _set_eval(nat: _Native, func: int) -> None:
    set_ = _api_fn("_PyInterpreterState_SetEvalFrameFunc", 2)  # (void: its word is ignored)
    set_(nat.interp, func)


def _foreign_reason(nat: _Native) -> Optional[str]:
    current = _current_eval(nat)
    if current in (nat.default, nat.entry):
        return None
    return f"another eval_frame function is installed ({current:#x}: e.g. a debugger's frame evaluator or torch.compile)"


_atexit_registered = False


def _register_atexit() -> None:
    """Make the shim inert before the interpreter tears modules down.

    The shim reads objects this module keeps alive (the TLS object, its key, the
    policy callback); interpreter finalisation frees module globals in no set order
    while Python code (finalisers, daemon threads) may still run. ``atexit`` handlers
    run before that: the shim then passes every frame straight through.
    """
    global _atexit_registered
    if _atexit_registered:
        return
    _atexit_registered = True
    import atexit

    atexit.register(_at_exit)


#: The started backend (its host is told at exit that the shadow stacks stop), or None.
_running: Optional["EvalFrameBackend"] = None
#: The shim was made inert at exit: snapshots walk the real frames from then on, quietly.
_exited = False


def _at_exit() -> None:
    global _exited
    nat = _native
    if nat is None or nat.blob is None:
        return
    _exited = True
    backend = _running
    if backend is not None:
        # finalizers and daemon threads still run after this: the shim no longer pushes,
        # so snapshot()'s fast paths must stop trusting the shadow stacks (capture()
        # walks the real frames instead, without taking the reset eval_frame function
        # for another tool's)
        try:
            backend.host.distrust()
        except Exception:
            pass
    f = nat.arch["fields"]
    nat.blob.put_i64(f["enabled"], 0)
    nat.blob.put_ptr(f["snap_live"], 0)
    nat.gen += 1
    nat.blob.put_i64(f["gen"], nat.gen)
    if _current_eval(nat) == nat.entry:
        _set_eval(nat, nat.default)


def _make_decide(policy: Policy, errors: list, distrust: Callable[[], None]) -> Callable[[CodeType, Any], Optional[bool]]:
    """The policy callback the shim calls once per (code object, install).

    Runs with ``tstate->tracing`` raised: nothing it runs is tracked. An Exception is
    recorded (reported later, outside the shim) and the code counts as filtered for
    this call only. Anything else (KeyboardInterrupt or another exception raised by a
    signal handler that happened to run in here) propagates: the shim makes the frame
    that was starting raise it, which is where CPython would have raised it.
    """
    is_tracked = policy.is_tracked

    def decide(code: CodeType, globals: Any) -> Optional[bool]:
        try:
            name = globals.get("__name__") if type(globals) is dict else None
            return bool(is_tracked(code, name))
        except Exception as exc:  # reported from capture(), outside the shim
            if not errors:  # one is enough to report; never pile up exceptions (and their tracebacks)
                errors.append(exc.with_traceback(None))
            distrust()  # so that the next snapshot reaches capture()
            return None

    return decide


class EvalFrameBackend:
    """Tracking through a native PEP 523 eval_frame shim (CPython 3.11)."""

    name = "evalframe"
    tracking = True

    @staticmethod
    def unavailable() -> Optional[str]:
        reason = _static_reason()
        if reason:
            return reason
        nat = _load()
        if nat.reason:
            return nat.reason
        return _foreign_reason(nat)

    def __init__(self, policy: Policy, host: Host, accelerator: Optional[bool] = None) -> None:
        """``accelerator`` is ignored: this backend is the native shim or nothing."""
        self.policy = policy
        self.host = host
        self.on_error = host.on_error
        self._nat: Optional[_Native] = None
        self._keep: tuple = ()
        self._errors: list = []
        self._eval_view: Optional[C.c_void_p] = None
        self._replaced_by = 0
        self._warned = False
        #: The native whole-snapshot path (``ms_snapshot_new``, called from inside
        #: ``snapshot()``), or None; ``snapshotter()``'s function (``ms_capture``), or None.
        self.snapshot_native: Optional[Callable[[], Any]] = None
        self.capture_native: Optional[Callable[[], Any]] = None
        #: The shim's blob while it runs (the origin carrier comes from it).
        self.native_blob: Any = None
        #: This install's token while its native snapshot paths are live: a 1-tuple
        #: holding ``monstack.snapshot`` (the self of both functions; the shim answers
        #: only while ``DATA.snap_live`` is this object, else they fall back).
        self._snap_token: Optional[tuple] = None

    def start(self) -> None:
        why = self.unavailable()
        if why:
            raise RuntimeError(f"backend 'evalframe' cannot run here: {why}")
        nat = _load()
        blob = nat.blob
        assert blob is not None
        f = nat.arch["fields"]
        _stack.reset_tls(self_registering=True)  # (the shim seeds threads in C)
        tls = _stack.TLS
        key, dummy_type, off_localdict = _find_tls_key(tls)
        decide = _make_decide(self.policy, self._errors, self.host.distrust)
        cell = sys.intern("cell")
        self._keep = (tls, key, dummy_type, decide, cell)
        blob.put_i64(f["enabled"], 0)
        nat.gen += 1
        nat.epoch += 1
        blob.put_i64(f["gen"], nat.gen)
        blob.put_i64(f["epoch"], nat.epoch)
        blob.put_ptr(f["tls"], id(tls))
        blob.put_ptr(f["tls_key"], id(key))
        blob.put_ptr(f["dummy_type"], id(dummy_type))
        blob.put_i64(f["off_localdict"], off_localdict)
        blob.put_ptr(f["str_cell"], id(cell))
        blob.put_ptr(f["decide"], id(decide))
        blob.put_i64(f["enabled"], 1)
        _register_atexit()
        _set_eval(nat, nat.entry)
        off = nat.arch["interp_offsets"]["interp_eval_frame"]
        view = C.c_void_p.from_address(nat.interp + off)
        if view.value != nat.entry or _current_eval(nat) != nat.entry:
            self._disable(nat)
            _set_eval(nat, nat.default)
            raise RuntimeError("backend 'evalframe': the interpreter did not take the shim (layout mismatch)")
        self._nat = nat
        self._eval_view = view
        self.native_blob = nat.blob
        self._start_snapshots(nat)
        _stack.watch_collections(True)
        global _running
        _running = self
        EXITS_REPORTED[0] = True

    def _start_snapshots(self, nat: _Native) -> None:
        """Offer the native snapshot paths, if ``Snapshot``'s layout is the one the shim
        builds (as ``_accel.snapshot_new`` checks it for the 3.12-3.15 callbacks)."""
        from . import _snapshot

        cls = _snapshot.Snapshot
        items = tuple.__getitem__  # Snapshot's own __getitem__/__iter__ read frames
        try:
            first = cls._new(None, 7, None)
            if (cls.__base__ is not tuple or items(first, slice(None)) != (None, 7, None, None, 0)
                    or items(cls._new(None, 8, first), slice(None)) != (None, 8, first, None, 1)
                    or _snapshot._HOP_BITS != 32):
                return
        except Exception:
            return
        blob = nat.blob
        assert blob is not None
        f = nat.arch["fields"]
        token = (self.host.snapshot,)
        by_file = self.policy.tracked_files()
        blob.put_ptr(f["snap_live"], 0)
        blob.put_ptr(f["snap_cls"], id(cls))
        blob.put_ptr(f["origin_var"], id(_snapshot.CURRENT_ORIGIN))
        blob.put_ptr(f["shorten"], id(_snapshot._SHORTEN_CELL))
        blob.put_ptr(f["by_file"], id(by_file))
        self._keep += (cls, _snapshot.CURRENT_ORIGIN, _snapshot._SHORTEN_CELL, by_file, token)
        self._snap_token = token
        blob.put_ptr(f["snap_live"], id(token))
        self.snapshot_native = _loader.cached_function(blob, "ms_snapshot_new", "snapshot_new", self_obj=token)
        self.capture_native = _loader.cached_function(blob, "ms_capture", "snapshot", self_obj=token)

    def _disable(self, nat: _Native) -> None:
        blob = nat.blob
        assert blob is not None
        f = nat.arch["fields"]
        blob.put_i64(f["enabled"], 0)
        nat.gen += 1
        blob.put_i64(f["gen"], nat.gen)
        self._retire_snapshots(nat)
        for name in ("tls", "tls_key", "str_cell", "decide", "by_file"):
            blob.put_ptr(f[name], 0)
        self._keep = ()

    def stop(self) -> None:
        nat = self._nat
        if nat is None:
            return
        self._nat = None
        self._eval_view = None
        EXITS_REPORTED[0] = False
        global _running
        if _running is self:
            _running = None
        self.snapshot_native = None
        self.capture_native = None
        self._disable(nat)
        if _current_eval(nat) == nat.entry:
            _set_eval(nat, nat.default)
        # else: somebody replaced us; leave their function alone (ours is now inert)
        _stack.watch_collections(False)
        _stack.reset_tls()

    def retire_fast(self) -> None:
        """The native snapshot paths stop answering (uninstall, or a shadow stack that
        can no longer be trusted); handed-out ``snapshotter()`` functions fall back to
        ``monstack.snapshot``. Coroutine exits are no longer reported either (the shim
        may have been replaced)."""
        EXITS_REPORTED[0] = False
        self.snapshot_native = None
        self.capture_native = None
        nat = self._nat
        if nat is not None:
            self._retire_snapshots(nat)

    def _retire_snapshots(self, nat: _Native) -> None:
        token, self._snap_token = self._snap_token, None
        blob = nat.blob
        if token is not None and blob is not None:
            off = nat.arch["fields"]["snap_live"]
            if blob.get_i64(off) == id(token):
                blob.put_ptr(off, 0)
            # the snapshot the shim keeps for reuse (it holds nodes of this install)
            _loader.cached_function(blob, "ms_snapshot_forget", "snapshot_forget", self_obj=token)()

    def capture(self, frame: Optional[FrameType]) -> tuple[Any, int]:
        view = self._eval_view
        if view is not None and view.value != self._nat.entry:  # type: ignore[union-attr]
            if _exited:  # made inert at exit (see _at_exit), not replaced
                return _stack.build(frame, self.policy)
            return self._replaced(frame)
        if self._errors:
            self._report_errors()
        return _stack.capture(frame, self.policy)

    def _replaced(self, frame):
        """Another PEP 523 user replaced (or reset) our eval_frame: stacks are stale."""
        if not self._warned:
            self._warned = True
            self._replaced_by = self._eval_view.value or 0  # type: ignore[union-attr]
            # snapshot()'s inline fast path trusts the shadow stack: turn it off for
            # this install (it comes back with the next install)
            self.host.distrust()
            warn(
                "monstack-eval-frame-replaced",
                "another tool replaced monstack's eval_frame function "
                f"({self._replaced_by:#x}); snapshots now walk the real frames (slower). "
                "Call monstack.uninstall()/install() after that tool is done."
            )
        return _stack.build(frame, self.policy)

    def _report_errors(self) -> None:
        errors, self._errors[:] = list(self._errors), []
        if errors:
            self.on_error(errors[0])

    def counters(self) -> Dict[str, int]:
        nat = _native
        if nat is None or nat.blob is None:
            return {}
        return {name: nat.blob.get_i64(o) for name, o in nat.arch["counters"].items()}

    def describe(self) -> Dict[str, str]:
        nat = self._nat
        if nat is None:
            return {"eval_frame": "not installed"}
        out = {
            "eval_frame": f"native shim at {nat.entry:#x} ({_env.MACHINE}, built against CPython "
                          f"{nat.meta.get('headers')} headers, {nat.arch['compiler']})",
        }
        view = self._eval_view
        if view is not None and view.value != nat.entry:
            out["eval_frame"] += f"; REPLACED by another function at {(view.value or 0):#x}: snapshots walk frames"
        c = self.counters()
        out["shim counters"] = ", ".join(f"{k[2:]}={v}" for k, v in c.items())
        out["C stack reserve"] = f"{STACK_MARGIN // 1024} KiB per thread"
        out["native checks"] = _loader.checked.get(BLOB, "-")
        return out
