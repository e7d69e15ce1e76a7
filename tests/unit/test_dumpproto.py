"""The exchange between ``python -m monstack dump`` and its target: a private directory,
requests claimed once, withdrawals that keep a late answer quiet, nothing followed or
overwritten."""

from __future__ import annotations

import ast
import os
import signal
import stat
import subprocess
import sys

import pytest

from monstack import _dumpproto as proto

pytestmark = pytest.mark.skipif(not hasattr(os, "O_NOFOLLOW") or sys.platform == "win32", reason="POSIX only")


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.setattr(proto, "BASE", str(tmp_path))
    monkeypatch.setattr(proto, "RUN_BASE", str(tmp_path / "run-user"))  # none: /tmp's layout
    return tmp_path


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("files of another uid need root")


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
    assert text.startswith(f"monstack dump: process {os.getpid()}, CPython ")  # monstack's own layout
    assert text.splitlines()[1] == "(no monstack here)"
    assert "Stack (most recent call last):" in text and "writing this report" in text
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


# -- where the directory is: /run/user/<uid> when private, else /tmp --------------------------


def test_a_private_runtime_directory_is_preferred(base):
    uid = os.geteuid()
    run = base / "run-user" / str(uid)
    run.mkdir(parents=True)
    os.chmod(run, 0o700)
    assert proto.dir_path(uid) == str(run / "monstack")
    os.close(proto.open_private_dir(uid, create=True))
    st = os.lstat(run / "monstack")
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == uid
    assert not os.path.exists(base / f"monstack-{uid}")
    os.chmod(run, 0o755)  # not private: /tmp
    assert proto.dir_path(uid) == str(base / f"monstack-{uid}")
    os.chmod(run, 0o700)
    os.rename(run, base / "real")
    os.symlink(base / "real", run)  # a symlink: /tmp
    assert proto.dir_path(uid) == str(base / f"monstack-{uid}")


def test_a_runtime_directory_of_another_owner_is_not_used(base):
    need_root()
    run = base / "run-user" / "65534"
    run.mkdir(parents=True)
    os.chmod(run, 0o700)  # root's, mode 0700: not nobody's
    assert proto.dir_path(65534) == str(base / "monstack-65534")
    os.chown(run, 65534, 65534)
    assert proto.dir_path(65534) == str(run / "monstack")


def test_a_squatted_tmp_directory_does_not_block_a_user_with_a_runtime_directory(base):
    """Another user made /tmp/monstack-<uid> first: the runtime directory is used instead."""
    need_root()
    os.mkdir(base / "monstack-65534", 0o700)
    os.chown(base / "monstack-65534", 12345, 12345)  # the squatter's
    with pytest.raises(proto.Refused, match="owner 12345"):
        proto.open_private_dir(65534, create=True, gid=65534)
    run = base / "run-user" / "65534"
    run.mkdir(parents=True)
    os.chmod(run, 0o700)
    os.chown(run, 65534, 65534)
    fd = proto.open_private_dir(65534, create=True, gid=65534)  # root for the target user
    try:
        st = os.fstat(fd)
        assert st.st_uid == 65534 and stat.S_IMODE(st.st_mode) == 0o700
        assert os.path.samestat(st, os.stat(run / "monstack"))
    finally:
        os.close(fd)


# -- the armed marker ---------------------------------------------------------------------------


def _stat_fields(comm: str, start: int) -> bytes:
    after = ["S"] + [str(n) for n in range(4, 22)] + [str(start)] + ["0"] * 30  # fields 3..52
    return f"4321 ({comm}) {' '.join(after)}\n".encode()


@pytest.mark.parametrize("comm", ["python3", "a) 1 2 (b", ") )", "x y z"])
def test_start_time_is_field_22_counted_after_the_last_parenthesis(comm):
    assert proto._parse_start_time(_stat_fields(comm, 987654)) == 987654
    assert proto._parse_start_time(b"4321 (no closing paren S 1 2") is None
    assert proto._parse_start_time(b"4321 (short) S 1 2") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/PID/stat")
def test_start_time_of_a_process_whose_name_looks_like_fields():
    code = "open('/proc/self/comm', 'w').write(') 1 2 3 (x'); print('ready', flush=True); input()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        with open(f"/proc/{child.pid}/comm") as f:
            assert f.read().strip() == ") 1 2 3 (x"
        mine, theirs = proto.start_time(os.getpid()), proto.start_time(child.pid)
        with open("/proc/uptime") as f:
            now = float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK")
        assert mine is not None and theirs is not None
        assert mine <= theirs <= now + 1  # started after this process, before now
    finally:
        child.stdin.close()
        child.wait()
        child.stdout.close()
    assert proto.start_time(child.pid) is None  # ended (reaped)


def _marker_path(pid: int) -> str:
    return os.path.join(proto.dir_path(os.geteuid()), proto.armed_name(pid, proto.start_time(pid)))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/PID/stat")
def test_arm_writes_a_private_marker_that_read_armed_and_disarm_find(base):
    uid, pid = os.geteuid(), os.getpid()
    [armed] = proto.arm(signal.SIGUSR1)  # makes the directory when missing (no runtime dir: one place)
    path = _marker_path(pid)
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == uid
    start = proto.start_time(pid)
    fd = proto.open_private_dir(uid)
    try:
        assert proto.read_armed(fd, pid, start, uid) == signal.SIGUSR1
        assert proto.read_armed(fd, pid, start + 1, uid) is None  # another process on that pid
        assert proto.read_armed(fd, pid, start, uid + 1) is None  # not the target user's
        assert proto.disarm((pid + 1,) + armed[1:]) is False  # a forked child: not its marker
        assert os.path.exists(path)
        assert proto.disarm(armed) is True
        assert proto.read_armed(fd, pid, start, uid) is None
        assert proto.disarm(armed) is False
        [again] = proto.arm(signal.SIGUSR2)
        os.unlink(path)
        proto.write_new(fd, os.path.basename(path), b"monstack-armed 1 12\n")  # not the file it wrote
        assert proto.disarm(again) is False
        assert proto.read_armed(fd, pid, start, uid) == 12
    finally:
        os.close(fd)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/PID/stat")
def test_with_a_runtime_directory_the_marker_is_in_both_places(base):
    """The runtime directory goes away with the user's last session: the marker in /tmp
    still says the process is armed; find_armed looks in both."""
    uid, pid = os.geteuid(), os.getpid()
    start = proto.start_time(pid)
    run = base / "run-user" / str(uid)
    run.mkdir(parents=True)
    os.chmod(run, 0o700)
    armed = proto.arm(signal.SIGUSR1)
    name = proto.armed_name(pid, start)
    assert len(armed) == 2
    assert os.path.exists(run / "monstack" / name) and os.path.exists(base / f"monstack-{uid}" / name)
    assert proto.find_armed(pid, start, uid) == signal.SIGUSR1
    assert proto.find_armed(pid, start + 1, uid) is None
    os.unlink(run / "monstack" / name)
    os.rmdir(run / "monstack")
    os.rmdir(run)  # logged out
    assert proto.find_armed(pid, start, uid) == signal.SIGUSR1
    assert [proto.disarm(a) for a in armed] == [False, True]
    assert proto.find_armed(pid, start, uid) is None
    os.chmod(base / f"monstack-{uid}", 0o755)  # squatted /tmp: the runtime directory alone
    run.mkdir()
    os.chmod(run, 0o700)
    armed = proto.arm(signal.SIGUSR2)
    assert len(armed) == 1 and proto.find_armed(pid, start, uid) == signal.SIGUSR2
    assert proto.disarm(armed[0]) is True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/PID/stat")
def test_read_armed_refuses_what_is_not_a_small_regular_file_of_the_user(base, tmp_path):
    uid, pid = os.geteuid(), os.getpid()
    start = proto.start_time(pid)
    name = proto.armed_name(pid, start)
    fd = proto.open_private_dir(uid, create=True)
    try:
        def check(expected):
            assert proto.read_armed(fd, pid, start, uid) == expected
            os.unlink(name, dir_fd=fd)

        (tmp_path / "elsewhere").write_text("monstack-armed 1 10\n")
        os.symlink(tmp_path / "elsewhere", name, dir_fd=fd)
        check(None)
        os.mkfifo(name, 0o600, dir_fd=fd)
        check(None)
        proto.write_new(fd, name, b"monstack-armed 1 10\n")
        os.link(name, "second", src_dir_fd=fd, dst_dir_fd=fd)
        check(None)
        os.unlink("second", dir_fd=fd)
        for junk in (b"monstack-armed 1 10" + b" " * 100, b"monstack-armed 2 10", b"monstack-armed 1 -3",
                     b"monstack-armed 1 999", b"monstack-dump 1 10", b""):
            proto.write_new(fd, name, junk)
            check(None)
        proto.write_new(fd, name, b"monstack-armed 1 10\n")
        check(10)
        if uid == 0:
            proto.write_new(fd, name, b"monstack-armed 1 10\n", uid=65534)
            check(None)
    finally:
        os.close(fd)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/PID/stat")
def test_clean_stale_removes_markers_of_ended_processes_and_reused_pids(base):
    pid = os.getpid()
    start = proto.start_time(pid)
    fd = proto.open_private_dir(os.geteuid(), create=True)
    try:
        for name in (proto.armed_name(pid, start), proto.armed_name(pid, start + 1),
                     proto.armed_name(999999999, 5), "armed-junk"):
            proto.write_new(fd, name, b"monstack-armed 1 10\n")
        proto.clean_stale(fd)
        assert sorted(os.listdir(fd)) == sorted([proto.armed_name(pid, start), "armed-junk"])
    finally:
        os.close(fd)


# -- what the caller reads and removes ---------------------------------------------------------


def test_read_output_refuses_an_answer_over_the_cap_without_reading_it(base):
    pid = 4247
    uid = os.geteuid()
    fd = proto.open_private_dir(uid, create=True)
    try:
        proto.write_new(fd, proto.output_name(pid, "ab01"), b"x" * 1000)
        assert proto.read_output(fd, pid, "ab01", uid, limit=1000) == "x" * 1000  # at the cap: fine
        proto.write_new(fd, proto.output_name(pid, "ab02"), b"x" * 1001)
        with pytest.raises(proto.Refused, match="larger than 1000 bytes"):
            proto.read_output(fd, pid, "ab02", uid, limit=1000)
        assert os.listdir(fd) == []  # deleted, unread
        proto.write_new(fd, proto.output_name(pid, "ab03"), b"")
        sparse = os.open(proto.output_name(pid, "ab03"), os.O_WRONLY, dir_fd=fd)
        os.ftruncate(sparse, 300 << 20)  # 300 MB, no disk
        os.close(sparse)
        with pytest.raises(proto.Refused, match="larger than"):
            proto.read_output(fd, pid, "ab03", uid)  # the default cap
        assert proto.MAX_OUTPUT == 16 << 20
        assert os.listdir(fd) == []
    finally:
        os.close(fd)


def test_remove_script_cleans_up_after_a_failed_remote_exec(base):
    pid = 4248
    uid = os.geteuid()
    fd = proto.open_private_dir(uid, create=True)
    try:
        for tok in ("ab01", "cd02"):
            _request(fd, pid, tok)
            proto.write_new(fd, proto.script_name(pid, tok), b"# script")
        proto.write_new(fd, f"dump-{pid}-ab01.withdrawn", b"")  # a withdrawal cut short
        proto.withdraw(fd, pid, "ab01", uid, -1)  # (the rename fails: nothing is lost)
        proto.remove_script(fd, pid, "ab01", uid)
        assert sorted(os.listdir(fd)) == sorted([proto.request_name(pid, "cd02"), proto.script_name(pid, "cd02")])
        proto.withdraw(fd, pid, "cd02", uid, -1)
        proto.remove_script(fd, pid, "cd02", uid)
        assert os.listdir(fd) == []
        proto.remove_script(fd, pid, "../x", uid)  # not a token: nothing
    finally:
        os.close(fd)


def _controls(text: str) -> list[str]:
    """C0 (but the line breaks), DEL and C1 characters in ``text``."""
    return [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) < 0xA0]


def test_escape_controls_escapes_c0_del_c1_and_keeps_other_text():
    assert proto.escape_controls("plain é 日本 \u2028") == "plain é 日本 \u2028"
    assert proto.escape_controls("a\x1b]0;t\x07\nb\t\r\x00\x7f\x9b") == "a\\x1b]0;t\\x07\\nb\\t\\r\\x00\\x7f\\x9b"


def test_plain_report_escapes_control_characters():
    import linecache
    import threading

    filename = "/nowhere/evil\x1b]0;title\x07.py"
    source = "def park(started, event):\n    started.set()  # \x1b[2J\x9b\n    event.wait()  # \x1b[2J\x9b\n"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict = {}
    exec(compile(source, filename, "exec"), namespace)
    started, event = threading.Event(), threading.Event()
    t = threading.Thread(target=namespace["park"], args=(started, event), name="name\x1b[31m\n\x7f")
    t.start()
    try:
        started.wait()
        text = proto.plain_report("note\x1b[2J")
    finally:
        event.set()
        t.join()
        linecache.cache.pop(filename, None)
    assert _controls(text) == []
    assert "evil\\x1b]0;title\\x07.py" in text and "# \\x1b[2J\\x9b" in text and "note\\x1b[2J" in text
    assert "name\\x1b[31m\\n\\x7f" in text


def test_a_crowded_directory_is_read_only_so_far(tmp_path, monkeypatch):
    """The private directory's user may fill it: claim() and clean_stale() look at
    MAX_ENTRIES names at most."""
    for i in range(50):
        (tmp_path / f"junk-{i}").write_text("")
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        monkeypatch.setattr(proto, "MAX_ENTRIES", 10)
        assert len(proto._names(fd)) == 10
        assert len(proto._names(fd)) == 10  # (the directory's position is rewound)
        monkeypatch.setattr(proto, "MAX_ENTRIES", 1000)
        assert len(proto._names(fd)) == 50
    finally:
        os.close(fd)
