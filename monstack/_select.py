"""Choosing a backend, in one place, with the reasons recorded.

``auto`` takes the first available of ``monitoring`` (3.12+), ``evalframe`` (3.11), then
``walk``; an explicitly requested backend that cannot run raises with its reason. Each
backend says why it cannot run through ``unavailable()`` (see ``_backend.Backend``).
"""

from __future__ import annotations

from . import _env
from ._settings import BACKEND_CHOICES, BACKEND_ENV, env_backend

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    from ._backend import Backend

AUTO_ORDER = ("monitoring", "evalframe", "walk")


def backend_class(name: str) -> "type[Backend]":
    if name == "monitoring":
        from ._sysmon import MonitoringBackend

        return MonitoringBackend
    if name == "evalframe":
        from ._evalframe import EvalFrameBackend

        return EvalFrameBackend
    if name == "walk":
        from ._walk import WalkBackend

        return WalkBackend
    raise ValueError(f"unknown backend {name!r}; valid choices: " + ", ".join(repr(c) for c in BACKEND_CHOICES))


def check_choice(requested: Optional[str]) -> str:
    if requested is None:
        requested = env_backend() or "auto"
        where = f"{BACKEND_ENV}={requested!r}"
    else:
        where = f"backend={requested!r}"
    if not isinstance(requested, str) or requested.lower() not in BACKEND_CHOICES:
        raise ValueError(f"{where} is not a backend; valid choices: " + ", ".join(repr(c) for c in BACKEND_CHOICES))
    return requested.lower()


def _why_not(name: str) -> Optional[str]:
    """``backend_class(name).unavailable()``, without importing ``monitoring``'s module
    where ``sys.monitoring`` does not exist (3.11 start-up)."""
    if name == "monitoring" and _env.NO_SYSMON_REASON:
        return _env.NO_SYSMON_REASON
    return backend_class(name).unavailable()


def reasons() -> dict[str, Optional[str]]:
    """For each backend: None if it can run here, else why not."""
    return {name: _why_not(name) for name in AUTO_ORDER}


def choose(requested: Optional[str]) -> "tuple[type[Backend], str]":
    """The backend class to use and the reason it was chosen.

    An explicitly requested backend that cannot run raises RuntimeError with the reason.
    """
    choice = check_choice(requested)
    if choice != "auto":
        cls = backend_class(choice)
        why_not = cls.unavailable()
        if why_not:
            raise RuntimeError(f"backend {choice!r} cannot run here: {why_not}")
        return cls, f"requested ({choice})"
    skipped: list[str] = []
    for name in AUTO_ORDER:
        why_not = _why_not(name)
        if why_not is None:
            why = "first available of " + ", ".join(AUTO_ORDER)
            if skipped:
                why += " (" + "; ".join(skipped) + ")"
            return backend_class(name), why
        skipped.append(f"{name}: {why_not}")
    raise AssertionError("the walk backend is always available")  # pragma: no cover
