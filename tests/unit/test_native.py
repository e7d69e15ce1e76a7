"""The native-code loader (``monstack/_native.py``), the shipped blobs and their build.

Every blob (sysmon callbacks for 3.12-3.15, the 3.11 eval_frame shim) has one manifest
format; the loader maps it read-write, fills its address table, makes the code
read+execute (never writable and executable at once) and keeps it mapped. The shipped
bytes must be what ``native/build.py`` makes of the C sources as they are now. A
manifest's canonical form is ``<name>.json``, which these tests read; the loader reads
``<name>.manifest``, the same dict in marshal form (checked here to be exactly that).
"""

from __future__ import annotations

import ctypes
import errno
import glob
import hashlib
import importlib.util
import json
import marshal
import os
import re
import shutil
import subprocess
import sys
from typing import Optional

import pytest

from monstack import _cdata, _env, _native

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NATIVE_SRC = os.path.join(ROOT, "native")
BLOBS = ("sysmon312", "sysmon313", "sysmon314", "sysmon315", "evalframe311")
TOP_KEYS = {"format", "name", "python", "headers", "sources", "arches"}
ENTRY_KEYS = {"blob", "size", "sha256", "checksum", "symbols", "data", "table", "layout", "compiler", "flags"}


def stored_json(name: str) -> dict:
    """The canonical form of blob ``name``'s manifest: ``<name>.json``."""
    with open(os.path.join(_native.NATIVE_DIR, name + ".json"), encoding="utf-8") as f:
        return json.load(f)


def _build_module():
    """native/build.py as a module (by path: a ``build`` package may be installed)."""
    mod = sys.modules.get("monstack_native_build")
    if mod is None:
        spec = importlib.util.spec_from_file_location("monstack_native_build", os.path.join(NATIVE_SRC, "build.py"))
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look the module up
        spec.loader.exec_module(mod)
    return mod


def own_blob() -> Optional[str]:
    """The blob this interpreter runs, if any."""
    v = sys.version_info[:2]
    if not _env.CPYTHON or not _env.LINUX or hasattr(sys, "gettotalrefcount"):
        return None
    name = {(3, 11): "evalframe311", (3, 12): "sysmon312", (3, 13): "sysmon313", (3, 14): "sysmon314",
            (3, 15): "sysmon315"}.get(v)
    if name is None or _native.machine() not in _native.read_manifest(name)["arches"]:
        return None
    return name


needs_own_blob = pytest.mark.skipif(own_blob() is None, reason="no shipped native code for this interpreter")


# --------------------------------------------------------------------------- manifests
@pytest.mark.parametrize("name", BLOBS)
def test_manifests_share_one_format(name):
    m = stored_json(name)
    assert set(m) == TOP_KEYS and m["format"] == _native.FORMAT == 3 and m["name"] == name
    assert m["headers"].startswith(m["python"] + ".")
    assert m["arches"] and "x86_64" in m["arches"]
    for arch, info in m["arches"].items():
        assert set(info) == ENTRY_KEYS, arch
        assert info["blob"] == f"{name}-{arch}.bin"
        assert info["flags"] and info["compiler"]
        for entry, offset in info["table"].items():
            assert entry[:2] in ("f:", "o:", "p:") and offset % 8 == 0, entry
        data = info["data"]
        if data is not None:
            assert data["offset"] % data["align"] == 0 and data["offset"] >= info["size"]
            assert all(data["offset"] <= o < data["offset"] + data["size"] for o in info["table"].values())
        else:
            assert all(0 <= o < info["size"] for o in info["table"].values())


@pytest.mark.parametrize("name", BLOBS)
def test_shipped_blobs_match_their_manifests(name):
    m = stored_json(name)
    for arch, info in m["arches"].items():
        with open(os.path.join(_native.NATIVE_DIR, info["blob"]), "rb") as f:
            data = f.read()
        assert hashlib.sha256(data).hexdigest() == info["sha256"], arch
        assert len(data) == info["size"], arch
        assert info["checksum"] == int.from_bytes(data, "little") % 1073741789, arch
        assert _native.checksum(data) == _build_module().checksum(data) == info["checksum"], arch
        assert all(0 <= off < info["size"] for off in info["symbols"].values() if info["data"] is None)


def test_every_shipped_file_belongs_to_a_manifest():
    listed = {n + ext for n in BLOBS for ext in (".json", ".manifest")}
    for name in BLOBS:
        listed |= {info["blob"] for info in stored_json(name)["arches"].values()}
    assert set(os.listdir(_native.NATIVE_DIR)) - {"__pycache__"} == listed  # (verdicts: not shipped)


@pytest.mark.parametrize("name", BLOBS)
def test_the_marshal_manifest_is_exactly_the_json_one(name):
    """The loader reads ``<name>.manifest``: it must hold exactly the dict of
    ``<name>.json`` (same keys in the same order, same values of the same types)."""
    with open(os.path.join(_native.NATIVE_DIR, name + ".manifest"), "rb") as f:
        packed = marshal.loads(f.read())
    canonical = stored_json(name)
    assert packed == canonical and repr(packed) == repr(canonical)
    loaded = _native.read_manifest(name)
    assert loaded == canonical and repr(loaded) == repr(canonical)
    assert _native.manifest_path(name) == os.path.join(_native.NATIVE_DIR, name + ".manifest")
    assert _build_module().same_value(packed, canonical)


@pytest.mark.parametrize("name", BLOBS)
def test_recorded_source_digests_match_the_sources(name):
    """Each blob was built from the C sources in native/ as they are now (else run
    ``python native/build.py``)."""
    recorded = stored_json(name)["sources"]
    assert recorded, name
    for source, digest in recorded.items():
        with open(os.path.join(NATIVE_SRC, source), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, f"native/{source} changed: run python native/build.py"
    assert recorded == _build_module().source_digests(_build_module().target(name))


def test_build_knows_every_shipped_blob():
    build = _build_module()
    assert {t.name for t in build.TARGETS} == set(BLOBS)
    assert (build.FORMAT, build.CHECKSUM_MODULUS) == (_native.FORMAT, _native.CHECKSUM_MODULUS)
    for t in build.TARGETS:
        assert set(stored_json(t.name)["arches"]) == set(t.arches), t.name


def _copy_native_dir(tmp_path) -> str:
    out = tmp_path / "native"
    shutil.copytree(_native.NATIVE_DIR, out)
    return str(out)


@pytest.mark.parametrize("name", BLOBS)
def test_build_manifests_mode_recomputes_the_checksum_and_writes_both_forms(name, tmp_path):
    """``build.py --manifests`` turns a format-2 manifest (no checksum, no .manifest) into
    what is shipped, from the stored .bin files alone."""
    out = _copy_native_dir(tmp_path)
    old = stored_json(name)
    old["format"] = 2
    for info in old["arches"].values():
        del info["checksum"]
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(old, f)
    os.remove(os.path.join(out, name + ".manifest"))
    run = subprocess.run([sys.executable, os.path.join(NATIVE_SRC, "build.py"), "--manifests", "--only", name,
                          "--out", out], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    for ext in (".json", ".manifest"):
        with open(os.path.join(out, name + ext), "rb") as f:
            got = f.read()
        with open(os.path.join(_native.NATIVE_DIR, name + ext), "rb") as f:
            shipped = f.read()
        if ext == ".json":
            assert got == shipped
        else:
            assert _build_module().same_value(marshal.loads(got), marshal.loads(shipped))


def test_build_manifests_mode_refuses_a_bin_that_is_not_the_recorded_one(tmp_path):
    out = _copy_native_dir(tmp_path)
    info = stored_json("sysmon313")["arches"]["x86_64"]
    shutil.copy(os.path.join(out, "sysmon312-x86_64.bin"), os.path.join(out, info["blob"]))
    before = (tmp_path / "native" / "sysmon313.json").read_bytes()
    run = subprocess.run([sys.executable, os.path.join(NATIVE_SRC, "build.py"), "--manifests", "--only", "sysmon313",
                          "--out", out], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "does not match its recorded size and sha256" in run.stdout, run.stdout
    assert (tmp_path / "native" / "sysmon313.json").read_bytes() == before


@pytest.mark.parametrize("damage", ["missing", "other dict", "truncated", "format"])
def test_build_check_compares_the_stored_marshal_manifest_and_bins(damage, tmp_path, capsys):
    """What ``--check`` verifies without a compiler: the .manifest holds exactly the
    .json, the format is the build's, and each .bin has its size, sha256 and checksum."""
    build = _build_module()
    t = build.target("sysmon313")
    out = _copy_native_dir(tmp_path)
    stored = build.read_manifest(t.name, out)
    assert build._check_stored(t, stored, t.arches, out) == 0
    assert "sysmon313.manifest holds exactly sysmon313.json" in capsys.readouterr().out
    path = os.path.join(out, "sysmon313.manifest")
    if damage == "missing":
        os.remove(path)
        expect = "MISSING sysmon313.manifest"
    elif damage == "other dict":
        changed = json.loads(json.dumps(stored))
        changed["arches"]["x86_64"]["size"] = 1.0 * changed["arches"]["x86_64"]["size"]  # == but not the same
        with open(path, "wb") as f:
            f.write(marshal.dumps(changed, 4))
        expect = "sysmon313.manifest DIFFERENT from sysmon313.json"
    elif damage == "truncated":
        with open(os.path.join(out, "sysmon313-aarch64.bin"), "r+b") as f:
            f.truncate(100)
        expect = "the stored sysmon313-aarch64.bin does not match its manifest (size, sha256, checksum)"
    else:
        stored["format"] = 2
        expect = "manifest format 2, this build writes 3"
    assert build._check_stored(t, stored, t.arches, out) == 1
    assert expect in capsys.readouterr().out


# --------------------------------------------------------------------------- version facts in C
#: The macros that say which CPython version the C code is compiled against.
VERSION_MACROS = re.compile(r"\bPY_(VERSION_HEX|MAJOR_VERSION|MINOR_VERSION|MICRO_VERSION|RELEASE_LEVEL|RELEASE_SERIAL)\b")
#: Version tests allowed outside native/compat.h: the 3.11 shim is built against 3.11
#: only; its one test refuses any other version.
VERSION_TESTS_ALLOWED = {("shim311.h", "#if PY_VERSION_HEX < 0x030B0000 || PY_VERSION_HEX >= 0x030C0000")}


def preprocessor_conditions(text: str):
    """(line number, directive) of each ``#if``/``#elif`` (and ``#ifdef``, ``#ifndef``,
    ``#elifdef``, ``#elifndef``) of C ``text``: comments removed, continued lines joined."""
    text = re.sub(r"/\*.*?\*/", lambda m: " " + "\n" * m.group().count("\n"), text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        start, line = i, lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i]
        m = re.match(r"\s*#\s*(if|elif|ifdef|ifndef|elifdef|elifndef)\b(.*)", line)
        if m:
            out.append((start + 1, "#" + m.group(1) + " " + " ".join(m.group(2).split())))
        i += 1
    return out


def version_tests(text: str):
    """The conditions of C ``text`` that test the CPython version."""
    return [(n, d) for n, d in preprocessor_conditions(text) if VERSION_MACROS.search(d)]


def test_the_version_test_finder_sees_every_spelling():
    found = version_tests("#if PY_VERSION_HEX >= 0x030D0000\n#elif  PY_MINOR_VERSION > 12\n"
                          "  #  if defined(X) && \\\n   PY_VERSION_HEX < 0x030E0000\n#ifdef PY_MICRO_VERSION\n"
                          "#if MS_HAS_X /* PY_VERSION_HEX */\n// #if PY_VERSION_HEX\n/* #if PY_VERSION_HEX\n*/\n"
                          "    PY_VERSION_HEX,\n#define V (PY_VERSION_HEX >= 1)\n#if MS_HAS_Y\n")
    assert [n for n, _ in found] == [1, 2, 3, 5], found
    assert found[2][1] == "#if defined(X) && PY_VERSION_HEX < 0x030E0000"


def test_version_tests_live_only_in_compat_h():
    """native/ tests the CPython version (PY_VERSION_HEX and the like) in an ``#if`` or
    ``#elif`` only in compat.h; the sources read the facts it names (MS_HAS_...). The
    layout table's ``PY_VERSION_HEX`` entry is a value, not a test."""
    elsewhere = []
    for path in sorted(glob.glob(os.path.join(NATIVE_SRC, "*.[ch]"))):
        name = os.path.basename(path)
        if name == "compat.h":
            continue
        with open(path, encoding="utf-8") as f:
            elsewhere += [(name, n, d) for n, d in version_tests(f.read()) if (name, d) not in VERSION_TESTS_ALLOWED]
    assert not elsewhere, "version tests outside native/compat.h (name a fact there): " + repr(elsewhere)
    with open(os.path.join(NATIVE_SRC, "compat.h"), encoding="utf-8") as f:
        assert version_tests(f.read())  # (its guard: CPython 3.12 to 3.15)
    with open(os.path.join(NATIVE_SRC, "sysmon.c"), encoding="utf-8") as f:
        assert "PY_VERSION_HEX," in f.read()  # the layout entry the loader compares


def test_each_version_fact_says_why_and_is_used():
    """Each ``MS_HAS_...`` of compat.h is defined from PY_VERSION_HEX under a comment
    that names the version it is about, and is read somewhere besides its definition."""
    with open(os.path.join(NATIVE_SRC, "compat.h"), encoding="utf-8") as f:
        compat = f.read()
    with open(os.path.join(NATIVE_SRC, "sysmon.c"), encoding="utf-8") as f:
        sysmon = f.read()
    facts = re.findall(r"/\*((?:(?!\*/).)*)\*/\n#define (MS_HAS_\w+) \((PY_VERSION_HEX [<>]=? 0x03[0-9A-F]{6})\)\n",
                       compat, re.S)
    assert len(facts) == compat.count("#define MS_HAS_") >= 5, facts
    for why, name, _test in facts:
        assert re.search(r"\b3\.1\d\b", why), name
        assert len(re.findall(r"\b%s\b" % name, compat + sysmon)) >= 2, f"{name} is never read"


def test_sysmon_includes_only_listed_sources():
    """Every file sysmon.c includes from native/ is one of the blobs' sources, so that its
    digest is in the manifest and a change to it without a rebuild fails the suite."""
    with open(os.path.join(NATIVE_SRC, "sysmon.c"), encoding="utf-8") as f:
        local = re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read(), re.M)
    assert "compat.h" in local
    for name in ("sysmon312", "sysmon313", "sysmon314", "sysmon315"):
        assert set(local) <= set(_build_module().target(name).sources) == set(stored_json(name)["sources"]), name


# --------------------------------------------------------------------------- reproducible
@pytest.mark.parametrize("name, arch", [("sysmon312", "x86_64"), ("sysmon313", "x86_64"), ("sysmon313", "aarch64"),
                                        ("sysmon314", "x86_64"), ("sysmon314", "aarch64"),
                                        ("sysmon315", "x86_64"), ("sysmon315", "aarch64"),
                                        ("evalframe311", "x86_64"), ("evalframe311", "aarch64")])
def test_shipped_blob_is_reproducible(name, arch):
    """``native/build.py --check`` rebuilds the blob and finds the same bytes and manifest
    entry (skipped without the compiler and headers that built it)."""
    build = _build_module()
    t = build.target(name)
    why = build.why_not(t, arch, build.find_include(t.python, t.headers), stored_json(name))
    if why:
        pytest.skip(why)
    out = subprocess.run([sys.executable, os.path.join(NATIVE_SRC, "build.py"), "--check", "--only", name,
                          "--arch", arch], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{name}-{arch}: identical" in out.stdout, out.stdout


def test_multiarch_pyconfig_is_found_per_architecture(tmp_path, monkeypatch):
    """Debian's pyconfig.h wraps one per architecture: each build looks for its own,
    beside the headers, then under --multiarch; without it that architecture cannot be
    built (skipped with the reason), the other still can."""
    build = _build_module()
    inc = tmp_path / "usr" / "include" / "python3.14"
    inc.mkdir(parents=True)
    (inc / "pyconfig.h").write_text(
        "#if defined(__x86_64__)\n#  include <x86_64-linux-gnu/python3.14/pyconfig.h>\n"
        "#elif defined(__aarch64__)\n#  include <aarch64-linux-gnu/python3.14/pyconfig.h>\n#endif\n")
    x86 = tmp_path / "usr" / "include" / "x86_64-linux-gnu" / "python3.14"
    x86.mkdir(parents=True)
    (x86 / "pyconfig.h").write_text("")
    arm_root = tmp_path / "arm64" / "usr" / "include"
    (arm_root / "aarch64-linux-gnu" / "python3.14").mkdir(parents=True)
    (arm_root / "aarch64-linux-gnu" / "python3.14" / "pyconfig.h").write_text("")
    monkeypatch.setattr(build, "MULTIARCH_ROOTS", [])
    assert build.multiarch_dirs(str(inc), "x86_64") == [str(tmp_path / "usr" / "include")]
    with pytest.raises(build.BuildError, match="no aarch64-linux-gnu/python3.14/pyconfig.h"):
        build.multiarch_dirs(str(inc), "aarch64")
    monkeypatch.setattr(build, "MULTIARCH_ROOTS", [str(tmp_path / "elsewhere"), str(arm_root)])
    assert build.multiarch_dirs(str(inc), "aarch64") == [str(arm_root)]
    (inc / "pyconfig.h").write_text("#define SIZEOF_LONG 8\n")  # a real one (pyenv): nothing to add
    assert build.multiarch_dirs(str(inc), "aarch64") == []


def test_build_refuses_external_symbols(tmp_path):
    build = _build_module()
    if build.have_tools("x86_64"):
        pytest.skip("no x86-64 toolchain")
    inc = build.find_include("3.12") or build.find_include("3.13")
    if inc is None:
        pytest.skip("no headers")
    t = build.Target("bad", "sysmon", "3.12", ("bad.c",), ("x86_64",), ("Python.h",))
    (tmp_path / "bad.c").write_text("#include <Python.h>\nPyObject *f(void) { return PyTuple_New(1); }\n")
    old = build.HERE
    build.HERE = str(tmp_path)
    try:
        with pytest.raises(build.BuildError, match="external symbols"):
            build.build_arch(t, "x86_64", inc, str(tmp_path / "out"))
    finally:
        build.HERE = old


# --------------------------------------------------------------------------- refusals
def test_missing_blob_is_refused():
    with pytest.raises(_native.NativeUnavailable, match="not shipped"):
        _native.read_manifest("sysmon399")


@pytest.mark.parametrize("value, got", [({"format": 1, "arch": "x86_64"}, "1"), ({"format": 2, "arches": {}}, "2"),
                                        (["not", "a", "dict"], "None")])
def test_unknown_manifest_format_is_refused(value, got, tmp_path, monkeypatch):
    (tmp_path / "old.manifest").write_bytes(marshal.dumps(value, 4))
    monkeypatch.setattr(_native, "NATIVE_DIR", str(tmp_path))
    with pytest.raises(_native.NativeUnavailable, match=f"unknown manifest format {got}$"):
        _native.read_manifest("old")


@pytest.mark.parametrize("name", BLOBS)
def test_an_architecture_without_code_is_refused(name, monkeypatch):
    monkeypatch.setattr(_env, "MACHINE", "riscv64")
    with pytest.raises(_native.NativeUnavailable, match=f"no {name} code for riscv64"):
        _native.load_copy(name)


@pytest.mark.parametrize("name", BLOBS)
@pytest.mark.parametrize("damage", ["one byte", "truncated", "extended", "another build"])
def test_a_corrupted_blob_is_refused(name, damage, tmp_path, monkeypatch):
    """The size and checksum catch a changed byte, a truncated or extended image and
    an image of another build (the same size: sysmon314 and sysmon315 have 24,720 bytes on
    x86-64).
    (Trailing zero bytes leave the integer, hence the checksum, unchanged: the size
    check catches those.)"""
    for f in os.listdir(_native.NATIVE_DIR):
        if f != "__pycache__":
            shutil.copy(os.path.join(_native.NATIVE_DIR, f), tmp_path / f)
    info = _native.read_manifest(name)["arches"].get(_native.machine())
    if info is None:
        pytest.skip(f"no {name} code for this architecture")
    blob = tmp_path / info["blob"]
    data = bytearray(blob.read_bytes())
    if damage == "one byte":
        data[10] ^= 0xFF
    elif damage == "truncated":
        del data[len(data) // 2:]
    elif damage == "extended":
        data += bytes(8)  # zeros: the same integer, so the same checksum; the size differs
    else:
        other = "sysmon315" if name == "sysmon314" else "sysmon314"
        other_info = _native.read_manifest(other)["arches"].get(_native.machine())
        if other_info is None:
            pytest.skip(f"no {other} code for this architecture")
        data = bytearray((tmp_path / other_info["blob"]).read_bytes())
    blob.write_bytes(bytes(data))
    match = "size differs" if damage == "extended" else r"does not match its manifest \(checksum\)"
    monkeypatch.setattr(_native, "NATIVE_DIR", str(tmp_path))
    with pytest.raises(_native.NativeUnavailable, match=match):
        _native.read_image(name)
    with pytest.raises(_native.NativeUnavailable, match=match):
        _native.load_copy(name)


@needs_own_blob
def test_refuses_when_the_os_refuses_executable_memory(monkeypatch):
    monkeypatch.setattr(_native, "_mprotect", lambda addr, size, prot: errno.EACCES)
    with pytest.raises(_native.NativeUnavailable, match="refused executable memory"):
        _native.load_copy(own_blob())  # type: ignore[arg-type]


@needs_own_blob
def test_a_symbol_the_interpreter_lacks_is_refused(monkeypatch):
    name = own_blob()
    manifest = _native.read_manifest(name)  # type: ignore[arg-type]
    info = manifest["arches"][_native.machine()]
    table = dict(info["table"])
    first = next(iter(table))
    table["f:monstack_no_such_function"] = table.pop(first)
    info["table"] = table
    with pytest.raises(_native.NativeUnavailable, match="monstack_no_such_function"):
        _native.load_copy(name, manifest)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- loading
def _perms(lo_addr: int, hi_addr: int) -> dict:
    out = {}
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo < hi_addr and hi > lo_addr:
                out[lo] = line.split()[1]
    return out


@needs_own_blob
def test_loaded_code_is_never_writable_and_executable_and_stays_mapped():
    blob = _native.load_copy(own_blob())  # type: ignore[arg-type]
    perms = _perms(blob.base, blob.base + blob.map_size)
    assert perms[blob.base].startswith("r-x"), perms
    assert not any("w" in p and "x" in p for p in perms.values()), perms
    if blob.data:
        assert any(p.startswith("rw-") for p in perms.values()), perms
        blob.put_i64(8, 1234)
        assert blob.get_i64(8) == 1234
        with pytest.raises(IndexError):
            blob.get_i64(blob.info["data"]["size"])
    del blob
    import gc

    gc.collect()
    assert any(e[0] == "mapping" for e in _native._FOREVER)


@needs_own_blob
def test_the_table_holds_the_interpreter_s_addresses():
    blob = _native.load_copy(own_blob())  # type: ignore[arg-type]
    for entry, offset in blob.info["table"].items():
        assert ctypes.c_void_p.from_address(blob.base + offset).value == _native.resolve(entry), entry
    for symbol, offset in blob.symbols.items():
        assert blob.addr(symbol) == blob.base + offset
    with pytest.raises(_native.NativeUnavailable, match="no symbol"):
        blob.addr("ms_nonesuch")


@needs_own_blob
def test_load_maps_once_per_process_load_copy_each_time():
    name = own_blob()
    assert _native.load(name) is _native.load(name)  # type: ignore[arg-type]
    a, b = _native.load_copy(name), _native.load_copy(name)  # type: ignore[arg-type]
    assert a.base != b.base


def test_api_function_is_private_and_made_once():
    f = _native.api_function("PyLong_FromLong", ctypes.py_object, ctypes.c_long)
    assert f(7) == 7
    assert _native.api_function("PyLong_FromLong", ctypes.py_object, ctypes.c_long) is f
    with pytest.raises(_native.NativeUnavailable, match="does not export"):
        _native.api_function("monstack_nonesuch", None)


@pytest.mark.skipif(_native.machine() != "aarch64", reason="the instruction cache is flushed on aarch64 only")
def test_icache_flush_is_available():
    buf = ctypes.create_string_buffer(256)
    _native._clear_icache(ctypes.addressof(buf), ctypes.addressof(buf) + 256)  # raises if it cannot


# --------------------------------------------------------------------------- no json, no digest, no mmap

def _broken_marshal():
    # a dict whose key is a list: marshal.loads raises TypeError (unhashable)
    return b"{" + marshal.dumps([], 4) + marshal.dumps(1, 4) + b"0"


@pytest.mark.parametrize("data", [b"", b"\xff\x00", b"{", marshal.dumps({"format": 3, "arches": {}}, 4)[:-3],
                                  _broken_marshal()],
                         ids=["empty", "bad type code", "eof", "truncated", "unhashable key"])
def test_a_broken_manifest_is_refused_with_the_reason(data, tmp_path, monkeypatch):
    (tmp_path / "broken.manifest").write_bytes(data)
    monkeypatch.setattr(_native, "NATIVE_DIR", str(tmp_path))
    with pytest.raises(_native.NativeUnavailable, match="broken.manifest: unreadable manifest"):
        _native.read_manifest("broken")


def test_an_unreadable_manifest_is_refused_with_the_reason(tmp_path, monkeypatch):
    (tmp_path / "dir.manifest").mkdir()  # open() raises IsADirectoryError (an OSError)
    monkeypatch.setattr(_native, "NATIVE_DIR", str(tmp_path))
    with pytest.raises(_native.NativeUnavailable, match="dir.manifest: unreadable manifest"):
        _native.read_manifest("dir")


def test_the_checksum_is_the_image_modulo_a_prime():
    p = _native.CHECKSUM_MODULUS
    assert p == 1073741789 < 2**30 and all(p % k for k in range(2, int(p**0.5) + 1))  # prime, one int digit
    assert _native.checksum(b"") == 0
    assert _native.checksum(b"\x01\x02") == 0x0201
    assert _native.checksum(b"\xff" * 8) == (2**64 - 1) % 1073741789
    assert _native.checksum(b"\xff" * 8 + b"\x00") == _native.checksum(b"\xff" * 8)  # the size check's job


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the constants are Linux's")
def test_mmap_constants_are_the_mmap_modules():
    import mmap

    assert (_native._PROT_READ, _native._PROT_WRITE, _native._PROT_EXEC) == (mmap.PROT_READ, mmap.PROT_WRITE, mmap.PROT_EXEC)
    assert (_native._MAP_PRIVATE, _native._MAP_ANONYMOUS) == (mmap.MAP_PRIVATE, mmap.MAP_ANONYMOUS)
    assert os.sysconf("SC_PAGE_SIZE") == mmap.PAGESIZE


def test_table_slots_resolve_as_ctypes_resolves_them():
    """resolve() looks symbols up with _ctypes.dlsym; ctypes.pythonapi gives the same."""
    entries = ["f:PyCapsule_New", "o:_Py_NoneStruct", "p:PyExc_TypeError"]
    got = [_native.resolve(e) for e in entries]
    api = ctypes.pythonapi
    assert got == [
        ctypes.cast(api.PyCapsule_New, ctypes.c_void_p).value,
        ctypes.addressof(ctypes.c_char.in_dll(api, "_Py_NoneStruct")),
        ctypes.c_void_p.in_dll(api, "PyExc_TypeError").value,
    ]
    assert got[1] == id(None) and got[2] == id(TypeError)
    with pytest.raises(_native.NativeUnavailable, match="does not export monstack_nonesuch"):
        _native.resolve("f:monstack_nonesuch")
    with pytest.raises(_native.NativeUnavailable, match="bad table entry"):
        _native.resolve("x:PyCapsule_New")


def test_the_method_def_layout_is_ctypes_structure_s():
    """_native lays PyMethodDef out by hand (a ctypes Structure would import ctypes on
    3.14+): the same offsets and size as the Structure ctypes makes of its fields."""

    class PyMethodDef(ctypes.Structure):
        _fields_ = [("ml_name", ctypes.c_char_p), ("ml_meth", ctypes.c_void_p),
                    ("ml_flags", ctypes.c_int), ("ml_doc", ctypes.c_char_p)]

    assert (_native.ML_NAME, _native.ML_METH, _native.ML_FLAGS, _native.ML_DOC, _native.SIZEOF_PYMETHODDEF) == (
        PyMethodDef.ml_name.offset, PyMethodDef.ml_meth.offset, PyMethodDef.ml_flags.offset,
        PyMethodDef.ml_doc.offset, ctypes.sizeof(PyMethodDef))


@needs_own_blob
def test_loading_imports_neither_ctypes_nor_sysconfig_nor_threading(tmp_path):
    """The loader uses _ctypes through monstack._cdata: loading and checking this
    interpreter's blob (as MONSTACK=1 does at start-up) imports no ctypes (~9.6M
    instructions on 3.13), and so not 3.14's sysconfig, which imports threading; nor
    json or _json (the manifest is read with marshal), nor a SHA-256 module (the image
    is checked with its checksum)."""
    check = ("from monstack._evalframe import EvalFrameBackend as B; why = B.unavailable()" if own_blob() == "evalframe311"
             else "from monstack import _accel; why = _accel.unavailable()")
    code = (
        "import sys; sys.path.insert(0, %r); %s; from monstack import _native; "
        "print(why, sorted({'ctypes', 'sysconfig', 'threading', 'json', '_json', 'hashlib', '_sha2', '_sha256'}"
        " & set(sys.modules)), list(_native.checked.values())[0].split(' (')[0])" % (ROOT, check)
    )
    # checked here, then trusted (a verdict written under a private bytecode prefix)
    env = dict(os.environ, PYTHONPYCACHEPREFIX=str(tmp_path))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    for how in ("at load", "by an earlier process"):
        out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "None [] " + how


def test_word_functions_pass_and_return_machine_words():
    """The loader calls C through two prototypes, every argument a word: an object as its
    address, an int argument in the low half of its word, an int result read by int32."""
    if not (_env.LINUX and _native.machine() in ("x86_64", "aarch64")):
        pytest.skip("the loader calls word functions only on x86-64 and aarch64 Linux")
    as_ssize_t = _native.api_word("PyLong_AsSsize_t", 1)
    assert _native.api_word("PyLong_AsSsize_t", 1) is as_ssize_t  # (one object per name and arity)
    minus_two, big = -2, 2**40 + 5
    assert _native.signed(as_ssize_t(id(minus_two))) == -2
    assert as_ssize_t(id(big)) == big
    with pytest.raises(TypeError):  # (a C-API error is raised, the prototype checks errors)
        as_ssize_t(id("not an int"))
    assert _native.api_object("PyLong_FromSsize_t", 1)(-3) == -3  # (a new reference, counted)
    # int PyObject_RichCompareBool(PyObject *, PyObject *, int op): an int in and out
    compare = _native.api_word("PyObject_RichCompareBool", 3)
    one, two = 1, 2
    assert _native.int32(compare(id(one), id(two), 0)) == 1  # Py_LT
    assert _native.int32(compare(id(two), id(one), 0)) == 0
    assert [_native.int32(v) for v in (None, 1, 0xFFFFFFFF, 0x1_0000_0005, 2**64 - 1)] == [0, 1, -1, 5, -1]
    # libc's, the GIL released and errno kept (mprotect of an unaligned address: EINVAL)
    assert _native.int32(_native.libc_word("mprotect", 3)(1, 4096, 1)) == -1
    assert _cdata.get_errno() == errno.EINVAL
    with pytest.raises(_native.NativeUnavailable, match="does not export"):
        _native.api_word("monstack_nonesuch", 0)
    data = b"monstack words"
    assert _native.read_bytes(_native.buffer_address(data), 8) == b"monstack"


def test_loading_and_checking_makes_two_prototypes_and_two_c_types(tmp_path):
    """Each ctypes prototype and C type is a class (~0.1-0.2M instructions of start-up):
    a process that loads its blob and checks it against the interpreter (no verdict)
    makes the loader's two prototypes and c_void_p and py_object, nothing more."""
    if own_blob() is None:
        pytest.skip("no blob for this interpreter")
    check = ("from monstack._evalframe import EvalFrameBackend as B; why = B.unavailable()" if own_blob() == "evalframe311"
             else "from monstack import _accel; why = _accel.unavailable()")
    code = (
        "import sys; sys.path.insert(0, %r); %s; "
        "from monstack import _cdata as C, _native; "
        "print(why, list(_native.checked.values())[0], len(C._c_functype_cache), "
        "sorted(n for n in list(C._LAZY_TYPES) + list(C._SIZED) + ['memmove'] if n in vars(C)))" % (ROOT, check)
    )
    # (no verdict: a private bytecode prefix, nothing written)
    env = dict(os.environ, PYTHONPYCACHEPREFIX=str(tmp_path), PYTHONDONTWRITEBYTECODE="1")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "at", "load", "2", "[]"]


def test_signed_reads_a_word_result_as_a_signed_64_bit_integer():
    assert [_native.signed(v) for v in (None, 0, 1, 2**63 - 1, 2**63, 2**64 - 1)] == [0, 0, 1, 2**63 - 1, -2**63, -1]
    # the prototype it lets functions share: a Py_ssize_t result read through c_void_p
    neg = _native.api_function("PyLong_AsSsize_t", _cdata.c_void_p, _cdata.c_void_p)
    minus_two = -2
    assert _native.signed(neg(id(minus_two))) == -2


# --------------------------------------------------------------------------- verdicts
@pytest.fixture
def private_blobs(tmp_path, monkeypatch) -> str:
    """A copy of the shipped blobs, whose verdicts go beside it (bytecode written)."""
    where = tmp_path / "site" / "monstack" / "_native"
    shutil.copytree(_native.NATIVE_DIR, where, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(_native, "NATIVE_DIR", str(where))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.setattr(_native, "checked", {})
    monkeypatch.setattr(_native, "_verdict_keys", {})
    checker = tmp_path / "site" / "checker.py"
    checker.write_text("# the module that checks\n")
    return str(checker)


@pytest.mark.parametrize("name", BLOBS)
def test_a_verdict_is_trusted_for_the_same_interpreter_blob_and_checker(name, private_blobs):
    if _native.machine() not in _native.read_manifest(name)["arches"]:
        pytest.skip(f"no {name} code for this architecture")
    _, info = _native.arch_entry(name)
    assert _native.trusted(name, info, private_blobs) is None
    assert _native.checked[name] == "at load"
    _native.remember(name, {"fact": 1})
    path = _native.verdict_path(name)
    site = os.path.dirname(os.path.dirname(_native.NATIVE_DIR))  # beside the package, not in it
    assert path == os.path.join(site, "__pycache__", f"monstack_{name}.{sys.implementation.cache_tag}.verdict")
    assert os.path.isfile(path)
    assert _native.trusted(name, info, private_blobs) == {"fact": 1}
    assert _native.checked[name] == f"by an earlier process ({path})"


@pytest.mark.parametrize("change", ["blob", "manifest", "checker", "interpreter", "unreadable", "foreign"])
def test_a_verdict_is_not_trusted_once_anything_it_was_for_changed(change, private_blobs):
    name = own_blob() or "sysmon314"
    _, info = _native.arch_entry(name)
    _native.trusted(name, info, private_blobs)
    _native.remember(name, {"fact": 1})
    path = _native.verdict_path(name)
    if change in ("blob", "manifest", "checker"):
        target = {"blob": os.path.join(_native.NATIVE_DIR, info["blob"]), "manifest": _native.manifest_path(name),
                  "checker": private_blobs}[change]
        st = os.stat(target)
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    elif change == "interpreter":  # another build of this version: its symbols lie elsewhere
        with open(path, "rb") as f:
            key, facts = marshal.loads(f.read())
        moved = key[:5] + (tuple(d + 16 for d in key[5]),) + key[6:]
        with open(path, "wb") as f:
            f.write(marshal.dumps((moved, facts)))
    elif change == "unreadable":
        with open(path, "wb") as f:
            f.write(b"\xff not marshal")
    else:
        with open(path, "wb") as f:
            f.write(marshal.dumps(("another", "layout")))
    assert _native.trusted(name, info, private_blobs) is None
    assert _native.checked[name] == "at load"


def test_no_verdict_is_written_without_bytecode_or_a_writable_directory(private_blobs, monkeypatch):
    name = own_blob() or "sysmon314"
    _, info = _native.arch_entry(name)
    _native.trusted(name, info, private_blobs)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    _native.remember(name, {})
    assert not os.path.exists(_native.verdict_path(name))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    os.makedirs(os.path.dirname(_native.verdict_path(name)))
    os.chmod(os.path.dirname(_native.verdict_path(name)), 0o500)
    try:
        _native.remember(name, {})  # (as root the directory is still writable: no error either way)
    finally:
        os.chmod(os.path.dirname(_native.verdict_path(name)), 0o700)
    assert not [f for f in os.listdir(os.path.dirname(_native.verdict_path(name))) if f.endswith(".tmp")]


def test_a_never_remembered_blob_writes_nothing(private_blobs):
    _native.remember("sysmon314", {})  # no key: trusted() was not asked (nothing was checked)
    assert not os.path.exists(_native.verdict_path("sysmon314"))


TRUSTED_PROBE = r"""
import sys, monstack
from monstack import _env, _native
def inner():
    snap, f, real = monstack.snapshot(), sys._getframe(), []
    while f is not None:
        real.append(f.f_code.co_name)
        f = f.f_back
    return [f.name for f in snap.frames], real[::-1]
def outer():
    return inner()
backend = monstack.install(track="all")
shadow, real = outer()
s = monstack.status()
print(backend, list(_native.checked.values())[0].split(" (")[0], shadow == real,
      s.get("native calls", "-"), s.get("accelerator", "-"), sep="|", end="|")
print("TAIL_CALL_INTERP" in vars(_env))  # (a build variable: read only when checking)
"""


@needs_own_blob
def test_a_process_that_trusts_the_verdict_tracks_as_one_that_checked(tmp_path):
    """Two processes: the first checks the interpreter and writes the verdict, the
    second trusts it and skips the checks; both load the native code and keep the
    real stack, with the same direct-call decision."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MONSTACK", "PYTHONDONTWRITE"))}
    env.update(PYTHONPYCACHEPREFIX=str(tmp_path), PYTHONPATH=ROOT)
    outs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", TRUSTED_PROBE], capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0 and out.stderr == "", out.stderr
        outs.append(out.stdout.split("|", 2))
    (backend, first, rest1), (backend2, second, rest2) = outs
    assert (first, second) == ("at load", "by an earlier process")
    assert backend == backend2 != "walk"
    (same1, read1), (same2, read2) = rest1.rsplit("|", 1), rest2.rsplit("|", 1)
    assert same1 == same2 and same1.startswith("True")
    assert read2.strip() == "False" and read1.strip() == str(backend == "monitoring")
