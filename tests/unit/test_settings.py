"""The MONSTACK_* variables: parsing, defaults, and what each row documents."""

from __future__ import annotations

import os
import subprocess
import sys

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
        ("MONSTACK_STARTUP_CACHE", "maybe", "1/true/yes/on, 0/false/no/off"),
    ],
)
def test_bad_value_is_one_problem_naming_variable_and_valid_values(var, value, valid):
    config = _settings.read_env({"MONSTACK": "1", var: value})
    [problem] = config.problems
    assert problem.startswith(f"monstack-bad-value: {var}={value!r} is not valid") and valid in problem
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


# -- mistakes that used to pass without a word --------------------------------------------


@pytest.mark.parametrize(
    "name, closest",
    [
        ("MONSTACK_TRAK", "MONSTACK_TRACK"),
        ("MONSTACK_TRACKS", "MONSTACK_TRACK"),
        ("MONSTACK_INLCUDE", "MONSTACK_INCLUDE"),
        ("MONSTACK_BAKCEND", "MONSTACK_BACKEND"),
        ("MONSTACK_DUMP_SIGANL", "MONSTACK_DUMP_SIGNAL"),
        ("MONSTACK_COLOUR", "MONSTACK_COLOR"),
        ("MONSTACK_CHAINLIMIT", "MONSTACK_CHAIN_LIMIT"),
    ],
)
def test_a_misspelt_variable_is_a_problem_naming_the_closest_one(name, closest):
    config = _settings.read_env({"MONSTACK": "1", name: "all"})
    assert config.problems == [f"monstack-unknown-variable: {name} is not a monstack variable; did you mean {closest}?"]
    assert config.options == {"backend": "auto"}  # and nothing else is read from it


def test_known_and_internal_variables_are_not_misspellings():
    env = {"MONSTACK": "1", **{s.var: "" for s in _settings.SETTINGS}}
    env.update({var: "1" for var in _settings.INTERNAL_VARS})
    env.update({"MONSTACKS": "1", "XMONSTACK_TRAK": "1", "monstack_trak": "1"})  # not ours
    assert _settings.read_env(env).problems == []
    from pathlib import Path

    documented = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for var in _settings.INTERNAL_VARS:  # each one is documented as a developer's variable
        assert f"`{var}`" in documented


@pytest.mark.parametrize("var", ["MONSTACK_INCLUDE", "MONSTACK_EXCLUDE"])
@pytest.mark.parametrize("value", [",,", " , ", os.pathsep])
def test_a_list_that_names_nothing_is_a_problem(var, value):
    config = _settings.read_env({"MONSTACK": "1", var: value})
    [problem] = config.problems
    assert problem.startswith(
        f"monstack-bad-value: {var}={value!r} is not valid (valid values: module names or path prefixes")
    assert var.split("_")[1].lower() not in config.options


def test_the_distance_counts_a_swap_as_one():
    assert _settings._distance("TRAK", "TRACK") == 1
    assert _settings._distance("INLCUDE", "INCLUDE") == 1
    assert _settings._distance("", "ABC") == 3 and _settings._distance("ABC", "ABC") == 0


def _start(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MONSTACK")}
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    environ["PYTHONPATH"] = os.pathsep.join([os.path.join(root, "monstack", "_boot"), root])  # this tree's
    environ.update(env)
    return subprocess.run([sys.executable, *args, "-c", "pass"], env=environ, capture_output=True, text=True, timeout=120)


def test_start_up_warnings_read_cleanly():
    """No made-up location, "monstack" said once: the warning is about the environment."""
    out = _start({"MONSTACK": "1", "MONSTACK_TRAK": "all"})
    assert (out.returncode, out.stderr) == (
        0, "MonstackWarning: monstack-unknown-variable: MONSTACK_TRAK is not a monstack variable; "
        "did you mean MONSTACK_TRACK?\n")
    out = _start({"MONSTACK": "1", "MONSTACK_INCLUDE": ",,"})
    assert out.stderr.startswith("MonstackWarning: monstack-bad-value: MONSTACK_INCLUDE=',,' is not valid (valid values: ") and (
        out.stderr.count("\n") == 1), out.stderr


def test_start_up_warnings_follow_the_warning_filters():
    env = {"MONSTACK": "1", "MONSTACK_TRAK": "all"}
    assert _start(env, "-W", "ignore::RuntimeWarning").stderr == ""  # MonstackWarning is one
    out = _start(env, "-W", "error")  # cannot be raised at start-up: the same line
    assert (out.returncode, out.stderr) == (
        0, "MonstackWarning: monstack-unknown-variable: MONSTACK_TRAK is not a monstack variable; "
        "did you mean MONSTACK_TRACK?\n")
    assert _start({"MONSTACK": "0", "MONSTACK_TRAK": "all"}).stderr == ""  # off: not a word
