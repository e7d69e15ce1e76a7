#!/usr/bin/env python3
"""Benchmark of the native sys.monitoring callbacks, standalone.

    PYTHONPATH=. python3.12 bench/bench_accel.py [--rounds 9] [--memory 10000000]

Tracking tax on a recursive fib (track="all"), as a ratio to no monitoring, for:
empty native callbacks (a C function returning None: CPython's own event cost), empty
Python callbacks, monstack's pure-Python callbacks and monstack's native callbacks.
Then snapshot() cost at depth 10/50/200 under both callback kinds (and the native
snapshot fast path when present), and with ``--memory N`` the RSS before/after N
tracked calls under the native callbacks.

Method: each timing is a >= 15 ms workload, best of 2 after a warm-up; modes are
interleaved round by round (rotating order); reported: median (min-max) of the
per-round ratios.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

import monstack
from monstack import _accel, _sysmon

ORIGINAL_CALLBACKS = _sysmon._callbacks


def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)


def best_of_2(fn, *args):
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t)
    return best


def _tool():
    for t in (5, 4, 3, 2):
        if sys.monitoring.get_tool(t) is None:
            return t
    raise RuntimeError("no free tool id")


class Raw:
    """Register given callbacks for PY_START/PY_RETURN (plus the other four)."""

    def __init__(self, cb):
        self.cb = cb

    def __enter__(self):
        mon = sys.monitoring
        self.tool = _tool()
        mon.use_tool_id(self.tool, "bench-empty")
        E = mon.events
        ev = 0
        for e in (E.PY_START, E.PY_RESUME, E.PY_THROW, E.PY_RETURN, E.PY_YIELD, E.PY_UNWIND):
            mon.register_callback(self.tool, e, self.cb)
            ev |= e
        mon.set_events(self.tool, ev)

    def __exit__(self, *a):
        mon = sys.monitoring
        mon.set_events(self.tool, 0)
        E = mon.events
        for e in (E.PY_START, E.PY_RESUME, E.PY_THROW, E.PY_RETURN, E.PY_YIELD, E.PY_UNWIND):
            mon.register_callback(self.tool, e, None)
        mon.free_tool_id(self.tool)


class Installed:
    def __init__(self, native):
        self.native = native

    def __enter__(self):
        import inspect

        if "accelerator" in inspect.signature(monstack.install).parameters:
            monstack.install(backend="monitoring", track="all", propagate=False, accelerator=self.native)
            return
        _sysmon._callbacks = (
            (lambda p, t, e: _accel.callbacks(p, t, e, py_callbacks=ORIGINAL_CALLBACKS))
            if self.native else ORIGINAL_CALLBACKS
        )
        monstack.install(backend="monitoring", track="all", propagate=False)

    def __exit__(self, *a):
        monstack.uninstall()
        _sysmon._callbacks = ORIGINAL_CALLBACKS


class Off:
    def __enter__(self):
        pass

    def __exit__(self, *a):
        pass


def py_noop(*args):
    return None


def calibrate(n=15):
    while True:
        t = best_of_2(fib, n)
        if t >= 0.015:
            return n
        n += 1


def tax(rounds):
    noop = _accel.empty_callback()
    n = calibrate()
    modes = {
        "empty-native": lambda: Raw(noop),
        "empty-python": lambda: Raw(py_noop),
        "monstack-python": lambda: Installed(False),
        "monstack-native": lambda: Installed(True),
    }
    ratios = {m: [] for m in modes}
    names = list(modes)
    for r in range(rounds + 1):  # round 0 is the warm-up
        order = names[r % len(names):] + names[: r % len(names)]
        base = best_of_2(fib, n)
        for m in order:
            with modes[m]():
                t = best_of_2(fib, n)
            if r:
                ratios[m].append(t / base)
        if r:
            base2 = best_of_2(fib, n)  # baseline again: noise check
            ratios.setdefault("off-vs-off", []).append(base2 / base)
    print(f"tracking tax, fib({n}) (baseline {base * 1e3:.1f} ms), ratio to no monitoring, {rounds} rounds:")
    for m, v in ratios.items():
        print(f"  {m:16s} median {statistics.median(v):5.2f}x  (min {min(v):.2f}, max {max(v):.2f})")
    med = {m: statistics.median(v) for m, v in ratios.items()}
    per_round = [a / b for a, b in zip(ratios["monstack-native"], ratios["empty-native"])]
    print(f"  native / empty-native: median {statistics.median(per_round):.2f}x")
    per_round = [a / b for a, b in zip(ratios["monstack-native"], ratios["monstack-python"])]
    print(f"  native / pure-python:  median {statistics.median(per_round):.2f}x")
    return med


def at_depth(depth, fn):
    if depth <= 1:
        return fn()
    return at_depth(depth - 1, fn)


def snap_loop(k):
    snap = monstack.snapshot
    for _ in range(k):
        snap()


_SNAP_SRC = """
def snapshot_via_fast():
    r = fast()
    if r is not None:
        return _new_snapshot(r[0], r[1], _get_origin())
    return snapshot()

def snapshot_via_new():
    s = snap_new()
    if s is not None:
        return s
    return snapshot()
"""


def snapshot_variants():
    """snapshot() as it is, and as it would be with the native fast paths (compiled
    under monstack's directory so the policy treats them as monstack's own code)."""
    import os

    from monstack import _install

    out = {"snapshot()": monstack.snapshot}
    if not _accel.is_native(_current_start_callback()):
        return out
    cb = _current_start_callback()
    ns = {
        "fast": _accel.snapshot_fast(cb), "snap_new": _accel.snapshot_new(cb),
        "_new_snapshot": _install._new_snapshot, "_get_origin": _install._get_origin,
        "snapshot": monstack.snapshot,
    }
    exec(compile(_SNAP_SRC, os.path.join(os.path.dirname(_install.__file__), "_bench_accel_snapshot.py"), "exec"), ns)
    out["+snapshot_fast"] = ns["snapshot_via_fast"]
    if ns["snap_new"] is not None:
        out["+snapshot_new"] = ns["snapshot_via_new"]
    return out


def _current_start_callback():
    from monstack import _install

    mon = sys.monitoring
    tool = _install._state.backend.tool
    cb = mon.register_callback(tool, mon.events.PY_START, None)
    mon.register_callback(tool, mon.events.PY_START, cb)
    return cb


def snap_loop_fn(fn, k):
    for _ in range(k):
        fn()


def snapshots(rounds):
    print("snapshot cost (us per call), median (min-max) of rounds:")
    for native in (False, True):
        with Installed(native):
            for label, fn in snapshot_variants().items():
                res = {}
                for depth in (10, 50, 200):
                    k = 2000
                    while best_of_2(at_depth, depth, lambda: snap_loop_fn(fn, k)) < 0.015:
                        k *= 2
                    vals = []
                    for r in range(rounds + 1):
                        t = best_of_2(at_depth, depth, lambda: snap_loop_fn(fn, k))
                        if r:
                            vals.append(t / k * 1e6)
                    res[depth] = vals
                cbs = "native callbacks" if native else "python callbacks"
                print(f"  {cbs}, {label:15s} " + "  ".join(
                    f"d{d}: {statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})" for d, v in res.items()))


def rss_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def memory(calls):
    def leaf(i):
        return i

    def loop(k):
        for i in range(k):
            leaf(i)

    with Installed(True):
        loop(100_000)
        before = rss_kb()
        done = 0
        step = 1_000_000
        samples = []
        while done < calls:
            loop(min(step, calls - done))
            done += min(step, calls - done)
            samples.append(rss_kb())
        cb = sys.monitoring  # noqa: F841
    print(f"memory: RSS {before} kB before, after each 1M tracked calls: {samples} kB "
          f"(growth {samples[-1] - before} kB over {calls:,} calls)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--memory", type=int, default=0)
    ap.add_argument("--no-snapshot", action="store_true")
    a = ap.parse_args()
    ok, why = _accel.available()
    print(f"Python {sys.version.split()[0]}: accelerator {'native' if ok else 'none (' + why + ')'}")
    if not ok:
        return 1
    tax(a.rounds)
    if not a.no_snapshot:
        snapshots(a.rounds)
    if a.memory:
        memory(a.memory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
