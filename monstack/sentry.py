"""Sentry and monstack: the origin of the work an event comes from, on the event.

Nothing to do for the usual case: with monstack on (``install()`` or ``MONSTACK=1``) and
``sentry_sdk.init()`` called, in either order, every event for an exception that has an
origin, or captured inside work that has one, carries it (the propagation point
``sentry``; ``install(propagate=[...])`` without it turns that off). Add
:class:`MonstackIntegration` to ``sentry_sdk.init(integrations=[...])`` for options, or to
have the origins on events whatever monstack's settings::

    sentry_sdk.init(dsn=..., integrations=[MonstackIntegration(tag=False)])

Importing this module imports ``sentry_sdk``: import it only where Sentry is used.
"""

from __future__ import annotations

try:
    from sentry_sdk.integrations import Integration
except ImportError as exc:  # the integration is for programs that use Sentry
    raise ImportError(f"monstack.sentry needs sentry-sdk 2.x or 3.x (pip install sentry-sdk): {exc}") from None

from ._points.sentry import TAG, process

__all__ = ["MonstackIntegration", "TAG"]


class MonstackIntegration(Integration):  # type: ignore[misc]
    """Adds the origin of the work an event comes from: a ``threads`` entry per hop of the
    origin chain with Sentry's frames (``stacktrace``), and the tag ``monstack.created_at``
    with the innermost site (``tag``)."""

    identifier = "monstack"

    def __init__(self, *, tag: bool = True, stacktrace: bool = True) -> None:
        self.tag = bool(tag)
        self.stacktrace = bool(stacktrace)

    @staticmethod
    def setup_once() -> None:
        from ._points.sentry import apply

        apply(for_integration=True)
