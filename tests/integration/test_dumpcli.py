"""``python -m monstack dump PID`` against real hung processes: the signal path on every
version, the ``sys.remote_exec`` path on 3.14+, every bad input as one line and exit 1,
"not permitted" across users, and a timed-out request that leaves its target quiet."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from monstack import _dumpcli, _dumpproto

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the dump command needs Linux's /proc"),
]

PROGRAM = Path(__file__).resolve().parents[1] / "programs" / "dump_target.py"
REPO = Path(__file__).resolve().parents[2]
HAS_REMOTE = sys.version_info >= (3, 14)
CI = os.environ.get("CI") == "true"
NOBODY = 65534


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MONSTACK", "PYTHON_DISABLE_REMOTE"))}
    env.update(extra)
    return env


def _user(uid: int):
    def drop() -> None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)

    return drop


class Targets:
    def __init__(self, tmp_path: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        self.tmp_path = tmp_path

    def start(self, *args: str, python: str = sys.executable, uid: "int | None" = None, script: Path = PROGRAM,
              runner: tuple = (), **env: str) -> subprocess.Popen:
        err = open(self.tmp_path / f"target-{len(self.procs)}.err", "w+b")
        proc = subprocess.Popen(
            [python, *runner, str(script), *args], stdout=subprocess.PIPE, stderr=err, env=_env(**env),
            preexec_fn=_user(uid) if uid is not None else None, cwd="/",
        )
        proc.err_file = err  # type: ignore[attr-defined]
        self.procs.append(proc)
        line = proc.stdout.readline()
        assert line == b"ready\n", (line, self.stderr(proc))
        self.wait_waiting(proc.pid)
        return proc

    @staticmethod
    def wait_waiting(pid: int) -> None:
        """Until the main thread waits (past its "ready" line: in the mode's wait)."""
        deadline = time.monotonic() + 30
        seen = 0
        while seen < 3 and time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/task/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                return
            seen = seen + 1 if state == "S" else 0
            time.sleep(0.02)

    @staticmethod
    def stderr(proc: subprocess.Popen) -> str:
        proc.err_file.seek(0)  # type: ignore[attr-defined]
        return proc.err_file.read().decode("utf-8", "replace")  # type: ignore[attr-defined]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()
            proc.err_file.close()  # type: ignore[attr-defined]


@pytest.fixture
def targets(tmp_path):
    t = Targets(tmp_path)
    yield t
    t.close()


def dump(pid: int, *args: str, uid: "int | None" = None, python: str = sys.executable,
         **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-m", "monstack", "dump", str(pid), *args], capture_output=True, text=True,
        env=_env(**env), preexec_fn=_user(uid) if uid is not None else None, timeout=120, cwd=str(REPO),
    )


def one_line_error(out: subprocess.CompletedProcess, *fragments: str) -> str:
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m monstack dump: "), out.stderr
    assert "Traceback" not in out.stderr
    for fragment in fragments:
        assert fragment in out.stderr, (fragment, out.stderr)
    return lines[0]


def need_root() -> None:
    if os.geteuid() != 0:
        reason = "running a process as another user needs root"
        if CI:
            pytest.fail(reason + ": CI requires it", pytrace=False)
        pytest.skip(reason)


def _usable_by(python: str, uid: int) -> bool:
    try:
        out = subprocess.run(
            [python, "-c", "import monstack"], preexec_fn=_user(uid), capture_output=True, cwd="/",
            env=_env(PYTHONPATH=str(REPO)),
        )
    except OSError:
        return False
    return out.returncode == 0


def interpreter_for(uid: int) -> str:
    """An interpreter ``uid`` can run monstack with: this one, or else a system-wide one.

    pyenv's interpreters live under /root (mode 700), out of another user's reach; what these
    tests check (who may dump whom, the private directory) is the same with any version, and
    the signal path does not need caller and target versions to match."""
    candidates = [sys.executable]
    for name in ("python3.15", "python3.14", "python3.13", "python3.12", "python3.11", "python3"):
        found = shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")
        if found and found not in candidates:
            candidates.append(found)
    for python in candidates:
        if _usable_by(python, uid):
            return python
    reason = f"no interpreter here can run monstack as uid {uid} (tried {', '.join(candidates)})"
    if CI:
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


WORKER_LINES = ("event.wait()  # the worker's waiting line", "thread.start()  # the worker's creating line")
MAIN_LINES = {
    "loop": "time.sleep(0.01)  # main: looping",
    "sleep": "time.sleep(3600)  # main: sleeping",
    "lock": "lock.acquire()  # main: waiting for a lock",
    "join": "thread.join()  # main: joining",
}


# -- the signal path (every version) --------------------------------------------------------


@pytest.mark.parametrize("mode", ["loop", "sleep", "lock", "join"])
def test_signal_path_reports_every_thread_and_origin(targets, mode):
    target = targets.start(mode, MONSTACK="1", MONSTACK_DUMP_SIGNAL="USR1")
    out = dump(target.pid)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert '"stuck-worker"' in out.stdout and '"MainThread"' in out.stdout
    for line in WORKER_LINES + (MAIN_LINES[mode],):
        assert line in out.stdout, (line, out.stdout)
    assert "_dumpsig" not in out.stdout and "_dumpproto" not in out.stdout
    assert target.poll() is None  # alive, and nothing on its stderr
    assert targets.stderr(target) == ""
    again = dump(target.pid)  # answers again
    assert again.returncode == 0 and MAIN_LINES[mode] in again.stdout
    assert [n for n in os.listdir(_dumpproto.dir_path(os.geteuid())) if n.startswith(f"dump-{target.pid}-")] == []


@pytest.mark.parametrize("option", [("--dump-signal", "usr2"), ("--dump-signal=SIGUSR2",)])
def test_the_runners_dump_signal_option_is_found(targets, option):
    """``python -m monstack run --dump-signal`` sets the variable after the process started
    (not in /proc/PID/environ): the command reads the option from the command line."""
    target = targets.start("sleep", runner=("-m", "monstack", "run", *option), PYTHONPATH=str(REPO))
    out = dump(target.pid)
    assert out.returncode == 0, out.stderr
    assert MAIN_LINES["sleep"] in out.stdout and WORKER_LINES[1] in out.stdout


def test_a_plain_kill_writes_the_report_to_the_targets_stderr(targets):
    target = targets.start("sleep", MONSTACK="1", MONSTACK_DUMP_SIGNAL="SIGUSR2")
    os.kill(target.pid, signal.SIGUSR2)
    deadline = time.monotonic() + 30
    while MAIN_LINES["sleep"] not in targets.stderr(target) and time.monotonic() < deadline:
        time.sleep(0.05)
    err = targets.stderr(target)
    for line in WORKER_LINES + (MAIN_LINES["sleep"],):
        assert line in err, err
    assert target.poll() is None


def test_a_declared_signal_without_a_handler_is_never_sent(targets):
    # MONSTACK is not on: nothing installs the handler, and USR1's default action kills.
    target = targets.start("loop", MONSTACK_DUMP_SIGNAL="USR1")
    out = dump(target.pid, "--timeout", "20")
    if HAS_REMOTE:  # falls back to sys.remote_exec: plain stacks, saying why
        assert out.returncode == 0, out.stderr
        assert "monstack is not imported" in out.stdout and MAIN_LINES["loop"] in out.stdout
    else:
        one_line_error(out, "MONSTACK_DUMP_SIGNAL=USR1 but has no handler for it", "older than 3.14")
    time.sleep(0.2)
    assert target.poll() is None


def test_a_signal_that_times_out_is_withdrawn(targets, monkeypatch):
    """A process that never runs the handler in time: the CLI gives up and withdraws (on
    3.14+ it then reads the stacks from outside, which a stopped process still allows)."""
    target = targets.start("loop", MONSTACK="1", MONSTACK_DUMP_SIGNAL="USR1")
    os.kill(target.pid, signal.SIGSTOP)  # stopped: the signal stays pending
    try:
        out = dump(target.pid, "--timeout", "0.5")
        if HAS_REMOTE:
            assert out.returncode == 0, out.stderr
            assert "no answer to SIGUSR1 within 0.5 s" in out.stdout.splitlines()[0]
            assert "read from outside the process" in out.stdout.splitlines()[0]
        else:
            one_line_error(out, "timed out after 0.5 s", "SIGUSR1", "withdrawn")
    finally:
        os.kill(target.pid, signal.SIGCONT)
    time.sleep(0.5)  # the pending signal is handled now: it finds the withdrawal, says nothing
    assert target.poll() is None and targets.stderr(target) == ""
    assert [n for n in os.listdir(_dumpproto.dir_path(os.geteuid())) if n.startswith(f"dump-{target.pid}-")] == []


def test_a_signal_monstack_refuses_is_never_sent(targets):
    """Every Python process handles SIGINT: sending it would raise KeyboardInterrupt there."""
    target = targets.start("loop", MONSTACK="1", MONSTACK_DUMP_SIGNAL="INT")
    out = dump(target.pid, "--timeout", "20")
    if HAS_REMOTE:  # the remote path instead
        assert out.returncode == 0, out.stderr
        assert MAIN_LINES["loop"] in out.stdout
    else:
        one_line_error(out, "MONSTACK_DUMP_SIGNAL=INT, which monstack refuses", "older than 3.14")
    assert target.poll() is None
    assert "Traceback" not in targets.stderr(target)


OWN_HANDLER = """
import signal, sys, time
signal.signal(signal.SIGUSR1, lambda *a: sys.stderr.write("the program's own handler ran\\n"))
print("ready", flush=True)
while True:
    time.sleep(0.01)
"""


def test_a_handler_that_is_not_monstacks_is_never_sent(targets, tmp_path):
    """The variable is set but monstack is off: the program's own USR1 handler (a reload,
    say) must not run because somebody asked for a dump."""
    program = tmp_path / "own_handler.py"
    program.write_text(OWN_HANDLER)
    target = targets.start(script=program, MONSTACK_DUMP_SIGNAL="USR1")
    out = dump(target.pid, "--timeout", "20")
    if HAS_REMOTE:
        assert out.returncode == 0, out.stderr
    else:
        one_line_error(out, "its handler for it is not monstack's", "older than 3.14")
    assert target.poll() is None
    assert "own handler ran" not in targets.stderr(target)


def test_a_reused_pid_is_never_signalled(targets, monkeypatch):
    """Between reading /proc and signalling, the target may end and its pid be reused: the
    signal goes through a pidfd only after the start time is checked again."""
    target = targets.start("loop", MONSTACK="1", MONSTACK_DUMP_SIGNAL="USR1")
    read = _dumpcli._Target(target.pid)
    sent: list = []
    monkeypatch.setattr(signal, "pidfd_send_signal", lambda *a: sent.append(a), raising=False)
    monkeypatch.setattr(os, "kill", lambda *a: sent.append(a))
    real = _dumpproto.start_time
    monkeypatch.setattr(_dumpproto, "start_time", lambda pid: (real(pid) or 0) + 1)
    with pytest.raises(_dumpcli.DumpError, match="its pid now names another process"):
        _dumpcli._send(read, signal.SIGUSR1)
    assert sent == []
    monkeypatch.setattr(_dumpproto, "start_time", real)
    _dumpcli._send(read, 0)  # signal 0: the check passes, nothing is delivered
    assert len(sent) == 1


def _older_interpreter() -> "str | None":
    """A CPython before 3.14 of another version than this one (pyenv's or on PATH)."""
    import glob

    candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[123].*/bin/python3.1[123]")))
    for name in ("python3.13", "python3.12", "python3.11"):
        found = shutil.which(name)
        if found:
            candidates.append(found)
    for path in candidates:
        out = subprocess.run([path, "-c", "import sys; print(sys.version_info[:2] != %r)" % (sys.version_info[:2],)],
                             capture_output=True, text=True)
        if out.stdout.strip() == "True":
            return path
    return None


def test_a_failed_remote_exec_leaves_no_files(targets):
    older = _older_interpreter()
    if older is None:
        if CI:
            pytest.fail("no CPython before 3.14 of another version: CI requires one", pytrace=False)
        pytest.skip("no CPython before 3.14 of another version here")
    target = targets.start("loop", python=older)
    one_line_error(dump(target.pid, "--timeout", "20"), "older than 3.14")
    assert [n for n in os.listdir(_dumpproto.dir_path(os.geteuid())) if f"-{target.pid}-" in n] == []


@pytest.mark.parametrize("program", ["hang_deadlock.py", "hang_pool.py", "hang_asyncio.py", "hang_sleep.py"])
def test_signal_path_on_the_hung_programs(targets, program):
    """Every waiting line and every creating line of the hung programs (each marked with a
    ``# WAITS-...``/``# STARTS-...`` comment), from outside, main thread blocked or not."""
    import re

    path = PROGRAM.parent / program
    markers = sorted(set(re.findall(r"# [A-Z][A-Z-]+", path.read_text())))
    assert markers
    target = targets.start(
        "wait", script=path, MONSTACK="1", MONSTACK_DUMP_SIGNAL="USR1",
        PYTHONPATH=os.pathsep.join([str(PROGRAM.parent), str(REPO)]),
    )
    for _ in range(50):  # until every thread has reached its wait
        out = dump(target.pid)
        assert out.returncode == 0, out.stderr
        missing = [m for m in markers if m not in out.stdout]
        if not missing:
            break
        time.sleep(0.1)
    assert missing == [], out.stdout
    assert targets.stderr(target) == ""


# -- the remote path (3.14+) ----------------------------------------------------------------


remote = pytest.mark.skipif(not HAS_REMOTE, reason="sys.remote_exec needs CPython 3.14+")


@remote
def test_remote_path_with_monstack_on(targets):
    target = targets.start("loop", MONSTACK="1")
    out = dump(target.pid, "--timeout", "20")
    assert out.returncode == 0, out.stderr
    for line in WORKER_LINES + (MAIN_LINES["loop"],):
        assert line in out.stdout, (line, out.stdout)
    assert targets.stderr(target) == ""


@remote
def test_remote_path_without_monstack_says_so(targets):
    target = targets.start("loop")
    out = dump(target.pid, "--timeout", "20")
    assert out.returncode == 0, out.stderr
    # the layout of monstack's own report: its header, thread headings and "Stack" lines
    assert out.stdout.startswith(f"monstack dump: process {target.pid}, CPython ")
    assert "monstack not imported: stacks without origins" in out.stdout.splitlines()[0]
    assert f"monstack is not imported in process {target.pid}" in out.stdout.splitlines()[1]
    assert 'Thread "MainThread" (ident 0x' in out.stdout and "Stack (most recent call last):" in out.stdout
    assert "Traceback (most recent call last):" not in out.stdout
    assert WORKER_LINES[0] in out.stdout and MAIN_LINES["loop"] in out.stdout
    assert WORKER_LINES[1] not in out.stdout  # no origins
    assert "<string>" not in out.stdout  # the remote script's own frames are left out


@remote
def test_a_blocked_main_thread_is_read_from_outside_and_the_late_script_stays_quiet(targets):
    target = targets.start("sleep-then-loop", "4", "1", MONSTACK="1")
    out = dump(target.pid, "--timeout", "1")
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert "its main thread ran no Python for 1 s" in first and "read from outside the process" in first
    assert "Origins" in out.stdout and WORKER_LINES[0] in out.stdout  # the worker's stack, no origins
    assert "time.sleep(float(sys.argv[2]))" in out.stdout  # the blocked main thread's line
    assert WORKER_LINES[1] not in out.stdout
    assert target.stdout.readline() == b"done\n"  # the script ran meanwhile, quietly
    assert target.wait(30) == 0
    assert targets.stderr(target) == ""
    assert [n for n in os.listdir(_dumpproto.dir_path(os.geteuid())) if n.startswith(f"dump-{target.pid}-")] == []


@remote
@pytest.mark.parametrize("mode", ["sleep", "lock", "join"])
def test_a_blocked_main_thread_of_monstack_alone_is_dumped_within_seconds(targets, mode):
    """The usual hang, started with MONSTACK=1 alone (no dump signal): every thread's stack
    within a few seconds, in the report's layout."""
    target = targets.start(mode, MONSTACK="1")
    out = dump(target.pid, "--timeout", "60")
    assert out.returncode == 0, out.stderr
    # read after REMOTE_WAIT seconds, not after the 60 s the script is given
    assert f"ran no Python for {_dumpcli.REMOTE_WAIT:g} s" in out.stdout.splitlines()[0]
    assert MAIN_LINES[mode] in out.stdout and WORKER_LINES[0] in out.stdout
    assert "Stack (most recent call last):" in out.stdout
    assert target.poll() is None


@remote
def test_remote_debugging_disabled_in_the_target_or_here(targets):
    target = targets.start("loop", PYTHON_DISABLE_REMOTE_DEBUG="1")
    one_line_error(dump(target.pid), "remote debugging is disabled there")
    other = targets.start("loop")
    one_line_error(dump(other.pid, PYTHON_DISABLE_REMOTE_DEBUG="1"), "PYTHON_DISABLE_REMOTE_DEBUG is set here")


def _other_remote_interpreter() -> "str | None":
    """A CPython 3.14+ of another version than this one, on PATH."""
    for name in ("python3.14", "python3.15"):
        path = shutil.which(name)
        if path is None:
            continue
        out = subprocess.run([path, "-c", "import sys; print(sys.version_info[:2] != %r)" % (sys.version_info[:2],)],
                             capture_output=True, text=True)
        if out.stdout.strip() == "True":
            return path
    return None


def test_remote_path_runs_with_the_targets_interpreter(targets):
    other = _other_remote_interpreter()
    if other is None:
        pytest.skip("no CPython 3.14+ of another version on PATH")
    target = targets.start("loop", python=other)
    out = dump(target.pid, "--timeout", "20")
    assert out.returncode == 0, out.stderr
    assert "monstack is not imported" in out.stdout and MAIN_LINES["loop"] in out.stdout


@pytest.mark.skipif(HAS_REMOTE, reason="a target before 3.14 has no remote path")
def test_no_signal_and_no_remote_path(targets):
    target = targets.start("loop", MONSTACK="1")
    one_line_error(dump(target.pid), "no monstack dump signal", "older than 3.14", "MONSTACK_DUMP_SIGNAL=USR1")
    assert target.poll() is None


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, fragment",
    [
        ([], "no PID given"),
        (["abc"], "PID 'abc' is not a process id"),
        (["0"], "is not a process id"),
        (["--bogus"], "unknown option '--bogus'"),
        (["1", "2"], "unexpected argument '2'"),
        (["1", "--timeout"], "--timeout needs a number"),
        (["1", "--timeout", "soon"], "not a number of seconds"),
        (["1", "--timeout=0"], "must be a number of seconds > 0"),
        (["1", "--timeout", "nan"], "must be a number of seconds > 0"),
    ],
)
def test_bad_arguments(args, fragment):
    out = subprocess.run([sys.executable, "-m", "monstack", "dump", *args], capture_output=True, text=True, env=_env())
    one_line_error(out, fragment)


def test_no_such_process():
    with open("/proc/sys/kernel/pid_max") as f:
        pid = int(f.read()) + 1  # above any pid
    one_line_error(dump(pid), f"no such process: {pid}")


def test_not_a_python_process(targets, tmp_path):
    proc = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.1)
        one_line_error(dump(proc.pid, "--timeout", "2"), str(proc.pid))
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_help_lists_the_options():
    out = subprocess.run([sys.executable, "-m", "monstack", "dump", "--help"], capture_output=True, text=True, env=_env())
    assert out.returncode == 0 and "--timeout" in out.stdout
    listed = subprocess.run([sys.executable, "-m", "monstack", "--help"], capture_output=True, text=True, env=_env())
    assert "dump" in listed.stdout


# -- permissions ----------------------------------------------------------------------------


def test_a_caller_of_another_user_is_not_permitted(targets):
    need_root()
    target = targets.start("loop", MONSTACK="1", MONSTACK_DUMP_SIGNAL="USR1")
    os.setegid(NOBODY)
    os.seteuid(NOBODY)  # this process, briefly: no interpreter needs to be reachable by nobody
    try:
        with pytest.raises(_dumpcli.DumpError, match="not permitted"):
            _dumpcli.dump_process(target.pid, 5)
    finally:
        os.seteuid(0)
        os.setegid(0)
    assert target.poll() is None


def test_a_caller_of_another_user_is_not_permitted_cli(targets):
    need_root()
    python = interpreter_for(NOBODY)
    target = targets.start("loop", MONSTACK="1", MONSTACK_DUMP_SIGNAL="USR1")
    one_line_error(dump(target.pid, uid=NOBODY, python=python, PYTHONPATH=str(REPO)), "not permitted", "uid 0")
    assert target.poll() is None


def test_root_dumps_another_users_process_through_its_private_directory(targets):
    need_root()
    python = interpreter_for(NOBODY)
    # the runner, not MONSTACK=1: a system interpreter has no monstack-startup.pth
    runner = ("-m", "monstack", "run", "--dump-signal", "USR1")
    target = targets.start("sleep", python=python, uid=NOBODY, runner=runner, PYTHONPATH=str(REPO))
    out = dump(target.pid)
    assert out.returncode == 0, out.stderr
    assert MAIN_LINES["sleep"] in out.stdout and WORKER_LINES[1] in out.stdout
    st = os.lstat(_dumpproto.dir_path(NOBODY))
    assert st.st_uid == NOBODY and st.st_mode & 0o077 == 0
    # ... and a third user may not
    one_line_error(dump(target.pid, uid=NOBODY - 1, python=interpreter_for(NOBODY - 1), PYTHONPATH=str(REPO)),
                   "not permitted")


# -- a target in other namespaces (a container: its own /tmp, its own pids) --------------------


def _namespaced_target(targets: Targets, *unshare: str, mode: str = "sleep",
                       dump_signal: bool = True) -> tuple[subprocess.Popen, int]:
    """``dump_target.py`` under ``unshare`` with a private exchange directory (and a /proc of
    its own for a pid namespace); (the unshare process, the target's pid as seen from here)."""
    need_root()
    if shutil.which("unshare") is None:
        if CI:
            pytest.fail("unshare (util-linux) is missing: CI requires it", pytrace=False)
        pytest.skip("unshare (util-linux) is missing")
    # Its own exchange directory: a fresh tmpfs over the path both sides compute (hiding all
    # of /tmp would hide a checkout or venv that lives there).
    private = _dumpproto.dir_path(os.geteuid())
    os.close(_dumpproto.open_private_dir(os.geteuid(), create=True))
    mounts = f"mount -t tmpfs -o mode=0700 tmpfs {private}"
    if "--pid" in unshare:
        mounts += " && mount -t proc proc /proc"
    script = f'{mounts} && exec "$0" "$@"'
    err = open(targets.tmp_path / f"ns-target-{len(targets.procs)}.err", "w+b")
    proc = subprocess.Popen(
        ["unshare", *unshare, *(["--kill-child"] if "--fork" in unshare else []), "--mount", "--propagation", "private",
         "--", "sh", "-c", script,
         sys.executable, str(PROGRAM), mode],
        stdout=subprocess.PIPE, stderr=err, cwd="/",
        env=_env(MONSTACK="1", **({"MONSTACK_DUMP_SIGNAL": "USR1"} if dump_signal else {})),
    )
    proc.err_file = err  # type: ignore[attr-defined]
    targets.procs.append(proc)
    line = proc.stdout.readline()
    assert line == b"ready\n", (line, targets.stderr(proc))
    pid = proc.pid
    if "--fork" in unshare:  # the program is unshare's child
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            pid = int(f.read().split()[0])
    targets.wait_waiting(pid)
    return proc, pid


def test_a_target_with_its_own_tmp_is_reached_through_its_root(targets):
    proc, pid = _namespaced_target(targets)
    try:  # its marker is in its own /tmp, not in ours
        ours = os.listdir(_dumpproto.dir_path(os.geteuid()))
    except FileNotFoundError:
        ours = []
    assert not [n for n in ours if n.startswith(f"armed-{pid}-")]
    out = dump(pid, "--timeout", "30")
    assert out.returncode == 0, out.stderr
    assert MAIN_LINES["sleep"] in out.stdout and WORKER_LINES[0] in out.stdout
    assert WORKER_LINES[1] in out.stdout  # the origin: the process answered itself
    assert proc.poll() is None and targets.stderr(proc) == ""


def test_a_target_in_its_own_pid_namespace_is_reached_by_its_own_pid(targets):
    proc, pid = _namespaced_target(targets, "--pid", "--fork")
    with open(f"/proc/{pid}/status") as f:
        nspid = [line.split()[1:] for line in f if line.startswith("NSpid:")][0]
    assert len(nspid) == 2 and nspid[0] == str(pid) and nspid[1] != str(pid)  # it sees itself as another pid
    out = dump(pid, "--timeout", "30")
    assert out.returncode == 0, out.stderr
    assert MAIN_LINES["sleep"] in out.stdout and WORKER_LINES[1] in out.stdout
    assert proc.poll() is None and targets.stderr(proc) == ""


@remote
def test_the_remote_path_reaches_a_target_with_its_own_tmp(targets):
    proc, pid = _namespaced_target(targets, mode="loop", dump_signal=False)
    out = dump(pid, "--timeout", "30")
    assert out.returncode == 0, out.stderr
    assert not out.stdout.startswith("[")  # the process answered (not read from outside)
    assert MAIN_LINES["loop"] in out.stdout and WORKER_LINES[1] in out.stdout
    assert proc.poll() is None and targets.stderr(proc) == ""
