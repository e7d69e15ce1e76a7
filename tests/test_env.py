"""monstack._env: the facts it computes without ``sysconfig`` or ``platform`` (both cost
start-up time, and sysconfig imports threading) agree with what those modules say."""

from __future__ import annotations

import platform
import sys
import sysconfig

import pytest

from monstack import _env


def test_machine_is_platform_machine():
    machine = platform.machine().lower()
    assert _env.MACHINE == {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def test_free_threaded_is_py_gil_disabled():
    assert _env.FREE_THREADED == bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def test_config_var_is_sysconfigs():
    for name in ("Py_GIL_DISABLED", "Py_DEBUG", "LDLIBRARY", "SOABI", "Py_TAIL_CALL_INTERP",
                 "_Py_TAIL_CALL_INTERP", "Py_ENABLE_SHARED", "WITH_PYMALLOC", "no such variable"):
        assert _env.config_var(name) == sysconfig.get_config_var(name), name


def test_config_vars_read_from_the_text_agree_with_the_module():
    # the build's _sysconfigdata source is read as text (importing it costs ~2.5M
    # instructions at start-up); a value the text cannot give for sure is _UNREAD, and
    # config_var imports the module for it
    module = (f"_sysconfigdata_{getattr(sys, 'abiflags', '')}_{sys.platform}_"
              f"{getattr(sys.implementation, '_multiarch', '')}")
    try:
        data = __import__(module).build_time_vars
    except ImportError:
        pytest.skip(f"no {module} here")
    text = _env._sysconfigdata_source(module)
    read = 0
    for name in [*data, "no such variable"]:
        got = _env._config_var_from_text(text, name)
        if got is not _env._UNREAD:
            assert got == data.get(name), name
            read += 1
    assert read > len(data) * 0.9
    for name in ("Py_GIL_DISABLED", "Py_TAIL_CALL_INTERP", "_Py_TAIL_CALL_INTERP", "no such variable"):
        assert _env._config_var_from_text(text, name) is not _env._UNREAD, name
    assert _env.config_vars("Py_DEBUG", "no such variable") == [sysconfig.get_config_var("Py_DEBUG"), None]


def test_tail_call_interp_is_read_when_asked_and_agrees_with_sysconfig():
    expected = bool(sysconfig.get_config_var("Py_TAIL_CALL_INTERP") or sysconfig.get_config_var("_Py_TAIL_CALL_INTERP"))
    assert _env.TAIL_CALL_INTERP == expected
    assert "TAIL_CALL_INTERP" in vars(_env)  # computed once, then a plain attribute


