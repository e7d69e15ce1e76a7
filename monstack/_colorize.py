"""Whether to colour, by CPython's own rules (as ``_colorize.can_colorize`` in 3.13).

Decided once, at the output edge, for the stream being written to.
"""

from __future__ import annotations

import io
import os
import sys

from . import _env
from ._settings import env_color

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Optional


class ANSI:
    RESET = "\x1b[0m"
    BOLD = "\x1b[1m"
    RED = "\x1b[31m"
    MAGENTA = "\x1b[35m"
    BOLD_RED = "\x1b[1;31m"
    BOLD_MAGENTA = "\x1b[1;35m"
    GREY = "\x1b[90m"
    CYAN = "\x1b[36m"


def can_colorize(file: Optional[IO[str]] = None) -> bool:
    """CPython 3.13's rules: PYTHON_COLORS, NO_COLOR, FORCE_COLOR, TERM=dumb, isatty."""
    if file is None:
        file = sys.stdout
    if not sys.flags.ignore_environment:
        if os.environ.get("PYTHON_COLORS") == "0":
            return False
        if os.environ.get("PYTHON_COLORS") == "1":
            return True
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    if os.environ.get("TERM") == "dumb":
        return False
    if file is None or not hasattr(file, "fileno"):
        return False
    try:
        return os.isatty(file.fileno())
    except (io.UnsupportedOperation, OSError, ValueError, AttributeError):
        try:
            return bool(file.isatty())
        except Exception:
            return False


def for_report(file: Optional[IO[str]], cpython_colours: bool = True) -> bool:
    """Whether a report monstack prints in place of CPython's (an uncaught exception's)
    is coloured: ``MONSTACK_COLOR`` if set, else CPython's own decision for that report:
    none where CPython does not colour it (``cpython_colours`` false: before 3.13, and
    ``threading.excepthook``'s), else ``_colorize.can_colorize(file=file)`` (3.13+: what
    the default ``sys.excepthook`` asks; :func:`can_colorize` where it is missing)."""
    forced = env_color()
    if forced is not None:
        return forced
    if not cpython_colours or not _env.COLORIZED_TRACEBACKS:
        return False
    try:
        import _colorize  # type: ignore[import-not-found]

        return bool(_colorize.can_colorize(file=file))
    except Exception:
        return can_colorize(file)


def resolve(color: Optional[bool], file: Optional[IO[str]] = None) -> bool:
    """``color`` if given, else ``MONSTACK_COLOR`` if set, else :func:`can_colorize`."""
    if color is None:
        forced = env_color()
        return can_colorize(file) if forced is None else forced
    return bool(color)
