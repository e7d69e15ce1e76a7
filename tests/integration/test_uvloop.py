"""uvloop: its loop is compiled, but ``uvloop.Loop`` is a Python subclass, so
``create_task`` and ``run_in_executor`` are patched there. Needs the ``integration`` extra."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextvars
import os
import subprocess
import sys
import threading
from typing import Any, Optional

import pytest

import stackcheck
from conftest import integration_module

import monstack
from monstack import _snapshot

pytestmark = pytest.mark.integration
uvloop = integration_module("uvloop")

THIS_FILE = __file__
line_of = stackcheck.marker_lines(__file__)


class Boom(Exception):
    pass


def assert_created_at(snap: Optional[monstack.Snapshot], marker: str) -> None:
    assert snap is not None, "no origin"
    recs = snap.records()
    assert (recs[-1][0], recs[-1][1]) == (THIS_FILE, line_of(marker)), snap.format(color=False)


async def afail() -> None:
    await asyncio.sleep(0)
    raise Boom("failed in a task")


async def report_origin() -> Optional[monstack.Snapshot]:
    return monstack.current_origin()


def fail() -> None:
    raise Boom("failed in the executor")


def run(coro: Any) -> Any:
    return uvloop.run(coro)


def test_tasks_on_uvloop_carry_origin(installed):
    async def main() -> Any:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        inside = await asyncio.create_task(report_origin())  # @create-task
        task = asyncio.get_running_loop().create_task(afail())  # @loop-create-task
        try:
            await task
        except Boom as exc:
            return inside, exc

    inside, exc = run(main())
    assert_created_at(inside, "create-task")
    assert_created_at(monstack.origin_of(exc), "loop-create-task")


def test_taskgroup_and_gather_on_uvloop(installed):
    async def main() -> Any:
        results = await asyncio.gather(report_origin(), afail(), return_exceptions=True)  # @gather
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(afail())  # @taskgroup
        except ExceptionGroup as group:
            return results, group.exceptions[0]

    (inside, gathered), grouped = run(main())
    assert_created_at(inside, "gather")
    assert_created_at(monstack.origin_of(gathered), "gather")
    assert_created_at(monstack.origin_of(grouped), "taskgroup")


def test_explicit_context_on_uvloop_is_not_changed(installed):
    async def main() -> Any:
        ctx = contextvars.copy_context()
        task = asyncio.get_running_loop().create_task(afail(), context=ctx)  # @context-task
        try:
            await task
        except Boom as exc:
            return exc, ctx

    exc, ctx = run(main())
    assert_created_at(monstack.origin_of(exc), "context-task")
    assert _snapshot.CURRENT_ORIGIN not in ctx


def test_main_task_on_uvloop_gets_no_note(installed):
    async def main() -> None:
        raise Boom("in main")

    with pytest.raises(Boom) as info:
        run(main())
    assert monstack.origin_of(info.value) is None


class OwnThreadExecutor(cf.Executor):
    def submit(self, fn, /, *args, **kwargs):
        future: cf.Future = cf.Future()

        def work() -> None:
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=work).start()
        return future


def test_executors_and_to_thread_on_uvloop(installed):
    async def main() -> Any:
        loop = asyncio.get_running_loop()
        out = [await loop.run_in_executor(None, monstack.current_origin)]  # @rie
        out.append(await loop.run_in_executor(OwnThreadExecutor(), monstack.current_origin))  # @rie-custom
        out.append(await asyncio.to_thread(monstack.current_origin))  # @to-thread
        try:
            await asyncio.to_thread(fail)  # @to-thread-fail
        except Boom as exc:
            out.append(monstack.origin_of(exc))
        return out

    for snap, marker in zip(run(main()), ["rie", "rie-custom", "to-thread", "to-thread-fail"]):
        assert_created_at(snap, marker)


async def coroutine_job() -> None:
    pass


def test_uvloop_still_refuses_coroutine_functions_in_run_in_executor(installed):
    async def main() -> None:
        with pytest.raises(TypeError, match="coroutines cannot be used with run_in_executor"):
            await asyncio.get_running_loop().run_in_executor(None, coroutine_job)

    run(main())


def test_uninstall_shows_the_compiled_methods_again():
    base = uvloop.Loop.__mro__[1]
    monstack.install()
    assert "create_task" in vars(uvloop.Loop) and "run_in_executor" in vars(uvloop.Loop)
    monstack.uninstall()
    assert "create_task" not in vars(uvloop.Loop) and "run_in_executor" not in vars(uvloop.Loop)
    assert uvloop.Loop.create_task is base.create_task


def test_uvloop_is_patched_when_imported_after_install():
    program = (
        "import sys, monstack\n"
        "monstack.install()\n"
        "assert 'uvloop' not in sys.modules\n"
        "import asyncio, uvloop\n"
        "async def boom():\n"
        "    raise ValueError(1)\n"
        "async def main():\n"
        "    task = asyncio.create_task(boom())\n"
        "    try:\n"
        "        await task\n"
        "    except ValueError as exc:\n"
        "        return monstack.origin_of(exc).records()[-1][1]\n"
        "print(uvloop.run(main()))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "8"
