"""The shadow stack equals the real interpreter stack, in the tricky cases (gen.throw()
and coroutine throws: test_throw.py)."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import weakref

import pytest
from stackcheck import Mismatch, check, real_records, shadow_records

import monstack
from monstack import _env, _stack

from conftest import expected_backend as conftest_backend


def test_nested_calls(installed, no_resync):
    depths = []

    def a():
        depths.append(check("a"))
        b()
        depths.append(check("a after b"))

    def b():
        depths.append(check("b"))
        c()

    def c():
        depths.append(check("c"))

    a()
    assert depths[1] == depths[0] + 1 and depths[2] == depths[1] + 1 and depths[3] == depths[0]


@pytest.mark.parametrize("catch_at", [0, 1, 2, 5])
def test_exceptions_caught_at_various_depths(installed, catch_at, no_resync):
    def thrower(n):
        if n == 0:
            check("before raise")
            raise ValueError("x")
        return thrower(n - 1)

    def catcher(level):
        if level == 0:
            try:
                thrower(6)
            except ValueError:
                check("in handler")
            check("after handler")
            return
        catcher(level - 1)
        check("after catcher returns")

    catcher(catch_at)
    check("top")


def test_exception_through_finally_and_reraise(installed, no_resync):
    def inner():
        try:
            raise KeyError(1)
        finally:
            check("finally")

    def middle():
        try:
            inner()
        except KeyError:
            check("middle handler")
            raise RuntimeError("wrapped")

    with pytest.raises(RuntimeError):
        middle()
    check("after")


def test_generator_consumed_elsewhere(installed, no_resync):
    def numbers():
        for i in range(3):
            check("numbers")
            yield i

    def consume(it):
        return [check("consume") and x for x in it]

    assert consume(numbers()) == [0, 1, 2]
    assert sorted(numbers(), key=lambda v: (check("key"), -v)[1]) == [2, 1, 0]
    assert list(map(lambda v: check("map") and v, numbers())) == [0, 1, 2]


def test_coroutines_under_asyncio(installed, no_resync):
    async def leaf(i):
        check("leaf start")
        await asyncio.sleep(0)
        check("leaf resumed")
        if i == 2:
            raise LookupError(i)
        return i

    async def middle(i):
        try:
            return await leaf(i)
        except LookupError:
            check("middle handler")
            return -1

    async def main():
        check("main")
        results = await asyncio.gather(*(middle(i) for i in range(4)))
        check("main after gather")
        task = asyncio.create_task(middle(1))
        await asyncio.sleep(0)
        check("main after sleep")
        results.append(await task)
        return results

    assert asyncio.run(main()) == [0, 1, -1, 3, 1]
    check("after asyncio.run")


def test_async_generators(installed, no_resync):
    async def agen():
        for i in range(3):
            check("agen")
            yield i
            await asyncio.sleep(0)

    async def main():
        out = [i async for i in agen()]
        check("main")
        return out

    assert asyncio.run(main()) == [0, 1, 2]


def test_recursion_near_the_limit(installed, no_resync):
    limit = sys.getrecursionlimit()
    here = len(real_records())
    seen = {}

    def down(n):
        if n == 0:
            seen["depth"] = check("bottom")
            return
        down(n - 1)

    down(limit - here - 60)
    assert seen["depth"] > limit - 200

    def forever(n):
        return forever(n + 1)

    with pytest.raises(RecursionError):
        forever(0)
    check("after RecursionError")


def test_class_bodies_lambdas_comprehensions_exec_eval(installed, no_resync):
    class K:
        depth = check("class body")
        values = [check("comprehension in class body") for _ in range(2)]

    f = lambda: check("lambda")  # noqa: E731
    f()
    [check("list comprehension") for _ in range(2)]
    {check("set comprehension") for _ in range(1)}
    dict((i, check("generator expression")) for i in range(2))
    ns = {"check": check}
    exec("def g():\n    check('exec def')\ng()\ncheck('exec body')", ns)
    eval("check('eval')", ns)
    assert K.depth >= 1


def test_eight_threads_at_once(installed, no_resync):
    errors = []
    barrier = threading.Barrier(8)

    def rec(n, tid):
        if n == 0:
            check(f"thread {tid}")
            return
        if n % 3 == 0:
            try:
                boom(n)
            except ValueError:
                check("thread handler")
        rec(n - 1, tid)

    def boom(n):
        raise ValueError(n)

    def worker(tid):
        try:
            barrier.wait()
            for i in range(30):
                rec(5 + (i + tid) % 17, tid)
                g = (check("thread gen") for _ in range(2))
                list(g)
        except BaseException as exc:  # noqa: BLE001 - collected for the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_install_while_deep_and_while_threads_run():
    monstack.uninstall()
    stop = threading.Event()
    started = threading.Event()
    errors = []

    def spin(n):
        if n:
            return spin(n - 1)
        started.set()
        while not stop.is_set():
            try:
                leaf_call()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return

    def leaf_call():
        check("spinner")

    t = threading.Thread(target=spin, args=(20,))
    t.start()
    started.wait()

    def deep(n):
        if n == 0:
            monstack.install()
            check("just installed, deep")
            inner()
            check("after inner")
            return
        deep(n - 1)
        check("unwinding through frames that started before install")

    def inner():
        check("inner")

    try:
        deep(40)
        check("back at the top")
    finally:
        stop.set()
        t.join()
    assert not errors, errors[0]


def test_uninstall_reinstall_cycles():
    def f(n):
        if n:
            return f(n - 1)
        return check("cycle")

    for i in range(5):
        monstack.install()
        f(i * 3)
        monstack.uninstall()
        f(2)  # untracked in between
        monstack.install(track="all" if i % 2 else "user")
        f(i)
        monstack.uninstall()


def test_old_snapshots_keep_their_lines(installed, no_resync):
    snaps = []

    def take():
        snaps.append(monstack.snapshot())  # line A
        snaps.append(monstack.snapshot())  # line B

    def caller():
        take()
        take()

    caller()
    recs = [shadow_records(s) for s in snaps]
    take_line = take.__code__.co_firstlineno
    caller_line = caller.__code__.co_firstlineno
    assert [r[-1][1] - take_line for r in recs] == [1, 2, 1, 2]
    assert [r[-2][1] - caller_line for r in recs] == [1, 1, 2, 2]
    assert all(r[-1][2] == "take" and r[-2][2] == "caller" for r in recs)


def test_no_frames_or_locals_kept_alive(installed, no_resync):
    class Local:
        pass

    held = []

    def work():
        obj = Local()
        ref = weakref.ref(obj)
        held.append(monstack.snapshot())
        return ref

    ref = work()
    gc.collect()
    assert ref() is None
    assert held and len(held[0]) >= 1


def test_shadow_matches_after_pending_exception_in_generator_expression(installed, no_resync):
    def bad():
        return [1 / x for x in (1, 0)]

    with pytest.raises(ZeroDivisionError):
        bad()
    check("after")


def test_snapshot_from_untracked_code_starts_at_nearest_tracked_caller(installed, no_resync):
    import json

    seen = []

    class Enc(json.JSONEncoder):
        def default(self, o):
            seen.append(check("called back by the json library"))
            return 1

    json.dumps({"a": object()}, cls=Enc)
    assert seen


def test_capture_on_fresh_thread_seeds_from_real_frames(installed, no_resync):
    out = []

    def body():
        out.append(shadow_records(monstack.snapshot()) == real_records())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert out == [True]


@pytest.mark.skipif(conftest_backend() == "walk", reason="walk backend keeps no stack")
def test_stack_nodes_are_tuples_of_code_parent_offset(installed, no_resync):
    def f():
        monstack.snapshot()
        return _stack.get_cell()[0]

    code, parent, off = f()
    assert code is f.__code__ if False else code.co_name == "f"
    assert parent is not None and parent[0] is test_stack_nodes_are_tuples_of_code_parent_offset.__code__
    assert isinstance(off, int) and off >= 0


@pytest.mark.skipif(conftest_backend() == "walk", reason="walk backend keeps no stack")
def test_capture_repairs_a_corrupted_stack(installed):
    def f():
        cell = _stack.get_cell()
        cell[0] = (test_stack.__code__ if False else g.__code__, None, 0)  # a lie about this thread
        return monstack.snapshot()

    def g():
        pass

    snap = f()
    assert [r[2] for r in shadow_records(snap)][-2:] == ["test_capture_repairs_a_corrupted_stack", "f"]
    check("after repair")


def test_oracle_detects_a_wrong_stack(installed, monkeypatch):
    """Guard against a test that cannot fail: a snapshot missing a frame is caught."""
    import stackcheck

    real_snapshot = monstack.snapshot

    def lying_snapshot():
        return real_snapshot()  # taken one frame deeper than the oracle expects: extra frame

    monkeypatch.setattr(stackcheck.monstack, "snapshot", lying_snapshot)
    with pytest.raises(Mismatch):
        check("with a lying snapshot")


def test_track_all_threads_whose_first_frame_is_tracked(no_resync):
    """With track='all' a new thread's first frame (threading's bootstrap) is tracked."""
    import warnings

    monstack.install(track="all")
    out = []

    def body():
        out.append(check("in a thread, track=all"))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = threading.Thread(target=body)
        t.start()
        t.join()
    assert out and monstack.active_backend() is not None


def test_suspendable_code_flags_are_inspects():
    import inspect

    from monstack import _sysmon

    assert _stack.SUSPENDABLE == _sysmon._SUSPENDABLE == (
        inspect.CO_GENERATOR | inspect.CO_COROUTINE
        | inspect.CO_ITERABLE_COROUTINE | inspect.CO_ASYNC_GENERATOR)


def test_delegation_opcode_is_the_opcode_modules():
    from opcode import opmap

    assert _stack.DELEGATION_OP == opmap["RESUME" if sys.version_info >= (3, 13) else "YIELD_VALUE"]
    assert _env.OPCODES == {"YIELD_VALUE": opmap["YIELD_VALUE"], "RESUME": opmap["RESUME"]}


def test_build_asks_unverified_about_generator_frames_only_and_marks_from_there_up():
    # The question costs a Python call per frame and build() runs at every throw: plain
    # frames are never asked. A frame answered "yes" and every node above it get
    # UNKNOWN call sites; the nodes below keep theirs.
    from monstack._policy import Policy

    asked = []

    def unverified(f):
        asked.append(f.f_code)
        return f.f_code is outer.__code__

    def top():
        return _stack.build(sys._getframe(), Policy(), unverified)

    def outer():
        yield top()

    def plain():
        return next(outer())

    node, lasti = plain()
    assert asked == [outer.__code__]
    names = []
    while node is not None and node[0] is not test_build_asks_unverified_about_generator_frames_only_and_marks_from_there_up.__code__:
        names.append((node[0].co_name, node[2] == _stack.UNKNOWN))
        node = node[1]
    assert names == [("top", True), ("outer", True), ("plain", False)]
    assert node is not None and node[2] != _stack.UNKNOWN


class _CyclicFinalizer:
    """Cyclic garbage (only a collection frees it) whose ``__del__`` snapshots, calls a
    tracked function that snapshots, and snapshots again: each must be the real stack."""

    def __init__(self, results: list) -> None:
        self.results = results
        self.me = self

    def __del__(self) -> None:
        try:
            check("finalizer")
            _finalizer_callee()
            check("finalizer, after a call")  # was answered stale: the first check's line
            self.results.append("ok")
        except Mismatch as exc:
            self.results.append(str(exc))


def _finalizer_callee() -> None:
    check("finalizer's callee")


def _abandoned_generator(results: list):
    """A generator whose ``finally:`` (run when a collection frees it, suspended) snapshots."""
    try:
        yield 1
    finally:
        try:
            check("generator finalizer")
            _finalizer_callee()
            check("generator finalizer, after a call")
            results.append("ok")
        except Mismatch as exc:
            results.append(str(exc))


def _garbage(results: list) -> None:
    """Leave cyclic garbage with finalizers that snapshot: a ``__del__`` and a suspended
    generator in a reference cycle."""
    _CyclicFinalizer(results)
    gen = _abandoned_generator(results)
    next(gen)
    holder = [gen]
    holder.append(holder)
    gen.gi_frame.f_locals  # (the frame, not only the generator, in the cycle's reach)
    del gen, holder


@pytest.mark.skipif(conftest_backend() == "walk", reason="walk backend keeps no stack")
@pytest.mark.parametrize("where", ["policy", "seed", "install", "uninstall"])
def test_finalizers_run_by_a_collection_inside_monstack(where, monkeypatch):
    """A collection that runs finalizers inside monstack's own machinery, made to happen
    there (deterministically, by a hook, not where allocation counts happen to fall):

    - ``policy``: a policy decision (3.11: the shim's call, with ``tstate->tracing``
      raised; 3.12+: inside the PY_START callback, native or Python), where no event
      reaches the finalizers' frames;
    - ``seed``: a snapshot's Python capture seeding the thread from the real frames
      (events reach the finalizers' frames: 3.12+ callbacks seed a fresh stack for
      them);
    - ``install`` / ``uninstall``: inside ``install()`` with the backend started, inside
      ``uninstall()`` before it stops (events reach monstack's filtered frames' callees).

    Every snapshot the finalizers take is the real stack (their second one used to
    answer stale from the fast path), the stacks after the collection are right without
    a rebuild, and nothing is reported (no false "replaced" warning on 3.11)."""
    from monstack import _install
    from monstack._policy import Policy

    results: list = []
    armed: list = []

    def collect() -> None:
        if armed:
            armed.clear()
            _garbage(results)
            gc.collect()

    trigger_file = f"<monstack-test-trigger-{where}-{id(results)}>"
    ns: dict = {}
    exec(compile("def trigger():\n    return 1\n", trigger_file, "exec"), ns)
    if where == "policy":
        real_decide = Policy._decide

        def decide(self, filename, module):
            if filename == trigger_file:
                collect()
            return real_decide(self, filename, module)

        monkeypatch.setattr(Policy, "_decide", decide)
    elif where == "seed":
        real_build = _stack.build

        def build(*args, **kwargs):
            collect()
            return real_build(*args, **kwargs)

        monkeypatch.setattr(_stack, "build", build)  # before install: callbacks bind it
    elif where == "install":
        monkeypatch.setattr(_install, "_start_hooks", _install._start_hooks + [lambda state: collect()])
    else:
        monkeypatch.setattr(_install, "_stop_hooks", _install._stop_hooks + [lambda state: collect()])
    monstack.uninstall()
    name = monstack.install()
    gc.collect()
    gc.disable()  # only the hook collects
    try:
        before = dict(_stack.STATS)

        def inner():
            check("inner, before")
            armed.append(1)
            if where == "policy":
                ns["trigger"]()
            elif where == "seed":
                _stack.clear_cell()  # no tracked call until the snapshot: its capture seeds
                snap, real = monstack.snapshot(), real_records(sys._getframe())
                assert shadow_records(snap) == real
            elif where == "install":
                monstack.install(track="all")
                monstack.uninstall()
                monstack.install()
            else:
                monstack.uninstall()
                monstack.install()
            check("inner, after the collection")
            _finalizer_callee()
            check("inner, after a call")

        def outer():
            check("outer")
            inner()
            check("outer, after inner")

        outer()
        assert not armed, "the hook never ran"
        assert results == ["ok", "ok"], results
        assert monstack.active_backend() == name
        if where in ("policy", "seed"):  # (a reinstall reseeds; these must not resync)
            assert _stack.STATS["resync"] == before["resync"]
    finally:
        gc.enable()
        monstack.uninstall()


@pytest.mark.skipif(conftest_backend() == "walk", reason="walk backend keeps no stack")
@pytest.mark.parametrize("program", ["finalizer_in_policy", "finalizer_in_reinstall", "finalizer_at_exit"])
def test_finalizer_programs(program):
    """Programs where collections run finalizers that snapshot, inside monstack's own
    machinery (where allocation counts make them fall: found by a fuzzer; the test above
    makes them happen deterministically) and at interpreter exit, after monstack's atexit
    handler (3.11: the shim is inert then, which must not read as another tool's
    eval_frame function). Every snapshot is right and nothing is reported."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "tests", "programs", program + ".py")
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "mismatches: 0" in out.stdout, out.stdout
    assert "MonstackWarning" not in out.stderr and "monstack:" not in out.stderr, out.stderr
