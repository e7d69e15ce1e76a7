"""Every thread's stack and the asyncio tasks of another CPython 3.14+ process, read from
its memory with CPython's own remote-debugging reader (the private ``_remote_debugging``
module, which ``python -m asyncio pstree`` and ``python -m profiling.sampling`` use).

The process runs no code for this: it answers even when its main thread is blocked in a
lock, ``join()``, ``sleep()`` or ``select()``, where ``sys.remote_exec`` waits for it to
run Python. What it cannot give: where work came from (origins), which live in the
target's Python objects, and Python's thread names (the OS's, 15 bytes, are shown).

Requirements: the reader's Python is the target's minor version (CPython refuses another),
the OS lets the reader attach (ptrace: same user or root, Yama's ``ptrace_scope``), Linux
for thread names, states and the target's view of its files (``/proc``).

This module is self-contained: stdlib imports only, no ``monstack`` import, nothing that
needs ``__file__``, so that its source runs as ``python -I -S -c SOURCE PID`` in another
interpreter. It never executes anything of the target's: source lines are read from the
files the frames name, by path, regular files only, with bounded sizes (and, read as the
target's user, bounded time: that user can stop the reading child). Everything taken
from the target (thread, task, file and function names, source lines) has its C0/C1
control characters, DEL and lone surrogates escaped. The reader's output is bounded
(threads, frames, tasks, name lengths, report size) so that a hostile target cannot make
the report use unbounded memory or time; CPython's reader bounds its own walks.
"""

from __future__ import annotations

import os
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Iterable, Optional, Sequence

#: Python threads shown; more are counted.
MAX_THREADS = 500
#: Frames shown per stack or await chain: the middle of longer ones is elided (as the
#: usual report and tracebacks do).
MAX_FRAMES = 100
#: Frames of one stack looked at at all (the innermost and outermost halves).
MAX_RAW_FRAMES = 10_000
#: Tasks shown; more are counted.
MAX_TASKS = 1000
#: "awaited by" links shown per task.
MAX_AWAITERS = 20
#: Characters kept of a name (thread, task, function, file) or a source line.
MAX_NAME = 300
#: Size of a source file read for its lines, and of all of them together.
MAX_SOURCE_FILE = 4 * 1024 * 1024
MAX_SOURCE_TOTAL = 32 * 1024 * 1024
#: Seconds a source file read as the target's user (root reading another user's process)
#: may take, and all of them together: that user can stop the reading child (SIGSTOP).
SOURCE_FILE_SECONDS = 2.0
SOURCE_TOTAL_SECONDS = 5.0
#: Size cap of the report, in bytes (UTF-8), as the usual report's default.
LIMIT_BYTES = 1_000_000
#: Reads retried when the target's memory changed under the reader.
RETRIES = 3
#: Identical consecutive frames shown before "[Previous line repeated N more times]".
RECURSIVE_CUTOFF = 3

STACK_HEADING = "Stack (most recent call last):"
AWAIT_HEADING = "Await chain (most recent call last):"

_BOLD, _MAGENTA, _GREY, _RESET = "\x1b[1m", "\x1b[35m", "\x1b[90m", "\x1b[0m"

# -- version facts: this module runs alone in another interpreter (no monstack._env there),
# so these few are its own; no other line of it compares versions (tests/unit/test_env.py).
#: ``"3.14"``: this interpreter's version as text.
VERSION_TAG = "%d.%d" % sys.version_info[:2]
#: The first version whose reader can read a process (PEP 768, gh-91048).
READABLE_SINCE = (3, 14)
#: The reader reads every interpreter of the process (gh-138385, 3.15); 3.14's reads one,
#: the most recently created, and sees no thread state of the others.
READS_EVERY_INTERPRETER = sys.version_info >= (3, 15)
#: The reader lists the asyncio tasks of every thread (gh-149230, 3.15); 3.14's lists the
#: main thread's only.
TASKS_OF_EVERY_THREAD = sys.version_info >= (3, 15)
#: The reader reads names that are not ASCII (gh-149214, 3.15); 3.14's reads some as NULs.
READS_NON_ASCII = sys.version_info >= (3, 15)

#: Thread status flags of 3.15's reader (absent on 3.14).
_STATUS_HAS_GIL = 1
_STATUS_MAIN_THREAD = 32

_STATES = {
    "R": "running", "S": "sleeping", "D": "in uninterruptible wait", "T": "stopped",
    "t": "stopped by a tracer", "Z": "zombie", "X": "dead", "I": "idle",
}


class ExternalError(Exception):
    """Why the process could not be read: one line for the user."""


# -- text from the target ------------------------------------------------------------------

def _escape_table() -> dict[int, str]:
    table = {}
    for code in list(range(0x20)) + [0x7F] + list(range(0x80, 0xA0)):
        table[code] = f"\\x{code:02x}"
    table.update({0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"})
    for code in range(0xD800, 0xE000):  # lone surrogates: unprintable, unencodable
        table[code] = f"\\u{code:04x}"
    return table


_ESCAPES = _escape_table()


def escape(text: object, limit: int = MAX_NAME) -> str:
    """``text`` (from the target) made safe to print: at most ``limit`` characters, C0 and
    C1 control characters, DEL and lone surrogates as backslash escapes; other non-ASCII
    text kept as it is."""
    if not isinstance(text, str):
        try:
            text = str(text)
        except Exception:
            text = "?"
    assert isinstance(text, str)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text.translate(_ESCAPES)


# -- /proc ---------------------------------------------------------------------------------

def _read_small(path: str, limit: int = 4096) -> Optional[bytes]:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def _thread_name(pid: int, tid: int) -> Optional[str]:
    raw = _read_small(f"/proc/{pid}/task/{tid}/comm", 64)
    if not raw:
        return None
    return raw.rstrip(b"\n").decode("utf-8", "backslashreplace")


def _thread_state(pid: int, tid: int) -> Optional[str]:
    raw = _read_small(f"/proc/{pid}/task/{tid}/stat", 4096)
    if not raw or b")" not in raw:
        return None
    fields = raw.rsplit(b")", 1)[1].split()
    if not fields:
        return None
    return _STATES.get(fields[0].decode("ascii", "replace"))


def _os_threads(pid: int) -> list[int]:
    try:
        names = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit())


def _check_process(pid: int) -> None:
    if not os.path.isdir("/proc/self"):
        return  # not Linux: the reader says what is wrong
    raw = _read_small(f"/proc/{pid}/stat")
    if raw is None:
        if not os.path.exists(f"/proc/{pid}"):
            raise ExternalError(f"no such process: {pid}")
        return
    fields = raw.rsplit(b")", 1)[1].split() if b")" in raw else []
    if fields[:1] == [b"Z"]:
        raise ExternalError(f"process {pid} has ended (a zombie)")


def _sniff_version(pid: int) -> Optional[tuple[int, int]]:
    """The Python version the process's executable or libpython names, if any."""
    import re

    pattern = re.compile(rb"(?:^|/)(?:lib)?python(\d)\.(\d{1,2})(?:[^/\d][^/]*)?$")
    candidates: list[bytes] = []
    try:
        candidates.append(os.fsencode(os.readlink(f"/proc/{pid}/exe")).removesuffix(b" (deleted)"))
    except OSError:
        pass
    maps = _read_small(f"/proc/{pid}/maps", 4 * 1024 * 1024) or b""
    for line in maps.splitlines()[:20000]:
        parts = line.split(None, 5)
        if len(parts) == 6:
            candidates.append(parts[5].strip().removesuffix(b" (deleted)"))
    for path in candidates:
        m = pattern.search(path)
        if m:
            return int(m.group(1)), int(m.group(2))
    return None


# -- source lines ------------------------------------------------------------------------------

class _Sources:
    """Source lines of the target's files, read by path (through the target's root and
    working directory where /proc shows them), regular files only, sizes bounded."""

    def __init__(self, pid: int) -> None:
        self.root = ""
        self.cwd = ""
        if os.path.isdir("/proc/self"):
            if os.access(f"/proc/{pid}/root/", os.X_OK):
                self.root = f"/proc/{pid}/root"
            if os.access(f"/proc/{pid}/cwd/", os.X_OK):
                self.cwd = f"/proc/{pid}/cwd"
        self.cache: dict[str, Optional[list[str]]] = {}
        self.budget = MAX_SOURCE_TOTAL
        # Root reading another user's process: the file names come from that process, so
        # a file is read only as that user could read it (a forked child with its
        # credentials), never with root's (a frame named /etc/shadow shows nothing).
        self.creds = _credentials(pid) if hasattr(os, "geteuid") and os.geteuid() == 0 else None
        if self.creds is not None and self.creds[0] == 0:
            self.creds = None
        self.deadline = time.monotonic() + SOURCE_TOTAL_SECONDS
        self.timed_out = 0  # files whose reading child was killed (or never started) for time

    def line(self, filename: str, lineno: Optional[int]) -> str:
        if not isinstance(filename, str) or not isinstance(lineno, int) or lineno < 1:
            return ""
        if filename not in self.cache:
            if len(self.cache) >= 2000:
                return ""
            try:
                self.cache[filename] = self._load(filename) if self.creds is None else self._load_as(filename)
            except Exception:
                self.cache[filename] = None
        lines = self.cache[filename]
        if lines is None or lineno > len(lines):
            return ""
        return escape(lines[lineno - 1].strip())

    def _path(self, filename: str) -> Optional[str]:
        if not filename or filename.startswith("<") or "\0" in filename or len(filename) > 4096:
            return None
        if os.path.isabs(filename):
            return self.root + filename
        if self.cwd:
            return os.path.join(self.cwd, filename)
        return None  # relative to a working directory we cannot see

    def _load_as(self, filename: str) -> Optional[list[str]]:
        """:meth:`_load` in a child process with the target's uid, gid and groups, within
        :data:`SOURCE_FILE_SECONDS` and what is left of :data:`SOURCE_TOTAL_SECONDS`: that
        user may signal the child (stop it), so past its time it is killed and reaped, and
        the file shows no lines."""
        import marshal
        import select
        import signal

        assert self.creds is not None
        if self._path(filename) is None or self.budget <= 0:
            return None
        now = time.monotonic()
        if now >= self.deadline:
            self.timed_out += 1
            return None
        deadline = min(now + SOURCE_FILE_SECONDS, self.deadline)
        uid, gid, groups = self.creds
        rfd, wfd = os.pipe()
        try:
            import warnings

            with warnings.catch_warnings():
                # 3.12+ warns of fork() in a process with threads; the child only reads a
                # file and exits, and a warning turned into an error (-W error) would leave
                # it running with no parent that waits for it
                warnings.simplefilter("ignore", DeprecationWarning)
                child = os.fork()
        except BaseException:
            os.close(rfd)
            os.close(wfd)
            raise
        if child == 0:  # pragma: no cover (the child's work is checked by its result)
            try:
                os.close(rfd)
                os.setgroups(groups)
                os.setgid(gid)
                os.setuid(uid)
                data = marshal.dumps(self._load(filename))
                view = memoryview(data)
                while view:
                    view = view[os.write(wfd, view):]
            finally:
                os._exit(0)
        os.close(wfd)
        chunks = []
        size = 0
        done = False
        try:
            poller = select.poll()
            poller.register(rfd, select.POLLIN)
            while size <= 4 * MAX_SOURCE_FILE + 1024:
                left = deadline - time.monotonic()
                if left <= 0 or not poller.poll(max(1, int(left * 1000 + 0.999))):
                    if time.monotonic() >= deadline:
                        break  # out of time: the child is killed below
                    continue
                chunk = os.read(rfd, 65536)
                if not chunk:
                    done = True
                    break
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(rfd)
            # At EOF the child has exited (its end of the pipe closes then); otherwise it is
            # stopped, slow or sending too much. SIGKILL ends even a stopped process, and the
            # wait reaps it: no zombie is left.
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass
            os.waitpid(child, 0)
        if not done:
            if size <= 4 * MAX_SOURCE_FILE + 1024:
                self.timed_out += 1
            return None
        if not chunks:
            return None
        lines = marshal.loads(b"".join(chunks))
        if not isinstance(lines, list) or not all(isinstance(x, str) for x in lines):
            return None
        self.budget -= sum(len(x) for x in lines)
        return lines

    def _load(self, filename: str) -> Optional[list[str]]:
        import stat

        path = self._path(filename)
        if path is None or self.budget <= 0:
            return None
        cloexec = getattr(os, "O_CLOEXEC", 0)
        o_path = getattr(os, "O_PATH", 0)
        flags = os.O_RDONLY | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_NONBLOCK", 0) | cloexec
        if o_path and os.path.isdir("/proc/self/fd"):
            # Look before opening: a device or FIFO is never opened for reading.
            pfd = os.open(path, o_path | cloexec)
            try:
                st = os.fstat(pfd)
                if not _plain_file(st) or os.readlink(f"/proc/self/fd/{pfd}").startswith(_PSEUDO):
                    return None
                fd = os.open(f"/proc/self/fd/{pfd}", flags)
            finally:
                os.close(pfd)
        else:
            st = os.stat(path)
            if not _plain_file(st) or os.path.realpath(path).startswith(_PSEUDO):
                return None
            fd = os.open(path, flags)
        try:
            st2 = os.fstat(fd)
            if not stat.S_ISREG(st2.st_mode) or (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
                return None
            chunks = []
            size = 0
            limit = min(MAX_SOURCE_FILE, self.budget)
            while size <= limit:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            if size > limit:
                return None
        finally:
            os.close(fd)
        self.budget -= size
        data = b"".join(chunks)
        return _decode_source(data).replace("\r\n", "\n").replace("\r", "\n").split("\n")


def _credentials(pid: int) -> Optional[tuple[int, int, list[int]]]:
    """(effective uid, effective gid, supplementary groups) of process ``pid``, or None."""
    raw = _read_small(f"/proc/{pid}/status", 65536)
    if raw is None:
        return None
    fields = {}
    for line in raw.decode("ascii", "replace").splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.split()
    try:
        return int(fields["Uid"][1]), int(fields["Gid"][1]), [int(g) for g in fields.get("Groups", [])]
    except (KeyError, IndexError, ValueError):
        return None


#: Where files are the kernel's (reading one may have effects, or never end), not sources.
_PSEUDO = ("/proc/", "/sys/", "/dev/")


def _plain_file(st: os.stat_result) -> bool:
    """A regular file of a size to read: an empty one (as /proc's and /sys's claim to be)
    has no lines to show anyway."""
    import stat

    return stat.S_ISREG(st.st_mode) and 0 < st.st_size <= MAX_SOURCE_FILE


def _decode_source(data: bytes) -> str:
    encoding = "utf-8"
    try:
        import io
        import tokenize

        encoding = tokenize.detect_encoding(io.BytesIO(data).readline)[0]
    except Exception:  # a bad coding cookie: show what UTF-8 makes of it
        pass
    try:
        return data.decode(encoding, "replace")
    except LookupError:
        return data.decode("utf-8", "replace")


# -- frames --------------------------------------------------------------------------------

def _frame(info: Any) -> Optional[tuple[str, Optional[int], str]]:
    """``(filename, lineno, funcname)`` of a FrameInfo of 3.14 (``lineno``) or 3.15
    (``location.lineno``), raw (not escaped)."""
    try:
        filename = info.filename
        funcname = info.funcname
    except Exception:
        return None
    lineno = getattr(info, "lineno", None)
    if lineno is None:
        location = getattr(info, "location", None)
        lineno = getattr(location, "lineno", None) if location is not None else None
    if not isinstance(lineno, int) or isinstance(lineno, bool):
        lineno = None
    return (filename if isinstance(filename, str) else str(filename),
            lineno, funcname if isinstance(funcname, str) else str(funcname))


def _is_monstack(filename: str) -> bool:
    """monstack's own modules (its thread and task wrappers), left out as in the usual
    report."""
    parts = filename.replace("\\", "/").split("/")
    if len(parts) >= 2 and parts[-2] == "monstack" and parts[-1].startswith("_"):
        return True
    return len(parts) >= 3 and parts[-3] == "monstack" and parts[-2].startswith("_")


def _records(frames: Sequence[Any]) -> tuple[list[tuple[str, Optional[int], str]], int]:
    """The reader's frames (innermost first) -> records outermost first, monstack's own
    left out, and the number of frames skipped for being past MAX_RAW_FRAMES."""
    try:
        n = len(frames)
    except Exception:
        return [], 0
    half = MAX_RAW_FRAMES // 2
    if n > MAX_RAW_FRAMES:
        picked: Iterable[Any] = list(frames[:half]) + list(frames[n - half:])
        skipped = n - 2 * half
    else:
        picked, skipped = frames, 0
    recs = []
    for info in picked:
        rec = _frame(info)
        if rec is not None and not _is_monstack(rec[0]):
            recs.append(rec)
    recs.reverse()
    return recs, skipped


def _format_frame(rec: tuple[str, Optional[int], str], sources: _Sources, color: bool) -> str:
    filename, lineno, name = escape(rec[0], 4096), rec[1], escape(rec[2])
    line_part = f"line {lineno}" if lineno is not None else "line ?"
    if color:
        m, r = _MAGENTA, _RESET
        lineno_text = f"{m}{lineno}{r}" if lineno is not None else "?"
        text = f'  File {m}"{filename}"{r}, line {lineno_text}, in {m}{name}{r}\n'
    else:
        text = f'  File "{filename}", {line_part}, in {name}\n'
    source = sources.line(rec[0], lineno)
    if source:
        text += f"    {source}\n"
    return text


def _format_records(recs: list[tuple[str, Optional[int], str]], sources: _Sources, color: bool,
                    skipped: int = 0) -> list[str]:
    """Records (outermost first) -> lines, recursion collapsed, the middle of stacks
    over MAX_FRAMES elided and counted (with the ``skipped`` ones)."""
    items: list[Any] = []  # records, and ints: "repeated N more times"
    last = None
    count = 0
    for rec in recs:
        if rec != last:
            if count > RECURSIVE_CUTOFF:
                items.append(count - RECURSIVE_CUTOFF)
            last, count = rec, 0
        count += 1
        if count <= RECURSIVE_CUTOFF:
            items.append(rec)
    if count > RECURSIVE_CUTOFF:
        items.append(count - RECURSIVE_CUTOFF)
    shown = [i for i, item in enumerate(items) if not isinstance(item, int)]
    gap_at, omitted = None, skipped
    if len(shown) > MAX_FRAMES:
        head = MAX_FRAMES // 2
        cut_from, cut_to = shown[head], shown[len(shown) - (MAX_FRAMES - head)]
        for item in items[cut_from:cut_to]:
            omitted += item if isinstance(item, int) else 1
        items = items[:cut_from] + [None] + items[cut_to:]
        gap_at = cut_from
    elif skipped:
        gap_at = len(items) // 2
        items = items[:gap_at] + [None] + items[gap_at:]
    out = []
    for i, item in enumerate(items):
        if i == gap_at and item is None:
            text = f"  ... {omitted} frame{'s' if omitted != 1 else ''} omitted ..."
            out.append(f"{_GREY}{text}{_RESET}\n" if color else text + "\n")
        elif isinstance(item, int):
            out.append(f"  [Previous line repeated {item} more time{'s' if item > 1 else ''}]\n")
        else:
            out.append(_format_frame(item, sources, color))
    return out


def _heading(text: str, color: bool) -> str:
    return f"{_BOLD}{text}{_RESET}\n" if color else f"{text}\n"


def _note(text: str, color: bool) -> str:
    return f"{_GREY}{text}{_RESET}\n" if color else f"{text}\n"


# -- reading -------------------------------------------------------------------------------

def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: Optional[BaseException] = exc
    while cur is not None and len(out) < 20:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _owner(pid: int) -> str:
    """" (user, uid N)" of the process's effective uid, or ""."""
    raw = _read_small(f"/proc/{pid}/status", 65536) or b""
    for line in raw.splitlines():
        if line.startswith(b"Uid:"):
            fields = line.split()
            if len(fields) > 2 and fields[2].isdigit():
                uid = int(fields[2])
                try:
                    import pwd

                    return f" ({escape(pwd.getpwuid(uid).pw_name)}, uid {uid})"
                except (ImportError, KeyError):
                    return f" (uid {uid})"
    return ""


def _permission_error(pid: int) -> ExternalError:
    return ExternalError(
        f"not permitted to attach to process {pid} (ptrace): run as its user{_owner(pid)} or root "
        f"and check /proc/sys/kernel/yama/ptrace_scope"
    )


def _attach_error(pid: int, exc: BaseException) -> ExternalError:
    """What the reader's refusal to attach means, in one line."""
    import re

    here = VERSION_TAG
    chain = _chain(exc)
    if any(isinstance(e, PermissionError) for e in chain):
        return _permission_error(pid)
    if any(isinstance(e, ProcessLookupError) for e in chain):
        return ExternalError(f"no such process: {pid}")
    text = " ".join(str(e) for e in chain)
    m = re.search(r"from a Python (\d+)\.(\d+) process to a Python (\d+)\.(\d+) process", text)
    theirs: Optional[tuple[int, int]] = None
    if m:
        theirs = int(m.group(3)), int(m.group(4))
    elif "PyRuntime" in text:
        theirs = _sniff_version(pid)
        if theirs is None:
            return ExternalError(f"process {pid} is not a Python process (no Python runtime found in it)")
    if theirs is not None:
        version = f"{theirs[0]}.{theirs[1]}"
        if theirs < READABLE_SINCE:
            return ExternalError(
                f"process {pid} runs Python {version}: reading stacks from outside needs CPython 3.14+ in the target"
            )
        if version != here:
            return ExternalError(
                f"process {pid} runs Python {version}, this is {here}: run python{version} -m monstack dump {pid}"
            )
    return ExternalError(f"cannot read process {pid}: {escape(text)}")


def _retry(call: Any, pid: int) -> Any:
    """``call()``, again when the target's memory changed under the reader."""
    for attempt in range(RETRIES + 1):
        try:
            return call()
        except PermissionError:
            raise _permission_error(pid) from None
        except ProcessLookupError:
            raise ExternalError(f"no such process: {pid}") from None
        except (RuntimeError, OSError, UnicodeDecodeError, MemoryError, ValueError):
            if attempt == RETRIES:
                raise
            time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")


class _Thread:
    __slots__ = ("tid", "interp", "frames", "status", "interp_main", "main")

    def __init__(self, tid: int, interp: Optional[int], frames: Any, status: Optional[int]) -> None:
        self.tid = tid
        self.interp = interp
        self.frames = frames
        self.status = status
        #: The main thread of its interpreter (3.15's flag; 3.14: found by _read)
        self.interp_main = bool(status is not None and status & _STATUS_MAIN_THREAD)
        #: The process's main thread: the main interpreter's main thread.
        self.main = self.interp_main and not interp


def _threads_of(result: Any) -> list[_Thread]:
    """3.14: [ThreadInfo]; 3.15: [InterpreterInfo(interpreter_id, threads=[ThreadInfo])]."""
    out: list[_Thread] = []
    for item in list(result)[: MAX_THREADS * 4]:
        threads = getattr(item, "threads", None)
        if threads is not None:
            interp = getattr(item, "interpreter_id", None)
            for t in list(threads)[: MAX_THREADS * 4]:
                out.append(_Thread(t.thread_id, interp, t.frame_info, getattr(t, "status", None)))
        else:
            out.append(_Thread(item.thread_id, None, item.frame_info, getattr(item, "status", None)))
    return out


def _unwinder(rd: Any, pid: int, **kwargs: Any) -> Any:
    try:
        return rd.RemoteUnwinder(pid, **kwargs)
    except Exception as exc:
        raise _attach_error(pid, exc) from None


class _Reading:
    """What the reader gave: the threads, why some could not be read, the asyncio tasks
    (the reader's awaited-by result), the ids of the running ones, why there are none."""

    def __init__(self, threads: list[_Thread], partial: Optional[str] = None, awaited: Any = None,
                 running: Optional[set] = None, why_no_tasks: Optional[str] = None) -> None:
        self.threads = threads
        self.partial = partial
        self.awaited = awaited
        self.running = running if running is not None else set()
        self.why_no_tasks = why_no_tasks
        self.other_interp: Optional[str] = None


def _read(pid: int) -> _Reading:
    try:
        import _remote_debugging as rd  # type: ignore[import-not-found]
    except ImportError:
        raise ExternalError(
            f"this Python {VERSION_TAG} has no _remote_debugging module: reading a process from outside needs CPython 3.14+"
        ) from None
    _check_process(pid)
    unwinder = _unwinder(rd, pid, all_threads=True)
    partial = None
    main_ids: Optional[set] = None
    try:
        threads = _threads_of(_retry(unwinder.get_stack_trace, pid))
    except ExternalError:
        raise
    except Exception as exc:
        # One thread the reader gives up on (a stack deeper than it walks: "Too many stack
        # frames") fails the whole read: the main thread alone, then.
        partial = f"the stacks of the other threads could not be read: {escape(exc)}"
        try:
            threads = _threads_of(_retry(_unwinder(rd, pid).get_stack_trace, pid))
        except ExternalError:
            raise
        except Exception as exc2:
            partial = f"no thread's stack could be read: {escape(exc2)}"
            threads = []
        main_ids = {t.tid for t in threads}
    other_interp = None
    if threads and not any(t.interp_main for t in threads):
        # 3.14 has no status flags; without all_threads it reads the main thread only.
        if main_ids is None:
            try:
                main_ids = {t.tid for t in _threads_of(_retry(_unwinder(rd, pid).get_stack_trace, pid))}
            except Exception:
                main_ids = {pid}  # the thread that started the process: the usual main thread
        # 3.14 reads one interpreter, the newest: with a subinterpreter, not the main one,
        # whose main thread is (Python started in it) the process's first thread.
        subinterpreter = pid not in main_ids and pid in _os_threads(pid)
        for t in threads:
            t.interp_main = t.tid in main_ids
            t.main = t.interp_main and not subinterpreter
        if subinterpreter:
            other_interp = (
                "CPython 3.14's reader reads one interpreter only, the most recently created: "
                "these are a subinterpreter's threads, the main interpreter's are not shown"
            )
    reading = _Reading(threads, partial)
    reading.other_interp = other_interp
    try:
        reading.awaited = _retry(unwinder.get_all_awaited_by, pid)
    except ExternalError:
        raise
    except RuntimeError as exc:
        if "AsyncioDebug" not in str(exc):  # (not there: asyncio's C part is not loaded)
            reading.why_no_tasks = f"asyncio tasks could not be read: {escape(exc)}"
    except Exception as exc:
        reading.why_no_tasks = f"asyncio tasks could not be read: {escape(exc)}"
    if reading.awaited is not None:
        try:
            for info in list(_retry(unwinder.get_async_stack_trace, pid))[:MAX_THREADS]:
                tasks = list(getattr(info, "awaited_by", ()) or ())
                if tasks:
                    reading.running.add(tasks[0].task_id)
        except Exception:
            pass
    if not reading.threads and reading.awaited is None:
        raise ExternalError(f"cannot read the stacks of process {pid}: {partial}")
    return reading


# -- the report ----------------------------------------------------------------------------

def _thread_heading(t: _Thread, pid: int, names: dict, show_interp: bool, color: bool) -> str:
    details = [f"native id {t.tid}"]
    if show_interp and t.interp is not None:
        details.append(f"interpreter {t.interp}")
    state = _thread_state(pid, t.tid)
    if state:
        details.append(state)
    if t.interp_main and not t.main:
        details.append("its interpreter's main thread")
    if t.status is not None and t.status & _STATUS_HAS_GIL:
        details.append("holds the GIL")
    if t.main:
        return _heading(f"Main thread ({', '.join(details)}):", color)
    name = names.get(t.tid)
    label = f'Thread "{escape(name)}"' if name is not None else "Thread"
    return _heading(f"{label} ({', '.join(details)}):", color)


def _thread_label(tid: int, names: dict, main_ids: set) -> str:
    if tid in main_ids:
        return f"the main thread (native id {tid})"
    name = names.get(tid)
    return f'thread "{escape(name)}" (native id {tid})' if name is not None else f"thread (native id {tid})"


def _is_loop_frame(rec: tuple[str, Optional[int], str]) -> bool:
    return rec[2].endswith("run_forever") and rec[0].replace("\\", "/").endswith("asyncio/base_events.py")


def _task_key(task: Any) -> tuple[str, int]:
    task_id = task.task_id
    return str(task.task_name), task_id if isinstance(task_id, int) else 0


def _task_sections(awaited: Any, running: set, names: dict, main_ids: set, sources: _Sources,
                   color: bool) -> Iterable[tuple[str, list[str]]]:
    """("tasks", lines) for each thread's heading and each task, bounded."""
    groups: list[tuple[int, list]] = []
    total = 0
    for info in list(awaited)[: MAX_THREADS * 4]:
        tasks = list(getattr(info, "awaited_by", ()) or ())
        if tasks:
            groups.append((info.thread_id, tasks))
            total += len(tasks)
    task_names: dict[int, str] = {}
    awaiting: dict[int, list[int]] = {}  # task id -> ids of the tasks it awaits
    indexed = 0
    for _, tasks in groups:
        for task in tasks[: max(0, MAX_TASKS - indexed)]:
            indexed += 1
            task_names[task.task_id] = escape(task.task_name)
            for coro in list(task.awaited_by or ())[:MAX_AWAITERS]:
                awaiting.setdefault(coro.task_name, []).append(task.task_id)

    def label(task_id: Any) -> str:
        name = task_names.get(task_id)
        ident = f"id {task_id:#x}" if isinstance(task_id, int) else f"id {escape(task_id)}"
        return f'task "{name}" ({ident})' if name is not None else f"a task ({ident})"

    shown = 0
    for tid, tasks in groups:
        if shown >= MAX_TASKS:
            break
        where = _thread_label(tid, names, main_ids) if tid else "no live thread (the interpreter's list)"
        n = len(tasks)
        yield "tasks", ["\n", _heading(f"Asyncio tasks of {where}, {n} task{'s' if n != 1 else ''}:", color)]
        for task in sorted(tasks[:MAX_TASKS], key=_task_key):
            if shown >= MAX_TASKS:
                break
            shown += 1
            state = "running" if task.task_id in running else "pending"
            ident = f"id {task.task_id:#x}, " if isinstance(task.task_id, int) else ""
            name = task_names.get(task.task_id) or escape(task.task_name)
            lines = ["\n", _heading(f'Task "{name}" ({ident}{state}):', color)]
            lines.append(AWAIT_HEADING + "\n")
            frames: list = []
            for coro in list(task.coroutine_stack or ())[:16]:
                frames.extend(list(coro.call_stack or ())[:MAX_RAW_FRAMES])
            recs, skipped = _records(frames)
            if recs:
                lines.extend(_format_records(recs, sources, color, skipped))
            else:
                lines.append("  (no coroutine frames)\n")
            for child in awaiting.get(task.task_id, [])[:MAX_AWAITERS]:
                lines.append(f"  awaiting {label(child)}\n")
            for coro in list(task.awaited_by or ())[:MAX_AWAITERS]:
                lines.append(f"  awaited by {label(coro.task_name)}\n")
            yield "tasks", lines
    if total > shown:
        yield "tasks", ["\n", _note(f"({total - shown} more task(s) not shown)", color)]


def report(pid: int, *, color: bool = False) -> str:
    """Every thread's stack and the asyncio tasks of process ``pid``, read from outside;
    raises :class:`ExternalError` with the one line to show when it cannot be read."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise ExternalError(f"{pid!r} is not a process id")
    reading = _read(pid)
    threads, awaited, running, why = reading.threads, reading.awaited, reading.running, reading.why_no_tasks
    sources = _Sources(pid)
    names = {}
    for t in threads[:MAX_THREADS]:
        if not t.main:
            names[t.tid] = _thread_name(pid, t.tid)
    main_ids = {t.tid for t in threads if t.main}
    # main thread first, then by native id (creation order, mostly)
    threads.sort(key=lambda t: (not t.main, t.interp or 0, t.tid))
    interps = {t.interp for t in threads}
    show_interp = len(interps) > 1

    parts: list[str] = []
    size = 0
    skipped = {"threads": 0, "tasks": 0}

    def add(kind: str, lines: list[str]) -> None:
        nonlocal size
        text = "".join(lines)
        n = len(text.encode("utf-8", "backslashreplace"))
        if size + n > LIMIT_BYTES and parts:
            skipped[kind] += 1
            return
        parts.append(text)
        size += n

    version = VERSION_TAG
    now = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    n = len(threads)
    add("threads", [
        _heading(f"monstack dump: process {pid}, CPython {version}, read from outside (_remote_debugging), "
                 f"{now}, {n} thread{'s' if n != 1 else ''}", color),
        _note("(Read from the process's memory: the process ran no code for it. Origins (\"Work created at\", "
              "\"Task created at\") are not available this way; thread names are the OS's, 15 bytes at most.)",
              color),
    ])
    loops_elsewhere = []
    for t in threads[:MAX_THREADS]:
        recs, raw_skipped = _records(t.frames)
        lines = ["\n", _thread_heading(t, pid, names, show_interp, color), STACK_HEADING + "\n"]
        if recs:
            lines.extend(_format_records(recs, sources, color, raw_skipped))
        else:
            lines.append("  (no Python frames)\n")
        add("threads", lines)
        if not t.main and any(_is_loop_frame(r) for r in recs):
            loops_elsewhere.append(t.tid)
    if len(threads) > MAX_THREADS:
        add("threads", ["\n", _note(f"({len(threads) - MAX_THREADS} more Python thread(s) not shown)", color)])
    for problem in (reading.partial, reading.other_interp):
        if problem:
            add("threads", ["\n", _note(f"({problem})", color)])
    python_tids = {t.tid for t in threads}
    others = [tid for tid in _os_threads(pid) if tid not in python_tids]
    if others:
        listed = ", ".join(
            f'"{escape(_thread_name(pid, tid) or "?")}" ({tid})' for tid in others[:20]
        ) + (", ..." if len(others) > 20 else "")
        if reading.partial or reading.other_interp:
            what = "not read"
        elif not READS_EVERY_INTERPRETER:
            what = "not seen by the reader (no Python thread state)"
        else:
            what = "run no Python code"
        add("threads", ["\n", _note(f"{len(others)} more OS thread(s) {what}: {listed}", color)])

    if why:
        add("tasks", ["\n", _note(f"({why})", color)])
    if awaited is not None:
        with_tasks = {getattr(info, "thread_id", None) for info in list(awaited)[: MAX_THREADS * 4]
                      if getattr(info, "awaited_by", None)}
        if not TASKS_OF_EVERY_THREAD:
            for tid in loops_elsewhere:
                if tid not in with_tasks:
                    add("tasks", ["\n", _note(
                        f"(An event loop runs in {_thread_label(tid, names, main_ids)}: CPython 3.14's reader "
                        f"lists the asyncio tasks of the main thread only, so its tasks are not shown.)", color)])
        try:
            for kind, lines in _task_sections(awaited, running, names, main_ids, sources, color):
                add(kind, lines)
        except Exception as exc:
            add("tasks", ["\n", _note(f"(asyncio tasks could not be reported: {escape(exc)})", color)])
    if sources.timed_out and sources.creds is not None:
        parts.append("\n" + _note(
            f"(No source lines for {sources.timed_out} file(s): reading them as the process's user (uid "
            f"{sources.creds[0]}) took longer than allowed ({SOURCE_FILE_SECONDS:g} s a file, "
            f"{SOURCE_TOTAL_SECONDS:g} s in all).)", color))
    if not READS_NON_ASCII and "\\x00" in "".join(parts[1:]):
        parts.append("\n" + _note("(CPython 3.14's reader misreads some names that are not ASCII (task names, "
                                  "file names outside Latin-1): they show as \\x00 sequences.)", color))
    if skipped["threads"] or skipped["tasks"]:
        parts.append(_note(f"\n[report cut at {LIMIT_BYTES} bytes: {skipped['threads']} more thread section(s) "
                           f"and {skipped['tasks']} more task section(s) not shown]", color))
    return "".join(parts)


def main(argv: Sequence[str]) -> int:
    """``[--color] PID``: the report on stdout (UTF-8), or ``ExternalError: message`` on
    stderr and exit status 2."""
    args = list(argv)
    color = False
    if "--color" in args:
        args.remove("--color")
        color = True
    try:
        if len(args) != 1:
            raise ExternalError("usage: _dumpext [--color] PID")
        try:
            pid = int(args[0])
        except ValueError:
            raise ExternalError(f"PID '{escape(args[0])}' is not a process id") from None
        text = report(pid, color=color)
    except ExternalError as exc:
        sys.stderr.write(f"ExternalError: {exc}\n")
        sys.stderr.flush()
        return 2
    except Exception as exc:  # a bug here, or a reader that broke in a new way: one line
        sys.stderr.write(f"ExternalError: reading the process failed: {type(exc).__name__}: {escape(exc)}\n")
        sys.stderr.flush()
        return 2
    out = getattr(sys.stdout, "buffer", None)
    if out is not None:
        sys.stdout.flush()
        out.write(text.encode("utf-8", "backslashreplace"))
        out.flush()
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
