"""Facts about the running interpreter, decided once, in one place.

Every version or platform test in monstack reads a name from here, so that the
reasons a backend is (not) available can be listed by ``python -m monstack info``.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

#: The running version, for the facts below: no module but this one compares versions
#: (tests/unit/test_env.py fails on a comparison elsewhere); they read a named fact instead.
PYVERSION: tuple[int, int, int] = sys.version_info[:3]
#: ``"3.13"``: the running version as text (``lib/python3.13``, messages, reports).
VERSION_TAG: str = f"{PYVERSION[0]}.{PYVERSION[1]}"
#: ``"3.13.1"``: the same with the micro version (report headings).
VERSION_TEXT: str = ".".join(map(str, PYVERSION))
IMPLEMENTATION: str = sys.implementation.name
CPYTHON: bool = IMPLEMENTATION == "cpython"

#: PEP 669 ``sys.monitoring`` exists (CPython 3.12+).
HAS_SYSMON: bool = hasattr(sys, "monitoring")


def config_var(name: str) -> object:
    """``sysconfig.get_config_var(name)`` for a build-time variable: see ``config_vars``."""
    return config_vars(name)[0]


def config_vars(*names: str) -> list:
    """``[sysconfig.get_config_var(name) for name in names]`` for build-time variables,
    without importing ``sysconfig`` (which imports ``threading``, ~1-2 ms at start-up) or
    even the interpreter's ``_sysconfigdata`` module it reads them from (~2.5M
    instructions): that module's source is a ``pprint``-ed dict, and a variable whose
    value is an int or a plain string is read from its bytes (read once per call).
    Anything else (no such file, another layout, another kind of value) imports the
    module as ``sysconfig`` would."""
    module = os.environ.get(
        "_PYTHON_SYSCONFIGDATA_NAME",
        f"_sysconfigdata_{getattr(sys, 'abiflags', '')}_{sys.platform}_{getattr(sys.implementation, '_multiarch', '')}",
    )
    text = _sysconfigdata_source(module)
    # (each scan of the text is ~50 KB: its layout is checked once for all the names)
    header = text.count(b"build_time_vars = {") == 1
    found = [_config_var_from_text(text, name, header) for name in names]
    if all(v is not _UNREAD for v in found):
        return found
    try:
        data = __import__(module).build_time_vars
        return [data.get(name) for name in names]
    except Exception:  # not POSIX, or an unusual layout: ask sysconfig itself
        import sysconfig

        return [sysconfig.get_config_var(name) for name in names]


_UNREAD = object()


def _sysconfigdata_source(module: str) -> bytes:
    """The source of ``<stdlib>/<module>.py``, or b"" if it cannot be read."""
    stdlib = getattr(sys, "_stdlib_dir", None)
    if not stdlib:
        return b""
    try:
        with open(os.path.join(stdlib, module + ".py"), "rb") as f:
            return f.read()
    except (OSError, ValueError):
        return b""


def _config_var_from_text(text: bytes, name: str, header: Optional[bool] = None) -> object:
    """The value of ``name`` in a ``_sysconfigdata`` source, None if its dict does not
    have it, or ``_UNREAD`` if the text cannot say for sure. ``header``: whether the text
    has its dict's first line exactly once, if the caller counted it."""
    key = repr(name).encode("ascii")
    if not (text.count(b"build_time_vars = {") == 1 if header is None else header):
        return _UNREAD
    count = text.count(key)
    if count != 1:  # absent (None), or also elsewhere than as one key
        return None if not count and b'"' + key[1:-1] + b'"' not in text else _UNREAD
    at = text.index(key)
    line_start = text.rfind(b"\n", 0, at) + 1
    if text[line_start:at].strip() not in (b"", b"build_time_vars = {") or text[at + len(key):at + len(key) + 2] != b": ":
        return _UNREAD
    end = text.find(b"\n", at)
    value = text[at + len(key) + 2:end if end >= 0 else len(text)].rstrip()
    if not value.endswith((b",", b"}")):  # continued on the next line
        return _UNREAD
    value = value[:-1]
    if value.lstrip(b"-").isdigit():
        return int(value)
    if len(value) >= 2 and value[:1] == value[-1:] == b"'" and not set(b"\\'") & set(value[1:-1]):
        try:
            return value[1:-1].decode("ascii")
        except UnicodeDecodeError:
            return _UNREAD
    return _UNREAD


def _machine() -> str:
    try:  # what platform.machine() returns on POSIX, without importing platform
        return os.uname().machine
    except AttributeError:  # pragma: no cover (Windows)
        import platform

        return platform.machine()


#: A free-threaded ("3.13t") build: no GIL, so native code written for the GIL is refused.
#: (``sys.abiflags`` has a "t" exactly when ``Py_GIL_DISABLED`` is set.)
FREE_THREADED: bool = (
    "t" in sys.abiflags if hasattr(sys, "abiflags") else bool(config_var("Py_GIL_DISABLED"))
)

#: ``x86_64`` / ``aarch64`` (normalised), for choosing stored machine code.
MACHINE: str = {"amd64": "x86_64", "arm64": "aarch64"}.get(_machine().lower(), _machine().lower())
LINUX: bool = sys.platform.startswith("linux")
POINTER_BITS: int = 64 if sys.maxsize > 2**32 else 32
#: A debug build (``--with-pydebug``: reference-count debugging changes object layouts).
DEBUG_BUILD: bool = hasattr(sys, "gettotalrefcount")

#: CPython versions the native ``sys.monitoring`` callbacks are built for.
NATIVE_CALLBACK_VERSIONS: tuple[tuple[int, int], ...] = ((3, 12), (3, 13), (3, 14), (3, 15))

#: Built with the tail-calling interpreter (3.14+, ``--with-tail-call-interp``; the config
#: variable is ``Py_TAIL_CALL_INTERP`` in 3.14, ``_Py_TAIL_CALL_INTERP`` in 3.15). The
#: native callbacks were tested only with the classic interpreter (switch-based
#: ``_PyEval_EvalFrameDefault``): refused on such a build. Computed when first read
#: (module ``__getattr__``): only the native path of 3.14+ needs them.
TAIL_CALL_INTERP: bool


def __getattr__(name: str) -> object:
    if name == "TAIL_CALL_INTERP":
        value = PYVERSION[:2] >= (3, 14) and any(config_vars("Py_TAIL_CALL_INTERP", "_Py_TAIL_CALL_INTERP"))
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
#: The experimental JIT (3.14+) is on in this process (``PYTHON_JIT=1`` with a build that
#: has it; decided at startup). Code whose events ``sys.monitoring`` delivers is not
#: JIT-compiled; filtered code (its events disabled) is, and calls tracked code from
#: JIT code: the native callbacks are tested with it on.
JIT_ENABLED: bool = bool(getattr(getattr(sys, "_jit", None), "is_enabled", lambda: False)())


#: The first CPython that another process can debug from outside (PEP 768): it runs a
#: script sent with ``sys.remote_exec`` (gh-131591), and its ``_remote_debugging`` module
#: reads another process's thread and asyncio stacks of its own version (gh-91048).
REMOTE_DEBUGGING_SINCE: tuple[int, int] = (3, 14)
#: This interpreter is one of those: ``python -m monstack dump`` can use both directly.
REMOTE_DEBUGGING: bool = PYVERSION[:2] >= REMOTE_DEBUGGING_SINCE and hasattr(sys, "remote_exec")

#: ``traceback.TracebackException.format(colorize=...)`` exists (3.13+).
COLORIZED_TRACEBACKS: bool = PYVERSION[:2] >= (3, 13)


def remote_debugging_in(version: Optional[tuple[int, int]] = None) -> bool:
    """A process of CPython ``version`` (``(major, minor)``; None: this one's) can be read
    from outside: ``sys.remote_exec`` and ``_remote_debugging`` (see ``REMOTE_DEBUGGING``)."""
    return (PYVERSION[:2] if version is None else version) >= REMOTE_DEBUGGING_SINCE


def is_this_version(version: tuple[int, int]) -> bool:
    """``version`` (``(major, minor)``, another process's) is this interpreter's."""
    return tuple(version) == PYVERSION[:2]


# -- version facts: what changed in CPython that monstack's Python code has to follow ------

#: ``frame.f_locals`` of a function's frame is a proxy that reads the frame's slots (PEP
#: 667, gh-74929, 3.13). Before, reading it copies the fast locals into a dict kept on the
#: frame: a side effect on a frame that is running.
FRAME_LOCALS_PROXY: bool = PYVERSION[:2] >= (3, 13)
#: Unraisable exceptions carry a message formatted with ``PyErr_FormatUnraisable``
#: (gh-108082, 3.13): a ``_thread.start_new_thread`` function's failure reads
#: "Exception ignored in thread started by <function>" (3.11/3.12: "... started by: <function>").
FORMAT_UNRAISABLE: bool = PYVERSION[:2] >= (3, 13)
#: The import system and ``python script.py`` set a module's ``__cached__`` (``None`` for a
#: script); 3.15 sets it no more (gh-65961).
SETS_CACHED: bool = PYVERSION[:2] < (3, 15)
#: The native ``sys.monitoring`` callbacks exist for this version (``NATIVE_CALLBACK_VERSIONS``).
NATIVE_CALLBACKS_FOR_VERSION: bool = PYVERSION[:2] in NATIVE_CALLBACK_VERSIONS
#: The 3.11 eval_frame shim (PEP 523) is built for this version: CPython 3.11 only (3.12+
#: have ``sys.monitoring``).
EVALFRAME_FOR_VERSION: bool = PYVERSION[:2] == (3, 11)
#: A PEP 523 eval_frame function is called for every Python frame, ``__getitem__``'s
#: included: 3.11.0-3.11.3 skip it there (gh-104405, fixed in 3.11.4).
EVALFRAME_SEES_GETITEM: bool = PYVERSION >= (3, 11, 4)

#: Where a generator frame linked in by ``gen.throw()`` sits while the frames it delegates
#: to run: its ``yield from``/``await`` suspension point. 3.11/3.12: the YIELD_VALUE it
#: suspended at; 3.13+: the RESUME after it, with oparg 2 (after yield from) or 3 (after
#: await). A frame that is running sits elsewhere (SEND, a call...).
RESUME_AFTER_YIELD: bool = PYVERSION[:2] >= (3, 13)
#: The opcodes of ``YIELD_VALUE`` and ``RESUME`` per minor version (a test checks them
#: against ``opcode``, which costs ~1.5 ms to import; the native paths also check them
#: against code compiled here at load); ``opcode`` is read for any other version.
OPCODES: dict[str, int]
_OPCODES = {(3, 11): (86, 151), (3, 12): (150, 151), (3, 13): (118, 149), (3, 14): (120, 128), (3, 15): (119, 128)}
if PYVERSION[:2] in _OPCODES:
    OPCODES = dict(zip(("YIELD_VALUE", "RESUME"), _OPCODES[PYVERSION[:2]]))
else:  # pragma: no cover (a version the table does not know)
    from opcode import opmap as _opmap

    OPCODES = {name: _opmap[name] for name in ("YIELD_VALUE", "RESUME")}
    del _opmap
#: The opcode a delegating generator frame sits at (see ``RESUME_AFTER_YIELD``).
DELEGATION_OP: int = OPCODES["RESUME" if RESUME_AFTER_YIELD else "YIELD_VALUE"]

#: Why the ``monitoring`` backend cannot run on this interpreter, or None: decided here so
#: that choosing a backend on 3.11 does not import that backend's module.
NO_SYSMON_REASON = None if HAS_SYSMON else (
    f"sys.monitoring needs CPython 3.12+ (this is {IMPLEMENTATION} {'.'.join(map(str, PYVERSION))})"
)
