"""The ``walk`` backend: no tracking; every snapshot walks the real frames.

The fallback where no tracking backend can run, and the baseline the benchmark
compares against. A snapshot costs O(depth) but produces the same nodes.
"""

from __future__ import annotations

from typing import Callable, Optional

from . import _stack
from ._policy import Policy


class WalkBackend:
    name = "walk"
    tracking = False

    @staticmethod
    def unavailable() -> Optional[str]:
        return None

    def __init__(self, policy: Policy, on_error: Callable[[BaseException], None] | None = None) -> None:
        self.policy = policy

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def capture(self, frame):
        return _stack.build(frame, self.policy)

    def describe(self) -> dict[str, str]:
        return {}
