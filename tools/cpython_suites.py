#!/usr/bin/env python3
"""Run CPython's own regression tests with and without monstack and compare the results.

For every supported CPython found (3.11 to 3.15 through pyenv, or pythonX.Y on
PATH), runs ``python -m test`` on the suites that exercise what monstack hooks into
(preset ``default``: threading, concurrent.futures, generators, coroutines, contextlib,
logging; preset ``asyncio``: test_asyncio and test_threading) in three modes:

- ``off``:  monstack not imported (the baseline);
- ``user``: ``MONSTACK=1``, started as the ``.pth`` line starts it, default policy -- the
  standard library, and so CPython's own tests, is *not* tracked: this checks that the
  callbacks' filtering (DISABLE, PY_UNWIND/PY_THROW checks) changes nothing;
- ``all``:  ``MONSTACK=1 MONSTACK_TRACK=all`` -- every frame of the tests is pushed and
  popped, the strongest check that tracking is invisible to the program.

monstack is switched on in every interpreter of the run (regrtest, its workers, the
subprocesses the tests start unless they run isolated with ``-I``/``-E``, and
subinterpreters) by a ``sitecustomize`` module on PYTHONPATH. Each interpreter writes a
line to a log at start-up (backend in use) and at exit (backend still active? -- a
self-uninstall after an internal error shows up here), and the summary reports those.
Packages (test_asyncio, test_concurrent_futures) run as one regrtest name per submodule,
each in its own worker process (``-j 1`` by default), so the per-test timeout and a crash
cost one submodule.

Per test case (from regrtest's ``--junit-xml``) the pass/fail/skip sets of each mode are
compared with the baseline; failures are re-run once (``-w``) in every mode alike so a
timing-sensitive test does not show up as a difference. Exit status 0 when every mode
matches its baseline on every interpreter.

    python tools/cpython_suites.py                     # all interpreters, all modes, preset default
    python tools/cpython_suites.py --python 3.12 --modes off,all --tests test_threading
    python tools/cpython_suites.py --python 3.14 --modes off,user --tests asyncio --out /tmp/suites
    python tools/cpython_suites.py --python 3.14 --modes off,user,all --tests asyncio --out /tmp/suites --skip-existing

The summary is printed and written to ``OUT/summary.md``; docs/cpython-suites.md has the
last results.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = ("3.11", "3.12", "3.13", "3.14", "3.15")
DEFAULT_TESTS = (
    "test_threading",
    "test_threading_local",
    "test_concurrent_futures",
    "test_generators",
    "test_coroutines",
    "test_contextlib",
    "test_contextlib_async",
    "test_logging",
)
#: ``--tests`` accepts these names for the sets the issues ask for.
PRESETS = {
    "default": DEFAULT_TESTS,
    "asyncio": ("test_asyncio", "test_threading"),
}
#: Test packages run as one regrtest name per submodule (``test_asyncio.test_tasks``...),
#: so the per-test timeout applies to each submodule and a hang or crash costs one of them.
SPLIT = ("test_asyncio", "test_concurrent_futures")
MODES = ("off", "user", "all")

#: Differences that are not monstack bugs: test id suffix -> (modes, reason).
EXPECTED = {
    "test_generators.SignalAndYieldFromTest.test_raise_and_yield_from": (
        ("user", "all"),
        "CPython itself: with any sys.monitoring tool whose PY_RESUME callback is Python code "
        "(monstack's pure-Python callbacks; its native ones run no bytecode), a SIGINT pending at "
        "`send` into a `yield from` chain is raised in the outer generator at its instrumented "
        "RESUME, not the innermost one (bpo-30039's guarantee); reproduced without monstack by "
        "tests/programs/sysmon_sigint_yield_from.py --tool",
    ),
    "test_threading.ExceptHookTests.test_original_excepthook": (
        ("all",),
        "by design: the test compares the report of the threading.excepthook in place "
        "(monstack's, which shows where the thread was started) with threading.__excepthook__'s "
        "(no origin); with track='all' the origin has the test's own lines (with the default "
        "policy it has no tracked frame: nothing is shown, the outputs are equal)",
    ),
}

SITECUSTOMIZE = r'''
import os, sys
_mode = os.environ.get("MONSTACK_COMPAT_MODE", "off")
_log = os.environ.get("MONSTACK_COMPAT_LOG")
if _mode != "off":
    def _note(text):
        if _log:
            try:
                with open(_log, "a") as f:
                    f.write(text + "\n")
            except OSError:
                pass
    try:
        import atexit
        # What MONSTACK=1 does at start-up (the .pth line); MONSTACK_TRACK=all in `all` mode.
        import monstack._startup
        monstack._startup.boot()
        import monstack
        from monstack import _stack
        _st = monstack.status()
        _note(f"start {os.getpid()} {monstack.active_backend()} accelerator={str(_st.get('accelerator') or _st.get('eval_frame')).split(' ')[0]} {_st.get('policy')}")
        def _at_exit():
            _note(f"exit {os.getpid()} {monstack.active_backend()} seed={_stack.STATS['seed']} resync={_stack.STATS['resync']}")
        atexit.register(_at_exit)
    except Exception as exc:
        _note(f"error {os.getpid()} {exc!r}")
        raise
'''


def find_python(version: str) -> str | None:
    """The interpreter for ``3.X``: pyenv's versions, then ``python3.X`` on PATH."""
    roots = []
    pyenv = shutil.which("pyenv")
    if pyenv:
        try:
            roots.append(subprocess.run([pyenv, "root"], capture_output=True, text=True, check=True).stdout.strip())
        except (OSError, subprocess.CalledProcessError):
            pass
    roots.append(os.path.expanduser("~/.pyenv"))
    for root in roots:
        for cand in sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"), reverse=True):
            if os.access(cand, os.X_OK):
                return cand
    cand = shutil.which(f"python{version}")
    return cand


def available_tests(python: str, wanted: list[str]) -> tuple[list[str], list[str]]:
    code = (
        "import importlib.util, json, sys\n"
        "def found(n):\n"
        "    try:\n"
        "        return importlib.util.find_spec('test.' + n) is not None\n"
        "    except ImportError:\n"
        "        return False\n"
        "out = {n: found(n) for n in sys.argv[1:]}\n"
        "print(json.dumps(out))"
    )
    res = subprocess.run([python, "-c", code, *wanted], capture_output=True, text=True)
    found = json.loads(res.stdout)
    return [t for t in wanted if found.get(t)], [t for t in wanted if not found.get(t)]


def expand_tests(python: str, names: list[str]) -> list[str]:
    """Preset names replaced by their tests; packages in SPLIT replaced by their submodules."""
    tests: list[str] = []
    for name in names:
        tests += PRESETS.get(name, (name,))
    split = [t for t in tests if t in SPLIT]
    if not split:
        return tests
    code = (
        "import importlib.util, json, pkgutil, sys\n"
        "out = {}\n"
        "for n in sys.argv[1:]:\n"
        "    spec = importlib.util.find_spec('test.' + n)\n"
        "    locs = spec.submodule_search_locations if spec else None\n"
        "    out[n] = sorted(m.name for m in pkgutil.iter_modules(locs) if m.name.startswith('test_')) if locs else []\n"
        "print(json.dumps(out))"
    )
    res = subprocess.run([python, "-c", code, *split], capture_output=True, text=True)
    subs = json.loads(res.stdout) if res.returncode == 0 else {}
    out: list[str] = []
    for t in tests:
        out += [f"{t}.{m}" for m in subs.get(t, [])] or [t]
    return out


def parse_junit(path: Path) -> dict[str, str]:
    """test id -> 'pass' | 'fail' | 'skip' (the last result of a re-run test wins)."""
    out: dict[str, str] = {}
    if not path.exists():
        return out
    try:
        tree = ET.parse(path)
    except ET.ParseError:
        return out
    for case in tree.iter("testcase"):
        key = f"{case.get('classname', '')}.{case.get('name', '')}"
        status = "pass"
        for child in case:
            if child.tag in ("failure", "error"):
                status = "fail"
            elif child.tag == "skipped" and status == "pass":
                status = "skip"
        out[key] = status
    return out


def _child_setup(limit_mb: int):
    """preexec_fn of regrtest (its workers inherit both):

    - SIGINT and SIGQUIT back to their defaults: a shell starting this script in the
      background (``cmd &`` without job control) ignores them, Python then keeps SIGINT
      ignored, and every test relying on ``_thread.interrupt_main()`` or ``raise(SIGINT)``
      hangs or fails (3.14+'s regrtest installs its own handler; 3.11-3.13's does not);
    - an address-space limit, so a runaway test fails with MemoryError instead of
      swapping the shared machine out.
    """
    def apply() -> None:
        import resource
        import signal

        for sig in (signal.SIGINT, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        if limit_mb > 0:
            resource.setrlimit(resource.RLIMIT_AS, (limit_mb << 20, limit_mb << 20))
    return apply


def run_mode(python: str, version: str, mode: str, tests: list[str], out: Path, hookdir: Path, timeout: int, jobs: int, root: Path, report_only: bool = False, memory_mb: int = 0, skip_existing: bool = False) -> dict:
    tag = f"{version}-{mode}"
    xml = out / f"{tag}.xml"
    log = out / f"{tag}.log"
    plog = out / f"{tag}.processes"
    meta = out / f"{tag}.json"
    if report_only or (skip_existing and xml.exists()):
        try:
            saved = json.loads(meta.read_text())
        except (OSError, ValueError):
            saved = {"rc": None, "seconds": 0.0}
        return _collect(xml, log, plog, rc=saved["rc"], elapsed=saved["seconds"])
    for p in (xml, plog, meta):
        if p.exists():
            p.unlink()
    env = dict(os.environ)
    for k in ("MONSTACK", "MONSTACK_BACKEND", "PYTHONWARNINGS"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([str(hookdir), str(root)])
    env["MONSTACK_COMPAT_MODE"] = mode
    env["MONSTACK_COMPAT_LOG"] = str(plog)
    for k in [k for k in env if k.startswith("MONSTACK_") and not k.startswith("MONSTACK_COMPAT_")]:
        del env[k]
    if mode != "off":
        env["MONSTACK"] = "1"
        if mode == "all":
            env["MONSTACK_TRACK"] = "all"
    cmd = [python, "-m", "test", "-w", "--timeout", str(timeout), "--junit-xml", str(xml)]
    if jobs > 0:  # worker processes: a timeout or crash costs one test file, not the run
        cmd += ["-j", str(jobs)]
    cmd += tests
    # An empty working directory: `-m test` puts it first on sys.path, and a stray module
    # in a shared directory such as /tmp would shadow the standard library's.
    cwd = out / f"cwd-{tag}"
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir()
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, preexec_fn=_child_setup(memory_mb)).returncode
    elapsed = time.monotonic() - t0
    meta.write_text(json.dumps({"rc": rc, "seconds": elapsed, "command": cmd}))
    return _collect(xml, log, plog, rc=rc, elapsed=elapsed)


def _collect(xml: Path, log: Path, plog: Path, rc, elapsed: float) -> dict:
    results = parse_junit(xml)
    procs = plog.read_text().splitlines() if plog.exists() else []
    starts = [l for l in procs if l.startswith("start ")]
    exits = [l for l in procs if l.startswith("exit ")]
    errors = [l for l in procs if l.startswith("error ")]
    # An interpreter (a process, or a subinterpreter: they share its pid) that started with
    # a backend but ended without one turned itself off; one that started without any
    # (monstack could not start there) ends without one too.
    not_started = [l for l in starts if l.split()[2] == "None"]
    turned_off = [l for l in exits if l.split()[2] == "None"][len(not_started):]
    starts = [l for l in starts if l.split()[2] != "None"]
    resyncs = sum(int(l.split("resync=")[1]) for l in exits if "resync=" in l)
    return {
        "rc": rc,
        "seconds": round(elapsed),
        "results": results,
        "starts": len(starts),
        "backends": sorted({" ".join(l.split()[2:4]) for l in starts}),
        "turned_off": turned_off,
        "not_started": len(not_started),
        "errors": errors,
        "resyncs": resyncs,
        "monstack_warnings": _count_in(log, "MonstackWarning"),
    }


def _count_in(path: Path, needle: str) -> int:
    try:
        return path.read_text(errors="replace").count(needle)
    except OSError:
        return 0


def counts(results: dict[str, str]) -> str:
    c = {"pass": 0, "fail": 0, "skip": 0}
    for s in results.values():
        c[s] += 1
    return f"{c['pass']} passed, {c['fail']} failed, {c['skip']} skipped"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", action="append", help="3.X or a path (repeatable); default: 3.11, 3.12, 3.13")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    ap.add_argument("--tests", default="default", help="comma-separated regrtest names or presets (" + ", ".join(f"{k}: {' '.join(v)}" for k, v in PRESETS.items()) + ")")
    ap.add_argument("--out", default=None, help="directory for logs and XML (default: a temp dir)")
    ap.add_argument("--timeout", type=int, default=1200, help="regrtest per-test timeout (s)")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="regrtest -j (default 1: one worker process at a time; 0: no workers)")
    ap.add_argument("--memory-limit", type=int, default=4096, metavar="MB", help="address-space limit of every test process (RLIMIT_AS; 0: none)")
    ap.add_argument("--skip-existing", action="store_true", help="summarise a mode whose results are already in --out instead of running it again (resume a run; add a mode to an earlier run)")
    ap.add_argument("--report-only", action="store_true", help="summarise the logs/XML already in --out, run nothing")
    ap.add_argument("--monstack", default=str(ROOT), help="directory holding the monstack package to test (default: this checkout)")
    args = ap.parse_args(argv)
    root = Path(args.monstack).resolve()

    modes = [m for m in args.modes.split(",") if m]
    if "off" not in modes:
        modes.insert(0, "off")
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}; valid: {MODES}")
    if (args.report_only or args.skip_existing) and not args.out:
        ap.error("--report-only and --skip-existing need --out")
    out = Path(args.out or tempfile.mkdtemp(prefix="monstack-suites-"))
    out.mkdir(parents=True, exist_ok=True)
    hookdir = out / "hook"
    hookdir.mkdir(exist_ok=True)
    (hookdir / "sitecustomize.py").write_text(SITECUSTOMIZE)

    pythons = []
    for spec in args.python or list(VERSIONS):
        if os.sep in spec:
            pythons.append((spec, spec))
        else:
            p = find_python(spec)
            pythons.append((spec, p))
    rev = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%h %cd", "--date=iso"], capture_output=True, text=True).stdout.strip()
    lines = ["# CPython regression suites with and without monstack", "", f"monstack from {root} ({rev or 'not a git checkout'}); regrtest -j {args.jobs}, --timeout {args.timeout}, memory limit {args.memory_limit} MB", ""]
    table = ["| CPython | mode | backend | test cases | failed | skipped | differences (expected) | no result | seconds |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    ok = True
    for spec, python in pythons:
        if python is None:
            lines += [f"## CPython {spec}: NOT FOUND", ""]
            ok = False
            continue
        full = subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True, text=True).stdout.strip()
        names = [t for n in args.tests.split(",") if n for t in PRESETS.get(n, (n,))]
        tests, missing = available_tests(python, names)
        tests = expand_tests(python, tests)
        lines += [f"## CPython {full} ({python})", ""]
        if missing:
            lines += [f"- not in this build's test package (skipped): {', '.join(missing)}"]
        print(f"== CPython {full}: {' '.join(tests)}", flush=True)
        res = {}
        expected = False
        for mode in modes:
            print(f"-- {full} mode={mode} ...", flush=True)
            res[mode] = run_mode(python, full, mode, tests, out, hookdir, args.timeout, args.jobs, root, args.report_only, args.memory_limit, args.skip_existing)
            r = res[mode]
            print(f"   {counts(r['results'])}; exit {r['rc']}; {r['seconds']} s; processes with monstack: {r['starts']} {r['backends']}", flush=True)
        base = res["off"]["results"]
        for mode in modes:
            r = res[mode]
            line = f"- `{mode}`: {counts(r['results'])} ({len(r['results'])} test cases, regrtest exit {r['rc']}, {r['seconds']} s)"
            expected = False
            n_diff = n_expected = n_missing = 0
            if mode != "off":
                line += f"; monstack on in {r['starts']} interpreter(s), backend {', '.join(r['backends']) or '-'}"
                line += f", resyncs {r['resyncs']}"
                if r["not_started"]:
                    line += f", DID NOT START in {r['not_started']} interpreter(s)"
                    ok = False
                if r["turned_off"]:
                    line += f", TURNED ITSELF OFF in {len(r['turned_off'])}"
                    ok = False
                if r["errors"]:
                    line += f", start-up errors {r['errors'][:3]}"
                    ok = False
                if r["monstack_warnings"]:
                    line += f", {r['monstack_warnings']} MonstackWarning line(s) in the log"
                    ok = False
                diff = {k: (base.get(k), r["results"].get(k)) for k in set(base) | set(r["results"]) if base.get(k) != r["results"].get(k)}
                for k in sorted(diff):
                    hit = next((e for e in EXPECTED if k.endswith(e) and mode in EXPECTED[e][0]), None)
                    if hit is not None:
                        line += f"\n    - expected: {k}: off={diff[k][0]} {mode}={diff[k][1]} ({EXPECTED[hit][1]})"
                        del diff[k]
                        expected = True
                        n_expected += 1
                missing: dict = {}
                for k in list(diff):
                    if diff[k][1] is None:  # no result: the module timed out or crashed
                        mod = ".".join(k.lstrip(".").split(".")[:3])
                        missing[mod] = missing.get(mod, 0) + 1
                        del diff[k]
                        n_missing += 1
                for mod, n in sorted(missing.items()):
                    line += f"\n    - NO RESULT for {n} test case(s) of {mod} (timed out or crashed: see the log)"
                    ok = False
                if not r["results"]:
                    line += " -- NO RESULTS (see log)"
                    ok = False
                elif diff:
                    ok = False
                    line += f"\n    {len(diff)} DIFFERENCE(S) from `off`:"
                    for k in sorted(diff)[:40]:
                        line += f"\n    - {k}: off={diff[k][0]} {mode}={diff[k][1]}"
                else:
                    line += "\n    otherwise identical to `off`" if (expected or missing) else " -- identical to `off`"
                n_diff = len(diff)
            lines.append(line)
            c = {"pass": 0, "fail": 0, "skip": 0}
            for st in r["results"].values():
                c[st] += 1
            backend = ", ".join(r["backends"]) if mode != "off" else "-"
            table.append(f"| {full} | `{mode}` | {backend} | {len(r['results'])} | {c['fail']} | {c['skip']} | "
                         + (f"{n_diff + n_expected} ({n_expected})" if mode != "off" else "-")
                         + f" | {n_missing if mode != 'off' else '-'} | {r['seconds']} |")
        if not base:
            ok = False
        lines.append("")
    lines += table + [""]
    lines.append(f"Overall: {'SAME RESULTS with and without monstack' if ok else 'DIFFERENCES or problems (see above)'}; logs in {out}")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
