"""``python -m monstack bench``: what monstack costs, as ratios measured in one run.

Method (the machines are shared and noisy): every workload runs >= 15 ms; each
measurement is the best of two runs after a warm-up; modes are interleaved round by
round; the reported figure is the median of the per-round ratios (min and max shown).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Optional

import monstack
from monstack import _env

#: Workloads are compiled into a synthetic module so the tracking policy can include or
#: exclude them by module name (monstack's own files are never tracked).
WORKLOAD_MODULE = "monstack_bench_workload"

_WORKLOAD_SRC = '''
import sys
def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)

class Vec:
    __slots__ = ("x", "y")
    def __init__(self, x, y):
        self.x = x; self.y = y
    def add(self, o):
        return Vec(self.x + o.x, self.y + o.y)
    def norm2(self):
        return self.x * self.x + self.y * self.y

def mixed(n):
    # calls, methods, a generator, dict/str work and a caught exception: everyday code
    total = 0
    acc = Vec(0, 0)
    for i in range(n):
        acc = acc.add(Vec(i, -i))
        d = {"k%d" % (i % 7): i}
        total += len(str(d)) + acc.norm2() % 7
        if i % 50 == 0:
            try:
                raise ValueError(i)
            except ValueError:
                total += 1
    total += sum(x for x in gen(n // 10))
    return total

def gen(n):
    for i in range(n):
        yield i * 2

def at_depth(depth, fn, *args):
    if depth <= 1:
        return fn(*args)
    return at_depth(depth - 1, fn, *args)
'''


def _workloads() -> dict:
    ns: dict = {"__name__": WORKLOAD_MODULE}
    exec(compile(_WORKLOAD_SRC, "<monstack-bench-workload>", "exec"), ns)
    return ns


def _best(fn: Callable[[], Any], repeat: int = 2) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _calibrate(fn: Callable[[int], Any], target: float = 0.02, start: int = 1) -> int:
    """The smallest size n (doubling) for which ``fn(n)`` takes >= ``target`` seconds."""
    n = start
    while True:
        t0 = time.perf_counter()
        fn(n)
        if time.perf_counter() - t0 >= target or n > 1 << 26:
            return n
        n *= 2


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _plain_walk() -> list:
    f = sys._getframe(1)
    out = []
    while f is not None:
        out.append((f.f_code, f.f_lasti))
        f = f.f_back
    return out


def snapshot_costs(rounds: int, depths=(10, 50, 200)) -> dict:
    """Cost per capture at each depth: monstack (installed / walk) vs plain walk vs extract_stack."""
    ns = _workloads()
    at_depth = ns["at_depth"]
    snap = monstack.snapshot
    extract = traceback.extract_stack

    def loop(fn, n):
        def run():
            for _ in range(n):
                fn()
        return run

    methods: dict[str, Callable] = {"monstack": snap, "plain walk": _plain_walk, "extract_stack": extract}
    out: dict = {}
    was = monstack.active_backend()
    monstack.uninstall()
    try:
        for depth in depths:
            per: dict[str, list[float]] = {name: [] for name in methods}
            per["monstack (walk backend)"] = []
            sizes = {}
            for name, fn in methods.items():
                if name == "monstack":
                    monstack.install(track="all")
                sizes[name] = _calibrate(lambda n, fn=fn: at_depth(depth, loop(fn, n)), 0.015, 64)
                if name == "monstack":
                    monstack.uninstall()
            sizes["monstack (walk backend)"] = sizes["plain walk"]
            for _ in range(rounds):
                for name in per:
                    fn = snap if name.startswith("monstack") else methods[name]
                    if name == "monstack":
                        monstack.install(track="all")
                    elif name == "monstack (walk backend)":
                        monstack.install(track="all", backend="walk")
                    n = sizes[name]
                    run = loop(fn, n)
                    at_depth(depth, run)  # warm-up
                    per[name].append(_best(lambda: at_depth(depth, run)) / n)
                    monstack.uninstall()
            out[depth] = {name: _summary(v) for name, v in per.items()}
    finally:
        if was:
            monstack.install()
    return out


def tracking_tax(rounds: int) -> dict:
    """Tracked / untracked time on a call-heavy (fib) and a mixed workload."""
    ns = _workloads()
    fib, mixed = ns["fib"], ns["mixed"]
    was = monstack.active_backend()
    monstack.uninstall()
    nfib = 1
    while True:  # fib size with >= 15 ms untracked
        t = _best(lambda: fib(nfib), 1)
        if t >= 0.015 or nfib > 30:
            break
        nfib += 1
    nmix = _calibrate(mixed, 0.015, 256)
    modes = {
        "track='all'": dict(track="all"),
        "default policy, workload filtered": dict(exclude=[WORKLOAD_MODULE]),
    }
    work = {"call-heavy (fib)": lambda: fib(nfib), "mixed": lambda: mixed(nmix)}
    ratios: dict = {w: {m: [] for m in modes} for w in work}
    base_times: dict = {w: [] for w in work}
    backend = None
    try:
        for _ in range(rounds):
            for wname, w in work.items():
                w()
                base = _best(w)
                base_times[wname].append(base)
                for mname, opts in modes.items():
                    backend = monstack.install(**opts)
                    w()
                    ratios[wname][mname].append(_best(w) / base)
                    monstack.uninstall()
    finally:
        if was:
            monstack.install()
    return {
        "backend": backend,
        "sizes": {"fib": nfib, "mixed": nmix},
        "untracked seconds": {w: statistics.median(v) for w, v in base_times.items()},
        "ratios": {w: {m: _summary(v) for m, v in d.items()} for w, d in ratios.items()},
    }


def run(quick: bool = False, as_json: bool = False, file=None) -> dict:
    file = file or sys.stdout
    rounds = 3 if quick else 7
    results = {
        "python": sys.version.split()[0],
        "machine": _env.MACHINE,
        "rounds": rounds,
        "snapshot": snapshot_costs(rounds, (10, 50, 200)),
        "tracking tax": tracking_tax(rounds),
    }
    if as_json:
        json.dump(results, file, indent=2, default=str)
        file.write("\n")
    else:
        _print(results, file)
    return results


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e6:8.2f} us"


def _print(r: dict, file) -> None:
    w = file.write
    w(f"monstack bench: CPython {r['python']} {r['machine']}, {r['rounds']} rounds, "
      "median of per-round figures [min..max]\n\n")
    w("Snapshot cost per capture (track='all'; monstack = installed tracking backend)\n")
    for depth, per in r["snapshot"].items():
        w(f"  depth {depth}:\n")
        ms = per["monstack"]["median"]
        for name, s in per.items():
            ratio = s["median"] / ms
            w(f"    {name:24s}{_fmt_s(s['median'])}  [{s['min']*1e6:.2f}..{s['max']*1e6:.2f}]  {ratio:6.1f}x monstack\n")
    d = r["snapshot"]
    if 10 in d and 200 in d:
        w(f"  monstack depth 200 / depth 10: {d[200]['monstack']['median'] / d[10]['monstack']['median']:.2f}x\n")
    if 50 in d:
        w(f"  plain walk / monstack at depth 50: {d[50]['plain walk']['median'] / d[50]['monstack']['median']:.1f}x\n")
    t = r["tracking tax"]
    w(f"\nTracking tax, tracked / untracked time (backend {t['backend']}; fib({t['sizes']['fib']}), mixed({t['sizes']['mixed']}))\n")
    for wname, modes in t["ratios"].items():
        for mname, s in modes.items():
            w(f"  {wname:18s} {mname:36s} {s['median']:6.2f}x  [{s['min']:.2f}..{s['max']:.2f}]\n")
