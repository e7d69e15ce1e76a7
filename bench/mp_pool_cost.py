#!/usr/bin/env python3
"""Per-task cost of the ``mp_pool`` propagation point: ``Pool.map(abs, range(N),
chunksize=1)`` on a spawn pool with one worker, taken 20 frames deep, with monstack off
and on (interleaved, two rounds), plus the cost of pickling one 20-frame snapshot::

    PYTHONPATH=. python3.12 bench/mp_pool_cost.py [N]
"""

from __future__ import annotations

import multiprocessing
import pickle
import sys
import time

import monstack


def deep(n, f):
    return deep(n - 1, f) if n else f()


def run(pool, n: int) -> float:
    t = time.perf_counter()
    pool.map(abs, range(n), chunksize=1)
    return time.perf_counter() - t


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        pool.map(abs, range(10))
        for mode in ("off", "on", "off", "on"):
            if mode == "on":
                monstack.install()
            else:
                monstack.uninstall()
            dt = deep(20, lambda: run(pool, n))
            print(f"monstack {mode:3s}: {dt * 1e6 / n:6.1f} us per item")
    monstack.install()
    snap = deep(20, monstack.snapshot)
    t = time.perf_counter()
    for _ in range(1000):
        pickle.dumps(snap)
    print(f"pickling one 20-frame snapshot: {(time.perf_counter() - t) * 1e3:.1f} us, {len(pickle.dumps(snap))} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
