#!/usr/bin/env python3
"""Grade a bench run against the issue targets (issues 3, 7, 10, 20 and 21), for developers.

``python -m monstack bench`` reports figures and the goals it states for users; this script
reads its JSON output and prints, per issue target, the figure and the verdict (met, NOT MET,
or n/a when the run has no such figure or the figure is invalid). It reads only the JSON, so
it grades a run saved on another machine too. Targets are stated for CPython 3.12 (issue 20:
for 3.14 and 3.15).

    PYTHONPATH=. python3.12 -m monstack bench --quick --json > /tmp/bench.json
    python3 bench/targets.py /tmp/bench.json
    PYTHONPATH=. python3.12 -m monstack bench --json | python3 bench/targets.py    # stdin
    python3 bench/targets.py --json /tmp/bench.json    # the verdicts as JSON
    python3 bench/targets.py --strict /tmp/bench.json  # exit 1 if a target is NOT MET
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

#: Names the bench's JSON uses (monstack/_bench: SECTIONS, and the op-queue's two floor rows).
SECTIONS = ("snapshot", "tax", "opqueue", "memory", "dump")
NOISE_FLOOR = "no capture again (noise)"
FILTERED_FLOOR = "every code filtered, no snapshot"


# The JSON readers the bench's own report uses (this checkout's monstack).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from monstack._bench._report import _get, main_snapshot_method  # noqa: E402


def targets(r: dict) -> list[dict]:
    """One verdict per target the run has a figure for: issue, target, value, met (True,
    False, or None: no verdict or an invalid figure) and a note."""
    out: list[dict] = []

    def add(issue: int, what: str, value: Any, met: Optional[bool], note: str = "", *invalid: Any) -> None:
        bad = [i["invalid"] for i in invalid if isinstance(i, dict) and i.get("invalid")]
        if bad:
            met, note = None, "INVALID: " + bad[0]
        out.append({"issue": issue, "target": what, "value": value, "met": met, "note": note})

    snap = r.get("snapshot") or {}
    methods = snap.get("methods", {})
    main = main_snapshot_method(methods)
    med = lambda name, depth: _get(methods, name, str(depth), "median")  # noqa: E731
    if main:
        d10, d50, d200 = med(main, 10), med(main, 50), med(main, 200)
        r200 = _get(snap, "main depth ratios", "200/10", "median")
        if r200 is None and d10 and d200:
            r200 = d200 / d10
        if r200 is not None:
            add(3, "snapshot depth 200 <= 1.3x depth 10", round(r200, 2), r200 <= 1.3, main)
        rw = _get(snap, "ratio to main", "plain sys._getframe walk", "50", "median")
        if rw is not None:
            add(3, "plain walk at depth 50 >= 20x snapshot", round(rw, 1), rw >= 20, main)
        worst = max(v for v in (d10, d50, d200) if v is not None) if any((d10, d50, d200)) else None
        if worst is not None:
            add(10, "snapshot at depth 10/50/200 <= 0.3 us", f"{worst * 1e6:.3f} us (worst depth)", worst <= 0.3e-6, main)
        fast = f"{main}, snapshotter()"
        vals = [v for v in (med(fast, d) for d in (10, 50, 200)) if v is not None]
        if vals:
            add(10, "snapshot at depth 10/50/200 <= 0.3 us, snapshotter()", f"{max(vals) * 1e6:.3f} us (worst depth)",
                max(vals) <= 0.3e-6, fast)
        rj = _get(snap, "ratio to main", "jax Traceback.get_traceback", "50", "median")
        add(7, "snapshot depth 50 <= jax get_traceback", None if rj is None else f"jax = {rj:.2f}x monstack",
            None if rj is None else rj >= 1.0, "jax not importable" if rj is None else "")
    tax = r.get("tax") or {}
    fib = _get(tax, "ratios", "call-heavy (fib)") or {}
    all_ = _get(fib, "track='all'", "median")
    if all_ is not None:
        inv = fib.get("track='all'")
        add(3, "fib tax track='all' <= 8x", round(all_, 2), all_ <= 8, "", inv)
        add(10, "fib tax track='all' <= 5x", round(all_, 2), all_ <= 5,
            tax.get("mode info", {}).get("track='all'", ""), inv)
        empty = _get(fib, "empty callbacks", "median")
        if empty:
            add(10, "fib tax track='all' within 1.5x of empty callbacks", f"{all_ / empty:.2f}x of {empty:.2f}x",
                all_ / empty <= 1.5, "", inv)
    if all_ is not None:
        add(20, "fib tax track='all' <= 2.5x (3.14/3.15)", round(all_, 2), all_ <= 2.5,
            tax.get("mode info", {}).get("track='all'", ""), fib.get("track='all'"))
    exc = _get(tax, "ratios", "exception-heavy") or {}
    exc_filt = _get(exc, "workload filtered", "median")
    if exc_filt is not None:
        add(20, "exception-heavy, workload filtered <= 1.3x", round(exc_filt, 2), exc_filt <= 1.3, "",
            exc.get("workload filtered"))
    filt = _get(fib, "workload filtered", "median")
    if filt is not None:
        add(3, "fib tax with the workload filtered <= 1.1x", round(filt, 2), filt <= 1.1, "", fib.get("workload filtered"))
    oq = r.get("opqueue") or {}
    dflt = _get(oq, "ratios", "default policy", "median")
    walk = _get(oq, "ratios", "walk per op", "median")
    if dflt is not None:
        inv = _get(oq, "ratios", "default policy")
        how = "framework binds snapshotter()"
        floor = _get(oq, "ratios", NOISE_FLOOR)
        if floor:
            how += f"; noise floor {floor['median']:.3f}x [{floor['min']:.2f}-{floor['max']:.2f}]"
        filtered = _get(oq, "ratios", FILTERED_FLOOR, "median")
        if filtered is not None:
            how += f"; every code filtered {filtered:.3f}x"
        add(7, "op-queue default policy <= 1.10x no capture", round(dflt, 3), dflt <= 1.10, how, inv)
        add(10, "op-queue default policy <= 1.05x no capture", round(dflt, 3), dflt <= 1.05, how, inv)
        if filtered is not None:
            # the floor a tool with every code DISABLEd already costs (installed, nothing tracked)
            add(20, "op-queue <= 1.05x, or within 2% of the filtered floor", f"{dflt:.3f}x vs floor {filtered:.3f}x",
                dflt <= 1.05 or dflt <= filtered * 1.02, how, inv)
        plain = _get(oq, "ratios", "default policy, snapshot()", "median")
        if plain is not None:
            add(10, "op-queue default policy <= 1.05x, calling snapshot()", round(plain, 3), plain <= 1.05,
                "framework calls monstack.snapshot", _get(oq, "ratios", "default policy, snapshot()"))
        if walk is not None:
            add(7, "op-queue default policy faster than a walk per op", f"{dflt:.3f}x vs {walk:.3f}x", dflt < walk, "", inv)
    mem = r.get("memory") or {}
    for name, run in (mem.get("runs") or {}).items():
        if name.endswith("same frame") and not name.startswith("walk"):
            b = run.get("bytes per snapshot")
            add(7, f"< 120 bytes per snapshot ({name})", round(b, 1), b < 120)
        if name.endswith("new frame each") and not name.startswith("walk"):
            b = run.get("bytes per snapshot")
            # not the issue's measure (a loop in one frame): shown for what a fresh call costs
            add(7, f"bytes per snapshot ({name}), for information", round(b, 1), None,
                "each snapshot here also fills a new 64-B node for its new frame")
    for name, lv in (mem.get("liveness") or {}).items():
        ok = lv.get("local dead without gc") and lv.get("frame objects reachable from snapshots") == 0
        add(7, f"no frames kept alive ({name})", ok, bool(ok))
    dump = r.get("dump") or {}
    dr = _get(dump, "threads() depth ratio", "median")
    if dr is not None:
        d0, d1 = (dump.get("depths") or ["?", "?"])[0], (dump.get("depths") or ["?", "?"])[-1]
        add(21, f"threads() x{dump.get('threads')} depth {d1} <= 1.5x depth {d0}", round(dr, 2), dr <= 1.5,
            dump.get("backend", ""))
        for d, s in (dump.get("threads() / extract_stack") or {}).items():
            add(21, f"threads() < _current_frames()+extract_stack, depth {d}", round(s["median"], 3), s["median"] < 1)
    for name, s in (dump.get("report ratios") or {}).items():
        add(21, f"{name} / faulthandler, for information", round(s["median"], 2), None)
    if r.get("quick") and r.get("elapsed seconds") is not None and r.get("sections") == list(SECTIONS):
        add(7, "--quick under 30 s", round(r["elapsed seconds"], 1), r["elapsed seconds"] < 30)
    return out


def render(verdicts: list[dict], file: Any) -> None:
    w = file.write
    w("Targets (issues 3, 7, 10, 20, 21; stated for CPython 3.12; #20 for 3.14/3.15):\n")
    for t in verdicts:
        verdict = {True: "met", False: "NOT MET", None: "n/a"}[t["met"]]
        note = f"  ({t['note']})" if t["note"] else ""
        w(f"  #{t['issue']:<3d}{t['target']:58s} {str(t['value']):>22s}  {verdict}{note}\n")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="bench/targets.py", description="grade a bench run's JSON against the issue targets")
    p.add_argument("file", nargs="?", default="-", help="the output of `python -m monstack bench --json` (default: stdin)")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 if any target is NOT MET")
    args = p.parse_args(argv)
    if args.file == "-":
        results = json.load(sys.stdin)
    else:
        with open(args.file) as f:
            results = json.load(f)
    verdicts = targets(results)
    if args.json:
        json.dump(verdicts, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        w = sys.stdout.write
        w(f"bench run: CPython {results.get('python')} {results.get('machine')}, {results.get('config')} sizes, "
          f"sections {', '.join(results.get('sections') or [])}\n")
        render(verdicts, sys.stdout)
    return 1 if args.strict and any(t["met"] is False for t in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
