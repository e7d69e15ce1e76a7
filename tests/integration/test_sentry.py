"""Sentry with monstack: events of work that has an origin carry it (a ``threads`` entry
per hop with Sentry's frames, the tag ``monstack.created_at``), in either order of
``sentry_sdk.init()`` and ``monstack.install()`` and under ``MONSTACK=1``, with sentry-sdk 2.x
(the venv's) and 3.x (installed once per CPython beside it: ``conftest.other_release``); the exception's
value keeps no monstack text; an event without an origin is untouched; ``uninstall()``
takes the processor off. Against the real SDK: ``before_send``, and a loopback HTTP server
receiving the envelopes. Each scenario runs in a process of its own (Sentry's
integrations patch threading for good)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import integration_module, other_release
from sentry_server import events_of, receiving

pytestmark = pytest.mark.integration
integration_module("sentry_sdk")

PROGRAM = Path(__file__).resolve().parents[1] / "programs" / "sentry_app.py"
LINES = {  # scenario -> the line its origin names
    "thread": "t.start()  # the thread's creating line",
    "job": "future = pool.submit(job)  # the job's submitting line",
    "log": "t.start()  # the logging thread's creating line",
    "task": "asyncio.get_running_loop().create_task(task())  # the task's creating line",
    "task-captured": "captured = asyncio.get_running_loop().create_task(captured_task())  # the captured task's creating line",
}
#: Where each scenario's event is captured (the exception's mechanism): inside the thread or
#: task by Sentry's integrations, by the program, or from a log record.
MECHANISMS = {"thread": "threading", "job": "generic", "task-captured": "asyncio"}


@pytest.fixture(params=["2", "3"], ids=["sentry-sdk-2", "sentry-sdk-3"])
def sdk(request) -> dict[str, str]:
    """The environment a program runs with to get sentry-sdk 2.x (the venv's) or 3.x; the
    program checks the major version it got (``MAJOR``). The 3.x copy is not in site-packages:
    monstack is told not to track it (``LIBRARY_DIR``, ``MONSTACK_EXCLUDE``), as it would not
    track an installed one."""
    if request.param == "2":
        return {"MAJOR": "2"}
    where = other_release("sentry-sdk-3")
    path = os.pathsep.join(p for p in (where, os.environ.get("PYTHONPATH", "")) if p)
    return {"MAJOR": "3", "PYTHONPATH": path, "LIBRARY_DIR": where, "MONSTACK_EXCLUDE": where}


def _lineno(text: str) -> int:
    return [line.strip() for line in PROGRAM.read_text().splitlines()].index(text) + 1


def clean_env(sdk: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MONSTACK", "SENTRY_"))}
    env.update({k: v for k, v in sdk.items() if k != "MAJOR"})
    return env


def run(sdk: dict[str, str], order: str, dsn: str = "none", *extra: str) -> dict[str, list[dict]]:
    env = clean_env(sdk)
    if order == "env":
        env["MONSTACK"] = "1"
    else:
        env.pop("MONSTACK_EXCLUDE", None)  # install() is told in the program
    out = subprocess.run([sys.executable, str(PROGRAM), order, dsn, *extra], capture_output=True, text=True,
                         env=env, timeout=120, cwd=str(PROGRAM.parent))
    assert out.returncode == 0, out.stderr
    scenarios = {d["scenario"]: d["events"] for d in map(json.loads, out.stdout.splitlines())}
    [version] = scenarios.pop("sdk")
    assert version["version"].split(".")[0] == sdk["MAJOR"], version
    return scenarios


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
        if name in MECHANISMS:
            assert event["exception"]["values"][-1]["mechanism"]["type"] == MECHANISMS[name], event["exception"]
    [plain] = scenarios["plain"]
    assert origin_threads(plain) == [] and "monstack.created_at" not in (plain.get("tags") or {})


@pytest.mark.parametrize("order", ["sentry-first", "monstack-first"])
def test_events_of_threads_jobs_logs_and_tasks_carry_their_origin(sdk, order):
    scenarios = run(sdk, order)
    check_origins(scenarios)
    [after] = scenarios["after-uninstall"]  # uninstall() took the processor off
    assert origin_threads(after) == [] and "monstack.created_at" not in (after.get("tags") or {})
    assert after["exception"]["values"][-1]["value"] == "failed in a thread"  # Sentry's capture stays


def test_under_monstack_1_with_sentry_imported_later(sdk):
    check_origins(run(sdk, "env"))


def test_in_app_follows_the_clients_project_root(sdk):
    scenarios = run(sdk, "sentry-first", "none", str(PROGRAM.parent))
    [event] = scenarios["job"]
    assert origin_threads(event)[0]["stacktrace"]["frames"][-1]["in_app"] is True
    outside = run(sdk, "sentry-first", "none", "/nonexistent-root")
    frame = origin_threads(outside["job"][0])[0]["stacktrace"]["frames"][-1]
    assert frame.get("in_app") is not True


def test_envelopes_sent_to_a_loopback_server_carry_the_origin(sdk):
    with receiving() as (dsn, bodies):
        run(sdk, "sentry-first", dsn)
    events = events_of(bodies)
    tagged = [e for e in events if (e.get("tags") or {}).get("monstack.created_at")]
    sites = sorted(e["tags"]["monstack.created_at"] for e in tagged)
    assert sites == sorted(f"sentry_app.py:{_lineno(line)}" for line in LINES.values()), sites
    for event in tagged:
        [entry] = origin_threads(event)
        assert entry["stacktrace"]["frames"][-1]["abs_path"] == str(PROGRAM)


def test_the_integration_takes_options_and_works_without_the_point(sdk, tmp_path):
    program = tmp_path / "app.py"
    program.write_text(
        "import concurrent.futures, json, sentry_sdk, monstack\n"
        "from monstack.sentry import MonstackIntegration\n"
        "events = []\n"
        "monstack.install(propagate=['thread_pool'], exclude=[d for d in [__import__('os').environ.get('LIBRARY_DIR')] if d])\n"
        "sentry_sdk.init(before_send=lambda e, h: events.append(e), integrations=[MonstackIntegration(tag=False)])\n"
        "def job():\n    return 1 / 0\n"
        "with concurrent.futures.ThreadPoolExecutor(1) as pool:\n"
        "    try:\n        pool.submit(job).result()  # submitted here\n"
        "    except ZeroDivisionError as exc:\n        sentry_sdk.capture_exception(exc)\n"
        "print(json.dumps([sentry_sdk.VERSION, events], default=str))\n"
    )
    out = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, env=clean_env(sdk), timeout=120)
    assert out.returncode == 0, out.stderr
    version, [event] = json.loads(out.stdout)
    assert version.split(".")[0] == sdk["MAJOR"], version
    [entry] = origin_threads(event)
    assert entry["stacktrace"]["frames"][-1]["lineno"] == 10
    assert "monstack.created_at" not in (event.get("tags") or {})  # tag=False


def test_the_point_is_off_when_not_asked_for(sdk, tmp_path):
    program = tmp_path / "app.py"
    program.write_text(
        "import concurrent.futures, json, sentry_sdk, monstack\n"
        "events = []\n"
        "monstack.install(propagate=['thread_pool'], exclude=[d for d in [__import__('os').environ.get('LIBRARY_DIR')] if d])\n"
        "sentry_sdk.init(before_send=lambda e, h: events.append(e))\n"
        "def job():\n    return 1 / 0\n"
        "with concurrent.futures.ThreadPoolExecutor(1) as pool:\n"
        "    try:\n        pool.submit(job).result()\n"
        "    except ZeroDivisionError as exc:\n        sentry_sdk.capture_exception(exc)\n"
        "print(json.dumps([sentry_sdk.VERSION, events], default=str))\n"
    )
    out = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, env=clean_env(sdk), timeout=120)
    assert out.returncode == 0, out.stderr
    version, [event] = json.loads(out.stdout)
    assert version.split(".")[0] == sdk["MAJOR"], version
    assert origin_threads(event) == [] and "monstack.created_at" not in (event.get("tags") or {})


def test_sentrys_own_normaliser_keeps_the_origin(sdk):
    """Relay's StoreNormalizer (what Sentry's ingestion runs) accepts the threads entry and
    the tag as sent: nothing dropped, no errors recorded."""
    relay = integration_module("sentry_relay")
    [event] = run(sdk, "sentry-first")["job"]
    normal = relay.StoreNormalizer(project_id=1).normalize_event(event)
    assert not normal.get("errors"), normal.get("errors")
    assert "threads" not in (normal.get("_meta") or {}), normal["_meta"]
    [entry] = origin_threads(normal)
    assert entry["name"] == "monstack: work created at"
    assert entry["stacktrace"]["frames"][-1]["lineno"] == _lineno(LINES["job"])
    assert ["monstack.created_at", f"sentry_app.py:{_lineno(LINES['job'])}"] in normal["tags"]
