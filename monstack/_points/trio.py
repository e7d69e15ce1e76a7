"""The ``trio`` point: ``nursery.start_soon``/``start`` (trio's ``Runner.spawn_impl``) and
``trio.to_thread.run_sync`` (see ``monstack._propagate``)."""

from __future__ import annotations

import sys

from . import ON, PATCHES, binder, patch, take
from .._origin import attach_if_absent, carry, has_origin
from .._snapshot import CURRENT_ORIGIN

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable


#: trio tasks spawned with an origin -> that origin (attached when the task fails).
_TRIO_TASKS: Any = None


def apply() -> None:
    import weakref

    trio_run = sys.modules["trio._core._run"]  # loaded by trio's own import, as is:
    trio_threads = sys.modules["trio._threads"]

    global _TRIO_TASKS
    if _TRIO_TASKS is None:
        _TRIO_TASKS = weakref.WeakKeyDictionary()
    tasks = _TRIO_TASKS
    Runner = trio_run.Runner

    def make_spawn(original: Callable[..., Any]) -> Callable[..., Any]:
        call = binder(original)  # calls it as Python would: through __get__

        def spawn_impl(self: Any, async_fn: Any, args: Any, nursery: Any, *rest: Any, **kwargs: Any) -> Any:
            # Not system tasks, not the main task (its exception comes out of trio.run();
            # the init task spawns it, in a nursery of its own), not a task given its own
            # context.
            if ("trio" not in ON or kwargs.get("system_task") or kwargs.get("context") is not None
                    or nursery is None or getattr(nursery, "parent_task", None) is getattr(self, "init_task", None)):
                return call(self, async_fn, args, nursery, *rest, **kwargs)
            snap = take()
            task = call(self, async_fn, args, nursery, *rest, **kwargs)
            if snap is not None:
                try:
                    # the task's own context (a fresh copy): its code sees the origin
                    task.context.run(CURRENT_ORIGIN.set, snap)
                    tasks[task] = snap
                except Exception:
                    pass
            return task

        return spawn_impl

    def make_exited(original: Callable[..., Any]) -> Callable[..., Any]:
        call = binder(original)  # calls it as Python would: through __get__

        def task_exited(self: Any, task: Any, outcome: Any, *rest: Any, **kwargs: Any) -> Any:
            if tasks:
                try:
                    snap = tasks.pop(task, None)
                    if snap is not None:
                        exc = getattr(outcome, "error", None)
                        if isinstance(exc, Exception):
                            attach_if_absent(exc, snap)
                except Exception:
                    pass
            return call(self, task, outcome, *rest, **kwargs)

        return task_exited

    def make_run_sync(original: Callable[..., Any]) -> Callable[..., Any]:  # (a module's function)
        async def run_sync(sync_fn: Any, *args: Any, **kwargs: Any) -> Any:
            # The body runs when awaited: the snapshot is the awaiting line.
            if "trio" in ON and not has_origin(sync_fn):
                snap = take()
                if snap is not None:
                    sync_fn = carry(sync_fn, snap)
            return await original(sync_fn, *args, **kwargs)

        return run_sync

    patch(Runner, "spawn_impl", make_spawn)
    patch(Runner, "task_exited", make_exited)
    patch(trio_threads, "to_thread_run_sync", make_run_sync)
    original, replacement = PATCHES[-1][2], PATCHES[-1][3]
    to_thread = sys.modules.get("trio.to_thread")
    if to_thread is not None and to_thread.__dict__.get("run_sync") is original:
        setattr(to_thread, "run_sync", replacement)
        PATCHES.append((to_thread, "run_sync", original, replacement))
