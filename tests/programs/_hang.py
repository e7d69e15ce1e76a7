"""What the hang_*.py programs share (they are also the targets of the dump CLI's tests).

Each program installs monstack (unless MONSTACK=1 already did), builds its hang, prints
``ready`` on stdout, then, by its first argument:

- ``wait`` (default): stays hung, for an outside tool (a signal, ``python -m monstack dump``);
- ``dump``: a watchdog thread calls ``monstack.dump()`` (stderr) once the hang is built;
- ``dump-later``: ``monstack.dump_later()`` writes the report;

and in the last two cases writes ``END-OF-DUMP`` on stderr after the report and exits
with status 0 (``os._exit``: the hung threads never finish).
"""
import os
import sys
import threading
import time

import monstack

END = "END-OF-DUMP"
#: Seconds between "ready" and the report (the hung threads reach their waits first).
DELAY = 0.3


def setup() -> None:
    if monstack.active_backend() is None:
        monstack.install()


class _ExitAfterReport:
    """The report's file for ``dump-later``: stderr, then the end marker and exit."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.write(END + "\n")
        sys.stderr.flush()
        os._exit(0)


def _watchdog() -> None:
    time.sleep(DELAY)
    monstack.dump()
    sys.stderr.write(END + "\n")
    sys.stderr.flush()
    os._exit(0)


def ready() -> None:
    """Call once every thread of the hang has been started (from the main thread)."""
    mode = sys.argv[1] if len(sys.argv) > 1 else "wait"
    if mode == "dump":
        threading.Thread(target=_watchdog, name="watchdog", daemon=True).start()
    elif mode == "dump-later":
        monstack.dump_later(DELAY, file=_ExitAfterReport())
    elif mode != "wait":
        sys.exit(f"unknown mode {mode!r}")
    print("ready", flush=True)
