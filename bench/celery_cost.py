#!/usr/bin/env python3
"""Per-task cost of the ``celery`` propagation point on round trips: ``task.delay(i).get()``
submitted 20 frames deep, against a real ``redis-server`` (started here on a free port of
127.0.0.1) and a solo worker started here with MONSTACK=1. The client alternates batches
with monstack installed with every propagation point and with every point but ``celery``
(same run, interleaved): without the point no header is sent and the worker's receivers
return at once. Reports the median round trip of each and their ratio, and the size of
the header, and the CPU time per task of the client, the worker and redis-server with and
without the point (less sensitive than wall time to other load on the machine)::

    PYTHONPATH=. python3.12 bench/celery_cost.py [ROUNDS] [BATCH]

Needs celery[redis] (pip install -e '.[engines]') and redis-server.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import monstack
from monstack._settings import PROPAGATION_POINTS

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAMS = os.path.join(HERE, os.pardir, "tests", "programs")
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))
from redis_server import answers as ping, free_port  # noqa: E402 (the tests' helper)
WITHOUT = [p for p in PROPAGATION_POINTS if p != "celery"]


def deep(n, f):
    return deep(n - 1, f) if n else f()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def batch(task, n: int) -> list[float]:
    times = []
    for i in range(n):
        t = time.perf_counter()
        task.delay(i).get(timeout=60)
        times.append(time.perf_counter() - t)
    return times


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 50
    exe = shutil.which("redis-server")
    if exe is None:
        print("redis-server is not installed (Debian: apt-get install redis-server)", file=sys.stderr)
        return 1
    sys.path.insert(0, PROGRAMS)
    try:
        import celery_app
    except ImportError as exc:
        print(f"celery cannot be imported ({exc}); pip install -e '.[engines]'", file=sys.stderr)
        return 1
    port = free_port()
    procs = [subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    logs = tempfile.mkdtemp(prefix="celery-cost-")
    try:
        while not ping(port):
            time.sleep(0.05)
        url = f"redis://127.0.0.1:{port}/1"
        env = dict(os.environ, MONSTACK="1", CT_BROKER=url, PYTHONPATH=os.pathsep.join([PROGRAMS] + sys.path))
        env.pop("MONSTACK_PROPAGATE", None)
        with open(os.path.join(logs, "worker.log"), "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "celery_app", "worker", "-P", "solo", "-l", "WARNING",
                 "--without-gossip", "--without-mingle", "--without-heartbeat"],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=PROGRAMS))
        app = celery_app.make_app(url)
        task = app.tasks["celery_app.ok"]
        task.delay(0).get(timeout=180)  # the worker is up, connections warm
        batch(task, 50)
        times: dict[str, list[float]] = {"with": [], "without": []}
        cpu = {"with": 0.0, "without": 0.0}  # client + worker + redis-server
        ratios = []
        for r in range(rounds):
            order = ("with", "without") if r % 2 == 0 else ("without", "with")
            got = {}
            for side in order:
                monstack.install(propagate=True if side == "with" else WITHOUT)
                before = time.process_time() + sum(cpu_seconds(p.pid) for p in procs)
                got[side] = deep(20, lambda: batch(task, size))
                cpu[side] += time.process_time() + sum(cpu_seconds(p.pid) for p in procs) - before
                monstack.uninstall()
                times[side] += got[side]
            ratios.append(statistics.median(got["with"]) / statistics.median(got["without"]))
        med = {side: statistics.median(ts) for side, ts in times.items()}
        for side in ("without", "with"):
            print(f"point {side:7s}: median round trip {med[side] * 1e6:8.1f} us over {len(times[side])} tasks")
        print(f"ratio of the medians with/without: {med['with'] / med['without']:.3f} "
              f"({(med['with'] - med['without']) * 1e6:+.1f} us per task)")
        per = {side: cpu[side] / len(times[side]) for side in cpu}
        if per["without"] > 0:
            print(f"CPU per task (client + worker + redis-server): without {per['without'] * 1e6:.1f} us, "
                  f"with {per['with'] * 1e6:.1f} us, ratio {per['with'] / per['without']:.3f}")
        print(f"median of the {rounds} paired batch ratios: {statistics.median(ratios):.3f} "
              f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}..{statistics.quantiles(ratios, n=4)[2]:.3f})")
        monstack.install()
        snap = deep(20, monstack.snapshot)
        from monstack._points import celery as _celery

        value = _celery.header_value(snap)
        print(f"header of a 20-frame snapshot: {len(json.dumps(value))} bytes of JSON "
              "(its records as one JSON text)")
        n = 2000
        t = time.perf_counter()
        for _ in range(n):
            _celery._SENT.clear()
            _celery.header_value(snap)
        encode = (time.perf_counter() - t) / n
        t = time.perf_counter()
        for _ in range(n):
            _celery._RECEIVED.clear()
            _celery.decode_header(value)
        decode = (time.perf_counter() - t) / n
        print(f"its encoding (uncached: a new line each time) {encode * 1e6:.1f} us, decoding (worker) "
              f"{decode * 1e6:.1f} us: {(encode + decode) / med['without'] * 100:.1f}% of the median round trip")
        monstack.uninstall()
        app.close()
        return 0
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
