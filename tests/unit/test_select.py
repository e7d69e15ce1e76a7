"""monstack._select: which backend runs, and why. ``auto`` takes the first available of
monitoring, evalframe, walk; an explicit request that cannot run raises with the reason;
MONSTACK_BACKEND stands in for ``backend=None``. And every backend keeps the contract of
``_backend.Backend``."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pytest

import monstack
from monstack import _backend, _select
from monstack._policy import Policy

AUTO = "first available of monitoring, evalframe, walk"


@pytest.fixture
def only(monkeypatch):
    """only(*names): make every other backend unavailable (with a reason naming it)."""

    def apply(*names):
        # (on 3.11 _select answers for monitoring without importing it: the class decides here)
        monkeypatch.setattr(_select._env, "NO_SYSMON_REASON", None)
        for name in _select.AUTO_ORDER:
            if name not in names:
                why = f"{name} is switched off by the test"
                monkeypatch.setattr(_select.backend_class(name), "unavailable", staticmethod(lambda why=why: why))
            else:
                monkeypatch.setattr(_select.backend_class(name), "unavailable", staticmethod(lambda: None))

    monkeypatch.delenv("MONSTACK_BACKEND", raising=False)
    return apply


def test_env_backend_is_honoured_and_checked(monkeypatch):
    monkeypatch.setenv("MONSTACK_BACKEND", "walk")
    assert monstack.install() == "walk"
    monstack.uninstall()
    monkeypatch.setenv("MONSTACK_BACKEND", "bogus")
    with pytest.raises(ValueError, match="MONSTACK_BACKEND='bogus'"):
        monstack.install()


def test_unavailable_backend_requested_explicitly_says_why():
    reasons = _select.reasons()
    missing = [name for name, why in reasons.items() if why]
    if not missing:
        pytest.skip("every backend is available here")
    with pytest.raises(RuntimeError, match="cannot run here"):
        monstack.install(backend=missing[0])

# -- auto -------------------------------------------------------------------------------------


def test_auto_order_is_monitoring_evalframe_walk():
    assert _select.AUTO_ORDER == ("monitoring", "evalframe", "walk")


@pytest.mark.parametrize("available, chosen, why", [
    (("monitoring", "evalframe", "walk"), "monitoring", AUTO),
    (("evalframe", "walk"), "evalframe", AUTO + " (monitoring: monitoring is switched off by the test)"),
    (("monitoring", "walk"), "monitoring", AUTO),
    (("walk",), "walk", AUTO + " (monitoring: monitoring is switched off by the test; "
                                "evalframe: evalframe is switched off by the test)"),
])
def test_auto_takes_the_first_available_and_says_what_it_skipped(only, available, chosen, why):
    only(*available)
    cls, reason = _select.choose("auto")
    assert cls is _select.backend_class(chosen) and cls.name == chosen
    assert reason == why
    assert _select.choose(None) == (cls, reason)  # nothing in MONSTACK_BACKEND: auto


def test_choosing_on_311_does_not_import_the_monitoring_backend():
    # start-up on 3.11 (no sys.monitoring) never needs _sysmon: ~0.8M instructions
    code = ("import sys, monstack._select as s; cls, why = s.choose('auto'); "
            "print(cls.name, 'monstack._sysmon' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    if sys.version_info >= (3, 12):
        assert out[0] == "monitoring"
    else:
        assert out == ["evalframe" if _select.reasons()["evalframe"] is None else "walk", "False"]
        assert _select.reasons()["monitoring"] == _select.backend_class("monitoring").unavailable()


def test_auto_here_matches_the_reasons(monkeypatch):
    monkeypatch.delenv("MONSTACK_BACKEND", raising=False)
    reasons = _select.reasons()
    first = next(name for name in _select.AUTO_ORDER if reasons[name] is None)
    skipped = [f"{name}: {reasons[name]}" for name in _select.AUTO_ORDER[: _select.AUTO_ORDER.index(first)]]
    cls, why = _select.choose("auto")
    assert cls.name == first
    assert why == AUTO + (" (" + "; ".join(skipped) + ")" if skipped else "")


# -- explicit requests ----------------------------------------------------------------------------


@pytest.mark.parametrize("requested", ["walk", "WALK", "Walk"])
def test_an_available_backend_requested_explicitly_is_used(only, requested):
    only("monitoring", "evalframe", "walk")
    cls, why = _select.choose(requested)
    assert cls.name == "walk" and why == "requested (walk)"


@pytest.mark.parametrize("name", ["monitoring", "evalframe"])
def test_an_explicit_backend_that_cannot_run_raises_runtimeerror_with_the_reason(only, name):
    only("walk")
    with pytest.raises(RuntimeError) as info:
        _select.choose(name)
    assert str(info.value) == f"backend {name!r} cannot run here: {name} is switched off by the test"


def test_every_unavailable_backend_here_raises_its_own_reason():
    for name, why in _select.reasons().items():
        if why is None:
            assert _select.choose(name)[0].name == name
        else:
            with pytest.raises(RuntimeError, match=re.escape(f"backend {name!r} cannot run here: {why}")):
                _select.choose(name)


# -- MONSTACK_BACKEND ---------------------------------------------------------------------------


@pytest.mark.parametrize("value, chosen, why", [
    ("walk", "walk", "requested (walk)"),
    (" Walk ", "walk", "requested (walk)"),
    ("auto", "monitoring", AUTO),
    ("", "monitoring", AUTO),  # empty: as if unset
])
def test_monstack_backend_is_read_when_backend_is_none(only, monkeypatch, value, chosen, why):
    only("monitoring", "evalframe", "walk")
    monkeypatch.setenv("MONSTACK_BACKEND", value)
    cls, reason = _select.choose(None)
    assert (cls.name, reason) == (chosen, why)


def test_an_explicit_backend_wins_over_monstack_backend(only, monkeypatch):
    only("monitoring", "evalframe", "walk")
    monkeypatch.setenv("MONSTACK_BACKEND", "bogus")  # not even read
    assert _select.choose("walk")[0].name == "walk"
    assert _select.check_choice("auto") == "auto"


def test_a_bad_monstack_backend_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("MONSTACK_BACKEND", "turbo")
    for call in (_select.check_choice, _select.choose):
        with pytest.raises(ValueError) as info:
            call(None)
        assert str(info.value) == (
            "MONSTACK_BACKEND='turbo' is not a backend; valid choices: 'auto', 'monitoring', 'evalframe', 'walk'"
        )


@pytest.mark.parametrize("requested", ["turbo", "", "auto walk", 3])
def test_a_bad_explicit_backend_names_the_argument(monkeypatch, requested):
    monkeypatch.delenv("MONSTACK_BACKEND", raising=False)
    with pytest.raises(ValueError) as info:
        _select.check_choice(requested)
    assert str(info.value).startswith(f"backend={requested!r} is not a backend; valid choices: 'auto', ")


def test_backend_class_knows_each_backend_and_rejects_others():
    for name in _select.AUTO_ORDER:
        assert _select.backend_class(name).name == name
    for bad in ("auto", "Walk", "turbo"):
        with pytest.raises(ValueError, match="unknown backend .*valid choices: 'auto', 'monitoring', 'evalframe', 'walk'"):
            _select.backend_class(bad)


# -- reasons() ------------------------------------------------------------------------------------


def test_reasons_lists_every_backend_with_none_or_a_sentence():
    reasons = _select.reasons()
    assert tuple(reasons) == _select.AUTO_ORDER
    assert reasons["walk"] is None  # always available
    for name, why in reasons.items():
        assert why == _select.backend_class(name).unavailable()
        assert why is None or (isinstance(why, str) and why.strip())


def test_reasons_follow_unavailable(only):
    only("evalframe", "walk")
    assert _select.reasons() == {"monitoring": "monitoring is switched off by the test", "evalframe": None, "walk": None}


# -- the Backend contract -------------------------------------------------------------------------

CLASS_ATTRS = ("name", "tracking")
INSTANCE_ATTRS = ("snapshot_native", "capture_native")
DATA_ATTRS = ("native_blob",)
METHODS = ("start", "stop", "capture", "retire_fast", "describe")


def test_the_contract_is_what_these_tests_check():
    """The members of ``_backend.Backend`` are the ones checked below (a new one fails here)."""
    declared = set(_backend.Backend.__annotations__)
    declared |= {k for k, v in vars(_backend.Backend).items() if not k.startswith("_") and (callable(v) or isinstance(v, staticmethod))}
    assert declared == set(CLASS_ATTRS + INSTANCE_ATTRS + DATA_ATTRS + METHODS) | {"unavailable"}
    assert list(inspect.signature(_backend.Backend.__init__).parameters) == ["self", "policy", "host", "accelerator"]


@pytest.mark.parametrize("name", _select.AUTO_ORDER)
def test_every_backend_satisfies_the_backend_protocol(name):
    cls = _select.backend_class(name)
    assert cls.name == name and isinstance(cls.tracking, bool)
    assert isinstance(inspect.getattr_static(cls, "unavailable"), staticmethod)
    why = cls.unavailable()
    assert why is None or isinstance(why, str)
    init = inspect.signature(cls.__init__)
    assert list(init.parameters)[:4] == ["self", "policy", "host", "accelerator"]
    assert init.parameters["accelerator"].default is None
    init.bind(None, Policy(), None, accelerator=True)  # accepted by keyword too
    host = _backend.Host(on_error=lambda exc: None, distrust=lambda: None, snapshot=monstack.snapshot)
    backend = cls(Policy(), host, accelerator=False)  # constructing starts nothing
    for attr in INSTANCE_ATTRS:
        value = getattr(backend, attr)
        assert value is None or callable(value)
    assert backend.native_blob is None  # (set by start(), where native code runs)
    for method in METHODS:
        assert callable(getattr(backend, method)), method
    inspect.signature(backend.capture).bind(None)  # capture(frame)
    for method in ("start", "stop", "retire_fast", "describe"):
        inspect.signature(getattr(backend, method)).bind()
    assert isinstance(backend.describe(), dict)
    backend.stop()  # idempotent: also before start()
