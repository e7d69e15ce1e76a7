"""monstack in :mod:`logging`: which work a log line came from, and where that work was created.

- :class:`OriginFilter` adds ``record.monstack_origin`` (the current origin, a
  :class:`monstack.Snapshot`, or None) and ``record.monstack_where`` (``"file:line in
  func"`` of the origin's innermost frame, ``""`` if none) to each record, so a format string
  can show ``%(monstack_where)s``, and ``record.monstack_created_at`` (``" [created at
  file:line in func]"``, ``""`` if none: ``"%(message)s%(monstack_created_at)s"`` prints no
  empty brackets for a line logged outside any work). Usable from ``dictConfig`` (``"()":
  "monstack.logging.OriginFilter"``).
- :class:`OriginFormatter` (or :class:`OriginFormatterMixin` on your own formatter) prints
  the origin chain after the traceback of records with ``exc_info``, and the causal stack
  (the stack plus the origins) for ``stack_info=True``.

The origin is captured when the record is first annotated, in the thread (and asyncio
task) that logged it: put the filter on the logger or on the ``QueueHandler`` and the
``QueueListener``'s handlers get the emitting thread's origin, not the listener's. Nothing
global is replaced (no LogRecord factory), and nothing here ever breaks logging: if
monstack fails, the record is formatted as the base formatter would.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from ._snapshot import CURRENT_ORIGIN, Snapshot

__all__ = ["OriginFilter", "OriginFormatter", "OriginFormatterMixin", "annotate", "where"]

#: Record attributes set by :func:`annotate`.
ORIGIN_ATTR = "monstack_origin"
WHERE_ATTR = "monstack_where"
CREATED_AT_ATTR = "monstack_created_at"
#: The heading of an origin chain (also of the PEP 678 note monstack adds to exceptions).
ORIGIN_HEADING = "Work created at (most recent call last):"

#: (snapshot, where) of the last origin summarised: every record logged by one piece of work
#: shares its origin, so this one-entry cache answers almost every call.
_last_where: tuple[Optional[Snapshot], str] = (None, "")


def where(snap: Optional[Snapshot]) -> str:
    """``"file:line in func"`` of the innermost frame of ``snap``; ``""`` for None or no frames."""
    global _last_where
    if snap is None:
        return ""
    cached = _last_where
    if cached[0] is snap:
        return cached[1]
    try:
        records = snap.records()
        text = f"{records[-1][0]}:{records[-1][1]} in {records[-1][2]}" if records else ""
    except Exception:  # never break logging
        text = ""
    _last_where = (snap, text)
    return text


def annotate(record: logging.LogRecord) -> logging.LogRecord:
    """Add ``monstack_origin``/``monstack_where``/``monstack_created_at`` to ``record``
    unless it already has them.

    The first call wins, so the origin is the one of the thread that logged (a filter on
    the logger or the QueueHandler runs there). Called from another thread than the one
    that created the record, it cannot know that thread's origin and records None.
    """
    if hasattr(record, ORIGIN_ATTR):
        return record
    origin: Optional[Snapshot] = None
    try:
        if record.thread is None or record.thread == threading.get_ident():
            origin = CURRENT_ORIGIN.get()
    except Exception:
        origin = None
    setattr(record, ORIGIN_ATTR, origin)
    text = where(origin)
    setattr(record, WHERE_ATTR, text)
    setattr(record, CREATED_AT_ATTR, f" [created at {text}]" if text else "")
    return record


class OriginFilter(logging.Filter):
    """Adds ``record.monstack_origin``, ``record.monstack_where`` and
    ``record.monstack_created_at``; never drops a record.

    Attach it where the record is still in the thread that logged it: a logger, or a
    handler such as ``QueueHandler`` (handlers run in the logging thread).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            annotate(record)
        except Exception:  # pragma: no cover - annotate already swallows failures
            pass
        return True


def _origin_text(snap: Snapshot, color: bool) -> str:
    """The origin chain of ``snap`` through the one formatting core."""
    try:
        from . import _format

        return "".join(_format.format_origin(snap, color=color))
    except Exception:
        pass
    try:  # the core cannot render chains: the snapshot's own frames, hop by hop
        parts: list[str] = []
        hop: Optional[Snapshot] = snap
        while hop is not None and len(parts) < 8:
            parts.append(ORIGIN_HEADING + "\n" + hop.format(color=False) + "\n")
            hop = hop.origin
        return "".join(parts)
    except Exception:
        return ""


def _exception_origin(exc: Optional[BaseException]) -> Optional[Snapshot]:
    if exc is None:
        return None
    try:
        from ._origin import origin_of

        return origin_of(exc)
    except Exception:
        return None


_formatting = threading.local()


class OriginFormatterMixin:
    """Put before a ``logging.Formatter`` subclass in the bases to add origins to it.

    ``color``: colour the origin chain (None: only if ``MONSTACK_COLOR`` says always; log
    destinations are rarely terminals).
    """

    def __init__(self, *args: Any, color: Optional[bool] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.color = color

    def _use_color(self) -> bool:
        if self.color is not None:
            return bool(self.color)
        try:
            from ._settings import env_color

            return env_color() is True
        except Exception:
            return False

    def format(self, record: logging.LogRecord) -> str:
        try:
            annotate(record)
        except Exception:
            pass
        previous = getattr(_formatting, "record", None)
        _formatting.record = record
        # Another formatter may have cached a traceback without the origin in exc_text:
        # format our own, and put theirs back for the handlers that come after us.
        cached = record.exc_text if record.exc_info else None
        if cached is not None:
            record.exc_text = None
        try:
            return super().format(record)  # type: ignore[misc]
        finally:
            _formatting.record = previous
            if cached is not None:
                record.exc_text = cached

    def formatException(self, ei: Any) -> str:
        text: str = super().formatException(ei)  # type: ignore[misc]
        try:
            if ORIGIN_HEADING in text:
                return text  # the exception's own note (see monstack.attach) shows it
            origin = _exception_origin(ei[1] if ei else None)
            if origin is None:
                record = getattr(_formatting, "record", None)
                origin = getattr(record, ORIGIN_ATTR, None) if record is not None else None
            return self._with_origin(text, origin)
        except Exception:
            return text

    def _with_origin(self, text: str, origin: Any) -> str:
        """``text`` followed by ``origin``'s chain (unchanged when there is none)."""
        if origin is None:
            return text
        chain = _origin_text(origin, self._use_color())
        if not chain:
            return text
        return text + ("" if text.endswith("\n") else "\n") + chain.rstrip("\n")

    def formatStack(self, stack_info: str) -> str:
        text: str = super().formatStack(stack_info)  # type: ignore[misc]
        try:
            record = getattr(_formatting, "record", None)
            origin = getattr(record, ORIGIN_ATTR, None) if record is not None else None
            return self._with_origin(text, origin)
        except Exception:
            return text


class OriginFormatter(OriginFormatterMixin, logging.Formatter):
    """A ``logging.Formatter`` that adds the origin chain to tracebacks and stack dumps.

    Takes the usual ``fmt``, ``datefmt``, ``style`` (and ``validate``, ``defaults``), so
    ``dictConfig`` can name it as ``"class": "monstack.logging.OriginFormatter"``; the
    fields ``%(monstack_where)s``, ``%(monstack_created_at)s`` and ``%(monstack_origin)s``
    always exist for it.
    """
