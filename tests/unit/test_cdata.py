"""monstack._cdata: the part of ctypes the native loader uses, made from ``_ctypes``
without importing ``ctypes``. Each name must behave as ctypes' own (checked here against
ctypes itself, which tests may import)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from monstack import _cdata as C

ROOT = str(Path(__file__).resolve().parents[2])

SIMPLE = ("py_object", "c_char", "c_char_p", "c_void_p", "c_int", "c_long", "c_ulong", "c_int64", "c_uint64",
          "c_uint8", "c_size_t", "c_ssize_t")


@pytest.mark.parametrize("name", SIMPLE)
def test_each_simple_type_is_ctypes_s(name):
    ours, theirs = getattr(C, name), getattr(ctypes, name)
    assert ours._type_ == theirs._type_
    assert C.sizeof(ours) == ctypes.sizeof(theirs)
    assert ctypes.alignment(ours) == ctypes.alignment(theirs)


def test_values_read_and_written_through_addresses():
    buf = (C.c_char * 16)()
    at = C.addressof(buf)
    C.c_int64.from_address(at).value = -2
    assert C.c_uint64.from_address(at).value == 2**64 - 2
    assert C.c_uint8.from_address(at).value == 0xFE
    C.c_void_p.from_address(at + 8).value = id(None)
    assert C.cast(C.c_void_p.from_address(at + 8).value, C.py_object).value is None
    assert C.c_ssize_t.from_address(id(tuple) + 2 * C.sizeof(C.c_void_p)).value == ctypes.c_ssize_t.from_address(
        id(tuple) + 2 * ctypes.sizeof(ctypes.c_void_p)).value


def test_memmove_string_at_cast_and_string_buffers_are_ctypes():
    buf = C.create_string_buffer(b"monstack")
    assert type(buf)._type_ is C.c_char and len(buf) == 9 and buf.value == b"monstack"
    assert C.string_at(C.addressof(buf)) == b"monstack"
    assert C.string_at(C.addressof(buf), 3) == b"mon"
    assert C.cast(buf, C.c_char_p).value == b"monstack"
    assert C.cast(buf, C.c_void_p).value == C.addressof(buf) == ctypes.addressof(buf)
    empty = C.create_string_buffer(4)
    assert empty.raw == b"\0" * 4
    C.memmove(C.addressof(empty), b"abc", 3)
    assert empty.raw == b"abc\0"
    with pytest.raises(TypeError):
        C.create_string_buffer(1.5)  # type: ignore[arg-type]


def test_prototypes_are_cached_per_signature_as_ctypes_caches_them():
    a = C.CFUNCTYPE(C.c_int, C.c_void_p)
    assert C.CFUNCTYPE(C.c_int, C.c_void_p) is a
    assert C.CFUNCTYPE(C.c_int, C.c_void_p, use_errno=True) is not a
    assert a._flags_ == ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)._flags_
    assert C.CFUNCTYPE(C.c_int, use_errno=True)._flags_ == ctypes.CFUNCTYPE(ctypes.c_int, use_errno=True)._flags_
    assert C.PYFUNCTYPE(C.py_object)._flags_ == ctypes.PYFUNCTYPE(ctypes.py_object)._flags_
    assert C.PYFUNCTYPE(C.c_int, C.c_void_p) is C.PYFUNCTYPE(C.c_int, C.c_void_p) is not a
    assert a._argtypes_ == (C.c_void_p,) and a._restype_ is C.c_int


def test_pythonapi_is_the_running_interpreter():
    new = C.PYFUNCTYPE(C.py_object, C.c_long)(("PyLong_FromLong", C.pythonapi))
    assert new(12345) == 12345
    with pytest.raises(TypeError, match="bad operand"):  # a C-API error is raised, as through ctypes.pythonapi
        C.PYFUNCTYPE(C.py_object, C.py_object)(("PyNumber_Negative", C.pythonapi))("x")
    assert C.c_void_p.in_dll(C.pythonapi, "PyExc_TypeError").value == id(TypeError)
    assert C.dlsym(C.pythonapi._handle, "PyLong_FromLong") == ctypes.cast(
        ctypes.pythonapi.PyLong_FromLong, ctypes.c_void_p).value
    with pytest.raises(AttributeError):
        C.PYFUNCTYPE(None)(("monstack_nonesuch", C.pythonapi))


def test_libc_calls_keep_errno():
    mprotect = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_size_t, C.c_int, use_errno=True)(("mprotect", C.DLL(None)))
    assert mprotect(1, 4096, 1) == -1  # not page aligned
    assert C.get_errno() == 22  # EINVAL


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-S", "-c", "import sys; sys.path.insert(0, %r); " % ROOT + code],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_it_imports_no_ctypes():
    """Its reason to exist: ``import ctypes`` costs ~9.6M instructions at start-up (3.13),
    ``_ctypes`` ~1.2M; on 3.14 ctypes also imports sysconfig and threading."""
    code = ("before = set(sys.modules); from monstack import _cdata; "
            "print(sorted(m for m in set(sys.modules) - before if 'ctypes' in m or m in ('sysconfig', 'threading', "
            "'struct', 'types')))")
    assert _run(code) == "['_ctypes']"


def test_without_ctypes_the_import_fails_with_import_error():
    """As where _ctypes refuses to load (3.12's isolated subinterpreters): callers catch
    ImportError and use the pure-Python callbacks."""
    code = ("sys.modules['_ctypes'] = None\ntry:\n from monstack import _cdata\nexcept ImportError as e: print('ImportError')")
    assert _run(code) == "ImportError"


def test_char_and_byte_types_are_made_at_first_use_only():
    """Each ctypes type costs ~0.2M instructions to create; install() needs none of these
    (the loader's method defs and names are bytes objects, see _native.buffer_address)."""
    code = ("import monstack; monstack.install(); from monstack import _cdata as C; "
            "print(sorted(n for n in C._LAZY_TYPES if n in vars(C)), C.c_uint8 is C.c_ubyte, "
            "sorted(n for n in C._LAZY_TYPES if n in vars(C)))")
    assert _run(code) == "[] True ['c_ubyte', 'c_uint8']"
    with pytest.raises(AttributeError, match="no attribute 'c_nonesuch'"):
        C.c_nonesuch  # noqa: B018


def test_method_defs_live_in_bytes_objects():
    from monstack import _native

    data = b"monstack\0"
    assert C.string_at(_native.buffer_address(data)) == b"monstack"
    assert _native.buffer_address(data) % ctypes.sizeof(ctypes.c_void_p) == 0
