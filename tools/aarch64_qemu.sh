#!/bin/sh
# Build an arm64 Debian trixie root with python3.13 under $ARM64_BASE (default /tmp/arm64), runnable with
# qemu-aarch64 on an x86-64 host, plus pure-Python pytest/hypothesis in its dist-packages.
# Then, from the repo: PYTHONPATH=$PWD MONSTACK_TEST_CONFIG=native /tmp/arm64/py313 -m pytest -q -p no:cacheprovider tests
# Usage: sh tools/aarch64_qemu.sh   (idempotent; re-downloads nothing already present).
# Needs qemu-aarch64 (Debian: qemu-user), curl, xz, dpkg-deb, and network access to
# deb.debian.org. What it ran on is written to $ARM64_BASE/versions.txt.
set -eu
BASE=${ARM64_BASE:-/tmp/arm64}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
ROOT=$BASE/root DEBS=$BASE/debs
# Test deps go where Debian puts packages (a site dir: monstack's default policy must see
# pytest as library code, as in a venv; a plain PYTHONPATH dir would count as user code).
SITE=$ROOT/usr/lib/python3/dist-packages
mkdir -p "$BASE" "$ROOT" "$DEBS" "$SITE"
cd "$BASE"
[ -f Packages ] || { curl -sSfO "$MIRROR/dists/trixie/main/binary-arm64/Packages.xz"; xz -dk Packages.xz; }
PKGS="libc6 libgcc-s1 python3.13-minimal libpython3.13-minimal libpython3.13-stdlib libpython3.13
 libffi8 zlib1g libexpat1 libssl3t64 libzstd1 libbz2-1.0 liblzma5 libsqlite3-0 libmpdec4
 libncursesw6 libtinfo6 libreadline8t64 libuuid1 libcrypt1 media-types tzdata"
for p in $PKGS; do
  f=$(awk -v p="$p" '$1=="Package:"{cur=$2} $1=="Filename:" && cur==p {print $2; exit}' Packages)
  [ -n "$f" ] || { echo "not in index: $p" >&2; exit 1; }
  d="$DEBS/$(basename "$f")"
  [ -f "$d" ] || curl -sSf -o "$d" "$MIRROR/$f"
  dpkg-deb -x "$d" "$ROOT"
  echo "$p $(dpkg-deb -f "$d" Version)"
done > "$BASE/versions.txt"
cat "$BASE/versions.txt"
# merged-/usr layout (normally made by base-files/usrmerge): the ELF interpreter is /lib/ld-linux-aarch64.so.1
for l in lib bin sbin; do [ -e "$ROOT/$l" ] || [ -L "$ROOT/$l" ] || ln -s "usr/$l" "$ROOT/$l"; done
# Subprocesses: the tests start sys.executable, and this host has no binfmt_misc entry for
# aarch64, so python3.13 in the root becomes an x86 shell wrapper that runs the real ELF
# (python3.13.elf) under qemu with argv[0] (hence sys.executable) = the wrapper.
PY=$ROOT/usr/bin/python3.13
if head -c4 "$PY" | grep -q ELF; then mv -f "$PY" "$PY.elf"; fi
cat > "$PY" <<EOP
#!/bin/sh
export QEMU_LD_PREFIX=$ROOT
exec qemu-aarch64 -L $ROOT -0 $PY $PY.elf "\$@"
EOP
chmod +x "$PY"
# pure-Python test deps for the arm64 interpreter
if [ ! -d "$SITE/pygments" ]; then
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.13 --platform any \
      -d "$BASE/wheels" pytest pluggy iniconfig packaging hypothesis attrs sortedcontainers pygments
  for w in "$BASE"/wheels/*.whl; do python3 -m zipfile -e "$w" "$SITE"; done
fi
# Byte-compile once (dpkg-deb -x skips Debian's py3compile, and PYTHONDONTWRITEBYTECODE
# may be set): without .pyc files every start recompiles the stdlib under qemu (17 s -> 5 s).
[ -d "$ROOT/usr/lib/python3.13/__pycache__" ] || "$PY" -m compileall -q -j2 \
    -x '(/test/|/idlelib/|/tkinter/|lib2to3)' "$ROOT/usr/lib/python3.13" "$SITE" >/dev/null || true
# smoke test
"$PY" -c \
  "import sys, ctypes, ssl, sqlite3, zlib, lzma, bz2, pytest, hypothesis; print(sys.version, sys.implementation, pytest.__version__, hypothesis.__version__)"
cat > "$BASE/py313" <<EOP
#!/bin/sh
# run the arm64 python3.13 under qemu
exec $ROOT/usr/bin/python3.13 "\$@"
EOP
chmod +x "$BASE/py313"
echo "ok: $BASE/py313"
