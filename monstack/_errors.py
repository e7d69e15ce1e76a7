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
    """A start-up (or settings) warning, once per process per message, never raises.

    Shown as ``MonstackWarning: <message>``: it is about the environment, not a line of
    the program, so no location is made up for it. The warning filters still decide
    (``-W ignore::...`` silences it; under ``-W error`` it cannot be raised into the
    program, so it becomes that line on stderr). Where the program or a test runner
    replaced ``warnings.showwarning`` (``logging.captureWarnings``, pytest), the warning
    goes there as any other."""
    if message in _said:
        return
    _said.add(message)
    try:
        import warnings

        if (
            warnings.showwarning is getattr(warnings, "_showwarning_orig", None)
            and warnings.formatwarning is getattr(warnings, "_formatwarning_orig", None)
            # (catch_warnings(record=True), pytest.warns: replaced by a list's append)
            and getattr(getattr(warnings, "_showwarnmsg_impl", None), "__name__", "") == "_showwarnmsg_impl"
        ):
            # The default display: let the filters decide, then show it without a location.
            with warnings.catch_warnings(record=True) as caught:
                warnings.warn_explicit(message, MonstackWarning, "monstack", 0, module="monstack", registry={})
            for shown in caught:
                _line(f"{shown.category.__name__}: {shown.message}")
        else:
            warnings.warn_explicit(message, MonstackWarning, "monstack", 0, module="monstack")
    except Exception:
        _line(f"MonstackWarning: {message}")


def _line(text: str) -> None:
    try:
        if sys.stderr is not None:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
    except Exception:
        pass
