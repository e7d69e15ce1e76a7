#!/usr/bin/env python3
"""Instructions per hop (an asyncio task, a thread-pool job), for valgrind: deterministic
where this box's wall clock is not. ``WORKLOAD MODE N`` runs N hops once, after 200 of
warm-up:

  WORKLOAD  ``asyncio``: ``asyncio.run`` of ``create_task`` x N trivial coroutines +
            ``gather``; ``pool``: ``ThreadPoolExecutor(1).submit`` x N of a trivial
            function, then every ``result()``.
  MODE      ``off`` (no monstack), ``default`` (``install()``), ``filtered`` (everything
            on the stack excluded by the policy: no tracked frame at all), ``floor``
            (``install(propagate=False)`` plus a task factory / ``submit`` wrapper that
            only takes ``monstack.snapshot()``). ``ACC=0`` / ``ACC=1``: ``accelerator=``.

``SWITCH=100``: the switch interval in seconds (``sys.setswitchinterval``): the pool's
submitting thread then queues all N jobs before the worker runs one, so the count no
longer depends on how valgrind happened to interleave the threads (without it, two runs
of one tree differ by up to ~4,000 instructions per job). ``GC=0``: the collector
disabled, which leaves out collections whose cost depends on where the allocations
happen to fall against the young generation's threshold (with ``SWITCH=100`` all N jobs
are alive at once, so each young collection traverses them).

Per hop = (instructions at N=3000 - at N=1000) / 2000::

    for n in 1000 3000; do
      PYTHONHASHSEED=0 PYTHONPATH=. valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python3.12 bench/hop_instructions.py asyncio default $n 2>&1 | grep Collected
    done
"""

import asyncio
import os
import sys
import types
from concurrent.futures import ThreadPoolExecutor

SRC = """
import asyncio

async def trivial():
    return 1

async def amain(n):
    tasks = [asyncio.create_task(trivial()) for _ in range(n)]
    await asyncio.gather(*tasks)

def arun(n):
    asyncio.run(amain(n))

def job(x):
    return x

def prun(n, ex):
    futures = [ex.submit(job, i) for i in range(n)]
    for f in futures:
        f.result()
"""


def main() -> None:
    workload, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    here = os.path.dirname(os.path.abspath(__file__))
    filename = os.path.join(here, "_hop_workload.py")  # (never written: a name for the policy)
    mod = types.ModuleType("hop_workload")
    mod.__file__ = filename
    exec(compile(SRC, filename, "exec"), mod.__dict__)
    if mode != "off":
        import monstack

        kw = {}
        if os.environ.get("ACC"):
            kw["accelerator"] = os.environ["ACC"] == "1"
        if mode == "default":
            monstack.install(**kw)
        elif mode == "filtered":
            monstack.install(exclude=[here + os.sep, "__main__"], **kw)
        elif mode == "floor":
            monstack.install(propagate=False, **kw)
            snap = monstack.snapshot

            def factory(loop, coro, context=None, **kwargs):
                s = snap()
                task = asyncio.Task(coro, loop=loop, context=context, **kwargs)
                task.origin = s
                return task

            async def amain(k, _inner=mod.amain):
                asyncio.get_running_loop().set_task_factory(factory)
                await _inner(k)

            mod.amain = amain
            from concurrent.futures import thread

            original = thread.ThreadPoolExecutor.submit

            def submit(self, fn, *args, **kwargs):
                s = snap()
                future = original(self, fn, *args, **kwargs)
                future.origin = s
                return future

            thread.ThreadPoolExecutor.submit = submit
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    ex = ThreadPoolExecutor(1) if workload == "pool" else None

    def run(k: int) -> None:
        if workload == "asyncio":
            mod.arun(k)
        else:
            mod.prun(k, ex)

    if os.environ.get("GC") == "0":
        import gc

        gc.disable()
    if os.environ.get("SWITCH"):
        sys.setswitchinterval(float(os.environ["SWITCH"]))
    run(200)
    run(n)
    if ex is not None:
        ex.shutdown()


if __name__ == "__main__":
    main()
