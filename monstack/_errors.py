"""How monstack tells the user something went wrong, without ever breaking the program.

The one place that issues ``MonstackWarning``s: each has a stable id, given as the first
argument of :func:`warn` / :func:`warn_once` / :func:`message` and put at the start of its
text. docs/messages.md lists them (tests/unit/test_messages.py keeps the list and the code in
step). The bottom layer: every other module may report through here, and this module
imports nothing of monstack's.
"""

from __future__ import annotations

import sys


class MonstackWarning(RuntimeWarning):
    """Something the user should know about monstack; the program goes on.

    Its text starts with the warning's id (``monstack-internal-error: ...``), so that a
    message filter picks it: ``-W ignore:monstack-unknown-variable``,
    ``warnings.filterwarnings("ignore", "monstack-internal-error")``. docs/messages.md
    lists every id, what it means and what to do.
    """


def message(slug: str, text: str) -> str:
    """The text of a warning: its id, then what happened (``"monstack-bad-value: ..."``)."""
    return f"{slug}: {text}"


def warn(slug: str, text: str) -> None:
    """A ``MonstackWarning`` attributed to the caller; a line on stderr where
    warnings are errors (``-W error``): never raises."""
    said = message(slug, text)
    try:
        import warnings  # here: start-up imports it only to say something

        warnings.warn(MonstackWarning(said), stacklevel=2)
    except Exception:
        _line(f"MonstackWarning: {said}")


_said: set[str] = set()


def warn_once(slug: str, text: str) -> None:
    """A start-up (or settings) warning, once per process per message, never raises.
    See :func:`warn_message_once`."""
    warn_message_once(message(slug, text))


def warn_message_once(said: str) -> None:
    """:func:`warn_once` for a text :func:`message` made (``_settings.Config.problems``).

    Shown as ``MonstackWarning: <id>: <text>``: it is about the environment, not a line of
    the program, so no location is made up for it. The warning filters still decide
    (``-W ignore:<id>``, ``-W ignore::RuntimeWarning``; under ``-W error`` it cannot be
    raised into the program, so it becomes that line on stderr). Where the program or a
    test runner replaced ``warnings.showwarning`` (``logging.captureWarnings``, pytest),
    the warning goes there as any other."""
    if said in _said:
        return
    _said.add(said)
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
                warnings.warn_explicit(said, MonstackWarning, "monstack", 0, module="monstack", registry={})
            for shown in caught:
                _line(f"{shown.category.__name__}: {shown.message}")
        else:
            warnings.warn_explicit(said, MonstackWarning, "monstack", 0, module="monstack")
    except Exception:
        _line(f"MonstackWarning: {said}")


def _line(text: str) -> None:
    try:
        if sys.stderr is not None:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
    except Exception:
        pass
