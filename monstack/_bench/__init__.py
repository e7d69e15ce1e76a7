"""``python -m monstack bench``: what monstack costs, next to the alternatives, in one run.

Sections (``--only`` selects some):

- ``snapshot``: cost of one capture at depth 10/50/200 -- ``monstack.snapshot()`` on every
  backend that can run here (and native / pure-Python callbacks when ``install()`` takes
  ``accelerator``), a plain ``sys._getframe`` walk, ``traceback.extract_stack()``, the
  asyncio debug-mode capture, and jax's / torch's native capture when they import.
- ``tax``: tracking tax, tracked time / untracked time, on call-heavy, method-heavy,
  generator, exception-heavy, mixed and thread-pool workloads; with ``track="all"``, the
  default policy, the workload filtered out, and empty ``sys.monitoring`` callbacks (the
  CPython floor).
- ``opqueue``: user model code a few dozen frames deep calls an excluded "framework" whose
  every op does eager-framework-like Python dispatch, takes a snapshot and queues the op to
  a worker thread. Ratios to no capture at all, cost per op, and the crossover (how light an
  op can be before the default policy costs more than 10%).
- ``memory``: bytes per snapshot over many snapshots at depth 50, peak RSS, and proof that
  snapshots keep no frames alive.
- ``dump``: ``monstack.threads()`` for 50 parked threads at depth 10 and 200, beside
  ``sys._current_frames()`` plus ``traceback.extract_stack`` (and a bare frame walk) for
  the same threads; the whole hang report at depth 50 beside
  ``faulthandler.dump_traceback(all_threads=True)`` (and ``py-spy dump`` where installed).

Method (the machines are shared and noisy): every timed workload runs >= 15 ms; each
measurement is the best of two runs after a warm-up; modes are interleaved round by round
(the order rotates each round); the figure reported is the median of the per-round values
or ratios, with min and max. The goals a figure is measured against are printed next to it;
timing goals live here, never in the unit tests.

Workloads are compiled into synthetic modules: ``monstack_bench_workload`` is "user code"
(tracked by the default policy); ``monstack_bench_framework.ops`` is compiled with a file
name inside site-packages, so the default policy excludes it exactly as it excludes an
installed framework. monstack's own files are never tracked.

Modules: ``_workloads`` (the synthetic modules and the op-queue driver), ``_harness`` (what
can run here, modes, timing), ``_sections`` (the five sections), ``_report`` (the table);
this module runs the sections and holds the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from typing import Any, Optional, Sequence

from monstack import _env

from ._harness import (
    CONFIGS,
    Config,
    backend_reasons,
    install_params,
    native_skipped,
    propagation_points,
    restore_install,
    saved_install,
)
from ._report import print_table
from ._sections import dump_costs, memory, opqueue, peak_rss_bytes, snapshot_costs, tracking_tax
from ._workloads import make_workloads

__all__ = ["CONFIGS", "SCHEMA", "SECTIONS", "Config", "main", "run"]

SCHEMA = 2
SECTIONS = ("snapshot", "tax", "opqueue", "memory", "dump")
#: One line per section, for ``--help``.
SECTION_HELP = {
    "snapshot": "one capture at depth 10/50/200, beside frame walks and others",
    "tax": "tracked time / untracked time on call-heavy and other workloads",
    "opqueue": "a framework snapshotting each op it queues: ratios, cost per op",
    "memory": "bytes per snapshot, peak RSS; snapshots keep no frames alive",
    "dump": "threads() and the hang report for 50 threads, beside faulthandler",
}
PROG = "python -m monstack bench"


def run(
    quick: bool = False,
    as_json: bool = False,
    file: Any = None,
    *,
    config: Optional[Config] = None,
    sections: Optional[Sequence[str]] = None,
) -> dict:
    """Run the bench, print it (table or JSON) to ``file`` and return the results."""
    file = file or sys.stdout
    cfg = config or CONFIGS["quick" if quick else "full"]()
    sections = list(sections) if sections else list(SECTIONS)
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise ValueError(f"unknown bench section(s) {bad}; valid choices: {list(SECTIONS)}")
    saved = saved_install()
    t0 = time.perf_counter()
    reasons = backend_reasons()
    results: dict = {
        "schema": SCHEMA,
        "python": sys.version.split()[0],
        "implementation": _env.IMPLEMENTATION,
        "machine": _env.MACHINE,
        "platform": sys.platform,
        "cpus": os.cpu_count(),
        "config": cfg.name,
        "quick": cfg.name == "quick",
        "rounds": cfg.rounds,
        "sections": sections,
        "backends": {k: (None if v is None else str(v)) for k, v in reasons.items()},
        "accelerator option": "accelerator" in install_params(),
        "propagation points": list(propagation_points()),
    }
    w = make_workloads()
    caught: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run_sections(cfg, w, sections, results, saved)
    results["warnings"] = sorted({f"{type(c.message).__name__}: {c.message}" for c in caught})
    results["native skipped"] = native_skipped()
    results["elapsed seconds"] = time.perf_counter() - t0
    results["peak rss bytes"] = peak_rss_bytes()
    if as_json:
        json.dump(results, file, indent=2, default=str)
        file.write("\n")
    else:
        print_table(results, file)
    return results


def _run_sections(cfg: Config, w: Any, sections: list, results: dict, saved: Optional[dict]) -> None:
    try:
        for section, fn in (("snapshot", snapshot_costs), ("tax", tracking_tax), ("opqueue", opqueue), ("memory", memory),
                            ("dump", dump_costs)):
            if section in sections:
                t = time.perf_counter()
                try:
                    results[section] = fn(cfg, w)
                except Exception as exc:  # one broken section must not hide the others
                    results[section] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
                results.setdefault("section seconds", {})[section] = time.perf_counter() - t
    finally:
        restore_install(saved)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """argv-style entry: ``[--quick] [--json] [--only SECTION[,SECTION]] [--rounds N]``."""
    from monstack._run import OneLineParser

    p = OneLineParser(
        prog=PROG,
        description="what monstack costs, as ratios measured in one run",
        epilog="sections (all by default):\n" + "".join(f"  {name:9s} {SECTION_HELP[name]}\n" for name in SECTIONS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="smaller sizes, 3 rounds (< 30 s)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--only", default="", metavar="SECTION[,SECTION]", help="comma-separated sections: " + ", ".join(SECTIONS))
    p.add_argument("--rounds", type=int, default=None, help="rounds of every section (default 7, --quick 3; op-queue pairs: 21, --quick 5)")
    p.add_argument("--config", choices=sorted(CONFIGS), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()] or None
    bad = [s for s in sections or () if s not in SECTIONS]
    if bad:  # one line, as for any bad usage
        sys.stderr.write(f"{PROG}: unknown section {', '.join(map(repr, bad))} (valid: {', '.join(SECTIONS)})\n")
        return 2
    if args.rounds is not None and args.rounds < 1:
        sys.stderr.write(f"{PROG}: --rounds must be a whole number >= 1, got {args.rounds}\n")
        return 2
    cfg = CONFIGS[args.config or ("quick" if args.quick else "full")]()
    if args.rounds:
        cfg.rounds = cfg.opqueue_rounds = max(1, args.rounds)
    run(as_json=args.json, config=cfg, sections=sections)
    return 0
