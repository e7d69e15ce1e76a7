from __future__ import annotations

import importlib
import io
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import monstack  # noqa: E402
from monstack import _env  # noqa: E402

#: Which configuration this run is (``tests/configs.py`` lists them):
#: ``native``/``python`` pick the sys.monitoring callbacks install() uses by default.
CONFIG = os.environ.get("MONSTACK_TEST_CONFIG", "default")
if CONFIG == "python":
    os.environ["MONSTACK_ACCELERATOR"] = "0"
elif CONFIG == "native":
    os.environ.pop("MONSTACK_ACCELERATOR", None)


def expected_backend() -> str:
    """The backend ``install()`` picks by itself on this interpreter."""
    from monstack import _select

    cls, _why = _select.choose("auto")
    return cls.name


@pytest.fixture
def installed():
    """monstack installed with its defaults for one test, uninstalled afterwards."""
    monstack.uninstall()
    name = monstack.install()
    try:
        yield name
    finally:
        monstack.uninstall()


@pytest.fixture
def no_resync():
    """Fails the test if the shadow stack ever disagreed with the real one (slow path)."""
    from monstack import _stack

    before = _stack.STATS["resync"]
    yield
    assert _stack.STATS["resync"] == before, "the shadow stack had to be rebuilt from the real frames"


@pytest.fixture(autouse=True)
def _always_uninstalled():
    yield
    monstack.uninstall()


tracking = pytest.mark.skipif(
    expected_backend() == "walk", reason="no tracking backend on this interpreter (walk only)"
)
needs_sysmon = pytest.mark.skipif(not _env.HAS_SYSMON, reason="sys.monitoring needs 3.12+")


class FakeStream(io.StringIO):
    """A text stream without a file descriptor that says whether it is a terminal."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty

    def fileno(self) -> int:
        raise io.UnsupportedOperation


def chain_of(n: int) -> monstack.Snapshot:
    """A snapshot whose origin chain is ``n`` hops long (each hop taken under the previous)."""
    snap = None
    for _ in range(n + 1):
        with monstack.origin(snap):
            snap = monstack.snapshot()
    return snap


def integration_module(name: str):
    """Import an integration dependency (pyproject's ``integration`` extra: trio, uvloop, gevent)
    for a test module marked ``integration``. Where it cannot be imported the module is
    skipped with the reason, except in CI (``CI=true``), where that is a failure: CI
    installs the extra on every CPython (uvloop and gevent have wheels for 3.11-3.15 on Linux and
    macOS; the extra leaves it out on Windows, where its tests skip even in CI)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        reason = f"{name} cannot be imported here ({exc}); pip install -e '.[integration]'"
        if os.environ.get("CI") == "true" and not (name == "uvloop" and sys.platform == "win32"):
            pytest.fail(f"{reason}: CI requires it", pytrace=False)
        pytest.skip(reason, allow_module_level=True)


#: CPythons an engine has no release for (pyproject's ``engines`` extra leaves it out
#: there): its tests skip with the reason even in CI. Checked: dask/distributed 2026.8.0,
#: celery[redis] 5.7.0 and rq 3.0.0 install on 3.11-3.15; ray 2.60.0 on 3.11-3.14 only.
ENGINE_NO_RELEASE: dict[str, tuple[tuple[int, int], ...]] = {"ray": ((3, 15),)}


def engine_module(name: str):
    """Import an engine (pyproject's ``engines`` extra: dask's distributed...) for a test
    module. Missing here: skipped with the reason; in CI (``CI=true``) that is a failure,
    unless the engine has no release for this CPython (``ENGINE_NO_RELEASE``), which
    skips with the reason there too (pytest's ``-ra`` summary prints it)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        version = sys.version_info[:2]
        if version in ENGINE_NO_RELEASE.get(name.split(".")[0], ()):
            pytest.skip(f"{name} has no release for CPython {version[0]}.{version[1]}", allow_module_level=True)
        reason = f"{name} cannot be imported here ({exc}); pip install -e '.[engines]'"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}: CI requires it", pytrace=False)
        pytest.skip(reason, allow_module_level=True)


#: Releases of another tool that the venvs do not hold (the ``integration`` extra pins one
#: major version): name -> pip requirement. Installed once per CPython with
#: ``pip install --target`` into a cache below ``.venvs/`` (see :func:`other_release`).
OTHER_RELEASES = {
    "sentry-sdk-3": ("sentry-sdk>=3,<4",),
    # what trio's own test suite imports beyond trio (its test requirements), where the venv lacks them
    "trio-test-deps": ("trustme>=1.0", "pyOpenSSL>=24.0"),
}
CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venvs", "cache")


def other_release(name: str) -> str:
    """The directory holding ``OTHER_RELEASES[name]`` for this CPython, installed there on
    first use (``pip install --target``, with its dependencies): subprocesses put it first on
    ``PYTHONPATH``. Where pip cannot install it, the test skips with the reason, except in CI
    (``CI=true``), where that is a failure."""
    import subprocess
    import tempfile

    where = os.path.join(CACHE, f"{name}-{sys.implementation.cache_tag}")
    if not os.path.isdir(where):
        os.makedirs(CACHE, exist_ok=True)
        partial = tempfile.mkdtemp(prefix=f"{name}-", dir=CACHE)
        res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                              "--no-input", "--target", partial, *OTHER_RELEASES[name]],
                             capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            import shutil

            shutil.rmtree(partial, ignore_errors=True)
            reason = f"pip could not install {' '.join(OTHER_RELEASES[name])}: {res.stderr.strip()[-500:]}"
            if os.environ.get("CI") == "true":
                pytest.fail(f"{reason}: CI requires it", pytrace=False)
            pytest.skip(reason)
        try:
            os.rename(partial, where)
        except OSError:  # another run installed it meanwhile
            import shutil

            shutil.rmtree(partial, ignore_errors=True)
    return where
