"""Stress: many threads, long workloads, memory, fork, install/uninstall races, shutdown.

Sizes are small enough for CI (a few seconds per interpreter); the long versions run with
``MONSTACK_STRESS=1`` (16 threads x many more rounds, 10M tracked calls for the memory
test; override the call count with ``MONSTACK_STRESS_CALLS``).
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import subprocess
import sys
import textwrap
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
from stackcheck import check

import monstack
from monstack import _stack

LONG = os.environ.get("MONSTACK_STRESS", "") not in ("", "0")
ROUNDS = 400 if LONG else 40
CALLS = int(os.environ.get("MONSTACK_STRESS_CALLS", 10_000_000 if LONG else 1_000_000))
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Where the monstack under test lives (subprocesses import the same copy).
HOME = os.path.dirname(os.path.dirname(os.path.abspath(monstack.__file__)))



# --------------------------------------------------------------------------------------
# A random workload: recursion, exceptions, generators, coroutines, snapshots.
# --------------------------------------------------------------------------------------


class WorkError(Exception):
    pass


class Local:
    """Allocated in workload frames: must never be kept alive by a snapshot."""


def _recurse(rng, n, held, refs):
    obj = Local()
    if rng.random() < 0.05:
        refs.append(weakref.ref(obj))
    if n <= 0:
        return _leaf(rng, held)
    r = rng.random()
    if r < 0.15:
        try:
            _raiser(rng, n - 1, held, refs)
        except WorkError:
            check("caught")
        return 0
    if r < 0.3:
        return sum(_gen(rng, n - 1, held, refs))
    if r < 0.4:
        return _drive(_coro(rng, n - 1, held, refs))
    return _recurse(rng, n - 1, held, refs) + 1


def _raiser(rng, n, held, refs):
    if n <= 0 or rng.random() < 0.3:
        if rng.random() < 0.2:
            held.append(monstack.snapshot())
        raise WorkError(n)
    _raiser(rng, n - 1, held, refs)


def _gen(rng, n, held, refs):
    local = Local()
    if rng.random() < 0.1:
        refs.append(weakref.ref(local))
    for i in range(rng.randint(0, 3)):
        check("gen")
        yield i
    if n > 0 and rng.random() < 0.5:
        yield from _gen(rng, n - 1, held, refs)


async def _coro(rng, n, held, refs):
    check("coro")
    if n > 0 and rng.random() < 0.5:
        await _coro(rng, n - 1, held, refs)
    await _Suspend()
    check("coro resumed")
    return n


class _Suspend:
    def __await__(self):
        yield


def _drive(coro):
    try:
        while True:
            coro.send(None)
    except StopIteration as stop:
        return stop.value or 0


def _leaf(rng, held):
    if rng.random() < 0.3:
        held.append(monstack.snapshot())
        if len(held) > 50:
            snap = held.pop(0)
            assert str(snap).count("File ") == len(snap)  # read an older snapshot
    return check("leaf")


def workload(seed, rounds, spawn=False):
    rng = random.Random(seed)
    held: list = []
    refs: list = []
    for i in range(rounds):
        _recurse(rng, rng.randint(0, 25), held, refs)
        g = _gen(rng, 3, held, refs)
        next(g, None)
        if rng.random() < 0.3:
            g.close()  # (throws into delegating generators are the oracle's business)
        del g
        if spawn and i % 10 == 0:
            _spawn_and_check_origin(seed * 1000 + i)
    del held[:]
    gc.collect()
    return refs


def _spawn_and_check_origin(seed):
    out = []

    def child():
        snap = monstack.snapshot()
        out.append((snap.origin, check("child thread")))

    t = threading.Thread(target=child)
    t.start()  # the origin of the child's work is this line
    t.join()
    origin, _depth = out[0]
    if monstack.active_backend() is not None:
        assert origin is not None, "a thread started under install() has no origin"
        assert origin.records()[-1][2] == "_spawn_and_check_origin"
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(check, "pool worker")
        assert fut.result() >= 1


def run_threads(n, target, *args):
    errors: list = []
    results: list = []
    barrier = threading.Barrier(n)

    def wrapped(i):
        try:
            barrier.wait()
            results.append(target(i, *args))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


# --------------------------------------------------------------------------------------


def test_sixteen_threads_long_random_workloads(installed):
    before = dict(_stack.STATS)
    results = run_threads(16, lambda i: workload(i, ROUNDS, spawn=True))
    gc.collect()
    alive = [r for refs in results for r in refs if r() is not None]
    assert alive == [], f"{len(alive)} frame locals kept alive"
    check("main after the threads")
    # Plain calls/returns/exceptions/generators never need a rebuild.
    assert _stack.STATS["resync"] == before["resync"]


def test_sixteen_threads_with_asyncio_loops(installed):
    async def task(rng, n):
        check("task")
        await asyncio.sleep(0)
        if n and rng.random() < 0.5:
            return await task(rng, n - 1)
        if rng.random() < 0.2:
            raise WorkError(n)
        return n

    async def main(i):
        rng = random.Random(i)
        for _ in range(ROUNDS // 4):
            res = await asyncio.gather(*(task(rng, rng.randint(0, 10)) for _ in range(5)), return_exceptions=True)
            assert all(isinstance(r, (int, WorkError)) for r in res)
            check("main")

    run_threads(16, lambda i: asyncio.run(main(i)))


def _chain(n):
    if n:
        return _chain(n - 1) + 1
    return 0


def _many_calls(total, depth=10):
    """``total`` tracked calls (each _chain(depth) is depth + 1 calls)."""
    rounds = total // (depth + 1)
    snapshot = monstack.snapshot
    for i in range(rounds):
        _chain(depth)
        if i % 1000 == 0:
            snapshot()


def test_memory_flat_over_many_tracked_calls(installed):
    _many_calls(200_000)  # warm up: caches, code decisions, positions
    gc.collect()
    depth_before = _stack.depth(_stack.get_cell()[0]) if _stack.TLS.__dict__.get("cell") else None
    blocks_before = sys.getallocatedblocks()
    _many_calls(CALLS)
    gc.collect()
    grown = sys.getallocatedblocks() - blocks_before
    # Flat: a leak of one object per 1000 calls would already be >= 1000 blocks.
    assert grown < 500, f"{grown} blocks more after {CALLS} tracked calls"
    if depth_before is not None:
        assert _stack.depth(_stack.get_cell()[0]) == depth_before
    check("after many calls")


def test_no_frames_kept_alive_by_snapshots_of_finished_work(installed):
    held = []
    refs = []

    def deep(n):
        local = Local()
        refs.append(weakref.ref(local))
        if n:
            return deep(n - 1)
        held.append(monstack.snapshot())
        gen = (monstack.snapshot() for _ in range(2))
        held.append(next(gen))  # an abandoned generator, then dropped
        return len(held)

    run_threads(4, lambda i: [deep(20) for _ in range(10)])
    gc.collect()
    assert [r for r in refs if r() is not None] == []
    assert all(len(s) >= 20 for s in held)
    # Nodes hold code objects and ints only: nothing reachable from a snapshot is a frame.
    seen = set()
    for snap in held:
        node = snap._node
        while node is not None and id(node) not in seen:
            seen.add(id(node))
            assert type(node[0]).__name__ == "code" and isinstance(node[2], int)
            node = node[1]


def test_objects_die_when_they_did_without_monstack(installed):
    """Tracking and propagation must not change object lifetimes: a finished Thread (and
    what it references) is freed by reference counting alone, as without monstack --
    code keyed on weak references (concurrent.futures' wakeups, caches) relies on it."""
    gc.disable()
    try:
        class Payload:
            pass

        def body(p):
            check("thread body")

        payload = Payload()
        t = threading.Thread(target=body, args=(payload,))
        t.start()
        t.join()
        refs = [weakref.ref(t), weakref.ref(payload)]
        del t, payload
        assert [r() for r in refs] == [None, None], "kept alive until the cyclic GC runs"
        pool = ThreadPoolExecutor(1)
        pool.submit(check, "pool").result()
        pool_ref = weakref.ref(pool)
        pool.shutdown()
        del pool
        assert pool_ref() is None
    finally:
        gc.enable()


def test_propagation_wrappers_pass_any_arguments_through(installed):
    """Keyword arguments named like the wrappers' own parameters reach the user's callable."""

    def f(*args, **kwargs):
        check("called through the wrapper")
        return args, kwargs

    kwargs = {"self": 1, "fn": 2, "func": 3, "args": 4, "kwargs": 5}
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(f, 0, **kwargs).result() == ((0,), kwargs)
    assert monstack.wrap(f)(0, **kwargs) == ((0,), kwargs)
    out = []
    t = threading.Thread(target=lambda **kw: out.append(kw), kwargs=kwargs)
    t.start()
    t.join()
    assert out == [kwargs]


def test_install_uninstall_while_threads_run():
    monstack.uninstall()
    stop = threading.Event()
    errors: list = []
    counts = [0] * 8

    def worker(i):
        rng = random.Random(i)
        try:
            while not stop.is_set():
                _recurse(rng, rng.randint(0, 15), [], [])
                counts[i] += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        for cycle in range(60 if not LONG else 600):
            monstack.install()
            check("installed")
            _chain(5)
            monstack.uninstall()
            check("uninstalled")
            if errors:
                break
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert all(c > 0 for c in counts)
    assert monstack.active_backend() is None
    if hasattr(sys, "monitoring"):
        assert "monstack" not in [sys.monitoring.get_tool(t) for t in range(6)]


# --------------------------------------------------------------------------------------
# Subprocesses: fork, shutdown.
# --------------------------------------------------------------------------------------


def run_script(source: str, timeout: float = 60, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([HOME, TESTS])
    env.pop("PYTHONWARNINGS", None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(source)],
        capture_output=True, text=True, timeout=timeout, env=env,
    )


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_while_tracking():
    res = run_script(
        """
        import os, sys, threading, warnings
        import monstack
        from stackcheck import check
        backend = monstack.install()
        stop = threading.Event()
        def spin():
            while not stop.is_set():
                check("spinner")
        t = threading.Thread(target=spin, daemon=True)
        t.start()

        def in_child():
            d = check("child")
            def again(n):
                return check("child deeper") if n == 0 else again(n - 1)
            assert again(10) == d + 11
            out = []
            th = threading.Thread(target=lambda: out.append(check("child thread")))
            th.start(); th.join()
            assert out and monstack.active_backend() == backend
            return d

        def deep(n):
            if n:
                return deep(n - 1)
            before = check("parent before fork")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # 3.12: fork with threads
                pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = 0 if in_child() == before + 1 else 3
                except BaseException:
                    import traceback; traceback.print_exc()
                finally:
                    os._exit(code)
            after = check("parent after fork")
            _, status = os.waitpid(pid, 0)
            return before, after, os.waitstatus_to_exitcode(status)

        for i in range(5):
            before, after, code = deep(15)
            assert before == after and code == 0, (before, after, code)
        stop.set(); t.join()
        check("parent at the end")
        print("ok", backend)
        """
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ok"), res.stdout
    assert res.stderr == ""


SHUTDOWN_SCRIPT = """
import asyncio, sys, threading, time
import monstack
monstack.install(track=TRACK)
CHECK

def rec(n):
    if n:
        return rec(n - 1)
    return monstack.snapshot()

def gen():
    while True:
        yield rec(5)

async def coro():
    while True:
        rec(3)
        await asyncio.sleep(0)

def daemon(i):
    g = gen()
    while True:
        next(g)
        check("daemon")
        if i % 3 == 0:
            try:
                raise ValueError(i)
            except ValueError:
                rec(4)
        if i % 4 == 1:
            try:
                asyncio.run(asyncio.wait_for(coro(), 0.001))
            except asyncio.TimeoutError:
                pass

for i in range(8):
    threading.Thread(target=daemon, args=(i,), daemon=True).start()
suspended = gen(); next(suspended)  # a generator still suspended at exit
time.sleep(0.2)
print("exiting", monstack.active_backend())
EXIT
"""


@pytest.mark.parametrize("track", ["user", "all"])
@pytest.mark.parametrize("how", ["return", "sys.exit", "uninstall-racing"])
def test_shutdown_with_tracking_on_and_daemon_threads_running(track, how):
    exit_line = {
        "return": "",
        "sys.exit": "sys.exit(0)",
        # a daemon thread uninstalls while the interpreter shuts down
        "uninstall-racing": "threading.Thread(target=lambda: (time.sleep(0.001), monstack.uninstall()), daemon=True).start()",
    }[how]
    if how == "uninstall-racing":
        # the policy changes under the daemons (track="all" -> none): compare nothing, read
        check_line = "def check(where):\n    return len(monstack.snapshot().records())"
    else:
        check_line = "from stackcheck import check"
    script = SHUTDOWN_SCRIPT.replace("TRACK", repr(track)).replace("EXIT", exit_line).replace("CHECK", check_line)
    for attempt in range(3):  # shutdown races: a few tries each
        res = run_script(script, timeout=60)
        assert res.returncode == 0, f"exit code {res.returncode}\n{res.stderr}"
        assert res.stderr == "", res.stderr
        assert res.stdout.startswith("exiting ")
