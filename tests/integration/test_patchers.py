"""monstack and other patchers of threads and pools, with the real packages: Sentry's
threading integration, OpenTelemetry's threading instrumentation, wrapt, a
``functools.wraps``-style patch and gevent's monkey-patching, each before and after
``monstack.install()`` and under ``MONSTACK=1``.

Each case runs ``tests/programs/patchers_app.py`` in a fresh interpreter (the tools patch
for the whole process, Sentry once per process) and checks three things: the threads and
jobs run; the other tool keeps its effect (Sentry captures the thread's exception with
the starting thread's scope, OTel's context is current inside the thread and the job,
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
from conftest import integration_module

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
APP = os.path.join(ROOT, "tests", "programs", "patchers_app.py")

#: The packages each tool needs (pyproject's ``integration`` extra).
NEEDS = {
    "sentry": ("sentry_sdk",),
    "otel": ("opentelemetry.sdk", "opentelemetry.instrumentation.threading"),
    "wrapt": ("wrapt",),
    "wraps": (),
    "gevent": ("gevent",),
}
ORDERS = ("tool-first", "monstack-first", "env")


def run_app(tool: str, order: str) -> dict:
    for name in NEEDS[tool]:
        integration_module(name)  # skipped with the reason where missing (a failure in CI)
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("MONSTACK", None)
    if order == "env":
        env["MONSTACK"] = "1"
    out = subprocess.run([sys.executable, APP, tool, order], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def has_line(lines: list, mark: str) -> bool:
    return any(mark in line for line in lines)


def check_effect(tool: str, res: dict) -> None:
    if tool == "sentry":
        assert res["sentry_events"] == 1  # captured inside the thread
        assert res["sentry_tag"] == "main"  # with the scope of the thread that started it
    elif tool == "otel":
        assert res["effect_is_parent"] and res["job_effect_is_parent"]
    elif tool in ("wrapt", "wraps"):
        # their wrapper saw the instance: 3 starts (2 threads, the pool's worker), 2 submits
        assert res["seen"] == {"start": [True, True, True], "submit": [True, True]}
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
    check_effect(tool, on)
    if order != "env":
        off = res["after_uninstall"]
        assert off["job_value"] == 42 and off["thread_failed"] == ["boom-thread-off"]
        assert off["thread_origin"] == off["thread_fail_origin"] == off["job_origin"] == []
        check_effect(tool, off)
