"""How ``python -m monstack dump PID`` and the process it dumps exchange a report.

Self-contained on purpose (``os``, ``stat``, ``sys`` only, no monstack import at module
level): the remote path (``sys.remote_exec``, 3.14+) sends this module's source, with one
call appended, to a process where monstack may not even be importable.

The exchange happens in a private directory of the *target's* user,
``/tmp/monstack-<uid>`` (mode 0700, owned by that uid, never a symlink): only that user and
root can reach it, and a caller that may signal or attach to the target is one of them.

- The caller creates ``dump-<pid>-<token>.request`` there (``O_EXCL``/``O_NOFOLLOW``,
  0600, given to the target's uid) holding ``monstack-dump 1 <token> <color>``, then sends
  the signal or the remote script.
- The target (signal handler or remote script) claims each request for its pid by reading
  and deleting it, writes the report to ``dump-<pid>-<token>.part`` (created exclusively,
  0600) and renames it to ``.txt``, which the caller polls for, reads and deletes.
- A caller that gives up replaces its request with a withdrawal (``monstack-dump 1 <token>
  withdrawn``): a late signal handler or remote script consumes it and writes nothing.
- A signal with no request at all (a plain ``kill -USR1 PID``) writes the report to stderr
  with ``os.write``.

Every file is opened relative to the directory's descriptor with ``O_NOFOLLOW``, checked
(a regular file of the expected owner, one link) before use, and nothing is ever written
into a file this side did not create.
"""

from __future__ import annotations

import os
import stat
import sys

BASE = "/tmp"
MAGIC = "monstack-dump 1"
WITHDRAWN = "withdrawn"

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class Refused(Exception):
    """The private directory or a file in it is not what it must be."""


def dir_path(uid: int) -> str:
    return os.path.join(BASE, f"monstack-{uid}")


def request_name(pid: int, token: str) -> str:
    return f"dump-{pid}-{token}.request"


def output_name(pid: int, token: str) -> str:
    return f"dump-{pid}-{token}.txt"


def script_name(pid: int, token: str) -> str:
    return f"dump-{pid}-{token}.py"


def _valid_token(token: str) -> bool:
    return 0 < len(token) <= 64 and all(c in "0123456789abcdef" for c in token)


def open_private_dir(uid: int, *, create: bool = False, gid: int = -1) -> int:
    """The descriptor of ``dir_path(uid)``, checked private to ``uid``; ``Refused`` otherwise.

    ``create``: make it (0700) when missing; a root caller gives it to ``uid``/``gid``.
    """
    path = dir_path(uid)
    if create:
        try:
            os.mkdir(path, 0o700)
            made = True
        except FileExistsError:
            made = False
    else:
        made = False
    try:
        fd = os.open(path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
    except FileNotFoundError:
        raise Refused(f"{path} does not exist") from None
    except OSError as exc:  # ELOOP: a symlink; ENOTDIR: not a directory
        raise Refused(f"{path} is not a private directory ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if made and st.st_uid != uid and os.geteuid() == 0:
            os.fchown(fd, uid, gid)
            st = os.fstat(fd)
        if made:
            os.fchmod(fd, 0o700)  # whatever the umask
            st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or stat.S_IMODE(st.st_mode) & 0o077:
            raise Refused(
                f"{path} is not private to uid {uid} (owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o});"
                " remove it"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_checked(dirfd: int, name: str, uid: int, limit: int) -> bytes:
    """A regular file of ``uid`` with one link, read without following a symlink."""
    fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=dirfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_nlink != 1:
            raise Refused(f"{name} is not a regular file of uid {uid}")
        chunks = []
        size = 0
        while size < limit:
            chunk = os.read(fd, min(65536, limit - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_new(dirfd: int, name: str, data: bytes, *, uid: int = -1, gid: int = -1) -> None:
    """Create ``name`` (never an existing file, never through a symlink), 0600, and write
    ``data``; a root caller gives it to ``uid``/``gid``."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600, dir_fd=dirfd)
    try:
        if uid >= 0 and os.geteuid() == 0 and uid != 0:
            os.fchown(fd, uid, gid)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _unlink(dirfd: int, name: str) -> bool:
    try:
        os.unlink(name, dir_fd=dirfd)
        return True
    except OSError:
        return False


# -- the target's side --------------------------------------------------------------------


def claim(pid: int, token: str = "") -> tuple[list[tuple[str, bool]], int]:
    """The requests for ``pid`` (``token``: only that one) -> ([(token, color)], dirfd or -1).

    Each request found is deleted (claimed); withdrawals are consumed and left out. No
    private directory, or no request file at all: ``([], -1)``. Requests found but all
    withdrawn: ``([], dirfd)`` (so a late signal does not print to stderr either).
    """
    uid = os.geteuid()
    try:
        dirfd = open_private_dir(uid)
    except Refused:
        return [], -1
    found = False
    wanted: list[tuple[str, bool]] = []
    try:
        names = os.listdir(dirfd)
    except OSError:
        names = []
    prefix = f"dump-{pid}-"
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".request")):
            continue
        tok = name[len(prefix) : -len(".request")]
        if not _valid_token(tok) or (token and tok != token):
            continue
        try:
            text = _read_checked(dirfd, name, uid, 256).decode("ascii", "replace")
        except (OSError, Refused):
            continue
        if not _unlink(dirfd, name):
            continue  # somebody else took it
        found = True
        words = text.split()
        if text.startswith(MAGIC) and len(words) >= 4 and words[2] == tok and words[3] != WITHDRAWN:
            wanted.append((tok, words[3] == "color"))
    if not found:
        os.close(dirfd)
        return [], -1
    return wanted, dirfd


def deliver(dirfd: int, pid: int, token: str, text: str) -> None:
    """Write one report where the caller waits for it (``.part``, then renamed ``.txt``)."""
    part = f"dump-{pid}-{token}.part"
    try:
        write_new(dirfd, part, text.encode("utf-8", "backslashreplace"))
        os.rename(part, output_name(pid, token), src_dir_fd=dirfd, dst_dir_fd=dirfd)
    except OSError:
        _unlink(dirfd, part)


def write_fd(fd: int, text: str) -> None:
    """All of ``text`` to ``fd`` with ``os.write`` (a buffered ``sys.stderr`` may be held)."""
    view = memoryview(text.encode("utf-8", "backslashreplace"))
    while view:
        try:
            view = view[os.write(fd, view) :]
        except InterruptedError:
            continue


def plain_report(note: str) -> str:
    """Every thread's stack from ``sys._current_frames()``, as tracebacks, after ``note``:
    what a process without monstack (or with monstack off) can still say."""
    import threading
    import traceback

    names = {t.ident: t for t in threading.enumerate()}
    here = threading.get_ident()
    main = threading.main_thread().ident
    this = sys._getframe().f_code.co_filename  # this file, or "<string>" in the remote script
    ours = (this, "<string>", os.path.join(os.path.dirname(this), "_dumpsig.py"))
    lines = [f"{note}\n"]
    frames = sys._current_frames()
    for ident in sorted(frames, key=lambda i: (i != main, i)):
        entries = traceback.extract_stack(frames[ident])
        if ident == here:  # leave out the dump's own frames (the handler, the script)
            for i, entry in enumerate(entries):
                if entry.filename in ours:
                    del entries[i:]
                    break
        thread = names.get(ident)
        if thread is not None:
            label = f"Thread {thread.name!r} (ident {ident}{', daemon' if thread.daemon else ''})"
        else:
            label = f"Thread (ident {ident})"
        lines.append(f"\n{label}:\n")
        lines.append("Traceback (most recent call last):\n")
        lines.extend(traceback.format_list(entries))
    del frames
    return "".join(lines)


def report_text(color: bool = False) -> str:
    """monstack's report when monstack is in this process, else plain stacks that say so.
    Never raises."""
    try:
        dump_module = sys.modules.get("monstack._dump")
        if dump_module is None and "monstack" in sys.modules:
            import importlib

            dump_module = importlib.import_module("monstack._dump")
        if dump_module is not None:
            return dump_module.report(color=color)  # its default size cap
        return plain_report(
            f"monstack is not imported in process {os.getpid()}: the stacks below have no origins "
            "(start it with MONSTACK=1 to see where each thread's work came from)."
        )
    except BaseException as exc:  # never break the target
        try:
            return plain_report(f"monstack could not build its report ({type(exc).__name__}: {exc}).")
        except BaseException:
            return f"monstack could not build its report ({type(exc).__name__}).\n"


def serve(pid: int, token: str = "", *, stderr_if_none: bool = True) -> None:
    """Answer the requests for ``pid``; with none, the report goes to stderr
    (``stderr_if_none``, the signal) or nowhere (the remote script). Never raises."""
    dirfd = -1
    try:
        wanted, dirfd = claim(pid, token)
        if dirfd < 0:
            if stderr_if_none:
                write_fd(2, report_text(color=_stderr_color()))
            return
        texts: dict[bool, str] = {}
        for tok, color in wanted:
            if color not in texts:
                texts[color] = report_text(color=color)
            deliver(dirfd, pid, tok, texts[color])
    except BaseException:
        pass
    finally:
        if dirfd >= 0:
            try:
                os.close(dirfd)
            except OSError:
                pass


def _stderr_color() -> bool:
    try:
        colorize = sys.modules.get("monstack._colorize")
        if colorize is not None:
            return bool(colorize.resolve(None, sys.stderr))
    except Exception:
        pass
    return False


def serve_remote(pid: int, token: str, script: str) -> None:
    """The remote script's body: delete the script, answer this request or, if it was
    withdrawn (the caller timed out), do nothing. Quiet whatever happens."""
    try:
        uid = os.geteuid()
        dirfd = open_private_dir(uid)
        try:
            _unlink(dirfd, os.path.basename(script))
        finally:
            os.close(dirfd)
    except BaseException:
        pass
    serve(pid, token, stderr_if_none=False)


# -- the caller's side --------------------------------------------------------------------


def read_output(dirfd: int, pid: int, token: str, uid: int) -> "str | None":
    """The finished report, deleted once read; None while it is not there."""
    name = output_name(pid, token)
    try:
        data = _read_checked(dirfd, name, uid, 1 << 31)
    except FileNotFoundError:
        return None
    _unlink(dirfd, name)
    return data.decode("utf-8", "replace")


def clean_stale(dirfd: int) -> None:
    """Delete the exchange files of processes that no longer exist (a target that ended
    with a request, or a remote script, still waiting)."""
    try:
        names = os.listdir(dirfd)
    except OSError:
        return
    for name in names:
        if not name.startswith("dump-"):
            continue
        pid_text = name[5:].split("-", 1)[0]
        if pid_text.isdigit() and not os.path.exists(f"/proc/{pid_text}"):
            _unlink(dirfd, name)


def withdraw(dirfd: int, pid: int, token: str, uid: int, gid: int) -> None:
    """Replace the request (if still there) by a withdrawal, so a late answer writes nothing."""
    tmp = f"dump-{pid}-{token}.withdrawn"
    try:
        os.stat(request_name(pid, token), dir_fd=dirfd, follow_symlinks=False)
    except OSError:  # already claimed: the answer will come as a file nobody reads
        return
    try:
        write_new(dirfd, tmp, f"{MAGIC} {token} {WITHDRAWN}\n".encode(), uid=uid, gid=gid)
        os.rename(tmp, request_name(pid, token), src_dir_fd=dirfd, dst_dir_fd=dirfd)
    except OSError:
        _unlink(dirfd, tmp)
