"""The one formatting core: snapshots (and exceptions with their origins) rendered in
CPython's traceback layout, in small steps that can be overridden or reused.

Colour is decided by the caller at the output edge (``color`` is a bool here, or None
to let :mod:`monstack._colorize` decide for the stream).
"""

from __future__ import annotations

from . import _env
from ._colorize import ANSI, resolve

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Any, Iterable, Optional, Sequence, Union

#: ``linecache``, imported at the first source line read (on 3.11 it imports tokenize,
#: which imports re: nothing start-up needs).
linecache: Any = None

#: Identical consecutive frames shown before "[Previous line repeated N more times]".
RECURSIVE_CUTOFF = 3
#: Default cap on frames shown; the middle of longer stacks is elided and counted.
MAX_FRAMES = 100


def source_line(filename: str, lineno: Optional[int]) -> str:
    """The stripped source line, or "" when the file is gone or unreadable."""
    if not lineno:
        return ""
    global linecache
    try:
        if linecache is None:
            import linecache as module

            linecache = module
        return linecache.getline(filename, lineno).strip()
    except Exception:  # a loader that raises, a file that vanished mid-read, ...
        return ""


def format_frame(record: Sequence, color: bool = False) -> str:
    """``  File "f", line N, in name`` plus the source line, as CPython prints it.

    A 7-field record (a snapshot restored from its portable form, maybe made on another
    machine) shows the line it carries, or none: its file is never read here."""
    filename, lineno, name = record[0], record[1], record[2]
    if color:
        m, r = ANSI.MAGENTA, ANSI.RESET
        text = f'  File {m}"{filename}"{r}, line {m}{lineno}{r}, in {m}{name}{r}\n'
    else:
        text = f'  File "{filename}", line {lineno}, in {name}\n'
    if len(record) > 6:
        carried = record[6]
        line = carried.strip() if isinstance(carried, str) else ""
    else:
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
    items: list[Any] = _collapse(records)
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
    """A snapshot's frames, as ``traceback.format_list`` would lay them out, without the
    last line's newline (``print(snap.format())`` prints no empty line)."""
    text = "".join(format_records(snap._display_records(), resolve(color, file), limit))
    return text[:-1] if text.endswith("\n") else text


def heading(text: str, color: bool) -> str:
    return f"{ANSI.BOLD}{text}{ANSI.RESET}\n" if color else f"{text}\n"


def join(parts: Iterable[str]) -> str:
    return "".join(parts)


# -- origins and exceptions -------------------------------------------------------------

#: First line of an origin chain, and of the PEP 678 note that carries it.
ORIGIN_HEADING = "Work created at (most recent call last):"
#: Heading of each older hop: the work above was itself created by other work.
HOP_HEADING = "Which ran in work created at (most recent call last):"


def format_origin(snap, color: bool = False, limit: Optional[int] = None, frame_limit: Optional[int] = None) -> list[str]:
    """Lines for the chain that starts at ``snap`` (where the work was created), newest hop
    first, at most ``limit`` hops (default: the installed ``chain_limit``), then how many
    older hops were dropped."""
    if limit is None:
        limit = snap._chain_limit()
    limit = max(1, limit)
    older, dropped = snap.chain(limit - 1)
    out: list[str] = []
    for i, hop in enumerate((snap,) + tuple(older)):
        try:
            records = hop._display_records()
        except Exception:  # never let a broken record break the report
            records = ()
        if not records:
            # An origin with no tracked frames says nothing: none is shown. An older hop
            # with none is left out (the work still ran, further out, in the next one).
            if i == 0:
                return out
            continue
        out.append(heading(ORIGIN_HEADING if i == 0 else HOP_HEADING, color))
        out.extend(format_records(records, color, frame_limit))
    if dropped > 0:
        text = f"[{dropped} more hop{'s' if dropped != 1 else ''} dropped (chain_limit={limit})]"
        out.append(f"{ANSI.GREY}{text}{ANSI.RESET}\n" if color else text + "\n")
    return out


def has_frames(snap) -> bool:
    """True if ``snap`` has a frame to show (an origin with none is never attached nor
    shown: :func:`format_origin` gives nothing for it)."""
    try:
        return bool(snap._display_records())
    except Exception:
        return False


def origin_note(snap, color: bool = False) -> str:
    """The origin chain as one PEP 678 note ("" when it has no frames); coloured only for
    a report monstack prints itself (never a note an exception keeps)."""
    try:
        return "".join(format_origin(snap, color=color)).rstrip("\n")
    except Exception:
        return ORIGIN_HEADING + "\n  (monstack: the origin could not be formatted)"


def is_origin_note(note: object) -> bool:
    """True for the PEP 678 note monstack adds (recognised by its heading, also after pickling)."""
    return isinstance(note, str) and note.startswith(ORIGIN_HEADING)


def _traceback_lines(exc: BaseException, color: bool, drop_origin_note: bool, origins: Any = None,
                     top: bool = False) -> list[str]:
    """CPython's own rendering of ``exc`` (chains, groups, carets), minus monstack's note.

    ``origins(e)``: the origin of an exception ``e`` of the chain or group below ``exc``
    (and of ``exc`` itself if ``top``); each one found is shown as a note of ``e``, where
    the excepthook prints notes. The exceptions themselves are left as they are."""
    import traceback

    te = traceback.TracebackException(type(exc), exc, exc.__traceback__, compact=True)
    _hide_own_frames(te)
    if drop_origin_note:
        notes = getattr(te, "__notes__", None)
        if isinstance(notes, (list, tuple)):
            kept = [n for n in notes if not is_origin_note(n)]
            te.__notes__ = kept or None  # type: ignore[attr-defined]
    if origins is not None:
        _origin_notes(te, exc, origins, top, color)
    if color and _COLORIZE_TRACEBACKS:
        return list(te.format(colorize=True))  # type: ignore[call-arg]
    return list(te.format())


def _hide_own_frames(te) -> None:
    """Drop monstack's own frames (its call wrappers) from a TracebackException and the
    exceptions chained to it, as the tracking policy keeps them out of snapshots."""
    import traceback

    from ._policy import _MONSTACK_DIR

    seen: set = set()
    todo = [te]
    while todo:
        t = todo.pop()
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        stack = getattr(t, "stack", None)
        if stack and any(f.filename.startswith(_MONSTACK_DIR) for f in stack):
            t.stack = traceback.StackSummary.from_list(
                [f for f in stack if not f.filename.startswith(_MONSTACK_DIR)]
            )
        todo.append(getattr(t, "__cause__", None))
        todo.append(getattr(t, "__context__", None))
        todo.extend(getattr(t, "exceptions", None) or ())


def _origin_notes(te: Any, exc: BaseException, origins: Any, top: bool = False, color: bool = False) -> None:
    """Give each TracebackException below ``te`` (causes, contexts, group members: the
    ones ``te`` rendered from ``exc``'s; ``te`` too if ``top``) a note with its
    exception's origin, coloured as the rest of the report when ``color`` (CPython prints
    notes as they are; the exceptions' own notes are not touched)."""
    seen: set = set()
    todo: list = []

    def below(t: Any, e: Any) -> None:
        for attr in ("__cause__", "__context__"):
            todo.append((getattr(t, attr, None), getattr(e, attr, None)))
        members = getattr(e, "exceptions", None)
        if isinstance(members, (list, tuple)):
            todo.extend(zip(getattr(t, "exceptions", None) or (), members))

    if top:
        todo.append((te, exc))
    else:
        below(te, exc)
    while todo and len(seen) < 1000:
        t, e = todo.pop()
        if t is None or not isinstance(e, BaseException) or id(t) in seen:
            continue
        seen.add(id(t))
        try:
            snap = origins(e)
            note = origin_note(snap, color) if snap is not None else ""
            if note and note.startswith((ORIGIN_HEADING, ANSI.BOLD + ORIGIN_HEADING)):
                notes = [n for n in (getattr(t, "__notes__", None) or ()) if not is_origin_note(n)]
                t.__notes__ = notes + [note]
        except Exception:
            pass
        below(t, e)


#: CPython 3.13+ colours tracebacks itself (``TracebackException.format(colorize=...)``).
_COLORIZE_TRACEBACKS = _env.COLORIZED_TRACEBACKS


def _fallback_exception_lines(exc: BaseException) -> list[str]:
    """The last resort when even the traceback module cannot render ``exc``."""
    try:
        name = type(exc).__qualname__
    except Exception:
        name = "<exception>"
    try:
        text = str(exc)
    except Exception:
        text = "<exception str() failed>"
    return [f"{name}: {text}\n" if text else f"{name}\n"]


def format_traceback(exc: BaseException, color: bool = False) -> str:
    """Only CPython's rendering of ``exc``, without monstack's origin note."""
    try:
        return "".join(_traceback_lines(exc, color, True))
    except Exception:
        return "".join(_fallback_exception_lines(exc))


def format_exception(exc: BaseException, origin=None, color: bool = False, origins: Any = None) -> str:
    """The traceback of ``exc`` as CPython prints it, then the origin chain (if any).

    monstack's own note is left out of the traceback part when ``origin`` is given (it
    would repeat the chain, uncoloured). ``origins``: see :func:`_traceback_lines` (the
    origins of the exceptions chained to or grouped in ``exc``, shown as their notes).
    Never raises for hostile exceptions.
    """
    try:
        lines = _traceback_lines(exc, color, origin is not None, origins)
    except Exception:
        lines = _fallback_exception_lines(exc)
    if origin is not None:
        try:
            lines.extend(format_origin(origin, color))
        except Exception:
            lines.append("(monstack: the origin of this exception could not be formatted)\n")
    return "".join(lines)
