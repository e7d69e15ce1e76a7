#!/usr/bin/env python3
"""What ``MONSTACK=1`` adds to an interpreter's start-up, in a regular install.

For each CPython given (default: every 3.11-3.15 found as ``tests/run-all.sh`` finds
them), a fresh venv gets monstack from a wheel built once from a copy of this checkout
(``pip install`` of the wheel: a regular, non-editable install, with the ``.pth``), then:

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

    python3 bench/startup_cost.py [--rounds 15] [--valgrind] [--json] [PYTHON ...]

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


def measure(vpy: str, rounds: int, valgrind: bool = False) -> dict:
    off, on = clean_env(), clean_env(MONSTACK="1")
    # (this first MONSTACK=1 start-up writes the start-up cache, as a user's first one does)
    run([vpy, "-c", "pass"], env=on)
    route, backend, native = run([vpy, "-c", STATUS], env=on).stdout.split(None, 2)
    cmd = [vpy, "-c", "pass"]
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
    args = parser.parse_args()
    pythons = args.pythons or find_pythons()
    results = []
    with tempfile.TemporaryDirectory(prefix="monstack-startup-") as work:
        wheel = build_wheel(work)
        for python in pythons:
            vpy = make_venv(python, work, wheel)
            r = measure(vpy, args.rounds, args.valgrind)
            results.append(r)
            if not args.json:
                print(f"CPython {r['python']} ({r['backend']}, {r['native']}, start-up {r['route']}): MONSTACK=1 python -c pass = "
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
