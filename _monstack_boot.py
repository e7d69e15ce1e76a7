"""What ``monstack-startup.pth`` runs when ``MONSTACK`` is set to a true value.

A module rather than code in the ``.pth`` line: site.py compiles a ``.pth`` line's source at
every start-up, and compiling this logic there cost as much as importing three of
monstack's modules; a module's bytecode is cached. Outside the ``monstack`` package on
purpose: what it guards against is importing that package failing (a broken install),
which costs one line on stderr instead of site.py's traceback.
"""

import sys


def main() -> None:
    """Boot monstack once per process (site.py may process a venv's ``.pth`` files twice)."""
    import os

    if os.environ.get("MONSTACK", "").strip().lower() in ("", "0", "false", "no", "off") or hasattr(sys, "_monstack_pth"):
        return
    sys._monstack_pth = 1  # type: ignore[attr-defined]
    try:
        import monstack._startup as m

        m.boot()
    except Exception as e:
        sys.stderr.write(
            "monstack: MONSTACK is set but monstack cannot start (%s: %s); running without it\n" % (type(e).__name__, e)
        )
