"""monstack: per-thread shadow stacks, O(1) snapshots, and where failed work came from."""

from ._capture import active_backend, snapshot, snapshotter
from ._errors import MonstackWarning
from ._install import install, status, uninstall
from ._origin import (
    attach,
    current_origin,
    format_exception,
    origin,
    origin_of,
    print_exception,
    wrap,
)
from ._settings import PROPAGATION_POINTS
from ._snapshot import Snapshot
from ._startup import install_from_env
from ._threads import threads
from . import _dumpsig

_dumpsig.register()  # install()/uninstall() set up and undo MONSTACK_DUMP_SIGNAL

# The hang report's functions load on first use: MONSTACK=1 start-up imports this package
# and should import only what tracking needs.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._dump import cancel_dump_later, dump, dump_later
_LAZY = {"dump": "_dump", "dump_later": "_dump", "cancel_dump_later": "_dump"}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'monstack' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__version__ = "0.1.0"

__all__ = [
    "PROPAGATION_POINTS",
    "MonstackWarning",
    "Snapshot",
    "active_backend",
    "attach",
    "cancel_dump_later",
    "current_origin",
    "dump",
    "dump_later",
    "format_exception",
    "install",
    "install_from_env",
    "origin",
    "origin_of",
    "print_exception",
    "snapshot",
    "snapshotter",
    "status",
    "threads",
    "uninstall",
    "wrap",
]
