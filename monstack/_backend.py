"""Choosing a backend, in one place, with the reasons recorded.

A backend is a small class:

- ``name`` (``"monitoring"``, ``"evalframe"``, ``"walk"``), ``tracking`` (keeps stacks?)
- ``unavailable() -> str | None`` (static): why it cannot run here, or None;
- ``__init__(policy, on_error)``, ``start()``, ``stop()``;
- ``capture(frame) -> (node, lasti)``: the snapshot of ``frame``'s thread;
- ``describe() -> dict[str, str]``: extra lines for ``python -m monstack info``.

``auto`` takes the first available of ``monitoring`` (3.12+), ``evalframe`` (3.11),
then ``walk``.
"""

from __future__ import annotations

from typing import Any, Optional

from . import _env

BACKEND_CHOICES = ("auto", "monitoring", "evalframe", "walk")
AUTO_ORDER = ("monitoring", "evalframe", "walk")


def backend_class(name: str) -> Any:
    if name == "monitoring":
        from ._sysmon import MonitoringBackend

        return MonitoringBackend
    if name == "evalframe":
        try:
            from ._evalframe import EvalFrameBackend
        except ImportError as exc:  # the module is optional while it is being built
            return _missing("evalframe", f"not available in this build ({exc})")
        return EvalFrameBackend
    if name == "walk":
        from ._walk import WalkBackend

        return WalkBackend
    raise ValueError(f"unknown backend {name!r}; valid choices: " + ", ".join(repr(c) for c in BACKEND_CHOICES))


def _missing(name: str, reason: str) -> Any:
    class Missing:
        tracking = True

        @staticmethod
        def unavailable() -> Optional[str]:
            return reason

    Missing.name = name  # type: ignore[attr-defined]
    return Missing


def check_choice(requested: Optional[str]) -> str:
    if requested is None:
        requested = _env.env_backend() or "auto"
        where = f"{_env.BACKEND_ENV}={requested!r}"
    else:
        where = f"backend={requested!r}"
    if not isinstance(requested, str) or requested.lower() not in BACKEND_CHOICES:
        raise ValueError(f"{where} is not a backend; valid choices: " + ", ".join(repr(c) for c in BACKEND_CHOICES))
    return requested.lower()


def reasons() -> dict[str, Optional[str]]:
    """For each backend: None if it can run here, else why not."""
    return {name: backend_class(name).unavailable() for name in AUTO_ORDER}


def choose(requested: Optional[str]) -> tuple[Any, str]:
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
    skipped = []
    for name in AUTO_ORDER:
        cls = backend_class(name)
        why_not = cls.unavailable()
        if why_not is None:
            why = "first available of " + ", ".join(AUTO_ORDER)
            if skipped:
                why += " (" + "; ".join(skipped) + ")"
            return cls, why
        skipped.append(f"{name}: {why_not}")
    raise AssertionError("the walk backend is always available")  # pragma: no cover
