#!/usr/bin/env python3
"""Build monstack's CPython 3.11 eval_frame shim into relocation-free machine code.

    python compat/build.py                 # every architecture whose compiler is here
    python compat/build.py --arch x86_64   # one architecture
    python compat/build.py --check         # rebuild in a temporary directory and
                                           # compare with monstack/_native (exit 1 on
                                           # any difference)

The C source (shim311.c, shim311.h) is compiled against the CPython 3.11 headers
(``--include``, default: the include directory of a CPython 3.11 found on this
machine) into one object file, which must:

- have no undefined symbols (every external function and object is reached through
  ``struct ms_data``, filled at load time),
- carry only PC-relative relocations, and no initialised writable data;

then is linked twice, at two different base addresses, with a linker script that puts
code and read-only data first and the (zero-initialised) ``ms_data`` page-aligned
after it: the two code images must be byte-identical, which proves the code has no
absolute address in it. The code image is written to
``monstack/_native/evalframe311-<arch>.bin``; ``evalframe311.json`` records, per
architecture, the entry offset, the data offset and size, the offset of every table
entry and field of ``ms_data``, the offsets of the interpreter struct fields the code
was compiled against (the loader checks each against the running interpreter), the
compiler version and flags, and the SHA-256 of the image.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NATIVE = os.path.join(ROOT, "monstack", "_native")
META_NAME = "evalframe311.json"
SOURCES = ("shim311.c", "shim311.h", "offsets.c")

COMMON_FLAGS = [
    "-std=gnu11", "-O2", "-fPIC", "-fvisibility=hidden", "-ffreestanding", "-fno-builtin",
    "-fno-stack-protector", "-fno-asynchronous-unwind-tables", "-fno-unwind-tables",
    "-fno-exceptions", "-fno-jump-tables", "-fno-common", "-fno-plt", "-fno-ident",
    "-g0", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror",
]

ARCHES = {
    "x86_64": {
        "cc": ["gcc", "x86_64-linux-gnu-gcc"],
        "flags": ["-m64", "-march=x86-64", "-mtune=generic", "-fcf-protection=none"],
        "relocs": {"R_X86_64_PC32", "R_X86_64_PLT32"},
    },
    "aarch64": {
        "cc": ["aarch64-linux-gnu-gcc"],
        "flags": ["-march=armv8-a", "-mbranch-protection=none", "-mno-outline-atomics"],
        "relocs": {
            "R_AARCH64_ADR_PREL_PG_HI21", "R_AARCH64_ADR_PREL_LO21", "R_AARCH64_ADD_ABS_LO12_NC",
            "R_AARCH64_LDST8_ABS_LO12_NC", "R_AARCH64_LDST16_ABS_LO12_NC",
            "R_AARCH64_LDST32_ABS_LO12_NC", "R_AARCH64_LDST64_ABS_LO12_NC",
            "R_AARCH64_LDST128_ABS_LO12_NC", "R_AARCH64_CALL26", "R_AARCH64_JUMP26",
            "R_AARCH64_CONDBR19", "R_AARCH64_TSTBR14", "R_AARCH64_PREL32",
        },
    },
}

#: Sections the object may have (anything else fails the build).
ALLOWED_SECTIONS = re.compile(
    r"^(\.text(\..*)?|\.rodata(\..*)?|\.bss\.ms_data|\.bss|\.data|\.comment|\.note\.GNU-stack|\.rela.*|"
    r"\.symtab|\.strtab|\.shstrtab|)$"
)

DATA_ALIGN = 0x10000  # data starts on a 64 KiB boundary: fine for 4K, 16K and 64K pages

LINKER_SCRIPT = """\
ENTRY(ms_eval_frame)
SECTIONS {
  . = %(base)#x;
  .text : { KEEP(*(.text.ms_entry)) *(.text .text.*) *(.rodata .rodata.*) }
  . = ALIGN(%(align)#x);
  .bss (NOLOAD) : { *(.bss.ms_data) *(.bss .bss.*) }
  /DISCARD/ : { *(.comment) *(.note .note.*) *(.eh_frame) *(.eh_frame_hdr) }
}
"""


class BuildError(RuntimeError):
    pass


def run(cmd: list[str], **kw) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def find_cc(arch: str) -> str | None:
    host = os.uname().machine
    for cc in ARCHES[arch]["cc"]:
        if cc == "gcc" and host != arch:
            continue
        if shutil.which(cc):
            return cc
    return None


def tool(cc: str, name: str) -> str:
    """binutils for the compiler's target (aarch64-linux-gnu-nm, or plain nm)."""
    prefix = cc[: -len("gcc")] if cc.endswith("gcc") else ""
    return prefix + name if shutil.which(prefix + name) else name


def cc_version(cc: str) -> str:
    return run([cc, "--version"]).splitlines()[0].strip()


def find_include() -> str:
    """The include directory of a CPython 3.11 (this interpreter if it is one)."""
    if sys.version_info[:2] == (3, 11):
        import sysconfig

        return sysconfig.get_paths()["include"]
    candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.11.*/include/python3.11")))
    for exe in ("python3.11",):
        path = shutil.which(exe)
        if path:
            out = subprocess.run([path, "-c", "import sysconfig;print(sysconfig.get_paths()['include'])"],
                                 capture_output=True, text=True)
            if out.returncode == 0:
                candidates.append(out.stdout.strip())
    for c in candidates:
        if os.path.exists(os.path.join(c, "internal", "pycore_frame.h")):
            return c
    raise BuildError("no CPython 3.11 headers found: pass --include DIR (DIR/internal/pycore_frame.h must exist)")


def header_version(include: str) -> str:
    text = open(os.path.join(include, "patchlevel.h")).read()
    m = re.search(r'#define PY_VERSION\s+"([^"]+)"', text)
    return m.group(1) if m else "?"


def read_offsets(cc: str, flags: list[str], include: str) -> dict[str, int]:
    asm = run([cc, *flags, "-I", include, "-S", "-o", "-", os.path.join(HERE, "offsets.c")])
    out: dict[str, int] = {}
    pat = re.compile(r"^ms_off__(\w+):\s*\n\s*\.(quad|xword|8byte|zero)\s+(\d+)", re.M)
    for name, kind, value in pat.findall(asm):
        out[name] = 0 if kind == "zero" else int(value)
    if not out:
        raise BuildError("could not read any offset from the assembly of offsets.c")
    return out


def check_object(cc: str, obj: str, arch: str) -> None:
    undefined = run([tool(cc, "nm"), "-u", obj]).split()
    if undefined:
        raise BuildError(f"{arch}: the object references external symbols {undefined}: call them through ms_data")
    relocs = run([tool(cc, "readelf"), "-rW", obj])
    kinds = set(re.findall(r"^\s*[0-9a-f]+\s+[0-9a-f]+\s+(R_\w+)", relocs, re.M))
    bad = kinds - ARCHES[arch]["relocs"]
    if bad:
        raise BuildError(f"{arch}: relocations that are not PC-relative: {sorted(bad)}")
    sections = run([tool(cc, "readelf"), "-SW", obj])
    for m in re.finditer(r"^\s*\[\s*[1-9]\d*\]\s+(\S+)\s+(\S+)\s+[0-9a-f]+\s+[0-9a-f]+\s+([0-9a-f]+)", sections, re.M):
        name, _kind, size = m.group(1), m.group(2), int(m.group(3), 16)
        if not ALLOWED_SECTIONS.match(name):
            raise BuildError(f"{arch}: unexpected section {name} in the object")
        if name in (".data",) and size:
            raise BuildError(f"{arch}: initialised writable data ({name}, {size} bytes) is not allowed")


def link(cc: str, obj: str, workdir: str, base: int) -> tuple[bytes, dict[str, tuple[int, int]]]:
    script = os.path.join(workdir, f"link-{base:x}.ld")
    with open(script, "w") as fh:
        fh.write(LINKER_SCRIPT % {"base": base, "align": DATA_ALIGN})
    elf = os.path.join(workdir, f"shim-{base:x}.elf")
    run([cc, "-nostdlib", "-static", "-no-pie", "-Wl,--build-id=none", "-Wl,-T," + script, "-o", elf, obj])
    binfile = elf + ".bin"
    run([tool(cc, "objcopy"), "-O", "binary", "-j", ".text", elf, binfile])
    with open(binfile, "rb") as fh:
        image = fh.read()
    symbols: dict[str, tuple[int, int]] = {}
    for line in run([tool(cc, "nm"), "-S", elf]).splitlines():
        parts = line.split()
        if len(parts) == 4:
            symbols[parts[3]] = (int(parts[0], 16) - base, int(parts[1], 16))
        elif len(parts) == 3:
            symbols[parts[2]] = (int(parts[0], 16) - base, 0)
    # the linked file must not need a dynamic loader or carry relocations
    headers = run([tool(cc, "readelf"), "-SW", elf])
    for forbidden in (".dynamic", ".got", ".plt", ".rela.dyn", ".data.rel"):
        if re.search(r"\s" + re.escape(forbidden) + r"(\s|\.)", headers):
            raise BuildError(f"linked image has a {forbidden} section")
    return image, symbols


def build_arch(arch: str, include: str, outdir: str) -> dict:
    cc = find_cc(arch)
    if cc is None:
        raise BuildError(f"no compiler for {arch} (tried {ARCHES[arch]['cc']})")
    flags = COMMON_FLAGS + ARCHES[arch]["flags"]
    with tempfile.TemporaryDirectory(prefix="monstack-build-") as tmp:
        # Compile from a copy so that no path of this checkout can end up in the output.
        for name in SOURCES:
            shutil.copy(os.path.join(HERE, name), os.path.join(tmp, name))
        obj = os.path.join(tmp, "shim311.o")
        run([cc, *flags, "-I", include, "-c", "-o", obj, "shim311.c"], cwd=tmp)
        check_object(cc, obj, arch)
        image, symbols = link(cc, obj, tmp, 0)
        image2, symbols2 = link(cc, obj, tmp, 0x7F3A0000)
        if image != image2 or symbols != symbols2:
            raise BuildError(f"{arch}: the code differs when linked at another address: it is not position independent")
        offsets = read_offsets(cc, flags, include)
    entry = symbols["ms_eval_frame"][0]
    data_offset, data_size = symbols["DATA"]
    if data_offset % DATA_ALIGN or data_offset < len(image):
        raise BuildError(f"{arch}: data at {data_offset:#x} overlaps the code ({len(image)} bytes)")
    if data_size != offsets["data__size"]:
        raise BuildError(f"{arch}: DATA is {data_size} bytes in the image, sizeof says {offsets['data__size']}")
    blob_name = f"evalframe311-{arch}.bin"
    with open(os.path.join(outdir, blob_name), "wb") as fh:
        fh.write(image)

    def group(prefix: str) -> dict[str, int]:
        return {k[len(prefix):]: v for k, v in sorted(offsets.items()) if k.startswith(prefix)}

    interp = {k: v for k, v in sorted(offsets.items()) if "__" not in k}
    return {
        "blob": blob_name,
        "sha256": hashlib.sha256(image).hexdigest(),
        "code_size": len(image),
        "entry": entry,
        "data_offset": data_offset,
        "data_size": data_size,
        "data_align": DATA_ALIGN,
        "table": group("table__"),
        "fields": group("field__"),
        "counters": group("counter__"),
        "records": {"offset": offsets["data__recs"], "size": offsets["data__sizeof_rec"],
                    "count": offsets["data__nrec"]},
        "magic_offset": offsets["data__magic"],
        "interp_offsets": interp,
        "compiler": cc_version(cc),
        "flags": flags,
    }


def sources_digest() -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(HERE, name), "rb") as fh:
            h.update(name.encode() + b"\0" + fh.read() + b"\0")
    return h.hexdigest()


def build(arches: list[str], include: str, outdir: str) -> dict:
    os.makedirs(outdir, exist_ok=True)
    meta = {
        "format": 1,
        "python": "3.11",
        "headers": header_version(include),
        "sources_sha256": sources_digest(),
        "arches": {},
    }
    for arch in arches:
        meta["arches"][arch] = build_arch(arch, include, outdir)
    with open(os.path.join(outdir, META_NAME), "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=True)
        fh.write("\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", choices=sorted(ARCHES), help="default: every arch with a compiler")
    ap.add_argument("--include", help="CPython 3.11 include directory")
    ap.add_argument("--out", default=NATIVE, help="output directory (default: monstack/_native)")
    ap.add_argument("--check", action="store_true", help="rebuild in a temporary directory and compare with --out")
    args = ap.parse_args(argv)
    try:
        return _main(args)
    except BuildError as exc:
        print(f"build.py: {exc}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    include = args.include or find_include()
    arches = args.arch or [a for a in ARCHES if find_cc(a)]
    if not arches:
        print("no compiler found for any architecture", file=sys.stderr)
        return 2
    if not args.check:
        meta = build(arches, include, args.out)
        for arch, info in meta["arches"].items():
            print(f"{arch}: {info['code_size']} bytes, entry {info['entry']:#x}, data {info['data_offset']:#x}"
                  f"+{info['data_size']}, sha256 {info['sha256'][:16]}, {info['compiler']}")
        return 0
    with tempfile.TemporaryDirectory(prefix="monstack-check-") as tmp:
        meta = build(arches, include, tmp)
        with open(os.path.join(args.out, META_NAME)) as fh:
            stored = json.load(fh)
        status = 0
        for arch, info in meta["arches"].items():
            old = stored["arches"].get(arch)
            with open(os.path.join(tmp, info["blob"]), "rb") as fh:
                new_bytes = fh.read()
            try:
                with open(os.path.join(args.out, info["blob"]), "rb") as fh:
                    old_bytes = fh.read()
            except OSError:
                old_bytes = b""
            same = old == info and old_bytes == new_bytes
            print(f"{arch}: {'identical' if same else 'DIFFERENT'}")
            status |= not same
        return status


if __name__ == "__main__":
    sys.exit(main())
