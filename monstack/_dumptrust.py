"""May ``python -m monstack dump`` run the target process's interpreter?

``dump PID`` on a target of another Python version runs that process's own interpreter
(``/proc/PID/exe``) with ``-I -S``. Run by root against another user's process, that is
running a program the other user may control: a binary they replaced (the link then reads
``... (deleted)``), one in a directory they can write, or an interpreter whose standard
library (``encodings`` is imported even under ``-I -S``, and the reader's source imports
``re``, ``tokenize``, ``linecache``...: the whole of it is checked, but ``site-packages``
and ``dist-packages``, which ``-S`` never imports), ``pythonXY.zip``, ``libpython``,
``pyvenv.cfg`` or ``._pth`` file they can change. :func:`check` refuses all of these.

The rule, as OpenSSH's ``safe_path``: every file and directory the interpreter reads at
start-up, and every directory above them, is owned by root or by the caller and writable by
nobody else (group write only for group 0). Symbolic links are refused on the way to the
binary: ``/proc/PID/exe`` names the resolved file, so a link there was put in afterwards.
When in doubt (the standard library cannot be found), it refuses.
"""

from __future__ import annotations

import os
import stat
from typing import Iterable, Optional


#: Files and directories of one standard library checked at most: a larger tree is refused
#: rather than walked without end (CPython's, tests and caches included, has under 10,000).
MAX_TREE_ENTRIES = 50_000

#: Where ``-S`` never imports from: not checked.
_NOT_IMPORTED = frozenset({"site-packages", "dist-packages"})


class Untrusted(Exception):
    """Why the interpreter may not be run by this caller: the one line to print."""


def _owner_ok(st: os.stat_result, trusted: frozenset[int]) -> bool:
    return st.st_uid in trusted


def _mode_ok(st: os.stat_result) -> bool:
    if st.st_mode & stat.S_IWOTH:
        return False
    return not (st.st_mode & stat.S_IWGRP and st.st_gid != 0)


def _describe(path: str, st: os.stat_result, trusted: frozenset[int]) -> Optional[str]:
    if not _owner_ok(st, trusted):
        return f"{path} belongs to uid {st.st_uid}"
    if not _mode_ok(st):
        who = "everyone" if st.st_mode & stat.S_IWOTH else f"group {st.st_gid}"
        return f"{path} is writable by {who}"
    return None


def _check_dirs_to(path: str, trusted: frozenset[int]) -> None:
    """Every directory from ``/`` down to ``path``'s parent: a real directory that only a
    trusted owner can change."""
    parts = [p for p in path.split("/") if p]
    current = "/"
    for part in [""] + parts[:-1]:
        current = os.path.join(current, part) if part else "/"
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return  # missing below a directory only trusted owners can change: stays missing
        except OSError as exc:
            raise Untrusted(f"cannot inspect {current}: {exc.strerror}") from None
        if stat.S_ISLNK(st.st_mode):
            raise Untrusted(f"{current} is a symbolic link now")
        if not stat.S_ISDIR(st.st_mode):
            raise Untrusted(f"{current} is not a directory")
        why = _describe(current, st, trusted)
        if why:
            raise Untrusted(why)


def _check_entry(path: str, trusted: frozenset[int], *, must_exist: bool = True) -> bool:
    """``path`` itself (a file or directory, not followed if a link): trusted. Returns
    whether it exists."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if must_exist:
            raise Untrusted(f"{path} does not exist") from None
        return False
    except OSError as exc:
        raise Untrusted(f"cannot inspect {path}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        # A link is as safe as what it names; its own mode bits mean nothing, its owner
        # (who may replace it in a sticky directory) and its directory do.
        if st.st_uid not in trusted:
            raise Untrusted(f"{path} belongs to uid {st.st_uid}")
        target = os.path.realpath(path)
        _check_dirs_to(target, trusted)
        return _check_entry(target, trusted, must_exist=must_exist)
    why = _describe(path, st, trusted)
    if why:
        raise Untrusted(why)
    return True


def _check_tree_level(directory: str, trusted: frozenset[int], names: Optional[Iterable[str]] = None) -> None:
    """``directory`` and the entries directly in it (or just ``names`` there)."""
    if not _check_entry(directory, trusted, must_exist=False):
        return
    try:
        entries = list(names) if names is not None else os.listdir(directory)
    except OSError as exc:
        raise Untrusted(f"cannot list {directory}: {exc.strerror}") from None
    for name in entries:
        _check_entry(os.path.join(directory, name), trusted, must_exist=False)


def _check_tree(directory: str, trusted: frozenset[int], skip: frozenset[str] = frozenset(),
                limit: int = MAX_TREE_ENTRIES) -> None:
    """``directory`` and every file and directory below it, but the ``skip`` names directly
    in it; a link is checked as :func:`_check_entry` does (its owner, the directories to its
    target, the target), and a link to a directory is walked too (each directory once). More
    than ``limit`` entries: refused."""
    if not _check_entry(directory, trusted, must_exist=False):
        return
    seen: set[tuple[int, int]] = set()
    count = 0
    pending = [directory]
    while pending:
        current = pending.pop()
        try:
            st = os.stat(current)
        except OSError as exc:
            raise Untrusted(f"cannot inspect {current}: {exc.strerror}") from None
        if (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        try:
            with os.scandir(current) as it:
                entries = [(e.name, e.path, e.is_symlink(), e.is_dir(follow_symlinks=False)) for e in it]
        except OSError as exc:
            raise Untrusted(f"cannot list {current}: {exc.strerror}") from None
        for name, path, is_link, is_dir in entries:
            if current == directory and name in skip:
                continue
            count += 1
            if count > limit:
                raise Untrusted(f"{directory} holds more than {limit} files and directories: too many to check")
            if not _check_entry(path, trusted, must_exist=False):
                continue  # gone, or a dangling link below trusted directories
            if is_link:
                try:
                    is_dir = stat.S_ISDIR(os.stat(path).st_mode)
                except OSError:
                    continue
            if is_dir:
                pending.append(path)


def _pyvenv_home(cfg: str) -> Optional[str]:
    try:
        with open(cfg, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition("=")
                if sep and key.strip().lower() == "home":
                    return value.strip() or None
    except OSError:
        return None
    return None


def _stdlib_dirs(lib: str) -> list[str]:
    try:
        names = os.listdir(lib)
    except OSError:
        return []
    return sorted(os.path.join(lib, n) for n in names if n.startswith("python3") and os.path.isfile(os.path.join(lib, n, "os.py")))


def _prefixes(exe_dir: str, trusted: frozenset[int], extra: Iterable[str]) -> list[str]:
    """Where the interpreter may take its standard library from: the first ancestor of its
    directory holding ``lib/python3.X/os.py`` (getpath's landmark), a venv's ``home``, and
    the prefixes the running target has files mapped from."""
    found: list[str] = []
    homes = [exe_dir]
    for cfg in (os.path.join(exe_dir, "pyvenv.cfg"), os.path.join(os.path.dirname(exe_dir), "pyvenv.cfg")):
        if _check_entry(cfg, trusted, must_exist=False):
            home = _pyvenv_home(cfg)
            if home:
                home = os.path.realpath(home)
                _check_dirs_to(os.path.join(home, "x"), trusted)
                homes.append(home)
    for start in homes:
        current = start
        while True:
            if _stdlib_dirs(os.path.join(current, "lib")):
                if current not in found:
                    found.append(current)
                break
            parent = os.path.dirname(current)
            if parent == current:
                break
            current = parent
    for prefix in extra:
        if prefix not in found and _stdlib_dirs(os.path.join(prefix, "lib")):
            found.append(prefix)
    return found


def _mapped_files(pid: int) -> list[str]:
    files: list[str] = []
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            data = f.read(4 << 20)
    except OSError:
        return files
    for line in data.decode("utf-8", "replace").splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith("/") and fields[5] not in files:
            files.append(fields[5])
    return files


def _shared_libraries(pid: int) -> list[str]:
    """The shared libraries the process has mapped that the interpreter's start-up loads
    too (``libc``, ``libpython``, what its RUNPATH names): not extension modules, which
    ``-I -S`` never imports from site-packages."""
    found = []
    for path in _mapped_files(pid):
        if "/site-packages/" in path or "/dist-packages/" in path or "/lib/python3" in path:
            continue
        if ".so" in os.path.basename(path):
            found.append(path)
    return found


def mapped_prefixes(pid: int) -> list[str]:
    """Prefixes ``X`` of the ``X/lib/python3.Y/...`` and ``X/lib/libpython3...`` files the
    running process has mapped (where its own interpreter took them from)."""
    prefixes: list[str] = []
    for path in _mapped_files(pid):
        for marker in ("/lib/python3", "/lib/libpython3"):
            at = path.find(marker)
            if at > 0:
                prefix = path[:at]
                if prefix not in prefixes:
                    prefixes.append(prefix)
    return prefixes


def check(exe: str, pid: int, trusted_uids: Iterable[int]) -> None:
    """Raise :class:`Untrusted` unless running ``exe`` (process ``pid``'s interpreter, as
    ``/proc/PID/exe`` names it) with ``-I -S`` runs only what ``trusted_uids`` control."""
    trusted = frozenset(trusted_uids)
    if exe.endswith(" (deleted)"):
        raise Untrusted(f"the program process {pid} runs was deleted or replaced since it started ({exe})")
    if not os.path.isabs(exe):
        raise Untrusted(f"the program of process {pid} has no absolute path ({exe!r})")
    try:
        running = os.stat(f"/proc/{pid}/exe")
        named = os.lstat(exe)
    except OSError as exc:
        raise Untrusted(f"cannot inspect {exe}: {exc.strerror}") from None
    if stat.S_ISLNK(named.st_mode) or (running.st_dev, running.st_ino) != (named.st_dev, named.st_ino):
        raise Untrusted(f"{exe} is no longer the program process {pid} runs")
    if not stat.S_ISREG(named.st_mode):
        raise Untrusted(f"{exe} is not a regular file")
    _check_dirs_to(exe, trusted)
    _check_entry(exe, trusted)
    exe_dir = os.path.dirname(exe)
    _check_entry(exe + "._pth", trusted, must_exist=False)
    if _check_entry(os.path.join(exe_dir, "pybuilddir.txt"), trusted, must_exist=False):
        raise Untrusted(f"{exe} runs from a build directory (pybuilddir.txt)")
    for library in _shared_libraries(pid):
        if library.endswith(" (deleted)"):
            raise Untrusted(f"{library.removesuffix(' (deleted)')} was deleted or replaced since process {pid} loaded it")
        _check_dirs_to(library, trusted)
        _check_entry(library, trusted, must_exist=False)
    prefixes = _prefixes(exe_dir, trusted, mapped_prefixes(pid))
    if not prefixes:
        raise Untrusted(f"cannot tell where {exe} takes its standard library from")
    for prefix in prefixes:
        lib = os.path.join(prefix, "lib")
        _check_dirs_to(os.path.join(lib, "x"), trusted)
        # lib/: the pythonXY.zip on sys.path, libpython (RUNPATH $ORIGIN/../lib) and its ._pth
        _check_tree_level(lib, trusted, [n for n in _listdir(lib) if n.startswith(("python3", "libpython3"))])
        for stdlib in _stdlib_dirs(lib):
            # all of it: packages (re, importlib, encodings...), caches, lib-dynload
            _check_tree(stdlib, trusted, _NOT_IMPORTED)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
