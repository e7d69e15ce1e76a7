"""trio's own test suite under ``MONSTACK=1``: no test fails (the trio nursery point, the
asyncio and thread points and the origins kept off the exceptions that tests inspect with
``pytest.raises(match=...)`` must leave trio's behaviour exactly as it is).

The command is trio's documented one, ``python -m pytest --pyargs trio -p
trio._tests.pytest_plugin``, with warnings as errors and pytest-timeout. trio's test
requirements beyond the integration extra (trustme, pyOpenSSL) are installed beside the venv
(``conftest.other_release``); the tests of trio's development tools (``trio/_tests/tools``:
code generation, needing black, ruff and astor) and of what static tools see of its exports
(``test_static_tool_sees_all_symbols``: pylint and jedi) are left out: they run no trio
code. If the suite fails with monstack, it is run again without: only failures that run
does not have count.

A run with monstack takes about a minute here (39-73 s on 3.11-3.15, all of them passing;
the second run only when the first fails), so to keep CI's total time it runs on CPython
3.12 and 3.14 only (``SUITE_VERSIONS``); it is marked ``integration`` (once per CPython in
tests/run-all.sh)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import integration_module, other_release

pytestmark = pytest.mark.integration

SUITE_VERSIONS = ((3, 12), (3, 14))
if sys.version_info[:2] not in SUITE_VERSIONS:
    pytest.skip(f"trio's suite runs on CPython {' and '.join('%d.%d' % v for v in SUITE_VERSIONS)} only "
                "(CI time)", allow_module_level=True)
trio = integration_module("trio")
integration_module("pytest_timeout")
PROGRAMS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "programs")
HOME = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_suite(tmp_path, monstack_on: bool) -> tuple[int, str, set[str]]:
    """(exit status, output, the ids of failed or erroring tests)."""
    deps = other_release("trio-test-deps")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MONSTACK", "PYTEST_"))}
    env.pop("PYTHONWARNINGS", None)
    env["PYTHONPATH"] = os.pathsep.join([HOME, PROGRAMS, deps])
    env["SUITE_PROBE"] = str(tmp_path / f"probe-{monstack_on}.json")
    if monstack_on:
        env["MONSTACK"] = "1"
    tools = os.path.join(os.path.dirname(trio.__file__), "_tests", "tools")
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "trio", "-p", "trio._tests.pytest_plugin", "-p", "suite_probe",
           "-W", "error", "--timeout=120", "-p", "no:randomly", "-p", "no:cacheprovider", "-q", "-rfE",
           f"--ignore={tools}", "-k", "not test_static_tool_sees_all_symbols", "-o", "markers=redistributors_should_skip: skipped by redistributors"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=1200)
    out = res.stdout + res.stderr
    failed = set(re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M))
    return res.returncode, out, failed


def test_trios_suite_has_no_new_failures_under_monstack(tmp_path):
    rc, out, failed = run_suite(tmp_path, True)
    probe = json.loads((tmp_path / "probe-True.json").read_text())
    assert probe["backend"] is not None and "trio" in probe["points"], probe  # on to the end
    assert " passed" in out, out[-3000:]
    if rc == 0:
        assert not failed
        return
    assert rc == 1, out[-3000:]  # tests failed (not a crash, an interrupted run or a usage error)
    base_rc, base_out, base_failed = run_suite(tmp_path, False)
    assert base_rc in (0, 1), base_out[-3000:]
    assert failed <= base_failed, f"new failures under monstack: {sorted(failed - base_failed)}\n{out[-3000:]}"
