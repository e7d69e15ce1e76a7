"""Turning monstack on at interpreter start-up, configured by ``MONSTACK_*`` variables.

The ``monstack-startup.pth`` line (and the sitecustomize route) call :func:`boot` only when
``MONSTACK`` is set to something other than a false value, so a process that does not ask
for monstack never imports it. :func:`boot` never raises: a bad value costs one warning
naming the variable and its valid values, and the default is used instead; a monstack
that cannot start costs one warning and the program runs without it.

The variables themselves (names, parsers, defaults) are rows of ``_settings.SETTINGS``;
``python -m monstack run`` validates its options with the same rows and passes them to
child processes through the same variables.
"""

from __future__ import annotations

from ._errors import message, warn_message_once
from ._errors import warn_once as warn
from ._settings import ENABLE_VAR, Config, read_env

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Mapping, Optional

#: The result of the first :func:`boot` from ``os.environ`` in this process (a list so
#: "not booted yet" is distinguishable from "booted, monstack off").
_booted: list[Optional[str]] = []


def boot(environ: Optional[Mapping[str, str]] = None, *, again: bool = False) -> Optional[str]:
    """Install monstack if ``MONSTACK`` asks for it; returns the backend name or None.

    Called from the ``.pth`` line and the sitecustomize route, so it never raises: bad
    values are warned about and replaced by defaults, and an ``install()`` that fails
    with the requested settings is retried once with the defaults. Once per process:
    site.py processes a venv's ``.pth`` files twice, and both routes may be present, so
    later calls return the first result (``again=True`` re-reads the environment).
    """
    if _booted and environ is None and not again:
        return _booted[0]
    result: Optional[str] = None
    try:
        config = read_env(environ)
        problems = config.problems
        if not config.enabled:  # off: only a bad MONSTACK itself is worth a word
            problems = [p for p in problems if p.startswith(message("monstack-bad-value", ENABLE_VAR + "="))]
        for problem in problems:
            warn_message_once(problem)
        if config.enabled:
            result = install_config(config)
    except Exception as exc:
        warn("monstack-startup-failed", f"start-up failed ({type(exc).__name__}: {exc}); the program runs without monstack")
    if environ is None:
        _booted[:] = [result]
    return result


def install_config(config: Config) -> Optional[str]:
    """``install(**config.options)``; on failure one warning and a retry with defaults."""
    from ._install import install

    try:
        return install(**config.options)
    except Exception as exc:
        settings = ", ".join(f"{k}={v!r}" for k, v in sorted(config.options.items()))
        warn("monstack-install-failed", f"install({settings}) failed ({type(exc).__name__}: {exc}); using the defaults")
    try:
        return install(backend="auto")
    except Exception as exc:
        warn("monstack-install-failed", f"install() failed ({type(exc).__name__}: {exc}); the program runs without monstack")
        return None


def install_from_env() -> Optional[str]:
    """Public: what start-up does, for code that starts monstack itself (a sitecustomize,
    an embedding application). Returns the backend name, or None when ``MONSTACK`` is not
    set to a true value. Never raises."""
    return boot()

