"""Where uncaught failures are reported, show the origins of their exceptions.

Not a propagation point: while monstack is installed (:data:`REPORTS` in ``ON``) these
patches wrap what reports an exception nobody caught, so the exceptions themselves can be
left as the program sees them (no note; see ``monstack._origin``):

- ``sys.excepthook`` (the main thread's uncaught exception; ``python -m monstack run``):
  patched at ``install()`` by ``monstack._points.apply_excepthook``, which loads this module
  only once an origin may exist (``monstack._origin`` loaded): MONSTACK=1 start-up stays lean;
- ``threading.excepthook`` (a thread's), patched when ``threading`` is imported;
- ``asyncio``'s ``BaseEventLoop.default_exception_handler`` ("Task exception was never
  retrieved", "Future exception was never retrieved", a failed callback...). A handler
  the program set with ``loop.set_exception_handler`` is its own business; it gets the
  exception as it is (``monstack.origin_of`` knows its origin).

Each replacement wraps whatever hook was in place at ``install()`` (another tool's
included) and calls it. When that is Python's default hook, the report is the one the
default prints, with each origin where that report prints notes; the exceptions are not
touched. Any other hook is called with the origins added as notes for the duration of
the call (that hook prints them if it prints notes), taken off again afterwards.
``uninstall()`` puts the hooks found at ``install()`` back where ours is still in place;
a hook set over ours keeps working (ours then only calls through).
"""

from __future__ import annotations

import sys

from . import ON, REPORTS, patch

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable

_ORIGIN_MODULE = __name__.rsplit(".", 2)[0] + "._origin"
_modules = sys.modules


def _origins_module() -> Any:
    """``monstack._origin`` if loaded: it holds every origin (none before it loads), so
    these hooks neither import it at ``install()`` (MONSTACK=1 start-up stays lean) nor
    need an import when they run (at interpreter shutdown imports fail)."""
    return _modules.get(_ORIGIN_MODULE)


def _has_origins(origin: Any, exc: Any) -> bool:
    try:
        return origin is not None and isinstance(exc, BaseException) and bool(origin.origins_in(exc, 1))
    except Exception:
        return False


def _render(origin: Any, exc: BaseException, file: Any, cpython_colours: bool = True) -> str:
    """What the default hooks print for ``exc``, with each origin as a note of its
    exception: coloured as CPython colours that report (``_colorize.for_report``), the
    origins too."""
    _format = origin._fmt()  # (the formatting core loads with the first report)
    from .._colorize import for_report

    color = for_report(file, cpython_colours)
    return "".join(_format._traceback_lines(exc, color, True, origin.stored_origin, top=True))


# -- sys.excepthook ----------------------------------------------------------------------------


def excepthook(original: Callable[..., Any], exc_type: Any, exc_value: Any, exc_tb: Any) -> Any:
    """What ``sys.excepthook``'s replacement (``monstack._points.apply_excepthook``, applied
    at ``install()`` without loading this module) does once an origin may exist: ``original``
    is the hook it replaced."""
    origin = _origins_module()
    if REPORTS not in ON or not _has_origins(origin, exc_value):
        return original(exc_type, exc_value, exc_tb)
    if original is sys.__excepthook__ and exc_tb is exc_value.__traceback__:
        stderr = sys.stderr
        if stderr is None:
            return None
        try:
            text = _render(origin, exc_value, stderr)
        except Exception:
            return original(exc_type, exc_value, exc_tb)
        stderr.write(text)
        stderr.flush()
        return None
    with origin.notes_shown(exc_value):
        return original(exc_type, exc_value, exc_tb)


# -- threading.excepthook ----------------------------------------------------------------------


def apply_threading_excepthook() -> None:
    threading = sys.modules["threading"]

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def excepthook(args: Any, /) -> Any:
            exc = getattr(args, "exc_value", None)
            origin = _origins_module()
            if REPORTS not in ON or exc is None or not _has_origins(origin, exc):
                return original(args)
            if original is threading.__excepthook__ and args.exc_traceback is exc.__traceback__:
                return _default_thread_report(origin, args, original)
            with origin.notes_shown(exc):
                return original(args)

        return excepthook

    patch(threading, "excepthook", make)


def _default_thread_report(origin: Any, args: Any, original: Callable[..., Any]) -> None:
    """``threading.__excepthook__``'s report, with the origins."""
    if args.exc_type is SystemExit:
        return None
    thread = args.thread
    stderr = sys.stderr
    if stderr is None:
        stderr = getattr(thread, "_stderr", None) if thread is not None else None
        if stderr is None:
            return None
    try:  # (threading's own hook never colours)
        text = _render(origin, args.exc_value, stderr, cpython_colours=False)
    except Exception:
        return original(args)
    name = thread.name if thread is not None else sys.modules["_thread"].get_ident()
    print(f"Exception in thread {name}:", file=stderr, flush=True)
    stderr.write(text)
    stderr.flush()
    return None


# -- asyncio's default exception handler ------------------------------------------------------------


def apply_asyncio() -> None:
    import asyncio.base_events

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def default_exception_handler(self: Any, context: Any) -> Any:
            exc = context.get("exception") if isinstance(context, dict) else None
            origin = _origins_module()
            if REPORTS not in ON or not _has_origins(origin, exc):
                return original(self, context)
            with origin.notes_shown(exc):
                return original(self, context)

        return default_exception_handler

    patch(asyncio.base_events.BaseEventLoop, "default_exception_handler", make)
