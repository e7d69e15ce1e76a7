"""Hang diagnosis: every thread and every pending asyncio task, with where its work came
from (``monstack.dump()``, ``dump_later()``).

The report is built from what other threads leave readable without stopping them: their
real frames (``sys._current_frames()``), their shadow stacks and current origins
(``_threads``), the tasks of the event loops that run (found in the frames, in asyncio's
task sets and among the loops monstack's ``asyncio_tasks`` point saw). Nothing here takes
a lock another thread may hold, or writes to another thread's state; everything it reads
may change while it reads, so every section is built under ``try`` and a failure is one
line in the report.
"""

from __future__ import annotations

import _thread
import os
import sys
import time

# Nothing heavy at import (``monstack`` imports this at start-up): threading is imported
# by ``dump_later()``, typing only by type checkers.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType
    from typing import IO, Any, Callable, Iterable, Optional

from . import _capture, _env, _format, _threads
from ._colorize import ANSI, resolve
from ._dumpproto import escape_controls
from ._policy import _MONSTACK_DIR
from ._snapshot import CURRENT_ORIGIN, frame_record

#: Default size cap of a report, in bytes (UTF-8); sections past it are counted, not shown.
DEFAULT_LIMIT = 1_000_000
#: Frames shown per stack or await chain (the middle of longer ones is elided, as
#: tracebacks are).
FRAME_LIMIT = _format.MAX_FRAMES
#: Hops shown per await chain before giving up (a cycle of awaitables).
_AWAIT_HOPS = 1000

STACK_HEADING = "Stack (most recent call last):"
AWAIT_HEADING = "Await chain (most recent call last):"
TASK_ORIGIN_HEADING = "Task created at (most recent call last):"


# -- loops ---------------------------------------------------------------------------------

def _loop_of_frame(frame: FrameType) -> Any:
    """The loop of a ``run_forever`` frame (asyncio's pure-Python event loops)."""
    if frame.f_code.co_name != "run_forever":
        return None
    try:
        if _env.FRAME_LOCALS_PROXY:  # a proxy reading the frame's slots: no side effect
            return frame.f_locals.get("self")
        return None  # (3.11-3.12: f_locals would write to the running frame; tasks find it)
    except Exception:
        return None


def _global_tasks() -> list:
    """Tasks from asyncio's own task sets: every task of every loop on 3.11-3.13 (native
    or not), the ones not in a native per-thread list on 3.14+."""
    tasks_mod = sys.modules.get("asyncio.tasks")
    if tasks_mod is None:
        return []
    out: list = []
    for name in ("_all_tasks", "_scheduled_tasks", "_eager_tasks"):
        coll = getattr(tasks_mod, name, None)
        if coll is None:
            continue
        for _ in range(100):
            try:
                out.extend(list(coll))
                break
            except RuntimeError:  # changed size during iteration: again
                continue
    return out


def _loops(frames: dict) -> dict[int, Any]:
    """id -> loop of every loop that may have pending tasks."""
    found: dict[int, Any] = {}
    for ref in list(_threads.LOOPS.values()):
        loop = ref()
        if loop is not None:
            found[id(loop)] = loop
    for frame in frames.values():
        f: Optional[FrameType] = frame
        while f is not None:
            loop = _loop_of_frame(f)
            if loop is not None:
                found[id(loop)] = loop
            f = f.f_back
    for task in _global_tasks():
        try:
            loop = task.get_loop()
        except Exception:
            continue
        found[id(loop)] = loop
    return found


def _pending_tasks(loop: Any) -> list:
    asyncio = sys.modules.get("asyncio")
    tasks: Iterable = ()
    if asyncio is not None:
        try:
            tasks = asyncio.all_tasks(loop)
        except Exception:
            tasks = ()
    seen = {id(t): t for t in tasks}
    for t in _global_tasks():
        try:
            if t.get_loop() is loop:
                seen.setdefault(id(t), t)
        except Exception:
            pass
    out = []
    for t in seen.values():
        try:
            if not t.done():
                out.append(t)
        except Exception:
            pass
    return out


# -- control characters ----------------------------------------------------------------------
# Names, reprs, file names and source lines come from the program (or whoever named its
# threads and files): their control characters are escaped before they reach a terminal.


def _safe_records(records: Iterable) -> list:
    """Frame records -> 7-field records (the form whose line ``_format`` shows as carried)
    with the file name, function name and source line escaped."""
    out = []
    for rec in records:
        if len(rec) > 6:
            line = rec[6] if isinstance(rec[6], str) else ""
        else:
            line = _format.source_line(rec[0], rec[1])
        out.append((escape_controls(str(rec[0])), rec[1], escape_controls(str(rec[2])), rec[3], rec[4], rec[5],
                    escape_controls(line.strip())))
    return out


class _EscapedSnapshot:
    """A snapshot as ``_format.format_origin`` reads it, with escaped records."""

    __slots__ = ("_snap",)

    def __init__(self, snap: Any) -> None:
        self._snap = snap

    def _chain_limit(self) -> int:
        return self._snap._chain_limit()

    def chain(self, limit: Optional[int] = None) -> tuple:
        older, dropped = self._snap.chain(limit)
        return tuple(_EscapedSnapshot(hop) for hop in older), dropped

    def _display_records(self) -> list:
        return _safe_records(self._snap._display_records())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._snap, name)


def _origin_lines(snap: Any, color: bool) -> list[str]:
    return _format.format_origin(_EscapedSnapshot(snap), color)


# -- pieces of the report ------------------------------------------------------------------


def _frame_records(frame: Optional[FrameType]) -> list:
    """The real stack from ``frame`` outwards, outermost first, without monstack's frames
    and without the ``<frozen runpy>`` frames that start a ``python -m`` program."""
    recs = []
    f = frame
    while f is not None:
        code = f.f_code
        if not code.co_filename.startswith(_MONSTACK_DIR):
            recs.append(frame_record(code, f.f_lasti))
        f = f.f_back
    recs.reverse()
    while recs and recs[0][0] == "<frozen runpy>":
        del recs[0]
    return _safe_records(recs)


def _format_stack(recs: list, color: bool, hide: Optional[Callable[[str], Optional[str]]]) -> list[str]:
    """``recs`` formatted; with ``hide`` (file name -> the name of the framework it belongs
    to, or None), each run of a framework's frames is one line saying how many."""
    if hide is None:
        return _format.format_records(recs, color, FRAME_LIMIT)
    out: list[str] = []
    shown: list = []
    hidden: list[str] = []

    def flush_hidden() -> None:
        if hidden:
            names = sorted(set(hidden))
            what = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
            line = f"  [... {len(hidden)} frame{'s' if len(hidden) != 1 else ''} of {what}]"
            out.append((f"{ANSI.GREY}{line}{ANSI.RESET}" if color else line) + "\n")
            hidden.clear()

    for rec in recs:
        name = hide(rec[0])
        if name is None:
            flush_hidden()
            shown.append(rec)
            continue
        if shown:
            out.extend(_format.format_records(shown, color, FRAME_LIMIT))
            shown = []
        hidden.append(name)
    flush_hidden()
    if shown:
        out.extend(_format.format_records(shown, color, FRAME_LIMIT))
    return out


def _thread_heading(ident: int, thread: Any, me: int, color: bool) -> str:
    if thread is not None:
        try:
            name = thread.name
        except Exception:
            name = "?"
        try:
            daemon = " daemon," if thread.daemon else ""
        except Exception:
            daemon = ""
        native = getattr(thread, "native_id", None)
    else:
        name, daemon, native = None, "", None
    parts = [f'Thread "{escape_controls(str(name))}"' if name is not None else "Thread (not started by threading)"]
    detail = f"ident {ident:#x},{daemon}"
    if native is not None:
        detail += f" native id {native},"
    detail = detail.rstrip(",")
    if ident == me:
        detail += ", writing this report"
    text = f"{parts[0]} ({detail}):"
    return _format.heading(text, color)


def _task_name(task: Any) -> str:
    try:
        return escape_controls(str(task.get_name()))
    except Exception:
        return "?"


def _await_chain(task: Any) -> tuple[list, Any]:
    """``(records, last)``: the frames of the task's coroutine chain, outermost first,
    down to the innermost coroutine, and the awaitable it waits on (or None)."""
    try:
        coro = task.get_coro()
    except Exception:
        coro = getattr(task, "_coro", None)
    recs = []
    for _ in range(_AWAIT_HOPS):
        if coro is None:
            break
        frame = None
        for attr in ("cr_frame", "gi_frame", "ag_frame"):
            frame = getattr(coro, attr, None)
            if frame is not None:
                break
        if frame is None:
            break
        recs.append(frame_record(frame.f_code, frame.f_lasti))
        nxt = None
        for attr in ("cr_await", "gi_yieldfrom", "ag_await"):
            nxt = getattr(coro, attr, None)
            if nxt is not None:
                break
        coro = nxt
    return _safe_records(recs), getattr(task, "_fut_waiter", None)


def _task_origin(task: Any) -> Any:
    """The creation snapshot the ``asyncio_tasks`` point gave ``task``: its done callback's
    where it has one (a task given its own ``context=``...), else the origin its creation
    set in the task's context."""
    try:
        callbacks = task._callbacks or ()
    except Exception:
        callbacks = ()
    for entry in list(callbacks):
        cb = entry[0] if isinstance(entry, tuple) else entry
        if type(cb).__name__ == "_TaskDone" and type(cb).__module__ == "monstack._points":
            return getattr(cb, "_snap", None)
    try:
        return _task_context(task).get(CURRENT_ORIGIN)
    except Exception:
        return None


def _task_context(task: Any) -> Any:
    """The context a task runs in (``get_context()``, 3.12+; before, the one the task
    holds: 3.11's C task does not show it)."""
    get_context = getattr(task, "get_context", None)
    if get_context is not None:
        return get_context()
    context = getattr(task, "_context", None)  # (asyncio's Python Task)
    if context is not None:
        return context
    import contextvars
    import gc

    for ref in gc.get_referents(task):
        if type(ref) is contextvars.Context:
            return ref
    return None


def _short_repr(obj: Any, limit: int = 200) -> str:
    try:
        text = repr(obj)
    except Exception:
        text = f"<{type(obj).__name__} object>"
    return escape_controls(text if len(text) <= limit else text[: limit - 3] + "...")


def _task_section(task: Any, color: bool) -> list[str]:
    out = [_format.heading(f'Task "{_task_name(task)}" (pending):', color)]
    recs, waiter = _await_chain(task)
    out.append(AWAIT_HEADING + "\n")
    if recs:
        out.extend(_format.format_records(recs, color, FRAME_LIMIT))
    else:
        out.append("  (not started, or no coroutine frames)\n")
    if waiter is not None:
        asyncio = sys.modules.get("asyncio")
        if asyncio is not None and isinstance(waiter, asyncio.Task):
            out.append(f'  awaiting task "{_task_name(waiter)}"\n')
        else:
            out.append(f"  awaiting {_short_repr(waiter)}\n")
    origin = _task_origin(task)
    if origin is not None:
        lines = _origin_lines(origin, color)
        if lines:
            lines[0] = _format.heading(TASK_ORIGIN_HEADING, color)
        out.extend(lines)
    return out


def _thread_section(ident: int, frame: Optional[FrameType], thread: Any, snap: Any, me: int, color: bool,
                    hide: Optional[Callable[[str], Optional[str]]] = None) -> list[str]:
    out = [_thread_heading(ident, thread, me, color)]
    if isinstance(getattr(thread, "_target", None), _WatchdogRun):
        out.append("  (monstack's dump_later watchdog)\n")
        return out
    out.append(STACK_HEADING + "\n")
    recs = _frame_records(frame)
    if recs:
        out.extend(_format_stack(recs, color, hide))
    else:
        out.append("  (no Python frames)\n")
    origin = snap.origin if snap is not None else None
    if origin is not None:
        out.extend(_origin_lines(origin, color))
    return out


def _header(color: bool, n_threads: int) -> str:
    state = _capture.running()
    if state is None:
        how = "monstack not installed: stacks without origins"
    else:
        how = f"backend {state.backend.name}"
    now = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return _format.heading(
        f"monstack dump: process {os.getpid()}, CPython {_env.VERSION_TEXT}, {how}, {now}, {n_threads} threads", color
    )


def _order(frames: dict, active: dict, me: int) -> list[int]:
    main = None
    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            main = threading.main_thread().ident
        except Exception:
            main = None
    idents = [i for i in frames if i in active] + [i for i in frames if i not in active]
    if main in frames:
        idents.remove(main)
        idents.insert(0, main)
    return idents


# -- the report ----------------------------------------------------------------------------


def report(*, color: bool = False, limit_bytes: Optional[int] = DEFAULT_LIMIT,
           hide: Optional[Callable[[str], Optional[str]]] = None) -> str:
    """The whole report as text. Never raises: a part that fails is a line in the report.

    ``hide``: file name -> the name of the framework whose frames it holds (each run of them
    becomes one line), or None to show it; the pytest plugin hides pytest's own frames."""
    parts: list[str] = []
    size = 0
    skipped = {"threads": 0, "tasks": 0}

    def add(kind: str, lines: list[str]) -> None:
        nonlocal size
        text = "".join(lines)
        n = len(text.encode("utf-8", "replace"))
        if limit_bytes is not None and size + n > limit_bytes and parts:
            skipped[kind] += 1
            return
        parts.append(text)
        size += n

    try:
        frames = sys._current_frames()
        me = _thread.get_ident()
        try:
            snaps = _threads.threads()
        except Exception:
            snaps = {}
        active = _threads._active_threads()
        add("threads", [_header(color, len(frames))])
        for ident in _order(frames, active, me):
            try:
                add("threads", ["\n"] + _thread_section(ident, frames.get(ident), active.get(ident), snaps.get(ident), me,
                                                        color, hide))
            except Exception as exc:
                add("threads", [f"\n(monstack: thread {ident:#x} could not be reported: {_short_repr(exc)})\n"])
        try:
            loops = _loops(frames)
        except Exception as exc:
            loops = {}
            add("tasks", [f"\n(monstack: event loops could not be listed: {_short_repr(exc)})\n"])
        del frames
        for loop in loops.values():
            try:
                tasks = _pending_tasks(loop)
                if not tasks:
                    continue
                tid = getattr(loop, "_thread_id", None)
                where = ""
                if isinstance(tid, int):
                    t = active.get(tid)
                    name = getattr(t, "name", None)
                    where = f' in thread "{escape_controls(str(name))}"' if name else ""
                    where += f" (ident {tid:#x})"
                running = ""
                try:
                    running = "running" if loop.is_running() else "not running"
                except Exception:
                    pass
                kind = escape_controls(f"{type(loop).__module__}.{type(loop).__qualname__}")
                add("tasks", ["\n", _format.heading(
                    f"Asyncio loop {kind}{where}, {running}, "
                    f"{len(tasks)} pending task{'s' if len(tasks) != 1 else ''}:", color)])
                for task in sorted(tasks, key=_task_name):
                    try:
                        add("tasks", ["\n"] + _task_section(task, color))
                    except Exception as exc:
                        add("tasks", [f"\n(monstack: a task could not be reported: {_short_repr(exc)})\n"])
            except Exception as exc:
                add("tasks", [f"\n(monstack: a loop could not be reported: {_short_repr(exc)})\n"])
    except Exception as exc:
        parts.append(f"\n(monstack: the report failed: {_short_repr(exc)})\n")
    if skipped["threads"] or skipped["tasks"]:
        text = (f"\n[report cut at {limit_bytes} bytes: {skipped['threads']} more thread(s) "
                f"and {skipped['tasks']} more task section(s) not shown]\n")
        parts.append(f"{ANSI.GREY}{text[1:-1]}{ANSI.RESET}\n" if color else text)
    return "".join(parts)


def dump(file: Optional[IO[str]] = None) -> None:
    """Write :func:`report` to ``file`` (default ``sys.stderr``), coloured as suits it."""
    if file is None:
        file = sys.stderr
    try:
        color = resolve(None, file)
    except Exception:
        color = False
    text = report(color=color)
    try:
        file.write(text)
        file.flush()
    except Exception:
        # A signal handler that interrupted a write to this very stream finds its buffer
        # held (RuntimeError: reentrant call, from the write or from the flush, which drops
        # the text): write to its file descriptor instead. Only then: pytest's capture and
        # a redirected sys.stderr keep getting the report.
        _write_fd(file, text)


def _write_fd(file: Any, text: str) -> None:
    """``text`` to ``file``'s descriptor (2 for a ``sys.stderr`` that has none) with
    ``os.write``. Never raises."""
    try:
        fd = file.fileno()
    except Exception:
        if file is not sys.stderr and file is not sys.__stderr__:
            return
        fd = 2
    try:
        view = memoryview(text.encode("utf-8", "backslashreplace"))
        while view:
            try:
                view = view[os.write(fd, view):]
            except InterruptedError:
                continue
    except Exception:
        pass


# -- the watchdog ----------------------------------------------------------------------------


class _Watchdog:
    """One ``dump_later`` timer: a daemon thread waiting on its own event."""

    def __init__(self, timeout: float, repeat: bool, file: Optional[IO[str]]) -> None:
        self.timeout = timeout
        self.repeat = repeat
        self.file = file
        import threading

        self.cancelled = threading.Event()
        self.thread = threading.Thread(target=_WatchdogRun(self), name="monstack-dump-later", daemon=True)


class _WatchdogRun:
    """A watchdog thread's target (what the report recognises it by)."""

    __slots__ = ("watchdog",)

    def __init__(self, watchdog: _Watchdog) -> None:
        self.watchdog = watchdog

    def __call__(self) -> None:
        w = self.watchdog
        while not w.cancelled.wait(w.timeout):
            dump(w.file)
            if not w.repeat:
                break


_watchdog: Optional[_Watchdog] = None
_watchdog_lock = _thread.allocate_lock()  # (monstack's own: taken by dump_later/cancel only)


def dump_later(timeout: float, repeat: bool = False, file: Optional[IO[str]] = None) -> None:
    """Write the report (``dump(file)``) after ``timeout`` seconds, every ``timeout`` seconds
    with ``repeat``, unless :func:`cancel_dump_later` is called first; replaces an earlier
    ``dump_later``. Like ``faulthandler.dump_traceback_later``, with origins and tasks, but
    in a Python thread: a thread holding the GIL inside C (a C extension's loop that never
    releases it) keeps it from running, where faulthandler's C watchdog still fires."""
    if isinstance(timeout, (str, bytes, bool)) or not hasattr(timeout, "__float__"):
        raise TypeError(f"timeout must be a number, got {type(timeout).__name__}")
    timeout = float(timeout)
    if not timeout > 0 or timeout != timeout or timeout == float("inf"):
        raise ValueError("timeout must be greater than 0")
    global _watchdog
    with _watchdog_lock:
        old, _watchdog = _watchdog, _Watchdog(timeout, bool(repeat), file)
        if old is not None:
            old.cancelled.set()
        _watchdog.thread.start()


def cancel_dump_later() -> None:
    """Cancel the last :func:`dump_later` (nothing if none is pending)."""
    global _watchdog
    with _watchdog_lock:
        old, _watchdog = _watchdog, None
    if old is not None:
        old.cancelled.set()
