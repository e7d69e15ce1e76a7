#!/usr/bin/env python3
"""Instructions per throw: three workloads that throw into tracked generators or
coroutines, under monstack's default install, counted with valgrind (deterministic, where
wall clock on these shared machines is not)::

    PYTHONPATH=. python3.12 bench/throw_cost.py measure [DEPTH]   # needs valgrind
    PYTHONPATH=. python3.12 bench/throw_cost.py run KIND N [snap] [DEPTH]

Workloads (``KIND``), each called ``N`` times from ``DEPTH`` extra plain frames:

- ``cm``: an exception raised in a ``@contextmanager`` block, caught by the generator
  (``gen.throw()`` into tracked code, one frame);
- ``chain``: ``g.throw(KeyError)`` into a 3-level ``yield from`` chain whose innermost
  generator catches and yields (two generators linked in by the throw);
- ``aio``: one batch of 10 asyncio tasks, each awaiting an Event 5 coroutines deep,
  cancelled and awaited (a PY_THROW per level, the first into asyncio's own code).

``snap`` takes a ``monstack.snapshot()`` after each throw. ``measure`` prints, per
workload, the instructions of one iteration (the difference between a run of 2N and
one of N, so start-up cancels out).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys

import monstack

_SNAP = False


@contextlib.contextmanager
def _cm():
    try:
        yield
    except ValueError:
        pass


def _run_cm() -> None:
    with _cm():
        raise ValueError
    if _SNAP:
        monstack.snapshot()


def _inner():
    while True:
        try:
            yield 1
        except KeyError:
            pass


def _mid():
    yield from _inner()


def _outer():
    yield from _mid()


_GEN: list = []  # the chain, started in _loop (after install)


def _run_chain() -> None:
    _GEN[0].throw(KeyError)
    if _SNAP:
        monstack.snapshot()


async def _waiter(ev: asyncio.Event) -> None:
    await ev.wait()


async def _level(ev: asyncio.Event, d: int) -> None:
    if d == 0:
        return await _waiter(ev)
    return await _level(ev, d - 1)


async def _aio_batch() -> None:
    ev = asyncio.Event()
    tasks = [asyncio.ensure_future(_level(ev, 3)) for _ in range(10)]
    await asyncio.sleep(0)
    for t in tasks:
        t.cancel()
    for t in tasks:
        try:
            await t
        except asyncio.CancelledError:
            if _SNAP:
                monstack.snapshot()


def _loop(kind: str, n: int) -> None:
    if kind == "aio":
        async def go() -> None:
            for _ in range(n):
                await _aio_batch()

        asyncio.run(go())
        return
    if kind == "chain":
        _GEN[:] = [_outer()]
        next(_GEN[0])
    f = {"cm": _run_cm, "chain": _run_chain}[kind]
    for _ in range(n):
        f()


def _deep(d: int, kind: str, n: int) -> None:
    if d:
        return _deep(d - 1, kind, n)
    _loop(kind, n)


_ITERATIONS = {"cm": 200, "chain": 200, "aio": 20}


def _instructions(args: list) -> int:
    out = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
         sys.executable, os.path.abspath(__file__), "run", *args],
        capture_output=True, text=True, check=True,
    ).stderr
    m = re.search(r"I\s+refs:\s+([\d,]+)", out)
    if m is None:
        raise SystemExit(f"no instruction count in valgrind's output:\n{out}")
    return int(m.group(1).replace(",", ""))


def main() -> int:
    global _SNAP
    if len(sys.argv) >= 4 and sys.argv[1] == "run":
        kind, n = sys.argv[2], int(sys.argv[3])
        _SNAP = "snap" in sys.argv[4:]
        depth = int(sys.argv[-1]) if sys.argv[-1].isdigit() and len(sys.argv) > 4 else 0
        monstack.install()
        _deep(depth, kind, n)
        return 0
    if len(sys.argv) >= 2 and sys.argv[1] == "measure":
        depth = sys.argv[2] if len(sys.argv) > 2 else "0"
        print(f"CPython {sys.version.split()[0]}, depth {depth}, instructions per iteration")
        for kind in ("cm", "chain", "aio"):
            for snap in ("nosnap", "snap"):
                n = _ITERATIONS[kind]
                a = _instructions([kind, str(n), snap, depth])
                b = _instructions([kind, str(2 * n), snap, depth])
                print(f"  {kind:5} {snap:6} {(b - a) // n:>10,}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
