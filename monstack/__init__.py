"""monstack: per-thread shadow stacks, O(1) snapshots, and where failed work came from."""

from ._capture import active_backend, snapshot, snapshotter, status
from ._dump import cancel_dump_later, dump, dump_later
from ._errors import MonstackWarning
from ._install import install, uninstall
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
