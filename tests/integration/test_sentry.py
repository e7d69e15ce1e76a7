"""Sentry with monstack: events of work that has an origin carry it (a ``threads`` entry
per hop with Sentry's frames, the tag ``monstack.created_at``), in either order of
``sentry_sdk.init()`` and ``monstack.install()`` and under ``MONSTACK=1``; the exception's
value keeps no monstack text; an event without an origin is untouched; ``uninstall()``
takes the processor off. Against the real SDK: ``before_send``, and a loopback HTTP server
receiving the envelopes. Each scenario runs in a process of its own (Sentry's
integrations patch threading for good)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from conftest import integration_module

pytestmark = pytest.mark.integration
integration_module("sentry_sdk")

PROGRAM = Path(__file__).resolve().parents[1] / "programs" / "sentry_app.py"
LINES = {  # scenario -> the line its origin names
    "thread": "t.start()  # the thread's creating line",
    "job": "future = pool.submit(job)  # the job's submitting line",
    "log": "t.start()  # the logging thread's creating line",
    "task": "asyncio.get_running_loop().create_task(task())  # the task's creating line",
}


def _lineno(text: str) -> int:
    return [line.strip() for line in PROGRAM.read_text().splitlines()].index(text) + 1


def run(order: str, dsn: str = "none", *extra: str) -> dict[str, list[dict]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MONSTACK", "SENTRY_"))}
    if order == "env":
        env["MONSTACK"] = "1"
    out = subprocess.run([sys.executable, str(PROGRAM), order, dsn, *extra], capture_output=True, text=True,
                         env=env, timeout=120, cwd=str(PROGRAM.parent))
    assert out.returncode == 0, out.stderr
    return {d["scenario"]: d["events"] for d in map(json.loads, out.stdout.splitlines())}


def origin_threads(event: dict) -> list[dict]:
    return [v for v in (event.get("threads") or {}).get("values", []) if str(v.get("id", "")).startswith("monstack-")]


def check_origins(scenarios: dict[str, list[dict]]) -> None:
    for name, line in LINES.items():
        [event] = scenarios[name]
        [entry] = origin_threads(event)
        assert entry["name"] == "monstack: work created at" and not entry["crashed"]
        frames = entry["stacktrace"]["frames"]
        assert frames[-1]["lineno"] == _lineno(line) and frames[-1]["abs_path"] == str(PROGRAM), (name, frames)
        assert frames[-1]["context_line"].strip() == line
        assert event["tags"]["monstack.created_at"] == f"sentry_app.py:{_lineno(line)}"
        for value in (event.get("exception") or {}).get("values", []):
            assert "Work created at" not in (value.get("value") or ""), value  # grouping text untouched
        assert [v for v in (event.get("exception") or {}).get("values", []) if v.get("type") == "Snapshot"] == []
    [plain] = scenarios["plain"]
    assert origin_threads(plain) == [] and "monstack.created_at" not in (plain.get("tags") or {})


@pytest.mark.parametrize("order", ["sentry-first", "monstack-first"])
def test_events_of_threads_jobs_logs_and_tasks_carry_their_origin(order):
    scenarios = run(order)
    check_origins(scenarios)
    [after] = scenarios["after-uninstall"]  # uninstall() took the processor off
    assert origin_threads(after) == [] and "monstack.created_at" not in (after.get("tags") or {})
    assert after["exception"]["values"][-1]["value"] == "failed in a thread"  # Sentry's capture stays


def test_under_monstack_1_with_sentry_imported_later():
    check_origins(run("env"))


def test_in_app_follows_the_clients_project_root():
    scenarios = run("sentry-first", "none", str(PROGRAM.parent))
    [event] = scenarios["job"]
    assert origin_threads(event)[0]["stacktrace"]["frames"][-1]["in_app"] is True
    outside = run("sentry-first", "none", "/nonexistent-root")
    frame = origin_threads(outside["job"][0])[0]["stacktrace"]["frames"][-1]
    assert frame.get("in_app") is not True


class _Envelopes(BaseHTTPRequestHandler):
    received: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        type(self).received.append(body)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


def test_envelopes_sent_to_a_loopback_server_carry_the_origin():
    server = HTTPServer(("127.0.0.1", 0), _Envelopes)
    _Envelopes.received = []
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        run("sentry-first", f"http://public@127.0.0.1:{server.server_port}/1")
    finally:
        server.shutdown()
        server.server_close()
    events = []
    for body in _Envelopes.received:
        lines = body.split(b"\n")
        for header, payload in zip(lines[1::2], lines[2::2]):
            if json.loads(header).get("type") == "event":
                events.append(json.loads(payload))
    tagged = [e for e in events if (e.get("tags") or {}).get("monstack.created_at")]
    sites = sorted(e["tags"]["monstack.created_at"] for e in tagged)
    assert sites == sorted(f"sentry_app.py:{_lineno(line)}" for line in LINES.values()), sites
    for event in tagged:
        [entry] = origin_threads(event)
        assert entry["stacktrace"]["frames"][-1]["abs_path"] == str(PROGRAM)


def test_the_integration_takes_options_and_works_without_the_point(tmp_path):
    program = tmp_path / "app.py"
    program.write_text(
        "import concurrent.futures, json, sentry_sdk, monstack\n"
        "from monstack.sentry import MonstackIntegration\n"
        "events = []\n"
        "monstack.install(propagate=['thread_pool'])\n"
        "sentry_sdk.init(before_send=lambda e, h: events.append(e), integrations=[MonstackIntegration(tag=False)])\n"
        "def job():\n    return 1 / 0\n"
        "with concurrent.futures.ThreadPoolExecutor(1) as pool:\n"
        "    try:\n        pool.submit(job).result()  # submitted here\n"
        "    except ZeroDivisionError as exc:\n        sentry_sdk.capture_exception(exc)\n"
        "print(json.dumps(events, default=str))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MONSTACK", "SENTRY_"))}
    out = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    [event] = json.loads(out.stdout)
    [entry] = origin_threads(event)
    assert entry["stacktrace"]["frames"][-1]["lineno"] == 10
    assert "monstack.created_at" not in (event.get("tags") or {})  # tag=False


def test_the_point_is_off_when_not_asked_for(tmp_path):
    program = tmp_path / "app.py"
    program.write_text(
        "import concurrent.futures, json, sentry_sdk, monstack\n"
        "events = []\n"
        "monstack.install(propagate=['thread_pool'])\n"
        "sentry_sdk.init(before_send=lambda e, h: events.append(e))\n"
        "def job():\n    return 1 / 0\n"
        "with concurrent.futures.ThreadPoolExecutor(1) as pool:\n"
        "    try:\n        pool.submit(job).result()\n"
        "    except ZeroDivisionError as exc:\n        sentry_sdk.capture_exception(exc)\n"
        "print(json.dumps(events, default=str))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MONSTACK", "SENTRY_"))}
    out = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    [event] = json.loads(out.stdout)
    assert origin_threads(event) == [] and "monstack.created_at" not in (event.get("tags") or {})


def test_sentrys_own_normaliser_keeps_the_origin():
    """Relay's StoreNormalizer (what Sentry's ingestion runs) accepts the threads entry and
    the tag as sent: nothing dropped, no errors recorded."""
    relay = integration_module("sentry_relay")
    [event] = run("sentry-first")["job"]
    normal = relay.StoreNormalizer(project_id=1).normalize_event(event)
    assert not normal.get("errors"), normal.get("errors")
    assert "threads" not in (normal.get("_meta") or {}), normal["_meta"]
    [entry] = origin_threads(normal)
    assert entry["name"] == "monstack: work created at"
    assert entry["stacktrace"]["frames"][-1]["lineno"] == _lineno(LINES["job"])
    assert ["monstack.created_at", f"sentry_app.py:{_lineno(LINES['job'])}"] in normal["tags"]
