"""``python -m monstack dump PID``: another process's monstack report, on stdout.

Three ways in, the first that applies:

- **The dump signal** (any version): the target declared ``MONSTACK_DUMP_SIGNAL`` (read
  from ``/proc/PID/environ``), ``/proc/PID/status`` shows a handler for it (``SigCgt``), and
  monstack's marker says monstack armed it in this process (``_dumpproto.read_armed``,
  keyed by pid and start time). Never a signal monstack refuses to arm (INT, TERM...). Sent
  through a pidfd after the start time is checked again. It reaches a main thread blocked
  in sleep, a lock or a join.
- **``sys.remote_exec``** (PEP 768, targets on CPython 3.14+): run with the target's own
  interpreter when it is not this one (caller and target versions must match), and only
  when ``_dumptrust`` finds nothing in it that another user than root or the caller can
  change. The script runs when the target's main thread next runs Python.
- **From outside** (3.14+, ``_dumpext``): when the main thread has not run the script
  within ``REMOTE_WAIT`` seconds, or the signal got no answer, every thread's stack is read
  from the process's memory; no origins.

The report travels through the target user's private directory (see ``_dumpproto``). Bad
input and every failure are one line on stderr and exit status 1. Linux only (``/proc``).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from typing import Optional, Sequence

from . import _dumpproto as proto
from . import _env
from ._settings import DUMP_SIGNAL_ENV, env_dump_signal

PROG = "python -m monstack dump"
USAGE = f"usage: {PROG} PID [--timeout SECONDS]"
DEFAULT_TIMEOUT = 10.0
HOW_TO_SIGNAL = "start it with MONSTACK=1 MONSTACK_DUMP_SIGNAL=USR1 to dump it at any time"
#: Run with the target's interpreter when it is not this one: sys.remote_exec, errors as
#: one line "ExceptionName: message" on stderr (exit 2), or "no-remote-exec X.Y" (exit 3).
_HELPER = (
    "import sys\n"
    "if not hasattr(sys, 'remote_exec'):\n"
    "    sys.stderr.write('no-remote-exec %d.%d\\n' % sys.version_info[:2]); sys.exit(3)\n"
    "try:\n"
    "    sys.remote_exec(int(sys.argv[1]), sys.argv[2])\n"
    "except Exception as e:\n"
    "    sys.stderr.write('%s: %s\\n' % (type(e).__name__, e)); sys.exit(2)\n"
)


class DumpError(Exception):
    """Why the dump failed: the one line the command prints."""


class _Target:
    """What /proc says about the target process."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        if not sys.platform.startswith("linux"):
            raise DumpError(f"dumping another process needs Linux (/proc); this is {sys.platform}")
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                status = f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            raise DumpError(f"no such process: {pid}") from None
        except OSError as exc:
            raise DumpError(f"cannot read /proc/{pid}/status: {exc.strerror}") from None
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        try:
            self.uid = int(fields["Uid"].split()[1])  # effective
            self.gid = int(fields["Gid"].split()[1])
            self.caught = int(fields.get("SigCgt", "0").strip() or "0", 16)
        except (KeyError, ValueError, IndexError):
            raise DumpError(f"cannot read /proc/{pid}/status") from None
        if fields.get("State", "").split()[:1] == ["Z"]:
            raise DumpError(f"process {pid} has ended (a zombie)")
        self.start_time = proto.start_time(pid)
        if self.start_time is None:
            raise DumpError(f"no such process: {pid}")
        # Another pid namespace (a container): the pid the target knows itself by, which
        # names its exchange files (NSpid's last field).
        nspid = fields.get("NSpid", "").split()
        self.own_pid = int(nspid[-1]) if nspid and nspid[-1].isdigit() else pid
        # Another mount namespace: its /tmp and /run are reached through /proc/PID/root.
        self.foreign_root = _namespace(pid, "mnt") != _namespace(os.getpid(), "mnt")
        # Another user namespace: the uid the target sees itself as (uid_map), for names.
        self.name_uid = self.uid
        if _namespace(pid, "user") != _namespace(os.getpid(), "user"):
            inner = _inner_uid(pid, self.uid)
            if inner is None:
                raise DumpError(f"process {pid} runs in a user namespace that does not map uid {self.uid}")
            self.name_uid = inner
        me = os.geteuid()
        if me != 0 and me != self.uid:
            raise DumpError(f"not permitted: process {pid} belongs to uid {self.uid} (run as that user or root)")
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise DumpError(f"no such process: {pid}") from None
        except PermissionError:
            raise DumpError(f"not permitted to inspect process {pid} (uid {self.uid})") from None
        except OSError as exc:
            raise DumpError(f"cannot read /proc/{pid}/environ: {exc.strerror}") from None
        self.environ: dict[str, str] = {}
        for item in raw.split(b"\0"):
            key, sep, value = item.partition(b"=")
            if sep:
                self.environ[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")

    def declared_signal(self) -> str:
        """The dump signal the process declared: ``MONSTACK_DUMP_SIGNAL`` in the environment
        it started with, or ``--dump-signal`` of ``python -m monstack run`` (which sets the
        variable only after start)."""
        declared = self.environ.get(DUMP_SIGNAL_ENV, "").strip()
        try:
            with open(f"/proc/{self.pid}/cmdline", "rb") as f:
                argv = [a.decode("utf-8", "replace") for a in f.read().split(b"\0")[:-1]]
        except OSError:
            return declared
        for i in range(len(argv) - 2):
            if argv[i : i + 3] == ["-m", "monstack", "run"]:
                from ._run import split_argv

                options = split_argv(argv[i + 3 :])[0]
                for j, word in enumerate(options):
                    if word.startswith("--dump-signal="):
                        declared = word.split("=", 1)[1].strip()
                    elif word == "--dump-signal" and j + 1 < len(options):
                        declared = options[j + 1].strip()
                break
        return declared

    def handles(self, signum: int) -> bool:
        return bool(self.caught >> (signum - 1) & 1)

    def alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"State:"):
                        return line.split()[1:2] != [b"Z"]
        except OSError:
            return False
        return True


def _namespace(pid: int, kind: str) -> Optional[int]:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def _inner_uid(pid: int, uid: int) -> Optional[int]:
    """``uid`` (as this process sees it) as process ``pid``'s user namespace sees it."""
    try:
        with open(f"/proc/{pid}/uid_map", "rb") as f:
            lines = f.read(65536).decode("ascii", "replace").splitlines()
    except OSError:
        return None
    for line in lines:
        words = line.split()
        if len(words) == 3 and all(w.isdigit() for w in words):
            inside, outside, count = map(int, words)
            if outside <= uid < outside + count:
                return inside + uid - outside
    return None


def _parse(argv: Sequence[str]) -> tuple[int, float]:
    pid: Optional[int] = None
    timeout = DEFAULT_TIMEOUT
    args = list(argv)
    i = 0
    while i < len(args):
        word = args[i]
        if word in ("-h", "--help"):
            raise SystemExit(_help())
        if word == "--timeout" or word.startswith("--timeout="):
            if "=" in word:
                text = word.split("=", 1)[1]
            elif i + 1 < len(args):
                i += 1
                text = args[i]
            else:
                raise DumpError("--timeout needs a number of seconds")
            try:
                timeout = float(text)
            except ValueError:
                raise DumpError(f"--timeout {text!r}: not a number of seconds") from None
            if not timeout > 0 or timeout != timeout or timeout == float("inf"):
                raise DumpError(f"--timeout {text!r}: must be a number of seconds > 0")
        elif word.startswith("-") and not word.lstrip("-").isdigit():
            raise DumpError(f"unknown option {word!r} ({USAGE})")
        elif pid is None:
            try:
                pid = int(word)
            except ValueError:
                raise DumpError(f"PID {word!r} is not a process id ({USAGE})") from None
            if pid <= 0:
                raise DumpError(f"PID {word!r} is not a process id ({USAGE})")
        else:
            raise DumpError(f"unexpected argument {word!r} ({USAGE})")
        i += 1
    if pid is None:
        raise DumpError(f"no PID given ({USAGE})")
    return pid, timeout


def _help() -> int:
    sys.stdout.write(
        f"{USAGE}\n\n"
        "Print another Python process's monstack report: every thread's stack and where its work\n"
        "came from, every pending asyncio task. Linux only (it reads /proc).\n\n"
        "Ways in, the first that applies:\n"
        "  1. the process's dump signal: it was started with MONSTACK=1 MONSTACK_DUMP_SIGNAL=USR1\n"
        "     (or 'python -m monstack run --dump-signal USR1'); works while its main thread is blocked\n"
        "  2. sys.remote_exec (the process runs CPython 3.14+): the report runs when its main thread\n"
        f"     next runs Python; after {REMOTE_WAIT:g} s without, the stacks are read from outside the\n"
        "     process (no origins). Needs permission to debug it: its user or root.\n"
        "Root never runs an interpreter that another user can change: it names the one to run instead.\n\n"
        f"  --timeout SECONDS  how long to wait for the answer (default {DEFAULT_TIMEOUT:g})\n"
        "  -h, --help         this text\n"
    )
    return 0


def _color() -> bool:
    try:
        from ._colorize import resolve

        return resolve(None, sys.stdout)
    except Exception:
        return False


class _Exchange:
    """One request in the target user's private directory."""

    def __init__(self, target: _Target) -> None:
        self.target = target
        self.token = secrets.token_hex(8)
        self.pid = target.own_pid  # the name the target knows itself by
        self.root: Optional[int] = None
        if target.foreign_root:
            self.root = _open_root(target)
        where = dict(root=self.root, name_uid=target.name_uid)
        # Never make (mkdir, then chown) a directory in a tree the target's user controls
        # (another mount namespace: a bind mount put on the new name in between would get
        # chowned): there the directory must exist already, made by the target itself.
        create = self.root is None
        try:
            try:
                self.dirfd = proto.open_private_dir(target.uid, create=create, gid=target.gid, **where)
            except proto.Refused as exc:
                raise DumpError(f"refusing to use the exchange directory: {exc}") from None
            except PermissionError as exc:
                raise DumpError(f"not permitted to create {self.path()}: {exc.strerror}") from None
            except OSError as exc:
                raise DumpError(f"cannot create {self.path()}: {exc.strerror}") from None
        except BaseException:
            if self.root is not None:
                os.close(self.root)
            raise
        self.answered = False
        self.posted = False
        if self.pid == target.pid:  # (names of another pid namespace say nothing here)
            proto.clean_stale(self.dirfd)

    def path(self) -> str:
        """The private directory as the target sees it (prefixed, for a message, with where
        the caller reaches it)."""
        return proto.dir_path(self.target.uid, self.root, self.target.name_uid)

    def armed(self) -> Optional[int]:
        """The signal monstack's handler in the target armed (its marker), or None."""
        assert self.target.start_time is not None
        try:
            return proto.find_armed(self.pid, self.target.start_time, self.target.uid, self.root,
                                    self.target.name_uid)
        except (OSError, proto.Refused):
            return None

    def post(self) -> None:
        color = "color" if _color() else "plain"
        try:
            proto.write_new(
                self.dirfd, proto.request_name(self.pid, self.token),
                f"{proto.MAGIC} {self.token} {color}\n".encode(), uid=self.target.uid, gid=self.target.gid,
            )
        except OSError as exc:
            raise DumpError(
                f"cannot write the request in {self.path()}: {exc.strerror}"
            ) from None
        self.posted = True

    def script(self) -> str:
        """Write the remote script (this module's protocol, then one call); its path."""
        source = _proto_source()
        name = proto.script_name(self.pid, self.token)
        path = os.path.join(self.path(), name)  # as the target opens it
        if self.root is not None:
            # sys.remote_exec checks here that the file exists, the target opens it there:
            # /proc/PID/root/... names the same file in both (PID: the same in both).
            if self.pid != self.target.pid:
                raise DumpError(
                    f"process {self.target.pid} runs in another pid namespace (its own pid is {self.pid}): "
                    f"sys.remote_exec cannot name a file for it; {HOW_TO_SIGNAL}"
                )
            path = f"/proc/{self.pid}/root{path}"
        call = (
            "\ntry:\n"
            f"    serve_remote({self.pid}, {self.token!r}, {path!r})\n"
            "except Exception:\n"  # KeyboardInterrupt/SystemExit: CPython prints them at least
            "    pass\n"
        )
        proto.write_new(self.dirfd, name, (source + call).encode("utf-8"), uid=self.target.uid, gid=self.target.gid)
        return path

    def wait(self, timeout: float) -> Optional[str]:
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            try:
                text = proto.read_output(self.dirfd, self.pid, self.token, self.target.uid)
            except (OSError, proto.Refused) as exc:
                raise DumpError(f"cannot read the answer: {exc}") from None
            if text is not None:
                self.answered = True
                return text
            if not self.target.alive():
                raise DumpError(f"process {self.target.pid} ended before answering")
            if time.monotonic() >= deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def abandon(self) -> None:
        """The request will never be served (``sys.remote_exec`` failed): remove its files."""
        proto.remove_script(self.dirfd, self.pid, self.token, self.target.uid)
        self.posted = False

    def close(self) -> None:
        if self.posted and not self.answered:
            proto.withdraw(self.dirfd, self.pid, self.token, self.target.uid, self.target.gid)
        os.close(self.dirfd)
        if self.root is not None:
            os.close(self.root)


def _open_root(target: _Target) -> int:
    """The target's root directory (``/proc/PID/root``: its mount namespace's ``/``), once
    the pid is checked to still name the process that was read."""
    try:
        fd = os.open(f"/proc/{target.pid}/root", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
    except PermissionError:
        raise DumpError(f"not permitted to reach process {target.pid}'s files (/proc/{target.pid}/root)") from None
    except OSError as exc:
        raise DumpError(f"cannot reach process {target.pid}'s files: {exc.strerror}") from None
    if proto.start_time(target.pid) != target.start_time:
        os.close(fd)
        raise DumpError(f"process {target.pid} has ended (its pid now names another process)")
    return fd


def _proto_source() -> str:
    path = proto.__file__
    if path.endswith((".pyc", ".pyo")):
        raise DumpError("monstack's _dumpproto source is not installed (needed for the remote path)")
    with open(path, encoding="utf-8") as f:
        return f.read()


def _same_interpreter(pid: int) -> bool:
    try:
        mine = os.stat(sys.executable)
        theirs = os.stat(f"/proc/{pid}/exe")
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)


def _remote_error(pid: int, text: str) -> DumpError:
    """``ExceptionName: message`` from ``sys.remote_exec`` -> the one line to print."""
    name, _, message = text.partition(": ")
    if name == "PermissionError" or "Operation not permitted" in message or "ermission denied" in message:
        return DumpError(
            f"not permitted to attach to process {pid} ({message.strip() or name}); run as its user or root, "
            f"and check /proc/sys/kernel/yama/ptrace_scope; or {HOW_TO_SIGNAL}"
        )
    if name == "ProcessLookupError":
        return DumpError(f"no such process: {pid}")
    if "PyRuntime" in message or "address lookup failed" in message or "not a Python process" in message:
        return DumpError(f"process {pid} is not a Python process (no CPython runtime found in it)")
    if "not enabled in the remote process" in message:
        return DumpError(
            f"remote debugging is disabled in process {pid} (PYTHON_DISABLE_REMOTE_DEBUG or "
            f"-X disable-remote-debug); {HOW_TO_SIGNAL}"
        )
    if "not enabled" in message:
        return DumpError("remote debugging is disabled in this interpreter (PYTHON_DISABLE_REMOTE_DEBUG is set here)")
    return DumpError(
        f"cannot run code in process {pid} with sys.remote_exec ({text.strip()}): is it CPython 3.14+ "
        f"of the same version? {HOW_TO_SIGNAL}"
    )


def _user_name(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _target_interpreter(target: _Target) -> str:
    """The path of the target's interpreter, once checked safe for this caller to run:
    nothing in it may be changed by anyone but root and the caller (``_dumptrust``)."""
    pid = target.pid
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except PermissionError:
        raise DumpError(f"not permitted to inspect process {pid} (uid {target.uid})") from None
    except OSError:
        raise DumpError(f"process {pid} is not a Python process (no executable)") from None
    from ._dumptrust import Untrusted, check

    me = os.geteuid()
    try:
        check(exe, pid, {0, me})
    except Untrusted as exc:
        shown = exe.removesuffix(" (deleted)")
        raise DumpError(
            f"refusing to run process {pid}'s interpreter {shown} as {_user_name(me)}: {exc}; run "
            f"'{shown} -m monstack dump {pid}' as {_user_name(target.uid)} instead, or {HOW_TO_SIGNAL}"
        ) from None
    return exe


def _run_interpreter(exe: str, args: Sequence[str], timeout: float) -> "subprocess.CompletedProcess[str]":
    env = {k: v for k, v in os.environ.items() if not k.startswith("MONSTACK")}
    try:
        return subprocess.run(
            [exe, "-I", "-S", *args], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, timeout=timeout, text=True, errors="replace",
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise DumpError(f"cannot run the interpreter {exe}: {exc}") from None


def _remote_exec(target: _Target, script: str, why_no_signal: str) -> None:
    pid = target.pid
    # sys.remote_exec names the process by pid alone: the one read must still be there
    if proto.start_time(pid) != target.start_time:
        raise DumpError(f"process {pid} has ended (its pid now names another process)")
    if _same_interpreter(pid) and hasattr(sys, "remote_exec"):
        try:
            sys.remote_exec(pid, script)
        except Exception as exc:
            raise _remote_error(pid, f"{type(exc).__name__}: {exc}") from None
        return
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except PermissionError:
        raise DumpError(f"not permitted to inspect process {pid} (uid {target.uid})") from None
    except OSError:
        raise DumpError(f"process {pid} is not a Python process (no executable)") from None
    base = os.path.basename(exe.removesuffix(" (deleted)"))
    if not base.startswith(("python", "pypy")):
        # Not a python executable (embedded Python?): never run an unknown program. This
        # interpreter may still be the right version.
        if hasattr(sys, "remote_exec"):
            try:
                sys.remote_exec(pid, script)
            except Exception as exc:
                raise _remote_error(pid, f"{type(exc).__name__}: {exc}") from None
            return
        raise DumpError(
            f"{why_no_signal}, and this Python {_env.VERSION_TAG} cannot attach to "
            f"it ({base} is not a Python 3.14+ interpreter); {HOW_TO_SIGNAL}"
        )
    exe = _target_interpreter(target)
    done = _run_interpreter(exe, ["-c", _HELPER, str(pid), script], 60)
    lines = (done.stderr or "").strip().splitlines()
    last = lines[-1] if lines else f"exit status {done.returncode}"
    if done.returncode == 3 and last.startswith("no-remote-exec"):
        version = last.split()[-1]
        raise DumpError(
            f"{why_no_signal}, and it runs Python {version}, older than 3.14 (no sys.remote_exec); {HOW_TO_SIGNAL}"
        )
    if done.returncode != 0:
        raise _remote_error(pid, last)


def _send(target: _Target, signum: int) -> None:
    """Signal the very process ``target`` read: through a pidfd, checked against the start
    time, so a pid reused since then is never signalled."""
    import signal

    pid = target.pid
    fd = -1
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise DumpError(f"no such process: {pid}") from None
    except (AttributeError, OSError):
        fd = -1  # no pidfd here (old kernel): the start time check below still narrows the race
    try:
        if proto.start_time(pid) != target.start_time:
            raise DumpError(f"process {pid} has ended (its pid now names another process)")
        try:
            if fd >= 0:
                signal.pidfd_send_signal(fd, signum)
            else:
                os.kill(pid, signum)
        except ProcessLookupError:
            raise DumpError(f"process {pid} has ended") from None
        except PermissionError:
            raise DumpError(f"not permitted to signal process {pid} (uid {target.uid})") from None
    finally:
        if fd >= 0:
            os.close(fd)


def _external(target: _Target, why: str) -> str:
    """Every thread's stack read from outside the process (CPython 3.14+'s remote-debugging
    reader, see ``_dumpext``), with a first line saying why and what is missing."""
    pid = target.pid
    from . import _dumpext

    header = f"[python -m monstack dump: {why}: the stacks below were read from outside the process]\n"
    theirs = _target_version(pid)
    if _env.REMOTE_DEBUGGING and (theirs is None or _env.is_this_version(theirs)):
        try:
            return header + _dumpext.report(pid, color=_color())
        except _dumpext.ExternalError as exc:
            raise DumpError(str(exc)) from None
    exe = _target_interpreter(target)
    path = _dumpext.__file__
    if path.endswith((".pyc", ".pyo")):
        raise DumpError("monstack's _dumpext source is not installed (needed to read another version's stacks)")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    done = _run_interpreter(exe, ["-c", source, str(pid)] + (["--color"] if _color() else []), 60)
    if done.returncode == 0:
        return header + done.stdout
    lines = (done.stderr or "").strip().splitlines()
    last = lines[-1] if lines else f"exit status {done.returncode}"
    raise DumpError(last.removeprefix("ExternalError: "))


def _target_version(pid: int) -> Optional[tuple[int, int]]:
    """The target's CPython minor version, from the files it has mapped, or None."""
    import re

    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            data = f.read(4 << 20).decode("utf-8", "replace")
    except OSError:
        return None
    found = re.search(r"/(?:lib)?python3\.(\d+)", data)
    if found is None:
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            return None
        found = re.match(r"python3\.(\d+)", os.path.basename(exe))
    return (3, int(found.group(1))) if found else None


#: How long the remote path waits for the target's main thread before reading its stacks
#: from outside (3.14+): a blocked main thread never runs the script.
REMOTE_WAIT = 2.0


def dump_process(pid: int, timeout: float = DEFAULT_TIMEOUT) -> str:
    """The report of process ``pid``; raises :class:`DumpError` with the reason."""
    import signal

    from ._dumpsig import REFUSED

    target = _Target(pid)
    declared = target.declared_signal()
    name = env_dump_signal({DUMP_SIGNAL_ENV: declared})
    signum = getattr(signal, name, None) if name else None
    why_no_signal = ""
    if name in REFUSED:
        why_no_signal = f"process {pid} sets {DUMP_SIGNAL_ENV}={declared}, which monstack refuses ({REFUSED[name]})"
    elif isinstance(signum, int) and target.handles(signum):
        exchange = _Exchange(target)
        try:
            if exchange.armed() != signum:
                why_no_signal = (
                    f"process {pid} sets {DUMP_SIGNAL_ENV}={declared}, but its handler for it is not monstack's "
                    "(no marker of monstack's arming it): not sent"
                )
            else:
                exchange.post()
                _send(target, signum)
                text = exchange.wait(timeout)
                if text is not None:
                    return text
                why = f"no answer to {name} within {timeout:g} s"
                if _env.remote_debugging_in(_target_version(pid)):
                    try:
                        return _external(target, why)
                    except DumpError:
                        pass
                raise DumpError(
                    f"timed out after {timeout:g} s waiting for process {pid} to answer {name} (Python runs "
                    "signal handlers in the main thread between bytecodes: is it stuck in C code holding "
                    "the GIL?); the request is withdrawn"
                )
        finally:
            exchange.close()
    if not why_no_signal:
        why_no_signal = (
            f"process {pid} sets {DUMP_SIGNAL_ENV}={declared} but has no handler for it (is monstack on there?)"
            if declared
            else f"process {pid} has no monstack dump signal ({DUMP_SIGNAL_ENV} unset)"
        )
    if target.environ.get("PYTHON_DISABLE_REMOTE_DEBUG"):
        raise DumpError(f"{why_no_signal}, and remote debugging is disabled there (PYTHON_DISABLE_REMOTE_DEBUG)")
    if os.environ.get("PYTHON_DISABLE_REMOTE_DEBUG"):
        raise DumpError(f"{why_no_signal}, and PYTHON_DISABLE_REMOTE_DEBUG is set here (no sys.remote_exec)")
    try:
        exchange = _Exchange(target)
    except DumpError as exc:
        if not target.foreign_root:
            raise
        try:  # (a container's process without a dump signal has no exchange directory)
            return _external(target, f"{why_no_signal}, and {exc}")
        except DumpError:
            raise exc from None
    try:
        exchange.post()
        try:
            script = exchange.script()
        except OSError as exc:
            exchange.abandon()
            raise DumpError(f"cannot write the remote script: {exc.strerror}") from None
        except DumpError as exc:
            exchange.abandon()
            try:  # (another pid namespace: no script can be named, the memory can be read)
                return _external(target, f"{why_no_signal}, and {exc}".split("; ")[0])
            except DumpError:
                raise exc from None
        try:
            _remote_exec(target, script, why_no_signal)
        except DumpError:
            exchange.abandon()
            raise
        first = min(timeout, REMOTE_WAIT)
        text = exchange.wait(first)
        if text is not None:
            return text
        try:
            return _external(target, f"its main thread ran no Python for {first:g} s")
        except DumpError as exc:
            external_failed = str(exc)
        text = exchange.wait(timeout - first) if timeout > first else None
        if text is not None:
            return text
        raise DumpError(
            f"timed out after {timeout:g} s: process {pid} has not run Python in its main thread since the "
            "request (blocked in sleep, a lock, a join or I/O, or busy in C code); the request is withdrawn, "
            f"and its stacks could not be read from outside ({external_failed}). "
            "To dump a blocked process, start it with MONSTACK=1 MONSTACK_DUMP_SIGNAL=USR1"
        )
    finally:
        exchange.close()


def main(argv: Sequence[str]) -> int:
    try:
        pid, timeout = _parse(argv)
        text = dump_process(pid, timeout)
    except DumpError as exc:  # (its text may hold names from the target: escaped)
        sys.stderr.write(f"{PROG}: {proto.escape_controls(str(exc))}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130
    sys.stdout.write(_safe_report(text, pid))
    sys.stdout.flush()
    return 0


#: An SGR colour sequence (what monstack's own reports use): the only escape kept.
_SGR = None


def _safe_report(text: str, pid: int) -> str:
    """The answer as printed: written by the target, so from another user's process every
    control character is escaped except well-formed colour (SGR) sequences: a title, a
    clipboard write or a screen clear the target put in never reaches this terminal."""
    import re

    global _SGR
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            uid = next((int(line.split()[2]) for line in f if line.startswith(b"Uid:")), -1)
    except (OSError, ValueError, IndexError):
        uid = -1
    if uid == os.geteuid() and uid != 0:
        return text  # (the caller's own process)
    if _SGR is None:
        _SGR = re.compile(r"(\x1b\[[0-9;]*m)")
    return "\n".join(
        "".join(part if i % 2 else proto.escape_controls(part) for i, part in enumerate(_SGR.split(line)))
        for line in text.split("\n")
    )
