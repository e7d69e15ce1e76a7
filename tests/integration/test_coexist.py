"""Coexistence: other tools see exactly what they saw without monstack, and monstack's
stacks stay correct while they run.

- coverage.py (its ``sys.monitoring`` core on 3.12+ via ``COVERAGE_CORE=sysmon``, its C
  tracer on 3.11): executed lines identical with and without monstack, started before
  or after monstack; monstack's own test suite passes under coverage. Skipped when
  coverage is not installed (it is a test-only dependency).
- a ``sys.settrace`` debugger: ``bdb`` stepping through tracked code records the same
  steps, never stops in monstack's code, and ``pdb`` driven by a script prints the same.
- another ``sys.monitoring`` tool: same event counts; DISABLE and ``restart_events``
  from either tool do not leak into the other.
- cProfile: same call counts for the profiled code.
"""

from __future__ import annotations

import bdb
import cProfile
import io
import json
import os
import pdb
import pstats
import subprocess
import sys

import pytest
from conftest import needs_sysmon
from stackcheck import check

import monstack

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")
#: Where the monstack under test lives (subprocesses import the same copy).
HOME = os.path.dirname(os.path.dirname(os.path.abspath(monstack.__file__)))
MONSTACK_DIR = os.path.join(HOME, "monstack") + os.sep
HERE = os.path.abspath(__file__)

try:
    import coverage  # noqa: F401

    HAS_COVERAGE = True
except ImportError:  # pragma: no cover - depends on the environment
    HAS_COVERAGE = False

needs_coverage = pytest.mark.skipif(not HAS_COVERAGE, reason="coverage.py not installed (test extra)")


# --------------------------------------------------------------------------------------
# A workload with calls, recursion, exceptions, generators, coroutines: checks inside.
# --------------------------------------------------------------------------------------


def w_leaf(n):
    check("leaf")
    if n % 3 == 0:
        raise ValueError(n)
    return n


def w_mid(n):
    total = 0
    for i in range(n):
        try:
            total += w_leaf(i)
        except ValueError:
            check("handler")
    return total


def w_gen(n):
    for i in range(n):
        check("gen")
        yield w_leaf(i * 3 + 1)


async def w_coro(n):
    check("coro")
    return sum(w_gen(n))


def w_rec(n):
    if n == 0:
        return w_mid(5)
    return w_rec(n - 1) + 1


def workload():
    out = [w_rec(6), list(w_gen(3))]
    coro = w_coro(3)
    try:
        coro.send(None)
    except StopIteration as stop:
        out.append(stop.value)
    return out


EXPECTED = workload()


# --------------------------------------------------------------------------------------
# coverage.py
# --------------------------------------------------------------------------------------

COVERED_PROGRAM = """
import os, sys
sys.path[:0] = [HOME, TESTS]
ORDER = sys.argv[1]  # under `coverage run`: off | coverage-first; API: api | monstack-first | coverage-first-api
if ORDER == "coverage-first":
    import monstack
    monstack.install()
if ORDER == "monstack-first":
    import monstack
    monstack.install()
if ORDER in ("api", "monstack-first", "coverage-first-api"):
    import coverage
    cov = coverage.Coverage(data_file=sys.argv[2], config_file=False)
    cov.start()
if ORDER == "coverage-first-api":
    import monstack
    monstack.install()
from stackcheck import check

# ---- measured part ----
def leaf(n):
    check("leaf")
    if n % 3 == 0:
        raise ValueError(n)
    return n

def gen(n):
    for i in range(n):
        check("gen")
        yield leaf(i * 3 + 1)

def mid(n):
    total = 0
    for i in range(n):
        try:
            total += leaf(i)
        except ValueError:
            check("handler")
    return total + sum(gen(2))

def rec(n):
    if n == 0:
        return mid(6)
    return rec(n - 1) + 1

never_called = lambda: 1

result = rec(8)
# ---- end of measured part ----
if ORDER in ("api", "monstack-first", "coverage-first-api"):
    cov.stop()
    cov.save()
if ORDER not in ("off", "api"):
    print("backend", monstack.active_backend(), "tools", [sys.monitoring.get_tool(i) for i in range(6)] if hasattr(sys, "monitoring") else None)
print("result", result)
""".replace("HOME", repr(HOME)).replace("TESTS", repr(TESTS))


def _coverage_env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONWARNINGS", None)
    env.pop("MONSTACK", None)
    if sys.version_info >= (3, 12):
        env["COVERAGE_CORE"] = "sysmon"
    else:
        env.pop("COVERAGE_CORE", None)
    return env


def _covered_lines(tmp_path, order: str) -> tuple[list[int], str]:
    prog = tmp_path / "covered.py"
    prog.write_text(COVERED_PROGRAM)
    first = COVERED_PROGRAM.splitlines().index("# ---- measured part ----") + 1
    last = COVERED_PROGRAM.splitlines().index("# ---- end of measured part ----") + 1
    data = tmp_path / f".coverage.{order}"
    env = _coverage_env()
    if order in ("off", "coverage-first"):
        cmd = [sys.executable, "-m", "coverage", "run", f"--data-file={data}", str(prog), order]
    else:
        cmd = [sys.executable, str(prog), order, str(data)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "MonstackWarning" not in res.stderr, res.stderr
    out_json = tmp_path / f"cov-{order}.json"
    rep = subprocess.run(
        [sys.executable, "-m", "coverage", "json", f"--data-file={data}", "-o", str(out_json), "--include", str(prog)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert rep.returncode == 0, rep.stderr + rep.stdout
    files = json.loads(out_json.read_text())["files"]
    (entry,) = files.values()
    return sorted(n for n in entry["executed_lines"] if first < n < last), res.stdout


@needs_coverage
def test_coverage_results_unchanged_by_monstack(tmp_path):
    bases = {}
    for order, base_order in (("off", None), ("coverage-first", "off"), ("api", None), ("monstack-first", "api"), ("coverage-first-api", "api")):
        lines, out = _covered_lines(tmp_path, order)
        assert "result 25" in out
        if base_order is None:
            bases[order] = lines
            continue
        base = bases[base_order]
        assert lines == base, f"{order}: executed lines differ"
        assert "backend None" not in out, out
        if hasattr(sys, "monitoring"):
            tools = out.split("tools", 1)[1]
            assert "monstack" in tools, out
            if order == "coverage-first":
                assert "coverage.py" in tools, out  # both tools held ids at once (sysmon core)
    # `coverage run` sees every line of the measured part (the API, started from inside
    # the running module, misses that module frame's own lines, with or without monstack).
    assert len(bases["off"]) > 20 and len(bases["api"]) > 10


@needs_coverage
def test_monstack_suite_passes_under_coverage(tmp_path):
    env = _coverage_env()
    env["PYTHONPATH"] = HOME
    res = subprocess.run(
        [sys.executable, "-m", "coverage", "run", f"--data-file={tmp_path / '.cov'}", "--source", MONSTACK_DIR,
         "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", os.path.join(ROOT, "tests", "unit", "test_stack.py")],
        capture_output=True, text=True, env=env, timeout=300, cwd=str(tmp_path),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert " passed" in res.stdout


# --------------------------------------------------------------------------------------
# A sys.settrace debugger
# --------------------------------------------------------------------------------------


class Recorder(bdb.Bdb):
    """Steps through everything, recording (file, line, function, event)."""

    def __init__(self):
        super().__init__()
        self.steps: list = []
        self.in_callbacks = 0

    def _note(self, frame, what):
        fn = frame.f_code.co_filename
        if fn.startswith(MONSTACK_DIR) and os.path.basename(fn) in ("_sysmon.py", "_accel.py", "_evalframe.py"):
            self.in_callbacks += 1
        if fn == HERE:
            self.steps.append((frame.f_lineno, frame.f_code.co_name, what))

    def user_call(self, frame, argument_list):
        self._note(frame, "call")
        self.set_step()

    def user_line(self, frame):
        self._note(frame, "line")
        self.set_step()

    def user_return(self, frame, return_value):
        self._note(frame, "return")
        self.set_step()

    def user_exception(self, frame, exc_info):
        self._note(frame, "exception")
        self.set_step()


def _debugged_run():
    rec = Recorder()
    result = rec.runcall(workload)
    sys.settrace(None)
    return result, rec


def test_bdb_steps_through_tracked_code_unchanged():
    base_result, base = _debugged_run()
    monstack.install()
    result, rec = _debugged_run()
    assert result == base_result == EXPECTED
    assert rec.steps == base.steps and len(base.steps) > 100
    # The debugger never stops in monstack's tracking callbacks.
    assert rec.in_callbacks == base.in_callbacks == 0
    check("after the debugger")


def test_pdb_script_output_unchanged():
    script = "\n".join(["step"] * 12 + ["where", "next", "next", "where", "continue"]) + "\n"

    def run():
        out = io.StringIO()
        dbg = pdb.Pdb(stdin=io.StringIO(script), stdout=out, skip=["monstack", "monstack.*", "stackcheck"])
        dbg.use_rawinput = False
        result = dbg.runcall(workload)
        sys.settrace(None)
        return result, out.getvalue()

    base_result, base_out = run()
    monstack.install()
    result, out = run()
    assert result == base_result == EXPECTED
    assert out == base_out
    assert "w_rec" in out and "-> " in out
    check("after pdb")


# --------------------------------------------------------------------------------------
# Another sys.monitoring tool
# --------------------------------------------------------------------------------------


class CountingTool:
    """A second PEP 669 tool counting starts/returns/lines in this file."""

    def __init__(self, tool_id: int, disable_others: bool = True):
        self.id = tool_id
        self.counts: dict = {}
        self.disable_others = disable_others

    def __enter__(self):
        mon = sys.monitoring
        mon.use_tool_id(self.id, "counting-tool")
        E = mon.events

        def make(kind):
            def cb(code, *args):
                if code.co_filename != HERE or not code.co_name.startswith("w"):
                    if code.co_filename != HERE and self.disable_others and kind != "unwind":
                        return mon.DISABLE
                    return None
                key = (kind, code.co_name)
                self.counts[key] = self.counts.get(key, 0) + 1
                return None

            return cb

        for event, kind in ((E.PY_START, "start"), (E.PY_RETURN, "return"), (E.LINE, "line"), (E.PY_UNWIND, "unwind"), (E.PY_YIELD, "yield")):
            mon.register_callback(self.id, event, make(kind))
        mon.set_events(self.id, E.PY_START | E.PY_RETURN | E.LINE | E.PY_UNWIND | E.PY_YIELD)
        return self

    def __exit__(self, *exc):
        mon = sys.monitoring
        mon.set_events(self.id, 0)
        for event in (mon.events.PY_START, mon.events.PY_RETURN, mon.events.LINE, mon.events.PY_UNWIND, mon.events.PY_YIELD):
            mon.register_callback(self.id, event, None)
        mon.free_tool_id(self.id)


@needs_sysmon
@pytest.mark.parametrize("tool_id", [0, 3])  # a debugger's id, and the id monstack prefers
@pytest.mark.parametrize("order", ["tool-first", "monstack-first"])
def test_another_sysmon_tool_sees_the_same_events(tool_id, order):
    with CountingTool(tool_id) as base:
        assert workload() == EXPECTED
    if order == "monstack-first":
        if tool_id == 3:
            pytest.skip("monstack holds id 3 itself when installed first")
        monstack.install()
        with CountingTool(tool_id) as other:
            assert workload() == EXPECTED
    else:
        with CountingTool(tool_id) as other:
            monstack.install()
            assert sys.monitoring.get_tool(tool_id) == "counting-tool"
            assert workload() == EXPECTED
            monstack.uninstall()  # uninstall must leave the other tool alone
            assert sys.monitoring.get_tool(tool_id) == "counting-tool"
            assert workload() == EXPECTED
        other.counts = {k: v // 2 for k, v in other.counts.items()}
    assert other.counts == base.counts and base.counts


@needs_sysmon
def test_restart_events_by_another_tool_keeps_stacks_right():
    monstack.install()
    with CountingTool(0):
        workload()
        sys.monitoring.restart_events()  # re-enables every DISABLEd event, for every tool
        assert workload() == EXPECTED
        check("after restart_events")
    sys.monitoring.restart_events()
    assert workload() == EXPECTED


# --------------------------------------------------------------------------------------
# cProfile
# --------------------------------------------------------------------------------------


def _profiled():
    prof = cProfile.Profile()
    result = prof.runcall(workload)
    stats = pstats.Stats(prof)
    calls = {
        (name, line): (cc, nc)
        for (fn, line, name), (cc, nc, _tt, _ct, _callers) in stats.stats.items()  # type: ignore[attr-defined]
        if fn == HERE
    }
    return result, calls


def test_cprofile_counts_unchanged():
    base_result, base = _profiled()
    monstack.install()
    result, calls = _profiled()
    assert result == base_result == EXPECTED
    assert calls == base and len(base) >= 5
    check("after cProfile")


def test_everything_at_once():
    """cProfile + a settrace debugger + monstack (+ another PEP 669 tool on 3.12+)."""
    base_result, base = _debugged_run()
    monstack.install()
    prof = cProfile.Profile()
    prof.enable()
    try:
        if hasattr(sys, "monitoring"):
            with CountingTool(0):
                result, rec = _debugged_run()
        else:
            result, rec = _debugged_run()
    finally:
        prof.disable()
    assert result == base_result
    assert rec.steps == base.steps
    check("after everything")
