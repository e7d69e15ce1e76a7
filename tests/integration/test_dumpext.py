"""Stacks and asyncio tasks of another process read from outside (``monstack._dumpext``,
CPython 3.14+'s ``_remote_debugging``), against real processes whose main thread is
blocked (the process ``sys.remote_exec`` cannot reach): in-process and as
``python -I -S -c SOURCE PID``, wrong versions, non-Python processes, permissions, and
hostile names and files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from monstack import _dumpext

pytestmark = [
    pytest.mark.integration,  # real processes: once per CPython, not once per configuration
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the targets' threads are read from /proc"),
]

HERE = Path(__file__).resolve().parents[1]
PROGRAMS = HERE / "programs"
REPO = HERE.parent
CI = os.environ.get("CI") == "true"
NOBODY = 65534
HAS_READER = sys.version_info >= (3, 14)
VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"
reader = pytest.mark.skipif(
    not HAS_READER, reason="reading a process from outside needs CPython 3.14+ (the _remote_debugging module)"
)
SOURCE = Path(_dumpext.__file__).read_text(encoding="utf-8")

WORKER_LINE = "event.wait()  # the worker's waiting line"
MAIN_LINES = {
    "sleep": "time.sleep(3600)  # main: sleeping",
    "lock": "lock.acquire()  # main: waiting for a lock",
    "join": "thread.join()  # main: joining",
}


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
    """Processes started for a test; each prints "ready" once its hang is built."""

    def __init__(self, tmp_path: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        self.tmp_path = tmp_path

    def start(self, *argv: str, python: str = sys.executable, uid: "int | None" = None, **env: str) -> subprocess.Popen:
        err = open(self.tmp_path / f"target-{len(self.procs)}.err", "w+b")
        proc = subprocess.Popen(
            [python, *argv], stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=_env(**env),
            preexec_fn=_user(uid) if uid is not None else None, cwd="/",
        )
        proc.err_file = err  # type: ignore[attr-defined]
        self.procs.append(proc)
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line == b"ready\n", (line, self.stderr(proc))
        return proc

    def script(self, name: str, text: str) -> str:
        path = self.tmp_path / name
        path.write_text(textwrap.dedent(text), encoding="utf-8")
        return str(path)

    @staticmethod
    def stderr(proc: subprocess.Popen) -> str:
        proc.err_file.seek(0)  # type: ignore[attr-defined]
        return proc.err_file.read().decode("utf-8", "replace")  # type: ignore[attr-defined]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()  # type: ignore[union-attr]
            proc.err_file.close()  # type: ignore[attr-defined]


@pytest.fixture
def targets(tmp_path):
    t = Targets(tmp_path)
    yield t
    t.close()


def _cannot(reason: str) -> None:
    if CI:
        pytest.fail(reason + ": CI requires it", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def ptrace_permitted():
    """Skips (outside CI) or fails (CI) when this process may not attach to its children."""
    if not HAS_READER:
        pytest.skip("reading a process from outside needs CPython 3.14+")
    import _remote_debugging  # type: ignore[import-not-found]

    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", "print('ready', flush=True); input()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_env())
    try:
        assert proc.stdout.readline() == b"ready\n"  # type: ignore[union-attr]
        _remote_debugging.RemoteUnwinder(proc.pid).get_stack_trace()
    except PermissionError as exc:
        _cannot(f"not permitted to attach to a child process (ptrace): {exc}")
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()  # type: ignore[union-attr]
        proc.stdout.close()  # type: ignore[union-attr]


def read_until(pid: int, *needles: str, timeout: float = 15.0) -> str:
    """The report, read again until it shows every needle (the target's threads reach
    their waits a little after its "ready" line), or the last one read."""
    deadline = time.monotonic() + timeout
    while True:
        text = _dumpext.report(pid)
        if all(n in text for n in needles) or time.monotonic() > deadline:
            return text
        time.sleep(0.02)


def run_source(pid: int, *extra: str, python: str = sys.executable, uid: "int | None" = None) -> subprocess.CompletedProcess:
    """``python -I -S -c SOURCE PID``, as the dump command runs it in another interpreter."""
    return subprocess.run(
        [python, "-I", "-S", "-c", SOURCE, str(pid), *extra], capture_output=True, env=_env(), cwd="/",
        preexec_fn=_user(uid) if uid is not None else None, timeout=60, stdin=subprocess.DEVNULL,
    )


def one_line_error(done: subprocess.CompletedProcess, *fragments: str) -> str:
    err = done.stderr.decode("utf-8", "replace")
    assert done.returncode == 2, (done.returncode, done.stdout, err)
    assert done.stdout == b""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ExternalError: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def stacks(text: str) -> list[str]:
    """The report's lines past its header, without the threads' states (which a thread
    just reaching its wait may change between two reads)."""
    import re

    return [re.sub(r", (sleeping|running)\)", ")", line) for line in text.splitlines()[2:]]


def section(text: str, heading_start: str) -> str:
    """The part of the report from the heading starting with ``heading_start`` to the next
    blank line."""
    start = text.index("\n" + heading_start) + 1
    end = text.find("\n\n", start)
    return text[start:] if end < 0 else text[start:end + 1]


# -- a blocked main thread -------------------------------------------------------------------


@reader
@pytest.mark.parametrize("mode", ["sleep", "lock", "join"])
def test_a_blocked_main_thread_and_a_worker(targets, ptrace_permitted, mode):
    target = targets.start(str(PROGRAMS / "dump_target.py"), mode, MONSTACK="1")
    text = read_until(target.pid, MAIN_LINES[mode], WORKER_LINE, f"Main thread (native id {target.pid}, sleeping)")
    started = time.monotonic()
    again = _dumpext.report(target.pid)
    assert time.monotonic() - started < 5
    assert stacks(again) == stacks(text)  # nothing moved: the same stacks
    first = text.splitlines()[0]
    assert first.startswith(f"monstack dump: process {target.pid}, CPython {VERSION}, read from outside")
    assert first.endswith(", 2 threads")
    assert "Origins" in text.splitlines()[1] and "not available" in text.splitlines()[1]
    main = section(text, "Main thread")
    assert main.startswith(f"Main thread (native id {target.pid}, sleeping):\nStack (most recent call last):\n")
    assert f'File "{PROGRAMS / "dump_target.py"}", line 46, in <module>' in main
    assert MAIN_LINES[mode] in main  # the line it is blocked at, read from the file
    assert main.rstrip("\n").count("\n  File ") >= 2
    worker = section(text, 'Thread "stuck-worker"')
    assert ", in worker\n    " + WORKER_LINE in worker
    assert worker.rstrip().endswith("waiter.acquire()")  # most recent call last
    assert "/monstack/" not in text  # monstack's own wrappers are left out, as in the usual report
    assert "Work created at (most recent call last)" not in text
    assert target.poll() is None and targets.stderr(target) == ""


@reader
def test_a_main_thread_blocked_in_select(targets, ptrace_permitted):
    path = targets.script("in_select.py", """\
        import os, select, threading

        def worker(lock):
            lock.acquire()  # worker: waiting

        lock = threading.Lock()
        lock.acquire()
        threading.Thread(target=worker, args=(lock,), name="locked-out", daemon=True).start()
        r, w = os.pipe()
        print("ready", flush=True)
        select.select([r], [], [])  # main: selecting
        """)
    target = targets.start(path, MONSTACK="1")
    text = read_until(target.pid, "# main: selecting", "# worker: waiting")
    assert "select.select([r], [], [])  # main: selecting" in section(text, "Main thread")
    assert "lock.acquire()  # worker: waiting" in section(text, 'Thread "locked-out"')


@reader
def test_the_source_runs_as_python_I_S_c(targets, ptrace_permitted):
    """What the dump command does for a target of another version: the module's source,
    alone, in an isolated interpreter without site."""
    target = targets.start(str(PROGRAMS / "dump_target.py"), "lock", MONSTACK="1")
    read_until(target.pid, MAIN_LINES["lock"], WORKER_LINE)
    done = run_source(target.pid)
    assert done.returncode == 0, done.stderr
    assert done.stderr == b""
    out = done.stdout.decode("utf-8")
    assert out.startswith(f"monstack dump: process {target.pid}, CPython {VERSION}, read from outside")
    assert MAIN_LINES["lock"] in out and WORKER_LINE in out and '"stuck-worker"' in out
    colored = run_source(target.pid, "--color")
    assert colored.returncode == 0 and b"\x1b[1mMain thread" in colored.stdout
    assert MAIN_LINES["lock"].encode() in colored.stdout


# -- asyncio ---------------------------------------------------------------------------------


ASYNC_TARGET = """\
    import asyncio, threading

    def worker(event):
        event.wait()  # worker: waiting

    async def leaf():
        await asyncio.Event().wait()  # leaf: waiting

    async def parent(child):
        await child  # parent: awaiting its child

    async def main():
        threading.Thread(target=worker, args=(threading.Event(),), name="plain-worker", daemon=True).start()
        child = asyncio.create_task(leaf(), name="leaf-task")
        other = asyncio.create_task(parent(child), name="parent-task")
        odd = asyncio.create_task(leaf(), name="bell\\x07 esc\\x1b[2J del\\x7f")
        asyncio.create_task(leaf(), name="c1\\x85 naïve ✓ 😀")
        await asyncio.sleep(0)
        print("ready", flush=True)
        await asyncio.gather(other, odd)  # main: gathering

    asyncio.run(main())
    """


@reader
def test_asyncio_tasks_with_their_await_chains(targets, ptrace_permitted):
    target = targets.start(targets.script("tasks.py", ASYNC_TARGET), MONSTACK="1")
    # (read until the main thread waits in the loop's select: a thread read while it runs can
    # come out torn, and right after "ready" it still runs)
    text = read_until(target.pid, "# worker: waiting", "# main: gathering", "leaf-task", "parent-task",
                      "asyncio.run(main())", "select")
    assert "asyncio.run(main())" in section(text, "Main thread")  # the loop's own thread: the main one
    tasks = text[text.index("\nAsyncio tasks of the main thread"):]
    assert f"Asyncio tasks of the main thread (native id {target.pid}), 5 tasks:" in tasks
    leaf = section(tasks, 'Task "leaf-task"')
    assert leaf.startswith('Task "leaf-task" (id 0x') and "pending" in leaf.splitlines()[0]
    assert "await asyncio.Event().wait()  # leaf: waiting" in leaf
    assert 'awaited by task "parent-task"' in leaf
    parent = section(tasks, 'Task "parent-task"')
    assert "await child  # parent: awaiting its child" in parent
    assert 'awaiting task "leaf-task"' in parent
    assert "await asyncio.gather(other, odd)  # main: gathering" in section(tasks, 'Task "Task-1"')
    # control characters in a task name are escaped; other non-ASCII text is kept
    assert 'Task "bell\\x07 esc\\x1b[2J del\\x7f" (id 0x' in tasks
    for raw in ("\x07", "\x1b", "\x85", "\x7f", "\x00"):
        assert raw not in text
    if sys.version_info >= (3, 15):
        assert 'Task "c1\\x85 naïve ✓ 😀" (id 0x' in tasks
    else:  # 3.14's reader reads such a name as NULs: escaped, and the report says why
        assert "CPython 3.14's reader misreads some names that are not ASCII" in text


@reader
def test_a_loop_in_another_thread(targets, ptrace_permitted):
    """tests/programs/hang_asyncio.py: the loop runs in a thread, the main thread waits.
    3.15's reader lists that thread's tasks; 3.14's lists the main thread's only
    (gh-149230), and the report says so."""
    target = targets.start(str(PROGRAMS / "hang_asyncio.py"), "wait", MONSTACK="1",
                           PYTHONPATH=os.pathsep.join([str(PROGRAMS), str(REPO)]))
    text = read_until(target.pid, "# MAIN-WAITS", "EpollSelector.select", "forever")
    assert "threading.Event().wait()  # MAIN-WAITS" in section(text, "Main thread")
    loop = section(text, 'Thread "event-loop"')
    assert "asyncio.run(supervisor())" in loop and "in BaseEventLoop.run_forever" in loop
    if sys.version_info >= (3, 15):
        assert 'Asyncio tasks of thread "event-loop" (native id ' in text
        forever = section(text, 'Task "forever"')
        assert "await asyncio.Event().wait()  # WAITS-TASK" in forever
        assert 'awaiting task "forever"' in section(text, 'Task "Task-1"')
        assert "await task  # WAITS-SUPERVISOR" in section(text, 'Task "Task-1"')
    else:
        assert "Asyncio tasks of" not in text
        assert "(An event loop runs in thread \"event-loop\"" in text
        assert "lists the asyncio tasks of the main thread only" in text


# -- what cannot be read ------------------------------------------------------------------------


def _other_python(versions: "tuple[str, ...]") -> "tuple[str, str] | None":
    for version in versions:
        if version == VERSION:
            continue
        for name in (f"/usr/local/bin/python{version}", shutil.which(f"python{version}")):
            if not name or not os.path.exists(name):
                continue
            out = subprocess.run([name, "-I", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True, env=_env())
            if out.returncode == 0 and out.stdout.strip() == version:
                return name, version
    return None


PLAIN_TARGET = "import time; print('ready', flush=True); time.sleep(3600)"


@reader
def test_a_target_of_another_version_names_the_interpreter_to_run(targets, ptrace_permitted):
    found = _other_python(("3.14", "3.15", "3.16"))
    if found is None:
        pytest.skip("no other CPython 3.14+ here")
    python, version = found
    target = targets.start("-I", "-c", PLAIN_TARGET, python=python)
    with pytest.raises(_dumpext.ExternalError) as info:
        _dumpext.report(target.pid)
    assert str(info.value) == (
        f"process {target.pid} runs Python {version}, this is {VERSION}: run python{version} -m monstack dump {target.pid}"
    )
    one_line_error(run_source(target.pid), f"runs Python {version}, this is {VERSION}")


@reader
def test_a_target_before_3_14(targets, ptrace_permitted):
    found = _other_python(("3.13", "3.12", "3.11"))
    if found is None:
        pytest.skip("no CPython 3.11-3.13 here")
    python, version = found
    target = targets.start("-I", "-c", PLAIN_TARGET, python=python)
    with pytest.raises(_dumpext.ExternalError, match=rf"runs Python {version}: reading stacks from outside needs CPython 3.14\+"):
        _dumpext.report(target.pid)


@reader
def test_not_a_python_process(ptrace_permitted):
    proc = subprocess.Popen(["sh", "-c", "echo ready; exec sleep 3600"], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"ready\n"  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{proc.pid}/exe").endswith("sh") and time.monotonic() < deadline:
            time.sleep(0.01)  # until the exec
        with pytest.raises(_dumpext.ExternalError) as info:
            _dumpext.report(proc.pid)
        assert str(info.value) == f"process {proc.pid} is not a Python process (no Python runtime found in it)"
        one_line_error(run_source(proc.pid), "is not a Python process")
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]


@reader
def test_no_such_process():
    with open("/proc/sys/kernel/pid_max") as f:
        pid = int(f.read()) + 1
    with pytest.raises(_dumpext.ExternalError, match=f"^no such process: {pid}$"):
        _dumpext.report(pid)
    one_line_error(run_source(pid), f"no such process: {pid}")
    one_line_error(run_source(0), "is not a process id")


@pytest.mark.skipif(HAS_READER, reason="3.14+ has the reader")
def test_before_3_14_the_reader_is_missing():
    with pytest.raises(_dumpext.ExternalError, match=f"this Python {VERSION} has no _remote_debugging module"):
        _dumpext.report(os.getpid())


def _need_root() -> None:
    if os.geteuid() != 0:
        _cannot("running processes as another user needs root")


def _python_for(uid: int) -> str:
    """This interpreter, if ``uid`` can run it (pyenv's live under /root, mode 700)."""
    done = subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], preexec_fn=_user(uid), cwd="/",
                          capture_output=True, env=_env())
    if done.returncode != 0:
        _cannot(f"uid {uid} cannot run {sys.executable}")
    return sys.executable


@reader
def test_permissions_across_users(targets, ptrace_permitted):
    """nobody may not read root's process, and is told whom to run as; nobody reads
    nobody's; root reads nobody's."""
    _need_root()
    python = _python_for(NOBODY)
    program = ("import threading, time\n"
               "threading.Thread(target=time.sleep, args=(3600,), name='nap', daemon=True).start()\n"
               "print('ready', flush=True)\n"
               "threading.Lock().acquire(); threading.Event().wait()\n")
    mine = targets.start("-I", "-c", program, python=python)
    refused = run_source(mine.pid, uid=NOBODY, python=python)
    one_line_error(refused, f"not permitted to attach to process {mine.pid} (ptrace): run as its user (root, uid 0) or root",
                   "ptrace_scope")
    theirs = targets.start("-I", "-c", program, python=python, uid=NOBODY)
    done = run_source(theirs.pid, uid=NOBODY, python=python)
    assert done.returncode == 0, done.stderr
    out = done.stdout.decode()
    assert f"Main thread (native id {theirs.pid}" in out and 'Thread "nap"' in out and "in <module>" in out
    assert 'Thread "nap"' in read_until(theirs.pid, 'Thread "nap"')


@reader
def test_root_reads_another_users_sources_only_as_that_user_could(targets, ptrace_permitted):
    """The file names come from the target: a nobody process whose frame claims a file only
    root can read gets no source line from root's reader; a file nobody can read does."""
    _need_root()
    python = _python_for(NOBODY)
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="monstack-src-", dir="/opt"))
    try:
        os.chmod(base, 0o755)
        lines = "import time\nprint('ready', flush=True)\ntime.sleep(3600)  # LINE-3 of {}\n"
        secret = base / "secret.py"
        secret.write_text(lines.format("SECRET"))
        os.chmod(secret, 0o600)  # root's alone
        public = base / "public.py"
        public.write_text(lines.format("PUBLIC"))
        os.chmod(public, 0o644)
        program = "import sys; exec(compile(open(sys.argv[1]).read(), sys.argv[2], 'exec'))"
        # the code is handed over on the command line's file that nobody can read: a copy
        readable = base / "code.py"
        readable.write_text(lines.format("CODE"))
        os.chmod(readable, 0o644)
        claims_secret = targets.start("-I", "-c", program, str(readable), str(secret), python=python, uid=NOBODY)
        claims_public = targets.start("-I", "-c", program, str(readable), str(public), python=python, uid=NOBODY)
        out = read_until(claims_public.pid, "LINE-3 of PUBLIC")
        assert "time.sleep(3600)  # LINE-3 of PUBLIC" in out
        out = read_until(claims_secret.pid, f'File "{secret}", line 3')
        assert f'File "{secret}", line 3' in out and "SECRET" not in out.replace(str(secret), "")
        assert secret.read_text().count("SECRET") == 1  # (what would have leaked)
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


STOPPER = """\
import os, signal, sys, time
parent, spare = int(sys.argv[1]), {int(a) for a in sys.argv[2:]} | {os.getpid()}
print("ready", flush=True)
while True:  # SIGSTOP every child of the reading process but the spared ones (as nobody: ours only)
    try:
        tids = os.listdir(f"/proc/{parent}/task")
    except OSError:
        break
    for tid in tids:
        try:
            with open(f"/proc/{parent}/task/{tid}/children") as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            continue
        for pid in pids:
            if pid not in spare:
                try:
                    os.kill(pid, signal.SIGSTOP)
                except OSError:
                    pass
    time.sleep(0.0002)
"""


def _children() -> "dict[int, str]":
    """This process's children: pid -> state letter (Z: a zombie)."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            for pid in map(int, f.read().split()):
                with open(f"/proc/{pid}/stat", "rb") as st:
                    found[pid] = st.read().rsplit(b")", 1)[1].split()[0].decode()
    return found


@reader
def test_a_stopped_source_reader_is_killed_in_time(targets, ptrace_permitted):
    """Root reads a nobody process's source files in children running as nobody, whom
    nobody may stop (SIGSTOP): the report still comes, within the sources' time budget,
    without that file's lines, and the stopped child is killed and reaped."""
    import signal
    import tempfile

    _need_root()
    python = _python_for(NOBODY)
    before = set(_children())  # (other tests' children, which this one leaves alone)
    base = Path(tempfile.mkdtemp(prefix="monstack-src-", dir="/opt"))
    try:
        os.chmod(base, 0o755)
        big = base / "big.py"  # a few MB, so that the reading child lives long enough to be caught
        big.write_text("import time\nprint('ready', flush=True)\ntime.sleep(3600)  # STOPPED-LINE\n"
                       + "# padding padding padding padding padding padding padding padding\n" * 50_000)
        os.chmod(big, 0o644)
        target = targets.start("-I", str(big), python=python, uid=NOBODY)
        assert "time.sleep(3600)  # STOPPED-LINE" in read_until(target.pid, "STOPPED-LINE")
        stopper = targets.start("-I", "-S", "-c", STOPPER, str(os.getpid()), str(target.pid),
                                *map(str, before), python=python, uid=NOBODY)
        spared = {target.pid, stopper.pid} | before

        def rescue(signum, frame):  # without a deadline the report would wait forever
            for pid in _children():
                if pid not in spared:
                    os.kill(pid, signal.SIGKILL)

        previous = signal.signal(signal.SIGALRM, rescue)
        signal.setitimer(signal.ITIMER_REAL, 15)
        try:
            for _ in range(20):  # until the stopper catches a reading child
                started = time.monotonic()
                text = _dumpext.report(target.pid)
                took = time.monotonic() - started
                if "STOPPED-LINE" not in text:
                    break
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            stopper.kill()
            stopper.wait()
        assert took < 6, took  # a stopped child is killed after 2 s (SOURCE_FILE_SECONDS)
        assert "STOPPED-LINE" not in text, "the stopper never caught a reading child"
        assert f'File "{big}", line 3, in <module>\n' in text
        assert "(No source lines for 1 file(s): reading them as the process's user (uid 65534) took longer" in text
        left = {pid: state for pid, state in _children().items() if pid not in before}
        assert set(left) == {target.pid} and "Z" not in left.values(), left  # no zombie, none left
        assert target.poll() is None
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- hostile targets ---------------------------------------------------------------------------


@reader
def test_hostile_names_files_and_depth(targets, ptrace_permitted, tmp_path):
    """Control characters in thread, function and file names are escaped; a frame naming a
    FIFO or a device is shown without a source line and never blocks the reader; a deep
    recursion is collapsed and the report stays small."""
    fifo = tmp_path / "pipe.py"
    os.mkfifo(fifo)
    path = targets.script("hostile.py", f"""\
        import sys, threading
        sys.setrecursionlimit(100_000)
        stop = threading.Event()

        def deep(n):
            if n:
                return deep(n - 1)
            ready.set()
            stop.wait()  # deep: waiting

        ready = threading.Event()
        threading.Thread(target=deep, args=(600,), name="deep", daemon=True).start()
        ready.wait()
        code = compile("def f():\\n    stop.wait()\\n", {str(fifo)!r}, "exec")
        exec(code)
        threading.Thread(target=f, name="fifo", daemon=True).start()
        code = compile("def g():\\n    stop.wait()\\n", "/dev/zero", "exec")
        exec(code)
        threading.Thread(target=g, name="zero", daemon=True).start()
        code = compile("def m():\\n    stop.wait()\\n", "/proc/self/status", "exec")
        exec(code)
        threading.Thread(target=m, name="procfs", daemon=True).start()
        def h():
            stop.wait()
        h.__code__ = h.__code__.replace(co_name="bad\\x1b]0;title\\x07", co_qualname="bad\\x1b]0;title\\x07",
                                        co_filename="/nowhere/\\x1b[2Jfile.py")
        threading.Thread(target=h, name="esc\\x1b[31m", daemon=True).start()
        def k():
            stop.wait()
        k.__code__ = k.__code__.replace(co_filename="/nowhere/\\u202enaïve ✓.py")
        threading.Thread(target=k, name="k", daemon=True).start()
        print("ready", flush=True)
        stop.wait()  # main: waiting
        """)
    target = targets.start(path, MONSTACK="1")
    started = time.monotonic()
    text = read_until(target.pid, "# main: waiting", "# deep: waiting", "in f\n", "in g\n", "in m\n", "bad", "in k\n")
    assert time.monotonic() - started < 10
    assert "\x1b" not in text and "\x07" not in text
    assert 'Thread "esc\\x1b[31m"' in text
    assert 'File "/nowhere/\\x1b[2Jfile.py", line 24, in bad\\x1b]0;title\\x07\n' in text
    if sys.version_info >= (3, 15):  # (3.14's reader misreads file names outside Latin-1)
        assert 'File "/nowhere/\u202enaïve ✓.py", line 29, in k\n' in text
    # no source line (the next line is the next frame): a FIFO or a device is never read
    assert f'File "{fifo}", line 2, in f\n  File "' in section(text, 'Thread "fifo"')
    assert 'File "/dev/zero", line 2, in g\n  File "' in section(text, 'Thread "zero"')
    assert 'File "/proc/self/status", line 2, in m\n  File "' in section(text, 'Thread "procfs"')
    deep = section(text, 'Thread "deep"')
    assert "  [Previous line repeated " in deep and "stop.wait()  # deep: waiting" in deep
    assert deep.count("\n  File ") <= _dumpext.MAX_FRAMES + 1
    assert len(text.encode()) < 100_000


@reader
def test_a_stack_deeper_than_the_reader_walks(targets, ptrace_permitted):
    """CPython's reader gives up on the whole read when one thread is deeper than it walks
    ("Too many stack frames"): the main thread is read alone, and the report says so."""
    path = targets.script("too_deep.py", """\
        import sys, threading
        sys.setrecursionlimit(100_000)
        stop = threading.Event()
        ready = threading.Event()

        def deep(n):
            if n:
                return deep(n - 1)
            ready.set()
            stop.wait()

        threading.Thread(target=deep, args=(20_000,), name="very-deep", daemon=True).start()
        ready.wait()
        print("ready", flush=True)
        stop.wait()  # main: waiting
        """)
    target = targets.start(path, MONSTACK="1")
    text = read_until(target.pid, "# main: waiting")
    assert "stop.wait()  # main: waiting" in section(text, "Main thread")
    assert "(the stacks of the other threads could not be read: Too many stack frames" in text
    assert 'more OS thread(s) not read: ' in text and '"very-deep"' in text
    assert ", 1 thread\n" in text.splitlines(keepends=True)[0]


@reader
def test_a_subinterpreter(targets, ptrace_permitted):
    """3.15's reader reads every interpreter; 3.14's the newest only, and the report says
    the main interpreter's threads are missing rather than calling another thread main."""
    path = targets.script("subinterp.py", """\
        import threading
        from concurrent import interpreters

        interp = interpreters.create()
        code = "import time\\ndef sub_wait():\\n    time.sleep(3600)\\nsub_wait()"
        threading.Thread(target=interp.exec, args=(code,), name="runs-sub", daemon=True).start()
        print("ready", flush=True)
        threading.Event().wait()  # main: waiting
        """)
    target = targets.start(path)
    if sys.version_info >= (3, 15):
        text = read_until(target.pid, "# main: waiting", "in sub_wait")
        assert f"Main thread (native id {target.pid}, interpreter 0, " in text
        sub = section(text, 'Thread "runs-sub" (native id ')
        assert "in Interpreter.exec" in sub  # its thread state in the main interpreter
        sub_main = [line for line in text.splitlines() if ", interpreter 1, " in line]
        assert len(sub_main) == 1 and sub_main[0].endswith("its interpreter's main thread):"), sub_main
    else:
        text = read_until(target.pid, "in sub_wait")
        assert "Main thread" not in text
        assert "its interpreter's main thread" in section(text, 'Thread "runs-sub"')
        assert "the main interpreter's are not shown" in text
        assert 'more OS thread(s) not read: "' in text and f"({target.pid})" in text


# -- bounds and escapes (no process) ----------------------------------------------------------


def test_escape_control_characters_and_keep_other_text():
    assert _dumpext.escape("a\x00b\x1b[31mc\x7fd\x85e\x9ff\tg\nh") == "a\\x00b\\x1b[31mc\\x7fd\\x85e\\x9ff\\tg\\nh"
    assert _dumpext.escape("naïve ✓ 日本 \u00a0") == "naïve ✓ 日本 \u00a0"
    assert _dumpext.escape("lone \udc80 surrogate") == "lone \\udc80 surrogate"
    assert _dumpext.escape("x" * 1000) == "x" * (_dumpext.MAX_NAME - 3) + "..."
    assert _dumpext.escape(12) == "12"


class _Frame:
    def __init__(self, filename: str, lineno: int, funcname: str) -> None:
        self.filename, self.lineno, self.funcname = filename, lineno, funcname


class _ThreadInfo:
    def __init__(self, thread_id: int, frame_info: list, status: int = 0) -> None:
        self.thread_id, self.frame_info, self.status = thread_id, frame_info, status


def test_the_report_is_bounded(monkeypatch):
    """A process with more threads and deeper stacks than the report shows: they are
    counted, frames elided, and the text stays under the size cap."""
    frames = [_Frame(f"/nowhere/m{i}.py", i + 1, f"f{i}") for i in range(50_000)]
    threads = [_Thread(1, frames, 32)] + [_Thread(1000 + i, frames[:30], 0) for i in range(_dumpext.MAX_THREADS + 50)]
    monkeypatch.setattr(_dumpext, "_read", lambda pid: _dumpext._Reading(threads))
    monkeypatch.setattr(_dumpext, "_os_threads", lambda pid: [])
    text = _dumpext.report(os.getpid())
    assert len(text.encode()) <= _dumpext.LIMIT_BYTES + 1000
    main = section(text, "Main thread")
    assert f"... {50_000 - _dumpext.MAX_FRAMES} frames omitted ..." in main
    assert main.count("\n  File ") == _dumpext.MAX_FRAMES
    assert 'File "/nowhere/m49999.py", line 50000, in f49999' in main  # the outermost
    assert 'File "/nowhere/m0.py", line 1, in f0' in main  # the innermost, last
    assert "[report cut at 1000000 bytes: " in text or "more Python thread(s) not shown" in text


def _Thread(tid: int, frames: list, status: int):  # noqa: N802 - a reader's ThreadInfo, wrapped
    return _dumpext._threads_of([_ThreadInfo(tid, frames, status)])[0]


@reader
def test_main_prints_usage_errors_as_one_line():
    one_line_error(subprocess.run([sys.executable, "-I", "-S", "-c", SOURCE], capture_output=True), "usage")
    one_line_error(subprocess.run([sys.executable, "-I", "-S", "-c", SOURCE, "x\x1by"], capture_output=True),
                   r"PID 'x\x1by' is not a process id")


def test_tasks_are_bounded(monkeypatch):
    from types import SimpleNamespace as NS

    frame = _Frame("/nowhere/t.py", 3, "coro")
    tasks = [NS(task_id=0x1000 + i, task_name=f"t{i:05d}", coroutine_stack=[NS(call_stack=[frame], task_name=0x1000 + i)],
                awaited_by=[NS(call_stack=[frame], task_name=0x1000)] * 50) for i in range(_dumpext.MAX_TASKS + 10)]
    awaited = [NS(thread_id=1, awaited_by=tasks), NS(thread_id=0, awaited_by=[])]
    monkeypatch.setattr(_dumpext, "_read", lambda pid: _dumpext._Reading([_Thread(1, [frame], 32)], awaited=awaited))
    monkeypatch.setattr(_dumpext, "_os_threads", lambda pid: [])
    text = _dumpext.report(os.getpid())
    assert f"Asyncio tasks of the main thread (native id 1), {_dumpext.MAX_TASKS + 10} tasks:" in text
    assert text.count('\nTask "t') == _dumpext.MAX_TASKS and "(10 more task(s) not shown)" in text
    first = section(text, 'Task "t00001"')
    assert first.count("awaited by task \"t00000\"") == _dumpext.MAX_AWAITERS
    assert len(text.encode()) <= _dumpext.LIMIT_BYTES + 1000
