#!/usr/bin/env python3
"""The bench's exception-heavy workload with the workload filtered (the default policy,
its module excluded): one iteration raises a KeyError through three frames and catches
it, then catches a failed dict lookup. The thread running it never runs tracked code
after install (as in the bench, whose harness is library code): it has no stack.

``instructions MODE N`` runs ``exception_heavy(N)`` once under MODE, for valgrind
(deterministic where wall clock is not):

  none         no tool;
  empty        an empty native callback (``_accel.empty_callback()``) on PY_UNWIND and
               PY_THROW only, the events filtered code cannot disable: CPython's own
               dispatch of the three PY_UNWIND events per iteration (3.12+);
  native       monstack, native callbacks;
  python       monstack, pure-Python callbacks;
  evalframe    monstack, the 3.11 shim (CPython 3.11 only).

Per iteration = (instructions at N=5000 - at N=1000) / 4000::

    for n in 1000 5000; do
      PYTHONHASHSEED=0 PYTHONPATH=. valgrind --tool=cachegrind --cache-sim=no \\
        --cachegrind-out-file=/dev/null python3.14 bench/exception_cost.py instructions native $n \\
        2>&1 | grep "I *refs"
    done

``wall ROUNDS [N] [MODES]``: wall clock, each mode (default ``none,native,python``; 3.11:
``none,evalframe``) in a process of its own, the modes interleaved round by round (order
alternating); each process times ``exception_heavy(N)`` (default 30000) best of 7 after a
warm-up; prints per mode the median time and the median of the per-round ratios to
``none`` [min-max]::

    PYTHONPATH=. python3.14 bench/exception_cost.py wall 5
"""

import os
import statistics
import subprocess
import sys
import time


def _setup(mode: str):
    import monstack
    from monstack._bench import _workloads

    w = _workloads.make_workloads()
    w.exception_heavy(100)
    if mode == "empty":
        from monstack import _accel  # (3.12+)

        noop = _accel.empty_callback()
        mon = sys.monitoring
        mon.use_tool_id(5, "exception-cost")
        for name in ("PY_UNWIND", "PY_THROW"):
            mon.register_callback(5, getattr(mon.events, name), noop)
        mon.set_events(5, mon.events.PY_UNWIND | mon.events.PY_THROW)
    elif mode in ("native", "python"):
        monstack.install(backend="monitoring", exclude=[_workloads.WORKLOAD_MODULE], accelerator=mode == "native")
    elif mode == "evalframe":
        monstack.install(backend="evalframe", exclude=[_workloads.WORKLOAD_MODULE])
    elif mode != "none":
        raise SystemExit(f"unknown mode {mode!r}")
    w.exception_heavy(100)  # each code object decided, its instructions specialised
    return w


def instructions(mode: str, n: int) -> None:
    _setup(mode).exception_heavy(n)


def one(mode: str, n: int) -> None:
    """A wall-clock measurement in this process: best of 7, seconds."""
    w = _setup(mode)
    w.exception_heavy(max(1, n // 10))
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        w.exception_heavy(n)
        best = min(best, time.perf_counter() - t0)
    print(best)


def wall(rounds: int, n: int, modes: list) -> None:
    times: dict = {m: [] for m in modes}
    for r in range(rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "_one", m, str(n)],
                                 capture_output=True, text=True, check=True)
            times[m].append(float(out.stdout))
    base = times[modes[0]]
    for m in modes:
        ratios = [a / b for a, b in zip(times[m], base)]
        print(f"{m:10} {statistics.median(times[m]) * 1e3:8.2f} ms   {statistics.median(ratios):.3f}x "
              f"[{min(ratios):.3f}-{max(ratios):.3f}]")


def main() -> None:
    args = sys.argv[1:]
    if len(args) == 3 and args[0] == "instructions":
        instructions(args[1], int(args[2]))
    elif len(args) == 3 and args[0] == "_one":
        one(args[1], int(args[2]))
    elif 2 <= len(args) <= 4 and args[0] == "wall":
        default = "none,evalframe" if sys.version_info[:2] == (3, 11) else "none,native,python"
        wall(int(args[1]), int(args[2]) if len(args) > 2 else 30000, (args[3] if len(args) > 3 else default).split(","))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
