#!/usr/bin/env python3
"""Where the op-queue's per-op snapshot cost goes: the native snapshot taken apart.

``variants``: builds, for the running CPython (3.12-3.15, x86-64 Linux), copies of this
checkout whose native ``capture()`` (what ``monstack.snapshotter()`` returns) does less than
the shipped one, then measures each with ``bench/opqueue_cost.py pairs-json`` (installed /
no capture and ``snapshotter()`` / no capture pairs) in its own processes, the copies
alternating (order reversed every other turn). Each copy's figure is the median of all its
per-pair ratios; per-process medians show the spread. The variants are measurement
probes, not alternatives: most of them return something that is not a snapshot::

    PYTHONPATH=. python3.14 bench/experiments/opqueue_parts.py variants --procs 4 --pairs 15
    ... variants --only shipped,no-object,node-only    # a subset (``shipped`` always runs)

  shipped      native/sysmon.c as it is (rebuilt here, as every variant is)
  no-context   the origin ContextVar is not read (every snapshot has no origin)
  no-walk      the caller is not looked for through the framework's filtered frames
               (the call-site offset is 0)
  no-object    everything but the Snapshot: capture() returns the top node, so no
               Snapshot is allocated or freed
  node-only    capture() finds the thread's cell and returns its top node, nothing else
  call-only    capture() returns None at once: the call from the framework alone

``probes ROUNDS``: the same pairs in one process for callables that are not monstack's,
bound where the framework calls ``capture()``: ``functools.partial(operator.getitem, cell,
0)`` (a C call that returns the thread's top node, which each queued op then holds, as a
snapshot does) and ``object`` (a C call that allocates an object the worker frees), beside
installed and ``snapshotter()``::

    PYTHONPATH=. python3.14 bench/experiments/opqueue_parts.py probes 40

Builds need gcc and the running CPython's headers (``native/build.py --list``). The
copies go to a temporary directory (``--keep DIR`` keeps them there). The measured figures
and what they showed are in docs/benchmarks.md ("The op-queue's snapshot, taken apart").
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
from _variants import ROOT, Refused, blob_name, last_line, make_tree  # noqa: E402
OPQUEUE = os.path.join(ROOT, "bench", "opqueue_cost.py")

_CAPTURE_BUILD = """    PyObject *snap = ms_build_snapshot(st, 0);
    if (snap != NONE) {"""

#: variant -> (text of native/sysmon.c, its replacement); each text occurs exactly once
#: (tests/integration/test_bench.py checks that they still do).
EDITS: Dict[str, Tuple[str, str]] = {
    "no-context": (
        """    if (API.PyContextVar_Get(st->origin_var, NULL, &origin) < 0) {
        API.PyErr_Clear();
        goto none;
    }""",
        "    /* (opqueue_parts no-context: the origin is not read) */",
    ),
    "no-walk": (
        """    _PyInterpreterFrame *caller = from_caller ? f->previous : f;
    PyCodeObject *code;""",
        """    if (f != NULL) { /* opqueue_parts no-walk */
        *top_out = top;
        *lasti_out = 0;
        return 1;
    }
    _PyInterpreterFrame *caller = from_caller ? f->previous : f;
    PyCodeObject *code;""",
    ),
    "no-object": (
        """    Py_INCREF(top); /* before the allocation: a collection may replace cell[0] */""",
        """    Py_INCREF(top); /* before the allocation: a collection may replace cell[0] */
    if (!from_caller) { /* opqueue_parts no-object: capture() returns the node */
        ms_decref(off);
        ms_decref(meta);
        ms_decref(origin);
        return top;
    }""",
    ),
    "node-only": (
        _CAPTURE_BUILD,
        """    { /* opqueue_parts node-only */
        int is_none = 0;
        PyObject *cell = ms_cell(st, API.PyThreadState_Get(), &is_none);
        if (cell != NULL) {
            PyObject *top = ((PyListObject *)cell)->ob_item[0];
            Py_INCREF(top);
            return top;
        }
        API.PyErr_Clear();
    }
""" + _CAPTURE_BUILD,
    ),
    "call-only": (
        _CAPTURE_BUILD,
        """    if (st->snap_cls != NULL) { /* opqueue_parts call-only */
        Py_INCREF(NONE);
        return NONE;
    }
""" + _CAPTURE_BUILD,
    ),
}
VARIANTS = ["shipped", *EDITS]


def edited_source(text: str, variant: str) -> str:
    """native/sysmon.c's ``text`` as ``variant`` builds it."""
    if variant == "shipped":
        return text
    old, new = EDITS[variant]
    if text.count(old) != 1:
        raise Refused(f"{variant}: its edit no longer applies to native/sysmon.c (update EDITS)")
    return text.replace(old, new)


def variants(names: List[str], procs: int, pairs: int, keep: str) -> None:
    blob = blob_name()
    dest = os.path.abspath(keep) if keep else tempfile.mkdtemp(prefix="opqueue-parts-")
    try:
        trees = {v: make_tree(dest, v, blob, "sysmon.c", lambda text, v=v: edited_source(text, v)) for v in names}
        got: Dict[str, List[dict]] = {v: [] for v in names}
        out = os.path.join(dest, "pairs.json")
        for i in range(procs):
            for v in (names if i % 2 == 0 else names[::-1]):
                proc = subprocess.run([sys.executable, OPQUEUE, "pairs-json", str(pairs), out],
                                      env=dict(os.environ, PYTHONPATH=trees[v]), stderr=subprocess.PIPE, text=True)
                if proc.returncode != 0:
                    raise Refused(f"{v}: the measuring process failed: {last_line(proc.stderr)}")
                with open(out) as f:
                    d = json.load(f)
                if not d.pop("monstack").startswith(trees[v]):
                    raise Refused(f"{v}: the measuring process imported another monstack")
                got[v].append(d)
    finally:
        if not keep:
            shutil.rmtree(dest, ignore_errors=True)
    print(f"CPython {sys.version.split()[0]}, {procs} processes x {pairs} pairs of 1800-op runs per variant")
    print(f"  {'variant':11s} {'installed':>9s} {'snapshotter()':>13s}  per process")
    for v in names:
        ins = statistics.median(r for d in got[v] for r in d["installed"])
        snap = statistics.median(r for d in got[v] for r in d["snapshotter"])
        per = " ".join(f"{statistics.median(d['snapshotter']):.3f}" for d in got[v])
        print(f"  {v:11s} {ins:9.3f} {snap:13.3f}  {per}")


def probes(rounds: int) -> None:
    import functools
    import operator

    sys.path.insert(0, os.path.dirname(OPQUEUE))
    import opqueue_cost
    from monstack import _stack
    from monstack._bench import _harness

    w, fw, oq = opqueue_cost._setup(1800)

    def mode(name: str, enter, capture) -> _harness.Mode:
        def go():
            info = enter()
            oq.configure(capture is True)
            if capture == "node":  # the producer's cell, made by install()
                fw._capture = functools.partial(operator.getitem, _stack.get_cell(), 0)
            elif capture is not True and capture is not False:
                fw._capture = capture
            return info

        return _harness.Mode(name, go, _harness.nothing)

    base = mode("no capture", _harness.nothing, False)
    modes = [
        mode("no capture again", _harness.nothing, False),
        mode("installed", _harness.installer(), False),
        mode("installed, top node", _harness.installer(), "node"),
        mode("installed, object()", _harness.installer(), object),
        mode("snapshotter()", _harness.installer(), True),
    ]
    opqueue_cost.paired_table(oq, base, modes, rounds, f"{rounds} pairs of {oq.ops}-op runs", width=22)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("variants")
    v.add_argument("--procs", type=int, default=4, help="processes per variant (default 4)")
    v.add_argument("--pairs", type=int, default=15, help="pairs per process (default 15)")
    v.add_argument("--only", default="", help="comma-separated variants (shipped always runs)")
    v.add_argument("--keep", default="", metavar="DIR", help="build the copies in DIR and keep them")
    q = sub.add_parser("probes")
    q.add_argument("rounds", type=int)
    a = p.parse_args(argv)
    try:
        if a.cmd == "probes":
            if a.rounds < 1:
                raise Refused("ROUNDS must be at least 1")
            probes(a.rounds)
            return 0
        names = VARIANTS
        if a.only:
            asked = [n.strip() for n in a.only.split(",") if n.strip()]
            unknown = [n for n in asked if n not in VARIANTS]
            if unknown:
                raise Refused(f"unknown variant {unknown[0]!r} (known: {', '.join(VARIANTS)})")
            names = ["shipped", *[n for n in asked if n != "shipped"]]
        if a.procs < 1 or a.pairs < 1:
            raise Refused("--procs and --pairs must be at least 1")
        if a.keep and os.path.exists(a.keep) and os.listdir(a.keep):
            raise Refused(f"--keep {a.keep}: not an empty directory")
        variants(names, a.procs, a.pairs, a.keep)
    except Refused as exc:
        print(f"opqueue_parts: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
