"""How monstack tells the user something went wrong, without ever breaking the program.

The bottom layer: every other module may report through here, and this module imports
nothing of monstack's.
"""

from __future__ import annotations

import sys


class MonstackWarning(RuntimeWarning):
    """monstack hit an internal error and turned itself off; the program goes on."""


def warn(message: str) -> None:
    """A ``MonstackWarning`` attributed to the caller; a line on stderr where
    warnings are errors (``-W error``): never raises."""
    try:
        import warnings  # here: start-up imports it only to say something

        warnings.warn(MonstackWarning(message), stacklevel=2)
    except Exception:
        try:
            sys.stderr.write(f"MonstackWarning: {message}\n")
        except Exception:
            pass


_said: set[str] = set()


def warn_once(message: str) -> None:
    """A start-up warning: ``monstack: <message>``, once per process per message, not
    attributed to any line of the program; falls back to stderr, never raises."""
    if message in _said:
        return
    _said.add(message)
    try:
        import warnings

        warnings.warn_explicit(f"monstack: {message}", MonstackWarning, "<monstack start-up>", 0, module="monstack")
    except Exception:
        try:
            sys.stderr.write(f"MonstackWarning: monstack: {message}\n")
        except Exception:
            pass
