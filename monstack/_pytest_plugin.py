"""What ``_monstack_pytest`` (the entry point) calls when monstack is tracking: the origins
section of a failed test's report (:func:`add_origins`), and pytest-timeout with monstack's
report when pytest-timeout sets a test's timer.

pytest-timeout has no "on timeout" hook, only ``pytest_timeout_set_timer`` and
``pytest_timeout_cancel_timer`` to replace its timer. :func:`set_timer` is its timer (the
same two methods, the same fallback from ``signal`` to ``thread`` outside the main thread,
its debugger detection, its ``pytest.fail`` for ``signal`` and ``os._exit(1)`` for
``thread``), with monstack's report where pytest-timeout dumps bare stacks. Cancelling stays
pytest-timeout's: it calls the ``item.cancel_timeout`` set here. Anything unexpected
(another pytest-timeout, a method it does not know) returns None: its own timer runs.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from typing import Any, Optional

try:
    import pytest
except ImportError:  # only pytest loads this module (a test dependency, not a runtime one)
    pytest = None  # type: ignore[assignment]

#: The title of the separators around the report.
TITLE = "Timeout"
#: The title of a failed test's section with the origins of its exceptions.
ORIGINS_TITLE = "monstack: where the failed work was created"


def origins_text(exc: BaseException, color: bool = False) -> str:
    """The origin of ``exc`` and of each exception chained to it or grouped in it (each
    headed by the exception's type and message when there is more than ``exc``'s), or ""."""
    from ._format import format_origin
    from ._origin import origins_in

    found = origins_in(exc)
    parts: list[str] = []
    for e, snap in found:
        if len(found) > 1 or e is not exc:
            try:
                text = str(e)
            except Exception:
                text = "<exception str() failed>"
            name = type(e).__qualname__
            parts.append(f"{name}: {text}\n" if text else f"{name}\n")
        parts.extend(format_origin(snap, color))
    return "".join(parts)


def add_origins(report: Any, exc: BaseException) -> None:
    """Add :func:`origins_text` to a failed test's report: in its long representation
    (shown whatever ``--show-capture`` says), else as a report section."""
    text = origins_text(exc)
    if not text:
        return
    longrepr = getattr(report, "longrepr", None)
    addsection = getattr(longrepr, "addsection", None)
    if addsection is not None:
        addsection(ORIGINS_TITLE, text.rstrip("\n"))
    else:
        report.sections.append((ORIGINS_TITLE, text))


def _framework_dirs() -> list[tuple[str, str]]:
    """(directory + os.sep, shown name) of the packages whose frames the report folds:
    pytest's own (``_pytest``, ``pytest``), ``pluggy``'s and pytest-timeout's, which every
    test's main thread runs through and pytest's own traceback leaves out."""
    found = []
    for module, shown in (("_pytest", "pytest"), ("pytest", "pytest"), ("pluggy", "pluggy"),
                          ("pytest_timeout", "pytest-timeout")):
        mod = sys.modules.get(module)
        path = getattr(mod, "__file__", None)
        if path:
            base = os.path.dirname(path)
            found.append((base + os.sep if os.path.basename(path) == "__init__.py" else path, shown))
    return found


def _hider() -> Any:
    dirs = _framework_dirs()

    def hide(filename: str) -> Any:
        for prefix, shown in dirs:
            if filename.startswith(prefix) or filename == prefix:
                return shown
        return None

    return hide


def _report(terminal: Any) -> None:
    """monstack's report of every thread and task on pytest's terminal, pytest's own
    frames folded (each run is one line: pytest shows the test's traceback itself)."""
    try:
        from ._dump import report

        text = report(color=bool(getattr(terminal, "hasmarkup", False)), hide=_hider())
    except Exception as exc:  # report() never raises; an old or missing one might
        text = f"monstack could not build its report ({type(exc).__name__}: {exc})\n"
    terminal.write(text if text.endswith("\n") else text + "\n")


def _debugging(pt: Any, settings: Any) -> bool:
    return not settings.disable_debugger_detection and pt.is_debugging()


def _timeout_sigalrm(pt: Any, item: Any, settings: Any) -> None:
    """pytest-timeout's ``timeout_sigalrm``: report, then fail the test."""
    if _debugging(pt, settings):
        return
    __tracebackhide__ = True
    terminal = item.config.get_terminal_writer()
    terminal.sep("+", title=TITLE)
    _report(terminal)
    terminal.sep("+", title=TITLE)
    pytest.fail(pt.PYTEST_FAILURE_MESSAGE % settings.timeout)


def _timeout_timer(pt: Any, item: Any, settings: Any) -> None:
    """pytest-timeout's ``timeout_timer``: captured output, the report, ``os._exit(1)``."""
    if _debugging(pt, settings):
        return
    terminal = item.config.get_terminal_writer()
    try:
        capman = item.config.pluginmanager.getplugin("capturemanager")
        if capman:
            capman.suspend_global_capture(item)
            stdout, stderr = capman.read_global_capture()
        else:
            stdout, stderr = None, None
        terminal.sep("+", title=TITLE)
        caplog = item.config.pluginmanager.getplugin("_capturelog")
        if caplog and hasattr(item, "capturelog_handler"):
            log = item.capturelog_handler.stream.getvalue()
            if log:
                terminal.sep("~", title="Captured log")
                terminal.write(log)
        if stdout:
            terminal.sep("~", title="Captured stdout")
            terminal.write(stdout)
        if stderr:
            terminal.sep("~", title="Captured stderr")
            terminal.write(stderr)
        _report(terminal)
        terminal.sep("+", title=TITLE)
    except Exception:
        traceback.print_exc()
    finally:
        terminal.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def set_timer(item: Any, settings: Any) -> Optional[bool]:
    """pytest-timeout's ``pytest_timeout_set_timer`` with monstack's report; None leaves
    the timer to pytest-timeout."""
    try:
        import pytest_timeout as pt  # type: ignore[import-untyped, unused-ignore]

        pt.is_debugging, pt.PYTEST_FAILURE_MESSAGE  # noqa: B018  (what this relies on)
        method = settings.method
        settings.timeout, settings.disable_debugger_detection  # noqa: B018
    except (ImportError, AttributeError):
        return None
    if method == "signal" and threading.current_thread() is not threading.main_thread():
        method = "thread"
    if method == "signal" and hasattr(signal, "SIGALRM"):

        def handler(signum: int, frame: Any) -> None:
            __tracebackhide__ = True
            _timeout_sigalrm(pt, item, settings)

        def cancel() -> None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)

        item.cancel_timeout = cancel
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    elif method == "thread":
        timer = threading.Timer(settings.timeout, _timeout_timer, (pt, item, settings))
        timer.name = f"{pt.__name__} {item.nodeid}"

        def cancel() -> None:
            timer.cancel()
            timer.join()

        item.cancel_timeout = cancel
        timer.start()
    else:
        return None
    return True
