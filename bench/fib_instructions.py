#!/usr/bin/env python3
"""Instructions per tracked call on a recursive fib, for valgrind (deterministic where wall
clock is not). ``MODE N`` runs fib(N) once under MODE:

  none         no sys.monitoring tool;
  emptydirect  a native callback doing nothing, written into the callbacks' vectorcall
               entry as the native callbacks are (the blob's ``ms_vc_probe``): CPython's
               own event dispatch, the floor for any callback;
  empty        the same through cfunction_vectorcall (``_accel.empty_callback()``);
  native       monstack, track='all', native callbacks;
  python       monstack, track='all', pure-Python callbacks;
  evalframe    monstack, track='all', the 3.11 shim (CPython 3.11 only).

Per call = (instructions at fib(20) - at fib(12)) / 21426 calls::

    for n in 12 20; do
      PYTHONHASHSEED=0 PYTHONPATH=. valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python3.14 bench/fib_instructions.py native $n 2>&1 | grep Collected
    done
"""

import sys

import monstack

EVENTS = ("PY_START", "PY_RESUME", "PY_THROW", "PY_RETURN", "PY_YIELD", "PY_UNWIND")


def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)


def main() -> None:
    mode, n = sys.argv[1], int(sys.argv[2])
    fib(10)
    if mode in ("empty", "emptydirect"):
        from monstack import _accel  # (3.12+)

        noop = _accel.empty_callback()
        if mode == "emptydirect":
            noop = _accel._direct(noop, _accel._blob, "ms_vc_probe")  # returns the callable: not DISABLE
        mon = sys.monitoring
        mon.use_tool_id(5, "fib-instructions")
        ev = 0
        for name in EVENTS:
            mon.register_callback(5, getattr(mon.events, name), noop)
            ev |= getattr(mon.events, name)
        mon.set_events(5, ev)
    elif mode in ("native", "python"):
        monstack.install(backend="monitoring", track="all", propagate=False, accelerator=mode == "native")
    elif mode == "evalframe":
        monstack.install(backend="evalframe", track="all", propagate=False)
    elif mode != "none":
        raise SystemExit(f"unknown mode {mode!r}")
    fib(8)
    fib(n)


if __name__ == "__main__":
    main()
