"""monstack's pytest plugin (the ``pytest11`` entry point): pytest loads it wherever
monstack is installed, so it imports nothing (pytest and ``sys`` are already loaded) and
does nothing unless monstack is tracking when a timer is set.

With pytest-timeout installed and monstack on, a test that times out prints monstack's
report (every thread and asyncio task, with where its work came from) instead of bare
stacks: this takes over pytest-timeout's timer through its ``pytest_timeout_set_timer``
hook (see ``monstack._pytest_plugin``). With monstack on, a failed test's report gets a
section with the origins of its exception (and of those chained to it or grouped in it):
the exceptions themselves carry no note under pytest, so ``raises(match=)`` matches what
it would without monstack. Outside the ``monstack`` package on purpose:
importing ``monstack._anything`` would import the whole package first.
"""

import sys

import pytest


def _monstack_on() -> bool:
    capture = sys.modules.get("monstack._capture")
    try:
        return capture is not None and capture.running() is not None
    except Exception:
        return False


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    if not _monstack_on():
        return None  # pytest-timeout's own timer
    from monstack._pytest_plugin import set_timer

    return set_timer(item, settings)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.excinfo is None or not _monstack_on():
        return
    try:
        report = outcome.get_result()
        if report.failed:
            from monstack._pytest_plugin import add_origins

            add_origins(report, call.excinfo.value)
    except Exception:  # never break pytest's report
        pass
