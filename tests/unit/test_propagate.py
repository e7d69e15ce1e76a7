"""Automatic propagation: every point names the line that created the work.

Each test checks the *innermost tracked frame* of the reported origin against a marked
line of this file (``# @name``), so a test fails if the origin points anywhere else.
"""

from __future__ import annotations

import asyncio
import os
import sys
import concurrent.futures as cf
import functools
import gc
import inspect
import json
import logging
import multiprocessing
import operator
import threading
import traceback
from typing import Any, Optional

import pytest

import stackcheck

import monstack
from monstack import _origin, _points, _propagate, _snapshot
from monstack._points import multiprocessing as _points_mp

from monstack import current_origin, format_exception, origin_of

THIS_FILE = __file__
line_of = stackcheck.marker_lines(__file__)


def innermost(snap: Optional[monstack.Snapshot]) -> tuple[str, int]:
    assert snap is not None, "no origin"
    recs = snap.records()
    assert recs, "origin has no tracked frames"
    return (recs[-1][0], recs[-1][1])


def assert_created_at(snap: Optional[monstack.Snapshot], marker: str) -> None:
    assert innermost(snap) == (THIS_FILE, line_of(marker)), format_snap(snap)


def format_snap(snap: Any) -> str:
    return snap.format(color=False) if snap is not None else "None"


def hop_lines(snap: monstack.Snapshot) -> list[int]:
    """Innermost line of the origin and of each older hop, newest first."""
    out = [innermost(snap)[1]]
    for hop in snap.chain(limit=100)[0]:
        out.append(innermost(hop)[1])
    return out


@pytest.fixture
def thread_errors(monkeypatch):
    """Exceptions that end threads, collected instead of printed (pytest would fail)."""
    caught: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: caught.append(args.exc_value))
    return caught


class Boom(Exception):
    pass


def fail(*args: Any) -> None:
    raise Boom("failed in the worker")


# -- threading ----------------------------------------------------------------------------------


def test_thread_start_carries_origin(installed, thread_errors):
    seen = {}

    def target():
        seen["origin"] = current_origin()
        seen["snap"] = monstack.snapshot()
        fail()

    t = threading.Thread(target=target)
    t.start()  # @thread-start
    t.join()
    assert_created_at(seen["origin"], "thread-start")
    assert seen["snap"].origin is seen["origin"]
    (exc,) = thread_errors
    assert_created_at(origin_of(exc), "thread-start")
    # The exception is as it was (the excepthook's report shows the origin: test_reports);
    # monstack's rendering shows it.
    assert "Work created at" not in "".join(traceback.format_exception(exc))
    printed = format_exception(exc, color=False)
    assert "Work created at (most recent call last):" in printed
    assert f'line {line_of("thread-start")}, in test_thread_start_carries_origin' in printed


def test_default_threading_excepthook_prints_the_origin(installed, monkeypatch, capsys):
    hook_args: list = []
    monkeypatch.setattr(threading, "excepthook", hook_args.append)
    t = threading.Thread(target=fail, name="dies")
    t.start()  # @excepthook-start
    t.join()
    # What the hook install() puts in front of Python's default one prints (under pytest
    # the hook it finds is pytest's: test_reports runs the real thing in a subprocess).
    from monstack._points import reports

    assert any(o is threading and a == "excepthook" for o, a, _x, _r in _points.PATCHES)
    reports._default_thread_report(_origin, hook_args[0], threading.__excepthook__)
    err = capsys.readouterr().err
    assert err.startswith("Exception in thread dies:\nTraceback (most recent call last):\n")
    assert "Work created at (most recent call last):" in err
    assert f'"{THIS_FILE}", line {line_of("excepthook-start")}, in test_default_threading' in err
    # the default report, with the origin where notes go; the exception itself unchanged
    exc = hook_args[0].exc_value
    assert not hasattr(exc, "__notes__")
    without = "".join(traceback.format_exception(exc))
    assert err == "Exception in thread dies:\n" + without.replace(
        "Boom: failed in the worker\n", "Boom: failed in the worker\n" + format_origin_text(exc) + "\n")


def format_origin_text(exc: BaseException) -> str:
    from monstack import _format

    return "".join(_format.format_origin(origin_of(exc))).rstrip("\n")


def test_thread_subclass_run_and_instance_cleanup(installed, thread_errors):
    class Worker(threading.Thread):
        def run(self):
            self.origin = current_origin()
            fail()

    w = Worker()
    w.start()  # @subclass-start
    w.join()
    assert_created_at(w.origin, "subclass-start")
    assert_created_at(origin_of(thread_errors[0]), "subclass-start")
    assert "run" not in w.__dict__, "the per-thread run wrapper was left on the thread"


def test_timer_carries_origin(installed, thread_errors):
    done = threading.Event()

    def later():
        try:
            fail()
        finally:
            done.set()

    timer = threading.Timer(0.0, later)
    timer.start()  # @timer-start
    timer.join()
    assert done.is_set()
    assert_created_at(origin_of(thread_errors[0]), "timer-start")


def test_thread_started_twice_still_raises_and_leaves_no_wrapper(installed):
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
    with pytest.raises(RuntimeError):
        t.start()
    assert "run" not in t.__dict__


def test_threading_point_off(thread_errors):
    monstack.install(propagate=["thread_pool"])
    seen = {}

    def target():
        seen["origin"] = current_origin()
        fail()

    t = threading.Thread(target=target)
    t.start()
    t.join()
    assert seen["origin"] is None
    assert origin_of(thread_errors[0]) is None


# -- concurrent.futures: threads ------------------------------------------------------------------


_PACKAGE_DIR = os.path.dirname(os.path.abspath(monstack.__file__))


def _tb_files_and_names(exc: BaseException) -> list[tuple[str, str]]:
    return [(os.path.abspath(f.filename), f.name) for f in traceback.extract_tb(exc.__traceback__)]


def _assert_no_monstack_frames(exc: BaseException, innermost_name: str) -> None:
    frames = _tb_files_and_names(exc)
    assert not [f for f in frames if f[0].startswith(_PACKAGE_DIR + os.sep)], frames
    assert frames[-1][1] == innermost_name, frames


def test_failed_jobs_tracebacks_show_no_monstack_wrapper_frames(installed, thread_errors):
    """A propagating wrapper takes its own entry off the failing job's traceback: what
    threading's excepthook, future.result() and wrap() callers print goes straight from
    whatever ran the job to the job."""
    t = threading.Thread(target=fail)
    t.start()
    t.join()
    (exc,) = thread_errors
    _assert_no_monstack_frames(exc, "fail")
    assert origin_of(exc) is not None
    with cf.ThreadPoolExecutor(1) as pool:
        with pytest.raises(Boom) as info:
            pool.submit(fail).result()
    _assert_no_monstack_frames(info.value, "fail")
    with pytest.raises(Boom) as info:
        monstack.wrap(fail)()
    _assert_no_monstack_frames(info.value, "fail")
    assert origin_of(info.value) is not None

    def leave() -> None:
        raise SystemExit(3)

    with pytest.raises(SystemExit) as exit_info:  # not an Exception: no note, same traceback
        monstack.wrap(leave)()
    _assert_no_monstack_frames(exit_info.value, "leave")


def test_wrapper_entry_is_dropped_when_the_call_itself_fails(installed):
    """Wrong arguments (or a C function as the job) fail with the wrapper's entry the only
    one: the traceback then ends at the caller's line, as a direct call's would."""

    def takes_nothing() -> None:
        pass

    with pytest.raises(TypeError) as info:
        monstack.wrap(takes_nothing)(1, 2)  # @wrap-bad-call
    frames = [(f.filename, f.lineno) for f in traceback.extract_tb(info.value.__traceback__)]
    assert frames == [(THIS_FILE, line_of("wrap-bad-call"))]
    with pytest.raises(ZeroDivisionError) as info:
        monstack.wrap(operator.truediv)(1, 0)  # @wrap-c-call
    frames = [(f.filename, f.lineno) for f in traceback.extract_tb(info.value.__traceback__)]
    assert frames == [(THIS_FILE, line_of("wrap-c-call"))]


def test_thread_pool_submit(installed):
    with cf.ThreadPoolExecutor(2) as pool:
        future = pool.submit(fail, 1)  # @pool-submit
        with pytest.raises(Boom) as info:
            future.result()
        inside = pool.submit(current_origin).result()  # @pool-submit-2
    assert_created_at(origin_of(info.value), "pool-submit")
    assert_created_at(inside, "pool-submit-2")


def test_thread_pool_map(installed):
    with cf.ThreadPoolExecutor(2) as pool:
        with pytest.raises(Boom) as info:
            list(pool.map(fail, [1, 2]))  # @pool-map
    assert_created_at(origin_of(info.value), "pool-map")


def test_thread_pool_worker_origin_is_reset(installed):
    """Workers are reused: an origin must not leak into the next, unpropagated job (nor
    may the worker thread inherit the line whose submit() happened to start it)."""
    with cf.ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: None).result()
        monstack.uninstall()
        assert pool.submit(current_origin).result() is None


# -- concurrent.futures: interpreters (3.14+) --------------------------------------------------

needs_interpreter_pool = pytest.mark.skipif(
    not hasattr(cf, "InterpreterPoolExecutor"), reason="InterpreterPoolExecutor is new in CPython 3.14"
)


@needs_interpreter_pool
def test_interpreter_pool_runs_unshareable_work_and_attaches_the_origin(installed):
    """A function defined inside a function cannot be pickled or shared; the pool runs it
    (in another interpreter, which does not import monstack) exactly as without monstack,
    and its failure carries the submitting line, attached in this interpreter."""

    def double(x):
        return 2 * x

    def boom(x):
        raise ValueError(x)

    with cf.InterpreterPoolExecutor(1) as pool:
        assert pool.submit(double, 21).result() == 42
        future = pool.submit(boom, 7)  # @interp-submit
        with pytest.raises(ValueError) as info:
            future.result()
        assert list(pool.map(double, [1, 2])) == [2, 4]
        with pytest.raises(ValueError) as mapped:
            list(pool.map(boom, [3]))  # @interp-map
    assert info.value.args == (7,)
    assert_created_at(origin_of(info.value), "interp-submit")
    assert_created_at(origin_of(mapped.value), "interp-map")
    assert "set_exception" not in vars(future)  # the pending-time hook is gone


@needs_interpreter_pool
def test_interpreter_pool_without_the_point_is_untouched():
    monstack.install(propagate=["threading"])
    try:
        def boom():
            raise ValueError("x")

        with cf.InterpreterPoolExecutor(1) as pool:
            future = pool.submit(boom)
            with pytest.raises(ValueError) as info:
                future.result()
        assert origin_of(info.value) is None and "set_exception" not in vars(future)
    finally:
        monstack.uninstall()


# -- concurrent.futures: processes ----------------------------------------------------------------


@pytest.fixture(scope="module")
def process_pool():
    # spawn: fork() from a multi-threaded pytest warns (an error here) on 3.12+.
    with cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def test_process_pool_submit(installed, process_pool):
    future = process_pool.submit(operator.truediv, 1, 0)  # @proc-submit
    with pytest.raises(ZeroDivisionError) as info:
        future.result()
    exc = info.value
    assert_created_at(origin_of(exc), "proc-submit")
    assert not hasattr(exc, "__notes__")


def test_process_pool_map(installed, process_pool):
    with pytest.raises(ZeroDivisionError) as info:
        list(process_pool.map(operator.truediv, [1, 2], [1, 0]))  # @proc-map
    assert_created_at(origin_of(info.value), "proc-map")


def _run_failing_process(capfd) -> tuple[Any, str]:
    """A spawned multiprocessing.Process whose target fails; what the child printed."""
    ctx = multiprocessing.get_context("spawn")  # fork() from threaded pytest warns on 3.12+
    p = ctx.Process(target=operator.truediv, args=(1, 0), name="doomed")
    p.start()  # @mp-start
    p.join(60)
    assert p.exitcode == 1
    return p, capfd.readouterr().err


def test_process_start_carries_origin_to_the_child(installed, capfd):
    """The child prints its own traceback when the target fails; the note names the
    parent's start() line, and the traceback shows no monstack frame."""
    p, err = _run_failing_process(capfd)
    assert "Process doomed:" in err and "ZeroDivisionError" in err
    assert "Work created at (most recent call last):" in err
    assert f'"{THIS_FILE}", line {line_of("mp-start")}, in _run_failing_process' in err
    assert "monstack" not in err.split("Work created at")[0]
    assert not hasattr(p, "_target")  # start() drops it, as without monstack (bpo-30775)


def test_process_point_applies_when_multiprocessing_is_imported_after_install():
    """The usual order: install() first, multiprocessing (or concurrent.futures.process)
    imported later -- the patch is applied by the import hook while multiprocessing is
    still initialising (found by review: it once failed there, silently)."""
    import subprocess

    code = (
        "import monstack; monstack.install()\n"
        "import {mod}\n"
        "from monstack import _propagate\n"
        "print(sorted(a for o, a, _ in _propagate.patched() if o.__name__ == 'BaseProcess'))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for mod in ("multiprocessing", "concurrent.futures.process"):
        out = subprocess.run([sys.executable, "-c", code.format(mod=mod)], capture_output=True,
                             text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "['start']", (mod, out.stdout, out.stderr)


def test_a_point_that_cannot_be_patched_at_import_says_so():
    """The import of the program goes on, but the user is told (once, as a warning)."""
    import subprocess

    code = (
        "import monstack\n"
        "from monstack import _points, _propagate\n"
        "from monstack._points import multiprocessing as family\n"
        "def boom():\n"
        "    raise RuntimeError('no such attribute here')\n"
        "family.apply_process = boom\n"
        "monstack.install()\n"
        "import multiprocessing\n"
        "print('imported', _propagate.FAILED)\n"
        "print('status', monstack.status()['propagation failed'])\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "imported {'process': 'RuntimeError: no such attribute here'}" in out.stdout
    assert "could not patch propagation point 'process'" in out.stderr
    assert "status {'process': 'RuntimeError: no such attribute here'}" in out.stdout


def test_status_names_the_points_and_the_modules_still_to_patch(installed):
    status = monstack.status()
    assert status["propagation"] == list(monstack.PROPAGATION_POINTS)
    assert "propagation failed" not in status
    monstack.install(propagate=["threading", "dask"])
    status = monstack.status()
    assert status["propagation"] == ["threading", "dask"]
    waiting = status.get("waiting for import", [])
    assert ("threading" in sys.modules) != ("threading" in waiting)
    assert ("distributed.client" in sys.modules) != ("distributed.client" in waiting)
    monstack.install(propagate=False)
    assert monstack.status()["propagation"] == []


def test_propagate_takes_all_and_none_as_the_variable_does(installed):
    monstack.install(propagate="all")
    assert monstack.status()["propagation"] == list(monstack.PROPAGATION_POINTS)
    monstack.install(propagate="none")
    assert monstack.status()["propagation"] == []
    monstack.install(propagate="threading")
    assert monstack.status()["propagation"] == ["threading"]
    with pytest.raises(ValueError, match="unknown propagation point"):
        monstack.install(propagate="everything")


def test_failed_process_start_leaves_the_process_as_it_was(installed):
    ctx = multiprocessing.get_context("spawn")

    def local_target() -> None:  # a local function cannot be pickled for spawn
        pass

    p = ctx.Process(target=local_target)
    with pytest.raises(Exception):
        p.start()
    assert p._target is local_target and "run" not in vars(p)


def test_processes_without_work_of_their_own_are_left_alone(installed):
    proc = multiprocessing.get_context("spawn").Process(target=None)
    assert _points_mp._bind_process_run(proc) is None
    proc._target = "data, not a callable"
    assert _points_mp._bind_process_run(proc) is None
    proc = multiprocessing.get_context("spawn").Process(target=monstack.wrap(operator.truediv))
    assert _points_mp._bind_process_run(proc) is None  # carries its own origin
    assert "run" not in vars(proc)


def test_process_point_off_adds_nothing(capfd):
    monstack.install(propagate=["threading"])
    _p, err = _run_failing_process(capfd)
    assert "ZeroDivisionError" in err and "Work created at" not in err


def test_pool_and_manager_processes_are_left_alone(installed):
    """Their processes run many jobs: no single origin is theirs (jobs get their own)."""
    from concurrent.futures import process as cfp
    from multiprocessing import pool as mpool

    for target in (cfp._process_worker, mpool.worker):
        proc = multiprocessing.get_context("spawn").Process(target=target)
        assert _points_mp._bind_process_run(proc) is None
        assert proc._target is target and "run" not in vars(proc)
    proc = multiprocessing.get_context("spawn").Process(target=operator.truediv)
    assert isinstance(_points_mp._bind_process_run(proc), _origin.RunOf)
    assert proc._target is operator.truediv  # the target itself is never replaced


def test_process_pool_parent_attaches_when_pickling_drops_it(installed, process_pool):
    # json.JSONDecodeError.__reduce__ rebuilds from (msg, doc, pos): attributes and notes
    # set in the child are lost on the way back, so the parent attaches the origin.
    future = process_pool.submit(json.loads, "{")  # @proc-json
    after_ours = threading.Event()
    future.add_done_callback(lambda f: after_ours.set())  # runs after monstack's callback
    assert after_ours.wait(60)
    exc = future.exception()
    assert isinstance(exc, json.JSONDecodeError)
    assert_created_at(origin_of(exc), "proc-json")


# -- multiprocessing.pool ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mp_process_pool():
    # spawn: fork() from a multi-threaded pytest warns (an error here) on 3.12+.
    pool = multiprocessing.get_context("spawn").Pool(1)
    try:
        yield pool
    finally:
        pool.terminate()
        pool.join()


def test_mp_pool_apply_async_in_a_child_process(installed, mp_process_pool):
    result = mp_process_pool.apply_async(operator.truediv, (1, 0))  # @mpp-apply
    with pytest.raises(ZeroDivisionError) as info:
        result.get(60)
    exc = info.value
    assert_created_at(origin_of(exc), "mpp-apply")
    assert not hasattr(exc, "__notes__")
    assert "monstack" not in "".join(traceback.format_tb(exc.__traceback__))


def test_mp_pool_map_starmap_imap_in_a_child_process(installed, mp_process_pool):
    with pytest.raises(ZeroDivisionError) as info:
        mp_process_pool.map(functools.partial(operator.truediv, 1), [1, 0], chunksize=1)  # @mpp-map
    assert_created_at(origin_of(info.value), "mpp-map")
    with pytest.raises(ZeroDivisionError) as info:
        mp_process_pool.starmap(operator.truediv, [(1, 1), (1, 0)])  # @mpp-starmap
    assert_created_at(origin_of(info.value), "mpp-starmap")
    with pytest.raises(ZeroDivisionError) as info:
        list(mp_process_pool.imap(functools.partial(operator.truediv, 1), [1, 0]))  # @mpp-imap
    assert_created_at(origin_of(info.value), "mpp-imap")
    # results are untouched
    assert mp_process_pool.map(abs, [-1, -2]) == [1, 2]
    assert sorted(mp_process_pool.imap_unordered(abs, [-3, -4], chunksize=2)) == [3, 4]


def test_mp_pool_parent_attaches_when_pickling_drops_it(installed, mp_process_pool):
    # json.JSONDecodeError rebuilds from (msg, doc, pos): the child's note is lost on the
    # way back; the error callback monstack adds attaches it in the parent, before get()
    # is woken, and the user's own error callback still runs.
    seen: list = []
    result = mp_process_pool.apply_async(json.loads, ("{",), error_callback=seen.append)  # @mpp-json
    with pytest.raises(json.JSONDecodeError) as info:
        result.get(60)
    assert_created_at(origin_of(info.value), "mpp-json")
    assert seen == [info.value]


def test_mp_thread_pool_jobs(installed):
    from multiprocessing.pool import ThreadPool

    with ThreadPool(2) as pool:
        result = pool.apply_async(fail)  # @tp-apply
        with pytest.raises(Boom) as info:
            result.get(60)
        assert_created_at(origin_of(info.value), "tp-apply")
        with pytest.raises(Boom) as info:
            pool.map(fail, [1, 2])  # @tp-map
        assert_created_at(origin_of(info.value), "tp-map")
        # the job itself sees the origin, and snapshots inside it link to it
        origin = pool.apply(current_origin)  # @tp-current
        assert_created_at(origin, "tp-current")
        inner = pool.apply(monstack.snapshot)
        assert inner.origin is not None
        monstack.uninstall()
        assert pool.apply(current_origin) is None


# -- asyncio ----------------------------------------------------------------------------------------


async def afail() -> None:
    await asyncio.sleep(0)
    raise Boom("failed in a task")


async def report_origin() -> Optional[monstack.Snapshot]:
    return current_origin()


def test_asyncio_create_task(installed):
    async def main():
        inside = await asyncio.create_task(report_origin())  # @create-task-2
        task = asyncio.create_task(afail())  # @create-task
        with pytest.raises(Boom) as info:
            await task
        return inside, info.value

    inside, exc = asyncio.run(main())
    assert_created_at(inside, "create-task-2")
    assert_created_at(origin_of(exc), "create-task")


def test_asyncio_loop_create_task_and_ensure_future(installed):
    async def main():
        loop = asyncio.get_running_loop()
        t1 = loop.create_task(afail())  # @loop-create-task
        t2 = asyncio.ensure_future(afail())  # @ensure-future
        out = []
        for t in (t1, t2):
            try:
                await t
            except Boom as exc:
                out.append(exc)
        return out

    e1, e2 = asyncio.run(main())
    assert_created_at(origin_of(e1), "loop-create-task")
    assert_created_at(origin_of(e2), "ensure-future")


def test_asyncio_gather(installed):
    async def main():
        return await asyncio.gather(report_origin(), afail(), return_exceptions=True)  # @gather

    inside, exc = asyncio.run(main())
    assert_created_at(inside, "gather")
    assert_created_at(origin_of(exc), "gather")


def test_asyncio_taskgroup(installed):
    async def main():
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(afail())  # @taskgroup
        except BaseExceptionGroup as group:  # noqa: F821 (3.11+ builtin)
            return group

    group = asyncio.run(main())
    (exc,) = group.exceptions
    assert_created_at(origin_of(exc), "taskgroup")
    # The group is as it was; monstack's rendering shows the member's origin as its note.
    assert "Work created at" not in "".join(traceback.format_exception(group))
    text = format_exception(group, color=False)
    assert f"line {line_of('taskgroup')}, in main" in text
    assert text.index("Boom: failed in a task") < text.index("Work created at")


def test_asyncio_never_retrieved_message_shows_origin(installed, caplog):
    async def main():
        task = asyncio.create_task(afail())  # @never-retrieved
        while not task.done():
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # let the done callbacks run
        del task
        gc.collect()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(main())
    (record,) = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    text = caplog.text  # as the handler formatted it when asyncio reported it
    assert "Task exception was never retrieved" in text
    assert "Work created at (most recent call last):" in text
    assert f'"{THIS_FILE}", line {line_of("never-retrieved")}, in main' in text
    assert not hasattr(record.exc_info[1], "__notes__")  # shown for the report only


def test_asyncio_composes_with_existing_task_factory(installed):
    made = []

    def factory(loop, coro, **kwargs):
        task = asyncio.Task(coro, loop=loop, **kwargs)
        made.append(task)
        return task

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_task_factory(factory)
        inside = await asyncio.create_task(report_origin())  # @factory
        assert loop.get_task_factory() is factory
        return inside

    inside = asyncio.run(main())
    assert [t.get_coro().__name__ for t in made].count("report_origin") == 1
    assert_created_at(inside, "factory")


@pytest.mark.skipif(not hasattr(asyncio, "eager_task_factory"), reason="eager tasks are 3.12+")
def test_asyncio_eager_task_factory(installed):
    async def fails_at_once():
        raise Boom("eager")

    async def main():
        asyncio.get_running_loop().set_task_factory(asyncio.eager_task_factory)
        inside = await asyncio.create_task(report_origin())  # @eager
        task = asyncio.create_task(fails_at_once())  # @eager-fail
        assert task.done()  # it failed inside create_task
        try:
            await task
        except Boom as exc:
            return inside, origin_of(exc)  # read where the creator handles it, not later

    inside, seen = asyncio.run(main())
    assert_created_at(inside, "eager")
    assert_created_at(seen, "eager-fail")


@pytest.mark.skipif(
    sys.version_info < (3, 13),
    reason="CPython 3.12's TaskGroup raises CancelledError when an eager task fails at once, with or without monstack",
)
def test_asyncio_eager_taskgroup(installed):
    async def fails_at_once():
        raise Boom("eager")

    async def main():
        asyncio.get_running_loop().set_task_factory(asyncio.eager_task_factory)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(fails_at_once())  # @eager-group
        except ExceptionGroup as group:
            return [origin_of(e) for e in group.exceptions]

    [seen] = asyncio.run(main())
    assert_created_at(seen, "eager-group")


def test_asyncio_explicit_context_is_left_alone(installed):
    import contextvars

    async def main():
        ctx = contextvars.copy_context()
        inside = await asyncio.get_running_loop().create_task(report_origin(), context=ctx)
        return inside, ctx.get(_snapshot.CURRENT_ORIGIN)

    inside, in_ctx = asyncio.run(main())
    assert inside is None and in_ctx is None


def test_asyncio_run_in_executor(installed):
    async def main():
        loop = asyncio.get_running_loop()
        inside = await loop.run_in_executor(None, current_origin)  # @rie
        try:
            await loop.run_in_executor(None, fail)  # @rie-fail
        except Boom as exc:
            return inside, exc

    inside, exc = asyncio.run(main())
    assert_created_at(inside, "rie")
    assert_created_at(origin_of(exc), "rie-fail")


def test_asyncio_run_in_executor_without_thread_pool_point():
    monstack.install(propagate=["asyncio_executor"])

    async def main():
        return await asyncio.get_running_loop().run_in_executor(None, current_origin)  # @rie-only

    assert_created_at(asyncio.run(main()), "rie-only")


def test_asyncio_to_thread(installed):
    async def main():
        inside = await asyncio.to_thread(current_origin)  # @to-thread
        try:
            await asyncio.to_thread(fail)  # @to-thread-fail
        except Boom as exc:
            return inside, exc

    inside, exc = asyncio.run(main())
    assert_created_at(inside, "to-thread")
    assert_created_at(origin_of(exc), "to-thread-fail")
    assert inspect.iscoroutinefunction(asyncio.to_thread)


# -- chains and the cap --------------------------------------------------------------------------------


def test_chain_across_three_hops(installed, thread_errors):
    """main starts thread B; B submits to a pool; the job creates an asyncio task that fails."""

    async def job_main():
        task = asyncio.create_task(afail())  # @hop3
        await task

    def job():
        asyncio.run(job_main())

    def thread_b():
        with cf.ThreadPoolExecutor(1) as pool:
            pool.submit(job).result()  # @hop2

    t = threading.Thread(target=thread_b)
    t.start()  # @hop1
    t.join()
    (exc,) = thread_errors
    snap = origin_of(exc)
    assert hop_lines(snap) == [line_of("hop3"), line_of("hop2"), line_of("hop1")]
    text = format_exception(exc, color=False)
    assert text.count("Work created at (most recent call last):") == 1
    assert text.count("Which ran in work created at (most recent call last):") == 2
    assert "dropped" not in text


def test_endless_resubmission_chain_is_capped():
    monstack.install(chain_limit=3)
    total = 40
    futures: list = []
    last_started = threading.Event()

    def step(n):
        if n == total:
            last_started.set()
            raise Boom("end of the chain")
        futures.append(pool.submit(step, n + 1))  # @resubmit

    with cf.ThreadPoolExecutor(1) as pool:  # one worker: job n+1 runs after job n returned
        pool.submit(step, 0)  # @first-submit
        assert last_started.wait(30)
        exc = futures[-1].exception(timeout=30)
    snap = origin_of(exc)
    # The job that failed was submitted by job `total - 1`; its chain has `total` origins
    # below it (one per earlier job, the first submitted from this test).
    shown, dropped = snap.chain()
    assert len(shown) == 3
    assert 1 + len(shown) + dropped == total + 1
    assert all(innermost(s)[1] == line_of("resubmit") for s in (snap,) + shown)
    # Memory stays flat: the physical chain is bounded by the cap, not by `total`.
    n, s = 0, snap
    while s is not None:
        n, s = n + 1, s.origin
    assert n <= 2 * 3
    text = format_exception(exc, color=False)
    assert text.count("created at (most recent call last):") == 3
    assert f"[{total + 1 - 3} more hops dropped (chain_limit=3)]" in text


# -- install/uninstall -----------------------------------------------------------------------------------


def _targets() -> dict[str, list[tuple[Any, str]]]:
    import _thread
    import asyncio.base_events
    import multiprocessing.pool
    import multiprocessing.process

    trio_targets: list[tuple[Any, str]] = []
    try:  # the trio point's targets, where trio is installed (tests/integration/test_trio.py uses it)
        import trio._core._run
        import trio._threads
        import trio.to_thread
    except ImportError:
        pass
    else:
        trio_targets = [(trio._core._run.Runner, "spawn_impl"), (trio._core._run.Runner, "task_exited"),
                        (trio._threads, "to_thread_run_sync"), (trio.to_thread, "run_sync")]
    celery_targets: list[tuple[Any, str]] = []
    try:  # the celery point's patches (its signal receivers are no patches), where installed
        import celery.app.trace
        import celery.result
    except ImportError:
        pass
    else:
        celery_targets = [(celery.app.trace.TraceInfo, "handle_failure"), (celery.result.AsyncResult, "get")]
    dask_targets: list[tuple[Any, str]] = []
    try:  # the dask point's targets, where distributed is installed (tests/integration/test_dask.py uses it)
        import distributed.client
    except ImportError:
        pass
    else:
        dask_targets = [(distributed.client.Client, a) for a in ("submit", "map", "_release_key")]
        dask_targets.append((distributed.client.FutureState, "set_error"))
    rq_targets: list[tuple[Any, str]] = []
    try:  # the rq point's targets, where rq is installed (tests/integration/test_rq.py uses it)
        import rq.job
        import rq.worker
    except ImportError:
        pass
    else:
        rq_targets = [(rq.job.Job, "create"), (rq.job.Job, "perform"), (rq.worker.Worker, "fork_work_horse")]
    ray_targets: list[tuple[Any, str]] = []
    try:  # the ray point's targets, where ray is installed (tests/integration/test_ray.py uses it)
        import ray
    except ImportError:
        pass
    else:
        ray_targets = [(ray.remote_function.RemoteFunction, "_remote"), (ray.actor.ActorClass, "_remote"),
                       (ray.actor.ActorMethod, "_remote"), (ray._private.worker.Worker, "deserialize_objects")]
    return {
        "threading": [(threading.Thread, "start")],
        "start_new_thread": [(_thread, "start_new_thread"), (_thread, "start_new")],
        "thread_pool": [(cf.ThreadPoolExecutor, "submit")],
        "process_pool": [(cf.ProcessPoolExecutor, "submit")],
        "asyncio_tasks": [(asyncio.base_events.BaseEventLoop, "create_task")],
        "asyncio_executor": [(asyncio.base_events.BaseEventLoop, "run_in_executor")],
        "process": [(multiprocessing.process.BaseProcess, "start")],
        "mp_pool": [
            (multiprocessing.pool.Pool, "apply_async"),
            (multiprocessing.pool.Pool, "_map_async"),
            (multiprocessing.pool.Pool, "imap"),
            (multiprocessing.pool.Pool, "imap_unordered"),
        ],
        "trio": trio_targets,
        "celery": celery_targets,
        "dask": dask_targets,
        "rq": rq_targets,
        "ray": ray_targets,
        "sentry": [],  # patches nothing: a global event processor (tests/integration/test_sentry.py)
    }


def _current(owner: Any, attr: str) -> Any:
    return owner.__dict__[attr]


def test_points_listed_match_patches():
    assert set(_targets()) == set(_propagate.PROPAGATION_POINTS)


def test_uninstall_restores_identical_originals():
    monstack.uninstall()
    targets = [t for ts in _targets().values() for t in ts]
    originals = {t: _current(*t) for t in targets}
    for _ in range(2):  # and again after a reinstall
        monstack.install()
        for t in targets:
            assert _current(*t) is not originals[t], f"{t} not patched"
        monstack.uninstall()
        for t in targets:
            assert _current(*t) is originals[t], f"{t} not restored"
    assert _propagate.patched() == []
    assert _snapshot.CHAIN_LIMIT == _snapshot.DEFAULT_CHAIN_LIMIT


@pytest.mark.parametrize("point", _propagate.PROPAGATION_POINTS)
def test_each_point_switches_alone(point):
    monstack.uninstall()
    targets = _targets()
    originals = {t: _current(*t) for ts in targets.values() for t in ts}
    monstack.install(propagate=[point])
    for name, ts in targets.items():
        for t in ts:
            assert (_current(*t) is not originals[t]) == (name == point), (name, t)
    monstack.uninstall()
    for t, original in originals.items():
        assert _current(*t) is original


def test_propagate_false_patches_nothing():
    monstack.uninstall()
    originals = {t: _current(*t) for ts in _targets().values() for t in ts}
    monstack.install(propagate=False)
    assert all(_current(*t) is o for t, o in originals.items())


def test_bad_propagate_values():
    with pytest.raises(ValueError, match="threading"):
        monstack.install(propagate=["threads"])
    with pytest.raises(ValueError):
        monstack.install(propagate=3)
    with pytest.raises(ValueError):
        monstack.install(chain_limit=0)
    assert monstack.active_backend() is None


def test_patched_over_by_someone_else_then_uninstalled(thread_errors):
    original = threading.Thread.start
    monstack.install()
    ours = threading.Thread.start

    def theirs(self):
        return ours(self)

    threading.Thread.start = theirs
    try:
        monstack.uninstall()
        assert threading.Thread.start is theirs  # not clobbered
        seen = {}
        t = threading.Thread(target=lambda: seen.setdefault("o", current_origin()))
        t.start()
        t.join()
        assert seen["o"] is None  # ours now only calls through
    finally:
        threading.Thread.start = original


def test_rewritten_in_place_by_someone_else_then_uninstalled():
    """A tool that wraps a function by rewriting its ``__code__`` (ddtrace does) leaves the
    attribute as it was: uninstall sees ours there with other code, and leaves it (putting
    the original back would drop their wrapping); ours then only calls through. With the
    real ddtrace: tests/integration/test_patchers.py."""
    original = cf.ThreadPoolExecutor.submit
    monstack.install()
    ours = cf.ThreadPoolExecutor.submit
    assert ours is not original
    ours.__code__ = ours.__code__.replace(co_name="rewritten")  # same behaviour, another code object
    try:
        monstack.uninstall()
        assert cf.ThreadPoolExecutor.submit is ours
        with cf.ThreadPoolExecutor(1) as pool:
            assert pool.submit(current_origin).result() is None  # ours now only calls through
            assert pool.submit(operator.add, 2, 3).result() == 5
    finally:
        cf.ThreadPoolExecutor.submit = original
    monstack.install()  # and the next install patches the original again
    try:
        assert cf.ThreadPoolExecutor.submit is not original
    finally:
        monstack.uninstall()
    assert cf.ThreadPoolExecutor.submit is original


def test_chain_limit_option_sets_cap():
    monstack.install(chain_limit=5)
    assert _snapshot.CHAIN_LIMIT == 5
    monstack.uninstall()
    assert _snapshot.CHAIN_LIMIT == _snapshot.DEFAULT_CHAIN_LIMIT


def test_snapshot_failure_never_breaks_the_host(installed, monkeypatch):
    def broken():
        raise RuntimeError("internal")

    monkeypatch.setattr(_points, "capture_snapshot", broken)
    with cf.ThreadPoolExecutor(1) as pool:
        assert pool.submit(operator.add, 1, 2).result() == 3
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()

    async def main():
        return await asyncio.create_task(asyncio.sleep(0, "ok"))

    assert asyncio.run(main()) == "ok"


def test_partial_with_origin_is_not_wrapped_twice():
    wrapped = _origin.WithOrigin(len, monstack.snapshot())
    assert _origin.has_origin(wrapped)
    assert _origin.has_origin(functools.partial(object.__call__, wrapped))
    assert not _origin.has_origin(len)


def test_install_does_not_import_asyncio_or_process_pools_but_patches_them_on_import():
    """install() stays cheap at start-up; modules imported later are patched then."""
    import subprocess
    import textwrap

    code = textwrap.dedent(
        """
        import sys, monstack
        monstack.install()
        assert "asyncio" not in sys.modules and "concurrent.futures.process" not in sys.modules
        import asyncio
        from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
        from monstack import _propagate
        names = sorted(a for _o, a, _x in _propagate.patched())
        assert names.count("submit") == 2 and "create_task" in names and "run_in_executor" in names, names
        assert "multiprocessing.pool" not in sys.modules
        import multiprocessing.pool
        names = sorted(a for _o, a, _x in _propagate.patched())
        assert "apply_async" in names and "imap_unordered" in names, names
        assert asyncio.__spec__.loader.__class__.__name__ == "SourceFileLoader"
        async def boom():
            raise ValueError(1)
        async def main():
            task = asyncio.create_task(boom())  # @created
            try:
                await task
            except ValueError as exc:
                return monstack.origin_of(exc).records()[-1][1]
        print(asyncio.run(main()))
        monstack.uninstall()
        assert not _propagate.patched() and not any(
            type(f).__name__ == "_PostImportHook" for f in sys.meta_path)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    created = [i for i, line in enumerate(code.splitlines(), 1) if "@created" in line][0]
    assert out.stdout.strip() == str(created)


# -- what libraries see is what the user gave them --------------------------------------------------


def documented_job(x: int = 1) -> int:
    """A documented job."""
    return x


async def coroutine_job() -> int:
    return 1


def _answers_like(seen: Any, fn: Any) -> None:
    assert seen is fn or type(seen) in _origin.CARRIER_TYPES, seen
    for name in ("__name__", "__qualname__", "__module__", "__doc__"):
        assert getattr(seen, name) == getattr(fn, name), name
    assert inspect.signature(seen) == inspect.signature(fn)
    assert inspect.iscoroutinefunction(seen) == inspect.iscoroutinefunction(fn)


@pytest.fixture
def work_items(monkeypatch):
    """The callables ThreadPoolExecutor and ProcessPoolExecutor queue (their _WorkItem.fn)."""
    import concurrent.futures.process as cf_process
    import concurrent.futures.thread as cf_thread

    seen: list = []
    for module in (cf_thread, cf_process):
        original = module._WorkItem

        class Recording(original):  # type: ignore[misc, valid-type]
            def __init__(self, future, fn, *rest, _original=original):
                seen.append(fn[0] if type(fn) is tuple else fn)  # 3.14+: (fn, args, kwargs)
                _original.__init__(self, future, fn, *rest)

        monkeypatch.setattr(module, "_WorkItem", Recording)
    return seen


def test_threading_target_is_untouched_and_run_answers(installed):
    seen = {}

    def target():
        me = threading.current_thread()
        seen["target"], seen["run"] = me._target, me.run

    t = threading.Thread(target=target)
    t.start()
    t.join()
    assert seen["target"] is target
    run = seen["run"]
    assert (run.__name__, run.__qualname__, run.__doc__) == ("run", "Thread.run", threading.Thread.run.__doc__)
    assert run.__wrapped__.__func__ is threading.Thread.run


def test_thread_pool_queues_a_callable_that_answers_like_the_job(installed, work_items):
    with cf.ThreadPoolExecutor(1) as pool:
        assert pool.submit(documented_job, 5).result() == 5
        coro = pool.submit(coroutine_job).result()  # nothing runs it: as without monstack
    coro.close()
    job, coro_job = work_items
    _answers_like(job, documented_job)
    assert coro_job is coroutine_job  # a coroutine function travels unwrapped


def test_thread_pool_wraps_plain_functions_but_not_marked_coroutine_functions(installed, work_items):
    """The short path of a plain function submitted to the pool class itself asks what
    ``carry`` asks: coroutine markers in the function's ``__dict__`` keep it unwrapped;
    other attributes do not; a subclass's pool takes the general path, same answer."""
    def marked():
        return None

    marked._is_coroutine_marker = object()  # (what inspect.markcoroutinefunction sets, 3.12+)

    def decorated():
        return monstack.current_origin()

    decorated.extra = 1

    class Pool(cf.ThreadPoolExecutor):
        pass

    for cls in (cf.ThreadPoolExecutor, Pool):
        work_items.clear()
        with cls(1) as pool:
            assert pool.submit(marked).result() is None
            inside = pool.submit(decorated).result()  # @plain-submit
        assert work_items[0] is marked
        assert type(work_items[1]) in _origin.CARRIER_TYPES and work_items[1].__wrapped__ is decorated
        assert work_items[1]._sent is None
        assert_created_at(inside, "plain-submit")


def test_process_pool_pickles_a_callable_that_answers_like_the_job(installed, work_items, process_pool):
    import pickle

    assert process_pool.submit(documented_job, 7).result() == 7  # @proc-answers
    (job,) = work_items
    _answers_like(job, documented_job)
    back = pickle.loads(pickle.dumps(job))
    _answers_like(back, documented_job)
    assert_created_at(back._snap, "proc-answers")


def test_mp_pool_pickles_a_callable_that_answers_like_the_job(installed, mp_process_pool, monkeypatch):
    import multiprocessing.pool as mpool

    seen: list = []
    original = mpool.Pool._get_tasks

    def recording(func, it, size):
        seen.append(func)
        return original(func, it, size)

    monkeypatch.setattr(mpool.Pool, "_get_tasks", staticmethod(recording))
    assert mp_process_pool.map(documented_job, [3]) == [3]
    _answers_like(seen[0], documented_job)


def test_asyncio_task_gets_the_users_coroutine_and_name(installed):
    async def main():
        coro = report_origin()
        task = asyncio.get_running_loop().create_task(coro, name="mine")
        await task
        return task.get_coro() is coro, task.get_name()

    assert asyncio.run(main()) == (True, "mine")


def test_asyncio_debug_mode_still_refuses_coroutines_in_run_in_executor(installed):
    """Found by CPython's test_asyncio under MONSTACK=1: the wrapper hid the coroutine
    function from asyncio's debug check."""

    async def main():
        loop = asyncio.get_running_loop()
        with pytest.raises(TypeError, match="coroutines cannot be used with run_in_executor"):
            await loop.run_in_executor(None, coroutine_job)
        coro = coroutine_job()
        try:
            with pytest.raises(TypeError, match="coroutines cannot be used with run_in_executor"):
                await loop.run_in_executor(None, coro)
        finally:
            coro.close()
        return await loop.run_in_executor(None, documented_job)

    assert asyncio.run(main(), debug=True) == 1


class InlineThreadExecutor(cf.Executor):
    """A custom executor (not a ThreadPoolExecutor): one new thread per job."""

    def __init__(self) -> None:
        self.received: list = []

    def submit(self, fn, /, *args, **kwargs):
        self.received.append(fn)
        future: cf.Future = cf.Future()

        def run():
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=run).start()
        return future


def test_asyncio_run_in_executor_with_a_custom_executor(installed):
    executor = InlineThreadExecutor()

    async def main():
        loop = asyncio.get_running_loop()
        inside = await loop.run_in_executor(executor, current_origin)  # @rie-custom
        try:
            await loop.run_in_executor(executor, fail)  # @rie-custom-fail
        except Boom as exc:
            return inside, exc

    inside, exc = asyncio.run(main())
    assert_created_at(inside, "rie-custom")
    assert_created_at(origin_of(exc), "rie-custom-fail")
    _answers_like(executor.received[1], fail)


def test_asyncio_to_thread_bound_before_install_carries_the_origin():
    """asyncio.to_thread itself is no longer patched: run_in_executor wraps the function
    inside to_thread's partial(ctx.run, ...), so any reference to it works."""
    to_thread = asyncio.to_thread  # as `from asyncio import to_thread` before install()
    monstack.install()

    async def main():
        inside = await to_thread(current_origin)  # @to-thread-early
        snap = await to_thread(monstack.snapshot)  # @to-thread-early-2
        return inside, snap

    inside, snap = asyncio.run(main())
    assert_created_at(inside, "to-thread-early")
    assert_created_at(snap.origin, "to-thread-early-2")


# -- _thread.start_new_thread -------------------------------------------------------------------------


def test_start_new_thread_carries_origin(installed, monkeypatch):
    import _thread

    caught: list = []
    done = threading.Event()
    monkeypatch.setattr(sys, "unraisablehook", lambda u: (caught.append(u), done.set()))
    seen = {}

    def job(x, y=0):
        seen["origin"] = current_origin()
        raise Boom(x + y)

    _thread.start_new_thread(job, (1,), {"y": 2})  # @start-new-thread
    assert done.wait(30)
    assert_created_at(seen["origin"], "start-new-thread")
    (u,) = caught
    assert u.exc_value.args == (3,)
    assert_created_at(origin_of(u.exc_value), "start-new-thread")
    if u.object is not None:  # 3.11/3.12: the function is the hook's object; it answers as job
        assert repr(u.object) == repr(job) and u.object.__name__ == "job"
    else:  # 3.13+: its repr is in the message
        assert u.err_msg == f"Exception ignored in thread started by {job!r}"
    _assert_no_monstack_frames(u.exc_value, "job")


def test_start_new_thread_default_hook_prints_the_origin():
    """3.11-3.14's default unraisablehook prints no notes: the report is printed with it
    (3.15's hook prints notes itself). Run in a child: pytest has a hook of its own. The
    child waits for the thread to end (its report is printed before _thread's count of
    running threads drops), not for a time: under emulation a second was not enough."""
    import subprocess

    program = (
        "import _thread, time, monstack\n"
        "monstack.install()\n"
        "started = _thread.allocate_lock(); started.acquire()\n"
        "def job():\n"
        "    started.release()\n"
        "    raise ValueError('in the thread')\n"
        "_thread.start_new_thread(job, ())\n"
        "started.acquire()\n"
        "deadline = time.monotonic() + 60\n"
        "while _thread._count() and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "print('main goes on')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout == "main goes on\n", out
    err = out.stderr
    assert "Exception ignored in thread started by" in err and "<function job at " in err
    assert "ValueError: in the thread" in err
    assert 'Work created at (most recent call last):\n  File "<string>", line 7, in <module>' in err
    assert "monstack" not in err.split("Work created at")[0].replace("import _thread, time, monstack", "")


def test_threading_still_starts_threads_once_through_start_new_thread(installed, thread_errors):
    """3.11/3.12's Thread.start goes through _thread.start_new_thread: one origin, the
    threading point's."""
    t = threading.Thread(target=fail)
    t.start()  # @thread-once
    t.join()
    snap = origin_of(thread_errors[0])
    assert_created_at(snap, "thread-once")
    assert snap.origin is None


# -- multiprocessing.Process subclasses with their own run() ----------------------------------------


_PROCESS_PROGRAM = """\
import multiprocessing, sys, monstack

class Worker(multiprocessing.Process):
    def run(self):
        print("child origin:", monstack.current_origin() is not None, flush=True)
        raise ValueError("failed in run()")

if __name__ == "__main__":
    monstack.install()
    multiprocessing.set_start_method(sys.argv[1])
    p = Worker()
    p.start()  # @child-start
    p.join()
    print("exitcode", p.exitcode, "run" in vars(p))
"""


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_process_subclass_with_its_own_run_carries_origin(tmp_path, method):
    import subprocess

    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {method} start method here")
    script = tmp_path / "subclass_run.py"
    script.write_text(_PROCESS_PROGRAM)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, str(script), method], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "child origin: True" in out.stdout and "exitcode 1 False" in out.stdout, out
    start_line = [i for i, line in enumerate(_PROCESS_PROGRAM.splitlines(), 1) if "@child-start" in line][0]
    err = out.stderr
    assert "ValueError: failed in run()" in err
    assert f'Work created at (most recent call last):\n  File "{script}", line {start_line}, in <module>' in err
    assert "monstack" not in err.split("Work created at")[0]


# -- asyncio tasks with their own context, TaskGroup ------------------------------------------------


def test_asyncio_explicit_context_is_not_changed_but_the_failure_has_the_origin(installed):
    import contextvars

    async def main():
        ctx = contextvars.copy_context()
        loop = asyncio.get_running_loop()
        inside = await loop.create_task(report_origin(), context=ctx)
        task = loop.create_task(afail(), context=ctx)  # @context-task
        try:
            await task
        except Boom as exc:
            return inside, exc, ctx

    inside, exc, ctx = asyncio.run(main())
    assert inside is None  # the task ran in ctx, which never gained our variable
    assert _snapshot.CURRENT_ORIGIN not in ctx
    assert_created_at(origin_of(exc), "context-task")


def test_asyncio_run_main_task_gets_no_note(installed):
    async def main():
        raise Boom("in main")

    with pytest.raises(Boom) as info:
        asyncio.run(main())
    assert origin_of(info.value) is None and not getattr(info.value, "__notes__", None)


def test_asyncio_taskgroup_with_context(installed):
    import contextvars

    async def main():
        ctx = contextvars.copy_context()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(afail(), context=ctx)  # @taskgroup-context
        except ExceptionGroup as group:
            return group.exceptions, ctx

    (exc,), ctx = asyncio.run(main())
    assert_created_at(origin_of(exc), "taskgroup-context")
    assert _snapshot.CURRENT_ORIGIN not in ctx


def test_asyncio_run_in_executor_with_a_process_pool(installed, process_pool):
    async def main():
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(process_pool, operator.truediv, 1, 0)  # @rie-process
        except ZeroDivisionError as exc:
            return exc

    assert_created_at(origin_of(asyncio.run(main())), "rie-process")


@needs_interpreter_pool
def test_asyncio_run_in_executor_with_an_interpreter_pool(installed):
    def boom(x):
        raise ValueError(x)

    async def main():
        with cf.InterpreterPoolExecutor(1) as pool:
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(pool, operator.add, 1, 2) == 3
            try:
                await loop.run_in_executor(pool, boom, 5)  # @rie-interp
            except ValueError as exc:
                return exc

    assert_created_at(origin_of(asyncio.run(main())), "rie-interp")


# -- composing with other patchers (the real packages: tests/integration/test_patchers.py) ----------------


class _Descriptor:
    """A class attribute that is not a function (as wrapt's FunctionWrapper is): it sees
    the instance only when called through the descriptor protocol."""

    def __init__(self, wrapped: Any, seen: list) -> None:
        self.wrapped, self.seen = wrapped, seen

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        wrapped, seen = self.wrapped, self.seen

        def bound(*args: Any, **kwargs: Any) -> Any:
            seen.append(instance)
            return wrapped(instance, *args, **kwargs)

        return bound


def test_a_replaced_class_attribute_is_called_through_the_descriptor_protocol():
    monstack.uninstall()
    seen_start: list = []
    seen_submit: list = []
    original_start, original_submit = threading.Thread.__dict__["start"], cf.ThreadPoolExecutor.__dict__["submit"]
    threading.Thread.start = _Descriptor(original_start, seen_start)  # type: ignore[method-assign,assignment]
    cf.ThreadPoolExecutor.submit = _Descriptor(original_submit, seen_submit)  # type: ignore[method-assign,assignment]
    try:
        monstack.install()
        try:
            got = []
            t = threading.Thread(target=lambda: got.append(monstack.current_origin()))
            t.start()  # @descriptor-start
            t.join()
            with cf.ThreadPoolExecutor(1) as pool:
                future = pool.submit(monstack.current_origin)  # @descriptor-submit
                origin = future.result()
        finally:
            monstack.uninstall()
        assert seen_start[0] is t and seen_submit == [pool]
        assert_created_at(got[0], "descriptor-start")
        assert_created_at(origin, "descriptor-submit")
    finally:
        threading.Thread.start = original_start  # type: ignore[method-assign]
        cf.ThreadPoolExecutor.submit = original_submit  # type: ignore[method-assign]


def test_a_threads_run_keeps_the_func_convention():
    """A ``Thread.start`` patch applied before monstack's that calls
    ``thread.run.__func__(thread)`` (as Sentry's threading integration does) runs
    monstack's run: the same work, under the origin."""
    monstack.uninstall()
    original = threading.Thread.__dict__["start"]

    def sentry_style_start(self: threading.Thread) -> None:
        run = getattr(self.run, "__func__", self.run)
        self.run = lambda: run(self)  # type: ignore[method-assign]
        return original(self)

    threading.Thread.start = sentry_style_start  # type: ignore[method-assign]
    try:
        monstack.install()
        try:
            got = []
            t = threading.Thread(target=lambda: got.append(monstack.current_origin()))
            t.start()  # @func-start
            t.join()
        finally:
            monstack.uninstall()
        assert_created_at(got[0], "func-start")
    finally:
        threading.Thread.start = original  # type: ignore[method-assign]


# -- a thread started at interpreter shutdown ---------------------------------------------------

AT_SHUTDOWN = """\
import {module}
def work():
    pass
class AtFinalization:
    def __del__(self):
        print("OK")
        {start}
at_finalization = AtFinalization()
"""


@pytest.mark.parametrize("how", ["start_new_thread", "threading"])
def test_a_thread_started_at_interpreter_shutdown_fails_as_without_monstack(how, tmp_path):
    """At shutdown (a ``__del__`` run while modules are finalized, ``sys.meta_path`` gone)
    CPython refuses a new thread with its own RuntimeError; where a point cannot load what
    it needs then (``start_new_thread``'s loads its family with the first thread), it calls
    through, so the program sees that error, with the same traceback, under monstack too."""
    import re
    import subprocess

    if how == "threading" and sys.version_info < (3, 12):
        pytest.skip("CPython 3.11's Thread.start() at shutdown waits forever, with or without monstack")
    start = "_thread.start_new_thread(work, ())" if how == "start_new_thread" else "threading.Thread(target=work).start()"
    program = tmp_path / "prog.py"
    program.write_text(AT_SHUTDOWN.format(module="_thread" if how == "start_new_thread" else "threading", start=start))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    outs = []
    for on in ("0", "1"):
        env = dict(os.environ, PYTHONPATH=root, MONSTACK=on)
        out = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, env=env, timeout=60)
        outs.append((out.returncode, out.stdout, re.sub(r"0x[0-9a-fA-F]+", "0x?", out.stderr)))
    if sys.version_info >= (3, 12):
        assert "can't create new thread at interpreter shutdown" in outs[0][2]  # (the case is real)
    assert outs[1] == outs[0]


# -- a hop from code the policy filters ---------------------------------------------------------

FILTERED_JOB = """\
def job(snapshot, out, n):
    for _ in range(n):
        out.append(snapshot())
"""


def test_a_snapshot_with_only_filtered_code_on_the_stack_does_not_walk_the_frames(installed, monkeypatch):
    """A thread running only filtered code (the user's code excluded, a framework's
    thread): its snapshots are empty and linked to the thread's origin, as capture()'s
    walk answers, but only the first (which seeds the thread) goes through it."""
    import sysconfig

    from monstack import _capture

    if monstack.status()["backend"] == "walk":
        pytest.skip("no shadow stack to agree with (walk backend)")
    filename = os.path.join(sysconfig.get_paths()["purelib"], "monstack_test_filtered", "jobs.py")
    namespace: dict = {}
    exec(compile(FILTERED_JOB, filename, "exec"), namespace)
    backend = _capture.running().backend
    calls: list = []
    original = backend.capture

    def counting(frame):
        calls.append(frame)
        return original(frame)

    monkeypatch.setattr(backend, "capture", counting, raising=False)
    out: list = []
    thread = threading.Thread(target=namespace["job"], args=(monstack.snapshot, out, 5))
    thread.start()  # @filtered-start
    thread.join()
    assert len(out) == 5
    for snap in out:
        assert snap.records() == ()
        assert_created_at(snap.origin, "filtered-start")
    assert len([f for f in calls if f is not None and f.f_code.co_filename == filename]) <= 1
