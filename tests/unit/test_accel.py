"""Native sys.monitoring callbacks: the same shadow stacks as the pure-Python ones.

Every scenario runs twice -- pure-Python callbacks, then native callbacks -- and must
give identical snapshot records (and identical node chains), each equal to the real
stack under the same policy (the ``stackcheck`` oracle).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import inspect
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import threading
import weakref

import pytest

from monstack import _env

if not _env.HAS_SYSMON:
    pytest.skip("native sys.monitoring callbacks need CPython 3.12+", allow_module_level=True)

import monstack  # noqa: E402
from monstack import _accel, _capture, _install, _native, _stack, _sysmon  # noqa: E402
from stackcheck import (assert_one_site_one_snapshot, captures_for_library_snapshots, library_module, real_records,  # noqa: E402
                        shadow_records)

WHY = _accel.unavailable()
OK = WHY is None
SUPPORTED = (
    sys.platform.startswith("linux")
    and sys.version_info[:2] in ((3, 12), (3, 13), (3, 14), (3, 15))
    and (_native.machine() == "x86_64" or (_native.machine() == "aarch64" and sys.version_info[:2] >= (3, 13)))
    and not sysconfig.get_config_var("Py_GIL_DISABLED")
    and not hasattr(sys, "gettotalrefcount")
)
needs_native = pytest.mark.skipif(not OK, reason=f"native callbacks unavailable: {WHY}")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PY_CALLBACKS = _sysmon._callbacks


def test_available_exactly_where_supported():
    if SUPPORTED:
        assert WHY is None, WHY
    else:
        assert WHY and isinstance(WHY, str)


@contextlib.contextmanager
def tracking(native: bool, **options):
    """monstack installed (monitoring backend) with native or pure-Python callbacks."""
    monstack.uninstall()
    options.setdefault("propagate", False)
    if "accelerator" in inspect.signature(monstack.install).parameters:
        monstack.install(backend="monitoring", accelerator=native, **options)
        patched = False
    else:  # before install() grows the option: swap the callback factory
        _sysmon._callbacks = _native_factory if native else _PY_CALLBACKS
        patched = True
        monstack.install(backend="monitoring", **options)
    try:
        assert registered_are_native() is native
        yield
    finally:
        monstack.uninstall()
        if patched:
            _sysmon._callbacks = _PY_CALLBACKS


def _registered(event=None):
    mon = sys.monitoring
    tool = _capture._state.backend.tool
    event = event or mon.events.PY_START
    cb = mon.register_callback(tool, event, None)
    mon.register_callback(tool, event, cb)
    return cb


def _native_factory(policy, tls, on_error):
    return _accel.callbacks(policy, tls, on_error, py_callbacks=_PY_CALLBACKS)


def registered_are_native() -> bool:
    return _accel.is_native(_registered())


@pytest.fixture
def native_throw(monkeypatch):
    """Use the native PY_THROW callback too (by default PY_THROW stays Python)."""
    real = _accel.callbacks
    monkeypatch.setattr(_accel, "callbacks", lambda *a, **k: real(*a, **k, native_throw=True))
    yield


def native_counters() -> dict:
    return _accel.counters(_registered())


# --------------------------------------------------------------------------- recording
OUT: list = []


def chain(snap):
    """The snapshot's node chain as (function name, call site known), innermost first.

    (Raw offsets are not compared across runs: the second run executes specialized
    bytecode, whose "previous instruction" inside a call can be another code unit of
    the same line; the records compare the lines.)"""
    out = []
    node = snap._node
    while node is not None:
        out.append((node[0].co_qualname, node[2] >= 0))
        node = node[1]
    return out


def mark(tag=""):
    """Record the snapshot here (records + node chain) and the real stack."""
    snap, real = monstack.snapshot(), real_records(sys._getframe())  # one line: same lineno
    OUT.append((tag, shadow_records(snap), chain(snap), real))


def run_both(scenario, *args, **options):
    """Run ``scenario`` under Python then native callbacks; return both recordings."""
    results = []
    for native in (False, True):
        OUT.clear()
        with tracking(native, **options):
            scenario(*args)
        results.append(list(OUT))
    OUT.clear()
    return results


def assert_same(py, nat):
    assert len(py) == len(nat) and py, (len(py), len(nat))
    for (tag, rec_p, chain_p, real_p), (tag2, rec_n, chain_n, real_n) in zip(py, nat):
        assert tag == tag2
        assert rec_p == real_p, f"python callbacks vs real stack at {tag}"
        assert rec_n == real_n, f"native callbacks vs real stack at {tag}"
        assert rec_p == rec_n, f"records differ at {tag}"
        assert chain_p == chain_n, f"node chains differ at {tag}"


# --------------------------------------------------------------------------- scenarios
def nested(n):
    if n == 0:
        mark("leaf")
        return
    if n % 2:
        mark(f"odd {n}")
    nested(n - 1)
    list(map(nested_via_c, [n - 1] if n > 3 else []))  # entered from C: call site unknown
    mark(f"after {n}")


def nested_via_c(n):
    mark(f"via C {n}")
    return sorted([3, 1, 2], key=lambda x: (mark("key") if x == 1 else None, x))


def s_nested():
    nested(6)


def boom(n):
    if n == 0:
        raise ValueError("boom")
    try:
        boom(n - 1)
    finally:
        mark(f"finally {n}")


def s_exceptions():
    for depth in (1, 3, 5):
        try:
            boom(depth)
        except ValueError as exc:
            mark(f"caught {depth}")
            assert str(exc) == "boom"
    try:
        try:
            boom(2)
        except ValueError:
            mark("handler")
            raise KeyError("chained")
    except KeyError as exc:
        assert isinstance(exc.__context__, ValueError)
        mark("outer")


def inner_gen():
    x = yield 1
    mark(f"inner got {x}")
    try:
        yield 2
    except KeyError:
        mark("inner caught")
        yield 3
    finally:
        mark("inner finally")


def outer_gen():
    mark("outer start")
    r = yield from inner_gen()
    mark(f"outer after {r}")
    yield 4


def s_generators():
    g = outer_gen()
    next(g)
    g.send("a")
    assert g.throw(KeyError) == 3  # throw into a delegating generator
    mark("after throw")
    g.close()
    mark("after close")
    g2 = inner_gen()
    next(g2)
    g2.close()
    g3 = outer_gen()
    next(g3)
    with contextlib.suppress(ValueError):
        g3.throw(ValueError)
    mark("end")
    gen_exp = (mark(f"genexp {i}") for i in range(2))
    list(gen_exp)


async def leaf_coro(i):
    mark(f"coro {i} before")
    await asyncio.sleep(0)
    mark(f"coro {i} after")
    return i


async def mid_coro(i):
    return await leaf_coro(i)


async def main_coro():
    res = await asyncio.gather(*(mid_coro(i) for i in range(3)))
    mark("gathered")
    return res


def s_asyncio():
    assert asyncio.run(main_coro()) == [0, 1, 2]


def s_threads():
    results: dict = {}

    def body(i):
        for k in range(3):
            nested(2 + (i + k) % 3)
        results[i] = True

    threads = [threading.Thread(target=body, args=(i,)) for i in range(4)]
    # Run one at a time so the order of OUT is deterministic; stacks are per thread.
    for t in threads:
        t.start()
        t.join()


class Shape:
    mark("class body")
    double = staticmethod(lambda x: (mark("lambda"), x * 2)[1])
    squares = [mark("comprehension") or i * i for i in range(2)]


def s_misc():
    Shape.double(3)
    exec("mark('exec')", {"mark": mark})
    eval("mark('eval')", {"mark": mark})
    [mark("listcomp") for _ in range(1)]
    {k: mark("dictcomp") for k in range(1)}


def deep(n):
    if n == 0:
        mark("deep")
        return
    deep(n - 1)


def s_recursion_near_limit():
    limit = sys.getrecursionlimit()
    deep(limit - len(inspect.stack(0)) - 40)


SCENARIOS = [s_nested, s_exceptions, s_generators, s_asyncio, s_threads, s_misc, s_recursion_near_limit]


@needs_native
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_identical_to_python_callbacks_and_to_the_real_stack(scenario):
    py, nat = run_both(scenario)
    assert_same(py, nat)


@needs_native
@pytest.mark.parametrize("scenario", [s_generators, s_asyncio], ids=lambda f: f.__name__)
def test_native_throw_callback_identical_too(scenario, native_throw):
    py, nat = run_both(scenario)
    assert_same(py, nat)


# --------------------------------------------------------------------------- random programs
def random_program(seed: int, nfuncs: int = 12) -> str:
    """Source of a random program: calls, C-mediated calls, exceptions, generators."""
    rnd = random.Random(seed)
    lines = ["class E(Exception):", "    pass", ""]
    for i in range(nfuncs):
        lines.append(f"def f{i}(d):")
        lines.append(f"    mark('f{i} in')")
        lines.append("    if d <= 0:")
        lines.append("        return 0")
        for _ in range(rnd.randint(1, 3)):
            j = rnd.randint(i, nfuncs - 1)
            kind = rnd.choice(["call", "c", "raise", "gen", "throw", "close", "yf"])
            if kind == "call":
                lines.append(f"    f{j}(d - 1)")
            elif kind == "c":
                lines.append(f"    list(map(f{j}, [d - 1]))")
            elif kind == "raise":
                lines += ["    try:", f"        f{j}(d - 1)", "        raise E()", "    except E:",
                          f"        mark('f{i} caught')"]
            elif kind == "gen":
                lines += [f"    for _x in g{j}(d - 1):", f"        mark('f{i} loop')"]
            elif kind == "throw":
                lines += [f"    it = g{j}(d - 1)", "    try:", "        next(it)", "        it.throw(E())",
                          "    except (E, StopIteration):", f"        mark('f{i} thrown')"]
            elif kind == "close":
                lines += [f"    it = g{j}(d - 1)", "    next(it, None)", "    it.close()", f"    mark('f{i} closed')"]
            else:
                lines += [f"    for _x in h{j}(d - 1):", "        pass"]
        lines.append("    return 1")
        lines.append("")
        lines.append(f"def g{i}(d):")
        lines.append(f"    mark('g{i} start')")
        lines.append("    try:")
        lines.append(f"        yield f{min(i + 1, nfuncs - 1)}(d - 1)")
        lines.append("    finally:")
        lines.append(f"        mark('g{i} finally')")
        lines.append("    yield 2")
        lines.append("")
        lines.append(f"def h{i}(d):")
        lines.append(f"    yield from g{i}(d)")
        lines.append(f"    mark('h{i} after')")
        lines.append("")
    return "\n".join(lines)


@needs_native
@pytest.mark.parametrize("seed", range(6))
def test_random_programs_identical(seed, tmp_path):
    source = random_program(seed)
    path = tmp_path / f"randprog_{seed}.py"
    path.write_text(source)
    ns: dict = {"mark": mark, "__name__": f"randprog_{seed}"}
    exec(compile(source, str(path), "exec"), ns)

    def scenario():
        for start in range(0, 12, 3):
            ns[f"f{start}"](3)
        t = threading.Thread(target=ns["f0"], args=(2,))
        t.start()
        t.join()

    py, nat = run_both(scenario)
    assert_same(py, nat)


@needs_native
@pytest.mark.parametrize("seed", range(6, 9))
def test_random_programs_identical_with_native_throw(seed, tmp_path, native_throw):
    test_random_programs_identical(seed, tmp_path)


# --------------------------------------------------------------------------- behaviour
def leaf(x):
    return x


def loop(n):
    for i in range(n):
        leaf(i)


@needs_native
def test_hot_path_needs_no_python_and_records_call_sites():
    with tracking(True, track="all"):
        loop(10)
        before = native_counters()
        stats = dict(_stack.STATS)
        loop(5000)
        after = native_counters()
        assert _stack.STATS == stats
    assert after["decide"] == before["decide"]
    assert after["seed"] == before["seed"] and after["resync"] == before["resync"] == 0
    assert after["push_known"] - before["push_known"] >= 5000  # caller frame is the top: site known
    assert after["pop"] - before["pop"] >= 5000
    assert after["errors"] == 0


@needs_native
def test_policy_asked_once_per_file_and_filtered_code_disabled(tmp_path):
    mod = tmp_path / "accel_filtered_mod.py"
    mod.write_text("def lib(n):\n    return n + 1\n\ndef lib2(n):\n    return lib(n)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import accel_filtered_mod as m
    finally:
        sys.path.remove(str(tmp_path))
    with tracking(True, exclude=["accel_filtered_mod"]):
        m.lib2(1)
        c1 = native_counters()
        for i in range(2000):
            m.lib2(i)
        c2 = native_counters()
        assert c2["events"] - c1["events"] < 20  # DISABLE'd after their first events
        assert "lib" not in [r[2] for r in shadow_records(m.lib(0) and monstack.snapshot())]
    with tracking(True):
        c0 = native_counters()["decide"]
        m.lib2(1)
        m.lib(2)
        assert native_counters()["decide"] - c0 == 1  # one file, one decision


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False], ids=["native", "python"])
def test_exceptions_through_filtered_frames_take_the_fast_path(tmp_path, native):
    # PY_UNWIND cannot be disabled per code object: each filtered frame an exception
    # leaves reports it. Its code's decision is known, so the event pops nothing (the
    # native callbacks: on the fast path, without looking the thread's stack up);
    # tracked frames around it keep their nodes.
    mod = tmp_path / "accel_unwind_mod.py"
    mod.write_text(
        "def inner(i):\n    raise KeyError(i)\n\n"
        "def middle(i):\n    return inner(i)\n\n"
        "def outer(i, check):\n"
        "    try:\n        middle(i)\n    except KeyError:\n        return check()\n\n"
        "def loop(n):\n    c = 0\n    for i in range(n):\n"
        "        try:\n            middle(i)\n        except KeyError:\n            c += 1\n    return c\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import accel_unwind_mod as m
    finally:
        sys.path.remove(str(tmp_path))

    def tracked_catcher(i):
        try:
            m.middle(i)
        except KeyError:
            return shadow_records(monstack.snapshot()) == real_records()

    counters = native_counters if native else (lambda: dict.fromkeys(("unwind_filtered", "decide", "resync",
                                                                       "cache_miss", "errors", "pop"), 0))
    stats = dict(_stack.STATS)
    with tracking(native, exclude=["accel_unwind_mod"]):
        assert tracked_catcher(0)
        c1 = counters()
        results = [tracked_catcher(i) for i in range(100)]
        c2 = counters()
        assert results == [True] * 100
        assert c2["decide"] == c1["decide"] and c2["resync"] == c1["resync"]
        # a filtered frame that catches: the tracked caller's node stays, the check's too
        assert m.outer(1, lambda: shadow_records(monstack.snapshot()) == real_records())
        # a thread that runs filtered code only has no stack at all: no lookup either
        out = []
        t = threading.Thread(target=lambda: out.append(m.loop(100)))
        c3 = counters()
        t.start()
        t.join()
        c4 = counters()
        assert out == [100]
        assert tracked_catcher(1)
        if native:
            assert c2["unwind_filtered"] - c1["unwind_filtered"] == 200  # inner and middle, each time
            assert c4["unwind_filtered"] - c3["unwind_filtered"] >= 200
            assert c4["cache_miss"] - c3["cache_miss"] < 20  # (its first events: start, return)
        assert counters()["errors"] == 0
    assert _stack.STATS["resync"] == stats["resync"]
    if not native:
        return
    with tracking(True, track="all"):
        assert tracked_catcher(0)
        c1 = native_counters()
        assert tracked_catcher(1)
        c2 = native_counters()
        assert c2["unwind_filtered"] == c1["unwind_filtered"]  # tracked frames pop their nodes
        assert c2["pop"] - c1["pop"] >= 2


@needs_native
def test_internal_error_warns_once_and_uninstalls(monkeypatch):
    monkeypatch.setattr(_install, "_failure_reported", False)
    with tracking(True):
        _stack.TLS.cell = None  # break this thread's state: the next push fails

        with pytest.warns(monstack.MonstackWarning, match="tracking turned off"):

            def user_code():
                return 42

            assert user_code() == 42
        assert monstack.active_backend() is None


@needs_native
def test_exceptions_pass_through_untouched():
    def thrower():
        raise KeyError("k")

    def middle():
        try:
            thrower()
        except KeyError as exc:
            assert sys.exception() is exc
            raise RuntimeError("r") from exc

    with tracking(True, track="all"):
        with pytest.raises(RuntimeError) as info:
            middle()
        err = info.value
        assert isinstance(err.__cause__, KeyError)
        names = []
        tb = err.__traceback__
        while tb is not None:
            names.append(tb.tb_frame.f_code.co_name)
            tb = tb.tb_next
        assert names[-1] == "middle"
        assert sys.exception() is None
        assert native_counters()["errors"] == 0


@needs_native
def test_no_leaks_over_many_tracked_calls():
    with tracking(True, track="all"):
        loop(50_000)
        gc.collect()
        before = sys.getallocatedblocks()
        loop(300_000)
        gc.collect()
        after = sys.getallocatedblocks()
    assert after - before < 500, (before, after)


@needs_native
def test_code_objects_and_frames_are_freed(tmp_path):
    path = tmp_path / "accel_gone.py"
    path.write_text("def f(x):\n    return g(x)\n\ndef g(x):\n    return snap()\n")

    class Local:
        pass

    with tracking(True):
        ns: dict = {"snap": monstack.snapshot, "__name__": "accel_gone"}
        exec(compile(path.read_text(), str(path), "exec"), ns)
        snap = ns["f"](1)
        # (node names, not records(): formatting keeps a bounded per-code cache)
        assert [name for name, _known in chain(snap)][:2] == ["g", "f"]
        code_ref = weakref.ref(ns["g"].__code__)
        local_ref = []

        def holder():
            obj = Local()
            local_ref.append(weakref.ref(obj))
            return monstack.snapshot()

        keep = holder()
        assert local_ref[0]() is None  # no frame kept alive by the shadow stack
        del ns, snap
        gc.collect()
        assert code_ref() is None
        assert keep is not None


@needs_native
def test_reinstall_cycles_free_their_state():
    for _ in range(3):
        with tracking(True):
            loop(100)
    gc.collect()
    before = sys.getallocatedblocks()
    for _ in range(30):
        with tracking(True):
            loop(100)
        with tracking(False):
            loop(100)
    gc.collect()
    assert sys.getallocatedblocks() - before < 1500


@needs_native
def test_threads_each_have_their_stack():
    errors: list = []
    barrier = threading.Barrier(8)

    def work(i):
        try:
            barrier.wait()
            for k in range(200):
                nested_check(3 + (i + k) % 4, i)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    with tracking(True):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        c = native_counters()
    assert errors == []
    assert c["resync"] == 0 and c["errors"] == 0 and c["seed"] >= 8


def nested_check(n, i):
    if n == 0:
        snap, real = monstack.snapshot(), real_records(sys._getframe())
        assert shadow_records(snap) == real
        return
    nested_check(n - 1, i)


# --------------------------------------------------------------------------- refusals
def test_refuses_free_threaded_builds(monkeypatch):
    monkeypatch.setattr(_env, "FREE_THREADED", True)
    assert "free-threaded" in (_accel._refusal() or "")


def test_refuses_other_versions(monkeypatch):
    monkeypatch.setattr(_env, "NATIVE_CALLBACKS_FOR_VERSION", False)
    monkeypatch.setattr(_env, "VERSION_TAG", "3.10")
    assert "exist for CPython 3.12, 3.13, 3.14 and 3.15 (this is 3.10)" in (_accel._refusal() or "")


def test_refuses_debug_and_tail_calling_builds_with_the_reason(monkeypatch):
    monkeypatch.setattr(_env, "DEBUG_BUILD", True)
    assert "debug build" in (_accel._refusal() or "")
    monkeypatch.setattr(_env, "DEBUG_BUILD", False)
    monkeypatch.setattr(_env, "TAIL_CALL_INTERP", True)
    assert "tail-calling interpreter" in (_accel._refusal() or "")


def test_build_facts_of_this_interpreter():
    """The tail-calling interpreter and the JIT (3.14+): facts read once, in _env."""
    assert _env.TAIL_CALL_INTERP == bool(sysconfig.get_config_var("Py_TAIL_CALL_INTERP")
                                         or sysconfig.get_config_var("_Py_TAIL_CALL_INTERP"))
    jit = getattr(sys, "_jit", None)
    assert _env.JIT_ENABLED == (jit is not None and jit.is_enabled())


_JIT_PROGRAM = """
import sys, monstack
sys.path[:0] = [{programs!r}, {lib!r}]
monstack.install(exclude=["hotlib"], propagate=False)
from mismatch import bad, check
import hotlib
assert monstack.status().get("accelerator") == "native", monstack.status()
cap = monstack.snapshotter()

def cb(i):
    if i % 89 == 0:
        check()
    if i % 13 == 0:
        raise ValueError
    if i % 31 == 0:
        return hotlib.nested(inner, i)
    return len(cap().records())

def inner(i):
    check()
    return 2

def cb2(i):
    if i % 97 == 0:
        check()
    return 1

hotlib.drive(cb, 60000)
sum(hotlib.gen_drive(cb2, 30000))
print("jit", sys._jit.is_enabled(), "active", hotlib.active[0], "mismatches", len(bad))
"""

_JIT_LIB = """
import sys
active = [0]

def drive(cb, n):
    t = 0
    for i in range(n):
        if sys._jit.is_active():
            active[0] += 1
        try:
            t += cb(i)
        except ValueError:
            t += 1
    return t

def gen_drive(cb, n):
    for i in range(n):
        yield cb(i)

def nested(cb, i):
    return cb(i) + 1
"""


@needs_native
@pytest.mark.skipif(not getattr(getattr(sys, "_jit", None), "is_available", lambda: False)(),
                    reason="no JIT in this build")
def test_native_callbacks_with_the_jit_on(tmp_path):
    """PYTHON_JIT=1: tracked code (its events delivered) is not JIT-compiled, filtered code
    is -- here a library loop, JIT code calling tracked callbacks that snapshot, raise
    and call back through the library. Every snapshot matches the real frames."""
    (tmp_path / "hotlib.py").write_text(_JIT_LIB)
    src = _JIT_PROGRAM.format(programs=os.path.join(ROOT, "tests", "programs"), lib=str(tmp_path))
    env = dict(os.environ, PYTHON_JIT="1", PYTHONPATH=ROOT)
    env.pop("MONSTACK_ACCELERATOR", None)
    out = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    assert words[:2] == ["jit", "True"] and int(words[3]) > 10000 and words[4:] == ["mismatches", "0"], out.stdout


@needs_native
def test_layout_mismatch_is_refused(monkeypatch):
    blob = _accel._blob
    real = _accel._layout

    def wrong(b):
        lay = dict(real(b))
        lay["co_filename"] += 8
        return lay

    monkeypatch.setattr(_accel, "_layout", wrong)
    with pytest.raises(_native.NativeUnavailable, match="co_filename"):
        _accel._verify_layout(blob)


@needs_native
def test_manifest_table_and_layout_are_the_blob_s():
    """The manifest records the table the blob describes itself (checked at load) and
    the layout it was compiled with (what _verify_layout compares)."""
    blob = _accel._blob
    _accel._verify_table(blob)
    assert blob.layout == _accel._layout(blob)
    assert blob.name == _accel.blob_name() == f"sysmon{sys.version_info[0]}{sys.version_info[1]}"


@needs_native
def test_a_table_that_differs_from_the_blob_s_is_refused(monkeypatch):
    blob = _accel._blob
    table = dict(blob.info["table"])
    first = next(iter(table))
    table[first] += 8
    monkeypatch.setattr(blob, "info", dict(blob.info, table=table))
    with pytest.raises(_native.NativeUnavailable, match="table differs"):
        _accel._verify_table(blob)


@needs_native
def test_memory_flat_in_a_subprocess_bench():
    """The 10M-call version is ``bench/bench_accel.py --memory 10000000``; here 1M."""
    code = (
        "import sys; sys.path[:0] = [%r, %r]\n"
        "import bench_accel\n"
        "bench_accel.memory(1_000_000)\n" % (ROOT, os.path.join(ROOT, "bench"))
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    growth = int(out.stdout.split("(growth ")[1].split(" kB")[0])
    assert growth < 2048, out.stdout


# --------------------------------------------------------------------------- native snapshot
_SNAP_SRC = """
def via_fast():
    r = fast()
    return r

def via_new():
    return snap_new()
"""


def _snap_helpers():
    """The native snapshot functions, called from functions that live (for the policy)
    in monstack's directory, as snapshot() itself does."""
    cb = _registered()
    ns = {"fast": _accel.snapshot_fast(cb), "snap_new": _accel.snapshot_new(cb, monstack.snapshot)}
    assert ns["snap_new"] is not None
    exec(compile(_SNAP_SRC, os.path.join(os.path.dirname(_install.__file__), "_test_accel_snapshot.py"), "exec"), ns)
    return ns["via_fast"], ns["via_new"]


_COLLECT_SRC = """
def collect(out, n):
    seed()  # monstack.snapshot(): its Python path seeds this thread's shadow stack
    for _ in range(n):
        out.append(snap_new())
"""


@needs_native
def test_native_snapshot_of_filtered_code_only_is_the_empty_snapshot():
    """A thread that runs only filtered code (its own functions live in monstack's
    directory here, as the user's code excluded by the policy would): the native path
    answers the empty snapshot, linked to the current origin, as the Python path does,
    instead of declining."""
    import threading

    from monstack._snapshot import CURRENT_ORIGIN, Snapshot

    with tracking(True):
        cb = _registered()
        ns = {"snap_new": _accel.snapshot_new(cb, monstack.snapshot), "seed": monstack.snapshot}
        exec(compile(_COLLECT_SRC, os.path.join(os.path.dirname(_install.__file__), "_test_accel_collect.py"), "exec"), ns)
        origin = monstack.snapshot()
        runs = []
        for with_origin in (False, True):
            ctx = contextvars.copy_context()
            if with_origin:
                ctx.run(CURRENT_ORIGIN.set, origin)
            out: list = []
            # the thread's stack: threading's frames, ctx.run (C), collect: filtered code only
            thread = threading.Thread(target=ctx.run, args=(ns["collect"], out, 4))
            thread.start()
            thread.join()
            runs.append(out)
    plain, linked = runs
    for s in plain:
        assert type(s) is Snapshot and tuple.__getitem__(s, slice(0, 5)) == (None, -1, None, None, 0)
        assert not gc.is_tracked(s)  # built natively
    for s in linked:
        assert type(s) is Snapshot and tuple.__getitem__(s, slice(0, 5)) == (None, -1, origin, None, 1)


@needs_native
def test_native_snapshot_paths_equal_the_python_snapshot():
    from monstack._snapshot import CURRENT_ORIGIN, Snapshot

    with tracking(True):
        via_fast, via_new = _snap_helpers()

        def user(n):
            if n:
                return user(n - 1)
            r = via_fast(); s = via_new(); p = monstack.snapshot()  # noqa: E702 (one line: same lasti)
            return r, s, p

        r, s, p = user(5)
        assert r is not None and s is not None
        assert type(s) is Snapshot
        # same node; the offsets differ only by the position on the line
        raw_s = [tuple.__getitem__(s, i) for i in range(5)]
        raw_p = [tuple.__getitem__(p, i) for i in range(5)]
        assert r[0] is p._node and raw_s[0] is p._node and raw_s[2:] == raw_p[2:]
        assert shadow_records(s) == shadow_records(p)
        def line(off):
            return next(ln for start, end, ln in user.__code__.co_lines() if start <= off < end)

        assert line(r[1]) == line(raw_s[1]) == line(p._lasti)
        # an origin set: the native path links to it as Snapshot._new does
        token = CURRENT_ORIGIN.set(p)
        try:
            linked, py_linked = via_new(), Snapshot._new(p._node, p._lasti, p)
        finally:
            CURRENT_ORIGIN.reset(token)
        assert type(linked) is Snapshot and not gc.is_tracked(linked)  # built natively
        assert tuple.__getitem__(linked, slice(2, 5)) == tuple.__getitem__(py_linked, slice(2, 5)) == (p, None, 1)
        assert linked.origin is p
        assert shadow_records(linked)[-1][2] == "test_native_snapshot_paths_equal_the_python_snapshot"
        # called through C (map): the lambda's push skipped the C-stack entry frame and
        # recorded its caller's site, so the native paths answer -- with the real stack
        [(r, s, p, real)] = list(map(lambda _: (via_fast(), via_new(), monstack.snapshot(), real_records()), [0]))
        assert r is not None and s is not None
        assert shadow_records(s) == shadow_records(p) == real


def _chain_shapes(native, limit, n):
    """(hops, dropped, shown origins, innermost function) of n snapshots, each taken
    under the previous one as origin, with chain_limit=limit."""
    from monstack._snapshot import CURRENT_ORIGIN

    out = []
    with tracking(native, chain_limit=limit):
        cap = monstack.snapshotter()

        def take():
            return cap()

        s = None
        for _ in range(n):
            token = CURRENT_ORIGIN.set(s)
            try:
                s = take()
            finally:
                CURRENT_ORIGIN.reset(token)
            shown, dropped = s.chain()
            out.append((s._hops, s._dropped, len(shown), dropped, s.records()[-1][2], gc.is_tracked(s)))
    return out


@needs_native
@pytest.mark.parametrize("limit", [1, 2, 8])
def test_native_origin_links_and_shortens_like_python(limit):
    """Snapshots under an origin (every thread, pool job and task started after install
    has one) are built natively too; a chain due to be shortened takes the Python path,
    which makes the shortened copy. Same hops, drops and chains as the Python callbacks."""
    native = _chain_shapes(True, limit, 5 * limit + 3)
    python = _chain_shapes(False, limit, 5 * limit + 3)
    assert [x[:5] for x in native] == [x[:5] for x in python]
    assert max(x[0] for x in native) < 2 * limit  # physically capped
    assert all(x[4] == "take" for x in native)
    # built natively (untracked at birth) but for the shortening ones (Python's); with
    # chain_limit=1 every link shortens
    if limit > 1:
        assert sum(not x[5] for x in native) >= len(native) // 2
    assert all(x[5] for x in python)


@needs_native
def test_native_origin_path_declines_a_broken_shorten_cell():
    """The native code re-checks the private one-item list it reads the limit from."""
    from monstack import _snapshot
    from monstack._snapshot import CURRENT_ORIGIN

    with tracking(True):
        cap = monstack.snapshotter()
        origin = cap()
        saved = list(_snapshot._SHORTEN_CELL)
        token = CURRENT_ORIGIN.set(origin)
        try:
            _snapshot._SHORTEN_CELL.clear()
            s = cap()  # the Python path
            _snapshot._SHORTEN_CELL[:] = saved
            t = cap()  # native again
        finally:
            _snapshot._SHORTEN_CELL[:] = saved
            CURRENT_ORIGIN.reset(token)
        assert s.origin is origin and gc.is_tracked(s)
        assert t.origin is origin and not gc.is_tracked(t)


@needs_native
def test_native_snapshot_in_a_started_thread():
    """A thread started after install runs with an origin: its snapshots take the native
    path (they used to fall back to Python: ~10x slower) and carry the starter's origin."""
    with tracking(True, propagate=True):
        cap = monstack.snapshotter()
        out = []

        def worker():
            cap()  # (the first fills in the thread's bottom node: the Python path)
            out.append(cap())

        def starter():
            t = threading.Thread(target=worker)
            t.start()
            t.join()

        starter()
        (snap,) = out
        assert not gc.is_tracked(snap)  # the native path
        assert shadow_records(snap)[-1][2] == "worker"
        assert snap.origin is not None and [r[2] for r in snap.origin.records()][-1] == "starter"
        assert snap._hops == 1


_DEEP_LIB = """
def down(n, fn):
    if n:
        return down(n - 1, fn)
    return fn()

def call(fn):
    return fn()
"""


def _filtered_lib(tmp_path, name):
    """A module in tmp_path (to be excluded from tracking): ``down(n, fn)`` calls ``fn``
    n + 1 frames down, ``call(fn)`` one frame down."""
    return library_module(tmp_path, name, _DEEP_LIB)


@needs_native
def test_native_snapshot_declines_unknown_call_sites(tmp_path):
    lib = _filtered_lib(tmp_path, "deep_filtered_lib")
    with tracking(True, exclude=[str(tmp_path)]):
        via_fast, via_new = _snap_helpers()
        lib["down"](0, lambda: None)  # the library gets decided (filtered)

        def callback():
            return via_fast(), via_new(), monstack.snapshot(), real_records()  # one line

        # more known-filtered frames between the callback and its tracked caller than
        # a push looks through: its call site is left unknown, the native paths decline,
        # snapshot() fills it from the real frames
        # (the native code looks through at most 16: MS_FAST_FILTERED_HOPS)
        r, s, p, real = lib["down"](20, callback)
        assert (r, s) == (None, None)
        assert shadow_records(p) == real
        # a shallow library: the push records the site, the native paths answer
        r, s, p, real = lib["down"](3, callback)
        assert r is not None and s is not None
        assert shadow_records(s) == shadow_records(p) == real


class _CallThroughC:
    """Calling an instance goes through C (slot_tp_call): a C-stack entry frame sits
    between __call__ and its caller."""

    def __call__(self):
        return _top_and_real()


def _top_and_real():
    return _stack.TLS.cell[0], monstack.snapshot(), real_records(sys._getframe())  # one line


@needs_native
def test_push_records_call_sites_through_c_and_filtered_frames(tmp_path):
    """A push records its caller's call site when the caller is reached past C-stack
    entry frames (tp_call, map, sorted keys...) or known-filtered library frames, so
    snapshots there take the native fast path; the sites equal the real stack's."""
    lib = _filtered_lib(tmp_path, "callback_lib")
    through_c = _CallThroughC()
    with tracking(True, exclude=[str(tmp_path)]):
        lib["call"](lambda: None)  # decided (filtered) on its first events

        def user(i):
            return [
                through_c(),
                list(map(lambda _: _top_and_real(), [i]))[0],
                lib["call"](_top_and_real),
                lib["down"](5, _top_and_real),
            ]

        user(0)
        before = native_counters()
        for i in range(20):
            for top, snap, real in user(i):
                # _top_and_real's node and its caller's (entered through C or a library)
                assert top[2] != _stack.UNKNOWN and top[1][2] != _stack.UNKNOWN
                assert shadow_records(snap) == real
        after = native_counters()
    assert after["push_unknown"] == before["push_unknown"]
    assert after["push_known"] - before["push_known"] >= 20 * 6


@needs_native
def test_native_snapshots_and_nodes_are_not_gc_tracked():
    """Snapshots from the native path and natively pushed nodes hold only nodes, ints
    and None -- never part of a cycle -- so the collector does not traverse them."""
    with tracking(True):
        via_fast, via_new = _snap_helpers()

        def user():
            return via_new()

        snap = user()
        assert snap is not None and shadow_records(snap)[-1][2] == "user"
        assert not gc.is_tracked(snap)
        assert not gc.is_tracked(snap._node)
        # a Snapshot-like class that can take part in a cycle (instances have a __dict__)
        # stays tracked
        class Weak(tuple):
            @classmethod
            def _new(cls, node, lasti, origin=None):
                meta = 0 if origin is None else tuple.__getitem__(origin, 4) + 1
                return tuple.__new__(cls, (node, lasti, origin, None, meta))

        from monstack._snapshot import CURRENT_ORIGIN

        weak_new = _accel.snapshot_new(_registered(), monstack.snapshot, Weak, CURRENT_ORIGIN)
        ns = {"snap_new": weak_new}
        exec(compile("def via():\n    return snap_new()\n",
                     os.path.join(os.path.dirname(_install.__file__), "_test_accel_weak.py"), "exec"), ns)

        def user2():
            return ns["via"]()

        w = user2()
        assert type(w) is Weak and gc.is_tracked(w)
        w.me = w  # the cycle the collector must still be able to see


def _tp_free(cls, slot="tp_free"):
    import ctypes

    return ctypes.c_void_p.from_address(id(cls) + _accel._layout(_accel._blob)[slot]).value


@needs_native
def test_native_snapshots_do_not_count_as_gc_allocations():
    """Natively built snapshots are never tracked, so they must not count towards the
    young generation's threshold either: on 3.12 they multiplied the collections of a
    framework keeping ops in flight (each collection traversing all of them)."""
    from monstack._snapshot import CURRENT_ORIGIN, Snapshot

    with tracking(True):
        cap = monstack.snapshotter()
        _via_fast, via_new = _snap_helpers()

        def user(n):
            return [cap() for _ in range(n)] + [via_new() for _ in range(n)]

        user(10)
        was = gc.isenabled()
        gc.disable()
        try:
            before = gc.get_count()[0]
            snaps = user(1000)
            grew = gc.get_count()[0] - before
        finally:
            if was:
                gc.enable()
        assert all(type(s) is Snapshot and not gc.is_tracked(s) for s in snaps)
        assert shadow_records(snaps[0])[-1][2] == "user"  # (3.12+: comprehensions are inlined)
        assert grew < 100, grew  # 2000 snapshots; counted, the count would grow by 2000+
        # the class's deallocation is now the native code's, for snapshots from Python
        # and native ones alike, installed or not; Python's are still counted, and so
        # uncounted when freed: created and freed, they leave the count where it was
        plain = tuple.__class__("Plain", (tuple,), {"__slots__": ()})
        assert _tp_free(Snapshot, "tp_dealloc") != _tp_free(plain, "tp_dealloc")
        assert _tp_free(Snapshot) == _tp_free(plain)
        gc.disable()
        try:
            before = gc.get_count()[0]
            for _ in range(1000):
                s = Snapshot._new(None, -1, None)  # the Python path's allocation
                assert gc.is_tracked(s)
                del s
            python_grew = gc.get_count()[0] - before
        finally:
            if was:
                gc.enable()
        assert abs(python_grew) < 50, python_grew
        # and freeing native ones does not uncount what other objects counted (else the
        # cyclic garbage of a program taking many snapshots would never be collected)
        gc.disable()
        try:
            natives = user(500)
            before = gc.get_count()[0]
            counted = [[] for _ in range(300)]
            del natives
            after = gc.get_count()[0]
        finally:
            if was:
                gc.enable()
        assert after - before >= 150, (before, after)  # 301 counted; 1000 uncounted would zero it
        del counted
        token = CURRENT_ORIGIN.set(cap())
        try:
            linked = [cap() for _ in range(100)]
        finally:
            CURRENT_ORIGIN.reset(token)
        assert all(s.origin is not None for s in linked)
    del snaps
    gc.collect()
    base = sys.getallocatedblocks()
    for _ in range(3):
        with tracking(True):
            cap = monstack.snapshotter()
            token = CURRENT_ORIGIN.set(cap())
            try:
                held = [cap() for _ in range(2000)]
            finally:
                CURRENT_ORIGIN.reset(token)
            held += [cap() for _ in range(2000)]
        del held, cap, token  # the last ones freed after uninstall
        gc.collect()
    assert sys.getallocatedblocks() - base < 1000


@needs_native
def test_offsets_past_the_small_ints_are_shared_not_allocated():
    """A snapshot's offset and a node's call site past 256 (not CPython's cached small
    ints) come from the state's int cache: two snapshots from one site share the int."""
    body = "".join(f"    x{i} = n + {i}\n" for i in range(100))
    src = ("def callee(cap):\n    return cap()\n\n"
           "def site(n, cap):\n" + body + "    a = cap()\n    b = cap()\n    c = callee(cap)\n"
           "    d = callee(cap)\n    return a, b, c, d\n")
    with tracking(True):
        cap = monstack.snapshotter()
        ns: dict = {}
        exec(compile(src, "/monstack-test/accel_offsets.py", "exec"), ns)
        ns["site"](1, cap)
        a, b, c, d = ns["site"](1, cap)
        assert 256 < a._lasti < b._lasti < 2048  # (past the small ints, within the cache)
        first, second = ns["site"](1, cap)[:2]
        assert first._lasti == a._lasti and first._lasti is a._lasti
        assert second._lasti is b._lasti
        # the call site callee's node records, past 256 too
        assert c._node[2] > 256 and c._node[2] is ns["site"](1, cap)[2]._node[2]
        assert [r[2] for r in shadow_records(c)][-2:] == ["site", "callee"]
        assert shadow_records(a)[-1][1] == 105 and shadow_records(c)[-2][1] == 107
        assert a.records()[-1][1] == 105 and b.records()[-1][1] == 106


@needs_native
def test_snapshot_memory_adopted_only_for_plain_tuple_classes():
    """A class whose instances may join a cycle keeps CPython's allocation (tracked);
    a subclass of Snapshot keeps CPython's tp_free."""
    from monstack._snapshot import CURRENT_ORIGIN, Snapshot

    class Weak(tuple):
        @classmethod
        def _new(cls, node, lasti, origin=None):
            meta = 0 if origin is None else tuple.__getitem__(origin, 4) + 1
            return tuple.__new__(cls, (node, lasti, origin, None, meta))

    class Sub(Snapshot):
        __slots__ = ()

    plain = tuple.__class__("Plain", (tuple,), {"__slots__": ()})
    gc_del, subtype_dealloc = _tp_free(plain), _tp_free(plain, "tp_dealloc")
    with tracking(True):
        assert _tp_free(Snapshot) == gc_del and _tp_free(Snapshot, "tp_dealloc") != subtype_dealloc
        origin = monstack.snapshotter()()
        assert type(origin) is Snapshot
        base = sys.getrefcount(origin)  # (3.14+ counts one less: the argument is borrowed)
        # subclass instances: subtype_dealloc, then the adopted base dealloc, which
        # releases their items (an origin, records) and frees them with their tp_free
        s = tuple.__new__(Sub, (None, -1, origin, None, 1))
        rec = ("f", 1, "g", None, None, None)
        t = tuple.__new__(Sub, (None, -1, tuple.__new__(Sub, (None, -1, None, (rec,), 0)), None, 1))
        assert sys.getrefcount(origin) == base + 1 and s.origin is origin and t.origin.records() == (rec,)
        del s, t
        assert sys.getrefcount(origin) == base
        assert _accel.snapshot_new(_registered(), monstack.snapshot, Weak, CURRENT_ORIGIN) is not None
        assert (_tp_free(Weak), _tp_free(Weak, "tp_dealloc")) == (gc_del, subtype_dealloc)
        assert (_tp_free(Sub), _tp_free(Sub, "tp_dealloc")) == (gc_del, subtype_dealloc)


@needs_native
def test_adopted_dealloc_runs_a_finalizer_added_later_and_allows_class_assignment():
    from monstack._snapshot import Snapshot

    class Sub(Snapshot):
        __slots__ = ()

    calls = []
    with tracking(True):
        cap = monstack.snapshotter()

        def take():  # (the native code keeps the last snapshot until its frame returns)
            return cap()

        Snapshot.__del__ = lambda self: calls.append(self._hops)
        try:
            s = take()
            assert not gc.is_tracked(s)  # natively built
            del s
            t = Snapshot._new(None, -1, None)
            del t
        finally:
            del Snapshot.__del__
        assert calls == [0, 0]
        s = take()
        s.__class__ = Sub  # same allocator and deallocator family: allowed, as in CPython
        s.__class__ = Snapshot
        del s
        assert calls == [0, 0]


@needs_native
def test_the_same_snapshot_again_is_the_same_object():
    with tracking(True):
        assert_one_site_one_snapshot(monstack.snapshotter())

        def twice():  # the monstack.snapshot() path too
            return [monstack.snapshot() for _ in range(2)]

        x, y = twice()
        assert x is y


@needs_native
def test_a_finalizer_run_by_letting_go_of_the_kept_snapshot_may_uninstall():
    from monstack._snapshot import Snapshot

    ran = []

    def finalizer(self):
        ran.append(1)
        monstack.uninstall()  # frees the native state, while its callback returns

    with tracking(True):
        cap = monstack.snapshotter()

        def take():
            cap()  # kept, and held by nothing else when take() returns

        take()  # (warm: the first call of a function decides its file)
        Snapshot.__del__ = finalizer
        try:
            take()
        finally:
            del Snapshot.__del__
        assert ran == [1] and _capture.running() is None


@needs_native
def test_the_kept_snapshot_is_let_go_when_its_frame_returns_or_at_uninstall():
    from monstack._snapshot import Snapshot

    freed = []
    with tracking(True):
        cap = monstack.snapshotter()

        def take():
            return cap()

        Snapshot.__del__ = lambda self: freed.append(1)
        try:
            s = take()
            del s  # take() returned: nothing keeps it
            assert freed == [1]
            s = cap()  # this frame still runs: kept for the next snapshot here
            del s
            assert freed == [1]
            monstack.uninstall()  # (retire) lets go of it
            assert freed == [1, 1]
        finally:
            del Snapshot.__del__


def test_long_origin_chains_are_freed_without_recursion():
    """The adopted dealloc unrolls a snapshot's origin chain (subtype_dealloc's trashcan
    no longer guards it): a 300,000-hop chain (chain_limit raised) is freed, in a child
    process, without exhausting the C stack."""
    code = (
        "import monstack\n"
        "from monstack._snapshot import CURRENT_ORIGIN\n"
        "monstack.install(chain_limit=10**6)\n"
        "cap = monstack.snapshotter()\n"
        "s = None\n"
        "for _ in range(300_000):\n"
        "    t = CURRENT_ORIGIN.set(s); s = cap(); CURRENT_ORIGIN.reset(t)\n"
        "print(s._hops, s.records()[-1][2])\n"
        "del s\n"
        "print('freed')\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.split() == ["299999", "<module>", "freed"]


@pytest.mark.parametrize("key, message", [("sizeof_PyGC_Head", "PyGC_Head"), ("op_YIELD_VALUE", "YIELD_VALUE"),
                                          ("op_RESUME", "RESUME"), ("tp_del", "tp_del")])
def test_gc_head_opcode_and_slot_mismatches_are_refused(monkeypatch, key, message):
    if not OK:
        pytest.skip(f"native callbacks unavailable: {WHY}")
    blob = _accel._blob
    real = _accel._layout

    def wrong(b):
        lay = dict(real(b))
        lay[key] += 8
        return lay

    monkeypatch.setattr(_accel, "_layout", wrong)
    with pytest.raises(_native.NativeUnavailable, match=message):
        _accel._verify_layout(blob)


@needs_native
def test_probe_agrees_in_other_threads():
    out: list = []
    t = threading.Thread(target=lambda: out.append(_accel._verify_runtime(_accel._fns["probe"])))
    t.start()
    t.join()
    assert out == [None]


@needs_native
def test_identical_with_track_all_threads_first_frame_tracked():
    """track='all': a new thread's very first frame (threading's bootstrap) is tracked,
    so seeding happens at a frame with no caller at all."""
    py, nat = run_both(s_threads, track="all")
    assert_same(py, nat)
    with tracking(True, track="all"):
        s_threads()
        assert monstack.active_backend() == "monitoring"
        assert native_counters()["errors"] == 0


@needs_native
def test_native_snapshot_looks_through_filtered_callers(tmp_path, monkeypatch):
    """A framework (filtered) taking the snapshot for its user: the native fast path
    answers without the Python capture, with the user's frames and lines."""
    ns = library_module(tmp_path, "fw_for_native_snapshot")
    monstack.install(exclude=[str(tmp_path)], accelerator=True)
    backend = _capture._state.backend
    assert backend.snapshot_native is not None
    # answered natively: the Python capture never ran
    assert captures_for_library_snapshots(ns["op"], backend, monkeypatch) == 0


# --------------------------------------------------------------------------- direct calls, node reuse
def _vectorcall_of(fn):
    import ctypes

    return ctypes.c_void_p.from_address(id(fn) + _accel._layout(_accel._blob)["cfunc_vectorcall"]).value


@needs_native
def test_event_dispatch_calls_the_callbacks_directly():
    """CPython's event dispatch reaches the blob's vectorcall entries (ms_vc_*), not
    cfunction_vectorcall_FASTCALL; calls through ml_meth still work."""
    assert _accel.direct_calls_refused == "", _accel.direct_calls_refused
    mon = sys.monitoring
    with tracking(True, track="all"):
        assert _capture._state.backend.describe()["native calls"] == "direct (vectorcall)"  # `info`
        blob = _accel._blob
        for event, symbol in ((mon.events.PY_START, "ms_vc_start"), (mon.events.PY_RESUME, "ms_vc_start"),
                              (mon.events.PY_RETURN, "ms_vc_return"), (mon.events.PY_YIELD, "ms_vc_yield"),
                              (mon.events.PY_UNWIND, "ms_vc_unwind")):
            assert _vectorcall_of(_registered(event)) == blob.addr(symbol), symbol
        before = native_counters()
        loop(1000)
        after = native_counters()
        assert after["events"] - before["events"] >= 2000  # leaf's start and return
        on_start = _registered()
        with pytest.raises(TypeError, match="keyword"):
            on_start(leaf.__code__, 0, extra=1)  # the vectorcall entry refuses keywords
        assert native_counters()["errors"] == 0


@needs_native
def test_direct_calls_refused_keeps_the_native_callbacks(monkeypatch):
    monkeypatch.setattr(_accel, "_vectorcall_field", _accel._vectorcall_field)
    monkeypatch.setattr(_accel, "direct_calls_refused", _accel.direct_calls_refused)
    real = _accel._layout

    def wrong(b):
        lay = dict(real(b))
        lay["cfunc_vectorcall"] += 8
        return lay

    monkeypatch.setattr(_accel, "_layout", wrong)
    _accel._verify_direct_calls(_accel._blob)
    assert _accel._vectorcall_field is None
    assert "vectorcall" in _accel.direct_calls_refused
    with tracking(True, track="all"):
        cb = _registered()
        assert _vectorcall_of(cb) != _accel._blob.addr("ms_vc_start")
        assert _capture._state.backend.describe()["native calls"].startswith("through cfunction_vectorcall (")
        OUT.clear()
        loop(3)
        outer_mark()
        [(_, shadow, _, real_)] = OUT
        assert shadow == real_
    OUT.clear()


def outer_mark():
    return inner_mark()


def inner_mark():
    mark()


@needs_native
def test_popped_nodes_are_reused_only_when_nothing_else_holds_them():
    """A node popped with no other reference is kept for the next push; one a snapshot
    holds never is (else the snapshot's frames would change under it)."""
    kept = []

    def leaf_snap(i):
        snap, real = monstack.snapshot(), real_records(sys._getframe())  # one line: same lineno
        kept.append((snap, real))

    def mid(i):
        leaf_snap(i)
        loop(3)  # pushes that would take a snapshot's node if it were spare

    with tracking(True, track="all"):
        before = native_counters()
        for i in range(20):
            mid(i)
            loop(5)
        after = native_counters()
    assert after["reused"] - before["reused"] >= 20 * 8  # loop's and leaf's nodes come back
    assert after["errors"] == 0
    for snap, real in kept:
        assert shadow_records(snap) == real
        names = [name.rsplit(".", 1)[-1] for name, _ in chain(snap)]
        assert names[:2] == ["leaf_snap", "mid"]


_SUBINTERPRETER_CODE = """
import json, sys, warnings
sys.path.insert(0, ROOT)
warnings.simplefilter("error")  # a MonstackWarning fails the run
import monstack
monstack.install(propagate=False)
def f():
    return monstack.snapshot()
snap = f()
status = monstack.status()
with open(OUT, "w") as fh:
    json.dump([status["backend"], status.get("accelerator"), [r[2] for r in snap.records()]], fh)
"""

_SUBINTERPRETER = """
import sys
try:
    import _interpreters as interpreters  # 3.13+
except ImportError:
    import _xxsubinterpreters as interpreters  # 3.12
interp = interpreters.create()
interpreters.run_string(interp, CODE)
interpreters.destroy(interp)
"""


def test_a_subinterpreter_without_ctypes_runs_the_pure_python_callbacks(tmp_path):
    """An isolated subinterpreter (its own GIL) of 3.12 cannot import ``_ctypes``: the
    default accelerator falls back to the pure-Python callbacks there, with no warning;
    where ``_ctypes`` loads (3.13+) the native callbacks run in it as in the main one."""
    out = tmp_path / "status.json"
    code = f"ROOT = {ROOT!r}\nOUT = {str(out)!r}\n" + _SUBINTERPRETER_CODE
    src = f"CODE = {code!r}\n" + _SUBINTERPRETER
    done = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0 and "MonstackWarning" not in done.stderr, done.stderr
    backend, accelerator, names = json.loads(out.read_text())
    assert backend == "monitoring"
    assert names[-1] == "f"
    if os.environ.get("MONSTACK_ACCELERATOR") == "0":
        assert accelerator == "none (turned off (MONSTACK_ACCELERATOR=0))"
    elif sys.version_info[:2] == (3, 12):
        assert accelerator.startswith("none (ctypes cannot be imported here"), accelerator
    elif _accel.unavailable() is None:
        assert accelerator == "native"
