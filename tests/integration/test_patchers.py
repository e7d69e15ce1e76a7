"""monstack and other patchers of threads and pools, with the real packages: Sentry's
threading integration (sentry-sdk 2.x and 3.x), OpenTelemetry's threading and asyncio
instrumentations (with the SDK and ``monstack.otel.OriginSpanProcessor``), wrapt, a
``functools.wraps``-style patch, gevent's monkey-patching and ddtrace's futures and asyncio
patching (which rewrites ``ThreadPoolExecutor.submit``'s and ``BaseEventLoop.create_task``'s
code in place), each before and after
``monstack.install()`` and under ``MONSTACK=1``.

Each case runs ``tests/programs/patchers_app.py`` in a fresh interpreter (the tools patch
for the whole process, Sentry once per process) and checks three things: the threads and
jobs run; the other tool keeps its effect (Sentry captures the thread's exception with
the starting thread's scope, OTel's context is current inside the thread, the job and the
task, the asyncio instrumentation's spans are made, children of the creator's span,
wrapt's wrapper sees its instance); monstack's origins show. After ``uninstall()`` the
work still runs, without origins, and the tool's effect stays (a patch laid over
monstack's keeps working).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import integration_module, other_release

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
APP = os.path.join(ROOT, "tests", "programs", "patchers_app.py")

#: The packages each tool needs (pyproject's ``integration`` extra).
NEEDS = {
    "sentry": ("sentry_sdk",),
    "sentry-3": (),  # sentry-sdk 3.x, installed beside the venv (conftest.other_release)
    "otel": ("opentelemetry.sdk", "opentelemetry.instrumentation.threading"),
    "otel-asyncio": ("opentelemetry.sdk", "opentelemetry.instrumentation.asyncio"),
    "wrapt": ("wrapt",),
    "wraps": (),
    "gevent": ("gevent",),
    "ddtrace": (),  # not imported here (see needs_ddtrace)
}
#: ddtrace's environment: no agent (its writer fails to connect to a closed loopback port
#: and drops the traces), no telemetry or remote configuration.
DDTRACE_ENV = {"DD_TRACE_AGENT_URL": "http://127.0.0.1:9", "DD_INSTRUMENTATION_TELEMETRY_ENABLED": "false",
               "DD_REMOTE_CONFIGURATION_ENABLED": "false", "DD_TRACE_STARTUP_LOGS": "false"}


def needs_ddtrace() -> None:
    """ddtrace (pyproject's ``integration`` extra where it has wheels: CPython 3.11 to 3.14;
    it has none for 3.15 and does not build from source there, so its test skips there even
    in CI). Looked up, not imported: importing it in the test process starts its services."""
    import importlib.util

    if importlib.util.find_spec("ddtrace") is not None:
        return
    reason = "ddtrace is not installed here; pip install -e '.[integration]'"
    if sys.version_info >= (3, 15):
        pytest.skip("ddtrace has no wheel for CPython 3.15 (and does not build from source here)")
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}: CI requires it", pytrace=False)
    pytest.skip(reason)
ORDERS = ("tool-first", "monstack-first", "env")


def run_app(tool: str, order: str) -> dict:
    for name in NEEDS[tool]:
        integration_module(name)  # skipped with the reason where missing (a failure in CI)
    env = dict(os.environ, PYTHONPATH=ROOT)
    if tool == "ddtrace":
        needs_ddtrace()
        env.update(DDTRACE_ENV)
    env.pop("MONSTACK", None)
    if tool == "sentry-3":
        # not in site-packages: monstack is told not to track it, as it would not track an installed one
        where = other_release("sentry-sdk-3")
        env.update(PYTHONPATH=os.pathsep.join((where, ROOT)), LIBRARY_DIR=where)
        if order == "env":
            env["MONSTACK_EXCLUDE"] = where
    if order == "env":
        env["MONSTACK"] = "1"
    name = "sentry" if tool == "sentry-3" else tool
    out = subprocess.run([sys.executable, APP, name, order], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if name == "sentry":
        assert res["version"].split(".")[0] == ("3" if tool == "sentry-3" else "2"), res["version"]
    return res


def has_line(lines: list, mark: str) -> bool:
    return any(mark in line for line in lines)


def site(mark: str) -> str:
    """``patchers_app.py:LINE`` of the line ending with ``mark``."""
    with open(APP) as f:
        [line] = [i for i, text in enumerate(f, 1) if text.rstrip().endswith(mark)]
    return f"patchers_app.py:{line}"


def check_effect(tool: str, res: dict, label: str) -> None:
    if tool in ("sentry", "sentry-3"):
        assert res["sentry_events"] == 1  # captured inside the thread
        assert res["sentry_tag"] == "main"  # with the scope of the thread that started it
    elif tool == "otel":
        assert res["effect_is_parent"] and res["job_effect_is_parent"]
    elif tool == "otel-asyncio":
        # the tasks ran in the creator's context, and the instrumentation's spans were made,
        # children of the span current where the task was created, the failing one an error
        assert res["task_value"] == 7 and res["to_thread_value"] == 8 and res["task_error"] == f"boom-task-{label}"
        assert res["task_effect_is_parent"]
        spans = res["spans"]
        assert sorted(spans) == ["asyncio coro-task_fail", "asyncio coro-task_ok", "asyncio to_thread-in_thread"]
        assert all(span["parent_is_parent"] for span in spans.values()), spans
        assert [name for name, span in spans.items() if span["error"]] == ["asyncio coro-task_fail"]
    elif tool in ("wrapt", "wraps"):
        # their wrapper saw the instance: 3 starts (2 threads, the pool's worker), 2 submits
        assert res["seen"] == {"start": [True, True, True], "submit": [True, True]}
    elif tool == "ddtrace":
        assert res["job_effect_is_parent"]  # its trace context carried into the pool's job
        assert res["task_value"] == 7 and res["to_thread_value"] == 8 and res["task_error"] == f"boom-task-{label}"
        assert res["task_effect_is_parent"]  # and into the task
    elif tool == "gevent":
        assert res["gevent_patched"]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("tool", list(NEEDS))
def test_monstack_composes_with_another_patcher(tool, order):
    res = run_app(tool, order)
    on = res["on"]
    # the work ran
    assert on["job_value"] == 42 and on["job_error"] == "'boom-job-on'"
    assert on["thread_failed"] == ["boom-thread-on"]
    # monstack's origins show (the creating line is in the origin; where the other tool
    # wraps in the program's own code, its wrapper's line may come after it)
    assert has_line(on["thread_origin"], "# @thread-ok"), on
    assert has_line(on["thread_fail_origin"], "# @thread-fail"), on
    assert has_line(on["job_origin"], "# @submit-fail"), on
    check_effect(tool, on, "on")
    if tool in ("otel-asyncio", "ddtrace"):  # the tasks' origins
        assert has_line(on["task_origin"], "# @task-ok") and has_line(on["task_fail_origin"], "# @task-fail"), on
        assert has_line(on["to_thread_origin"], "# @to-thread"), on
    if tool == "otel-asyncio":  # OriginSpanProcessor on each first span
        assert {name: span["site"] for name, span in on["spans"].items()} == {
            "asyncio coro-task_ok": site("# @task-ok"), "asyncio coro-task_fail": site("# @task-fail"),
            "asyncio to_thread-in_thread": site("# @to-thread")}
    if order != "env":
        off = res["after_uninstall"]
        assert off["job_value"] == 42 and off["thread_failed"] == ["boom-thread-off"]
        assert off["thread_origin"] == off["thread_fail_origin"] == off["job_origin"] == []
        check_effect(tool, off, "off")
        if tool in ("otel-asyncio", "ddtrace"):
            assert off["task_origin"] == off["task_fail_origin"] == off["to_thread_origin"] == []
        if tool == "otel-asyncio":
            assert all(span["site"] is None for span in off["spans"].values())
