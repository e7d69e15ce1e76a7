"""``MONSTACK_DUMP_SIGNAL``: a signal that makes this process dump every thread's stack.

``install()`` (and so ``MONSTACK=1`` start-up) installs the handler when the variable names
a usable signal; ``uninstall()`` puts the previous handler back. Nothing is installed when
the variable is unset. The handler answers ``python -m monstack dump PID`` through the
private directory of :mod:`monstack._dumpproto`, or, for a plain ``kill``, writes the
report to stderr with ``os.write``, like ``faulthandler.register``.

Refused, with one warning: a name this platform does not have, signals that cannot be
caught (KILL, STOP), signals Python or the system already use for something else (INT,
TERM, HUP, the fault signals, the job-control ones, the ones sent for other reasons such
as CHLD and WINCH, the timer ones), and a signal the program already handles or ignores
(no chaining: the program's handler stays). Python runs signal handlers in the main
thread only, so the handler is installed only when ``install()`` runs there.

Arming also imports everything a report needs (a handler that imported would wait for
another thread holding the import lock) and writes this process's marker in the private
directory (``armed-<pid>-<starttime>``, see :mod:`monstack._dumpproto`), so that ``python -m
monstack dump`` signals only a process whose handler is monstack's; disarming deletes it.

The handler never nests: signals that arrive while it builds a report (CPython runs a
signal's Python handler inside another one) make it build one more report after the
current one, not one each. ``KeyboardInterrupt`` and ``SystemExit`` raised meanwhile by
another signal's handler (Ctrl-C, a SIGTERM handler calling ``sys.exit``) are re-raised
after the exchange files are cleaned up.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional

from ._errors import warn_once
from ._settings import DUMP_SIGNAL_ENV, env_dump_signal

#: Signals refused whatever the program does, with the reason the warning gives.
REFUSED: dict[str, str] = {
    "SIGKILL": "it cannot be caught",
    "SIGSTOP": "it cannot be caught",
    "SIGINT": "Python turns it into KeyboardInterrupt",
    "SIGTERM": "it must stop the program",
    "SIGHUP": "it must stop the program when its terminal goes away",
    "SIGSEGV": "it reports a crash (faulthandler's)",
    "SIGBUS": "it reports a crash (faulthandler's)",
    "SIGFPE": "it reports a crash (faulthandler's)",
    "SIGILL": "it reports a crash (faulthandler's)",
    "SIGABRT": "it reports a crash (faulthandler's)",
    "SIGSYS": "it reports a crash",
    "SIGTRAP": "debuggers use it",
    "SIGCHLD": "the system sends it whenever a child process ends",
    "SIGWINCH": "the system sends it whenever the terminal is resized",
    "SIGURG": "the system sends it for urgent socket data",
    "SIGCONT": "job control uses it",
    "SIGTSTP": "job control uses it",
    "SIGTTIN": "job control uses it",
    "SIGTTOU": "job control uses it",
    "SIGPIPE": "Python ignores it for its own use",
    "SIGALRM": "timers use it (signal.alarm, pytest-timeout)",
    "SIGVTALRM": "timers use it",
    "SIGPROF": "profilers use it",
}

#: (signal number, the handler it replaced) while ours is installed.
_installed: list[tuple[int, Any]] = []
#: What ``_dumpproto.disarm`` needs to delete each of this process's markers.
_armed: list[tuple] = []
#: The handler is building a report / a signal arrived meanwhile (one more report).
_busy = False
_again = False
_fork_hook = False

#: Imported when arming, so that the handler imports nothing (``linecache`` and
#: ``tokenize`` read source lines; ``traceback`` is the plain report's).
_PRELOAD = ("linecache", "tokenize", "traceback", "threading")


def _handler(signum: int, frame: Any) -> None:
    global _busy, _again
    del frame
    if _busy:  # nested in our own handler: one more report after the current one
        _again = True
        return
    proto: Any = sys.modules.get("monstack._dumpproto")  # imported when arming
    if proto is None:
        from . import _dumpproto as proto
    serve = proto.serve
    _busy = True
    try:
        to_stderr = True
        while True:
            _again = False
            # a follow-up goes to stderr only if the report before it did: a signal sent
            # with a request that report already answered then adds nothing
            to_stderr = not serve(os.getpid(), stderr_if_none=to_stderr)
            if not _again:
                break
    finally:
        _busy = False
        _again = False


def _preload() -> None:
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    from . import _dump, _dumpproto  # noqa: F401


def _arm(signum: int) -> None:
    """Write this process's marker; a failure says the dump command cannot use the signal."""
    if not sys.platform.startswith("linux"):
        return  # the dump command reads /proc: Linux only
    from . import _dumpproto

    try:
        _armed.extend(_dumpproto.arm(signum))
    except (OSError, _dumpproto.Refused) as exc:
        warn_once(
            "monstack-dump-unarmed",
            f"{DUMP_SIGNAL_ENV}: python -m monstack dump cannot find this process's handler "
            f"({exc}); a plain kill still writes the report to stderr"
        )
    global _fork_hook
    if not _fork_hook and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hook = True


def _disarm() -> None:
    from . import _dumpproto

    while _armed:
        _dumpproto.disarm(_armed.pop())


def _after_fork_in_child() -> None:
    """A forked child keeps the handler: it needs its own marker (its pid and start time)."""
    global _busy, _again
    _busy = _again = False
    try:
        if _installed and _armed:
            _armed.clear()  # the parent's: never deleted from here (disarm checks the pid)
            from . import _dumpproto

            _armed.extend(_dumpproto.arm(_installed[0][0]))
    except Exception:
        pass


def _caught_elsewhere(signum: int) -> bool:
    """Linux: a handler installed outside Python (faulthandler.register, a C library) shows
    in /proc/self/status SigCgt while Python still reports SIG_DFL."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def refusal(name: str) -> Optional[str]:
    """Why ``name`` (``"SIGUSR1"``) cannot be the dump signal in this process, or None."""
    import signal

    if name in REFUSED:
        return f"{name} cannot be used: {REFUSED[name]}"
    signum = getattr(signal, name, None)
    if not isinstance(signum, int) or name.startswith("SIG_"):
        return f"{name} does not exist on this platform"
    current = signal.getsignal(signum)
    if current is not signal.SIG_DFL or _caught_elsewhere(signum):
        what = "ignores" if current is signal.SIG_IGN else "handles"
        return f"{name} cannot be used: the program already {what} it"
    return None


def start(state: Any = None) -> None:
    """The start hook: install the handler ``MONSTACK_DUMP_SIGNAL`` asks for. Never raises."""
    try:
        raw = os.environ.get(DUMP_SIGNAL_ENV, "")
        if not raw.strip():
            return
        name = env_dump_signal()
        if name is None:
            return  # a bad value: start-up already said so (read_env's problems)
        if _installed:
            return  # still ours from an earlier install
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            warn_once("monstack-no-dump-signal",
                      f"{DUMP_SIGNAL_ENV}={raw.strip()}: install() ran outside the main thread; no dump signal")
            return
        why = refusal(name)
        if why is not None:
            warn_once("monstack-no-dump-signal", f"{DUMP_SIGNAL_ENV}={raw.strip()}: {why}; no dump signal")
            return
        signum = getattr(signal, name)
        _preload()  # before the handler can run
        previous = signal.signal(signum, _handler)
        _installed.append((signum, previous))
        _arm(signum)
    except Exception as exc:
        warn_once("monstack-no-dump-signal",
                  f"{DUMP_SIGNAL_ENV}: the handler could not be installed ({type(exc).__name__}: {exc})")


def stop(state: Any = None) -> None:
    """The stop hook: put the previous handler back, if ours is still the one installed.
    Outside the main thread Python cannot change handlers: ours stays (it still works)."""
    if not _installed:
        return
    try:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        signum, previous = _installed.pop()
        if signal.getsignal(signum) is _handler:
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
    except Exception:
        pass
    try:
        _disarm()
    except Exception:
        pass


def installed_signal() -> Optional[int]:
    """The signal number whose handler is ours, or None."""
    return _installed[0][0] if _installed else None

