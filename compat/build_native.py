#!/usr/bin/env python3
"""Turn a C file into a relocation-free machine-code blob monstack loads with ctypes.

Generic (not tied to one blob): ``build(source, include_dir, arch, out_stem)`` compiles
``source`` against the CPython headers in ``include_dir`` for ``arch`` (x86_64 or
aarch64), links it at address 0 with a flat linker script and writes

- ``<out_stem>.bin``: the bytes to map (text, read-only data, then the address table);
- ``<out_stem>.json``: its manifest: size, the offset of every global symbol, the
  CPython version of the headers, the compiler, the flags and the blob's sha256.

Rules the C file must follow (checked here, the build fails otherwise):

- no external symbol at all (``nm -u`` of the object is empty): every C-API function or
  object is reached through a table in the blob that the loader fills in at load time
  (see ``monstack/_native.py``: symbols ``ms_table`` / ``ms_table_names``);
- only PC-relative relocations in the object (no absolute addresses: the blob runs
  wherever it is mapped);
- no writable data besides that table (the blob is made read+execute after the table is
  filled: mutable state belongs in memory the code allocates).

Reproducible: the same compiler version and headers give the same bytes (no debug info,
no build paths, no timestamps). ``tests/test_accel.py`` rebuilds and compares.

Usage::

    python compat/build_native.py            # rebuild every target whose headers exist
    python compat/build_native.py --check    # rebuild into a temp dir and compare
    python compat/build_native.py --list     # show targets and the headers they use

Headers come from an interpreter of the target version found through pyenv or PATH
(``python3.12 -c 'import sysconfig; print(sysconfig.get_paths()["include"])'``), or
from ``--include 3.12=/path/to/include/python3.12``.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NATIVE_DIR = os.path.join(ROOT, "monstack", "_native")

#: (blob name prefix, C source, {target CPython version: architectures shipped}).
#: aarch64 is built with Debian's cross compiler (``gcc-aarch64-linux-gnu``) and shipped
#: only where its tests have run (3.13: under qemu-user on Debian's arm64 CPython; no
#: arm64 CPython 3.12 was available). ``--arch aarch64`` builds it for every version.
TARGETS = [
    ("sysmon", "sysmon_native.c", {"3.12": ("x86_64",), "3.13": ("x86_64", "aarch64")}),
]
ARCHES = ("x86_64", "aarch64")

CFLAGS = [
    "-std=gnu11", "-O2", "-DNDEBUG", "-fPIC", "-fno-plt", "-fvisibility=hidden",
    "-fno-stack-protector", "-fno-asynchronous-unwind-tables", "-fno-unwind-tables",
    "-fno-jump-tables", "-fno-common", "-fno-ident", "-fno-exceptions",
    "-fno-builtin", "-fno-tree-loop-distribute-patterns",
    "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers",
    "-Werror=implicit-function-declaration",
]
ARCH_CFLAGS = {
    "x86_64": ["-fcf-protection=none", "-mno-red-zone"],
    "aarch64": ["-mbranch-protection=none", "-mno-outline-atomics"],
}
TOOLS = {
    "x86_64": {"cc": "gcc", "ld": "ld", "objcopy": "objcopy", "nm": "nm", "readelf": "readelf"},
    "aarch64": {
        "cc": "aarch64-linux-gnu-gcc", "ld": "aarch64-linux-gnu-ld",
        "objcopy": "aarch64-linux-gnu-objcopy", "nm": "aarch64-linux-gnu-nm",
        "readelf": "aarch64-linux-gnu-readelf",
    },
}
#: On the build host, its native tools may be the plain names.
if platform.machine() == "aarch64":  # pragma: no cover - depends on the host
    TOOLS["aarch64"] = dict(TOOLS["x86_64"])
    TOOLS["x86_64"] = {k: "x86_64-linux-gnu-" + v for k, v in TOOLS["x86_64"].items()}

ALLOWED_RELOCS = {
    "x86_64": {"R_X86_64_PC32", "R_X86_64_PLT32"},
    "aarch64": {
        "R_AARCH64_ADR_PREL_PG_HI21", "R_AARCH64_ADD_ABS_LO12_NC",
        "R_AARCH64_LDST8_ABS_LO12_NC", "R_AARCH64_LDST16_ABS_LO12_NC",
        "R_AARCH64_LDST32_ABS_LO12_NC", "R_AARCH64_LDST64_ABS_LO12_NC",
        "R_AARCH64_LDST128_ABS_LO12_NC", "R_AARCH64_CALL26", "R_AARCH64_JUMP26",
        "R_AARCH64_CONDBR19", "R_AARCH64_TSTBR14", "R_AARCH64_PREL32",
        "R_AARCH64_ADR_PREL_LO21", "R_AARCH64_LD_PREL_LO19",
    },
}

LINKER_SCRIPT = """\
SECTIONS
{
  . = 0;
  .text : { *(.text .text.*) }
  . = ALIGN(64);
  .rodata : { *(.rodata .rodata.*) }
  . = ALIGN(64);
  .data : { *(.data.ms_table) *(.data .data.*) }
  .bss : { *(.bss .bss.*) *(COMMON) }
  /DISCARD/ : { *(.comment) *(.note*) *(.eh_frame*) *(.gnu*) }
}
"""


class BuildError(RuntimeError):
    pass


def _run(cmd: list[str], cwd: Optional[str] = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                          env=dict(os.environ, LC_ALL="C", SOURCE_DATE_EPOCH="0"))
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def have_tools(arch: str) -> Optional[str]:
    """None if the toolchain for ``arch`` is installed, else what is missing."""
    missing = [t for t in TOOLS[arch].values() if shutil.which(t) is None]
    return ("missing " + ", ".join(missing)) if missing else None


def compiler_version(arch: str) -> str:
    return _run([TOOLS[arch]["cc"], "--version"]).splitlines()[0].strip()


def find_include(version: str) -> Optional[str]:
    """The CPython include directory of an interpreter ``version`` found on this machine."""
    candidates: list[str] = []
    pyenv_root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    candidates += sorted(glob.glob(os.path.join(pyenv_root, "versions", version + ".*", "bin", "python" + version)))
    exe = shutil.which("python" + version)
    if exe:
        candidates.append(exe)
    if sys.version_info[:2] == tuple(map(int, version.split("."))):
        candidates.insert(0, sys.executable)
    for exe in candidates:
        try:
            out = subprocess.run(
                [exe, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
                capture_output=True, text=True, timeout=60,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        inc = out.stdout.strip()
        if out.returncode == 0 and os.path.isfile(os.path.join(inc, "Python.h")):
            return inc
    return None


def header_version(include_dir: str) -> str:
    with open(os.path.join(include_dir, "patchlevel.h")) as f:
        for line in f:
            if line.startswith("#define PY_VERSION "):
                return line.split('"')[1]
    raise BuildError(f"no PY_VERSION in {include_dir}/patchlevel.h")


def _symbols(nm: str, elf: str) -> dict[str, int]:
    out = {}
    for line in _run([nm, "--defined-only", elf]).splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "TtRrDdBb":
            out[parts[2]] = int(parts[0], 16)
    return out


def _check_object(arch: str, obj: str) -> None:
    tools = TOOLS[arch]
    undefined = [l.split()[-1] for l in _run([tools["nm"], "-u", obj]).splitlines() if l.strip()]
    if undefined:
        raise BuildError(f"{obj} names external symbols (use the table): {', '.join(undefined)}")
    bad = set()
    for line in _run([tools["readelf"], "-r", "-W", obj]).splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2].startswith("R_"):
            if parts[2] not in ALLOWED_RELOCS[arch]:
                bad.add(parts[2])
    if bad:
        raise BuildError(f"{obj} has relocations that are not PC-relative: {', '.join(sorted(bad))}")
    sections = _run([tools["readelf"], "-S", "-W", obj])
    for line in sections.splitlines():
        if ("] .data" in line or "] .bss" in line) and ".data.ms_table" not in line:
            fields = line.split("]", 1)[1].split()
            if len(fields) >= 5 and int(fields[4], 16) != 0:
                raise BuildError(f"{obj}: writable section {fields[0]} besides the table: state belongs on the heap")


def build(source: str, include_dir: str, arch: str, out_stem: str, workdir: Optional[str] = None) -> dict:
    """Build ``source`` into ``out_stem``.bin/.json; returns the manifest."""
    why = have_tools(arch)
    if why:
        raise BuildError(f"cannot build for {arch}: {why}")
    tools = TOOLS[arch]
    tmp = workdir or tempfile.mkdtemp(prefix="monstack-build-")
    try:
        src_dir = os.path.dirname(os.path.abspath(source))
        obj = os.path.join(tmp, "blob.o")
        elf = os.path.join(tmp, "blob.elf")
        binf = os.path.join(tmp, "blob.bin")
        script = os.path.join(tmp, "blob.ld")
        with open(script, "w") as f:
            f.write(LINKER_SCRIPT)
        flags = CFLAGS + ARCH_CFLAGS[arch]
        # Relative paths and prefix maps keep the build directory out of the output.
        _run([tools["cc"], *flags, f"-ffile-prefix-map={src_dir}=.", f"-ffile-prefix-map={include_dir}=include",
              "-I", include_dir, "-c", os.path.basename(source), "-o", obj], cwd=src_dir)
        _check_object(arch, obj)
        _run([tools["ld"], "-static", "-nostdlib", "--no-dynamic-linker", "-e", "0", "--build-id=none",
              "-T", script, "-o", elf, obj])
        rel = _run([tools["readelf"], "-r", "-W", elf])
        if "Relocation section" in rel:
            raise BuildError(f"{elf} still has relocations:\n{rel}")
        _run([tools["objcopy"], "-O", "binary", "--only-section=.text", "--only-section=.rodata",
              "--only-section=.data", elf, binf])
        syms = _symbols(tools["nm"], elf)
        with open(binf, "rb") as f:
            data = f.read()
        end = max(v for k, v in syms.items())
        if "ms_table" not in syms or "ms_table_names" not in syms:
            raise BuildError("the blob must define ms_table and ms_table_names")
        size = max(len(data), end)
        manifest = {
            "format": 1,
            "arch": arch,
            "python": header_version(include_dir),
            "compiler": compiler_version(arch),
            "cflags": flags,
            "source": os.path.basename(source),
            "size": size,
            "sha256": hashlib.sha256(data).hexdigest(),
            "symbols": dict(sorted(syms.items())),
        }
        os.makedirs(os.path.dirname(out_stem) or ".", exist_ok=True)
        with open(out_stem + ".bin", "wb") as f:
            f.write(data)
        with open(out_stem + ".json", "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.write("\n")
        return manifest
    finally:
        if workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)


def targets(include_overrides: Optional[dict] = None, arches: Optional[tuple] = None):
    """Yield (stem name, source path, include dir or None, arch, why-not or None).

    ``arches`` None: the shipped architectures of each version; else those, for all."""
    include_overrides = include_overrides or {}
    for prefix, source, versions in TARGETS:
        for version, shipped in versions.items():
            inc = include_overrides.get(version) or find_include(version)
            for arch in (arches or shipped):
                name = f"{prefix}{version.replace('.', '')}-{arch}"
                why = None if inc else f"no CPython {version} headers found"
                why = why or have_tools(arch)
                yield name, os.path.join(HERE, source), inc, arch, why


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="rebuild into a temp dir and compare with the stored blobs")
    ap.add_argument("--list", action="store_true", help="list targets")
    ap.add_argument("--only", default=None, help="build only targets whose name contains this")
    ap.add_argument("--include", action="append", default=[], metavar="3.X=DIR", help="headers for a version")
    ap.add_argument("--arch", action="append", default=None, choices=sorted(TOOLS), help="architectures, for every version (default: the shipped ones of each version)")
    ap.add_argument("--out", default=NATIVE_DIR, help="output directory (default monstack/_native)")
    args = ap.parse_args(argv)
    overrides = dict(item.split("=", 1) for item in args.include)
    status = 0
    for name, source, inc, arch, why in targets(overrides, tuple(args.arch) if args.arch else None):
        if args.only and args.only not in name:
            continue
        if args.list:
            print(f"{name}: {source} with {inc or '-'}" + (f" (skipped: {why})" if why else ""))
            continue
        if why:
            print(f"{name}: skipped ({why})")
            continue
        if args.check:
            with tempfile.TemporaryDirectory() as tmp:
                m = build(source, inc, arch, os.path.join(tmp, name))
                stored = os.path.join(args.out, name + ".bin")
                if not os.path.exists(stored):
                    print(f"{name}: MISSING stored blob {stored}")
                    status = 1
                    continue
                with open(stored, "rb") as a, open(os.path.join(tmp, name + ".bin"), "rb") as b:
                    same = a.read() == b.read()
                print(f"{name}: {'identical' if same else 'DIFFERENT'} ({m['compiler']}, headers {m['python']})")
                status |= 0 if same else 1
        else:
            m = build(source, inc, arch, os.path.join(args.out, name))
            print(f"{name}: {m['size']} bytes, sha256 {m['sha256'][:16]}, headers {m['python']}, {m['compiler']}")
    return status


if __name__ == "__main__":
    sys.exit(main())
