"""The ``trio`` propagation point: nursery tasks and ``trio.to_thread.run_sync`` carry the
line that started them; nothing else about the program changes. Needs the ``integration``
extra."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any, Optional

import pytest

import stackcheck
from conftest import integration_module

import monstack
from monstack import _origin, _propagate

pytestmark = pytest.mark.integration
trio = integration_module("trio")

THIS_FILE = __file__
line_of = stackcheck.marker_lines(__file__)


class Boom(Exception):
    pass


def assert_created_at(snap: Optional[monstack.Snapshot], marker: str) -> None:
    assert snap is not None, "no origin"
    recs = snap.records()
    assert (recs[-1][0], recs[-1][1]) == (THIS_FILE, line_of(marker)), snap.format(color=False)


def leaves(group: BaseException) -> list[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        return [e for sub in group.exceptions for e in leaves(sub)]
    return [group]


async def fails() -> None:
    await trio.sleep(0)
    raise Boom("failed in a trio task")


def test_start_soon_task_carries_origin(installed):
    seen: dict = {}

    async def child() -> None:
        seen["origin"] = monstack.current_origin()
        seen["snap"] = monstack.snapshot()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)  # @start-soon
            nursery.start_soon(fails)  # @start-soon-fail

    with pytest.raises(BaseException) as info:
        trio.run(main)
    (exc,) = leaves(info.value)
    assert isinstance(exc, Boom)
    assert_created_at(monstack.origin_of(exc), "start-soon-fail")
    assert_created_at(seen["origin"], "start-soon")
    assert seen["snap"].origin is seen["origin"]
    text = monstack.format_exception(info.value, color=False)
    assert f'"{THIS_FILE}", line {line_of("start-soon-fail")}, in main' in text
    # the member's origin shows as its note; the exceptions themselves are as they were
    assert text.index("Boom: failed in a trio task") < text.index("Work created at (most recent call last):")
    import traceback

    assert "Work created at" not in "".join(traceback.format_exception(info.value))
    assert not hasattr(exc, "__notes__") and str(exc) == "failed in a trio task"


def test_nursery_start_carries_origin(installed):
    seen: dict = {}

    async def server(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(monstack.current_origin())
        await trio.sleep(0)
        raise Boom("after started()")

    async def refuses(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        raise Boom("before started()")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            try:
                await nursery.start(refuses)  # @start-refuses
            except Boom as exc:  # start() raises it in the caller
                seen["early"] = exc
            seen["inside"] = await nursery.start(server)  # @start

    with pytest.raises(BaseException) as info:
        trio.run(main)
    (exc,) = leaves(info.value)
    assert_created_at(monstack.origin_of(exc), "start")
    assert_created_at(seen["inside"], "start")
    assert_created_at(monstack.origin_of(seen["early"]), "start-refuses")


def test_to_thread_run_sync_carries_origin(installed):
    def job() -> Any:
        return monstack.current_origin(), "run" in vars(threading.current_thread())

    def job_fails() -> None:
        raise Boom("in trio's worker thread")

    async def main() -> Any:
        inside, bound = await trio.to_thread.run_sync(job)  # @to-thread
        try:
            await trio.to_thread.run_sync(job_fails)  # @to-thread-fail
        except Boom as exc:
            return inside, bound, exc

    inside, bound, exc = trio.run(main)
    assert_created_at(inside, "to-thread")
    assert_created_at(monstack.origin_of(exc), "to-thread-fail")
    assert not bound  # trio's cached worker threads get no thread-level origin


def test_main_task_and_system_tasks_get_no_origin(installed):
    async def main() -> None:
        raise Boom("in main")

    with pytest.raises(Boom) as info:
        trio.run(main)
    assert monstack.origin_of(info.value) is None and not getattr(info.value, "__notes__", None)


def _names() -> tuple[str, str]:
    """The name trio gives a task and the name of the thread to_thread runs a job in."""
    seen: dict = {}

    async def named_child() -> None:
        seen["task"] = trio.lowlevel.current_task().name

    def named_job() -> None:
        seen["thread"] = threading.current_thread().name

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(named_child)
        await trio.to_thread.run_sync(named_job)

    trio.run(main)
    return seen["task"], seen["thread"]


def test_names_trio_gives_are_unchanged():
    without = _names()
    monstack.install()
    assert _names() == without
    assert without[0].endswith("named_child") and without[1].startswith("named_job from ")


def test_to_thread_refuses_async_functions_as_without_monstack(installed):
    async def not_sync() -> None:
        pass

    async def main() -> None:
        await trio.to_thread.run_sync(not_sync)

    with pytest.raises(TypeError, match="appears to be asynchronous"):
        trio.run(main)


def test_point_off_leaves_trio_alone():
    monstack.install(propagate=["threading"])
    assert not [p for p in _propagate.patched() if "trio" in getattr(p[0], "__module__", "") + str(p[0])]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fails)

    with pytest.raises(BaseException) as info:
        trio.run(main)
    assert _origin.origin_of(leaves(info.value)[0]) is None


def test_trio_is_patched_when_imported_and_never_imported_by_install():
    program = (
        "import sys, monstack\n"
        "monstack.install()\n"
        "assert 'trio' not in sys.modules\n"
        "import trio\n"
        "from monstack import _propagate\n"
        "print(sorted(a for o, a, _ in _propagate.patched() if 'trio' in repr(o)))\n"
        "async def child():\n"
        "    raise ValueError(1)\n"
        "async def main():\n"
        "    async with trio.open_nursery() as n:\n"
        "        n.start_soon(child)\n"
        "try:\n"
        "    trio.run(main)\n"
        "except BaseExceptionGroup as g:\n"
        "    print(monstack.origin_of(g.exceptions[0]).records()[-1][1])\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == [
        "['run_sync', 'spawn_impl', 'task_exited', 'to_thread_run_sync']", "11"], out.stdout
