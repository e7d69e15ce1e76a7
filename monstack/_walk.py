"""The ``walk`` backend: no tracking; every snapshot walks the real frames.

The fallback where no tracking backend can run, and the baseline the benchmark
compares against. A snapshot costs O(depth) but produces the same nodes.
"""

from __future__ import annotations

from types import FrameType

from . import _stack
from ._policy import Policy

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional

    from ._backend import Host
    from ._snapshot import Snapshot


class WalkBackend:
    name = "walk"
    tracking = False
    snapshot_native: "Optional[Callable[[], Optional[Snapshot]]]" = None
    capture_native: "Optional[Callable[[], Snapshot]]" = None
    native_blob: Any = None

    @staticmethod
    def unavailable() -> Optional[str]:
        return None

    def __init__(self, policy: Policy, host: "Host", accelerator: Optional[bool] = None) -> None:
        self.policy = policy

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def capture(self, frame: Optional[FrameType]) -> tuple[Any, int]:
        return _stack.build(frame, self.policy)

    def retire_fast(self) -> None:
        pass

    def describe(self) -> dict[str, str]:
        return {}
