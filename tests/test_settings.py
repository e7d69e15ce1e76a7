"""The MONSTACK_* variables: parsing, defaults, and what each row documents."""

from __future__ import annotations

import os

import pytest

from monstack import _settings


# -- parsing -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1", "true", "TRUE", " yes ", "on", "On"])
def test_true_values_enable(value):
    config = _settings.read_env({"MONSTACK": value})
    assert config.enabled and config.problems == []


@pytest.mark.parametrize("value", ["", "0", "false", "No", "off", " "])
def test_false_values_disable_silently(value):
    config = _settings.read_env({"MONSTACK": value})
    assert not config.enabled and config.problems == []


def test_unknown_monstack_value_is_off_with_a_problem_naming_valid_values():
    config = _settings.read_env({"MONSTACK": "maybe"})
    assert not config.enabled
    [problem] = config.problems
    assert "MONSTACK='maybe'" in problem and "1/true/yes/on" in problem and "0/false/no/off" in problem


def test_every_setting_parses_good_values_into_install_options():
    config = _settings.read_env(
        {
            "MONSTACK": "1",
            "MONSTACK_BACKEND": "Walk",
            "MONSTACK_TRACK": "all",
            "MONSTACK_INCLUDE": f"pkg.a{os.pathsep}/srv/app, pkg.b",
            "MONSTACK_EXCLUDE": "vendored",
            "MONSTACK_CHAIN_LIMIT": " 3 ",
            "MONSTACK_PROPAGATE": "threading,thread_pool",
            "MONSTACK_COLOR": "never",
        }
    )
    assert config.problems == []
    assert config.options == {
        "backend": "walk",
        "track": "all",
        "include": ("pkg.a", "/srv/app", "pkg.b"),
        "exclude": ("vendored",),
        "chain_limit": 3,
        "propagate": ("threading", "thread_pool"),
    }
    assert config.values["MONSTACK_COLOR"] is False


@pytest.mark.parametrize(
    "var, value, valid",
    [
        ("MONSTACK_BACKEND", "fast", "auto, monitoring, evalframe, walk"),
        ("MONSTACK_TRACK", "everything", "user, all"),
        ("MONSTACK_CHAIN_LIMIT", "0", "a whole number >= 1"),
        ("MONSTACK_CHAIN_LIMIT", "many", "a whole number >= 1"),
        ("MONSTACK_PROPAGATE", "threading,telepathy", "threading, thread_pool"),
        ("MONSTACK_COLOR", "sometimes", "auto, always"),
    ],
)
def test_bad_value_is_one_problem_naming_variable_and_valid_values(var, value, valid):
    config = _settings.read_env({"MONSTACK": "1", var: value})
    [problem] = config.problems
    assert problem.startswith(f"{var}={value!r} is not valid") and valid in problem
    assert "using the default" in problem
    setting = next(s for s in _settings.SETTINGS if s.var == var)
    assert setting.option not in config.options or setting.option == "backend"
    assert config.options["backend"] == "auto"  # never left for install() to re-read


@pytest.mark.parametrize("value, expected", [("1", True), ("all", True), ("none", False), ("off", False)])
def test_propagate_switches(value, expected):
    assert _settings.read_env({"MONSTACK_PROPAGATE": value}).options["propagate"] is expected


def test_blank_variables_are_ignored():
    config = _settings.read_env({"MONSTACK": "1", "MONSTACK_TRACK": "  ", "MONSTACK_INCLUDE": ""})
    assert config.problems == [] and config.options == {"backend": "auto"}


@pytest.mark.parametrize("value, expected", [("always", True), ("NEVER", False), ("auto", None), ("bad", None)])
def test_env_color(value, expected):
    assert _settings.env_color({"MONSTACK_COLOR": value}) is expected
    assert _settings.env_color({}) is None


def test_every_setting_documents_itself():
    names = [s.var for s in _settings.SETTINGS]
    assert len(set(names)) == len(names)
    for s in _settings.SETTINGS:
        assert s.var.startswith("MONSTACK_") and s.valid and s.default and s.doc
        assert s.flag is None or s.flag.startswith("--")
