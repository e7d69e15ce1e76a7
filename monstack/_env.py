"""Facts about the running interpreter, decided once, in one place.

Every version or platform test in monstack reads a name from here, so that the
reasons a backend is (not) available can be listed by ``python -m monstack info``.
"""

from __future__ import annotations

import platform
import sys
import sysconfig

PYVERSION: tuple[int, int, int] = sys.version_info[:3]
IMPLEMENTATION: str = sys.implementation.name
CPYTHON: bool = IMPLEMENTATION == "cpython"

#: PEP 669 ``sys.monitoring`` exists (CPython 3.12+).
HAS_SYSMON: bool = hasattr(sys, "monitoring")

#: A free-threaded ("3.13t") build: no GIL, so native code written for the GIL is refused.
FREE_THREADED: bool = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))

#: ``x86_64`` / ``aarch64`` (normalised), for choosing stored machine code.
MACHINE: str = {"amd64": "x86_64", "arm64": "aarch64"}.get(
    platform.machine().lower(), platform.machine().lower()
)
LINUX: bool = sys.platform.startswith("linux")
POINTER_BITS: int = 64 if sys.maxsize > 2**32 else 32

def sha256_hex(data: bytes) -> str:
    """sha256 of ``data`` with CPython's built-in implementation when there is one
    (``_sha2`` on 3.12+, ``_sha256`` on 3.11): ``hashlib`` loads OpenSSL, ~5 ms at start-up
    just to check the stored machine code against its manifest."""
    try:
        from _sha2 import sha256  # type: ignore[import-not-found]
    except ImportError:
        try:
            from _sha256 import sha256  # type: ignore[import-not-found,no-redef]
        except ImportError:
            from hashlib import sha256  # type: ignore[no-redef]
    return sha256(data).hexdigest()
