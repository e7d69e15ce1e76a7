"""The backend contract: what ``install()`` needs from whatever keeps the stacks.

A backend keeps (or, for ``walk``, computes on demand) the shadow stack of every thread
and answers one question fast: the node of the innermost tracked frame of a thread, and
that frame's instruction offset. ``_select`` chooses one; ``_install`` drives it; the
backends themselves (``_sysmon``, ``_evalframe``, ``_walk``) import only the layers below
(facts, settings, the stack core, the native loader): they reach back up only through
the :class:`Host` they are given.

Every backend follows one convention for "can this run here": ``unavailable()`` returns
None (it can) or the reason it cannot, as a sentence for ``python -m monstack info``.
"""

from __future__ import annotations

# ``typing`` is not imported at run time (start-up with MONSTACK=1 imports only what
# tracking needs): mypy sees ``Backend`` as a ``typing.Protocol``, the interpreter as a
# plain class that nothing inherits from (the tests read its members).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType
    from typing import Any, Callable, Optional, Protocol

    from ._policy import Policy
    from ._snapshot import Snapshot
else:
    Protocol = object


#: Coroutine exits. A tracking backend that can (``monitoring``, ``evalframe``) calls
#: ``COROUTINE_EXIT[0](code, exc)``, when the slot holds a handler, each time an
#: ``Exception`` leaves a frame of a coroutine (``CO_COROUTINE``) whose caller is not a
#: generator, coroutine or async generator frame -- the outermost coroutine of an
#: asyncio task's step -- whether or not its code is tracked. The exception is still
#: propagating and the current context is the frame's. The ``asyncio_tasks`` point fills
#: the slot: a failed task's origin is attached there, on the failure path only,
#: instead of by a done callback per task. (A list: the native callbacks read it.)
COROUTINE_EXIT: list = [None]

#: ``[True]`` while the running backend reports coroutine exits: set by its ``start()``,
#: cleared by ``stop()`` (and by ``retire_fast()`` where the reports stop with the fast
#: paths: another eval_frame function replaced the 3.11 shim).
EXITS_REPORTED: list = [False]

#: The ``co_flags`` bits of code whose frames can be suspended (generators, coroutines,
#: async generators): a frame below a coroutine's that has one of them awaits it.
CO_SUSPENDABLE = 0x20 | 0x80 | 0x100 | 0x200
CO_COROUTINE = 0x80


class Host:
    """What a backend may call back into (provided by ``_install``)."""

    __slots__ = ("on_error", "distrust", "snapshot")

    def __init__(
        self,
        on_error: Callable[[BaseException], None],
        distrust: Callable[[], None],
        snapshot: Callable[[], Snapshot],
    ) -> None:
        #: A callback or capture failed: report it once and turn tracking off cleanly.
        self.on_error = on_error
        #: The shadow stack can no longer be trusted (another tool replaced the eval_frame
        #: function, or a policy callback failed): ``snapshot()`` stops taking fast paths
        #: until the next install, so every capture reaches ``Backend.capture``.
        self.distrust = distrust
        #: ``monstack.snapshot``: where a native snapshot path sends what it does not cover.
        self.snapshot = snapshot


class Backend(Protocol):
    """One way of keeping stacks. Constructed as ``cls(policy, host, accelerator=...)``."""

    #: ``"monitoring"``, ``"evalframe"`` or ``"walk"`` (a class attribute).
    name: str
    #: Keeps shadow stacks (True) or walks the real frames at each capture (False).
    tracking: bool


    #: Optional native fast paths, None where the backend has none (or retired them):
    #: the whole O(1) case of ``snapshot()`` (called from inside it: returns the finished
    #: Snapshot of snapshot()'s caller, or None to take the Python path) ...
    snapshot_native: Optional[Callable[[], Optional["Snapshot"]]]
    #: ... and ``snapshotter()``'s function (the Snapshot of its own caller).
    capture_native: Optional[Callable[[], "Snapshot"]]
    #: The verified blob (``_native.Blob``) of the native code this install runs, or None:
    #: the native origin carrier (``_origin.native_carrier``) is taken from it.
    native_blob: Optional[Any]

    @staticmethod
    def unavailable() -> Optional[str]:
        """None if this backend can run in this process, else why not (one sentence)."""

    def __init__(self, policy: "Policy", host: Host, accelerator: Optional[bool] = None) -> None:
        """``accelerator``: None = native code where it can run (unless the environment
        turns it off), True = require it (``start()`` raises otherwise), False = pure
        Python. Backends without such a choice ignore it."""

    def start(self) -> None:
        """Begin tracking; raises (RuntimeError with the reason) if it cannot."""

    def stop(self) -> None:
        """Undo ``start()``; idempotent."""

    def capture(self, frame: Optional["FrameType"]) -> tuple[Any, int]:
        """``(node, lasti)`` for ``frame``'s thread: the shadow stack's top node when it is
        ``frame``'s (rebuilding it from the real frames otherwise), and ``frame``'s offset."""

    def retire_fast(self) -> None:
        """Drop the native fast paths (``snapshot_native``/``capture_native`` become None);
        functions already handed out keep working through ``monstack.snapshot``."""

    def describe(self) -> dict[str, str]:
        """Extra lines for ``python -m monstack info``."""
