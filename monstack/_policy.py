"""Which code is tracked.

A decision is made once per code object (cached by file name, since a file is a
module) and never revisited: the monitoring backend turns the events of filtered
code off for good, so filtered code costs nothing after its first event.

Rules: ``track="user"`` (default) tracks everything except the standard library,
site-packages and monstack itself; ``track="all"`` tracks everything but monstack.
``include``/``exclude`` entries are module names (``"pkg.sub"``, matching the module
and its submodules) or path prefixes (anything containing a path separator). The
longest matching rule wins; on a tie, exclude wins.
"""

from __future__ import annotations

import os
import sys

from . import _env
from ._settings import TRACK_CHOICES

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import CodeType
    from typing import Iterable, Sequence

_MONSTACK_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _norm_dir(path: str) -> str:
    path = os.path.normcase(os.path.abspath(path))
    return path if path.endswith(os.sep) else path + os.sep


def library_dirs() -> list[str]:
    """Directories of the standard library and of installed third-party packages.

    On POSIX, the directories ``sysconfig.get_paths()`` gives for its ``posix_prefix``
    and ``venv`` schemes, computed from ``sys`` without importing ``sysconfig`` (which
    imports ``threading``: ~1-2 ms of start-up, and a program that checks threading is
    not imported yet would see it); a test checks they agree. Elsewhere, ``sysconfig``.
    """
    if os.name != "posix":  # pragma: no cover (Windows)
        return _library_dirs_sysconfig()
    dirs: set[str] = set()
    lib = f"python{_env.VERSION_TAG}{'t' if _env.FREE_THREADED else ''}"
    platlibdir = getattr(sys, "platlibdir", "lib")
    dirs.add(_norm_dir(os.path.join(sys.base_prefix, platlibdir, lib)))  # stdlib
    for prefix in {sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}:  # platstdlib
        dirs.add(_norm_dir(os.path.join(prefix, platlibdir, lib)))
    dirs.add(_norm_dir(os.path.join(sys.prefix, "lib", lib, "site-packages")))  # purelib
    dirs.add(_norm_dir(os.path.join(sys.exec_prefix, platlibdir, lib, "site-packages")))  # platlib
    _add_site_dirs(dirs)
    return sorted(dirs)


def _library_dirs_sysconfig() -> list[str]:
    """``library_dirs()`` as ``sysconfig`` says them (non-POSIX systems; and the tests)."""
    import sysconfig

    dirs: set[str] = set()
    for scheme_key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(scheme_key)
        if p:
            dirs.add(_norm_dir(p))
    # The base installation's library too, when running inside a venv.
    for prefix in {sys.base_prefix, sys.base_exec_prefix}:
        try:
            paths = sysconfig.get_paths(vars={"base": prefix, "platbase": prefix})
        except Exception:  # pragma: no cover - exotic sysconfig
            continue
        for scheme_key in ("stdlib", "platstdlib"):
            if paths.get(scheme_key):
                dirs.add(_norm_dir(paths[scheme_key]))
    _add_site_dirs(dirs)
    return sorted(dirs)


def _add_site_dirs(dirs: set[str]) -> None:
    try:
        import site

        for p in site.getsitepackages() + [site.getusersitepackages()]:
            dirs.add(_norm_dir(p))
    except Exception:  # pragma: no cover - site without these helpers (some embedders)
        pass


class Policy:
    """Decides, once per code object (file), whether it is tracked."""

    __slots__ = ("track", "include", "exclude", "_rules", "_lib_dirs", "_by_file", "_tracked_set")

    def __init__(
        self,
        track: str = "user",
        include: Iterable[str] = (),
        exclude: Iterable[str] = (),
    ) -> None:
        if track not in TRACK_CHOICES:
            raise ValueError(
                f"track={track!r} is not a tracking policy; valid choices: "
                + ", ".join(repr(c) for c in TRACK_CHOICES)
            )
        self.track = track
        self.include: tuple[str, ...] = _check_rules("include", include)
        self.exclude: tuple[str, ...] = _check_rules("exclude", exclude)
        rules: list[tuple[str, str, bool]] = []  # (kind, key, tracked)
        for entries, tracked in ((self.exclude, False), (self.include, True)):
            for entry in entries:
                if _is_path(entry):
                    rules.append(("path", os.path.normcase(os.path.abspath(entry)).rstrip(os.sep), tracked))
                else:
                    rules.append(("module", entry, tracked))
        self._rules = rules
        self._lib_dirs = tuple(library_dirs()) if track == "user" else ()
        #: file name -> decision; plain dict reads are atomic under the GIL.
        self._by_file: dict[str, bool] = {}
        #: file names decided "tracked": the hot paths test membership here.
        self._tracked_set: set[str] = set()

    def __repr__(self) -> str:
        return f"Policy(track={self.track!r}, include={list(self.include)!r}, exclude={list(self.exclude)!r})"

    def describe(self) -> str:
        text = f"track={self.track}"
        if self.include:
            text += f", include={list(self.include)}"
        if self.exclude:
            text += f", exclude={list(self.exclude)}"
        return text

    def is_tracked(self, code: CodeType, module: str | None = None) -> bool:
        """True if frames running ``code`` belong on the shadow stack (cached per file)."""
        filename = code.co_filename
        try:
            return self._by_file[filename]
        except KeyError:
            pass
        decision = self._decide(filename, module)
        if decision:
            self._tracked_set.add(filename)
        self._by_file[filename] = decision
        return decision

    def tracked_files(self) -> dict[str, bool]:
        """The decision cache itself (read by the hot paths; do not mutate)."""
        return self._by_file

    def tracked_set(self) -> set[str]:
        """File names decided tracked so far (read by the hot paths; do not mutate)."""
        return self._tracked_set

    def _decide(self, filename: str, module: str | None) -> bool:
        if filename.startswith("<frozen "):
            # Frozen modules are the standard library (importlib, os, ...).
            path = ""
            frozen = True
        else:
            path = os.path.normcase(os.path.abspath(filename)) if not filename.startswith("<") else filename
            frozen = False
        if path.startswith(_MONSTACK_DIR):
            return False  # monstack never shows itself
        best: tuple[int, bool] | None = None
        for kind, key, tracked in self._rules:
            if kind == "path":
                ok = path == key or path.startswith(key + os.sep)
            else:
                ok = module is not None and (module == key or module.startswith(key + "."))
            if ok:
                score = len(key)
                if best is None or score > best[0] or (score == best[0] and not tracked):
                    best = (score, tracked)
        if best is not None:
            return best[1]
        if self.track == "all":
            return True
        if frozen:
            return False
        return not any(path.startswith(d) for d in self._lib_dirs)


def _is_path(entry: str) -> bool:
    return os.sep in entry or "/" in entry or entry.startswith(".") or entry.endswith(".py")


def _check_rules(name: str, entries: Iterable[str] | str) -> tuple[str, ...]:
    if isinstance(entries, str):
        entries = [entries]
    out: list[str] = []
    for entry in entries:
        if not isinstance(entry, str) or not entry:
            raise ValueError(f"{name} entries must be non-empty module names or path prefixes, got {entry!r}")
        out.append(entry)
    return tuple(out)


def make_policy(track: str | Policy = "user", include: Sequence[str] = (), exclude: Sequence[str] = ()) -> Policy:
    if isinstance(track, Policy):
        return track
    return Policy(track, include, exclude)
