"""The exchange between ``python -m monstack dump`` and its target: a private directory,
requests claimed once, withdrawals that keep a late answer quiet, nothing followed or
overwritten."""

from __future__ import annotations

import ast
import os
import stat
import sys

import pytest

from monstack import _dumpproto as proto

pytestmark = pytest.mark.skipif(not hasattr(os, "O_NOFOLLOW") or sys.platform == "win32", reason="POSIX only")


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.setattr(proto, "BASE", str(tmp_path))
    return tmp_path


def _request(dirfd: int, pid: int, token: str, color: str = "plain") -> None:
    proto.write_new(dirfd, proto.request_name(pid, token), f"{proto.MAGIC} {token} {color}\n".encode())


def test_the_private_directory_is_created_0700_and_reused(base):
    fd = proto.open_private_dir(os.geteuid(), create=True)
    os.close(fd)
    st = os.lstat(proto.dir_path(os.geteuid()))
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    os.close(proto.open_private_dir(os.geteuid(), create=True))  # exists: fine


def test_a_symlinked_directory_is_refused(base, tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    os.symlink(real, proto.dir_path(os.geteuid()))
    with pytest.raises(proto.Refused, match="not a private directory"):
        proto.open_private_dir(os.geteuid(), create=True)


def test_a_directory_others_can_reach_is_refused(base):
    path = proto.dir_path(os.geteuid())
    os.mkdir(path)
    os.chmod(path, 0o755)
    with pytest.raises(proto.Refused, match="not private"):
        proto.open_private_dir(os.geteuid(), create=True)


def test_a_directory_of_another_user_is_refused(base):
    with pytest.raises(proto.Refused):
        proto.open_private_dir(os.geteuid() + 1)  # does not exist
    if os.geteuid() != 0:
        pytest.skip("making a directory of another uid needs root")
    os.mkdir(proto.dir_path(12345), 0o700)  # root's, not uid 12345's
    with pytest.raises(proto.Refused, match="owner 0"):
        proto.open_private_dir(12345)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_root_gives_the_directory_and_files_to_the_target_user(base):
    fd = proto.open_private_dir(65534, create=True, gid=65534)
    try:
        assert os.fstat(fd).st_uid == 65534
        proto.write_new(fd, "x", b"1", uid=65534, gid=65534)
        assert os.stat("x", dir_fd=fd).st_uid == 65534
    finally:
        os.close(fd)


def test_write_new_never_follows_a_symlink_nor_overwrites(base, tmp_path):
    fd = proto.open_private_dir(os.geteuid(), create=True)
    try:
        victim = tmp_path / "victim"
        victim.write_text("keep")
        os.symlink(victim, os.path.join(proto.dir_path(os.geteuid()), "link"))
        with pytest.raises(OSError):
            proto.write_new(fd, "link", b"evil")
        proto.write_new(fd, "plain", b"1")
        with pytest.raises(FileExistsError):
            proto.write_new(fd, "plain", b"2")
        assert victim.read_text() == "keep"
    finally:
        os.close(fd)


def test_claim_takes_each_request_once_and_serve_delivers(base):
    pid = 4242
    fd = proto.open_private_dir(os.geteuid(), create=True)
    try:
        _request(fd, pid, "aa11", "color")
        _request(fd, pid, "bb22")
        _request(fd, pid + 1, "cc33")  # another process's
        wanted, claim_fd = proto.claim(pid)
        os.close(claim_fd)
        assert sorted(wanted) == [("aa11", True), ("bb22", False)]
        assert proto.claim(pid) == ([], -1)  # claimed: gone
        _request(fd, pid, "dd44")
        proto.serve(pid, stderr_if_none=False)
        text = proto.read_output(fd, pid, "dd44", os.geteuid())
        assert text is not None and "Thread" in text
        assert proto.read_output(fd, pid, "dd44", os.geteuid()) is None  # read once
    finally:
        os.close(fd)


def test_a_withdrawn_request_is_consumed_quietly(base, capfd):
    pid = 4243
    fd = proto.open_private_dir(os.geteuid(), create=True)
    try:
        _request(fd, pid, "ee55")
        proto.withdraw(fd, pid, "ee55", os.geteuid(), -1)
        proto.serve(pid)  # a late signal: the withdrawal is consumed, nothing written
        assert capfd.readouterr().err == ""
        assert os.listdir(fd) == []
        proto.withdraw(fd, pid, "ee55", os.geteuid(), -1)  # already claimed: leaves nothing
        assert os.listdir(fd) == []
    finally:
        os.close(fd)


def test_no_request_means_stderr_for_a_signal_and_nothing_for_a_remote_script(base, capfd):
    proto.serve(4244, stderr_if_none=False)
    assert capfd.readouterr().err == ""
    proto.serve(4244)
    assert "test_no_request_means_stderr" in capfd.readouterr().err


def test_a_request_of_another_owner_or_a_fifo_is_ignored(base):
    pid = 4245
    fd = proto.open_private_dir(os.geteuid(), create=True)
    try:
        os.mkfifo(proto.request_name(pid, "ff66"), 0o600, dir_fd=fd)
        assert proto.claim(pid) == ([], -1)
        if os.geteuid() == 0:
            proto.write_new(fd, proto.request_name(pid, "ab12"), b"monstack-dump 1 ab12 plain\n", uid=65534)
            assert proto.claim(pid) == ([], -1)
    finally:
        os.close(fd)


def test_the_remote_script_deletes_itself_and_answers_its_own_request_only(base):
    pid = 4246
    fd = proto.open_private_dir(os.geteuid(), create=True)
    try:
        _request(fd, pid, "aa01")
        _request(fd, pid, "aa02")
        proto.write_new(fd, proto.script_name(pid, "aa01"), b"# script")
        script = os.path.join(proto.dir_path(os.geteuid()), proto.script_name(pid, "aa01"))
        proto.serve_remote(pid, "aa01", script)
        assert not os.path.exists(script)
        assert proto.read_output(fd, pid, "aa01", os.geteuid()) is not None
        assert proto.request_name(pid, "aa02") in os.listdir(fd)
    finally:
        os.close(fd)


def test_clean_stale_removes_files_of_ended_processes_only(base):
    fd = proto.open_private_dir(os.geteuid(), create=True)
    try:
        proto.write_new(fd, f"dump-{os.getpid()}-aa.request", b"")
        proto.write_new(fd, "dump-999999999-aa.py", b"")
        proto.clean_stale(fd)
        assert os.listdir(fd) == [f"dump-{os.getpid()}-aa.request"]
    finally:
        os.close(fd)


def test_plain_report_says_why_and_leaves_out_its_own_frames():
    text = proto.plain_report("no monstack here")
    assert text.startswith("no monstack here\n")
    assert "test_plain_report_says_why" in text
    assert "monstack/_dumpproto.py" not in text and "in plain_report" not in text


def test_the_module_is_self_contained():
    """The remote script is this module's source: it must not need monstack."""
    with open(proto.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not (node.module or "").startswith("monstack"), ast.dump(node)
        if isinstance(node, ast.Import):
            assert all(not a.name.startswith("monstack") for a in node.names)
