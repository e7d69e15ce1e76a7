"""``MONSTACK=1 pytest`` runs clean in a project that turns warnings into errors.

pytest marks every top-level module and package of a distribution that provides a
``pytest11`` entry point for assertion rewriting, and warns for the ones already imported
(``PytestAssertRewriteWarning: Module already imported so cannot be rewritten``). Under
``MONSTACK=1`` the ``.pth`` line has imported ``_monstack_boot`` and ``monstack`` before
pytest starts. Only a regular install lists those files (an editable one lists none), so
this installs monstack into a fresh venv, with pytest.
"""

from __future__ import annotations

import pytest

from test_startup import _install_into, _run, clean_env, venv  # noqa: F401  (venv: a fixture)

TESTS = """
def test_passes():
    assert 1 + 1 == 2

def test_fails():
    x = 3
    assert x == 4
"""


@pytest.fixture(scope="module")
def with_pytest(venv):  # noqa: F811
    out = _run(venv["pip"] + ["install", "pytest"])
    if out.returncode != 0:
        pytest.skip(f"no pytest for the venv (offline?): {out.stderr.strip()[-300:]}")
    return venv


def _pytest(venv, tmp_path, *args: str, **env: str):
    (tmp_path / "test_tiny.py").write_text(TESTS)
    return _run([venv["python"], "-m", "pytest", "-p", "no:cacheprovider", "-W", "error", "-rA", *args],
                env=clean_env(**env), cwd=tmp_path)


@pytest.mark.parametrize("editable", [False, True], ids=["regular", "editable"])
def test_monstack_on_under_pytest_warns_nothing(with_pytest, tmp_path, editable):
    _install_into(with_pytest, *(["-e"] if editable else []))
    # The venv really starts monstack before pytest (else this test proves nothing).
    probe = _run([with_pytest["python"], "-c", "import sys; print('_monstack_boot' in sys.modules, 'monstack' in sys.modules)"],
                 env=clean_env(MONSTACK="1"))
    assert probe.stdout.split() == ["True", "True"], probe.stdout + probe.stderr

    out = _pytest(with_pytest, tmp_path, MONSTACK="1")
    text = out.stdout + out.stderr
    assert "Warning" not in text, text
    assert "1 failed, 1 passed" in text, text  # collected and ran, -W error notwithstanding
    assert "assert 3 == 4" in text, text  # the test module's asserts are still rewritten

    # The plain run says the same (the comparison above is not vacuous).
    plain = _pytest(with_pytest, tmp_path)
    assert "1 failed, 1 passed" in plain.stdout + plain.stderr
