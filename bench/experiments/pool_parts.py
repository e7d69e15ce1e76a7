#!/usr/bin/env python3
"""Where a thread-pool job's hop cost goes: the native submit and carrier taken apart.

``variants``: builds, for the running CPython (3.12-3.15, x86-64 Linux), copies of this
checkout whose native ``submit`` / carrier (``native/carrier.h``) do less than the shipped
ones, then times ``ThreadPoolExecutor(4).submit`` x 2000 of a trivial function + every
``result()`` in fresh processes, each copy in turn (order reversed every other turn), with
no monstack as the base. Every process runs on one CPU (``--cpu``) with a switch interval
of 100 s, so the submitting thread queues all 2000 jobs before a worker runs one: its CPU
time over the submitting loop is the submit side, the rest of the process's CPU time the
workers' side (and ``result()``). Figures: medians over processes of each one's best of 7
runs after 3 of warm-up, in µs per job. The variants are measurement probes, not
alternatives: most of them lose the origin::

    PYTHONPATH=. python3.14 bench/experiments/pool_parts.py variants --procs 9
    ... variants --only no-running,no-state       # a subset (``shipped`` always runs)

  shipped       native/carrier.h as it is (rebuilt here, as every variant is)
  no-running    the carrier leaves its thread's RUNNING cell alone (other threads no longer
                see the job's origin); the ContextVar is still set
  no-state      the carrier sets nothing: no RUNNING cell, no ContextVar (the job's own
                snapshots and current_origin() lose the origin; exceptions still get it)
  no-capture    submit takes no snapshot (the carrier carries None)
  no-reuse      a new carrier for every job (the carrier made last is not handed out
                again; the snapshot still is)
  no-carrier    submit takes the snapshot, drops it and queues fn itself
  pass-through  submit calls the original at once (its checks only)

Builds need gcc and the running CPython's headers (``native/build.py --list``). The
copies go to a temporary directory (``--keep DIR`` keeps them there). The measured figures
and what they showed are in docs/benchmarks.md ("The cost of a hop").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _variants import Refused, blob_name, last_line, make_tree  # noqa: E402

_RUNNING_SET = """    PyObject *cell = mc_cell(c), *prev = NULL;
    if (cell == NULL) {
        c->PyErr_Clear(); /* (the job runs all the same; other threads do not see its origin) */
    } else {
        prev = ((PyListObject *)cell)->ob_item[0]; /* (the cell's reference, ours now) */
        Py_INCREF(snap);
        ((PyListObject *)cell)->ob_item[0] = snap;
    }
"""
_RUNNING_RESTORE = """    /* finally: the cell as it was, the origin reset (an exception set aside meanwhile) */
    if (cell != NULL) {
        if (Py_SIZE(cell) >= 1) { /* (resized meanwhile: running_cell() repairs it next time) */
            PyObject *now = ((PyListObject *)cell)->ob_item[0];
            ((PyListObject *)cell)->ob_item[0] = prev;
            if (now != NULL) {
                ms_decref(now);
            }
        } else {
            ms_decref(prev); /* (emptied meanwhile: left as it is) */
        }
        ms_decref(cell);
    }
"""
_NO_RUNNING = [
    (_RUNNING_SET, "    /* pool_parts: no RUNNING cell */\n"),
    (_RUNNING_RESTORE, "    /* pool_parts: no RUNNING cell to put back */\n"),
]
_NO_VAR = [
    ("""    PyObject *token = c->PyContextVar_Set(c->var, snap);
    if (token == NULL) {
        goto done;
    }
""", """    PyObject *token = c->none; /* pool_parts: no ContextVar set */
    Py_INCREF(token);
"""),
    ("""    if (c->PyContextVar_Reset(c->var, token) < 0) {
        c->PyErr_Clear(); /* entered another context in between: leave it be */
    }
    ms_decref(token);
    mc_reused_done(c, self);""", """    ms_decref(token); /* pool_parts: no ContextVar to reset */
    mc_reused_done(c, self);"""),
]

#: variant -> [(text of native/carrier.h, its replacement)], applied in order; each text
#: occurs exactly once when its turn comes (tests/integration/test_bench.py checks that
#: they still do).
EDITS: Dict[str, List[Tuple[str, str]]] = {
    "no-running": _NO_RUNNING,
    "no-state": _NO_RUNNING + _NO_VAR,
    "no-capture": [(
        "    PyObject *snap = nr_capture(c, SB(SB_CAPTURE), &dropped);\n",
        "    PyObject *snap = c->none; /* pool_parts: no snapshot */\n    Py_INCREF(snap);\n",
    )],
    "no-reuse": [(
        "    if (last != NULL && Py_TYPE(last) == (PyTypeObject *)c->cls",
        "    if (0 /* pool_parts: a new carrier per job */ && last != NULL && Py_TYPE(last) == (PyTypeObject *)c->cls",
    )],
    "no-carrier": [(
        "        carrier = ms_carrier_new(table, pair, 2); /* (a collection may run Python code here) */\n",
        "        carrier = fn; /* pool_parts: fn queued as it is */\n        Py_INCREF(carrier);\n"
        "        (void)pair;\n",
    )],
    "pass-through": [(
        "    /* snap = capture(); on an Exception: call through with fn unwrapped */\n",
        "    return c->PyObject_Vectorcall(call, args, nargsf, kwnames); /* pool_parts: pass-through */\n",
    )],
}
VARIANTS = ["shipped", *EDITS]

CHILD = r"""
import json, os, sys, time
os.sched_setaffinity(0, {int(sys.argv[2])})
sys.setswitchinterval(100)
if sys.argv[1] == "on":
    import monstack
    monstack.install()
from concurrent.futures import ThreadPoolExecutor
def job(x):
    return x
ex = ThreadPoolExecutor(4)
N = 2000
def run():
    t0 = time.process_time(); s0 = time.thread_time()
    fs = [ex.submit(job, i) for i in range(N)]
    s1 = time.thread_time()
    for f in fs:
        f.result()
    return s1 - s0, time.process_time() - t0
for _ in range(3):
    run()
runs = [run() for _ in range(7)]
best = min(runs, key=lambda r: r[1])
mod = sys.modules.get("monstack")
print(json.dumps({"submit": best[0] / N * 1e6, "total": best[1] / N * 1e6,
                  "monstack": os.path.dirname(mod.__file__) if mod else ""}))
"""


def edited_source(text: str, variant: str) -> str:
    """native/carrier.h's ``text`` as ``variant`` builds it."""
    for old, new in EDITS.get(variant, []):
        if text.count(old) != 1:
            raise Refused(f"{variant}: its edit no longer applies to native/carrier.h (update EDITS)")
        text = text.replace(old, new)
    return text


def _measure(tree: str, mode: str, cpu: int, dest: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, str(cpu)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=tree), cwd=dest)
    if proc.returncode != 0:
        raise Refused(f"the measuring process failed: {last_line(proc.stderr)}")
    got: dict = json.loads(proc.stdout.strip().splitlines()[-1])
    if mode == "on" and not got["monstack"].startswith(tree):
        raise Refused("the measuring process imported another monstack")
    return got


def variants(names: List[str], procs: int, cpu: int, keep: str) -> None:
    blob = blob_name()
    dest = os.path.abspath(keep) if keep else tempfile.mkdtemp(prefix="pool-parts-")
    try:
        trees = {v: make_tree(dest, v, blob, "carrier.h", lambda text, v=v: edited_source(text, v)) for v in names}
        runs = ["off", *names]
        got: Dict[str, List[dict]] = {v: [] for v in runs}
        for i in range(procs):
            for v in (runs if i % 2 == 0 else runs[::-1]):
                tree = trees["shipped" if v == "off" else v]
                got[v].append(_measure(tree, "off" if v == "off" else "on", cpu, dest))
    finally:
        if not keep:
            shutil.rmtree(dest, ignore_errors=True)
    med = {v: {k: statistics.median(d[k] for d in got[v]) for k in ("submit", "total")} for v in runs}
    off = med["off"]
    print(f"CPython {sys.version.split()[0]}, {procs} processes per variant on CPU {cpu}; "
          "µs per job, then what it adds over no monstack")
    print(f"  {'variant':13s} {'submit side':>18s} {'workers and rest':>18s} {'total':>18s} ratio")
    for v in runs:
        m = med[v]
        rest, off_rest = m["total"] - m["submit"], off["total"] - off["submit"]
        cells = [(m["submit"], m["submit"] - off["submit"]), (rest, rest - off_rest),
                 (m["total"], m["total"] - off["total"])]
        text = " ".join(f"{a:9.2f} {b:+7.2f} " for a, b in cells)
        print(f"  {v:13s} {text} {m['total'] / off['total']:5.2f}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("variants")
    v.add_argument("--procs", type=int, default=9, help="processes per variant (default 9)")
    v.add_argument("--only", default="", help="comma-separated variants (shipped always runs)")
    v.add_argument("--cpu", type=int, default=-1, help="the CPU every process runs on (default: the last one "
                   "this process may use)")
    v.add_argument("--keep", default="", metavar="DIR", help="build the copies in DIR and keep them")
    a = p.parse_args(argv)
    try:
        names = VARIANTS
        if a.only:
            asked = [n.strip() for n in a.only.split(",") if n.strip()]
            unknown = [n for n in asked if n not in VARIANTS]
            if unknown:
                raise Refused(f"unknown variant {unknown[0]!r} (known: {', '.join(VARIANTS)})")
            names = ["shipped", *[n for n in asked if n != "shipped"]]
        if a.procs < 1:
            raise Refused("--procs must be at least 1")
        allowed = sorted(os.sched_getaffinity(0))
        cpu = allowed[-1] if a.cpu < 0 else a.cpu
        if cpu not in allowed:
            raise Refused(f"--cpu {a.cpu}: not one of the CPUs this process may use ({allowed})")
        if a.keep and os.path.exists(a.keep) and os.listdir(a.keep):
            raise Refused(f"--keep {a.keep}: not an empty directory")
        variants(names, a.procs, cpu, a.keep)
    except Refused as exc:
        print(f"pool_parts: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
