"""``python -m monstack`` -- demo | info | warm | run | dump | bench (and ``--version``)."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Optional, Sequence


def _info(args: argparse.Namespace) -> int:
    import monstack
    from monstack import _env, _select

    w = sys.stdout.write
    w(f"monstack {monstack.__version__}\n")
    w(f"interpreter: {_env.IMPLEMENTATION} {sys.version.split()[0]} ({sys.executable})\n")
    w(f"platform: {sys.platform} {_env.MACHINE}{' free-threaded' if _env.FREE_THREADED else ''}\n")
    if monstack.active_backend() is None:
        try:
            monstack.install()
        except Exception as exc:  # say why, never crash info
            w(f"install() failed: {exc}\n")
    status = monstack.status()
    w(f"backend: {status.get('backend')}\n")
    if status.get("reason"):
        w(f"chosen because: {status['reason']}\n")
    for name, why_not in _select.reasons().items():
        w(f"  {name:10s} {'available' if why_not is None else 'unavailable: ' + why_not}\n")
    verbose = getattr(args, "verbose", False)
    for key, value in status.items():
        if key in ("backend", "reason") or (key in _INTERNALS and not verbose):
            continue
        if key == "C stack reserve" and isinstance(value, int):
            value = f"{value // 1024} KiB per thread"
        elif key == "propagation" and not value:
            value = "off"
        elif isinstance(value, dict):
            value = "; ".join(f"{k} ({v})" for k, v in value.items()) if key == "propagation failed" else (
                ", ".join(f"{k}={v}" for k, v in value.items()))
        elif isinstance(value, (list, tuple)):
            value = ", ".join(map(str, value)) or "none"
        elif value is None:
            value = "-"
        elif not verbose and isinstance(value, str):
            value = re.sub(r" at 0x[0-9a-fA-F]+", "", value)  # where the native code sits: --verbose
        w(f"{key}: {value}\n")
    if not verbose and any(key in _INTERNALS for key in status):
        w("(more with --verbose)\n")
    return 0


#: status() entries that describe monstack's internals, not what it does for you: info
#: prints them with --verbose only.
_INTERNALS = frozenset({"shim counters", "C stack reserve", "native checks", "native calls"})




#: What ``warm``'s children run: the boot (a no-op where the ``.pth`` line already ran
#: it), then how it went and where the files are, as JSON.
_WARM_CHILD = """
import json, os, sys, _monstack_boot
_monstack_boot.main()
from monstack import _native
cache = _monstack_boot._Cache.for_this_interpreter(os)
print(json.dumps({"route": _monstack_boot.route, "cache": cache.path if cache is not None else None,
                  "verdicts": {_native.verdict_path(n): how != "at load" for n, how in _native.checked.items()}}))
"""


def _warm(args: argparse.Namespace) -> int:
    """Write the start-up cache and the native code's verdict for this interpreter now,
    whatever ``PYTHONDONTWRITEBYTECODE`` says (an image build), then check that a start-up
    that writes nothing uses them. Optional: without them, such a start-up takes the
    ``.pyc`` route."""
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "MONSTACK_STARTUP_CACHE")}
    env["MONSTACK"] = "1"
    facts = []
    for extra in ({}, {"PYTHONDONTWRITEBYTECODE": "1"}):  # write, then read as a container would
        out = subprocess.run([sys.executable, "-c", _WARM_CHILD], env=dict(env, **extra), capture_output=True,
                             text=True)
        sys.stderr.write(out.stderr)
        try:
            facts.append(json.loads(out.stdout.splitlines()[-1]))
        except (ValueError, IndexError):
            sys.stderr.write(f"monstack warm: the start-up failed (exit code {out.returncode})\n")
            return 1
    after = facts[1]
    ok = after["route"] == "cache" and all(after["verdicts"].values())
    sys.stdout.write(f"start-up cache: {'ready' if after['route'] == 'cache' else 'NOT written'} "
                     f"({after['cache'] or 'not usable with this install'})\n")
    for path, ready in after["verdicts"].items():
        sys.stdout.write(f"native code's verdict: {'ready' if ready else 'NOT written'} ({path})\n")
    if not ok:
        sys.stderr.write("monstack warm: not everything could be written (a read-only install? run it where the "
                         "install is written, as its owner)\n")
    return 0 if ok else 1


def _demo(args: argparse.Namespace) -> int:
    from monstack import _demo

    _demo.run_demo()
    return 0


def _version() -> str:
    """``monstack X.Y.Z (CPython a.b.c)``: what ``--version`` prints."""
    import platform

    import monstack

    return f"monstack {monstack.__version__} ({platform.python_implementation()} {platform.python_version()})"


#: Commands with a parser of their own: everything after the name is theirs (``run``: the
#: program's arguments; ``dump``, ``bench``: their options and one-line errors).
_OWN_PARSER = {
    "run": ("monstack._run", "run a script or -m module with monstack on (see: run --help)"),
    "dump": ("monstack._dumpcli", "another process's stacks and origins (see: dump --help)"),
    "bench": ("monstack._bench", "what monstack costs, as ratios measured in one run (see: bench --help)"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    command = list(argv[:1])
    if command and command[0] in _OWN_PARSER:
        import importlib

        module = importlib.import_module(_OWN_PARSER[command[0]][0])
        return int(module.main(list(argv[1:])))
    from monstack._run import OneLineParser

    parser = OneLineParser(prog="python -m monstack", description="monstack: where did this work come from?")
    parser.add_argument("--version", action="version", version=_version())
    commands = ("demo", "info", "warm", *_OWN_PARSER)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(commands) + "}")
    sub.add_parser("demo", help="a background thread fails; see the line that created its work").set_defaults(func=_demo)
    i = sub.add_parser("info", help="version, interpreter, backend and why")
    i.add_argument("--verbose", "-v", action="store_true", help="also the backend's internals (counters, addresses)")
    i.set_defaults(func=_info)
    sub.add_parser("warm", help="write the start-up cache now (an image build: -B and read-only start-ups use it)"
                   ).set_defaults(func=_warm)
    for name, (_module, text) in _OWN_PARSER.items():
        sub.add_parser(name, add_help=False, help=text)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
