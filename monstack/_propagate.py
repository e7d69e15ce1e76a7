"""Automatic propagation of origins (threads, executors, asyncio). Placeholder API.

``check_points(value)`` validates ``install(propagate=...)`` and returns a frozenset of
point names; ``check_chain_limit(n)`` validates ``install(chain_limit=...)``;
``start(options)`` applies the patches named in ``options["propagate"]``;
``stop()`` undoes every patch ``start`` made.
"""

from __future__ import annotations

from typing import Any

#: Every propagation point install() knows.
PROPAGATION_POINTS: tuple[str, ...] = ()


def check_points(value: Any) -> frozenset:
    if value is True:
        return frozenset(PROPAGATION_POINTS)
    if value is False or value is None:
        return frozenset()
    names = frozenset([value] if isinstance(value, str) else value)
    bad = sorted(n for n in names if n not in PROPAGATION_POINTS)
    if bad:
        raise ValueError(f"unknown propagation point(s) {bad}; valid choices: {list(PROPAGATION_POINTS)}")
    return names


def check_chain_limit(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"chain_limit must be a positive int, got {value!r}")
    return value


def start(options: dict) -> None:
    pass


def stop() -> None:
    pass
