"""tools/cpython_suites.py, the runner of CPython's own regression suites with and without
monstack: its parsing and comparison (on hand-made regrtest results, so a difference is
shown to fail the run) and one small real run in this interpreter. The runs themselves,
on every CPython: docs/reliability.md."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "cpython_suites.py"
sys.path.insert(0, str(ROOT / "tools"))

import cpython_suites  # noqa: E402

VERSION = sys.version.split()[0]


def _has_test_package(name: str) -> bool:
    try:
        return importlib.util.find_spec("test." + name) is not None
    except ImportError:
        return False


def run_tool(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MONSTACK")}
    return subprocess.run([sys.executable, str(TOOL), "--python", sys.executable, *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


def junit(cases: dict[str, str]) -> str:
    """A regrtest-like JUnit file: test id -> 'pass' | 'fail' | 'error' | 'skip'."""
    body = []
    for key, status in cases.items():
        classname, name = key.rsplit(".", 1)
        child = {"pass": "", "fail": "<failure>x</failure>", "error": "<error>x</error>",
                 "skip": '<skipped message="no"/>'}[status]
        body.append(f'<testcase classname="{classname}" name="{name}">{child}</testcase>')
    return "<testsuites><testsuite>" + "".join(body) + "</testsuite></testsuites>"


def test_parse_junit_maps_results_and_the_last_run_of_a_test_wins(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(junit({"m.C.a": "pass", "m.C.b": "fail", "m.C.c": "error", "m.C.d": "skip"})
                   .replace("</testsuites>", "<testsuite>" + '<testcase classname="m.C" name="b"/>'
                            + "</testsuite></testsuites>"))
    assert cpython_suites.parse_junit(xml) == {"m.C.a": "pass", "m.C.b": "pass", "m.C.c": "fail",
                                               "m.C.d": "skip"}
    assert cpython_suites.parse_junit(tmp_path / "missing.xml") == {}


def test_presets_expand_and_packages_split_into_submodules():
    assert cpython_suites.expand_tests(sys.executable, ["test_threading", "test_logging"]) == ["test_threading", "test_logging"]
    default = cpython_suites.expand_tests(sys.executable, ["default"])
    assert default[:2] == ["test_threading", "test_threading_local"] and default[-1] == "test_logging"
    if not _has_test_package("test_asyncio"):
        pytest.skip("this interpreter has no test.test_asyncio")
    tests = cpython_suites.expand_tests(sys.executable, ["asyncio"])
    assert tests[-1] == "test_threading"
    assert "test_asyncio.test_tasks" in tests and "test_asyncio" not in tests
    assert all(t.startswith("test_asyncio.test_") for t in tests[:-1])


OK_PROCESS = "start 1 monitoring accelerator=native track=user\nexit 1 monitoring seed=1 resync=0\n"


def _fake_run(out: Path, off: dict[str, str], user: dict[str, str], processes: str = OK_PROCESS,
              log: str = "") -> subprocess.CompletedProcess:
    out.mkdir(exist_ok=True)
    (out / f"{VERSION}-off.xml").write_text(junit(off))
    (out / f"{VERSION}-user.xml").write_text(junit(user))
    (out / f"{VERSION}-user.processes").write_text(processes)
    (out / f"{VERSION}-user.log").write_text(log)
    return run_tool("--modes", "off,user", "--tests", "test_contextlib", "--out", str(out), "--report-only")


def test_a_difference_from_the_baseline_fails_the_run(tmp_path):
    same = _fake_run(tmp_path / "same", {"m.C.a": "pass", "m.C.b": "skip"}, {"m.C.a": "pass", "m.C.b": "skip"})
    assert same.returncode == 0, same.stdout + same.stderr
    assert "identical to `off`" in same.stdout
    diff = _fake_run(tmp_path / "diff", {"m.C.a": "pass", "m.C.b": "skip"}, {"m.C.a": "fail", "m.C.b": "skip"})
    assert diff.returncode == 1, diff.stdout + diff.stderr
    assert "1 DIFFERENCE(S) from `off`" in diff.stdout and "m.C.a: off=pass user=fail" in diff.stdout
    assert f"| {VERSION} | `user` | monitoring accelerator=native | 2 | 1 | 1 | 1 (0) | 0 |" in diff.stdout


def test_expected_differences_and_missing_results_are_reported_apart(tmp_path):
    known = "test.test_generators.SignalAndYieldFromTest.test_raise_and_yield_from"
    res = _fake_run(tmp_path / "known", {known: "pass", "m.C.a": "pass"}, {known: "fail", "m.C.a": "pass"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "expected: " + known in res.stdout
    lost = _fake_run(tmp_path / "lost", {"test.test_x.C.a": "pass", "m.C.a": "pass"}, {"m.C.a": "pass"})
    assert lost.returncode == 1
    assert "NO RESULT for 1 test case(s) of test.test_x.C" in lost.stdout


def test_monstack_not_starting_turning_off_or_warning_fails_the_run(tmp_path):
    same = {"m.C.a": "pass"}
    sub = OK_PROCESS + "start 1 None accelerator=None None\nexit 1 None seed=0 resync=0\n"
    res = _fake_run(tmp_path / "sub", same, same, processes=sub)
    assert res.returncode == 1 and "DID NOT START in 1 interpreter(s)" in res.stdout
    assert "TURNED ITSELF OFF" not in res.stdout
    off = OK_PROCESS.replace("exit 1 monitoring", "exit 1 None")
    res = _fake_run(tmp_path / "off", same, same, processes=off)
    assert res.returncode == 1 and "TURNED ITSELF OFF in 1" in res.stdout
    res = _fake_run(tmp_path / "warn", same, same, log="x: MonstackWarning: monstack: oops\n")
    assert res.returncode == 1 and "1 MonstackWarning line(s) in the log" in res.stdout


@pytest.mark.skipif(not _has_test_package("test_contextlib"), reason="this interpreter has no test package")
def test_a_real_run_switches_monstack_on_in_every_process(tmp_path):
    res = run_tool("--modes", "off,user", "--tests", "test_contextlib", "--out", str(tmp_path), "--timeout", "120")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SAME RESULTS with and without monstack" in res.stdout
    starts = [line for line in (tmp_path / f"{VERSION}-user.processes").read_text().splitlines()
              if line.startswith("start ")]
    assert len(starts) >= 2  # regrtest itself and its worker
    assert not (tmp_path / f"{VERSION}-off.processes").exists()
