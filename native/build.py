#!/usr/bin/env python3
"""Build monstack's native code into relocation-free machine-code blobs, and check them.

    python native/build.py                  # rebuild every blob whose compiler and headers are here
    python native/build.py --check          # rebuild in a temporary directory and compare with
                                            # monstack/_native (exit 1 on any difference)
    python native/build.py --list           # the blobs, their sources, compilers and headers
    python native/build.py --only sysmon313 --arch x86_64   # one blob, one architecture
    python native/build.py --manifests      # rewrite the manifests from the stored .bin files
                                            # (derived fields: checksum; no compiler needed)

Each blob is one C file compiled against the CPython headers of one version, for one
architecture (x86_64 with gcc, aarch64 with Debian's ``aarch64-linux-gnu-gcc``), then
linked at address 0 by a flat linker script. The output, in ``monstack/_native/``:

- ``<name>-<arch>.bin``: the bytes the loader (``monstack/_native.py``) maps;
- ``<name>.json``: the manifest of every architecture of that blob (format 3, see
  native/README.md): sizes, sha256, checksum, global symbols, the address-table slots
  the loader fills, the data area, the layout the code was compiled with, compiler and
  flags, and the sha256 of every source file. The canonical form: human-readable,
  reviewed in diffs, read by the tests;
- ``<name>.manifest``: the same dict as ``marshal.dumps(manifest, 4)`` (marshal format
  4: every CPython 3.11-3.15 reads it), which is what the loader reads at start-up
  (``marshal`` is built in; ``json`` or even ``_json`` costs an import).

The ``checksum`` of an image is ``int.from_bytes(image, "little") % 1073741789``: the
loader checks it and the size, which catches a corrupted, truncated or mismatched
image without importing anything; the ``sha256`` is kept for provenance and the tests.
``--manifests`` recomputes the derived fields (the checksum) from the stored ``.bin``
files, after checking each against its recorded size and sha256, and rewrites both
forms of each manifest: how a change to the manifest format reaches blobs that cannot
or need not be rebuilt. ``--check`` also requires each stored ``.manifest`` to hold
exactly the stored ``.json``'s dict and each stored ``.bin`` to match its size, sha256
and checksum, whether or not a compiler is here.

The build fails unless the object names no external symbol (every C-API function or
object is reached through the address table), carries only PC-relative relocations,
has no writable data besides its table or data area, and links to the same bytes at two
different addresses. The same compiler version and headers give the same bytes (no
debug info, no build paths, no timestamps): ``--check`` relies on that.

Headers come from an interpreter of the target version found through pyenv or PATH, or
from ``--include 3.12=/path/to/include/python3.12``. Where ``pyconfig.h`` is Debian's
multiarch wrapper, the target architecture's own ``pyconfig.h``
(``<triplet>/python3.X/pyconfig.h``) is looked for beside the headers, then under each
``--multiarch DIR`` (default: ``$MONSTACK_MULTIARCH_INCLUDE``, ``os.pathsep``-separated):
an x86-64 host's 3.14 headers serve an aarch64 build with the arm64 package's
``pyconfig.h`` (``tools/aarch64_qemu.sh`` unpacks it). Without it, that architecture is
skipped with the reason.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import marshal
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT_DIR = os.path.join(ROOT, "monstack", "_native")
#: 3: each architecture's entry has a ``checksum``; ``<name>.manifest`` (marshal) beside
#: ``<name>.json``. Must equal ``monstack/_native.py``'s FORMAT.
FORMAT = 3
#: The marshal format of ``<name>.manifest``: 4 is read by every CPython 3.11-3.15.
MARSHAL_VERSION = 4
#: ``checksum(image)``: the image as a little-endian integer modulo this prime (as
#: ``monstack/_native.py`` computes it).
CHECKSUM_MODULUS = 1073741789  # the largest prime below 2**30: one CPython int digit, so
#: the modulo is one pass over the integer (2**61 - 1 took ~1M instructions for a 22 KB image)


@dataclass(frozen=True)
class Target:
    name: str                  # blob name: <name>.json, <name>-<arch>.bin
    kind: str                  # "sysmon" or "evalframe": how it is linked and described
    python: str                # CPython minor version of the headers
    sources: Tuple[str, ...]   # files of native/ it is built from (the first is compiled)
    arches: Tuple[str, ...]    # architectures shipped
    headers: Tuple[str, ...]   # header files the include directory must have


#: aarch64: sysmon313 passed the suite under qemu-user on Debian's arm64 CPython 3.13, and
#: sysmon314/sysmon315 on Debian unstable's arm64 3.14/3.15, built with their arm64
#: ``pyconfig.h`` (``--multiarch``, see ``tools/aarch64_qemu.sh``); no arm64 CPython 3.12
#: was available (not shipped); evalframe311 is built and checked but has not run on
#: aarch64 (the loader verifies every offset first). ``--arch aarch64`` builds the others too.
TARGETS = (
    Target("sysmon312", "sysmon", "3.12", ("sysmon.c", "compat.h", "carrier.h"), ("x86_64",), ("Python.h",)),
    Target("sysmon313", "sysmon", "3.13", ("sysmon.c", "compat.h", "carrier.h"), ("x86_64", "aarch64"), ("Python.h",)),
    Target("sysmon314", "sysmon", "3.14", ("sysmon.c", "compat.h", "carrier.h"), ("x86_64", "aarch64"),
           ("Python.h", os.path.join("internal", "pycore_interpframe_structs.h"))),
    Target("sysmon315", "sysmon", "3.15", ("sysmon.c", "compat.h", "carrier.h"), ("x86_64", "aarch64"),
           ("Python.h", os.path.join("internal", "pycore_interpframe_structs.h"))),
    Target("evalframe311", "evalframe", "3.11", ("shim311.c", "shim311.h", "offsets.c", "carrier.h"), ("x86_64", "aarch64"),
           ("Python.h", os.path.join("internal", "pycore_frame.h"))),
)
ARCHES = ("x86_64", "aarch64")

#: Compiler flags, per kind of blob and per architecture (changing one changes the bytes).
FLAGS = {
    "sysmon": [
        "-std=gnu11", "-O2", "-DNDEBUG", "-fPIC", "-fno-plt", "-fvisibility=hidden",
        "-fno-stack-protector", "-fno-asynchronous-unwind-tables", "-fno-unwind-tables",
        "-fno-jump-tables", "-fno-common", "-fno-ident", "-fno-exceptions",
        "-fno-builtin", "-fno-tree-loop-distribute-patterns",
        "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers",
        "-Werror=implicit-function-declaration",
    ],
    "evalframe": [
        "-std=gnu11", "-O2", "-fPIC", "-fvisibility=hidden", "-ffreestanding", "-fno-builtin",
        "-fno-stack-protector", "-fno-asynchronous-unwind-tables", "-fno-unwind-tables",
        "-fno-exceptions", "-fno-jump-tables", "-fno-common", "-fno-plt", "-fno-ident",
        "-g0", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror",
    ],
}
ARCH_FLAGS = {
    ("sysmon", "x86_64"): ["-fcf-protection=none", "-mno-red-zone"],
    ("sysmon", "aarch64"): ["-mbranch-protection=none", "-mno-outline-atomics"],
    ("evalframe", "x86_64"): ["-m64", "-march=x86-64", "-mtune=generic", "-fcf-protection=none"],
    ("evalframe", "aarch64"): ["-march=armv8-a", "-mbranch-protection=none", "-mno-outline-atomics"],
}

TOOLS = {
    "x86_64": {"cc": "gcc", "ld": "ld", "objcopy": "objcopy", "nm": "nm", "readelf": "readelf"},
    "aarch64": {k: "aarch64-linux-gnu-" + v for k, v in
                {"cc": "gcc", "ld": "ld", "objcopy": "objcopy", "nm": "nm", "readelf": "readelf"}.items()},
}
#: Debian's multiarch triplets: where each architecture's ``pyconfig.h`` lives.
TRIPLETS = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}
#: Where else to look for a multiarch ``pyconfig.h`` (``--multiarch``).
MULTIARCH_ROOTS: List[str] = [d for d in os.environ.get("MONSTACK_MULTIARCH_INCLUDE", "").split(os.pathsep) if d]
#: On an aarch64 host, its native tools are the plain names.
if platform.machine() == "aarch64":  # pragma: no cover - depends on the host
    TOOLS["aarch64"] = dict(TOOLS["x86_64"])
    TOOLS["x86_64"] = {k: "x86_64-linux-gnu-" + v for k, v in TOOLS["x86_64"].items()}

#: Relocations the object may carry: PC-relative ones only (ADD/LDST *_LO12 complete
#: an ADRP page-relative address on aarch64).
ALLOWED_RELOCS = {
    "x86_64": {"R_X86_64_PC32", "R_X86_64_PLT32"},
    "aarch64": {
        "R_AARCH64_ADR_PREL_PG_HI21", "R_AARCH64_ADR_PREL_LO21", "R_AARCH64_ADD_ABS_LO12_NC",
        "R_AARCH64_LDST8_ABS_LO12_NC", "R_AARCH64_LDST16_ABS_LO12_NC",
        "R_AARCH64_LDST32_ABS_LO12_NC", "R_AARCH64_LDST64_ABS_LO12_NC",
        "R_AARCH64_LDST128_ABS_LO12_NC", "R_AARCH64_CALL26", "R_AARCH64_JUMP26",
        "R_AARCH64_CONDBR19", "R_AARCH64_TSTBR14", "R_AARCH64_PREL32", "R_AARCH64_LD_PREL_LO19",
    },
}
#: Sections the object may have (anything else fails the build).
ALLOWED_SECTIONS = re.compile(
    r"^(\.text(\..*)?|\.rodata(\..*)?|\.data(\..*)?|\.bss(\..*)?|\.comment|\.note\.GNU-stack|\.rela.*|"
    r"\.symtab|\.strtab|\.shstrtab|\.group)$"
)
#: The only writable sections that may hold bytes: the sysmon blob's address table
#: (made read+execute with the code once filled), the shim's data area (its own pages).
WRITABLE = {"sysmon": {".data.ms_table"}, "evalframe": {".bss.ms_data"}}

#: The shim's data area starts on a 64 KiB boundary: fine for 4K, 16K and 64K pages.
DATA_ALIGN = 0x10000
#: The second address every blob is linked at (its bytes must not change).
OTHER_BASE = 0x7F3A0000

LINKER_SCRIPTS = {
    # code, read-only data, then the address table (filled, then read+execute with the rest)
    "sysmon": """\
SECTIONS
{
  . = %(base)#x;
  .text : { *(.text .text.*) }
  . = ALIGN(64);
  .rodata : { *(.rodata .rodata.*) }
  . = ALIGN(64);
  .data : { *(.data.ms_table) *(.data .data.*) }
  .bss : { *(.bss .bss.*) *(COMMON) }
  /DISCARD/ : { *(.comment) *(.note*) *(.eh_frame*) *(.gnu*) }
}
""",
    # code and read-only data; the (zero-initialised) data area page-aligned after it,
    # not in the file: the loader maps it read-write next to the code
    "evalframe": """\
ENTRY(ms_eval_frame)
SECTIONS {
  . = %(base)#x;
  .text : { KEEP(*(.text.ms_entry)) *(.text .text.*) *(.rodata .rodata.*) }
  . = ALIGN(%(align)#x);
  .bss (NOLOAD) : { *(.bss.ms_data) *(.bss .bss.*) }
  /DISCARD/ : { *(.comment) *(.note .note.*) *(.eh_frame) *(.eh_frame_hdr) }
}
""",
}


class BuildError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------
# toolchain and headers (shared by every blob)
# --------------------------------------------------------------------------------------


def run(cmd: List[str], cwd: Optional[str] = None) -> str:
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
    return run([TOOLS[arch]["cc"], "--version"]).splitlines()[0].strip()


def find_include(version: str, required: Tuple[str, ...] = ("Python.h",)) -> Optional[str]:
    """The include directory of a CPython ``version`` (e.g. "3.12") found on this machine
    (this interpreter, pyenv, PATH) that has every file of ``required``."""
    candidates: List[str] = []
    if sys.version_info[:2] == tuple(map(int, version.split("."))):
        candidates.append(sys.executable)
    pyenv_root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    candidates += sorted(glob.glob(os.path.join(pyenv_root, "versions", version + ".*", "bin", "python" + version)))
    exe = shutil.which("python" + version)
    if exe:
        candidates.append(exe)
    for exe in candidates:
        try:
            out = subprocess.run([exe, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        inc = out.stdout.strip()
        if out.returncode == 0 and all(os.path.isfile(os.path.join(inc, f)) for f in required):
            return inc
    return None


def multiarch_dirs(include_dir: str, arch: str) -> List[str]:
    """Extra include directories the headers need for ``arch``: Debian's ``pyconfig.h``
    is a wrapper that includes ``<x86_64-linux-gnu/python3.X/pyconfig.h>`` (one per
    architecture), which lives under the parent of the include directory (``sysconfig``'s
    ``INCLUDEPY``) or, for another architecture's, under a ``--multiarch`` directory:
    the first that has it, searched after the system directories. None for a
    ``pyconfig.h`` that is the real one (pyenv, python.org builds). BuildError when the
    wrapper names no ``pyconfig.h`` for ``arch`` that is found."""
    try:
        with open(os.path.join(include_dir, "pyconfig.h")) as f:
            wrapped = re.findall(r"^\s*#\s*include\s*<([\w.-]+/python3\.\d+t?/pyconfig\.h)>", f.read(), re.M)
    except OSError:
        return []
    if not wrapped:
        return []
    mine = [w for w in wrapped if w.startswith(TRIPLETS[arch] + "/")]
    for d in [os.path.dirname(os.path.normpath(include_dir)), *MULTIARCH_ROOTS]:
        if any(os.path.isfile(os.path.join(d, w)) for w in mine):
            return [d]
    want = mine[0] if mine else f"{TRIPLETS[arch]}/python3.X/pyconfig.h"
    raise BuildError(f"no {want} for Debian's multiarch pyconfig.h (--multiarch DIR)")


def header_version(include_dir: str) -> str:
    with open(os.path.join(include_dir, "patchlevel.h")) as f:
        m = re.search(r'#define PY_VERSION\s+"([^"]+)"', f.read())
    if not m:
        raise BuildError(f"no PY_VERSION in {include_dir}/patchlevel.h")
    return m.group(1)


def source_digests(target: Target) -> Dict[str, str]:
    """sha256 of each source file's content (names relative to native/)."""
    out = {}
    for name in target.sources:
        with open(os.path.join(HERE, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def checksum(image: bytes) -> int:
    """What the loader checks an image against (with its size): cheap, no import."""
    return int.from_bytes(image, "little") % CHECKSUM_MODULUS


def flags(target: Target, arch: str) -> List[str]:
    return FLAGS[target.kind] + ARCH_FLAGS[(target.kind, arch)]


# --------------------------------------------------------------------------------------
# checks on the object and the linked image (shared)
# --------------------------------------------------------------------------------------


def check_object(target: Target, arch: str, obj: str) -> None:
    tools = TOOLS[arch]
    undefined = run([tools["nm"], "-u", obj]).split()[1::2]
    if undefined:
        raise BuildError(f"{arch}: the object names external symbols (reach them through the table): "
                         + ", ".join(undefined))
    kinds = set(re.findall(r"^\s*[0-9a-f]+\s+[0-9a-f]+\s+(R_\w+)", run([tools["readelf"], "-rW", obj]), re.M))
    bad = kinds - ALLOWED_RELOCS[arch]
    if bad:
        raise BuildError(f"{arch}: relocations that are not PC-relative: {', '.join(sorted(bad))}")
    sections = run([tools["readelf"], "-SW", obj])
    for m in re.finditer(r"^\s*\[\s*[1-9]\d*\]\s+(\S+)\s+(\S+)\s+[0-9a-f]+\s+[0-9a-f]+\s+([0-9a-f]+)", sections, re.M):
        name, size = m.group(1), int(m.group(3), 16)
        if not ALLOWED_SECTIONS.match(name):
            raise BuildError(f"{arch}: unexpected section {name} in the object")
        if name.startswith((".data", ".bss")) and size and name not in WRITABLE[target.kind]:
            raise BuildError(f"{arch}: writable data ({name}, {size} bytes) besides "
                             f"{', '.join(sorted(WRITABLE[target.kind]))}: state belongs in allocated memory")


def link(target: Target, arch: str, obj: str, workdir: str, base: int) -> Tuple[bytes, Dict[str, Tuple[int, int, str]]]:
    """Link ``obj`` at ``base``: (image bytes, {symbol: (offset, size, nm type)})."""
    tools = TOOLS[arch]
    script = os.path.join(workdir, f"link-{base:x}.ld")
    with open(script, "w") as f:
        f.write(LINKER_SCRIPTS[target.kind] % {"base": base, "align": DATA_ALIGN})
    elf = os.path.join(workdir, f"blob-{base:x}.elf")
    binf = elf + ".bin"
    if target.kind == "sysmon":
        run([tools["ld"], "-static", "-nostdlib", "--no-dynamic-linker", "-e", "0", "--build-id=none",
             "-T", script, "-o", elf, obj])
        run([tools["objcopy"], "-O", "binary", "--only-section=.text", "--only-section=.rodata",
             "--only-section=.data", elf, binf])
    else:
        run([tools["cc"], "-nostdlib", "-static", "-no-pie", "-Wl,--build-id=none", "-Wl,-T," + script, "-o", elf, obj])
        run([tools["objcopy"], "-O", "binary", "-j", ".text", elf, binf])
    if "Relocation section" in run([tools["readelf"], "-rW", elf]):
        raise BuildError(f"{arch}: the linked image still has relocations")
    headers = run([tools["readelf"], "-SW", elf])
    for forbidden in (".dynamic", ".got", ".plt", ".rela.dyn", ".data.rel"):
        if re.search(r"\s" + re.escape(forbidden) + r"(\s|\.)", headers):
            raise BuildError(f"{arch}: the linked image has a {forbidden} section")
    with open(binf, "rb") as f:
        image = f.read()
    symbols: Dict[str, Tuple[int, int, str]] = {}
    for line in run([tools["nm"], "-S", "--defined-only", elf]).splitlines():
        parts = line.split()
        if len(parts) == 4:
            symbols[parts[3]] = (int(parts[0], 16) - base, int(parts[1], 16), parts[2])
        elif len(parts) == 3:
            symbols[parts[2]] = (int(parts[0], 16) - base, 0, parts[1])
    return image, symbols


def cstrings(image: bytes, at: int) -> List[str]:
    """A NUL-separated list of names ending with an empty string (C ``"a\\0b\\0"``)."""
    out: List[str] = []
    while True:
        end = image.index(b"\0", at)
        if end == at:
            return out
        out.append(image[at:end].decode("ascii"))
        at = end + 1


# --------------------------------------------------------------------------------------
# one blob, one architecture
# --------------------------------------------------------------------------------------


def build_arch(target: Target, arch: str, include: str, outdir: str) -> dict:
    """Compile, check and link ``target`` for ``arch``; write ``<name>-<arch>.bin`` into
    ``outdir``; return its manifest entry."""
    why = have_tools(arch)
    if why:
        raise BuildError(f"cannot build for {arch}: {why}")
    cflags = flags(target, arch)
    with tempfile.TemporaryDirectory(prefix="monstack-build-") as tmp:
        # Compile copies, with relative names and prefix maps: no path of this checkout
        # or of the headers can end up in the output.
        for name in target.sources:
            shutil.copy(os.path.join(HERE, name), os.path.join(tmp, name))
        obj = os.path.join(tmp, "blob.o")
        extra = [a for d in multiarch_dirs(include, arch)
                 for a in (f"-ffile-prefix-map={d}=include-multiarch", "-idirafter", d)]
        run([TOOLS[arch]["cc"], *cflags, f"-ffile-prefix-map={tmp}=.", f"-ffile-prefix-map={include}=include",
             "-I", include, *extra, "-c", target.sources[0], "-o", obj], cwd=tmp)
        check_object(target, arch, obj)
        image, symbols = link(target, arch, obj, tmp, 0)
        image2, symbols2 = link(target, arch, obj, tmp, OTHER_BASE)
        if image != image2 or symbols != symbols2:
            raise BuildError(f"{arch}: the code differs when linked at another address: it is not position independent")
        if target.kind == "evalframe":
            offsets = read_offsets(arch, cflags, include, tmp)
    exported = {k: v[0] for k, v in sorted(symbols.items()) if v[2].isupper()}
    if target.kind == "sysmon":
        data, table, layout = describe_sysmon(arch, image, exported)
    else:
        data, table, layout = describe_evalframe(arch, image, symbols, offsets)
    blob = f"{target.name}-{arch}.bin"
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, blob), "wb") as f:
        f.write(image)
    return {
        "blob": blob,
        "size": len(image),
        "sha256": hashlib.sha256(image).hexdigest(),
        "checksum": checksum(image),
        "symbols": exported,
        "data": data,
        "table": table,
        "layout": layout,
        "compiler": compiler_version(arch),
        "flags": cflags,
    }


def describe_sysmon(arch: str, image: bytes, symbols: Dict[str, int]) -> tuple:
    """The address table is in the blob: ``ms_table`` = magic, slot count, one pointer
    per slot; ``ms_table_names`` = the slots' names. ``ms_layout``/``ms_layout_names``:
    the struct offsets and constants the code was compiled with."""
    for need in ("ms_table", "ms_table_names", "ms_layout", "ms_layout_names"):
        if need not in symbols:
            raise BuildError(f"{arch}: the blob must define {need}")
    at = symbols["ms_table"]
    _magic, nslots = struct.unpack_from("<QQ", image, at)
    names = cstrings(image, symbols["ms_table_names"])
    if len(names) != nslots:
        raise BuildError(f"{arch}: {len(names)} table names for {nslots} slots")
    if at + 16 + 8 * nslots > len(image):
        raise BuildError(f"{arch}: the table runs past the end of the image")
    table = {name: at + 16 + 8 * i for i, name in enumerate(names)}
    lay_names = cstrings(image, symbols["ms_layout_names"])
    values = struct.unpack_from(f"<{len(lay_names)}Q", image, symbols["ms_layout"])
    return None, table, dict(zip(lay_names, values))


def read_offsets(arch: str, cflags: List[str], include: str, srcdir: str) -> Dict[str, int]:
    """The shim's struct offsets, read from the assembly of offsets.c (cross builds
    need not run target code)."""
    extra = [a for d in multiarch_dirs(include, arch) for a in ("-idirafter", d)]
    asm = run([TOOLS[arch]["cc"], *cflags, "-I", include, *extra, "-S", "-o", "-", "offsets.c"], cwd=srcdir)
    out: Dict[str, int] = {}
    pat = re.compile(r"^ms_off__(\w+):\s*\n\s*\.(quad|xword|8byte|zero)\s+(\d+)", re.M)
    for name, kind, value in pat.findall(asm):
        out[name] = 0 if kind == "zero" else int(value)
    if not out:
        raise BuildError("could not read any offset from the assembly of offsets.c")
    return out


def describe_evalframe(arch: str, image: bytes, symbols: Dict[str, Tuple[int, int, str]],
                       offsets: Dict[str, int]) -> tuple:
    """The data area (symbol ``DATA``, struct ms_data) follows the code, page-aligned;
    the address table is in it. Layout: offsets of its fields, counters and records
    (from the start of the data area), and of the interpreter struct fields the code
    reads (the loader checks each against the running interpreter)."""
    data_offset, data_size, _ = symbols["DATA"]
    if data_offset % DATA_ALIGN or data_offset < len(image):
        raise BuildError(f"{arch}: data at {data_offset:#x} overlaps the code ({len(image)} bytes)")
    if data_size != offsets["data__size"]:
        raise BuildError(f"{arch}: DATA is {data_size} bytes in the image, sizeof says {offsets['data__size']}")

    def group(prefix: str) -> Dict[str, int]:
        return {k[len(prefix):]: v for k, v in sorted(offsets.items()) if k.startswith(prefix)}

    table = {"f:" + k: data_offset + v for k, v in group("table__").items()}
    layout = {
        "fields": group("field__"),
        "counters": group("counter__"),
        "records": {"offset": offsets["data__recs"], "size": offsets["data__sizeof_rec"],
                    "count": offsets["data__nrec"]},
        "magic_offset": offsets["data__magic"],
        "interp_offsets": {k: v for k, v in sorted(offsets.items()) if "__" not in k},
    }
    return {"offset": data_offset, "size": data_size, "align": DATA_ALIGN}, table, layout


# --------------------------------------------------------------------------------------
# manifests, targets, command line
# --------------------------------------------------------------------------------------


def manifest_head(target: Target, include: str) -> dict:
    return {
        "format": FORMAT,
        "name": target.name,
        "python": target.python,
        "headers": header_version(include),
        "sources": source_digests(target),
    }


def read_manifest(name: str, directory: str = OUT_DIR) -> Optional[dict]:
    try:
        with open(os.path.join(directory, name + ".json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def read_marshal_manifest(name: str, directory: str = OUT_DIR) -> Optional[object]:
    """The stored ``<name>.manifest`` decoded (None if there is none)."""
    try:
        with open(os.path.join(directory, name + ".manifest"), "rb") as f:
            return marshal.loads(f.read())
    except FileNotFoundError:
        return None


def same_value(a: object, b: object) -> bool:
    """Exactly the same data: equal, and the same types and key order throughout (``==``
    alone takes ``True`` for ``1`` and ``1.0`` for ``1``)."""
    return a == b and repr(a) == repr(b)


def write_manifest(manifest: dict, directory: str) -> None:
    """``<name>.json`` and, made from that very text, ``<name>.manifest``. The marshal
    bytes of equal dicts can differ (marshal writes a back-reference for an object whose
    reference count is above 1 or that is interned, which depends on the interpreter and
    on how the dict was made), so a ``.manifest`` that already holds exactly this dict is
    left as it is, and ``--check`` compares decoded values."""
    name = manifest["name"]
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    with open(os.path.join(directory, name + ".json"), "w") as f:
        f.write(text)
    value = json.loads(text)
    try:
        if same_value(read_marshal_manifest(name, directory), value):
            return
    except (OSError, EOFError, ValueError, TypeError):
        pass  # unreadable: rewrite it
    with open(os.path.join(directory, name + ".manifest"), "wb") as f:
        f.write(marshal.dumps(value, MARSHAL_VERSION))


def target(name: str) -> Target:
    for t in TARGETS:
        if t.name == name:
            return t
    raise KeyError(name)


def why_not(t: Target, arch: str, include: Optional[str], stored: Optional[dict] = None) -> Optional[str]:
    """Why ``t`` cannot be built for ``arch`` here, or (``stored``: its manifest) cannot
    be reproduced: a missing toolchain or headers, another compiler or header version."""
    if include is None:
        return f"no CPython {t.python} headers found (with {', '.join(t.headers)})"
    why = have_tools(arch)
    if why:
        return why
    try:
        multiarch_dirs(include, arch)
    except BuildError as exc:
        return str(exc)
    entry = (stored or {}).get("arches", {}).get(arch)
    if entry is not None:
        if compiler_version(arch) != entry["compiler"]:
            return f"the blob was built with {entry['compiler']}, this is {compiler_version(arch)}"
        if header_version(include) != stored["headers"]:  # type: ignore[index]
            return f"the blob was built against CPython {stored['headers']} headers, these are {header_version(include)}"  # type: ignore[index]
    return None


def _build(t: Target, arches: Tuple[str, ...], include: Optional[str], out: str) -> int:
    built = {}
    for arch in arches:
        why = why_not(t, arch, include)
        if why:
            print(f"{t.name}-{arch}: skipped ({why})")
            continue
        assert include is not None
        entry = built[arch] = build_arch(t, arch, include, out)
        print(f"{t.name}-{arch}: {entry['size']} bytes, sha256 {entry['sha256'][:16]}, "
              f"headers {header_version(include)}, {entry['compiler']}")
    if not built:
        return 0
    assert include is not None
    manifest = manifest_head(t, include)
    manifest["arches"] = {}
    old = read_manifest(t.name, out)
    for arch, entry in sorted((old or {}).get("arches", {}).items()):
        if arch in built:
            continue
        if all(old.get(k) == manifest[k] for k in ("format", "python", "headers", "sources")):  # type: ignore[union-attr]
            manifest["arches"][arch] = entry
        else:
            print(f"{t.name}-{arch}: dropped from the manifest (built from other sources or headers; "
                  f"rebuild it with {TOOLS[arch]['cc']})")
    manifest["arches"].update(built)
    write_manifest(manifest, out)
    return 0


def _check(t: Target, arches: Tuple[str, ...], include: Optional[str], out: str) -> int:
    stored = read_manifest(t.name, out)
    if stored is None:
        print(f"{t.name}: MISSING manifest {os.path.join(out, t.name + '.json')}")
        return 1
    status = _check_stored(t, stored, arches, out)
    sources = source_digests(t)
    if stored.get("sources") != sources:
        changed = sorted(k for k in set(sources) | set(stored.get("sources", {}))
                         if sources.get(k) != stored.get("sources", {}).get(k))
        print(f"{t.name}: sources CHANGED since the blobs were built ({', '.join(changed)}): run python native/build.py")
        status = 1
    for arch in arches:
        entry = stored.get("arches", {}).get(arch)
        if entry is None:
            print(f"{t.name}-{arch}: MISSING from the manifest")
            status = 1
            continue
        why = why_not(t, arch, include, stored)
        if why:
            print(f"{t.name}-{arch}: not rebuilt ({why})")
            continue
        assert include is not None
        with tempfile.TemporaryDirectory(prefix="monstack-check-") as tmp:
            new = build_arch(t, arch, include, tmp)
            with open(os.path.join(tmp, new["blob"]), "rb") as f:
                new_bytes = f.read()
        try:
            with open(os.path.join(out, entry["blob"]), "rb") as f:
                old_bytes = f.read()
        except OSError:
            old_bytes = b""
        diff = [k for k in sorted(set(new) | set(entry)) if new.get(k) != entry.get(k)]
        if old_bytes != new_bytes:
            diff.insert(0, "the .bin bytes")
        print(f"{t.name}-{arch}: " + (f"DIFFERENT ({', '.join(diff)})" if diff else
                                       f"identical ({entry['compiler']}, headers {stored['headers']})"))
        status |= 1 if diff else 0
    return status


def _check_stored(t: Target, stored: dict, arches: Tuple[str, ...], out: str) -> int:
    """What needs no compiler: the format, the ``.manifest`` holding exactly the
    ``.json``'s dict, each stored ``.bin`` matching its size, sha256 and checksum."""
    status = 0
    if stored.get("format") != FORMAT:
        print(f"{t.name}: manifest format {stored.get('format')!r}, this build writes {FORMAT}: "
              f"run python native/build.py --manifests")
        status = 1
    try:
        packed = read_marshal_manifest(t.name, out)
    except (OSError, EOFError, ValueError, TypeError) as exc:
        print(f"{t.name}: {t.name}.manifest UNREADABLE ({exc}): run python native/build.py --manifests")
        status = 1
    else:
        if packed is None:
            print(f"{t.name}: MISSING {t.name}.manifest: run python native/build.py --manifests")
            status = 1
        elif not same_value(packed, stored):
            print(f"{t.name}: {t.name}.manifest DIFFERENT from {t.name}.json: run python native/build.py --manifests")
            status = 1
        else:
            print(f"{t.name}: {t.name}.manifest holds exactly {t.name}.json")
    for arch in arches:
        entry = stored.get("arches", {}).get(arch)
        if entry is None:
            continue  # reported by the caller
        why = _stored_image_differs(entry, out)
        if why:
            print(f"{t.name}-{arch}: the stored {entry['blob']} does not match its manifest ({why})")
            status = 1
    return status


def _stored_image_differs(entry: dict, out: str) -> Optional[str]:
    """None if ``entry``'s stored .bin has its size, sha256 and checksum, else what differs."""
    try:
        with open(os.path.join(out, entry["blob"]), "rb") as f:
            image = f.read()
    except OSError as exc:
        return f"unreadable: {exc}"
    wrong = [k for k, v in (("size", len(image)), ("sha256", hashlib.sha256(image).hexdigest()),
                            ("checksum", checksum(image))) if entry.get(k) != v]
    return ", ".join(wrong) or None


def _manifests(t: Target, out: str) -> int:
    """Recompute the derived fields of ``t``'s manifest (the checksum) from its stored
    .bin files and rewrite ``<name>.json`` and ``<name>.manifest``; refuses a .bin that
    does not match its recorded size and sha256 (that needs a rebuild, not this)."""
    stored = read_manifest(t.name, out)
    if stored is None:
        print(f"{t.name}: MISSING manifest {os.path.join(out, t.name + '.json')}")
        return 1
    if stored.get("format") not in (2, FORMAT):  # 2 -> 3 only added the checksum
        print(f"{t.name}: manifest format {stored.get('format')!r} cannot be converted: rebuild it")
        return 1
    for arch, entry in sorted(stored.get("arches", {}).items()):
        try:
            with open(os.path.join(out, entry["blob"]), "rb") as f:
                image = f.read()
        except OSError as exc:
            print(f"{t.name}-{arch}: {entry['blob']} unreadable ({exc})")
            return 1
        if len(image) != entry.get("size") or hashlib.sha256(image).hexdigest() != entry.get("sha256"):
            print(f"{t.name}-{arch}: {entry['blob']} does not match its recorded size and sha256: "
                  f"not updated (rebuild it)")
            return 1
        entry["checksum"] = checksum(image)
    stored["format"] = FORMAT
    write_manifest(stored, out)
    print(f"{t.name}: manifest written ({', '.join(sorted(stored.get('arches', {})))})")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="rebuild in a temporary directory and compare with --out")
    mode.add_argument("--list", action="store_true", help="list the blobs, what they are built from and with")
    mode.add_argument("--manifests", action="store_true",
                    help="recompute derived manifest fields (checksum) from the stored .bin files and rewrite "
                         "<name>.json and <name>.manifest (no compiler needed)")
    ap.add_argument("--only", action="append", default=None, metavar="NAME", help="only this blob (repeatable)")
    ap.add_argument("--arch", action="append", default=None, choices=ARCHES,
                    help="architectures (repeatable; default: the shipped ones of each blob)")
    ap.add_argument("--include", action="append", default=[], metavar="3.X=DIR", help="CPython headers for a version")
    ap.add_argument("--multiarch", action="append", default=[], metavar="DIR",
                    help="where else to find <triplet>/python3.X/pyconfig.h for Debian's multiarch "
                         "pyconfig.h (repeatable; default: $MONSTACK_MULTIARCH_INCLUDE)")
    ap.add_argument("--out", default=OUT_DIR, help="blob directory (default: monstack/_native)")
    args = ap.parse_args(argv)
    if args.multiarch:
        MULTIARCH_ROOTS[:] = args.multiarch
    overrides = dict(item.split("=", 1) for item in args.include)
    unknown = set(args.only or ()) - {t.name for t in TARGETS}
    if unknown:
        ap.error(f"unknown blob {', '.join(sorted(unknown))} (blobs: {', '.join(t.name for t in TARGETS)})")
    status = 0
    try:
        for t in TARGETS:
            if args.only and t.name not in args.only:
                continue
            include = None if args.manifests else overrides.get(t.python) or find_include(t.python, t.headers)
            arches = tuple(args.arch) if args.arch else t.arches
            if args.list:
                for arch in arches:
                    why = why_not(t, arch, include)
                    print(f"{t.name}-{arch}: {', '.join(t.sources)} with {TOOLS[arch]['cc']}, "
                          f"headers {include or '-'}" + (f" (cannot build: {why})" if why else ""))
            elif args.check:
                status |= _check(t, arches, include, args.out)
            elif args.manifests:
                status |= _manifests(t, args.out)
            else:
                status |= _build(t, arches, include, args.out)
    except BuildError as exc:
        print(f"build.py: {exc}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
