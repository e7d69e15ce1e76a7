"""The CPython 3.11 ``evalframe`` backend: refusals, loading the shim, and the shim's pitfalls.

The loader itself, the stored code and its build: test_native.py.

The shadow-stack correctness cases of the core (test_stack.py, test_oracle.py...) run
with this backend automatically on 3.11; this file covers what is specific to it.
Risky cases (C stack exhaustion, foreign eval_frame functions) run in subprocesses.
"""

from __future__ import annotations

import contextvars
import ctypes
import errno
import gc
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest
from stackcheck import (Mismatch, assert_one_site_one_snapshot, check, library_module, real_records, shadow_records,
                        snapshots_at_one_site)

import monstack
from monstack import _capture, _env, _native, _select, _stack

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IS_311 = _env.CPYTHON and sys.version_info[:2] == (3, 11)

pytestmark = pytest.mark.skipif(not IS_311, reason="the eval_frame shim is for CPython 3.11 only")

if IS_311:
    from monstack import _evalframe
    from monstack._evalframe import EvalFrameBackend
else:  # pragma: no cover - collected but skipped
    _evalframe = None  # type: ignore[assignment]


def _available() -> bool:
    return IS_311 and EvalFrameBackend.unavailable() is None


needs_shim = pytest.mark.skipif(not _available(), reason="the shim cannot run here")


def run_py(code: str, *args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = ROOT + os.pathsep + os.path.join(ROOT, "tests") + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.pop("MONSTACK_BACKEND", None)
    if env:
        full_env.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env)


def counters() -> dict:
    state = _capture._state
    assert state is not None and state.backend.name == "evalframe"
    return state.backend.counters()


def arch_info() -> dict:
    """The shim's manifest entry for this machine, its layout's keys at top level (as
    ``_evalframe._Native.arch``)."""
    info = _native.read_manifest(_evalframe.BLOB)["arches"][_env.MACHINE]
    return dict(info, **info["layout"])


# ---------------------------------------------------------------------------------------
# chosen automatically, shown by info
# ---------------------------------------------------------------------------------------


@needs_shim
def test_auto_chooses_evalframe_and_installs_the_shim():
    assert monstack.install() == "evalframe"
    assert monstack.active_backend() == "evalframe"
    nat = _evalframe._native
    assert _evalframe._current_eval(nat) == nat.entry
    status = monstack.status()
    assert "native shim at" in status["eval_frame"]
    assert isinstance(status["shim counters"]["push"], int)
    monstack.uninstall()
    assert _evalframe._current_eval(nat) == nat.default


@needs_shim
def test_info_command_shows_the_backend():
    out = run_py("import runpy, sys; sys.argv=['monstack', 'info']; runpy.run_module('monstack', run_name='__main__')")
    assert out.returncode == 0, out.stderr
    assert "evalframe" in out.stdout


# ---------------------------------------------------------------------------------------
# refusals (each gives a reason; auto falls back to walk)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "facts, expected",
    [({"VERSION_TEXT": "3.11.3", "EVALFRAME_SEES_GETITEM": False}, "3.11.3 does not call eval_frame for __getitem__ frames (gh-104405"),
     ({"VERSION_TEXT": "3.12.1", "EVALFRAME_FOR_VERSION": False}, "for CPython 3.11 (this is 3.12.1)"),
     ({"VERSION_TEXT": "3.10.13", "EVALFRAME_FOR_VERSION": False}, "for CPython 3.11 (this is 3.10.13)")],
)
def test_refuses_other_versions(monkeypatch, facts, expected):
    # the 3.11 that gh-104405 affects (3.11.0-3.11.3), or another version
    monkeypatch.setattr(_env, "EVALFRAME_FOR_VERSION", True)
    monkeypatch.setattr(_env, "EVALFRAME_SEES_GETITEM", True)
    for name, value in facts.items():
        monkeypatch.setattr(_env, name, value)
    reason = EvalFrameBackend.unavailable()
    assert reason is not None and expected in reason
    cls, why = _select.choose("auto")
    assert cls.name == "walk" and expected in why


def test_refuses_an_architecture_without_code(monkeypatch):
    monkeypatch.setattr(_env, "MACHINE", "riscv64")
    reason = _evalframe._load_into(_evalframe._Native())
    assert reason is not None and "no evalframe311 code for riscv64" in reason


def test_refuses_when_the_os_refuses_executable_memory(monkeypatch):
    monkeypatch.setattr(_native, "_mprotect", lambda addr, size, prot: errno.EACCES)
    reason = _evalframe._load_into(_evalframe._Native())
    assert reason is not None and "refused executable memory" in reason


def test_install_falls_back_to_walk_with_the_reason(monkeypatch):
    nat = _evalframe._Native()
    nat.reason = "the OS refused executable memory (mprotect: Permission denied)"
    monkeypatch.setattr(_evalframe, "_native", nat)
    assert monstack.install() == "walk"
    assert "refused executable memory" in monstack.status()["reason"]
    monstack.uninstall()
    with pytest.raises(RuntimeError, match="refused executable memory"):
        monstack.install(backend="evalframe")


def test_refuses_a_corrupted_blob(tmp_path, monkeypatch):
    for name in os.listdir(_native.NATIVE_DIR):
        if name != "__pycache__":
            shutil.copy(os.path.join(_native.NATIVE_DIR, name), tmp_path / name)
    blob = tmp_path / arch_info()["blob"]
    data = bytearray(blob.read_bytes())
    data[10] ^= 0xFF
    blob.write_bytes(bytes(data))
    monkeypatch.setattr(_native, "NATIVE_DIR", str(tmp_path))
    reason = _evalframe._load_into(_evalframe._Native())
    assert reason is not None and "checksum" in reason


def test_probe_accepts_the_real_offsets():
    assert _evalframe._probe_interp_offsets(arch_info()["interp_offsets"]) == []


def test_every_wrong_offset_is_detected():
    """Each struct offset the shim relies on, shifted, must make the probe refuse."""
    code = """
        import ctypes, sys
        from monstack import _evalframe, _env, _native
        off = _native.read_manifest("evalframe311")["arches"][_env.MACHINE]["layout"]["interp_offsets"]
        idx = _native.api_function("_PyEval_RequestCodeExtraIndex", ctypes.c_ssize_t, ctypes.c_void_p)(None)
        assert _evalframe._probe_code_extra(off, idx) == []
        missed = []
        for name in sorted(off):
            if name == "interp_eval_frame":
                continue  # checked at load and install time (see test below)
            bad = dict(off)
            bad[name] = off[name] + (1 if name in ("owner_generator", "if_owner", "sizeof_codeunit") else 8)
            if not (_evalframe._probe_interp_offsets(bad) + _evalframe._probe_code_extra(bad, idx)):
                missed.append(name)
        print("MISSED", missed)
    """
    out = run_py(code)
    assert out.returncode == 0, out.stderr
    assert "MISSED []" in out.stdout, out.stdout


# ---------------------------------------------------------------------------------------
# the loaded shim (the stored code and its build: test_native.py)
# ---------------------------------------------------------------------------------------


def test_manifest_has_what_the_shim_needs():
    info = arch_info()
    assert set(info["table"]) >= {"f:_PyEval_EvalFrameDefault", "f:PyTuple_New", "f:_Py_Dealloc"}
    assert info["data"]["offset"] % 65536 == 0 and info["symbols"]["DATA"] == info["data"]["offset"]
    assert info["data"]["size"] > info["records"]["offset"] + info["records"]["size"]
    assert "ms_eval_frame" in info["symbols"]
    assert {"fields", "counters", "records", "magic_offset", "interp_offsets"} <= set(info)


@needs_shim
def test_code_pages_are_never_writable_and_executable():
    monstack.install()
    blob = _evalframe._native.blob
    maps = _maps()
    perms = {}
    for line in maps:
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo < blob.base + blob.map_size and hi > blob.base:
            perms[lo] = line.split()[1]
    assert perms[blob.base].startswith("r-x"), perms
    assert any(p.startswith("rw-") for p in perms.values()), perms
    assert not any("w" in p and "x" in p for p in perms.values()), perms
    monstack.uninstall()
    # never unmapped
    assert any(line.startswith(f"{blob.base:x}-") for line in _maps())


def _maps() -> list:
    with open("/proc/self/maps") as fh:
        return fh.read().splitlines()


# ---------------------------------------------------------------------------------------
# other PEP 523 users
# ---------------------------------------------------------------------------------------

FOREIGN = """
    import ctypes
    from monstack import _evalframe, _native
    # A "foreign" eval_frame: a second, inert copy of our own shim (it passes every
    # frame to _PyEval_EvalFrameDefault), installed the way another tool would.
    nat = _evalframe._load()
    assert nat.reason is None, nat.reason
    other = _native.load_copy(_evalframe.BLOB)
    other.put_ptr(nat.arch["fields"]["interp"], nat.interp)
    FOREIGN = other.addr("ms_eval_frame")
    def set_foreign():
        _evalframe._set_eval(nat, FOREIGN)
    def reset():
        _evalframe._set_eval(nat, nat.default)
"""


@needs_shim
def test_refuses_to_install_over_a_foreign_eval_frame():
    code = FOREIGN + """
    import monstack
    set_foreign()
    reason = _evalframe.EvalFrameBackend.unavailable()
    print("REASON", reason)
    print("BACKEND", monstack.install())
    print("KEPT", _evalframe._current_eval(nat) == FOREIGN)
    monstack.uninstall()
    print("STILL", _evalframe._current_eval(nat) == FOREIGN)
    reset()
    print("AFTER", monstack.install())
    """
    out = run_py(code)
    assert out.returncode == 0, out.stderr
    assert "REASON another eval_frame function is installed" in out.stdout
    assert "BACKEND walk" in out.stdout and "KEPT True" in out.stdout and "STILL True" in out.stdout
    assert "AFTER evalframe" in out.stdout


@needs_shim
def test_foreign_eval_frame_replacing_ours_is_detected_with_one_warning():
    code = FOREIGN + """
    import sys, warnings
    import monstack
    from stackcheck import check
    warnings.simplefilter("always")
    assert monstack.install() == "evalframe"
    def a():
        return b()
    def b():
        return check("after replacement")
    a()
    set_foreign()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            a()          # still correct: snapshots walk the real frames
    print("WARNINGS", len([w for w in rec if issubclass(w.category, monstack.MonstackWarning)]))
    print("MESSAGE", rec[0].message if rec else None)
    print("INFO", monstack.status()["eval_frame"])
    monstack.uninstall()
    print("LEFT_ALONE", _evalframe._current_eval(nat) == FOREIGN)
    reset()
    """
    out = run_py(code)
    assert out.returncode == 0, out.stderr
    assert "WARNINGS 1" in out.stdout, out.stdout
    assert "replaced monstack's eval_frame" in out.stdout
    assert "REPLACED by another function" in out.stdout
    assert "LEFT_ALONE True" in out.stdout


# ---------------------------------------------------------------------------------------
# the pitfalls
# ---------------------------------------------------------------------------------------


@needs_shim
def test_throw_into_a_delegating_yield_from_chain_resyncs(installed):
    assert installed == "evalframe"
    seen = []

    def leaf():
        try:
            yield "a"
        except KeyError:
            seen.append(check("leaf handler"))
            yield "handled"

    def middle():
        return (yield from leaf())

    def outer():
        yield from middle()

    g = outer()
    assert next(g) == "a"
    before = counters()
    assert g.throw(KeyError("k")) == "handled"
    after = counters()
    assert seen and seen[0] == len(real_records()) + 4  # outer, middle, leaf, check
    # the delegating frames were linked without being evaluated: the shim noticed
    assert after["n_resync"] + after["n_verify"] > before["n_resync"] + before["n_verify"]
    check("after throw")


@needs_shim
def test_throw_into_awaiting_coroutines(installed):
    seen = []

    class Boom(Exception):
        pass

    class Step:
        def __await__(self):
            yield "step"

    async def inner():
        try:
            await Step()
        except Boom:
            seen.append(check("inner handler"))
            raise ValueError("converted")

    async def mid():
        try:
            await inner()
        except ValueError:
            seen.append(check("mid handler"))
            return "done"

    c = mid()
    assert c.send(None) == "step"
    with pytest.raises(StopIteration) as info:
        c.throw(Boom())
    assert info.value.value == "done" and len(seen) == 2
    check("after")


_THROW_LIB = """
import sys, monstack
from stackcheck import real_records

class E(Exception):
    pass

def libgen(out, mode):
    try:
        yield 1
    except E:
        out.append((monstack.snapshot(), real_records(sys._getframe())))  # one line
        if mode == "raise":
            raise KeyError("from the library")
    yield 2
    out.append((monstack.snapshot(), real_records(sys._getframe())))  # one line
    yield 3

def libdelegate(inner):
    return (yield from inner)

class Step:
    def __await__(self):
        yield "step"

async def libcoro(out):
    try:
        await Step()
    except E:
        out.append((monstack.snapshot(), real_records(sys._getframe())))  # one line
        return "done"
"""


def _throw_lib(tmp_path) -> dict:
    ns = library_module(tmp_path, "throw_lib", _THROW_LIB)
    monstack.install(exclude=[str(tmp_path)])
    out: list = []
    list(ns["libgen"](out, "yield"))  # the library's file gets decided (filtered)
    out.clear()
    return ns


@needs_shim
@pytest.mark.parametrize("chain", ["tracked", "tracked-mid", "library-mid"])
@pytest.mark.parametrize("mode", ["yield", "raise"])
def test_throw_into_filtered_code_shows_the_linked_in_tracked_frames(tmp_path, chain, mode):
    """gen.throw() into tracked generators delegating to a filtered generator: 3.11 links
    the delegating frames without evaluating them and evaluates only the filtered frame
    (throwflag set). The thrower runs the same code as the outer delegator. Snapshots
    taken in the library during the throw and on the delegator's later resume must
    equal the real stack, whether the library yields or raises."""
    ns = _throw_lib(tmp_path)
    libgen, libdelegate, E = ns["libgen"], ns["libdelegate"], ns["E"]
    out: list = []

    def mid(inner):
        return (yield from inner)

    def g(other, inner):
        if other is not None:  # the thrower
            try:
                got = other.throw(E)
            except KeyError:
                check("thrower after the library raised")
                return
            check("thrower after the throw")
            yield got
            yield next(other)  # the delegating generator's own later resume
            return
        yield from inner

    def inner_chain():
        if chain == "tracked":
            return libgen(out, mode)
        if chain == "tracked-mid":
            return mid(mid(libgen(out, mode)))
        return libdelegate(mid(libgen(out, mode)))  # tracked > library > tracked > library

    for _ in range(3):
        throws = counters()["n_throw"]
        delegator = g(None, inner_chain())
        assert next(delegator) == 1
        got = list(g(delegator, None))
        assert got == ([] if mode == "raise" else [2, 3])
        assert len(out) == (1 if mode == "raise" else 2)
        for snap, real in out:
            assert shadow_records(snap) == real
        assert counters()["n_throw"] > throws
        out.clear()
        check("after")


@needs_shim
def test_throw_into_a_filtered_coroutine_a_tracked_one_awaits(tmp_path):
    ns = _throw_lib(tmp_path)
    libcoro, E = ns["libcoro"], ns["E"]
    out: list = []

    async def co(other, inner):
        if other is not None:  # the thrower runs the same code
            try:
                other.throw(E)
            except StopIteration as stop:
                check("thrower")
                return stop.value
        return await inner

    for _ in range(3):
        awaiting = co(None, libcoro(out))
        assert awaiting.send(None) == "step"
        with pytest.raises(StopIteration) as info:
            co(awaiting, None).send(None)
        assert info.value.value == "done"
        [(snap, real)] = out
        assert shadow_records(snap) == real
        out.clear()
        check("after")


@needs_shim
def test_throw_into_filtered_code_from_a_pushed_frame_does_not_rebuild(tmp_path):
    """The common throw into a library generator (the thrower calls lg.throw() itself,
    no tracked frame linked in): the shadow chain is trusted, nothing rebuilt."""
    ns = _throw_lib(tmp_path)
    libgen, E = ns["libgen"], ns["E"]
    out: list = []

    def thrower(lg):
        return lg.throw(E)

    for _ in range(3):
        lg = libgen(out, "yield")
        next(lg)
        counts = counters()
        assert thrower(lg) == 2
        after = counters()
        assert after["n_throw"] == counts["n_throw"] and after["n_resync"] == counts["n_resync"]
        [(snap, real)] = out
        assert shadow_records(snap) == real
        out.clear()


@needs_shim
def test_throw_into_undecided_filtered_code_shows_the_linked_in_frames(tmp_path):
    """The same throw when the library's code is undecided (a new install): the policy
    decides it while the thrown exception is pending; the library still receives it and
    its snapshot is right."""
    ns = _throw_lib(tmp_path)
    libgen, E = ns["libgen"], ns["E"]
    out: list = []

    def g(other, inner):
        if other is not None:
            yield other.throw(E)
            return
        yield from inner

    delegator = g(None, libgen(out, "yield"))
    assert next(delegator) == 1
    monstack.uninstall()
    monstack.install(exclude=[str(tmp_path)])  # new epoch: every decision is stale
    decided = counters()["n_decide"]
    assert list(g(delegator, None)) == [2]
    assert counters()["n_decide"] > decided
    [(snap, real)] = out
    assert shadow_records(snap) == real
    check("after")


@needs_shim
def test_throw_into_filtered_code_from_a_frame_started_before_install(tmp_path):
    """No live shim activation to build on (the thrower started before install): the
    shadow chain is compared with the real frames and rebuilt for the throw."""
    ns = _throw_lib(tmp_path)
    libgen, E = ns["libgen"], ns["E"]
    monstack.uninstall()
    out: list = []

    def g(inner):
        yield from inner

    def thrower(delegator):  # its frame is never evaluated by the shim
        monstack.install(exclude=[str(tmp_path)])
        check("seeds the stack")
        throws = counters()["n_throw"]
        got = delegator.throw(E)
        check("after the throw")
        return got, counters()["n_throw"] - throws

    delegator = g(libgen(out, "yield"))
    assert next(delegator) == 1
    assert thrower(delegator) == (2, 1)
    [(snap, real)] = out
    assert shadow_records(snap) == real
    assert next(delegator) == 3
    assert shadow_records(out[1][0]) == out[1][1]


@needs_shim
def test_throw_from_an_unseeded_thread_leaves_no_linked_frame_behind(tmp_path):
    """The thread has no shadow stack yet when it throws (the thrower started before
    install and made no tracked call since): a snapshot in the library seeds it while
    CPython has the delegator linked in; after the throw the thrower's snapshot must not
    keep that frame (found by review)."""
    ns = library_module(tmp_path, "throw_lib", _THROW_LIB)
    libgen, E = ns["libgen"], ns["E"]
    out: list = []

    def g(other, inner_gen):
        if other is not None:
            monstack.install(exclude=[str(tmp_path)])
            list(ns["libdelegate"](iter(())))  # decides the library file (filtered); no tracked call
            seeded = hasattr(_stack.TLS, "cell")
            got = other.throw(E)
            snap = monstack.snapshot(); real = real_records(sys._getframe())  # noqa: E702 (one line)
            yield seeded, got, shadow_records(snap), real
            return
        yield from inner_gen

    monstack.install(exclude=[str(tmp_path)])
    delegator = g(None, libgen(out, "yield"))
    assert next(delegator) == 1
    monstack.uninstall()
    [(seeded, got, shadow, real)] = list(g(delegator, None))
    assert not seeded, "precondition: the thread has no shadow stack at the throw"
    assert got == 2
    assert shadow_records(out[0][0]) == out[0][1]
    assert shadow == real


@needs_shim
def test_generator_stress_against_the_real_stack(installed):
    """Many generators delegating, thrown into, closed, resumed from varying depths."""
    import random

    rnd = random.Random(4)
    mismatches = []

    def leaf(n):
        for i in range(n):
            try:
                yield i
            except ValueError:
                check("leaf caught")
        check("leaf done")

    def mid(n):
        try:
            yield from leaf(n)
        except KeyError:
            check("mid caught")
        check("mid done")

    def top(n):
        yield from mid(n)

    def at_depth(d, fn):
        if d:
            return at_depth(d - 1, fn)
        return fn()

    for _ in range(300):
        g = top(rnd.randint(1, 4))
        try:
            at_depth(rnd.randint(0, 5), lambda: next(g))
            for _ in range(rnd.randint(0, 5)):
                op = rnd.choice(("next", "throwV", "throwK", "close"))
                if op == "next":
                    at_depth(rnd.randint(0, 5), lambda: next(g))
                elif op == "throwV":
                    at_depth(rnd.randint(0, 5), lambda: g.throw(ValueError()))
                elif op == "throwK":
                    at_depth(rnd.randint(0, 5), lambda: g.throw(KeyError()))
                else:
                    g.close()
        except (StopIteration, ValueError, KeyError, RuntimeError):
            pass  # exceptions thrown into exhausted/closed generators come back out
        except Mismatch as exc:
            mismatches.append(exc)
        check("between")
    assert not mismatches, mismatches[0]


@needs_shim
def test_pending_exception_is_preserved_across_the_pop(installed):
    class Marker(Exception):
        pass

    marker = Marker("m")

    def raiser():
        raise marker

    def middle():
        try:
            raiser()
        finally:
            check("finally while unwinding")  # calls tracked code with the exception pending

    with pytest.raises(Marker) as info:
        middle()
    assert info.value is marker
    names = []
    tb = info.value.__traceback__
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert names[-2:] == ["middle", "raiser"]
    assert info.value.__context__ is None
    check("after")


@needs_shim
def test_throwflag_with_an_undecided_code_object_keeps_the_thrown_exception():
    """gen.throw() into code the shim has not decided yet (a new install): the policy
    runs while the thrown exception is pending; the generator must receive it intact."""

    def gen():
        try:
            yield 1
        except LookupError as exc:
            yield ("caught", exc, check("gen handler"))

    g = gen()
    monstack.install(track="all")
    assert next(g) == 1
    monstack.uninstall()
    monstack.install(track="user")  # new epoch: gen's code is undecided again
    decided = counters()["n_decide"]
    exc = LookupError("thrown")
    kind, got, depth = g.throw(exc)
    assert kind == "caught" and got is exc and depth >= 1
    assert counters()["n_decide"] > decided


@needs_shim
def test_policy_callback_runs_untracked_with_tracing_raised(monkeypatch):
    """The shim's own Python (the policy) runs with tstate->tracing raised: never tracked,
    never re-entering the shim's tracking."""
    from monstack._policy import Policy

    monstack.install()
    off = _evalframe._native.arch["interp_offsets"]
    monstack.uninstall()
    ts_get = _native.api_function("PyThreadState_Get", ctypes.c_void_p)
    seen = []
    real = Policy.is_tracked

    def spy(self, code, module=None):
        ts = ts_get()
        seen.append((code.co_filename, ctypes.c_int.from_address(ts + off["ts_tracing"]).value))
        return real(self, code, module)

    monkeypatch.setattr(Policy, "is_tracked", spy)
    monstack.install()
    pushes = counters()["n_push"]
    exec(compile("def fresh():\n    return 1\nfresh()\n", "/tmp/monstack_fresh_module.py", "exec"), {})
    mine = [t for f, t in seen if f == "/tmp/monstack_fresh_module.py"]
    assert mine and all(t >= 1 for t in mine), seen
    assert counters()["n_push"] - pushes >= 2  # <module> and fresh() were pushed
    # the spy's own frames (tracked code in this file) were not pushed: the stack is right
    check("after")


def test_c_stack_exhaustion_becomes_recursion_error():
    """A huge recursion limit: without the guard the C stack would overflow (segfault)."""
    code = """
        import gc, sys, threading, monstack
        from monstack import _capture
        assert monstack.install(track="all") == "evalframe"
        sys.setrecursionlimit(1_000_000)
        # (no collections: a gc callback's frame refused near the stack end would count
        # too, wherever the unwinding's allocations make a collection fall)
        gc.disable()
        def probe():
            depth = [0]
            def r(n):
                depth[0] = n
                r(n + 1)
            try:
                r(0)
            except RecursionError as exc:
                return depth[0], str(exc)
        d, msg = probe()
        print("MAIN", d, "C stack" in msg)
        out = []
        threading.stack_size(1 << 20)
        t = threading.Thread(target=lambda: out.append(probe()))
        t.start(); t.join()
        print("THREAD", out[0][0], "C stack" in out[0][1])
        from stackcheck import check
        print("CHECK", check("after") >= 1)
        print("REFUSED", _capture._state.backend.counters()["n_stack_refused"])
    """
    if not _available():
        pytest.skip("the shim cannot run here")
    out = run_py(code)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    m = re.search(r"MAIN (\d+) True", out.stdout)
    assert m and 2000 < int(m.group(1)) < 1_000_000, out.stdout
    t = re.search(r"THREAD (\d+) True", out.stdout)
    assert t and 100 < int(t.group(1)) < int(m.group(1)), out.stdout
    assert "CHECK True" in out.stdout and "REFUSED 2" in out.stdout


@needs_shim
def test_recursion_limit_error_is_the_users_not_the_policys():
    """At depth limit-1, calling never-seen code gives the RecursionError one would get
    without monstack, raised in the user's frame (the policy runs with headroom)."""
    code = """
        import sys, monstack
        def measure():
            depth = [0]
            def r(n):
                depth[0] = n
                r(n + 1)
            try:
                r(0)
            except RecursionError as exc:
                return depth[0], exc.__traceback__.tb_next is not None
        sys.setrecursionlimit(500)
        base = measure()
        monstack.install(track="all")
        assert monstack.active_backend() == "evalframe"
        fresh = {}
        exec("def r2(n):\\n    return r2(n + 1)\\n", fresh)
        try:
            fresh["r2"](0)
        except RecursionError as exc:
            tb = exc.__traceback__
            while tb.tb_next: tb = tb.tb_next
            print("WHERE", tb.tb_frame.f_code.co_name)
        print("SAME", measure() == base)
    """
    out = run_py(code)
    assert out.returncode == 0, out.stderr
    assert "WHERE r2" in out.stdout and "SAME True" in out.stdout, out.stdout


@needs_shim
def test_uninstall_reinstall_cycles_with_threads_running():
    stop = threading.Event()
    errors = []

    def worker():
        def rec(n):
            if n:
                return rec(n - 1)
            return sum(x for x in range(3))

        while not stop.is_set():
            try:
                rec(10)
                if monstack.active_backend() == "evalframe":
                    check("worker")
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for i in range(30):
            # one policy throughout: the workers' oracle reads the current policy, and a
            # policy change between their snapshot and their oracle would be the test's race
            assert monstack.install(include=[f"no_such_module_{i}"]) == "evalframe"
            check(f"cycle {i}")
            monstack.uninstall()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]


@needs_shim
def test_many_short_threads_reuse_thread_states(installed):
    """Thread states are reused at the same address by new threads: records are keyed
    by (address, thread id), so no thread sees another's stack."""
    results = []

    def body(i):
        def f(n):
            return f(n - 1) if n else (shadow_records(monstack.snapshot()) == real_records())

        results.append(f(i % 7))

    for batch in range(20):
        threads = [threading.Thread(target=body, args=(batch * 5 + k,)) for k in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == [True] * 100


@needs_shim
def test_thread_running_before_install_is_seeded_natively():
    ready = threading.Event()
    go = threading.Event()
    out = []

    def deep(n):
        if n:
            return deep(n - 1)
        ready.set()
        go.wait()
        out.append(check("seeded thread"))
        leaf()
        return None

    def leaf():
        out.append(check("leaf in seeded thread"))

    t = threading.Thread(target=deep, args=(12,))
    t.start()
    ready.wait()
    monstack.install()
    go.set()
    t.join()
    assert len(out) == 2 and out[1] == out[0] + 1


@needs_shim
def test_no_frames_kept_alive_by_the_shim(installed):
    import weakref

    class Local:
        pass

    refs = []

    def work():
        obj = Local()
        refs.append(weakref.ref(obj))
        check("work")

    for _ in range(10):
        work()
    gc.collect()
    assert all(r() is None for r in refs)
    node = _stack.get_cell()[0]
    while node is not None:
        assert isinstance(node[0], type(work.__code__)) and len(node) == 3
        node = node[1]


@needs_shim
def test_filtered_code_is_not_pushed(tmp_path):
    mod = tmp_path / "filtered_mod.py"
    mod.write_text("def call(fn):\n    return fn()\n")
    import importlib.util

    spec = importlib.util.spec_from_file_location("filtered_mod", mod)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    monstack.install(exclude=[str(tmp_path) + os.sep])

    def leaf():
        return 1

    def pushes_of(fn) -> int:
        before = counters()["n_push"]
        fn()
        return counters()["n_push"] - before

    m.call(leaf)  # decide everything once
    assert pushes_of(lambda: m.call(leaf)) == pushes_of(lambda: leaf())  # filtered_mod.call: no push
    depth = m.call(lambda: check("called back through filtered code"))
    assert depth == len(real_records()) + 2  # the lambda and check()


@needs_shim
def test_sub_interpreters_do_not_crash(installed):
    si = pytest.importorskip("_xxsubinterpreters")
    interp = si.create()
    try:
        si.run_string(interp, "def f(n):\n    return f(n - 1) if n else 0\nf(50)\nimport threading\n")
    finally:
        si.destroy(interp)
    check("after a sub-interpreter ran")


@needs_shim
def test_keyboard_interrupt_in_the_policy_callback_reaches_user_code(monkeypatch):
    """A signal handled while the shim's policy callback runs is delivered again, to
    user code, instead of being swallowed."""
    from monstack._policy import Policy

    real = Policy.is_tracked
    armed = {"on": True}

    def interrupted(self, code, module=None):
        if armed["on"] and code.co_filename == "/tmp/monstack_interrupted.py":
            armed["on"] = False
            raise KeyboardInterrupt
        return real(self, code, module)

    monkeypatch.setattr(Policy, "is_tracked", interrupted)
    monstack.install()
    ns: dict = {}
    with pytest.raises(KeyboardInterrupt):
        exec(compile("def g():\n    return 1\n", "/tmp/monstack_interrupted.py", "exec"), ns)
        for _ in range(1000):
            ns["g"]()
    assert not armed["on"]
    monstack.uninstall()


def test_lasti_ints_is_the_shims():
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "native", "shim311.h")) as f:
        header = f.read()
    assert f"#define MS_LASTI_INTS {_evalframe.LASTI_INTS}\n" in header


@needs_shim
def test_offset_ints_are_made_once_at_first_use_and_kept(installed):
    """The shim makes the int of a call-site offset at its first push and reuses it: the
    same object in every node with that call site, and none made at load."""
    src = "".join(f"    x{i} = {i}\n" for i in range(200)) + "    return check()\n"
    ns: dict = {}
    exec(compile(f"def long_fn(check):\n{src}", "/tmp/monstack_offsets.py", "exec"), ns)
    seen = []

    def grab():
        monstack.snapshot()
        seen.append(_stack.get_cell()[0][2])  # grab's node: its call site in long_fn
        return 0

    ns["long_fn"](grab)
    ns["long_fn"](grab)
    assert seen[0] > 256 and seen[0] == seen[1]  # (not a small int: CPython caches those)
    assert seen[0] is seen[1]


@needs_shim
def test_call_sites_beyond_the_preallocated_offsets(installed):
    """Call sites past the shim's preallocated offset ints (a long function) still give
    the right line."""
    body = "".join(f"    x{i} = {i}\n" for i in range(3000))
    src = f"def long_fn(check):\n{body}    return inner(check)\n\ndef inner(check):\n    return check('deep in a long function')\n"
    ns: dict = {}
    exec(compile(src, "/tmp/monstack_long_fn.py", "exec"), ns)
    assert ns["long_fn"].__code__.co_code.__len__() > 2 * _evalframe.LASTI_INTS
    assert ns["long_fn"](check) == len(real_records()) + 3
    node = None

    def grab(_where):
        nonlocal node
        monstack.snapshot()
        node = _stack.get_cell()[0]
        return 0

    ns["long_fn"](grab)
    lastis = []
    while node is not None:
        lastis.append(node[2])
        node = node[1]
    assert max(lastis) > 2 * _evalframe.LASTI_INTS


@needs_shim
def test_no_leaks_code_objects_freed_and_memory_flat(installed):
    import tracemalloc
    import weakref

    ns: dict = {}
    exec(compile("def f(n):\n    return f(n - 1) if n else 0\n", "/tmp/monstack_leak_check.py", "exec"), ns)
    ns["f"](20)
    ref = weakref.ref(ns["f"].__code__)
    del ns
    gc.collect()
    assert ref() is None, "a code object outlived its function (held by the shim?)"

    def g(n):
        return g(n - 1) if n else 0

    for _ in range(2000):
        g(20)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(20000):
            g(20)  # 420k tracked calls
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after - before < 64 * 1024, (before, after)


# ---------------------------------------------------------------------------------------
# the native snapshot (ms_snapshot_new / ms_capture): equal to snapshot()'s Python path
# ---------------------------------------------------------------------------------------

#: A library (filtered by the tests below) with snapshot()'s Python path on demand, a
#: framework taking the snapshot for its user, and a filtered recursion.
SNAP_LIB = (
    "import monstack\n"
    "from monstack import _capture\n"
    "def python_path():\n"
    "    saved = _capture._native_snapshot\n"
    "    _capture._native_snapshot = None\n"
    "    try:\n"
    "        return monstack.snapshot()\n"
    "    finally:\n"
    "        _capture._native_snapshot = saved\n"
    "def dispatch(take):\n"
    "    return take()\n"
    "def deep(n, fn):\n"
    "    return deep(n - 1, fn) if n else fn()\n"
)

_items = tuple.__getitem__


def _snap_counts() -> tuple:
    c = counters()
    return c["n_snap"], c["n_snap_py"]


def assert_same(native, python) -> None:
    """Same Snapshot: the same node, offset, origin object and hop counts (taken by the
    same call instruction: ``for take in (native, python): out.append(take())``)."""
    a, b = _items(native, slice(None)), _items(python, slice(None))
    assert type(native) is type(python)
    assert a[0] is b[0] and a[1] == b[1] and a[2] is b[2] and a[3] == b[3] and a[4] == b[4], (a, b)
    assert native.records() == python.records()
    assert native.format() == python.format()


def both(*takes) -> list:
    """The snapshots ``takes`` return, each called by the same instruction."""
    out = []
    for take in takes:
        out.append(take())
    return out


@pytest.fixture
def snaplib(tmp_path):
    """monstack installed with ``SNAP_LIB`` (in tmp_path) filtered; the library's namespace."""
    monstack.uninstall()
    monstack.install(exclude=[str(tmp_path) + os.sep])
    lib = library_module(tmp_path, "monstack_snaplib", SNAP_LIB)
    lib["dispatch"](lib["python_path"])  # decide the library's file (filtered)
    lib["deep"](2, lambda: None)
    try:
        yield lib
    finally:
        monstack.uninstall()


@needs_shim
def test_native_snapshot_is_offered_and_used(snaplib):
    backend = _capture._state.backend
    assert _capture._native_snapshot is backend.snapshot_native is not None
    cap = monstack.snapshotter()
    assert cap is backend.capture_native and type(cap).__name__ == "builtin_function_or_method"

    def user(n):
        if n:
            return user(n - 1)
        before = _snap_counts()
        out = []
        for take in (monstack.snapshot, snaplib["python_path"], cap):
            out.append(take())
        return before, _snap_counts(), out, real_records()

    before, after, (native, python, captured), real = user(30)
    assert after[0] - before[0] == 2  # snapshot() and cap() natively
    assert_same(native, python)
    assert_same(captured, python)
    assert shadow_records(native)[:-1] == real[:-1]
    assert shadow_records(native)[-1][2] == "user"


@needs_shim
def test_native_snapshot_again_is_the_same_object_until_its_frame_returns(snaplib):
    from monstack._snapshot import Snapshot

    cap = monstack.snapshotter()
    assert_one_site_one_snapshot(cap)
    freed = []
    Snapshot.__del__ = lambda self: freed.append(1)
    try:
        s = snapshots_at_one_site(cap, [None])[0][0]
        del s  # its function returned: nothing keeps it
        assert freed == [1, 1, 1]  # (and the function's two others)
        s = cap()  # this frame still runs: kept for the next snapshot here
        del s
        assert freed == [1, 1, 1]
        monstack.uninstall()  # (retire) lets go of it
        assert freed == [1, 1, 1, 1]
    finally:
        del Snapshot.__del__


@needs_shim
def test_native_snapshot_in_generators_and_coroutines(snaplib):
    py = snaplib["python_path"]

    def gen():
        for _ in range(2):
            out = []
            for take in (monstack.snapshot, py):
                out.append(take())
            yield out

    async def coro():
        out = []
        for take in (monstack.snapshot, py):
            out.append(take())
        return out

    for native, python in gen():
        assert_same(native, python)
    c = coro()
    try:
        c.send(None)
    except StopIteration as stop:
        assert_same(*stop.value)


@needs_shim
def test_native_snapshot_under_origins_and_chains_past_the_limit(tmp_path):
    monstack.uninstall()
    monstack.install(exclude=[str(tmp_path) + os.sep], chain_limit=3)
    try:
        lib = library_module(tmp_path, "monstack_snaplib2", SNAP_LIB)
        lib["python_path"]()
        py = lib["python_path"]
        s = monstack.snapshot()
        declined = native = 0
        for i in range(20):
            with monstack.origin(s):
                n0 = _snap_counts()
                a, b = both(monstack.snapshot, py)
                n1 = _snap_counts()
            assert_same(a, b)
            # Snapshot._new shortens the chain at 2 * chain_limit hops: the Python path's
            hops = _items(s, 4) & 0xFFFFFFFF
            due = hops + 1 >= 6
            assert (n1[0] - n0[0], n1[1] - n0[1] >= 1) == ((0, True) if due else (1, False)), (i, hops)
            declined += due
            native += not due
            s = a
        assert declined and native
        assert _items(s, 4) & 0xFFFFFFFF < 6 and s.origin is not None
        # an origin that is not exactly a Snapshot: the Python path links it
        ns = library_module(tmp_path, "monstack_snaplib3",
                            "from monstack._snapshot import Snapshot\nclass Sub(Snapshot):\n    __slots__ = ()\n")
        sub = tuple.__new__(ns["Sub"], _items(s, slice(None)))
        with monstack.origin(sub):
            n0 = _snap_counts()
            a, b = both(monstack.snapshot, py)
            assert _snap_counts()[0] == n0[0]
        assert_same(a, b)
    finally:
        monstack.uninstall()


@needs_shim
def test_native_snapshot_looks_through_filtered_callers(snaplib):
    py = snaplib["python_path"]

    def user(depth):
        n0 = _snap_counts()
        out = []
        for take in (monstack.snapshot, py):
            # a framework taking the snapshot for its user, `depth` filtered frames down
            out.append(snaplib["deep"](depth, take))
        return out[0], out[1], n0, _snap_counts(), real_records()

    for depth, native in ((0, True), (5, True), (15, True), (16, False), (40, False)):
        a, b, n0, n1, real = user(depth)
        assert_same(a, b)
        assert shadow_records(a)[:-1] == real[:-1] and shadow_records(a)[-1][2] == "user"
        # deep(depth), deep(depth - 1)... deep(0): depth + 1 filtered frames between
        # user and snapshot(); 16 looked through at most
        assert (n1[0] - n0[0] == 1) is native, depth
    # a snapshotter() function called by filtered code for its user
    cap = monstack.snapshotter()

    def user2():
        out = []
        for take in (cap, py):
            out.append(snaplib["dispatch"](take))
        return out, real_records()

    (a, b), real = user2()
    assert_same(a, b)
    assert shadow_records(a)[:-1] == real[:-1] and shadow_records(a)[-1][2] == "user2"


_FILTERED_ONLY_LIB = SNAP_LIB + (
    "def collect(out, n):\n"
    "    for _ in range(n):\n"
    "        pair = []\n"
    "        for take in (monstack.snapshot, python_path):\n"
    "            pair.append(take())\n"
    "        out.append(pair)\n"
)


@needs_shim
def test_native_snapshot_of_filtered_code_only_is_the_empty_snapshot(tmp_path):
    """A thread running only filtered code (threading's frames, then the library's): the
    shim answers the empty snapshot natively, as snapshot()'s Python path answers it."""
    from monstack._snapshot import CURRENT_ORIGIN

    monstack.uninstall()
    monstack.install(exclude=[str(tmp_path) + os.sep])
    try:
        lib = library_module(tmp_path, "monstack_filtered_only", _FILTERED_ONLY_LIB)
        origin = monstack.snapshot()
        for with_origin in (False, True):
            ctx = contextvars.copy_context()
            if with_origin:
                ctx.run(CURRENT_ORIGIN.set, origin)
            out: list = []
            th = threading.Thread(target=ctx.run, args=(lib["collect"], out, 4))
            n0 = _snap_counts()
            th.start()
            th.join()
            n1 = _snap_counts()
            assert n1[0] - n0[0] >= 3  # (the first may seed the thread through Python)
            for native, python in out:
                assert_same(native, python)
                assert _items(native, slice(0, 3)) == (None, -1, origin if with_origin else None)
    finally:
        monstack.uninstall()


@needs_shim
def test_native_snapshot_declines_for_undecided_callers(tmp_path):
    """A filtered frame whose file the policy has not decided (it started before
    install): the native path declines, the Python path decides (as snapshot() did)."""
    monstack.uninstall()
    lib = library_module(tmp_path, "monstack_undecided", "def take(first, then):\n    first()\n    return then()\n")

    def install():
        monstack.install(exclude=[str(tmp_path) + os.sep])
        inner()  # this file decided (tracked) in the new install
        out.append(_snap_counts())

    def inner():
        pass

    def user():
        return lib["take"](install, monstack.snapshot), real_records()

    out: list = []
    try:
        snap, real = user()
        n1 = _snap_counts()
        assert n1[0] == out[0][0] and n1[1] > out[0][1]  # declined, the Python path answered
        assert shadow_records(snap)[:-1] == real[:-1] and shadow_records(snap)[-1][2] == "user"
        assert _capture._state.policy.tracked_files()[lib["take"].__code__.co_filename] is False
    finally:
        monstack.uninstall()


@needs_shim
def test_native_snapshot_of_a_new_thread_and_a_forgotten_stack(installed):
    out = []

    def worker():
        def inner():
            out.append((monstack.snapshot(), real_records()))
            out.append((monstack.snapshot(), real_records()))

        inner()

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    for snap, real in out:
        assert shadow_records(snap) == real
    # this thread's stack forgotten (as after a RecursionError): the Python path reseeds
    try:
        del _stack.TLS.cell
    except AttributeError:
        pass
    assert check("after the stack was forgotten") == len(real_records()) + 1


@needs_shim
def test_uninstall_and_reinstall_retire_the_native_functions(installed):
    cap = monstack.snapshotter()
    backend = _capture._state.backend
    assert backend.capture_native is cap

    def user(fn):
        return fn(), real_records()

    snap, real = user(cap)
    assert shadow_records(snap) == real
    monstack.uninstall()
    assert backend.snapshot_native is None and backend.capture_native is None
    assert _capture._native_snapshot is None
    nat = _evalframe._native
    n_snap = nat.blob.get_i64(nat.arch["counters"]["n_snap"])
    snap, real = user(cap)  # through monstack.snapshot: the walk backend
    assert shadow_records(snap) == real
    assert nat.blob.get_i64(nat.arch["counters"]["n_snap"]) == n_snap
    monstack.install()
    new = monstack.snapshotter()
    assert new is not cap and type(new).__name__ == "builtin_function_or_method"
    user(cap)  # the old install's function: through monstack.snapshot
    assert counters()["n_snap"] == n_snap + 1  # (monstack.snapshot's own native path)
    snap, real = user(new)
    assert shadow_records(snap) == real and counters()["n_snap"] == n_snap + 2
    # a distrusted stack (as when a policy callback failed) retires them too
    _capture.disable_fast_path()
    assert _capture._native_snapshot is None and monstack.snapshotter() is monstack.snapshot
    snap, real = user(new)
    assert shadow_records(snap) == real and counters()["n_snap"] == n_snap + 2


@needs_shim
def test_native_snapshot_declines_once_another_eval_frame_replaced_ours():
    code = FOREIGN + """
    import sys, warnings
    import monstack
    from monstack import _capture
    from stackcheck import check
    warnings.simplefilter("ignore")
    assert monstack.install() == "evalframe"
    cap = monstack.snapshotter()
    backend = _capture._state.backend
    def counts():
        c = backend.counters()
        return c["n_snap"], c["n_snap_py"]
    def a(fn):
        return b(fn)
    def b(fn):
        return fn()
    a(lambda: check("before"))
    before = counts()
    a(cap)
    print("NATIVE_BEFORE", counts()[0] - before[0])
    set_foreign()
    before = counts()
    native = _capture._native_snapshot
    s = a(native)   # the shim is no longer called: the shadow stack is stale
    print("DECLINED", s is None, counts()[0] - before[0])
    for _ in range(3):
        a(lambda: check("after replacement"))
        a(cap)
    print("RETIRED", backend.snapshot_native is None, _capture._native_snapshot is None)
    print("NATIVE_AFTER", counts()[0] - before[0])
    monstack.uninstall()
    reset()
    """
    out = run_py(code)
    assert out.returncode == 0, out.stderr
    assert "NATIVE_BEFORE 1" in out.stdout, out.stdout
    assert "DECLINED True 0" in out.stdout, out.stdout
    assert "RETIRED True True" in out.stdout and "NATIVE_AFTER 0" in out.stdout, out.stdout


@needs_shim
def test_native_snapshot_is_fast_at_any_depth(installed):
    import timeit

    def at(depth, fn):
        return at(depth - 1, fn) if depth else min(timeit.repeat(fn, number=2000, repeat=5)) / 2000

    before = counters()["n_snap"]
    for depth in (10, 200):
        at(depth, monstack.snapshot)
        at(depth, monstack.snapshotter())
    assert counters()["n_snap"] - before >= 4 * 5 * 2000
