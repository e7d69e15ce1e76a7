"""``python -m monstack`` -- demo | info | run | dump | bench."""

from __future__ import annotations

import argparse
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
    for key, value in status.items():
        if key not in ("backend", "reason"):
            w(f"{key}: {value}\n")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from monstack import _demo

    _demo.run_demo()
    return 0


def _bench(args: argparse.Namespace) -> int:
    from monstack import _bench

    argv = (["--quick"] if args.quick else []) + (["--json"] if args.json else [])
    if args.only:
        argv += ["--only", args.only]
    if args.rounds:
        argv += ["--rounds", str(args.rounds)]
    return _bench.main(argv)


def _test_configs(args: argparse.Namespace) -> int:
    """The test configurations the suite runs in on this interpreter (for tests/run-all.sh).

    Where the native sys.monitoring callbacks can run, the suite runs twice: with them
    (``native``) and with the pure-Python callbacks (``python``).
    """
    from monstack import _env

    if _env.HAS_SYSMON:
        from monstack import _accel

        if _accel.unavailable() is None:
            print("native python")
            return 0
    print("default")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if list(argv[:1]) == ["run"]:  # everything after "run" belongs to the program
        from monstack._run import main as run_main

        return run_main(list(argv[1:]))
    if list(argv[:1]) == ["dump"]:  # its own parser: bad input is one line and exit 1
        from monstack._dumpcli import main as dump_main

        return dump_main(list(argv[1:]))
    parser = argparse.ArgumentParser(prog="python -m monstack", description="monstack: where did this work come from?")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="a background thread fails; see the line that created its work").set_defaults(func=_demo)
    sub.add_parser("info", help="version, interpreter, backend and why").set_defaults(func=_info)
    sub.add_parser("run", add_help=False, help="run a script or -m module with monstack on (see: run --help)")
    sub.add_parser("dump", add_help=False, help="another process's stacks and origins (see: dump --help)")
    b = sub.add_parser("bench", help="what monstack costs, as ratios measured in one run")
    b.add_argument("--quick", action="store_true", help="fewer rounds (about 30 s)")
    b.add_argument("--json", action="store_true", help="machine-readable output")
    b.add_argument("--only", default="", help="comma-separated sections: snapshot,tax,opqueue,memory")
    b.add_argument("--rounds", type=int, default=None, help="rounds (default 7, --quick 3)")
    b.set_defaults(func=_bench)
    sub.add_parser("_test-configs", help=argparse.SUPPRESS).set_defaults(func=_test_configs)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
