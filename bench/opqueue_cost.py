#!/usr/bin/env python3
"""The bench's op-queue workload, measured the two ways the README quotes.

``instructions MODE N``: runs N ops of the op-queue producer (user model -> framework
dispatch -> snapshot -> queue) with the ops queued to a list instead of the worker thread,
for counting instructions under valgrind (deterministic where wall clock is not)::

    for n in 4800 14400; do
      PYTHONPATH=. valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null \\
        python3.12 bench/opqueue_cost.py instructions snapshotter $n 2>&1 | grep "I *refs"
    done
    # instructions per op = (refs at 14400 - refs at 4800) / 9600

  MODE: ``none`` (not installed), ``installed`` (default policy, no snapshot),
  ``snapshotter`` (the framework binds monstack.snapshotter()), ``snapshot`` (it calls
  monstack.snapshot), ``filtered`` (installed, the model excluded too: every code object
  filtered), ``uninstalled`` (no capture, measured after the same code ran once under
  monstack and monstack was uninstalled: on 3.12 that code has lost its superinstructions).

``ab K ROUNDS TREE_A TREE_B``: the same wall-clock pairs for two checkouts of monstack
(say ``git worktree add /tmp/before HEAD~1`` and this one), for a change's cost in wall
clock: K processes per checkout, A and B alternating, each running ROUNDS pairs of
1800-op runs (installed / no capture, ``snapshotter()`` / no capture) with its checkout
first on the path; prints per checkout the median of all its per-pair ratios and each
process's median::

    PYTHONPATH=. python3.13 bench/opqueue_cost.py ab 6 25 /tmp/before .

``floor ROUNDS``: pairs for a bare ``sys.monitoring`` tool (not monstack) with global
events whose callbacks return DISABLE, against no tool (3.12+): CPython's own cost.

``pairs ROUNDS OPS [--no-worker]``: wall clock, each mode measured back to back with its
own no-capture run (the bench's ``_harness.paired``), many short runs, each measurement on new
code objects (``OpQueue.renew``: on 3.12 code once instrumented stays ~1% slower); prints
the median of the per-pair ratios with the quartiles and the ratio of the sums. ``no
capture again`` is the noise floor; ``every code filtered`` (installed, the workload
excluded) is what any ``sys.monitoring`` tool with global events costs before it tracks
anything.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import monstack
from monstack._bench import _harness, _workloads


def _setup(ops: int):
    w = _workloads.make_workloads()
    fw = _workloads.make_framework()
    fw.LAYERS = 3
    return w, fw, _workloads.OpQueue(w, fw, ops, 30)


def instructions(mode: str, ops: int) -> None:
    w, fw, oq = _setup(ops)
    sink: list = []
    fw._put = sink.append
    if mode == "filtered":
        monstack.install(exclude=[_workloads.WORKLOAD_MODULE])
    elif mode == "uninstalled":  # ran once under monstack, then measured without it
        monstack.install()
        oq.configure(True)
        w.run_model(oq.depth, oq.model, oq.x, 100)
        monstack.uninstall()
        sink.clear()
    elif mode != "none":
        monstack.install()
    oq.configure({"snapshotter": True, "snapshot": "snapshot"}.get(mode, False))
    w.run_model(oq.depth, oq.model, oq.x, 100)  # warm: specialised, instrumented, decided
    sink.clear()
    for _ in range(20):
        w.run_model(oq.depth, oq.model, oq.x, max(1, oq.steps // 20))
        sink.clear()


def _mode(oq, name: str, enter, capture) -> _harness.Mode:
    """A measured mode: ``enter`` (install or not), then the framework's capture set."""

    def go():
        info = enter()
        oq.configure(capture)
        return info

    return _harness.Mode(name, go, _harness.nothing)


def pairs(rounds: int, ops: int, worker: bool) -> None:
    w, fw, oq = _setup(ops)
    sink: list = []

    def no_worker() -> None:
        oq.fw._put = sink.append
        oq.w.run_model(oq.depth, oq.model, oq.x, oq.steps)
        sink.clear()

    def mode(name: str, enter, capture) -> _harness.Mode:
        return _mode(oq, name, enter, capture)

    base = mode("no capture", _harness.nothing, False)
    modes = [
        mode("no capture again", _harness.nothing, False),
        # any sys.monitoring tool's floor: PY_START/PY_RETURN set, every code object
        # filtered (its events DISABLEd after the first); on 3.12 the instrumented code
        # has lost its superinstructions
        mode("every code filtered", _harness.installer(exclude=[_workloads.WORKLOAD_MODULE]), False),
        mode("installed, no snapshot", _harness.installer(), False),
        mode("snapshotter()", _harness.installer(), True),
        mode("snapshot()", _harness.installer(), "snapshot"),
    ]
    paired_table(oq, base, modes, rounds,
                 f"{rounds} pairs of {oq.ops}-op runs, "
                 f"{'worker thread' if worker else 'no worker (ops queued to a list)'}",
                 width=24, sums=True, run=None if worker else no_worker)


def paired_table(oq, base: _harness.Mode, modes: list, rounds: int, title: str, width: int,
                 sums: bool = False, run=None) -> None:
    """Measure ``modes`` against ``base`` in pairs on ``oq`` (its worker thread unless
    ``run`` is given), close it, print per mode the median of the per-pair ratios
    [quartiles] (and the ratio of the sums)."""
    try:
        out = _harness.paired(run or oq.run, base, modes, rounds, warm=None if run else oq.warm,
                              fresh=oq.renew)
    finally:
        oq.close()
    print(f"CPython {sys.version.split()[0]}, {title}")
    for name, ps in out.items():
        r = sorted(t / b for b, t in ps)
        q = len(r) // 4
        line = f"  {name:{width}s} median {statistics.median(r):.3f} [{r[q]:.2f}-{r[-q - 1]:.2f}]"
        if sums:
            line += f"  ratio of sums {sum(t for _, t in ps) / sum(b for b, _ in ps):.3f}"
        print(line)


def floor(rounds: int) -> None:
    """Pairs for a bare ``sys.monitoring`` tool, not monstack: global events on a free
    tool id whose callback returns DISABLE at once (so each code location delivers one
    event), against no tool. What CPython's instrumentation alone costs the workload."""
    mon = sys.monitoring
    E = mon.events
    tool = next(t for t in (5, 4, 3, 2, 1, 0) if mon.get_tool(t) is None)

    def disable(*args):
        return mon.DISABLE

    def enter_with(events: tuple):
        def enter() -> str:
            mon.use_tool_id(tool, "opqueue-cost-floor")
            for e in events:
                mon.register_callback(tool, e, disable)
            mon.set_events(tool, sum(events))
            return f"tool {tool}"
        return enter

    def leave() -> None:
        if mon.get_tool(tool) is not None:
            mon.set_events(tool, 0)
            mon.free_tool_id(tool)

    w, fw, oq = _setup(1800)

    def mode(name: str, enter) -> _harness.Mode:
        def go():
            info = enter()
            oq.configure(False)
            return info
        return _harness.Mode(name, go, leave)

    base = mode("no tool", _harness.nothing)
    modes = [
        mode("no tool again", _harness.nothing),
        mode("PY_START", enter_with((E.PY_START,))),
        mode("PY_START/RESUME/RETURN/YIELD", enter_with((E.PY_START, E.PY_RESUME, E.PY_RETURN, E.PY_YIELD))),
        mode("CALL", enter_with((E.CALL,))),
    ]
    paired_table(oq, base, modes, rounds, f"{rounds} pairs of 1800-op runs, a bare tool whose callbacks return DISABLE",
                 width=30)


def _pairs_json(rounds: int, out: str) -> None:
    """One process of ``ab``: installed and snapshotter() pairs, raw ratios to ``out``."""
    import json

    w, fw, oq = _setup(1800)

    def mode(name: str, enter, capture) -> _harness.Mode:
        return _mode(oq, name, enter, capture)

    base = mode("no capture", _harness.nothing, False)
    modes = [mode("installed", _harness.installer(), False), mode("snapshotter", _harness.installer(), True)]
    try:
        res = _harness.paired(oq.run, base, modes, rounds, warm=oq.warm, fresh=oq.renew)
    finally:
        oq.close()
    with open(out, "w") as f:
        json.dump({"monstack": monstack.__file__, **{k: [t / b for b, t in v] for k, v in res.items()}}, f)


def ab(k: int, rounds: int, trees: list) -> None:
    import json
    import os
    import subprocess
    import tempfile

    got: dict = {t: {} for t in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(k):
            for t in trees:
                out = os.path.join(tmp, f"{len(got[t].get('installed', []))}-{trees.index(t)}.json")
                env = dict(os.environ, PYTHONPATH=os.path.abspath(t))
                subprocess.run([sys.executable, os.path.abspath(__file__),
                                "pairs-json", str(rounds), out], env=env, check=True)
                with open(out) as f:
                    d = json.load(f)
                if not d.pop("monstack").startswith(os.path.abspath(t)):
                    raise SystemExit(f"{t}: the process imported another monstack")
                for name, ratios in d.items():
                    got[t].setdefault(name, []).append(ratios)
    print(f"CPython {sys.version.split()[0]}, {k} processes x {rounds} pairs of 1800-op runs per checkout")
    for label, t in zip("AB", trees):
        print(f"  {label} {t}")
        for name, runs in got[t].items():
            flat = [r for run in runs for r in run]
            per = " ".join(f"{statistics.median(run):.3f}" for run in runs)
            print(f"    {name:12s} median {statistics.median(flat):.3f}  (per process: {per})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("instructions")
    i.add_argument("mode", choices=["none", "installed", "snapshotter", "snapshot", "filtered", "uninstalled"])
    i.add_argument("ops", type=int)
    q = sub.add_parser("pairs")
    q.add_argument("rounds", type=int)
    q.add_argument("ops", type=int)
    q.add_argument("--no-worker", action="store_true")
    j = sub.add_parser("pairs-json")
    j.add_argument("rounds", type=int)
    j.add_argument("out")
    fl = sub.add_parser("floor")
    fl.add_argument("rounds", type=int)
    c = sub.add_parser("ab")
    c.add_argument("k", type=int)
    c.add_argument("rounds", type=int)
    c.add_argument("trees", nargs=2)
    a = p.parse_args(argv)
    if a.cmd == "instructions":
        instructions(a.mode, a.ops)
    elif a.cmd == "pairs-json":
        _pairs_json(a.rounds, a.out)
    elif a.cmd == "floor":
        floor(a.rounds)
    elif a.cmd == "ab":
        ab(a.k, a.rounds, a.trees)
    else:
        pairs(a.rounds, a.ops, not a.no_worker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
