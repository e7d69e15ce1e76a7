"""Whether to colour, by CPython's own rules (as ``_colorize.can_colorize`` in 3.13).

Decided once, at the output edge, for the stream being written to.
"""

from __future__ import annotations

import io
import os
import sys

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


def resolve(color: Optional[bool], file: Optional[IO[str]] = None) -> bool:
    """``color`` if given, else ``MONSTACK_COLOR`` if set, else :func:`can_colorize`."""
    if color is None:
        forced = env_color()
        return can_colorize(file) if forced is None else forced
    return bool(color)
