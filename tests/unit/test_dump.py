"""monstack.dump() / report() / dump_later(): the hang report, in process and on real
hung programs in subprocesses (tests/programs/hang_*.py)."""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import monstack
from monstack import _dump, _threads

from conftest import FakeStream, integration_module
from test_threads import Parked

PROGRAMS = Path(__file__).resolve().parents[1] / "programs"


@pytest.fixture(autouse=True)
def _no_watchdog_left():
    yield
    monstack.cancel_dump_later()


def line_of(path, marker: str) -> int:
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if marker in line and "line_of(" not in line:
                return n
    raise LookupError(marker)


def frame_line(path, marker: str) -> str:
    """The report's line for the frame at ``marker`` in ``path``."""
    return f'  File "{path}", line {line_of(path, marker)}, in '


def section(report: str, heading_start: str) -> str:
    """The part of ``report`` from the heading starting with ``heading_start`` to the next
    thread, loop or task heading."""
    start = report.index(heading_start)
    nxt = re.search(r'^(Thread [("]|Task "|Asyncio loop )', report[start + 1:], re.M)
    return report[start: start + 1 + nxt.start()] if nxt else report[start:]


def test_public_exports():
    for name in ("threads", "dump", "dump_later", "cancel_dump_later"):
        assert name in monstack.__all__ and hasattr(monstack, name), name
    assert monstack.dump is _dump.dump and monstack.threads is _threads.threads


def test_report_of_parked_threads():
    monstack.install()
    with Parked(count=2, depth=3, name="parked") as parked:
        text = monstack._dump.report()
    assert text.startswith(f"monstack dump: process {os.getpid()}, CPython ")
    assert "backend " in text.splitlines()[0]
    for t in parked.threads:
        part = section(text, f'Thread "{t.name}" (ident {t.ident:#x}, daemon')
        assert "Stack (most recent call last):" in part
        assert "release.wait()  # the line every parked thread waits at" in part
        assert "threading.py" in part  # library frames included, down to the wait
        assert "Work created at (most recent call last):" in part
        assert "t.start()  # STARTED" in part
    me = section(text, 'Thread "MainThread"')
    assert "writing this report" in me
    assert "monstack/_dump.py" not in text and "monstack/_threads.py" not in text


def test_not_installed_says_so_and_shows_stacks():
    with Parked(count=1) as parked:
        text = monstack._dump.report()
    assert "monstack not installed: stacks without origins" in text.splitlines()[0]
    part = section(text, f'Thread "{parked.threads[0].name}"')
    assert "release.wait()" in part and "Work created at" not in part


def pool_job(ready, release):
    ready.set()
    release.wait()  # POOL-WAITS


def test_pool_job_and_its_submit_line():
    monstack.install()
    ready, release = threading.Event(), threading.Event()
    with ThreadPoolExecutor(1, thread_name_prefix="dumppool") as pool:
        fut = pool.submit(pool_job, ready, release)  # POOL-SUBMIT
        try:
            assert ready.wait(30)
            text = monstack._dump.report()
        finally:
            release.set()
        fut.result()
    part = section(text, 'Thread "dumppool_0"')
    assert "release.wait()  # POOL-WAITS" in part
    assert "pool.submit(pool_job, ready, release)  # POOL-SUBMIT" in part


async def wait_forever(ev):
    await ev.wait()  # TASK-WAITS


def test_tasks_of_a_loop_in_another_thread():
    monstack.install()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    t = threading.Thread(target=loop.run_forever, name="dump-loop", daemon=True)
    t.start()
    try:
        holder = {}

        async def make():
            holder["ev"] = asyncio.Event()
            holder["task"] = asyncio.get_running_loop().create_task(wait_forever(holder["ev"]), name="waiter")  # TASK-CREATED
            started.set()

        asyncio.run_coroutine_threadsafe(make(), loop).result(30)
        assert started.wait(30)
        text = monstack._dump.report()
        loop.call_soon_threadsafe(holder["ev"].set)
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(30)
        loop.close()
    assert re.search(r'^Asyncio loop .* in thread "dump-loop" \(ident 0x[0-9a-f]+\), running, 1 pending task:', text, re.M)
    part = section(text, 'Task "waiter" (pending):')
    assert "Await chain (most recent call last):" in part
    assert "await ev.wait()  # TASK-WAITS" in part
    assert "locks.py" in part  # down to the line it waits at, in asyncio
    assert "awaiting <Future pending" in part
    assert "Task created at (most recent call last):" in part
    assert "# TASK-CREATED" in part


@pytest.mark.integration
def test_uvloop_tasks_in_another_thread():
    """uvloop's run_forever has no Python frame: its loop is found through its tasks
    (3.11-3.13) or the loops monstack's asyncio point saw create tasks (3.14+)."""
    uvloop = integration_module("uvloop")
    monstack.install()
    ready, done = threading.Event(), threading.Event()
    holder = {}

    async def main():
        holder["ev"] = asyncio.Event()
        holder["task"] = asyncio.create_task(wait_forever(holder["ev"]), name="uv-waiter")  # UV-CREATED
        holder["loop"] = asyncio.get_running_loop()
        await asyncio.sleep(0)
        ready.set()
        await holder["task"]

    t = threading.Thread(target=lambda: (uvloop.run(main()), done.set()), name="uv-loop", daemon=True)
    t.start()
    try:
        assert ready.wait(30)
        text = monstack._dump.report()
    finally:
        if "loop" in holder:
            holder["loop"].call_soon_threadsafe(holder["ev"].set)
        t.join(30)
    assert re.search(r"^Asyncio loop uvloop\.Loop.*, running, 2 pending tasks:", text, re.M), text
    part = section(text, 'Task "uv-waiter" (pending):')
    assert "await ev.wait()  # TASK-WAITS" in part and "# UV-CREATED" in part


def test_size_cap():
    monstack.install()
    with Parked(count=5, depth=20):
        full = monstack._dump.report(limit_bytes=None)
        cut = monstack._dump.report(limit_bytes=2000)
    assert "[report cut at" not in full
    assert len(cut.encode()) < 2000 + 300
    assert re.search(r"\[report cut at 2000 bytes: \d+ more thread\(s\) and 0 more task section\(s\) not shown\]", cut)
    assert cut.startswith("monstack dump:")


def test_never_raises(monkeypatch):
    monstack.install()

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(_dump, "_frame_records", broken)
    monkeypatch.setattr(_threads, "threads", broken)
    monkeypatch.setattr(_dump, "_loops", broken)
    text = monstack._dump.report()
    assert "could not be reported: RuntimeError('boom')" in text
    assert "(monstack: event loops could not be listed: RuntimeError('boom'))" in text
    monkeypatch.setattr(_dump, "_header", broken)
    assert "(monstack: the report failed: RuntimeError('boom'))" in monstack._dump.report()


def test_dump_writes_to_stderr_by_default(capsys):
    monstack.dump()
    err = capsys.readouterr().err
    assert err.startswith("monstack dump:") and "\x1b[" not in err


def test_colour_decided_for_the_file(monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "PYTHON_COLORS", "MONSTACK_COLOR", "TERM"):
        monkeypatch.delenv(name, raising=False)
    tty, plain = FakeStream(tty=True), FakeStream(tty=False)
    monstack.dump(tty)
    monstack.dump(plain)
    assert "\x1b[1m" in tty.getvalue()
    assert "\x1b[" not in plain.getvalue()
    monkeypatch.setenv("NO_COLOR", "1")
    quiet = FakeStream(tty=True)
    monstack.dump(quiet)
    assert "\x1b[" not in quiet.getvalue()


@pytest.mark.skipif(not hasattr(signal, "SIGUSR2"), reason="POSIX signals")
@pytest.mark.parametrize("write_through", [False, True], ids=["flush-fails", "write-fails"])
def test_dump_from_a_signal_handler_that_interrupted_a_stderr_write(monkeypatch, tmp_path, write_through):
    """The program's own handler calls monstack.dump() while the main thread is inside
    sys.stderr's buffer (its lock held: RuntimeError, reentrant call): the report goes to
    the stream's file descriptor instead of nowhere."""
    fd = os.open(tmp_path / "stderr", os.O_WRONLY | os.O_CREAT, 0o600)
    interrupt = []

    class Raw(io.RawIOBase):
        def writable(self):
            return True

        def fileno(self):
            return fd

        def write(self, data):
            if interrupt:
                interrupt.pop()
                signal.raise_signal(signal.SIGUSR2)  # the handler runs here, in the flush
            return os.write(fd, data)

    stream = io.TextIOWrapper(io.BufferedWriter(Raw()), encoding="utf-8", write_through=write_through)
    monkeypatch.setattr(sys, "stderr", stream)
    called = []

    def handler(signum, frame):
        called.append(signum)
        monstack.dump()

    previous = signal.signal(signal.SIGUSR2, handler)
    try:
        stream.write("before\n")
        interrupt.append(True)
        stream.flush()
        assert called == [signal.SIGUSR2] and not interrupt
        stream.write("after\n")
        stream.flush()
    finally:
        signal.signal(signal.SIGUSR2, previous)
        stream.close()
        os.close(fd)
    text = (tmp_path / "stderr").read_text()
    assert text.count("monstack dump:") == 1 and "test_dump_from_a_signal_handler" in text
    assert text.startswith("monstack dump:") and text.endswith("before\nafter\n")


def _controls(text: str) -> list[str]:
    """C0 (but the line breaks), DEL and C1 characters in ``text``."""
    return [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) < 0xA0]


EVIL_FILE = "/nowhere/evil\x1b]0;title\x07.py"
EVIL_SOURCE = (
    "import threading\n"
    "def park(started, event):\n"
    "    started.set()  # \x1b[2J\x9b\n"
    "    event.wait()  # \x1b[2J\x9b\n"
    "def start(target, args, name):\n"
    "    t = threading.Thread(target=target, args=args, name=name, daemon=True)\n"
    "    t.start()  # \x1b[2J\x9b\n"
    "    return t\n"
    "async def wait_on(fut):\n"
    "    await fut  # \x1b[2J\x9b\n"
    "def create(loop, coro, name):\n"
    "    return loop.create_task(coro, name=name)  # \x1b[2J\x9b\n"
)


def test_control_characters_from_the_program_are_escaped(monkeypatch):
    """Thread, task and loop names, reprs, file names, function names and source lines may
    hold terminal controls (a window title, clear screen): the report escapes them, keeps
    its own colours and line breaks, and other non-ASCII text."""
    import linecache

    monstack.install()
    monkeypatch.setitem(linecache.cache, EVIL_FILE, (len(EVIL_SOURCE), None, EVIL_SOURCE.splitlines(True), EVIL_FILE))
    ns: dict = {}
    exec(compile(EVIL_SOURCE, EVIL_FILE, "exec"), ns)
    code = ns["park"].__code__
    ns["park"].__code__ = code.replace(co_name="park\x1b[2J", co_qualname="park\x1b[2J")

    class EvilFuture(asyncio.Future):
        def __repr__(self):
            return "<evil\x1b]0;x\x07 é>"

    loop = type("Loop\x1b]0;x\x07", (asyncio.SelectorEventLoop,), {})()
    started, release = threading.Event(), threading.Event()
    parked = ns["start"](ns["park"], (started, release), "thread\x1b[31m\n\x7f é")
    runner = ns["start"](loop.run_forever, (), "loop\x1b[2J")
    holder = {}
    try:
        assert started.wait(30)

        async def make():
            holder["fut"] = EvilFuture()
            holder["task"] = ns["create"](loop, ns["wait_on"](holder["fut"]), "task\x1b[2J\x9b")
            await asyncio.sleep(0)  # the task runs to its await

        asyncio.run_coroutine_threadsafe(make(), loop).result(30)
        plain = _dump.report(color=False)
        colored = _dump.report(color=True)
    finally:
        release.set()
        if "fut" in holder:
            loop.call_soon_threadsafe(holder["fut"].set_result, None)
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        runner.join(30)
        parked.join(30)
        loop.close()
    from monstack._colorize import ANSI

    for code in (v for k, v in vars(ANSI).items() if k.isupper()):
        colored = colored.replace(code, "")
    for text in (plain, colored):
        assert _controls(text) == [], text
        part = section(text, 'Thread "thread\\x1b[31m\\n\\x7f é"')
        assert 'in park\\x1b[2J\n' in part
        assert 'File "/nowhere/evil\\x1b]0;title\\x07.py", line 4' in part
        assert "    event.wait()  # \\x1b[2J\\x9b\n" in part
        work = part[part.index("Work created at"):]
        assert "t.start()  # \\x1b[2J\\x9b" in work
        assert 'Asyncio loop ' in text and 'Loop\\x1b]0;x\\x07 in thread "loop\\x1b[2J"' in text
        task = section(text, 'Task "task\\x1b[2J\\x9b" (pending):')
        assert "await fut  # \\x1b[2J\\x9b" in task
        assert "awaiting <evil\\x1b]0;x\\x07 é>" in task
        created = task[task.index("Task created at"):]
        assert "loop.create_task(coro, name=name)  # \\x1b[2J\\x9b" in created


def test_dump_later_fires_once_then_repeats_and_cancels():
    got = threading.Event()

    class Sink(io.StringIO):
        def flush(self):
            got.set()

    once = Sink()
    monstack.dump_later(0.01, file=once)
    assert got.wait(30)
    assert once.getvalue().count("monstack dump:") == 1
    assert "(monstack's dump_later watchdog)" in once.getvalue()

    reports = []
    twice = threading.Event()

    class Counting(io.StringIO):
        def flush(self):
            reports.append(1)
            if len(reports) >= 2:
                twice.set()

    monstack.dump_later(0.01, repeat=True, file=Counting())
    assert twice.wait(30)
    watchdog = _dump._watchdog
    monstack.cancel_dump_later()
    watchdog.thread.join(30)
    assert not watchdog.thread.is_alive()
    monstack.cancel_dump_later()  # nothing pending: nothing happens


def test_dump_later_replaces_and_cancel_prevents():
    never = io.StringIO()
    monstack.dump_later(3600, file=never)
    first = _dump._watchdog
    monstack.dump_later(3600, file=never)
    first.thread.join(30)
    assert not first.thread.is_alive()  # replaced: its thread ended without dumping
    second = _dump._watchdog
    monstack.cancel_dump_later()
    second.thread.join(30)
    assert not second.thread.is_alive() and never.getvalue() == ""


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-1, ValueError), (float("nan"), ValueError),
                                     (float("inf"), ValueError), ("1", TypeError), (None, TypeError), (True, TypeError)])
def test_dump_later_bad_timeout(bad, exc):
    with pytest.raises(exc):
        monstack.dump_later(bad)
    assert _dump._watchdog is None


def test_stress_threads_and_tasks_come_and_go():
    """Threads and tasks start and end while dumps run: every report is whole."""
    monstack.install()
    stop = threading.Event()

    def churn_threads():
        while not stop.is_set():
            ts = [threading.Thread(target=lambda: None) for _ in range(4)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

    def churn_tasks():
        async def short():
            await asyncio.sleep(0)

        async def main():
            while not stop.is_set():
                await asyncio.gather(*(asyncio.create_task(short()) for _ in range(20)))

        asyncio.run(main())

    workers = [threading.Thread(target=churn_threads, daemon=True), threading.Thread(target=churn_tasks, daemon=True)]
    for w in workers:
        w.start()
    try:
        for _ in range(60):
            text = monstack._dump.report()
            assert text.startswith("monstack dump:")
            assert "could not be" not in text and "failed" not in text
    finally:
        stop.set()
        for w in workers:
            w.join(30)


# -- real hung programs ----------------------------------------------------------------------


def run_hung(name: str, mode: str) -> str:
    """Run tests/programs/<name> in ``mode`` until it has written its report; its stderr."""
    env = dict(os.environ)
    env.pop("MONSTACK", None)
    env["PYTHONPATH"] = os.pathsep.join([str(PROGRAMS)] + [p for p in sys.path if p])
    proc = subprocess.run([sys.executable, str(PROGRAMS / name), mode], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ready\n"
    assert proc.stderr.rstrip().endswith("END-OF-DUMP"), proc.stderr
    return proc.stderr


def lines(report: str, path: Path, *markers: str) -> None:
    for marker in markers:
        assert frame_line(path, marker) in report, (marker, report)
        assert marker in report


MODES = ["dump", "dump-later"]


@pytest.mark.integration
@pytest.mark.parametrize("mode", MODES)
def test_hung_lock_order_deadlock(mode):
    path = PROGRAMS / "hang_deadlock.py"
    text = run_hung(path.name, mode)
    alpha, beta = section(text, 'Thread "alpha"'), section(text, 'Thread "beta"')
    lines(alpha, path, "# WAITS-A", "# STARTS-A")
    lines(beta, path, "# WAITS-B", "# STARTS-B")
    lines(section(text, 'Thread "MainThread"'), path, "# MAIN-WAITS")


@pytest.mark.integration
@pytest.mark.parametrize("mode", MODES)
def test_hung_pool_job(mode):
    path = PROGRAMS / "hang_pool.py"
    text = run_hung(path.name, mode)
    lines(section(text, 'Thread "pool_0"'), path, "# WAITS-JOB", "# SUBMITS")
    lines(section(text, 'Thread "MainThread"'), path, "# MAIN-WAITS")


@pytest.mark.integration
@pytest.mark.parametrize("mode", MODES)
def test_hung_asyncio_task_in_another_thread(mode):
    path = PROGRAMS / "hang_asyncio.py"
    text = run_hung(path.name, mode)
    lines(section(text, 'Thread "event-loop"'), path, "# STARTS-LOOP")
    lines(section(text, 'Thread "MainThread"'), path, "# MAIN-WAITS")
    assert re.search(r'^Asyncio loop .* in thread "event-loop" .*running, 2 pending tasks:', text, re.M), text
    task = section(text, 'Task "forever" (pending):')
    lines(task, path, "# WAITS-TASK", "# CREATES-TASK", "# STARTS-LOOP")
    lines(section(text, 'Task "Task-1" (pending):'), path, "# WAITS-SUPERVISOR")
    assert 'awaiting task "forever"' in section(text, 'Task "Task-1" (pending):')


@pytest.mark.integration
@pytest.mark.parametrize("mode", MODES)
def test_hung_main_thread_sleeping(mode):
    path = PROGRAMS / "hang_sleep.py"
    text = run_hung(path.name, mode)
    lines(section(text, 'Thread "MainThread"'), path, "# MAIN-SLEEPS")
    lines(section(text, 'Thread "sleeper"'), path, "# WAITS-WORKER", "# STARTS-WORKER")


def test_a_program_started_by_run_or_dash_m_shows_no_runpy_frames(tmp_path):
    """``python -m`` and ``python -m monstack run`` start the program from ``<frozen runpy>``
    frames: noise the report leaves out (the program's own frames start the stack)."""
    (tmp_path / "prog.py").write_text("import monstack\n\ndef main():\n    monstack.dump()  # the dumping line\n\nmain()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MONSTACK")}
    for argv in (["-m", "monstack", "run", "prog.py"], ["-m", "prog"]):
        out = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        assert "monstack.dump()  # the dumping line" in out.stderr
        assert "<frozen runpy>" not in out.stderr, out.stderr


def test_hide_folds_each_run_of_a_frameworks_frames():
    recs = [("/fw/a.py", 1, "a", None, None, None), ("/fw/b.py", 2, "b", None, None, None),
            ("/app.py", 3, "main", None, None, None), ("/fw/c.py", 4, "c", None, None, None)]
    lines = _dump._format_stack(recs, False, lambda f: "fw" if f.startswith("/fw/") else None)
    text = "".join(lines)
    assert text.count("[... 2 frames of fw]") == 1 and text.count("[... 1 frame of fw]") == 1
    assert 'File "/app.py", line 3, in main' in text and "/fw/" not in text
    assert text.index("2 frames") < text.index("/app.py") < text.index("1 frame")
