"""Root never runs an interpreter another user can change (``_dumptrust``, ``dump PID``).

Each test copies a real interpreter into a fresh tree under /opt (root's, mode 755: not
/tmp, whose sticky world-writable bit alone would refuse everything), starts it, and then
changes one thing another user could control: the binary, a directory on its way, the
standard library's ``encodings``, a link. ``_dumptrust.check`` must name that thing, and the
``dump`` command must refuse in one line and run nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from monstack import _dumpcli, _dumptrust

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the dump command needs Linux's /proc"),
]

CI = os.environ.get("CI") == "true"
NOBODY = 65534
REPO = Path(__file__).resolve().parents[2]
HOLD = "import sys, time; print('ready', flush=True); time.sleep(600)"


def _need(condition: bool, reason: str) -> None:
    if not condition:
        if CI:
            pytest.fail(reason + ": CI requires it", pytrace=False)
        pytest.skip(reason)


def _other_version() -> tuple[str, str]:
    """(binary, X.Y) of a CPython 3.14+ other than this one that nobody can run: one whose
    prefix is reachable by every user (not pyenv's, under /root)."""
    mine = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for version in ("3.14", "3.15"):
        if version == mine:
            continue
        found = shutil.which(f"python{version}", path="/usr/local/bin:/usr/bin:/bin")
        if found:
            real = os.path.realpath(found)
            probe = subprocess.run([real, "-I", "-S", "-c", "import sys; print(sys.prefix)"],
                                   capture_output=True, text=True)
            if probe.returncode == 0 and not probe.stdout.startswith("/root"):
                return real, version
    _need(False, "no CPython 3.14/3.15 of another version than this one on PATH")
    raise AssertionError("unreachable")


class Layout:
    """``<base>/bin/pythonX.Y`` (a copy) and ``<base>/lib/pythonX.Y`` (a link to the real
    standard library, or a tree of links with a copied ``encodings`` or the packages named in
    ``copy``)."""

    def __init__(self, *, copy_encodings: bool = False, copy: "tuple[str, ...]" = ()) -> None:
        _need(os.geteuid() == 0, "changing owners needs root")
        binary, self.version = _other_version()
        self.base = Path(tempfile.mkdtemp(prefix="monstack-trust-", dir="/opt"))
        os.chmod(self.base, 0o755)
        (self.base / "bin").mkdir(mode=0o755)
        (self.base / "lib").mkdir(mode=0o755)
        self.exe = self.base / "bin" / f"python{self.version}"
        shutil.copy2(binary, self.exe)
        real_prefix = subprocess.run([binary, "-I", "-S", "-c", "import sys; print(sys.prefix)"],
                                     capture_output=True, text=True, check=True).stdout.strip()
        real_stdlib = Path(real_prefix) / "lib" / f"python{self.version}"
        self.stdlib = self.base / "lib" / f"python{self.version}"
        copied = set(copy) | ({"encodings"} if copy_encodings else set())
        if copied:
            self.stdlib.mkdir(mode=0o755)
            for entry in os.listdir(real_stdlib):
                if entry in copied:
                    shutil.copytree(real_stdlib / entry, self.stdlib / entry, symlinks=True)
                else:
                    os.symlink(real_stdlib / entry, self.stdlib / entry)
        else:
            os.symlink(real_stdlib, self.stdlib)
        self.proc: "subprocess.Popen[bytes] | None" = None

    def start(self, uid: "int | None" = None) -> int:
        def drop() -> None:
            os.setgroups([])
            os.setgid(uid)  # type: ignore[arg-type]
            os.setuid(uid)  # type: ignore[arg-type]

        self.proc = subprocess.Popen([str(self.exe), "-I", "-c", HOLD], stdout=subprocess.PIPE, cwd="/",
                                     preexec_fn=drop if uid is not None else None,
                                     env={"PATH": "/usr/bin:/bin"})
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == b"ready\n"
        return self.proc.pid

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            assert self.proc.stdout is not None
            self.proc.stdout.close()
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def layout():
    made: list[Layout] = []

    def make(**kw: "bool | tuple[str, ...]") -> Layout:
        made.append(Layout(**kw))
        return made[-1]

    yield make
    for each in made:
        each.close()


def refused(pid: int, *fragments: str) -> str:
    exe = os.readlink(f"/proc/{pid}/exe")
    with pytest.raises(_dumptrust.Untrusted) as caught:
        _dumptrust.check(exe, pid, {0})
    for fragment in fragments:
        assert fragment in str(caught.value), (fragment, str(caught.value))
    return str(caught.value)


def test_a_root_owned_copy_is_trusted(layout):
    lay = layout()
    pid = lay.start()
    _dumptrust.check(os.readlink(f"/proc/{pid}/exe"), pid, {0})


def test_this_interpreter_is_trusted_by_its_owner():
    exe = os.readlink("/proc/self/exe")
    owner = os.stat(exe).st_uid
    _dumptrust.check(exe, os.getpid(), {0, owner, os.geteuid()})


def test_a_directory_another_user_owns(layout):
    lay = layout()
    os.chown(lay.base / "bin", NOBODY, NOBODY)
    refused(lay.start(), f"{lay.base / 'bin'} belongs to uid {NOBODY}")


def test_a_world_writable_directory_above_the_standard_library(layout):
    lay = layout()
    os.chmod(lay.base / "lib", 0o777)
    refused(lay.start(), f"{lay.base / 'lib'} is writable by everyone")


def test_a_binary_another_user_owns(layout):
    lay = layout()
    os.chown(lay.exe, NOBODY, NOBODY)
    refused(lay.start(), f"{lay.exe} belongs to uid {NOBODY}")


def test_an_encodings_module_another_user_can_change(layout):
    lay = layout(copy_encodings=True)
    victim = lay.stdlib / "encodings" / "aliases.py"
    os.chown(victim, NOBODY, NOBODY)
    refused(lay.start(), f"{victim} belongs to uid {NOBODY}")


def test_a_group_writable_encodings_cache(layout):
    lay = layout(copy_encodings=True)
    cache = lay.stdlib / "encodings" / "__pycache__"
    cache.mkdir(exist_ok=True)
    os.chown(cache, 0, 100)
    os.chmod(cache, 0o775)
    refused(lay.start(), f"{cache} is writable by group 100")


def test_a_module_inside_a_package_another_user_owns(layout):
    """The reader's source imports re, tokenize, linecache...: every file of the standard
    library counts, not only its top level and encodings."""
    lay = layout(copy=("re",))
    victim = lay.stdlib / "re" / "_parser.py"
    os.chown(victim, NOBODY, NOBODY)
    refused(lay.start(), f"{victim} belongs to uid {NOBODY}")


def test_a_group_writable_cache_inside_a_package(layout):
    lay = layout(copy=("re",))
    cache = lay.stdlib / "re" / "__pycache__"
    cache.mkdir(exist_ok=True)
    os.chown(cache, 0, 100)
    os.chmod(cache, 0o775)
    refused(lay.start(), f"{cache} is writable by group 100")


def test_the_tree_walk_follows_links_skips_site_packages_and_is_bounded():
    _need(os.geteuid() == 0, "changing owners needs root")
    base = Path(tempfile.mkdtemp(prefix="monstack-trust-", dir="/opt"))
    try:
        os.chmod(base, 0o755)
        stdlib = base / "python3.99"
        for d in (stdlib / "site-packages" / "theirs", stdlib / "dist-packages", base / "elsewhere" / "pkg"):
            d.mkdir(parents=True, mode=0o755)
        for f in (stdlib / "site-packages" / "theirs" / "mod.py", stdlib / "dist-packages" / "mod.py"):
            f.write_text("")
            os.chown(f, NOBODY, NOBODY)  # -S never imports these: not checked
        os.chown(stdlib / "site-packages", NOBODY, NOBODY)
        (base / "elsewhere" / "pkg" / "__init__.py").write_text("")
        os.symlink(base / "elsewhere" / "pkg", stdlib / "pkg")
        os.symlink(stdlib, stdlib / "loop")  # walked once
        skip = _dumptrust._NOT_IMPORTED
        _dumptrust._check_tree(str(stdlib), frozenset({0}), skip)
        victim = base / "elsewhere" / "pkg" / "__init__.py"
        os.chown(victim, NOBODY, NOBODY)  # below a linked directory
        with pytest.raises(_dumptrust.Untrusted, match=f"^{stdlib / 'pkg' / '__init__.py'} belongs to uid {NOBODY}$"):
            _dumptrust._check_tree(str(stdlib), frozenset({0}), skip)
        os.chown(victim, 0, 0)
        with pytest.raises(_dumptrust.Untrusted, match="holds more than 2 files and directories: too many to check"):
            _dumptrust._check_tree(str(stdlib), frozenset({0}), skip, limit=2)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_link_to_the_standard_library_another_user_owns(layout):
    lay = layout()
    os.lchown(lay.stdlib, NOBODY, NOBODY)
    refused(lay.start(), f"{lay.stdlib} belongs to uid {NOBODY}")


def test_a_planted_zip_on_the_path(layout):
    lay = layout()
    pid = lay.start()
    planted = lay.base / "lib" / f"python{lay.version.replace('.', '')}.zip"
    planted.write_bytes(b"PK\x05\x06" + b"\0" * 18)
    os.chown(planted, NOBODY, NOBODY)
    refused(pid, f"{planted} belongs to uid {NOBODY}")


def test_a_replaced_binary(layout):
    lay = layout()
    pid = lay.start()
    os.unlink(lay.exe)
    shutil.copy2(sys.executable, lay.exe)  # same name, another file
    refused(pid, "deleted or replaced")


def test_root_never_runs_a_program_another_user_put_in_place(layout, tmp_path):
    """The attack of the review: a nobody process runs a nobody-owned copy of python, then
    replaces it (and plants a file named '... (deleted)'); root's dump must run neither."""
    lay = layout()
    for path in (lay.base, lay.base / "bin", lay.exe):
        os.chown(path, NOBODY, NOBODY)
    pid = lay.start(uid=NOBODY)
    sentinel = tmp_path / "ran-as-root"
    script = f"#!/bin/sh\ntouch {sentinel}\n"
    os.unlink(lay.exe)
    for name in (lay.exe, Path(f"{lay.exe} (deleted)")):
        name.write_text(script)
        os.chmod(name, 0o755)
        os.chown(name, NOBODY, NOBODY)
    out = subprocess.run([sys.executable, "-m", "monstack", "dump", str(pid), "--timeout", "5"],
                         capture_output=True, text=True, cwd=str(REPO), timeout=120,
                         env={k: v for k, v in os.environ.items() if not k.startswith("MONSTACK")})
    assert out.returncode == 1, (out.stdout, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "refusing to run" in lines[0] and str(lay.exe) in lines[0], lines[0]
    assert "as nobody" in lines[0] or f"uid {NOBODY}" in lines[0], lines[0]
    assert not sentinel.exists()


def test_the_cli_names_the_interpreter_and_the_user(layout):
    lay = layout()
    os.chown(lay.base / "bin", NOBODY, NOBODY)
    pid = lay.start(uid=NOBODY)
    with pytest.raises(_dumpcli.DumpError) as caught:
        _dumpcli.dump_process(pid, 5)
    message = str(caught.value)
    assert f"refusing to run process {pid}'s interpreter {lay.exe} as root (uid 0)" in message, message
    assert f"{lay.base / 'bin'} belongs to uid {NOBODY}" in message
    assert f"'{lay.exe} -m monstack dump {pid}' as nobody (uid {NOBODY})" in message


def test_a_dangling_link_below_root_owned_directories_is_fine(tmp_path):
    # /etc/pythonX.Y/sitecustomize.py on Debian: the link's target may not exist.
    _need(os.geteuid() == 0, "needs root")
    base = Path(tempfile.mkdtemp(prefix="monstack-trust-", dir="/opt"))
    try:
        os.symlink(base / "missing" / "file.py", base / "link.py")
        _dumptrust._check_tree_level(str(base), frozenset({0}))
        os.chmod(base, 0o777)
        with pytest.raises(_dumptrust.Untrusted, match="is writable by everyone"):
            _dumptrust._check_tree_level(str(base), frozenset({0}))
    finally:
        shutil.rmtree(base, ignore_errors=True)
