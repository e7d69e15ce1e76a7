"""The ``rq`` propagation point: an RQ job carries the line that enqueued it in
its ``meta``, runs under it on the worker, and its stored traceback shows it.

Every test here is marked ``integration``: it starts Debian's ``redis-server`` on a free
port of 127.0.0.1 (stopped at the end), and real ``rq worker --burst`` processes
(MONSTACK=1; the forking ``Worker`` and ``SpawnWorker``) or a ``SimpleWorker`` in this
process. Needs rq (the ``engines`` extra) and redis-server; where either is missing the
tests skip with the reason, and fail in CI."""

from __future__ import annotations

import json
import os
import subprocess
import signal
import sys
import tempfile
import time
import warnings
import uuid
from datetime import timedelta
from typing import Any, Iterator, Optional

import pytest

import redis_server
import stackcheck
from conftest import engine_module, integration_module

import monstack
from monstack import _propagate
from monstack._errors import MonstackWarning

if sys.platform == "win32":  # (the engines extra leaves rq out there: its workers fork)
    pytest.skip("rq's workers need fork(): not on Windows", allow_module_level=True)
rq = engine_module("rq")
from rq import Queue, SimpleWorker  # noqa: E402
from rq.job import Job  # noqa: E402
from rq.serializers import JSONSerializer  # noqa: E402

from monstack import _points  # noqa: E402
from monstack._points import rq as _rq  # noqa: E402

PROGRAMS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "programs")
sys.path.insert(0, PROGRAMS)
import rq_jobs  # noqa: E402

pytestmark = pytest.mark.integration

THIS_FILE = __file__
THIS = os.path.basename(__file__)
line_of = stackcheck.marker_lines(__file__)
jobs_line = stackcheck.marker_lines(rq_jobs.__file__)
JSON = "rq.serializers.JSONSerializer"


def need(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}: CI requires it", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server.running(need, lambda reason: pytest.fail(reason, pytrace=False)) as port:
        yield f"redis://127.0.0.1:{port}/0"


@pytest.fixture(scope="module")
def conn(redis_url: str) -> Iterator[Any]:
    import redis

    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def queue(conn: Any, serializer: Any = None, job_class: Any = None) -> Queue:
    """A queue of its own (a fresh name) for one test."""
    kwargs: dict = {"connection": conn}
    if serializer is not None:
        kwargs["serializer"] = serializer
    if job_class is not None:
        kwargs["job_class"] = job_class
    return Queue(f"t-{uuid.uuid4().hex[:12]}", **kwargs)


WORKERS = ("fork", "spawn", "simple")


class _SimpleWorker(SimpleWorker):
    """RQ's SimpleWorker without its pubsub thread (the channel for remote stop and kill
    commands, not used here): its teardown may wait up to 60 s for that thread (rq 3.0
    with redis-py 8, with or without monstack), in this process."""

    def subscribe(self) -> None:
        pass


def work(kind: str, q: Queue, redis_url: str, *, monstack_in_worker: bool = True, scheduler: bool = False,
         serializer: Optional[str] = None, job_class: Optional[str] = None) -> str:
    """Run a burst worker of ``kind`` over ``q`` until it is empty; its log."""
    if kind == "spawn" and not hasattr(sys.modules["rq.worker"], "SpawnWorker"):
        pytest.skip(f"rq {rq.__version__} has no SpawnWorker")
    if kind == "simple":  # in this process (monstack as the test has it)
        w = _SimpleWorker([q], connection=q.connection, serializer=q.serializer, job_class=q.job_class)
        w.work(burst=True, with_scheduler=scheduler, logging_level="WARNING")
        return ""
    cls = {"fork": "rq.worker.Worker", "spawn": "rq.worker.SpawnWorker"}[kind]
    rq_cli = os.path.join(os.path.dirname(sys.executable), "rq")
    cmd = [rq_cli] if os.path.exists(rq_cli) else [sys.executable, "-m", "rq.cli"]
    cmd += ["worker", "--burst", "--url", redis_url, "-w", cls]
    if scheduler:
        cmd.append("--with-scheduler")
    if serializer:
        cmd += ["--serializer", serializer]
    if job_class:
        cmd += ["--job-class", job_class]
    cmd.append(q.name)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PROGRAMS] + sys.path))
    for name in [n for n in env if n.startswith("MONSTACK")]:
        del env[name]
    if monstack_in_worker:
        env["MONSTACK"] = "1"
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=PROGRAMS, stdout=out, stderr=subprocess.STDOUT)
        try:
            # Every job is done once the burst worker logs "done, quitting". Its teardown then
            # may wait up to 60 s on its pubsub thread (rq 3.0 with redis-py 8: the thread
            # sits in get_message(timeout=60) after the unsubscribe; with or without
            # monstack), so it gets a second to exit and is killed after that.
            deadline = time.monotonic() + 120
            while proc.poll() is None and "done, quitting" not in _read(out):
                if time.monotonic() > deadline:
                    pytest.fail(f"the {kind} worker did not finish; its log:\n{_read(out)[-3000:]}")
                time.sleep(0.02)
            try:
                proc.wait(1)
            except subprocess.TimeoutExpired:
                pass
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log = _read(out)
    assert proc.returncode in (0, -signal.SIGKILL), log
    assert "done, quitting" in log and "MonstackWarning" not in log, log
    return log


def _read(fh: Any) -> str:
    fh.seek(0)
    return fh.read()


def where_in(text: str, marker: str, path: str = THIS_FILE, lines: Any = line_of) -> str:
    return f'File "{path}", line {lines(marker)}'


def assert_enqueued_at(exc_string: str, marker: str) -> None:
    """The stored traceback ends with the note naming this file's ``marker`` line."""
    assert exc_string is not None
    note = exc_string.find("Work created at (most recent call last):")
    assert note > exc_string.find("ValueError: boom") > 0, exc_string
    assert where_in(exc_string, marker) in exc_string[note:], exc_string


def exc_string_of(job: Job) -> str:
    result = job.latest_result()
    assert result is not None and result.type == result.Type.FAILED, result
    return result.exc_string


def carried(job: Job) -> Optional[monstack.Snapshot]:
    """The snapshot stored with the job in Redis (fetched anew, as a worker reads it)."""
    fetched = Job.fetch(job.id, connection=job.connection, serializer=job.serializer)
    return _rq.origin_of_job(fetched)


# -- the client side ------------------------------------------------------------------------------


def test_enqueue_puts_the_line_in_the_jobs_meta(conn, installed):
    q = queue(conn)
    mine = {"user": 1}
    job = q.enqueue(rq_jobs.ok, 1, meta=mine)  # @meta
    assert mine == {"user": 1}  # the caller's dict is not changed
    snap = carried(job)
    assert snap is not None and snap.records()[-1][:2] == (THIS_FILE, line_of("meta"))
    fetched = Job.fetch(job.id, connection=conn)
    assert fetched.meta["user"] == 1 and sorted(fetched.meta) == [_rq.META_KEY, "user"]
    assert fetched.origin == q.name  # RQ's own origin: the queue's name, untouched
    value = fetched.meta[_rq.META_KEY]
    assert sorted(value) == ["key", "snapshot"] and type(value["snapshot"]) is str


def test_the_meta_survives_the_json_serializer(conn, installed):
    q = queue(conn, serializer=JSONSerializer)
    job = q.enqueue(rq_jobs.ok, 1)  # @json-meta
    raw = json.loads(conn.hget(job.key, "meta"))  # as stored: JSON text
    assert monstack.Snapshot.from_portable(json.loads(raw[_rq.META_KEY]["snapshot"])).records()[-1][:2] == (
        THIS_FILE, line_of("json-meta"))


def test_point_off_adds_nothing(conn):
    monstack.install(propagate=[p for p in monstack.PROPAGATION_POINTS if p != "rq"])
    q = queue(conn)
    job = q.enqueue(rq_jobs.ok, 1)
    assert _rq.META_KEY not in Job.fetch(job.id, connection=conn).meta
    work("simple", q, "")
    assert job.latest_result().return_value == rq_jobs.ok(1)


def test_a_key_already_there_is_kept_and_a_bad_one_is_ignored(conn, installed):
    q = queue(conn)
    bad = q.enqueue(rq_jobs.where, meta={_rq.META_KEY: {"key": "k-bad", "snapshot": "not json"}})
    worse = q.enqueue(rq_jobs.where, meta={_rq.META_KEY: 7})
    assert Job.fetch(bad.id, connection=conn).meta[_rq.META_KEY]["snapshot"] == "not json"
    work("simple", q, "")
    assert bad.latest_result().return_value == [] and worse.latest_result().return_value == []


def test_rq_is_not_imported_by_install():
    code = "import sys, monstack; monstack.install(); print(sorted(m for m in sys.modules if m.split('.')[0] == 'rq'))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("MONSTACK", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


# -- workers: the job runs under the enqueue line, its stored traceback shows it ----------------


@pytest.mark.parametrize("kind", WORKERS)
def test_a_failing_jobs_stored_traceback_shows_the_enqueue_line(conn, redis_url, installed, kind):
    q = queue(conn)
    job = q.enqueue(rq_jobs.boom, kind)  # @enqueue
    there = q.enqueue(rq_jobs.where)  # @where
    log = work(kind, q, redis_url)
    exc_string = exc_string_of(job)
    assert_enqueued_at(exc_string, "enqueue")
    assert where_in(exc_string, "boom", rq_jobs.__file__, jobs_line) in exc_string  # the job's own frame
    assert "monstack" not in exc_string.split("Work created at")[0]  # no frame of ours in the traceback
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (job.exc_info is deprecated in rq 2.x)
        assert Job.fetch(job.id, connection=conn).exc_info == exc_string
    assert there.latest_result().return_value == [[THIS, line_of("where")]]
    if kind != "simple":  # the worker's own log has it too
        assert where_in(log, "enqueue") in log


def test_a_sentry_event_from_a_forking_worker_carries_the_enqueue_line(conn, redis_url, installed):
    """End to end: Sentry's RqIntegration in a forking worker (MONSTACK=1) captures the
    failure in the work horse and sends it to a loopback Sentry: the event names the line
    that enqueued the job."""
    integration_module("sentry_sdk")
    from sentry_server import events_of, receiving

    q = queue(conn)
    q.enqueue(rq_jobs.boom, "sentry")  # @sentry-enqueue
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MONSTACK", "SENTRY_"))}
    env.update(MONSTACK="1", PYTHONPATH=os.pathsep.join([PROGRAMS] + sys.path))
    with receiving() as (dsn, bodies):
        out = subprocess.run([sys.executable, os.path.join(PROGRAMS, "rq_sentry_worker.py"), redis_url, q.name, dsn],
                             capture_output=True, text=True, env=env, cwd=PROGRAMS, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
    [event] = [e for e in events_of(bodies) if e.get("exception")]
    assert event["exception"]["values"][-1]["value"] == "boom sentry"  # no monstack text in it
    assert event["exception"]["values"][-1]["mechanism"]["type"] == "rq"
    assert event["tags"]["monstack.created_at"] == f"{THIS}:{line_of('sentry-enqueue')}"
    [entry] = [t for t in event["threads"]["values"] if t["id"].startswith("monstack-origin-")]
    assert entry["stacktrace"]["frames"][-1]["abs_path"] == THIS_FILE


def test_a_synchronous_queue(conn, installed):
    q = Queue(f"t-{uuid.uuid4().hex[:12]}", connection=conn, is_async=False)
    job = q.enqueue(rq_jobs.boom, "sync")  # @sync
    assert_enqueued_at(exc_string_of(job), "sync")
    assert q.enqueue(rq_jobs.where).return_value() == [[THIS, line_of("sync-where")]]  # @sync-where


@pytest.mark.parametrize("kind", ["fork", "simple"])
def test_enqueue_many(conn, redis_url, installed, kind):
    q = queue(conn)
    many = q.enqueue_many([Queue.prepare_data(rq_jobs.boom, ("many",)), Queue.prepare_data(rq_jobs.where)])  # @many
    work(kind, q, redis_url)
    assert_enqueued_at(exc_string_of(many[0]), "many")
    assert many[1].latest_result().return_value == [[THIS, line_of("many")]]


@pytest.mark.parametrize("kind", ["fork", "simple"])
def test_enqueue_in_with_the_scheduler(conn, redis_url, installed, kind):
    q = queue(conn)
    job = q.enqueue_in(timedelta(seconds=0), rq_jobs.boom, "later")  # @later
    assert job.get_status() == "scheduled"
    work(kind, q, redis_url, scheduler=True)  # burst: moves the due job to the queue, then runs it
    assert_enqueued_at(exc_string_of(job), "later")


def test_a_succeeding_job_is_unaffected(conn, redis_url):
    results = []
    for points in (True, [p for p in monstack.PROPAGATION_POINTS if p != "rq"]):
        monstack.install(propagate=points)
        q = queue(conn)
        job = q.enqueue(rq_jobs.ok, 41)
        monstack.uninstall()
        work("fork", q, redis_url)
        assert job.get_status() == "finished"
        results.append(job.latest_result().return_value)
    assert results == [rq_jobs.ok(41)] * 2


def test_a_client_without_monstack_runs_jobs_exactly_as_before(conn, redis_url):
    monstack.uninstall()
    texts = []
    for in_worker in (True, False):
        q = queue(conn)
        job = q.enqueue(rq_jobs.boom, "plain")
        assert _rq.META_KEY not in Job.fetch(job.id, connection=conn).meta
        work("fork", q, redis_url, monstack_in_worker=in_worker)
        texts.append(exc_string_of(job))
    assert "Work created at" not in texts[0]
    assert texts[0] == texts[1]  # the worker with monstack stored the very same traceback


@pytest.mark.parametrize("kind", ["fork", "simple"])
def test_json_serializer(conn, redis_url, installed, kind):
    q = queue(conn, serializer=JSONSerializer)
    job = q.enqueue(rq_jobs.boom, "json")  # @json
    there = q.enqueue(rq_jobs.where)  # @json-where
    work(kind, q, redis_url, serializer=JSON)
    assert_enqueued_at(exc_string_of(job), "json")
    assert there.latest_result().return_value == [[THIS, line_of("json-where")]]


@pytest.mark.parametrize("kind", ["fork", "simple"])
def test_a_custom_job_class(conn, redis_url, installed, kind):
    q = queue(conn, job_class=rq_jobs.CustomJob)
    job = q.enqueue(rq_jobs.boom, "custom")  # @custom
    assert type(job) is rq_jobs.CustomJob and job.meta["custom"] == "created" and _rq.META_KEY in job.meta
    there = q.enqueue(rq_jobs.where)  # @custom-where
    work(kind, q, redis_url, job_class="rq_jobs.CustomJob")
    assert_enqueued_at(exc_string_of(job), "custom")
    # the snapshot's innermost tracked frame is the class's own create(), called from here
    assert there.latest_result().return_value == [["rq_jobs.py", jobs_line("custom-create")]]
    recs = carried(there).records()
    assert (recs[-2][0], recs[-2][1]) == (THIS_FILE, line_of("custom-where"))
    assert Job.fetch(job.id, connection=conn).meta["performed_by"] == "CustomJob"


def test_a_job_enqueued_by_a_job_chains_the_origins(conn, redis_url, installed):
    q = queue(conn)
    outer = q.enqueue(rq_jobs.spawn, q.name)  # @spawn-client
    work("fork", q, redis_url)
    inner = Job.fetch(outer.latest_result().return_value, connection=conn)
    text = exc_string_of(inner)
    note = text.find("Work created at")
    chained = text.find("Which ran in work created at")
    assert 0 < note < text.find(where_in(text, "spawn", rq_jobs.__file__, jobs_line)) < chained, text
    assert where_in(text, "spawn-client") in text[chained:], text


# -- versions and internals ------------------------------------------------------------------------


def test_an_unsupported_rq_is_reported_and_left_alone(conn, monkeypatch):
    monkeypatch.setitem(_points.MIN_VERSIONS, "rq", (99, 0))
    with pytest.warns(MonstackWarning, match="could not patch propagation point 'rq'"):
        monstack.install()
    assert "needs rq >= 99.0" in _propagate.FAILED["rq"]
    assert not [a for o, a, _ in _propagate.patched() if str(getattr(o, "__module__", "")).startswith("rq")]
    q = queue(conn)
    job = q.enqueue(rq_jobs.boom, "old")
    work("simple", q, "")
    assert _rq.META_KEY not in job.meta and "Work created at" not in exc_string_of(job)


def test_the_forking_worker_decodes_before_the_fork(conn, installed):
    """The horse finds the snapshot decoded by the worker (Worker.fork_work_horse): the
    origin it runs under is the very object the worker holds (same address after fork)."""
    from monstack._points import celery as _wire

    class QuietWorker(rq.worker.Worker):  # (no pubsub thread: see _SimpleWorker)
        def subscribe(self) -> None:
            pass

    q = queue(conn)
    job = q.enqueue(rq_jobs.origin_id)  # @pre-fork
    _wire._RECEIVED.clear()
    with warnings.catch_warnings():  # 3.12+ warns of fork() in a process with threads (the
        # suite's other tests may leave some): the worker would die of it under -W error
        warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks", category=DeprecationWarning)
        QuietWorker([q], connection=conn).work(burst=True, logging_level="WARNING")  # forks this process
    held = _wire._RECEIVED[job.meta[_rq.META_KEY]["key"]]
    assert held.records()[-1][:2] == (THIS_FILE, line_of("pre-fork"))
    assert job.latest_result().return_value == id(held)


def test_the_oldest_supported_version_is_what_is_installed_or_newer():
    version = tuple(int(p) for p in rq.__version__.split(".")[:2])
    assert version >= _points.MIN_VERSIONS["rq"]
    _rq.recognise(sys.modules["rq.job"])
