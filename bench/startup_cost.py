#!/usr/bin/env python3
"""What ``MONSTACK=1`` adds to an interpreter's start-up, in a regular install.

For each CPython given (default: every 3.11-3.15 found as ``tests/run-all.sh`` finds
them), a fresh venv gets monstack from a wheel built once from a copy of this checkout
(``pip install`` of the wheel: a regular, non-editable install, with the ``.pth``; pip
writes the ``.pyc`` files), then, in each of four cases:

- **warm**: the start-up cache and the native code's verdict written by a first
  ``MONSTACK=1`` run (what a writable install has from its second start-up on);
- **PYTHONDONTWRITEBYTECODE=1**, **-B** (most container images) and **read-only** (the
  venv's site-packages mounted read-only in a private mount namespace, ``unshare -m``;
  without it, made unwritable with ``chmod``, which root ignores): neither file exists nor
  can be written, so every start-up runs without them (the ``.pyc`` route and the native
  code's checks); both modes of a round run under the same condition;

- **start-up**: ``python -c pass`` without and with ``MONSTACK=1``, the two modes
  interleaved round by round (order alternating); each measurement is the best of two
  runs; the figure is the median of the per-round ratios ``with / without``, [min-max],
  and the median times, for the wall clock and for the child's CPU time (user + system,
  which moves less with the load of a shared machine);
- **install()**: in one process, the time of ``import monstack`` and of
  ``monstack.install()`` (``MONSTACK`` unset; the best of the rounds: a one-off cost,
  which a busy machine only ever inflates);
- **-X importtime**: the modules ``MONSTACK=1`` adds to ``python -c pass`` through the
  import system (not those the start-up cache runs: see docs/configuration.md) with their
  self time (top entries) and the sum of the added modules' self times (best of 5 runs
  per module);
- with ``--valgrind``: instructions executed (``valgrind --tool=cachegrind``) by
  ``python -c pass`` without and with ``MONSTACK=1``, and their ratio: the figure that
  does not move with the machine's load;
- the backend, whether the native path (3.12+ native callbacks, 3.11 shim) loaded, and
  whether it trusted the verdict the first run wrote (``checks: verdict``: see
  docs/native.md) rather than checking the interpreter again.

::

    python3 bench/startup_cost.py [--rounds 15] [--valgrind] [--json] [--cases warm,-B,...] [PYTHON ...]

Needs network or a local index for nothing: the wheel is built with the running
interpreter's pip (``--no-build-isolation`` when setuptools 70.1+ is importable here).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSIONS = ("3.11", "3.12", "3.13", "3.14", "3.15")
STATUS = (
    "import _monstack_boot, monstack, sys; s = monstack.status(); print(_monstack_boot.route or '-', end=' '); "
    "print(s.get('backend'), s.get('accelerator') or ('native shim' if 'native shim' in str(s.get('eval_frame')) else '-'), end=''); "
    "print(', checks: verdict' if 'earlier process' in str(s.get('native checks')) else '')"
)
INSTALL_TIME = (
    "import time; t0 = time.perf_counter(); import monstack; t1 = time.perf_counter(); "
    "monstack.install(); t2 = time.perf_counter(); print(t1 - t0, t2 - t1)"
)


def find_pythons() -> list[str]:
    found = []
    for v in VERSIONS:
        cands = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{v}.*/bin/python{v}")))
        path = cands[-1] if cands else shutil.which(f"python{v}")
        if path:
            found.append(path)
    return found


def clean_env(**extra: str) -> dict[str, str]:
    # (PYTHONDONTWRITEBYTECODE off: a user's interpreter reads monstack's .pyc files)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MONSTACK") and k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    env.update(extra)
    return env


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if out.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out.stdout}{out.stderr}")
    return out


def build_wheel(work: str) -> str:
    src = os.path.join(work, "src")
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venvs", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache", ".hypothesis", "*.so"))
    dist = os.path.join(work, "dist")
    try:  # building here needs a setuptools with bdist_wheel built in (70.1+)
        import setuptools

        recent = tuple(int(p) for p in setuptools.__version__.split(".")[:2]) >= (70, 1)
    except (ImportError, ValueError):
        recent = False
    isolation = ["--no-build-isolation"] if recent else []
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", dist, src], env=clean_env())
    [wheel] = glob.glob(os.path.join(dist, "monstack-*.whl"))
    return wheel


def make_venv(python: str, work: str, wheel: str) -> str:
    tag = os.path.basename(python)
    venv = os.path.join(work, "venv-" + tag)
    run([python, "-m", "venv", venv], env=clean_env())
    vpy = os.path.join(venv, "bin", "python")
    run([vpy, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", wheel], env=clean_env())
    return vpy


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one process, each the best of two runs. The CPU time
    (user + system of the child) moves less with the load of a shared machine."""
    best_wall = best_cpu = float("inf")
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        best_wall = min(best_wall, time.perf_counter() - t)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        best_cpu = min(best_cpu, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return best_wall, best_cpu


def importtime(vpy: str, env: dict[str, str]) -> dict[str, int]:
    """module -> self time (us) of ``python -X importtime -c pass``."""
    err = run([vpy, "-X", "importtime", "-c", "pass"], env=env).stderr
    out = {}
    for line in err.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        head, _cumulative, name = line.split("|", 2)
        name = name.strip()
        out[name] = out.get(name, 0) + int(head.split(":")[1])
    return out


CASES = ("warm", "PYTHONDONTWRITEBYTECODE=1", "-B", "read-only")


def site_packages(vpy: str) -> str:
    return run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=clean_env()).stdout.strip()


def forget(vpy: str) -> None:
    """Remove the start-up cache and the verdicts a start-up wrote (a fresh install)."""
    for path in glob.glob(os.path.join(site_packages(vpy), "__pycache__", "*")):
        if path.endswith((".modules", ".verdict")):
            os.unlink(path)


def measure_case(vpy: str, case: str, rounds: int, valgrind: bool = False) -> dict:
    """``measure`` in one of CASES; "read-only" in a private mount namespace where the
    venv's site-packages is mounted read-only (``unshare -m``, as root), else with its
    directories made unwritable."""
    if case == "warm":
        return measure(vpy, rounds, valgrind)
    forget(vpy)
    if case != "read-only":
        return measure(vpy, rounds, valgrind, case)
    site = site_packages(vpy)
    me = [sys.executable, os.path.abspath(__file__), "--_read-only-measure", vpy, "--rounds", str(rounds)]
    if valgrind:
        me.append("--valgrind")
    if os.geteuid() == 0 and shutil.which("unshare"):
        inner = f"mount --bind -o ro {site} {site} && exec " + " ".join(map(repr, me))
        out = run(["unshare", "-m", "sh", "-c", inner], env=clean_env())
        return json.loads(out.stdout)
    dirs = [d for d, _, _ in os.walk(site)]
    modes = {d: os.stat(d).st_mode for d in dirs}
    try:
        for d in dirs:
            os.chmod(d, 0o555)
        return measure(vpy, rounds, valgrind, case)
    finally:
        for d, mode in modes.items():
            os.chmod(d, mode)


def measure(vpy: str, rounds: int, valgrind: bool = False, case: str = "warm") -> dict:
    extra = dict([case.split("=", 1)]) if "=" in case else {}
    off, on = clean_env(**extra), clean_env(MONSTACK="1", **extra)
    flags = [case] if case.startswith("-") else []
    # (warm: this first MONSTACK=1 start-up writes the start-up cache and the verdict, as
    # a user's first one does; the other cases write nothing)
    run([vpy, *flags, "-c", "pass"], env=on)
    route, backend, native = run([vpy, *flags, "-c", STATUS], env=on).stdout.split(None, 2)
    if case != "warm" and route == "cache":
        raise SystemExit(f"{case}: a start-up cache was used")
    cmd = [vpy, *flags, "-c", "pass"]
    timed(cmd, off), timed(cmd, on)  # warm-up (page cache, .pyc files)
    ratios, cpu_ratios, t_off, t_on, c_off, c_on = [], [], [], [], [], []
    for i in range(rounds):
        pair = {}
        for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
            pair[mode] = timed(cmd, off if mode == "off" else on)
        ratios.append(pair["on"][0] / pair["off"][0])
        cpu_ratios.append(pair["on"][1] / pair["off"][1])
        t_off.append(pair["off"][0])
        t_on.append(pair["on"][0])
        c_off.append(pair["off"][1])
        c_on.append(pair["on"][1])
    instructions = {}
    if valgrind:
        for mode, env in (("off", off), ("on", on)):
            err = run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null", *cmd],
                      env=env).stderr
            refs = [line for line in err.splitlines() if "I" in line and "refs:" in line]
            instructions[mode] = int(refs[-1].split("refs:")[1].replace(",", "").strip())
    common = {
        "case": case,
        "python": run([vpy, "-c", "import sys; print(sys.version.split()[0])"]).stdout.strip(),
        "backend": backend,
        "native": native.strip(),
        "route": route,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ms_off": 1000 * statistics.median(t_off),
        "ms_on": 1000 * statistics.median(t_on),
        "cpu_ratio": statistics.median(cpu_ratios),
        "cpu_ratio_min": min(cpu_ratios),
        "cpu_ratio_max": max(cpu_ratios),
        "cpu_ms_off": 1000 * statistics.median(c_off),
        "cpu_ms_on": 1000 * statistics.median(c_on),
        "instructions": instructions,
    }
    if case != "warm":
        return common
    imports, installs = [], []
    for _ in range(rounds):
        a, b = map(float, run([vpy, "-c", INSTALL_TIME], env=off).stdout.split())
        imports.append(a)
        installs.append(b)
    added: dict[str, list[int]] = {}
    for _ in range(5):
        base = importtime(vpy, off)
        with_ms = importtime(vpy, on)
        for name, us in with_ms.items():
            if name not in base:
                added.setdefault(name, []).append(us)
    added_med = {k: min(v) for k, v in added.items()}
    return {
        **common,
        "import_ms": 1000 * min(imports),
        "install_ms": 1000 * min(installs),
        "instructions": instructions,
        "added_modules": len(added_med),
        "added_self_ms": sum(added_med.values()) / 1000,
        "top": sorted(added_med.items(), key=lambda kv: -kv[1])[:8],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pythons", nargs="*")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--valgrind", action="store_true", help="also count instructions (needs valgrind)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    parser.add_argument("--_read-only-measure", dest="read_only", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.read_only:  # (inside the private mount namespace of measure_case)
        print(json.dumps(measure(args.read_only, args.rounds, args.valgrind, "read-only")))
        return 0
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if set(cases) - set(CASES):
        parser.error(f"unknown case(s): {', '.join(sorted(set(cases) - set(CASES)))} (cases: {', '.join(CASES)})")
    cases.sort(key=lambda c: c == "warm")  # (warm last: it writes what the others must not find)
    pythons = args.pythons or find_pythons()
    results = []
    with tempfile.TemporaryDirectory(prefix="monstack-startup-") as work:
        os.chmod(work, 0o755)
        wheel = build_wheel(work)
        for python in pythons:
            vpy = make_venv(python, work, wheel)
            for case in cases:
                r = measure_case(vpy, case, args.rounds, args.valgrind)
                results.append(r)
                if args.json:
                    continue
                if r["case"] != "warm":
                    print(f"CPython {r['python']} [{r['case']}] ({r['backend']}, {r['native']}, start-up {r['route']}): "
                          f"CPU time {r['cpu_ratio']:.2f}x [{r['cpu_ratio_min']:.2f}-{r['cpu_ratio_max']:.2f}] "
                          f"({r['cpu_ms_on']:.1f} vs {r['cpu_ms_off']:.1f} ms); wall {r['ratio']:.2f}x "
                          f"[{r['ratio_min']:.2f}-{r['ratio_max']:.2f}]" + (
                              f"; instructions {r['instructions']['on'] / r['instructions']['off']:.2f}x"
                              if r["instructions"] else ""))
                    sys.stdout.flush()
                    continue
                print(f"CPython {r['python']} [warm] ({r['backend']}, {r['native']}, start-up {r['route']}): MONSTACK=1 python -c pass = "
                      f"{r['ratio']:.2f}x [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}] of python -c pass "
                      f"({r['ms_on']:.1f} vs {r['ms_off']:.1f} ms wall); CPU time {r['cpu_ratio']:.2f}x "
                      f"[{r['cpu_ratio_min']:.2f}-{r['cpu_ratio_max']:.2f}] ({r['cpu_ms_on']:.1f} vs "
                      f"{r['cpu_ms_off']:.1f} ms)")
                print(f"  in-process: import monstack {r['import_ms']:.1f} ms, install() {r['install_ms']:.1f} ms")
                if r["instructions"]:
                    i = r["instructions"]
                    print(f"  instructions: {i['on'] / i['off']:.2f}x ({i['on'] / 1e6:.1f}M vs {i['off'] / 1e6:.1f}M)")
                print(f"  -X importtime (the start-up cache's modules bypass the import system): {r['added_modules']} modules added, {r['added_self_ms']:.1f} ms self time; top: "
                      + ", ".join(f"{name} {us / 1000:.2f}" for name, us in r["top"]))
                sys.stdout.flush()
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
