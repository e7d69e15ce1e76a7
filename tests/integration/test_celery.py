"""The ``celery`` propagation point: a Celery task runs under the line that
published it, and its failure shows that line on the worker and in ``AsyncResult.get()``.

Fast tests use Celery's in-memory transport and eager mode in this process; the tests
marked ``integration`` start Debian's ``redis-server`` (broker and result backend) on a
free port of 127.0.0.1 and real ``celery worker`` processes (MONSTACK=1): the prefork
pool with the JSON result serializer, the solo pool with pickle. Needs celery[redis]
(the ``engines`` extra) and redis-server; where either is missing the tests skip with
the reason, and fail in CI."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Iterator

import pytest

import redis_server
import stackcheck
from conftest import engine_module, integration_module

import monstack
from monstack import _propagate
from monstack._errors import MonstackWarning

celery = engine_module("celery")
from celery import chain  # noqa: E402

from monstack import _points  # noqa: E402
from monstack._points import celery as _celery  # noqa: E402

PROGRAMS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "programs")
sys.path.insert(0, PROGRAMS)
import celery_app  # noqa: E402

THIS_FILE = __file__
THIS = os.path.basename(__file__)
line_of = stackcheck.marker_lines(__file__)
app_line = stackcheck.marker_lines(celery_app.__file__)


def assert_created_at(snap: Any, marker: str) -> None:
    assert snap is not None, "no origin"
    recs = snap.records()
    assert (recs[-1][0], recs[-1][1]) == (THIS_FILE, line_of(marker)), snap.format(color=False)


def need(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}: CI requires it", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def memory_app(installed: str) -> Iterator[Any]:
    """A client app on the in-memory transport, with the headers of what it publishes."""
    app = celery_app.make_app("memory://")
    sent: list = []

    def record(headers: Any = None, **_: Any) -> None:
        sent.append(dict(headers))

    celery.signals.before_task_publish.connect(record, weak=False, dispatch_uid="test_celery.record")
    _celery.SUBMITTED.clear()
    try:
        yield app, sent
    finally:
        celery.signals.before_task_publish.disconnect(record, dispatch_uid="test_celery.record")


# -- publishing ----------------------------------------------------------------------------------


def test_publish_puts_the_line_in_the_headers(memory_app):
    app, sent = memory_app
    result = app.tasks["celery_app.ok"].delay(1)  # @publish
    data = sent[-1][_celery.HEADER]
    assert sorted(data) == ["key", "snapshot"]
    assert type(data["snapshot"]) is str  # the records as one JSON text (cheaper on the wire)
    snap = monstack.Snapshot.from_portable(json.loads(data["snapshot"]))
    assert_created_at(snap, "publish")
    assert_created_at(_celery.SUBMITTED[result.id], "publish")
    assert json.loads(json.dumps(data)) == data  # plain JSON-safe records
    assert "origin" in sent[-1] and sent[-1]["origin"] != data  # Celery's own header untouched


def test_a_header_already_there_is_kept(memory_app):
    """What a retry does: re-publish with the request's headers, ours among them."""
    app, sent = memory_app
    theirs = app.tasks["celery_app.ok"].delay(1)  # @first
    data = sent[-1][_celery.HEADER]
    again = app.tasks["celery_app.ok"].apply_async((1,), headers={_celery.HEADER: data, "custom": "x"})
    assert sent[-1][_celery.HEADER] == data and sent[-1]["custom"] == "x"
    assert again.id not in _celery.SUBMITTED and theirs.id in _celery.SUBMITTED


def test_chain_members_are_remembered(memory_app):
    app, _sent = memory_app
    result = chain(app.tasks["celery_app.ok"].s(1), app.tasks["celery_app.boom"].s()).apply_async()  # @chain-mem
    assert_created_at(_celery.SUBMITTED[result.id], "chain-mem")
    assert_created_at(_celery.SUBMITTED[result.parent.id], "chain-mem")


def test_the_map_is_bounded(memory_app, monkeypatch):
    app, _sent = memory_app
    monkeypatch.setattr(_celery, "SUBMITTED_MAX", 3)
    ids = [app.tasks["celery_app.ok"].delay(i).id for i in range(5)]
    assert len(_celery.SUBMITTED) == 3 and ids[-1] in _celery.SUBMITTED and ids[0] not in _celery.SUBMITTED


def test_point_off_adds_nothing():
    monstack.install(propagate=["threading"])
    app = celery_app.make_app("memory://")
    sent: list = []

    def record(headers: Any = None, **_: Any) -> None:
        sent.append(dict(headers))

    celery.signals.before_task_publish.connect(record, weak=False, dispatch_uid="test_celery.off")
    try:
        app.tasks["celery_app.ok"].delay(1)
    finally:
        celery.signals.before_task_publish.disconnect(record, dispatch_uid="test_celery.off")
    assert _celery.HEADER not in sent[-1]
    eager = celery_app.make_app("memory://", eager=True)
    assert eager.tasks["celery_app.where"].delay().get() == []


# -- running: eager mode and apply() (the worker side, in this process) ---------------------------


@pytest.fixture
def eager_app(installed: str) -> Any:
    return celery_app.make_app("memory://", eager=True)


def test_eager_task_fails_with_the_applying_line(eager_app):
    result = eager_app.tasks["celery_app.boom"].delay(1)  # @eager
    with pytest.raises(ValueError) as info:
        result.get()
    assert_created_at(monstack.origin_of(info.value), "eager")
    assert "Work created at" in monstack.format_exception(info.value, color=False)
    assert not hasattr(info.value, "__notes__")


def test_eager_task_runs_under_the_applying_line(eager_app):
    got = eager_app.tasks["celery_app.where"].delay().get()  # @eager-where
    assert got == [[THIS, line_of("eager-where")]]


def test_eager_retries_keep_the_applying_line(eager_app):
    result = eager_app.tasks["celery_app.flaky"].apply_async(headers={"custom": "x"})  # @eager-retry
    with pytest.raises(ValueError) as info:
        result.get()
    assert f"origin [['{THIS}', {line_of('eager-retry')}]]; custom 'x'" in str(info.value)


def test_eager_chain(eager_app):
    tasks = eager_app.tasks
    got = chain(tasks["celery_app.ok"].s(1), tasks["celery_app.where"].s()).apply_async().get()  # @eager-chain
    assert got == [[THIS, line_of("eager-chain")]]


def test_a_carried_header_becomes_the_current_origin(eager_app):
    snap = monstack.snapshot()  # @carried
    value = {"key": "test-carried", "snapshot": snap.to_portable()}
    got = eager_app.tasks["celery_app.where"].apply(headers={_celery.HEADER: value}).get()
    assert got == [[THIS, line_of("carried")]]


@pytest.mark.parametrize("bad", [{"not": "a snapshot"}, {"key": "k-bad", "snapshot": {"v": 1}}, {"snapshot": None},
                                 {"key": 5, "snapshot": "text"}, "text", [[1, 2, 3]], 7])
def test_a_malformed_header_is_ignored(eager_app, bad):
    got = eager_app.tasks["celery_app.where"].apply(headers={_celery.HEADER: bad}).get()  # @malformed
    assert got == [[THIS, line_of("malformed")]]  # as if there were none: the applying line


# -- versions ---------------------------------------------------------------------------------------


def test_an_unsupported_celery_is_reported_and_left_alone(monkeypatch):
    monkeypatch.setitem(_points.MIN_VERSIONS, "celery", (99, 0))
    with pytest.warns(MonstackWarning, match="could not patch propagation point 'celery'"):
        monstack.install()
    assert "needs celery >= 99.0" in _propagate.FAILED["celery"]
    assert not [a for o, a, _ in _propagate.patched() if str(getattr(o, "__module__", "")).startswith("celery")]
    eager = celery_app.make_app("memory://", eager=True)
    with pytest.raises(ValueError) as info:
        eager.tasks["celery_app.boom"].delay(1).get()
    assert monstack.origin_of(info.value) is None


def test_an_unsupported_celery_imported_later_runs_on():
    """The post-import path: install() first, then the program imports Celery."""
    code = (
        "import monstack\n"
        "from monstack import _points, _propagate\n"
        "_points.MIN_VERSIONS['celery'] = (99, 0)\n"
        "monstack.install()\n"
        f"import sys; sys.path.insert(0, {PROGRAMS!r})\n"
        "import celery_app\n"
        "app = celery_app.make_app('memory://', eager=True)\n"
        "print('result', app.tasks['celery_app.ok'].delay(1).get())\n"
        "print('failed', sorted(_propagate.FAILED))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("MONSTACK", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "result 2" in out.stdout and "failed ['celery']" in out.stdout, out.stdout
    assert out.stderr.count("could not patch propagation point 'celery'") == 1, out.stderr


def test_the_oldest_supported_version_is_what_is_installed_or_newer():
    version = tuple(int(p) for p in celery.__version__.split(".")[:2])
    assert version >= _points.MIN_VERSIONS["celery"]
    _points.check_version("celery")


# -- real workers on a real redis -----------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_port() -> Iterator[int]:
    try:
        import redis  # noqa: F401
    except ImportError as exc:
        need(f"the redis client cannot be imported ({exc}); pip install -e '.[engines]'")
    with redis_server.running(need, lambda reason: pytest.fail(reason, pytrace=False)) as port:
        yield port


class Worker:
    def __init__(self, app: Any, log: str, pool: str, serializer: str) -> None:
        self.app, self.log, self.pool, self.serializer = app, log, pool, serializer

    def task(self, name: str) -> Any:
        return self.app.tasks[f"celery_app.{name}"]

    def wait_for_log(self, text: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while True:
            with open(self.log, encoding="utf-8", errors="replace") as fh:
                content = fh.read()
            if text in content or time.monotonic() > deadline:
                return content
            time.sleep(0.1)


WORKERS = [("prefork", "json", 1), ("solo", "pickle", 2)]


@contextlib.contextmanager
def running_worker(pool: str, serializer: str, url: str, log: str, **env_extra: str) -> Iterator[Worker]:
    """A ``celery worker`` (MONSTACK=1) of ``pool`` on the broker ``url``, answering already."""
    # notes mode: the worker's log ("Task ... raised unexpected") prints the exception itself
    env = dict(os.environ, MONSTACK="1", MONSTACK_NOTES="1", CT_BROKER=url, CT_RESULT_SERIALIZER=serializer,
               PYTHONPATH=os.pathsep.join([PROGRAMS] + sys.path), **env_extra)
    cmd = [sys.executable, "-m", "celery", "-A", "celery_app", "worker", "-P", pool, "-c", "1", "-l", "INFO",
           "--without-gossip", "--without-mingle", "--without-heartbeat", "-n", f"{pool}@%h"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=PROGRAMS)
    client = celery_app.make_app(url, serializer)
    try:
        w = Worker(client, log, pool, serializer)
        first = w.task("ok").delay(1)
        deadline = time.monotonic() + 180
        while not first.ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                with open(log, encoding="utf-8", errors="replace") as fh:
                    pytest.fail(f"the {pool} worker did not start (exit {proc.poll()}); its log:\n{fh.read()[-3000:]}")
            time.sleep(0.1)
        assert first.get(timeout=10) == 2
        del first
        yield w
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        client.close()


@pytest.fixture(scope="module", params=WORKERS, ids=[f"{p}-{s}" for p, s, _db in WORKERS])
def worker(request, redis_port, tmp_path_factory) -> Iterator[Worker]:
    pool, serializer, db = request.param
    log = str(tmp_path_factory.mktemp(f"celery-{pool}") / "worker.log")
    with running_worker(pool, serializer, f"redis://127.0.0.1:{redis_port}/{db}", log) as w:
        yield w


@pytest.fixture
def client(worker: Worker, installed: str) -> Worker:
    _celery.SUBMITTED.clear()
    return worker


@pytest.mark.integration
def test_delay_failure_shows_the_submitting_line(client):
    result = client.task("boom").delay("delay")  # @delay
    with pytest.raises(ValueError, match="boom delay") as info:
        result.get(timeout=60)
    exc = info.value
    assert_created_at(monstack.origin_of(exc), "delay")
    assert "Work created at" in monstack.format_exception(exc, color=False)
    if client.serializer == "pickle":  # the worker's origin travelled back with the exception
        assert monstack.origin_of(exc) is not _celery.SUBMITTED[result.id]
    else:  # JSON drops attributes: the one this process remembered
        assert monstack.origin_of(exc) is _celery.SUBMITTED[result.id]
    log = client.wait_for_log(f'"{THIS_FILE}", line {line_of("delay")}')
    # the worker's own report (notes mode: MONSTACK_NOTES=1 there) has the note
    assert f'"{THIS_FILE}", line {line_of("delay")}' in log


@pytest.mark.integration
def test_worker_runs_the_task_under_the_submitting_line(client):
    assert client.task("where").delay().get(timeout=60) == [[THIS, line_of("where")]]  # @where


@pytest.mark.integration
def test_a_chain_shows_the_line_that_applied_it(client):
    result = chain(client.task("ok").s(1), client.task("boom").s()).apply_async()  # @chain
    with pytest.raises(ValueError, match="boom 2") as info:
        result.get(timeout=60)
    assert_created_at(monstack.origin_of(info.value), "chain")
    got = chain(client.task("ok").s(1), client.task("where").s()).apply_async().get(timeout=60)  # @chain-where
    assert got == [[THIS, line_of("chain-where")]]  # the second step: no hop of its own


@pytest.mark.integration
def test_tasks_published_inside_a_task_chain_the_parents_origin(client):
    inner = client.task("spawn_chain").delay().get(timeout=60)  # @spawn-chain-client
    got = client.app.AsyncResult(inner).get(timeout=60)
    assert got == [["celery_app.py", app_line("spawn-chain")], [THIS, line_of("spawn-chain-client")]]
    nested = client.task("spawn").delay().get(timeout=60)  # @spawn-client
    with pytest.raises(ValueError, match="boom nested"):
        client.app.AsyncResult(nested).get(timeout=60)
    log = client.wait_for_log(f'"{THIS_FILE}", line {line_of("spawn-client")}')
    at = log.rfind(f'"{THIS_FILE}", line {line_of("spawn-client")}')
    assert at >= 0 and f'celery_app.py", line {app_line("spawn")}' in log[:at], log[-3000:]


@pytest.mark.integration
def test_a_retry_keeps_the_clients_origin_and_headers(client):
    """celery#9174: a retry re-published with the task's headers, ours among them."""
    result = client.task("flaky").apply_async(headers={"custom": "x"})  # @retry-client
    with pytest.raises(ValueError) as info:
        result.get(timeout=60)
    assert f"origin [['{THIS}', {line_of('retry-client')}]]; custom 'x'" in str(info.value)
    assert_created_at(monstack.origin_of(info.value), "retry-client")
    assert client.task("headers_seen").delay().get(timeout=60) == [_celery.HEADER]


def test_a_loop_publishing_from_one_line_encodes_once(memory_app):
    app, sent = memory_app
    for i in range(3):
        app.tasks["celery_app.ok"].delay(i)  # @loop
    app.tasks["celery_app.ok"].delay(9)  # @after-loop
    first, second, third, other = (h[_celery.HEADER] for h in sent[-4:])
    assert first is second is third and other is not first
    assert_created_at(monstack.Snapshot.from_portable(json.loads(first["snapshot"])), "loop")
    assert_created_at(monstack.Snapshot.from_portable(json.loads(other["snapshot"])), "after-loop")
    assert first["key"] != other["key"]
    assert _celery.decode_header(dict(first)) is _celery.decode_header(dict(first))  # decoded once per key


def test_each_member_of_a_group_carries_the_line(memory_app):
    app, sent = memory_app
    ok = app.tasks["celery_app.ok"]
    celery.group(ok.s(1), ok.s(2)).apply_async()  # @group
    carried = [h[_celery.HEADER] for h in sent[-2:]]
    assert len(carried) == 2
    for data in carried:
        assert_created_at(monstack.Snapshot.from_portable(json.loads(data["snapshot"])), "group")


def test_an_eager_tasks_headers_published_from_inside_it(installed):
    """An eager task's request carries its origin as a Snapshot; publishing a task with
    those headers (from inside it) sends the encoded form, never the object."""
    app = celery_app.make_app("memory://")
    sent: list = []

    def record(headers: Any = None, **_: Any) -> None:
        sent.append(dict(headers))

    @app.task(name="test_celery.republish", bind=True, shared=False)
    def republish(self: Any) -> None:
        app.tasks["celery_app.ok"].apply_async((1,), headers=dict(self.request.headers))

    celery.signals.before_task_publish.connect(record, weak=False, dispatch_uid="test_celery.eager-pub")
    try:
        republish.apply().get()  # @eager-pub
    finally:
        celery.signals.before_task_publish.disconnect(record, dispatch_uid="test_celery.eager-pub")
    value = sent[-1][_celery.HEADER]
    assert type(value) is dict
    assert_created_at(monstack.Snapshot.from_portable(json.loads(value["snapshot"])), "eager-pub")


@pytest.mark.integration
def test_a_sentry_event_from_a_prefork_worker_carries_the_submitting_line(redis_port, tmp_path, installed):
    """End to end: Sentry's CeleryIntegration in the worker (prefork, MONSTACK=1) captures the
    task's failure in the pool's child and sends it to a loopback Sentry: the event names
    the line that submitted the task, and its value holds no monstack text."""
    integration_module("sentry_sdk")
    from sentry_server import events_of, receiving

    with receiving() as (dsn, bodies):
        url = f"redis://127.0.0.1:{redis_port}/3"
        with running_worker("prefork", "json", url, str(tmp_path / "worker.log"), CT_SENTRY_DSN=dsn) as w:
            result = w.task("boom").delay("sentry")  # @sentry-delay
            with pytest.raises(ValueError, match="^boom sentry$"):
                result.get(timeout=60)
            deadline = time.monotonic() + 60
            while not [e for e in events_of(list(bodies)) if e.get("exception")] and time.monotonic() < deadline:
                time.sleep(0.1)
    [event] = [e for e in events_of(bodies) if e.get("exception")]
    value = event["exception"]["values"][-1]
    assert value["value"] == "boom sentry" and value["mechanism"]["type"] == "celery", value
    assert event["tags"]["monstack.created_at"] == f"{THIS}:{line_of('sentry-delay')}"
    [entry] = [t for t in event["threads"]["values"] if t["id"].startswith("monstack-origin-")]
    assert entry["stacktrace"]["frames"][-1]["abs_path"] == THIS_FILE
