#!/usr/bin/env python3
"""Wall clock of a hop, in fresh processes, the modes interleaved (their order rotates each
round); per round each mode's best of 5 runs after 2 of warm-up; printed: median us per
hop, what the mode adds over ``off`` and the median [min-max] of the per-round ratios.

    python bench/hop_wallclock.py WORKLOAD ROUNDS MODE...

WORKLOAD ``asyncio`` (create_task x N trivial coroutines + gather, N=5000) or ``pool``
(ThreadPoolExecutor(4).submit x N + result, N=2000; ``N=`` in the environment to change).
MODE: ``off``, ``default``, ``filtered`` (the workload and ``__main__`` excluded: no
tracked frame), ``floor`` (propagate=False plus a task factory / submit wrapper that only
takes monstack.snapshot() and stores it), ``floorctx`` (asyncio: the same, copying a
context too), ``nopropagate``. ``MODE@DIR`` runs the monstack found in DIR (a checkout to
compare with: ``default@/tmp/old``); otherwise the one of this checkout (children run with
``-P``: the current directory never shadows it). ``ACC=0``/``1``: ``accelerator=``.
``CPU=1``: the process's CPU time (every thread's) instead of the wall clock: what the hops
cost, less what waiting on a loaded box adds. ``PIN=1`` (a CPU number, or several, comma-
separated): each child runs on those CPUs only (``sched_setaffinity``): the pool's threads
then take turns on one core instead of racing on two, which takes the per-round spread of a
pool measurement from about +-0.5x to +-0.1x. ``GC=0``: the collector disabled in the
children. Examples::

    python3.12 bench/hop_wallclock.py asyncio 7 off default filtered floor
    PIN=1 CPU=1 python3.14 bench/hop_wallclock.py pool 9 off default floor nopropagate
"""
import json, os, subprocess, sys, time, statistics

CHILD = r'''
import sys, time, types, json, os
if os.environ.get("PIN"):
    os.sched_setaffinity(0, {int(c) for c in os.environ["PIN"].split(",")})
wl, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
SRC = """
import asyncio
from concurrent.futures import ThreadPoolExecutor
async def triv():
    return 1
async def amain(n):
    ts = [asyncio.create_task(triv()) for _ in range(n)]
    await asyncio.gather(*ts)
def arun(n):
    asyncio.run(amain(n))
def job(x):
    return x
def prun(n, ex):
    fs = [ex.submit(job, i) for i in range(n)]
    for f in fs:
        f.result()
"""
import asyncio
from concurrent.futures import ThreadPoolExecutor
WORK = os.path.join(os.getcwd(), "_hop_wallclock_work.py")  # (never written: a name for the policy)
mod = types.ModuleType("hopwork"); mod.__file__ = WORK
exec(compile(SRC, WORK, "exec"), mod.__dict__)
sys.modules["hopwork"] = mod
if mode != "off":
    import monstack
    acc = os.environ.get("ACC")
    kw = {}
    if acc: kw["accelerator"] = acc == "1"
    if mode == "default":
        monstack.install(**kw)
    elif mode == "filtered":
        monstack.install(exclude=[WORK, "__main__"], **kw)
    elif mode in ("floor", "floorctx"):
        monstack.install(propagate=False, **kw)
        snap = monstack.snapshot
        if wl == "asyncio":
            ctxcopy = mode == "floorctx"
            import contextvars
            def factory(loop, coro, **kw):
                t = asyncio.Task(coro, loop=loop, **kw)
                t._ms_origin = snap()
                return t
            class T(asyncio.Task):
                pass
            def factory(loop, coro, context=None, **kw):
                s = snap()
                if ctxcopy and context is None:
                    context = contextvars.copy_context()
                t = T(coro, loop=loop, context=context, **kw)
                t.ms = s
                return t
            orig_run = mod.amain
            async def amain(n, _o=orig_run):
                asyncio.get_running_loop().set_task_factory(factory)
                await _o(n)
            mod.amain = amain
        else:
            from concurrent.futures import thread as cft
            orig = cft.ThreadPoolExecutor.submit
            def submit(self, fn, *a, **k):
                f = orig(self, fn, *a, **k)
                f.ms = snap()
                return f
            cft.ThreadPoolExecutor.submit = submit
    elif mode == "nopropagate":
        monstack.install(propagate=False, **kw)
if os.environ.get("GC") == "0":
    import gc; gc.disable()
ex = ThreadPoolExecutor(4) if wl == "pool" else None
clock = time.process_time if os.environ.get("CPU") == "1" else time.perf_counter
def run():
    if wl == "asyncio":
        mod.arun(n)
    else:
        mod.prun(n, ex)
run(); run()
best = []
for _ in range(5):
    t = clock(); run(); best.append(clock() - t)
print(json.dumps(min(best)))
'''

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def refuse(why):
    print(f"hop_wallclock: {why}", file=sys.stderr)
    sys.exit(2)


def main():
    if len(sys.argv) < 4 or sys.argv[1] not in ("asyncio", "pool") or not sys.argv[2].isdigit() or int(sys.argv[2]) < 1:
        refuse("usage: hop_wallclock.py asyncio|pool ROUNDS MODE... (ROUNDS at least 1; see the docstring)")
    if "off" not in sys.argv[3:]:
        refuse("the modes must include off (the base of every ratio)")
    pin = os.environ.get("PIN")
    if pin:
        allowed = os.sched_getaffinity(0)
        cpus = [c.strip() for c in pin.split(",")]
        if not all(c.isdigit() and int(c) in allowed for c in cpus):
            refuse(f"PIN={pin}: not a comma-separated list of the CPUs this process may use ({sorted(allowed)})")
    wl, rounds, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    n = int(os.environ.get("N", 5000 if wl == "asyncio" else 2000))
    py = sys.executable
    res = {m: [] for m in modes}
    for r in range(rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for m in order:
            mode, _, tree = m.partition("@")
            env = dict(os.environ, PYTHONPATH=tree or ROOT)
            out = subprocess.run([py, "-P", "-c", CHILD, wl, mode, str(n)], capture_output=True, text=True, env=env)
            if out.returncode:
                print(out.stderr); sys.exit(1)
            res[m].append(float(out.stdout.strip().splitlines()[-1]))
    base = res["off"]
    print(f"{sys.version.split()[0]} {wl} n={n} rounds={rounds} ACC={os.environ.get('ACC','auto')}" + (" (CPU time)" if os.environ.get("CPU") == "1" else "")
          + (f" PIN={os.environ['PIN']}" if os.environ.get("PIN") else "") + (" GC=0" if os.environ.get("GC") == "0" else ""))
    for m in modes:
        ratios = [a / b for a, b in zip(res[m], base)]
        us = statistics.median(res[m]) / n * 1e6
        over = statistics.median([(a - b) / n * 1e6 for a, b in zip(res[m], base)])
        print(f"  {m:12s} {us:7.2f} us/hop  +{over:5.2f} us  ratio {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")

main()
