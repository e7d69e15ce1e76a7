#!/bin/sh
# Build an arm64 Debian root with CPython under $ARM64_BASE, runnable with qemu-aarch64 on an
# x86-64 host, plus pure-Python pytest/hypothesis in its dist-packages:
#   sh tools/aarch64_qemu.sh                      # trixie, python3.13 -> /tmp/arm64/py313
#   ARM64_SUITE=sid ARM64_PYTHONS="3.14 3.15" sh tools/aarch64_qemu.sh
#                                                 # unstable, 3.14 and 3.15 (with their arm64
#                                                 # headers) -> /tmp/arm64-sid/py314, py315
# Then, from the repo: PYTHONPATH=$PWD MONSTACK_TEST_CONFIG=native /tmp/arm64/py313 -m pytest -q -p no:cacheprovider tests
# The sid root also holds each version's arm64 headers (libpython3.X-dev), which the aarch64
# builds of sysmon314/sysmon315 need: native/build.py --arch aarch64 --multiarch /tmp/arm64-sid/root/usr/include.
# Idempotent; re-downloads nothing already present. Needs qemu-aarch64 (Debian: qemu-user),
# curl, xz, dpkg-deb, and network access to deb.debian.org. What it ran on is written to
# $ARM64_BASE/versions.txt.
set -eu
SUITE=${ARM64_SUITE:-trixie}
PYTHONS=${ARM64_PYTHONS:-3.13}
if [ "$SUITE" = trixie ]; then BASE=${ARM64_BASE:-/tmp/arm64}; else BASE=${ARM64_BASE:-/tmp/arm64-$SUITE}; fi
MIRROR=${MIRROR:-http://deb.debian.org/debian}
ROOT=$BASE/root DEBS=$BASE/debs
# Test deps go where Debian puts packages (a site dir: monstack's default policy must see
# pytest as library code, as in a venv; a plain PYTHONPATH dir would count as user code).
SITE=$ROOT/usr/lib/python3/dist-packages
mkdir -p "$BASE" "$ROOT" "$DEBS" "$SITE"
cd "$BASE"
[ -f Packages ] || { curl -sSfO "$MIRROR/dists/$SUITE/main/binary-arm64/Packages.xz"; xz -dk Packages.xz; }
PKGS="libc6 libgcc-s1 libffi8 zlib1g libexpat1 libssl3t64 libzstd1 libbz2-1.0 liblzma5 libsqlite3-0 libmpdec4
 libncursesw6 libtinfo6 libreadline8t64 libuuid1 libcrypt1 media-types tzdata"
for v in $PYTHONS; do
  PKGS="$PKGS python$v-minimal libpython$v-minimal libpython$v-stdlib libpython$v"
  [ "$SUITE" = trixie ] || PKGS="$PKGS libpython$v-dev"
done
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
for v in $PYTHONS; do
  PY=$ROOT/usr/bin/python$v
  if head -c4 "$PY" | grep -q ELF; then mv -f "$PY" "$PY.elf"; fi
  cat > "$PY" <<EOP
#!/bin/sh
export QEMU_LD_PREFIX=$ROOT
exec qemu-aarch64 -L $ROOT -0 $PY $PY.elf "\$@"
EOP
  chmod +x "$PY"
  # pure-Python test deps for the arm64 interpreter
  if [ ! -d "$SITE/pygments" ]; then
    python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version $v --platform any \
        -d "$BASE/wheels" pytest pluggy iniconfig packaging hypothesis attrs sortedcontainers pygments
    for w in "$BASE"/wheels/*.whl; do python3 -m zipfile -e "$w" "$SITE"; done
  fi
  # Byte-compile once (dpkg-deb -x skips Debian's py3compile, and PYTHONDONTWRITEBYTECODE
  # may be set): without .pyc files every start recompiles the stdlib under qemu (17 s -> 5 s).
  [ -d "$ROOT/usr/lib/python$v/__pycache__" ] || "$PY" -m compileall -q -j2 \
      -x '(/test/|/idlelib/|/tkinter/|lib2to3)' "$ROOT/usr/lib/python$v" "$SITE" >/dev/null || true
  # smoke test
  "$PY" -c \
    "import sys, ctypes, ssl, sqlite3, zlib, lzma, bz2, pytest, hypothesis; print(sys.version, sys.implementation, pytest.__version__, hypothesis.__version__)"
  cat > "$BASE/py$(echo $v | tr -d .)" <<EOP
#!/bin/sh
# run the arm64 python$v under qemu
exec $ROOT/usr/bin/python$v "\$@"
EOP
  chmod +x "$BASE/py$(echo $v | tr -d .)"
  echo "ok: $BASE/py$(echo $v | tr -d .)"
done
