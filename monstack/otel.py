"""OpenTelemetry and monstack: the first span of work that has an origin says where the work
was created.

Add the processor to the application's tracer provider, as OpenTelemetry's convention wants::

    from opentelemetry.sdk.trace import TracerProvider
    from monstack.otel import OriginSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(OriginSpanProcessor())

The first span started in a thread, a pool job, an asyncio task (any work monstack gives an
origin) gets two attributes: ``monstack.created_at``, the innermost site (``app.py:11``),
and ``monstack.created_at.stack``, the formatted origin chain (CPython's traceback layout, no
colour). A span whose parent was started under the same origin gets nothing (it is not the
first); a span outside such work gets nothing and costs one context-variable read.
``code.stacktrace`` is left alone: it means the span's own code.

Importing this module imports ``opentelemetry.sdk``: import it only where OpenTelemetry is used.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

try:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import SpanProcessor
except ImportError as exc:  # the processor is for programs that use OpenTelemetry's SDK
    raise ImportError(f"monstack.otel needs opentelemetry-sdk (pip install opentelemetry-sdk): {exc}") from None

from ._origin import current_origin

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional

__all__ = ["OriginSpanProcessor", "SITE", "STACK"]

#: The attribute with the innermost site of the work's origin, ``file.py:LINE``.
SITE = "monstack.created_at"
#: The attribute with the formatted origin chain.
STACK = "monstack.created_at.stack"
#: Spans remembered at once (their origin, until they end): enough for any live tree.
_REMEMBERED = 100_000
#: Origins whose texts are kept (compared by identity: a snapshot is immutable).
_TEXTS = 16


class OriginSpanProcessor(SpanProcessor):  # type: ignore[misc]
    """Sets :data:`SITE` and :data:`STACK` on the first span started in work that has an
    origin. No required arguments; ``stack=False`` leaves the formatted chain out."""

    def __init__(self, *, stack: bool = True) -> None:
        self.stack = bool(stack)
        self._origins: OrderedDict[int, Any] = OrderedDict()  # span id -> the origin it started under
        self._texts_cache: list[tuple[Any, tuple[str, str]]] = []
        self._lock = threading.Lock()

    def on_start(self, span: Any, parent_context: Optional[Any] = None) -> None:
        origin = current_origin()
        if origin is None:
            return
        try:
            parent = trace.get_current_span(parent_context).get_span_context()
            with self._lock:
                first = not (parent.is_valid and self._origins.get(parent.span_id) is origin)
                self._origins[span.get_span_context().span_id] = origin
                while len(self._origins) > _REMEMBERED:
                    self._origins.popitem(last=False)
            if first and len(origin):
                site, stack = self._texts(origin)
                span.set_attribute(SITE, site)
                if self.stack:
                    span.set_attribute(STACK, stack)
        except Exception:
            pass

    def _texts(self, origin: Any) -> tuple[str, str]:
        """(site, formatted chain) of ``origin``, kept for the last few origins: the spans
        of many jobs submitted from one line share one."""
        with self._lock:
            for known, texts in self._texts_cache:
                if known is origin:
                    return texts
        innermost = origin.records()[-1]
        site = f"{os.path.basename(innermost[0])}:{innermost[1]}"
        stack = ""
        if self.stack:
            from ._format import format_origin

            stack = "".join(format_origin(origin, False)).rstrip("\n")
        with self._lock:
            self._texts_cache.insert(0, (origin, (site, stack)))
            del self._texts_cache[_TEXTS:]
        return site, stack

    def on_end(self, span: Any) -> None:
        try:
            with self._lock:
                self._origins.pop(span.get_span_context().span_id, None)
        except Exception:
            pass

    def shutdown(self) -> None:
        with self._lock:
            self._origins.clear()
            self._texts_cache.clear()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
