#!/usr/bin/env python3
"""Per-task cost of the ``dask`` propagation point on round trips.

``client.submit(inc, i).result()`` against a ``distributed.LocalCluster`` (one worker
process, one thread, 127.0.0.1; the worker boots monstack from ``MONSTACK=1``), taken 20
frames deep, with monstack installed in the client with every point and with every point
but ``dask``: interleaved blocks in the same run, the median round trip of each mode::

    PYTHONPATH=. python3.12 bench/engines_cost.py [BLOCKS [TRIPS_PER_BLOCK]]

Needs the engines extra (``pip install -e '.[engines]'``). The goal: the "with" median at
most 5% above the "without" one.
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import time

import monstack
from monstack._settings import PROPAGATION_POINTS


def inc(x: int) -> int:
    return x + 1


def deep(n: int, f):
    return deep(n - 1, f) if n else f()


def main() -> int:
    blocks = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    trips = int(sys.argv[2]) if len(sys.argv) > 2 else 50
    os.environ["MONSTACK"] = "1"  # the workers' environment (they are spawned from this one)
    try:
        import dask
        import distributed
    except ImportError as exc:
        print(f"engines_cost: {exc}; pip install -e '.[engines]'", file=sys.stderr)
        return 1
    counter = itertools.count()
    with dask.config.set({"distributed.worker.daemon": False}):
        cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                           dashboard_address=None, host="127.0.0.1")
    modes = {"with dask point": list(PROPAGATION_POINTS),
             "without": [p for p in PROPAGATION_POINTS if p != "dask"]}
    times: dict[str, list[float]] = {m: [] for m in modes}
    block_ratios: list[float] = []
    try:
        with distributed.Client(cluster) as client:
            def block(n: int) -> list[float]:
                out = []
                for _ in range(n):
                    i = next(counter)
                    t = time.perf_counter()
                    client.submit(inc, i).result()
                    out.append(time.perf_counter() - t)
                return out

            for mode, points in modes.items():  # warm up both
                monstack.install(propagate=points)
                deep(20, lambda: block(trips))
            for b in range(blocks):
                medians = {}
                order = list(modes) if b % 2 == 0 else list(reversed(modes))
                for mode in order:
                    monstack.install(propagate=modes[mode])
                    got = deep(20, lambda: block(trips))
                    times[mode].extend(got)
                    medians[mode] = statistics.median(got)
                block_ratios.append(medians["with dask point"] / medians["without"])
            monstack.uninstall()
    finally:
        cluster.close()
    on = statistics.median(times["with dask point"])
    off = statistics.median(times["without"])
    print(f"python {sys.version.split()[0]}, dask/distributed {distributed.__version__}, "
          f"{blocks} blocks x {trips} round trips per mode")
    print(f"  without the dask point: median round trip {off * 1e3:.3f} ms")
    print(f"  with the dask point:    median round trip {on * 1e3:.3f} ms")
    print(f"  ratio of medians: {on / off:.3f} (cost {(on - off) * 1e6:+.0f} us per task); "
          f"median of per-block ratios: {statistics.median(block_ratios):.3f}")
    print(f"  target <= 1.05: {'met' if on / off <= 1.05 else 'NOT MET'}")
    print(f"  the point's own CPU work per task, 20 frames deep: {deep(20, own_work) * 1e6:.1f} us "
          "(snapshot, wrapper, pickling it; not counting the unpickling, cached per snapshot)")
    return 0


def own_work(n: int = 2000) -> float:
    """CPU seconds per task of what the point adds on the client: the snapshot, the
    wrapper and its pickling with the task (Dask pickles the function once per submit)."""
    import pickle

    from monstack._points import dask as _dask

    monstack.install()
    try:
        best = float("inf")
        for _ in range(5):
            t = time.process_time()
            for _ in range(n):
                pickle.dumps(_dask._carried(inc, monstack.snapshot()))
            t1 = time.process_time()
            for _ in range(n):
                pickle.dumps(inc)
            best = min(best, ((t1 - t) - (time.process_time() - t1)) / n)
        return best
    finally:
        monstack.uninstall()


if __name__ == "__main__":
    sys.exit(main())
