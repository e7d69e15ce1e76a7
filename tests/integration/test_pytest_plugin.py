"""The pytest plugin: with pytest-timeout and monstack on, a timed-out test prints
monstack's report (threads with origins) and pytest-timeout's behaviour stays (signal: the
test fails and the run goes on; thread: the run exits; debugger detection); with monstack
off the plugin does nothing and imports nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import integration_module

pytestmark = pytest.mark.integration
integration_module("pytest_timeout")

HUNG = textwrap.dedent(
    """
    import threading, time

    def test_hangs():
        event = threading.Event()
        worker = threading.Thread(target=event.wait, name="stuck-worker", daemon=True)
        worker.start()  # the worker's creating line
        time.sleep(60)  # the test's waiting line

    def test_after():
        pass
    """
)


def run_pytest(tmp_path, *args: str, source: str = HUNG, monstack_on: bool = True) -> subprocess.CompletedProcess:
    (tmp_path / "test_hung.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MONSTACK", "PYTEST_"))}
    if monstack_on:
        env["MONSTACK"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args, "test_hung.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )


def test_signal_method_prints_monstacks_report_and_fails_the_test(tmp_path):
    out = run_pytest(tmp_path, "--timeout", "1", "--timeout-method", "signal")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "Timeout (>1.0s) from pytest-timeout" in text
    assert "monstack dump:" in text and '"stuck-worker"' in text
    assert "worker.start()  # the worker's creating line" in text  # the origin
    assert "time.sleep(60)  # the test's waiting line" in text
    assert "1 failed, 1 passed" in text  # the run goes on, as with pytest-timeout


def test_thread_method_prints_monstacks_report_and_exits(tmp_path):
    out = run_pytest(tmp_path, "--timeout", "1", "--timeout-method", "thread")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "monstack dump:" in text and "worker.start()  # the worker's creating line" in text
    assert "time.sleep(60)  # the test's waiting line" in text
    assert "passed" not in text  # os._exit(1), as with pytest-timeout


def test_the_timeout_marker_and_a_test_in_time(tmp_path):
    source = textwrap.dedent(
        """
        import time, pytest

        @pytest.mark.timeout(5)
        def test_quick():
            time.sleep(0.1)
        """
    )
    out = run_pytest(tmp_path, source=source)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout + out.stderr


def test_debugger_detection_is_kept(tmp_path):
    source = textwrap.dedent(
        """
        import time, pytest_timeout

        def test_debugging(monkeypatch):
            monkeypatch.setattr(pytest_timeout, "SUPPRESS_TIMEOUT", True)  # as pytest's pdb sets it
            time.sleep(2)
        """
    )
    out = run_pytest(tmp_path, "--timeout", "0.5", source=source)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout + out.stderr
    assert "monstack dump:" not in out.stdout


def test_with_monstack_off_pytest_timeout_is_unchanged_and_nothing_is_imported(tmp_path):
    source = HUNG + textwrap.dedent(
        """
        def test_nothing_imported(request):
            import sys
            assert request.config.pluginmanager.has_plugin("monstack")
            assert "monstack" not in sys.modules
        """
    )
    out = run_pytest(tmp_path, "--timeout", "1", source=source, monstack_on=False)
    text = out.stdout + out.stderr
    assert "Stack of stuck-worker" in text  # pytest-timeout's own dump
    assert "monstack dump:" not in text
    assert "1 failed, 2 passed" in text, text


def _between_timeout_separators(text: str) -> list[str]:
    lines = text.splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith("+") and " Timeout " in line]
    assert len(marks) == 2, text
    return lines[marks[0] + 1 : marks[1]]


def test_the_report_folds_pytests_own_frames_and_stays_short(tmp_path):
    """The main thread runs through some 30 frames of pytest and pluggy that pytest's own
    traceback leaves out: each run is one line, and the report stays within 3x the length of
    pytest-timeout's own (which shows the other threads without origins)."""
    source = textwrap.dedent(
        """
        import threading

        def test_joins():
            event = threading.Event()
            worker = threading.Thread(target=event.wait, name="stuck-worker", daemon=True)
            worker.start()  # the worker's creating line
            worker.join()  # the test's waiting line
        """
    )
    ours = _between_timeout_separators((lambda o: o.stdout + o.stderr)(
        run_pytest(tmp_path, "--timeout", "1", "--timeout-method", "signal", source=source)))
    theirs = _between_timeout_separators((lambda o: o.stdout + o.stderr)(
        run_pytest(tmp_path, "--timeout", "1", "--timeout-method", "signal", source=source, monstack_on=False)))
    text = "\n".join(ours)
    assert "worker.join()  # the test's waiting line" in text
    assert "worker.start()  # the worker's creating line" in text  # the stuck thread's origin
    assert f"{os.sep}_pytest{os.sep}" not in text and f"{os.sep}pluggy{os.sep}" not in text
    assert "<frozen runpy>" not in text
    folded = [line for line in ours if line.startswith("  [... ") and "frames of" in line]
    assert folded and "pytest" in folded[0], text
    assert len(ours) <= 3 * len(theirs), (len(ours), len(theirs), text)
