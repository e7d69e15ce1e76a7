"""monstack's pytest plugin (the ``pytest11`` entry point): pytest loads it wherever
monstack is installed, so it imports nothing (pytest and ``sys`` are already loaded) and
does nothing unless monstack is tracking when a timer is set.

With pytest-timeout installed and monstack on, a test that times out prints monstack's
report (every thread and asyncio task, with where its work came from) instead of bare
stacks: this takes over pytest-timeout's timer through its ``pytest_timeout_set_timer``
hook (see ``monstack._pytest_plugin``). Outside the ``monstack`` package on purpose:
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
