#!/usr/bin/env python3
"""Per-task cost of the ``ray`` propagation point on round trips.

``ray.get(inc.remote(i))`` against a local Ray instance (``ray.init(num_cpus=1,
include_dashboard=False)``, usage stats off, a temporary ``HOME`` and temp dir; the workers
run with ``MONSTACK=1``), submitted 20 frames deep, with monstack installed in the driver
with every point and with every point but ``ray``. Each round runs a block of round trips
(well over 15 ms) in each mode, the order alternating; the figure is the median of the
per-round ratios (with min and max), the better of two passes after a warm-up::

    PYTHONPATH=. python3.12 bench/ray_cost.py [ROUNDS [TRIPS_PER_BLOCK]]

Needs the engines extra (``pip install -e '.[engines]'``, CPython 3.11-3.14). The goal:
with the point at most 5% above without it.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

import monstack
from monstack._settings import PROPAGATION_POINTS


def deep(n: int, f):
    return deep(n - 1, f) if n else f()


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    trips = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    home = tempfile.mkdtemp(prefix="monstack-ray-home-")
    temp = tempfile.mkdtemp(prefix="msr", dir="/tmp")  # (Ray's socket paths must stay short)
    os.environ["HOME"] = home
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    try:
        import ray
    except ImportError as exc:
        print(f"ray_cost: {exc}; pip install -e '.[engines]' (CPython 3.11-3.14)", file=sys.stderr)
        return 1

    @ray.remote
    def inc(x: int) -> int:
        return x + 1

    env = {"MONSTACK": "1", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    ray.init(num_cpus=1, include_dashboard=False, object_store_memory=80 * 1024**2, _temp_dir=temp,
             log_to_driver=False, runtime_env={"env_vars": env})
    modes = {"with": list(PROPAGATION_POINTS), "without": [p for p in PROPAGATION_POINTS if p != "ray"]}
    try:
        def block(n: int) -> float:
            t = time.perf_counter()
            for i in range(n):
                ray.get(inc.remote(i))
            return (time.perf_counter() - t) / n

        for points in modes.values():  # warm up both (workers started, functions exported)
            monstack.install(propagate=points)
            deep(20, lambda: block(trips))
        passes = []
        for _ in range(2):
            ratios: list[float] = []
            per: dict[str, list[float]] = {m: [] for m in modes}
            for r in range(rounds):
                got = {}
                for mode in (list(modes) if r % 2 == 0 else list(reversed(modes))):
                    monstack.install(propagate=modes[mode])
                    got[mode] = deep(20, lambda: block(trips))
                    per[mode].append(got[mode])
                ratios.append(got["with"] / got["without"])
            passes.append((statistics.median(ratios), min(ratios), max(ratios), per))
        own = deep(20, own_work)
        monstack.uninstall()
    finally:
        ray.shutdown()
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(temp, ignore_errors=True)
    ratio, low, high, per = min(passes, key=lambda p: p[0])
    on, off = statistics.median(per["with"]), statistics.median(per["without"])
    print(f"python {sys.version.split()[0]}, ray {ray.__version__}, {rounds} rounds x {trips} round trips per mode, "
          "best of 2 passes")
    print(f"  without the ray point: median round trip {off * 1e3:.3f} ms")
    print(f"  with the ray point:    median round trip {on * 1e3:.3f} ms")
    print(f"  median of per-round ratios: {ratio:.3f} (min {low:.3f}, max {high:.3f}); "
          f"other pass: {max(p[0] for p in passes):.3f}")
    print(f"  target <= 1.05: {'met' if ratio <= 1.05 else 'NOT MET'}")
    print(f"  the point's own CPU work per task, 20 frames deep: {own * 1e6:.2f} us "
          "(snapshot, keeping it under the ref, dropping it when the result arrives)")
    return 0


def own_work(n: int = 20000) -> float:
    """CPU seconds per task of what the point adds in the driver, outside Ray's own work:
    the snapshot, keeping it under the ref's id, and the lookup that drops it."""
    import ray

    from monstack._points import ray as _ray

    monstack.install()
    ref = ray.ObjectRef.from_random()
    best = float("inf")
    for _ in range(5):
        t = time.process_time()
        for _ in range(n):
            _ray._remember(ref, _ray.take())
            _ray._REFS.pop(ref.binary(), None)
        best = min(best, (time.process_time() - t) / n)
    return best


if __name__ == "__main__":
    sys.exit(main())
