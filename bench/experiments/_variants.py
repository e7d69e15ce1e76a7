"""What the ``*_parts.py`` experiments share: copies of this checkout with one native
source file edited, its blob rebuilt for the running CPython, checked to load natively."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Refused(Exception):
    """A one-line reason an experiment cannot run here."""


def blob_name() -> str:
    """The sysmon blob of the running CPython (the variants are of it)."""
    v = sys.version_info
    if not (3, 12) <= v[:2] <= (3, 15):
        raise Refused(f"the variants are of the sysmon blob, CPython 3.12-3.15 (this is {v[0]}.{v[1]})")
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        raise Refused("the variants are built for x86-64 Linux only")
    return f"sysmon{v[0]}{v[1]}"


def make_tree(dest: str, variant: str, blob: str, source: str, edit: Callable[[str], str]) -> str:
    """A copy of the checkout's monstack/ and native/ under dest/variant, native/``source``
    rewritten by ``edit`` and the blob rebuilt (every variant, the unedited one too, from
    the same compiler and headers)."""
    tree = os.path.join(dest, variant)
    ignore = shutil.ignore_patterns("__pycache__")
    for part in ("monstack", "native"):
        shutil.copytree(os.path.join(ROOT, part), os.path.join(tree, part), ignore=ignore)
    src = os.path.join(tree, "native", source)
    with open(src) as f:
        text = f.read()
    with open(src, "w") as f:
        f.write(edit(text))
    proc = subprocess.run(
        [sys.executable, os.path.join(tree, "native", "build.py"), "--only", blob, "--arch", "x86_64",
         "--out", os.path.join(tree, "monstack", "_native")],
        capture_output=True, text=True)
    if proc.returncode != 0:
        raise Refused(f"{variant}: native/build.py failed: {last_line(proc.stderr or proc.stdout)}")
    info = subprocess.run([sys.executable, "-m", "monstack", "info"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=tree), cwd=dest)
    if "accelerator: native" not in info.stdout:
        raise Refused(f"{variant}: the native callbacks do not load from the copy "
                      f"({line_starting(info.stdout, 'accelerator:')})")
    return tree


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no output"


def line_starting(text: str, prefix: str) -> str:
    return next((ln.strip() for ln in text.splitlines() if ln.strip().startswith(prefix)), "no such line")
