"""Coroutine exits (``monstack._backend.COROUTINE_EXIT``): what the tracking backends
report (an ``Exception`` leaving a coroutine frame that nothing awaits), and the
``asyncio_tasks`` point, which attaches a failed task's origin there instead of with a
done callback per task."""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import sys
from typing import Any, Optional

import pytest

import stackcheck

import monstack
from monstack import _backend, _snapshot, origin_of
from monstack._points import asyncio as _points_asyncio

THIS_FILE = __file__


class Boom(Exception):
    pass


def line_of(marker: str) -> int:
    with open(THIS_FILE) as f:
        for number, line in enumerate(f, 1):
            if line.rstrip().endswith(f"# @{marker}"):
                return number
    raise AssertionError(marker)


def assert_created_at(snap: Optional[monstack.Snapshot], marker: str) -> None:
    assert snap is not None, f"no origin (expected the line marked @{marker})"
    frames = [(f.filename, f.lineno) for f in snap.frames]
    assert (THIS_FILE, line_of(marker)) in frames, frames


@pytest.fixture
def exits(installed):
    """The exits the backend reports while the test runs, as (code name, exception type)."""
    seen: list = []
    saved = _backend.COROUTINE_EXIT[0]
    _backend.COROUTINE_EXIT[0] = lambda code, exc: seen.append((code.co_name, type(exc).__name__))
    try:
        yield seen
    finally:
        _backend.COROUTINE_EXIT[0] = saved


async def inner() -> None:
    await asyncio.sleep(0)
    raise Boom("inner")


async def outer() -> None:
    await inner()


async def catches() -> str:
    try:
        await inner()
    except Boom:
        return "caught"
    return "not reached"


def test_backends_that_track_report_exits(installed):
    assert _backend.EXITS_REPORTED == [True]
    monstack.uninstall()
    assert _backend.EXITS_REPORTED == [False]
    monstack.install(backend="walk")
    assert _backend.EXITS_REPORTED == [False]


def test_only_the_outermost_coroutine_of_a_failing_task_is_reported(exits):
    async def main():
        with pytest.raises(Boom):
            await asyncio.create_task(outer())
        return await asyncio.create_task(catches())

    assert asyncio.run(main()) == "caught"
    # main's own frames: the Boom left outer's task, and pytest.raises caught it in main
    assert exits == [("outer", "Boom")]


def test_cancellation_and_other_base_exceptions_are_not_reported(exits):
    async def sleeper():
        await asyncio.sleep(10)

    async def exits_the_loop():
        raise SystemExit(3)

    async def main():
        task = asyncio.create_task(sleeper())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    with pytest.raises(SystemExit):
        asyncio.run(exits_the_loop())
    assert exits == []


def test_a_coroutine_awaited_by_an_async_generator_is_not_outermost(exits):
    async def agen():
        try:
            await inner()
        except Boom:
            yield "caught in the generator"

    async def main():
        return [item async for item in agen()]

    assert asyncio.run(main()) == ["caught in the generator"]
    assert exits == []


def test_a_coroutine_driven_by_hand_is_reported_the_handler_decides(exits):
    async def fails_at_once():
        raise Boom("by hand")

    coro = fails_at_once()
    with pytest.raises(Boom):
        coro.send(None)
    assert exits == [("fails_at_once", "Boom")]


def test_filtered_coroutines_are_reported_too(tmp_path, monkeypatch):
    (tmp_path / "exits_filtered_mod.py").write_text(
        "import asyncio\n\n"
        "async def lib_fails():\n"
        "    await asyncio.sleep(0)\n"
        "    raise ValueError('in filtered code')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("exits_filtered_mod")
    monstack.uninstall()
    monstack.install(exclude=[str(tmp_path)])
    try:
        async def main():
            task = asyncio.create_task(mod.lib_fails())  # @filtered
            try:
                await task
            except ValueError as exc:
                return exc

        exc = asyncio.run(main())
    finally:
        monstack.uninstall()
        sys.modules.pop("exits_filtered_mod", None)
    assert_created_at(origin_of(exc), "filtered")


def test_the_shadow_stack_stays_the_real_one_across_exits(installed, no_resync):
    # the handler runs Python while the failing frame is still on the stack: afterwards the
    # shadow stack must be the real one, with no repair
    async def leaf():
        stackcheck.check("in the task's innermost coroutine")
        await asyncio.sleep(0)
        raise Boom("leaf")

    async def mid():
        await leaf()

    async def fails_at_once():
        raise Boom("by hand")

    async def main():
        stackcheck.check("main, before")
        for _ in range(3):
            with pytest.raises(Boom):
                await asyncio.create_task(mid())  # an exit, reported
            stackcheck.check("main, after a task failed")
            with pytest.raises(Boom):
                await mid()  # awaited by main: no exit
            stackcheck.check("main, after a direct await failed")
        coro = fails_at_once()
        with pytest.raises(Boom):
            coro.send(None)  # an exit the handler looks at and leaves
        return stackcheck.check("main, at the end")

    assert asyncio.run(main()) >= 1
    stackcheck.check("after the loop")


# -- the asyncio_tasks point ----------------------------------------------------------


def _has_done_callback(task: Any) -> bool:
    entries = task._callbacks or ()
    return any(isinstance(e[0] if isinstance(e, tuple) else e, _points_asyncio._TaskDone) for e in entries)


@pytest.mark.parametrize("backend", ["auto", "walk"])
def test_a_failed_task_gets_its_origin_with_or_without_exits(backend):
    monstack.uninstall()
    monstack.install(backend=backend)
    try:
        async def main():
            task = asyncio.create_task(outer())  # @task-origin
            callback = _has_done_callback(task)
            try:
                await task
            except Boom as exc:
                return callback, exc

        callback, exc = asyncio.run(main())
    finally:
        monstack.uninstall()
    # a backend that reports exits needs no done callback per task; walk does
    assert callback is (backend == "walk")
    assert_created_at(origin_of(exc), "task-origin")


def test_stop_iteration_becomes_the_tasks_runtime_error_with_the_origin(installed):
    async def raises_stop():
        await asyncio.sleep(0)
        raise StopIteration

    async def main():
        task = asyncio.create_task(raises_stop())  # @stop-iteration
        try:
            await task
        except RuntimeError as exc:
            return exc

    exc = asyncio.run(main())
    assert isinstance(exc.__cause__, StopIteration)  # PEP 479, as without monstack
    assert_created_at(origin_of(exc), "stop-iteration")


def test_a_task_with_its_own_context_gets_its_creation_site_not_the_contexts(installed):
    async def creator():
        ctx = contextvars.copy_context()  # holds creator's own origin
        assert ctx.get(_snapshot.CURRENT_ORIGIN) is not None
        task = asyncio.get_running_loop().create_task(outer(), context=ctx)  # @own-context
        try:
            await task
        except Boom as exc:
            return exc

    async def main():
        return await asyncio.create_task(creator())  # @creator

    exc = asyncio.run(main())
    snap = origin_of(exc)
    assert_created_at(snap, "own-context")
    # the innermost hop is the task's own creation; the creator's is the chain behind it
    assert (THIS_FILE, line_of("own-context")) == (snap.frames[-1].filename, snap.frames[-1].lineno)


def test_a_task_failing_after_uninstall_is_left_as_it_is():
    monstack.uninstall()
    monstack.install()

    async def main():
        task = asyncio.create_task(outer())
        await asyncio.sleep(0)
        monstack.uninstall()
        assert _backend.COROUTINE_EXIT == [None]
        try:
            await task
        except Boom as exc:
            return exc

    try:
        exc = asyncio.run(main())
    finally:
        monstack.uninstall()
    assert origin_of(exc) is None
