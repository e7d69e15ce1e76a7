"""monstack: per-thread shadow stacks, O(1) snapshots, and where failed work came from.

PYTEST_DONT_REWRITE: under ``MONSTACK=1`` this package is imported before pytest starts,
and pytest marks the packages of every plugin's distribution for assertion rewriting;
this marker keeps it from warning that it cannot rewrite an imported module.
"""

import os as _os
import sys as _sys

from . import _install
from ._capture import active_backend, snapshot, snapshotter
from ._errors import MonstackWarning
from ._install import install, status, uninstall
from ._settings import DUMP_SIGNAL_ENV as _DUMP_SIGNAL_ENV
from ._settings import PROPAGATION_POINTS
from ._snapshot import Snapshot

# What tracking does not need loads on first use (PEP 562): MONSTACK=1 start-up imports
# this package and should import only what tracking needs (docs/configuration.md).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._dump import cancel_dump_later, dump, dump_later
    from ._origin import attach, current_origin, format_exception, origin, origin_of, print_exception, wrap
    from ._startup import install_from_env
    from ._threads import threads
del TYPE_CHECKING  # (not part of the package's namespace)
_LAZY = {
    "attach": "_origin",
    "current_origin": "_origin",
    "format_exception": "_origin",
    "origin": "_origin",
    "origin_of": "_origin",
    "print_exception": "_origin",
    "wrap": "_origin",
    "install_from_env": "_startup",
    "threads": "_threads",
    "dump": "_dump",
    "dump_later": "_dump",
    "cancel_dump_later": "_dump",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'monstack' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))


# install()/uninstall() set up and undo MONSTACK_DUMP_SIGNAL (monstack._dumpsig, loaded
# only when the variable is set at install time).
def _dump_signal_start(state: object = None) -> None:
    if _os.environ.get(_DUMP_SIGNAL_ENV, "").strip():
        from . import _dumpsig

        _dumpsig.start(state)


def _dump_signal_stop(state: object = None) -> None:
    dumpsig = _sys.modules.get(f"{__name__}._dumpsig")
    if dumpsig is not None:
        dumpsig.stop(state)


_install.add_hooks(_dump_signal_start, _dump_signal_stop)

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
