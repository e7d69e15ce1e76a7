"""The one formatting core: snapshots (and exceptions with their origins) rendered in
CPython's traceback layout, in small steps that can be overridden or reused.

Colour is decided by the caller at the output edge (``color`` is a bool here, or None
to let :mod:`monstack._colorize` decide for the stream).
"""

from __future__ import annotations

import linecache
from typing import IO, Iterable, Optional, Sequence, Union

from ._colorize import ANSI, resolve

#: Identical consecutive frames shown before "[Previous line repeated N more times]".
RECURSIVE_CUTOFF = 3
#: Default cap on frames shown; the middle of longer stacks is elided and counted.
MAX_FRAMES = 100


def source_line(filename: str, lineno: Optional[int]) -> str:
    """The stripped source line, or "" when the file is gone or unreadable."""
    if not lineno:
        return ""
    try:
        return linecache.getline(filename, lineno).strip()
    except Exception:  # a loader that raises, a file that vanished mid-read, ...
        return ""


def format_frame(record: Sequence, color: bool = False) -> str:
    """``  File "f", line N, in name`` plus the source line, as CPython prints it."""
    filename, lineno, name = record[0], record[1], record[2]
    if color:
        m, r = ANSI.MAGENTA, ANSI.RESET
        text = f'  File {m}"{filename}"{r}, line {m}{lineno}{r}, in {m}{name}{r}\n'
    else:
        text = f'  File "{filename}", line {lineno}, in {name}\n'
    line = source_line(filename, lineno)
    if line:
        text += f"    {line}\n"
    return text


def _collapse(records: Sequence[Sequence]) -> list[Union[Sequence, int]]:
    """Records with runs of identical frames past the cutoff replaced by a count."""
    items: list[Union[Sequence, int]] = []
    last = None
    count = 0
    for rec in records:
        key = (rec[0], rec[1], rec[2])
        if key != last:
            if count > RECURSIVE_CUTOFF:
                items.append(count - RECURSIVE_CUTOFF)
            last = key
            count = 0
        count += 1
        if count <= RECURSIVE_CUTOFF:
            items.append(rec)
    if count > RECURSIVE_CUTOFF:
        items.append(count - RECURSIVE_CUTOFF)
    return items


def _repeated(n: int, color: bool) -> str:
    return f"  [Previous line repeated {n} more time{'s' if n > 1 else ''}]\n"


def format_records(records: Sequence[Sequence], color: bool = False, limit: Optional[int] = None) -> list[str]:
    """Frame records (outermost first) -> lines, recursion collapsed, middle elided."""
    if limit is None:
        limit = MAX_FRAMES
    items = _collapse(records)
    shown = [i for i, item in enumerate(items) if not isinstance(item, int)]
    omitted_at = None
    omitted = 0
    if limit > 0 and len(shown) > limit:
        head = limit // 2
        tail = limit - head
        cut_from = shown[head]
        cut_to = shown[len(shown) - tail]  # first index kept after the gap
        omitted = sum(1 for it in items[cut_from:cut_to] if not isinstance(it, int)) + sum(
            it for it in items[cut_from:cut_to] if isinstance(it, int)
        )
        items = items[:cut_from] + [None] + items[cut_to:]
        omitted_at = cut_from
    out: list[str] = []
    for i, item in enumerate(items):
        if i == omitted_at and item is None:
            text = f"  ... {omitted} frame{'s' if omitted != 1 else ''} omitted ...\n"
            out.append(f"{ANSI.GREY}{text[:-1]}{ANSI.RESET}\n" if color else text)
        elif isinstance(item, int):
            out.append(_repeated(item, color))
        else:
            out.append(format_frame(item, color))
    return out


def format_snapshot(snap, color: Optional[bool] = None, limit: Optional[int] = None, file: Optional[IO[str]] = None) -> str:
    """A snapshot's frames, as ``traceback.format_list`` would lay them out."""
    return "".join(format_records(snap.records(), resolve(color, file), limit))


def heading(text: str, color: bool) -> str:
    return f"{ANSI.BOLD}{text}{ANSI.RESET}\n" if color else f"{text}\n"


def join(parts: Iterable[str]) -> str:
    return "".join(parts)
