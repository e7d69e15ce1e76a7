"""How ``python -m monstack dump PID`` and the process it dumps exchange a report.

Self-contained on purpose (``os``, ``stat``, ``sys`` only, no monstack import at module
level): the remote path (``sys.remote_exec``, 3.14+) sends this module's source, with one
call appended, to a process where monstack may not even be importable.

The exchange happens in a private directory of the *target's* user (mode 0700, owned by
that uid, never a symlink): only that user and root can reach it, and a caller that may
signal or attach to the target is one of them. It is ``/run/user/<uid>/monstack`` when
``/run/user/<uid>`` is a directory of that uid with mode 0700 (nobody else can squat a name
there), else ``/tmp/monstack-<uid>`` (:func:`dir_path`: caller and target compute it the
same way, at each exchange).

- A process that arms the dump signal writes ``armed-<pid>-<starttime>`` there (its start
  time from ``/proc/PID/stat``: a reused pid does not match), holding the signal number,
  and in ``/tmp/monstack-<uid>`` too when the runtime directory is used (that one goes away
  with the user's last session); it deletes them when it disarms. The caller sends a
  signal only to a process whose marker says the handler is monstack's
  (:func:`find_armed`, :func:`read_armed`). A marker can say no more than what the process
  did at arming: a program that later replaces the handler without ``uninstall()`` keeps it.
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
#: Per-user runtime directories (systemd-logind's ``XDG_RUNTIME_DIR``), used when the
#: user's is there and private.
RUN_BASE = "/run/user"
MAGIC = "monstack-dump 1"
WITHDRAWN = "withdrawn"
ARMED_MAGIC = "monstack-armed 1"
#: The largest answer the caller reads (a report is capped at about 1 MB by default).
MAX_OUTPUT = 16 << 20
#: The most entries of a private directory looked at (its user could fill it).
MAX_ENTRIES = 10_000
#: ``"3.14.0"``: this interpreter's version as text (its own: the remote script has no
#: monstack._env to read it from).
VERSION_TEXT = ".".join(map(str, sys.version_info[:3]))

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


#: C0 controls, DEL and C1 controls -> backslash escapes (a name or a file name that
#: reaches a terminal raw could set its title, clear it, ...); other text is kept as is.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_CONTROLS.update({0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"})


def escape_controls(text: str) -> str:
    """``text`` with its C0/C1 control characters and DEL as backslash escapes (``\\x1b``)."""
    if text.isprintable():  # (no control character is printable)
        return text
    return text.translate(_CONTROLS)


class Refused(Exception):
    """The private directory or a file in it is not what it must be."""


def _walk(root: int, path: str) -> int:
    """Open directory ``path`` (absolute, as the target sees it) from ``root``, the
    descriptor of the target's root directory (``/proc/PID/root``), one component at a time
    with ``O_NOFOLLOW``: a symlink in the target's tree (whose absolute targets would resolve
    against the caller's root) is refused with ``OSError``, never followed."""
    fd = os.dup(root)
    try:
        for part in [p for p in path.split("/") if p]:
            if part in (".", ".."):
                raise OSError(22, f"{path} is not a plain path")
            nfd = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _run_dir(uid: int, root: "int | None" = None) -> "str | None":
    """``/run/user/<uid>`` when it is a directory (not a symlink) of ``uid``, mode 0700
    (in the target's tree when ``root`` is given)."""
    path = os.path.join(RUN_BASE, str(uid))
    try:
        if root is None:
            st = os.lstat(path)
        else:
            pfd = _walk(root, RUN_BASE)
            try:
                st = os.stat(str(uid), dir_fd=pfd, follow_symlinks=False)
            finally:
                os.close(pfd)
    except (OSError, ValueError):
        return None
    if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and stat.S_IMODE(st.st_mode) == 0o700:
        return path
    return None


def _places(uid: int, root: "int | None" = None, name_uid: "int | None" = None) -> list[tuple[str, str, bool]]:
    """Where the private directory of ``uid`` may be, the one used first: (parent, name in
    it, whether the parent is the user's runtime directory). ``root``: seen from the
    caller, in the tree of a target in another mount namespace; ``name_uid``: the uid as
    the target sees itself (another user namespace), for the names."""
    shown = uid if name_uid is None else name_uid
    run = _run_dir(shown, root) if name_uid is None or name_uid == uid else None
    tmp = (BASE, f"monstack-{shown}", False)
    return [(run, "monstack", True), tmp] if run is not None else [tmp]


def _locate(uid: int, root: "int | None" = None, name_uid: "int | None" = None) -> tuple[str, str, bool]:
    return _places(uid, root, name_uid)[0]


def dir_path(uid: int, root: "int | None" = None, name_uid: "int | None" = None) -> str:
    """The private directory of ``uid``: ``/run/user/<uid>/monstack`` when ``/run/user/<uid>``
    is a directory of ``uid`` with mode 0700, else ``/tmp/monstack-<uid>``. Decided anew at
    each call (a runtime directory comes and goes with the user's sessions). With ``root``
    (see :func:`_places`): the path as the target sees it."""
    parent, name, _ = _locate(uid, root, name_uid)
    return os.path.join(parent, name)


def armed_name(pid: int, start: int) -> str:
    return f"armed-{pid}-{start}"


def request_name(pid: int, token: str) -> str:
    return f"dump-{pid}-{token}.request"


def output_name(pid: int, token: str) -> str:
    return f"dump-{pid}-{token}.txt"


def script_name(pid: int, token: str) -> str:
    return f"dump-{pid}-{token}.py"


def _names(dirfd: int) -> list[str]:
    """The names in the directory, at most ``MAX_ENTRIES`` of them."""
    names: list[str] = []
    try:
        with os.scandir(dirfd) as entries:
            for entry in entries:
                names.append(entry.name)
                if len(names) >= MAX_ENTRIES:
                    break
    except OSError:
        pass
    return names


def _valid_token(token: str) -> bool:
    return 0 < len(token) <= 64 and all(c in "0123456789abcdef" for c in token)


def open_private_dir(uid: int, *, create: bool = False, gid: int = -1, root: "int | None" = None,
                     name_uid: "int | None" = None) -> int:
    """The descriptor of ``dir_path(uid)``, checked private to ``uid``; ``Refused`` otherwise.

    ``create``: make it (0700) when missing; a root caller gives it to ``uid``/``gid``.
    ``root``, ``name_uid``: a target in other namespaces (see :func:`_places`).
    """
    return _open_dir(_locate(uid, root, name_uid), uid, create=create, gid=gid, root=root)


def _open_dir(place: tuple[str, str, bool], uid: int, *, create: bool = False, gid: int = -1,
              root: "int | None" = None) -> int:
    parent, name, runtime = place
    path = os.path.join(parent, name)
    try:
        if root is not None:  # the target's tree: every component without following a link
            pfd = _walk(root, parent)
        else:
            # the runtime directory: opened without following a symlink, checked again on its fd
            pfd = os.open(parent, os.O_RDONLY | _DIRECTORY | _CLOEXEC | (_NOFOLLOW if runtime else 0))
    except OSError as exc:
        raise Refused(f"{parent} cannot be opened ({exc.strerror})") from None
    try:
        if runtime:
            pst = os.fstat(pfd)
            if pst.st_uid != uid or stat.S_IMODE(pst.st_mode) != 0o700:
                raise Refused(f"{parent} changed while in use")
        made = False
        if create:
            try:
                os.mkdir(name, 0o700, dir_fd=pfd)
                made = True
            except FileExistsError:
                pass
        try:
            fd = os.open(name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=pfd)
        except FileNotFoundError:
            raise Refused(f"{path} does not exist") from None
        except OSError as exc:  # ELOOP: a symlink; ENOTDIR: not a directory
            raise Refused(f"{path} is not a private directory ({exc.strerror})") from None
    finally:
        os.close(pfd)
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


def _read_checked(dirfd: int, name: str, uid: int, limit: int, *, strict: bool = False) -> bytes:
    """A regular file of ``uid`` with one link, read without following a symlink, at most
    ``limit`` bytes; ``strict``: a larger file is ``Refused`` (never read past the limit)."""
    fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=dirfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_nlink != 1:
            raise Refused(f"{name} is not a regular file of uid {uid}")
        if strict and st.st_size > limit:
            raise Refused(f"{name} is larger than {limit} bytes ({st.st_size})")
        chunks = []
        size = 0
        cap = limit + 1 if strict else limit  # one byte more: a file that grew is refused
        while size < cap:
            chunk = os.read(fd, min(65536, cap - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise Refused(f"{name} is larger than {limit} bytes")
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


def _parse_start_time(data: bytes) -> "int | None":
    """Field 22 (starttime) of a ``/proc/PID/stat`` line. The command name (field 2) may
    hold spaces and parentheses: the fields are counted after its last ``)``."""
    try:
        fields = data[data.rindex(b")") + 1 :].split()
        value = int(fields[19])  # fields[0] is field 3 (state)
    except (ValueError, IndexError):
        return None
    return value if value >= 0 else None


def start_time(pid: int) -> "int | None":
    """When process ``pid`` started (clock ticks after boot, from ``/proc/PID/stat``), or
    None (no such process, no /proc): with the pid, it names one process."""
    try:
        fd = os.open(f"/proc/{int(pid)}/stat", os.O_RDONLY | _CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        chunks = []
        while True:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    return _parse_start_time(b"".join(chunks))


# -- the target's side --------------------------------------------------------------------


def arm(signum: int) -> list[tuple]:
    """Write this process's marker (``armed-<pid>-<starttime>``: monstack's handler is on
    ``signum``) in its private directory, made if missing, and also in ``/tmp``'s when the
    runtime directory is used (it goes away when the user's last session ends; a process
    started there keeps its marker in ``/tmp``). Returns what :func:`disarm` needs to
    delete those very files; raises ``Refused`` or ``OSError`` when none could be written."""
    pid = os.getpid()
    start = start_time(pid)
    if start is None:
        raise Refused(f"/proc/{pid}/stat cannot be read")
    uid = os.geteuid()
    armed: list[tuple] = []
    first: "BaseException | None" = None
    for place in _places(uid):
        try:
            armed.append(_arm_in(place, pid, start, uid, signum))
        except (OSError, Refused) as exc:
            first = first or exc
    if not armed and first is not None:
        raise first
    return armed


def _arm_in(place: tuple[str, str, bool], pid: int, start: int, uid: int, signum: int) -> tuple:
    dirfd = _open_dir(place, uid, create=True)
    try:
        clean_stale(dirfd)
        name = armed_name(pid, start)
        _unlink(dirfd, name)  # a marker of this pid and start time is this process's
        # a nonce: a file written in its place (same name, maybe the same inode) is not it
        data = f"{ARMED_MAGIC} {int(signum)} {os.urandom(8).hex()}\n".encode()
        write_new(dirfd, name, data)
        dst = os.fstat(dirfd)
        fst = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        return (pid, uid, place, name, (dst.st_dev, dst.st_ino), (fst.st_dev, fst.st_ino), data)
    finally:
        os.close(dirfd)


def disarm(armed: tuple) -> bool:
    """Delete a marker :func:`arm` wrote, only if it is still that file, in that
    directory, and this is still that process (not a forked child). Never raises."""
    try:
        pid, uid, place, name, dir_key, file_key, data = armed
        if os.getpid() != pid:
            return False
        dirfd = _open_dir(place, uid)
    except Exception:
        return False
    try:
        dst = os.fstat(dirfd)
        if (dst.st_dev, dst.st_ino) != dir_key:
            return False
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) != file_key or _read_checked(dirfd, name, uid, 64, strict=True) != data:
            return False
        return _unlink(dirfd, name)
    except Exception:
        return False
    finally:
        os.close(dirfd)


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
    names = _names(dirfd)
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
    """Write one report where the caller waits for it (``.part``, then renamed ``.txt``).
    Whatever interrupts it, no ``.part`` is left behind."""
    part = f"dump-{pid}-{token}.part"
    try:
        write_new(dirfd, part, text.encode("utf-8", "backslashreplace"))
        os.rename(part, output_name(pid, token), src_dir_fd=dirfd, dst_dir_fd=dirfd)
    except OSError:
        _unlink(dirfd, part)
    except BaseException:
        _unlink(dirfd, part)
        raise


def write_fd(fd: int, text: str) -> None:
    """All of ``text`` to ``fd`` with ``os.write`` (a buffered ``sys.stderr`` may be held)."""
    view = memoryview(text.encode("utf-8", "backslashreplace"))
    while view:
        try:
            view = view[os.write(fd, view) :]
        except InterruptedError:
            continue


def plain_report(note: str, why: str = "monstack not imported") -> str:
    """Every thread's stack from ``sys._current_frames()``, in the layout of monstack's own
    report (``monstack._dump``: the same header, thread headings and frames), then ``note``
    under the header: what a process without monstack (or with monstack off) can still say.
    Names, file names and source lines have their control characters escaped."""
    import linecache
    import threading
    import time
    import traceback

    esc = escape_controls
    names = {t.ident: t for t in threading.enumerate()}
    here = threading.get_ident()
    main = threading.main_thread().ident
    this = sys._getframe().f_code.co_filename  # this file, or "<string>" in the remote script
    ours = (this, "<string>", os.path.join(os.path.dirname(this), "_dumpsig.py"))
    frames = sys._current_frames()
    now = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    lines = [
        f"monstack dump: process {os.getpid()}, CPython {VERSION_TEXT}, {why}: stacks without origins, {now}, "
        f"{len(frames)} threads\n",
        f"({esc(note)})\n",
    ]
    for ident in sorted(frames, key=lambda i: (i != main, i)):
        entries = traceback.extract_stack(frames[ident], limit=None)
        if ident == here:  # leave out the dump's own frames (the handler, the script)
            for i, entry in enumerate(entries):
                if entry.filename in ours:
                    del entries[i:]
                    break
        while entries and entries[0].filename == "<frozen runpy>":
            del entries[0]
        thread = names.get(ident)
        detail = f"ident {ident:#x}"
        if thread is not None:
            if thread.daemon:
                detail += ", daemon"
            if getattr(thread, "native_id", None) is not None:
                detail += f", native id {thread.native_id}"
            label = f'Thread "{esc(str(thread.name))}"'
        else:
            label = "Thread (not started by threading)"
        if ident == here:
            detail += ", writing this report"
        lines.append(f"\n{label} ({detail}):\n")
        lines.append("Stack (most recent call last):\n")
        if not entries:
            lines.append("  (no Python frames)\n")
        for entry in entries:
            lines.append(f'  File "{esc(entry.filename)}", line {entry.lineno}, in {esc(entry.name)}\n')
            source = linecache.getline(entry.filename, entry.lineno or 0).strip()
            if source:
                lines.append(f"    {esc(source)}\n")
    del frames
    return "".join(lines)


def report_text(color: bool = False) -> str:
    """monstack's report when monstack is in this process, else plain stacks that say so.
    Raises only what is no error of the report's: ``KeyboardInterrupt``, ``SystemExit``
    (any ``BaseException`` that is not an ``Exception``), which another signal's handler
    raised while it was being built."""
    try:
        dump_module = sys.modules.get("monstack._dump")
        if dump_module is None and "monstack" in sys.modules:
            import importlib

            dump_module = importlib.import_module("monstack._dump")
        if dump_module is not None:
            return dump_module.report(color=color)  # its default size cap
        return plain_report(
            f"monstack is not imported in process {os.getpid()}: start it with MONSTACK=1 to see where "
            "each thread's work came from"
        )
    except Exception as exc:  # never break the target
        why = escape_controls(f"{type(exc).__name__}: {exc}")
        try:
            return plain_report(f"monstack could not build its report ({why})", "monstack failed")
        except Exception:
            return f"monstack could not build its report ({escape_controls(type(exc).__name__)}).\n"


def serve(pid: int, token: str = "", *, stderr_if_none: bool = True) -> bool:
    """Answer the requests for ``pid``; with none, the report goes to stderr
    (``stderr_if_none``, the signal) or nowhere (the remote script). True when requests
    were found (answered or withdrawn). Never raises, but re-raises ``KeyboardInterrupt``,
    ``SystemExit`` (any ``BaseException`` that is not an ``Exception``) raised meanwhile by
    another signal's handler, once no ``.part`` is left and each claimed request has a
    one-line answer saying the report was interrupted."""
    dirfd = -1
    waiting: list[str] = []
    try:
        wanted, dirfd = claim(pid, token)
        if dirfd < 0:
            if stderr_if_none:
                write_fd(2, report_text(color=_stderr_color()))
            return False
        waiting = [tok for tok, _ in wanted]
        texts: dict[bool, str] = {}
        for tok, color in wanted:
            if color not in texts:
                texts[color] = report_text(color=color)
            deliver(dirfd, pid, tok, texts[color])
            waiting.remove(tok)
        return True
    except Exception:
        return dirfd >= 0
    except BaseException as exc:
        try:
            note = f"process {pid} was interrupted ({type(exc).__name__}) while building its report\n"
            for tok in waiting:
                deliver(dirfd, pid, tok, note)
        except BaseException:
            pass
        raise
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
    except Exception:
        pass
    serve(pid, token, stderr_if_none=False)


# -- the caller's side --------------------------------------------------------------------


def read_output(dirfd: int, pid: int, token: str, uid: int, limit: int = MAX_OUTPUT) -> "str | None":
    """The finished report, deleted once read; None while it is not there. An answer that
    is not a regular file of ``uid`` or is larger than ``limit`` bytes is deleted unread:
    ``Refused``."""
    name = output_name(pid, token)
    try:
        data = _read_checked(dirfd, name, uid, limit, strict=True)
    except FileNotFoundError:
        return None
    except Refused:
        _unlink(dirfd, name)
        raise
    _unlink(dirfd, name)
    return data.decode("utf-8", "replace")


def read_armed(dirfd: int, pid: int, start_time: int, uid: int) -> "int | None":
    """The dump signal process ``pid`` (started at ``start_time``, see :func:`start_time`)
    armed, from its marker; None when there is no marker, or it is not a small regular file
    of ``uid`` with one link, or it does not hold a signal number."""
    try:
        data = _read_checked(dirfd, armed_name(pid, start_time), uid, 64, strict=True)
    except (OSError, Refused):
        return None
    words = data.decode("ascii", "replace").split()  # magic, signal number, nonce
    if len(words) not in (3, 4) or " ".join(words[:2]) != ARMED_MAGIC or not words[2].isdigit():
        return None
    signum = int(words[2])
    return signum if 0 < signum < 128 else None


def find_armed(pid: int, start_time: int, uid: int, root: "int | None" = None,
               name_uid: "int | None" = None) -> "int | None":
    """:func:`read_armed` in each place the target may have written its marker: the private
    directory (``dir_path(uid)``), then ``/tmp``'s when that is the runtime directory. None
    when no place has a valid marker (a directory that is not private is skipped).
    ``pid`` is the target's own (its ``os.getpid()``); ``root``, ``name_uid``: see
    :func:`_places`."""
    for place in _places(uid, root, name_uid):
        try:
            dirfd = _open_dir(place, uid, root=root)
        except (OSError, Refused):
            continue
        try:
            signum = read_armed(dirfd, pid, start_time, uid)
        finally:
            os.close(dirfd)
        if signum is not None:
            return signum
    return None


def remove_script(dirfd: int, pid: int, token: str, uid: int) -> None:
    """After a failed ``sys.remote_exec`` (the script will never run): delete this
    exchange's script, its request or the withdrawal that replaced it, and a leftover
    ``.withdrawn``; only regular files of ``uid``. Never raises."""
    if not _valid_token(token):
        return
    for name in (script_name(pid, token), request_name(pid, token), f"dump-{pid}-{token}.withdrawn"):
        try:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        except (OSError, ValueError):
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
            _unlink(dirfd, name)


def clean_stale(dirfd: int) -> None:
    """Delete the exchange files of processes that no longer exist (a target that ended
    with a request, or a remote script, still waiting), and the markers of processes that
    ended without disarming (their pid gone or now another process's)."""
    for name in _names(dirfd):
        if name.startswith("armed-"):
            words = name.split("-")
            if len(words) == 3 and words[1].isdigit() and words[2].isdigit():
                if start_time(int(words[1])) != int(words[2]):  # ended, or the pid was reused
                    _unlink(dirfd, name)
            continue
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
