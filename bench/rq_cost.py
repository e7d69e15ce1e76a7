#!/usr/bin/env python3
"""Per-job cost of the ``rq`` propagation point on round trips: ``q.enqueue(ok, i)`` taken
20 frames deep, then ``job.latest_result(timeout=60)`` (a blocking read of the job's result
stream), against a real ``redis-server`` (started here on a free port of 127.0.0.1) and an
``rq worker`` started here with MONSTACK=1. The client alternates batches with monstack
installed with every propagation point and with every point but ``rq`` (same run,
interleaved): without the point the job's meta has no snapshot and the worker runs it
straight. Reports the median round trip of each, their ratio, the median of the paired
batch ratios, the CPU time per job of the client, the worker and redis-server, and what
the point's own work costs::

    PYTHONPATH=. python3.12 bench/rq_cost.py [ROUNDS [BATCH [WORKER]]]

WORKER is ``fork`` (RQ's default ``Worker``: a work horse forked per job) or ``simple``
(``SimpleWorker``: the job runs in the worker's process, the cheapest round trip RQ has,
so the point's share is the largest). Needs rq (pip install -e '.[engines]') and
redis-server. Target: the "with" median at most 5% above the "without" one.
"""

from __future__ import annotations

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
WITHOUT = [p for p in PROPAGATION_POINTS if p != "rq"]
WORKERS = {"fork": "rq.worker.Worker", "simple": "rq.worker.SimpleWorker"}


def deep(n, f):
    return deep(n - 1, f) if n else f()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` and its waited-for children so far
    (Linux ``/proc``; 0 elsewhere): the forking worker's horses count."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def batch(q, fn, n: int) -> list[float]:
    times = []
    for i in range(n):
        t = time.perf_counter()
        job = q.enqueue(fn, i)
        result = job.latest_result(timeout=60)
        times.append(time.perf_counter() - t)
        if result is None or result.type != result.Type.SUCCESSFUL:
            raise RuntimeError(f"job {job.id} did not succeed: {result and result.exc_string}")
    return times


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    kind = sys.argv[3] if len(sys.argv) > 3 else "fork"
    exe = shutil.which("redis-server")
    if exe is None:
        print("redis-server is not installed (Debian: apt-get install redis-server)", file=sys.stderr)
        return 1
    sys.path.insert(0, PROGRAMS)
    try:
        import redis
        import rq
        import rq_jobs
    except ImportError as exc:
        print(f"rq cannot be imported ({exc}); pip install -e '.[engines]'", file=sys.stderr)
        return 1
    port = free_port()
    procs = [subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    logs = tempfile.mkdtemp(prefix="rq-cost-")
    try:
        while not ping(port):
            time.sleep(0.05)
        url = f"redis://127.0.0.1:{port}/0"
        env = dict(os.environ, MONSTACK="1", PYTHONPATH=os.pathsep.join([PROGRAMS] + sys.path))
        env.pop("MONSTACK_PROPAGATE", None)
        rq_cli = os.path.join(os.path.dirname(sys.executable), "rq")
        cmd = [rq_cli] if os.path.exists(rq_cli) else [sys.executable, "-m", "rq.cli"]
        with open(os.path.join(logs, "worker.log"), "w") as out:
            procs.append(subprocess.Popen(cmd + ["worker", "--url", url, "-w", WORKERS[kind], "-q", "bench"],
                                          stdout=out, stderr=subprocess.STDOUT, env=env, cwd=PROGRAMS))
        conn = redis.Redis(host="127.0.0.1", port=port)
        q = rq.Queue("bench", connection=conn)
        fn = rq_jobs.ok
        batch(q, fn, 1)  # the worker is up
        batch(q, fn, 20)
        times: dict[str, list[float]] = {"with": [], "without": []}
        cpu = {"with": 0.0, "without": 0.0}
        ratios = []
        for r in range(rounds):
            order = ("with", "without") if r % 2 == 0 else ("without", "with")
            got = {}
            for side in order:
                monstack.install(propagate=True if side == "with" else WITHOUT)
                before = time.process_time() + sum(cpu_seconds(p.pid) for p in procs)
                got[side] = deep(20, lambda: batch(q, fn, size))
                cpu[side] += time.process_time() + sum(cpu_seconds(p.pid) for p in procs) - before
                monstack.uninstall()
                times[side] += got[side]
            ratios.append(statistics.median(got["with"]) / statistics.median(got["without"]))
        med = {side: statistics.median(ts) for side, ts in times.items()}
        print(f"python {sys.version.split()[0]}, rq {rq.__version__}, redis-py {redis.__version__}, "
              f"{WORKERS[kind]}, {rounds} rounds x {size} jobs per mode")
        for side in ("without", "with"):
            print(f"point {side:7s}: median round trip {med[side] * 1e6:8.1f} us over {len(times[side])} jobs")
        ratio = med["with"] / med["without"]
        print(f"ratio of the medians with/without: {ratio:.3f} "
              f"({(med['with'] - med['without']) * 1e6:+.1f} us per job); target <= 1.05: "
              f"{'met' if ratio <= 1.05 else 'NOT MET'}")
        quart = statistics.quantiles(ratios, n=4)
        print(f"median of the {rounds} paired batch ratios: {statistics.median(ratios):.3f} "
              f"(quartiles {quart[0]:.3f}..{quart[2]:.3f})")
        per = {side: cpu[side] / len(times[side]) for side in cpu}
        if per["without"] > 0:
            print(f"CPU per job (client + worker + redis-server): without {per['without'] * 1e6:.1f} us, "
                  f"with {per['with'] * 1e6:.1f} us, ratio {per['with'] / per['without']:.3f}")
        own_work(conn)
        conn.close()
        return 0
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)  # (rq's teardown may wait up to 60 s on its pubsub thread)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(logs, ignore_errors=True)


def own_work(conn) -> None:
    """What the point adds per job, 20 frames deep: on the client the snapshot and the meta
    entry (encoded once per distinct line: a loop enqueues from one), and on the worker the
    decoding of a snapshot it has not seen (a forked horse starts with the parent's cache)."""
    import json

    from rq.job import Job

    import rq_jobs
    from monstack._points import celery as _wire
    from monstack._points import rq as _rq

    n = 2000
    monstack.install()
    try:
        snap = deep(20, monstack.snapshot)
        value = _wire.header_value(snap)
        t = time.perf_counter()
        for _ in range(n):
            Job.create(rq_jobs.ok, (1,), connection=conn)
        with_point = (time.perf_counter() - t) / n
        monstack.install(propagate=WITHOUT)
        t = time.perf_counter()
        for _ in range(n):
            Job.create(rq_jobs.ok, (1,), connection=conn)
        without = (time.perf_counter() - t) / n
        t = time.perf_counter()
        for _ in range(n):
            _wire._RECEIVED.clear()
            _wire.decode_header(value)
        decode = (time.perf_counter() - t) / n
        print(f"meta entry of a 20-frame snapshot: {len(json.dumps(value))} bytes of JSON; Job.create "
              f"{without * 1e6:.1f} us without the point, {with_point * 1e6:.1f} us with it "
              f"(a line seen before); decoding it on the worker (not cached) {decode * 1e6:.1f} us")
    finally:
        monstack.uninstall()


if __name__ == "__main__":
    sys.exit(main())
