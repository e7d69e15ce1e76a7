"""The package's namespace and ``status()``: what a user sees of the API itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import monstack

REPO = Path(__file__).resolve().parents[2]


def test_dir_shows_the_public_api_and_nothing_else():
    public = {name for name in dir(monstack) if not name.startswith("_")}
    # the public submodules, once something imported them
    public -= {"logging", "sentry", "otel"}
    assert "TYPE_CHECKING" not in dir(monstack)
    assert public == set(monstack.__all__)
    for name in monstack.__all__:
        assert getattr(monstack, name) is not None


def test_a_fresh_import_has_no_typing_helper_either():
    code = "import monstack; print(hasattr(monstack, 'TYPE_CHECKING'), 'TYPE_CHECKING' in dir(monstack))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MONSTACK")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_status_values_are_typed():
    assert monstack.status() == {"backend": None}
    monstack.install(propagate=["threading", "dask"])
    try:
        status = monstack.status()
        assert isinstance(status["backend"], str) and isinstance(status["reason"], str)
        assert status["propagation"] == ["threading", "dask"]
        waiting = status.get("waiting for import", [])
        assert isinstance(waiting, list) and all(isinstance(name, str) for name in waiting)
        for name in waiting:  # modules still to be imported, never ones already imported
            assert name not in sys.modules, name
        if status["backend"] == "monitoring":
            assert isinstance(status["tool id"], int)
            assert status["accelerator"] == "native" or status["accelerator"].startswith("none (")
        if status["backend"] == "evalframe":
            counters = status["shim counters"]
            assert counters and all(isinstance(v, int) for v in counters.values()) and "push" in counters
            assert isinstance(status["C stack reserve"], int) and status["C stack reserve"] > 0
        monstack.install(propagate=False)
        assert monstack.status()["propagation"] == [] and "waiting for import" not in monstack.status()
    finally:
        monstack.uninstall()
