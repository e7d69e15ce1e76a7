"""monstack: per-thread shadow stacks, O(1) snapshots, and where failed work came from."""

from ._install import (
    MonstackWarning,
    active_backend,
    install,
    snapshot,
    status,
    uninstall,
)
from ._snapshot import Snapshot

__version__ = "0.1.0"

__all__ = [
    "MonstackWarning",
    "Snapshot",
    "active_backend",
    "install",
    "snapshot",
    "status",
    "uninstall",
]
