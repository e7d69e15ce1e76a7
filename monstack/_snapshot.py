"""Snapshots: an O(1) handle on "where this thread is", read lazily.

A live snapshot is the top node of the thread's shadow stack plus the snapshotting
frame's offset. File names, line numbers and source lines are computed only when the
snapshot is read, through per-code caches that keep their code objects alive and are
bounded. A pickled snapshot travels as its portable form (``Snapshot.to_portable``): plain
JSON-safe records that carry the source text of each line as read where the snapshot was
made, so a snapshot restored on another machine never shows a line read from a local file.
"""

from __future__ import annotations

from _contextvars import ContextVar
from _thread import _local
from _thread import get_ident as _get_ident

from . import _stack

TYPE_CHECKING = False
if TYPE_CHECKING:
    import traceback
    from types import CodeType
    from typing import Any, Iterator, Optional, Tuple

    #: One frame as plain data: filename, lineno, name, end_lineno, colno, end_colno.
    FrameRecord = Tuple[str, Optional[int], str, Optional[int], Optional[int], Optional[int]]

#: Per-code cache of ``co_positions()``: id(code) -> (code, positions). Holding the
#: code keeps its id from being reused while cached; the cap keeps memory bounded.
_POSITIONS: dict[int, tuple[CodeType, list]] = {}
POSITIONS_CACHE_SIZE = 2048

#: The snapshot of where the work now running was created (see ``monstack.origin``).
#: Each thread and asyncio task has its own; ``snapshot()`` links new snapshots to it.
CURRENT_ORIGIN: "ContextVar[Optional[Snapshot]]" = ContextVar(
    "monstack_current_origin", default=None
)

#: ident -> that thread's cell: a list of one item, the origin of the work the thread is
#: running now (None between jobs), for other threads to read (``monstack.threads()``):
#: ``CURRENT_ORIGIN`` is invisible outside its thread. Each wrapper that runs work with an
#: origin (``_origin``; the native carrier, which keeps the cell in its thread-state dict)
#: stores into its own thread's cell and puts back what it held after (one list store each
#: way: atomic under the GIL). Only ``running_cell()`` makes a cell; a cell is never
#: replaced by another list (one made unusable is repaired in place: the native carrier
#: holds it), and it leaves with its thread (``_CellGuard``).
RUNNING: dict = {}
_running_get = RUNNING.get
#: Per thread, the guard that takes the thread's cell out of ``RUNNING`` when it ends.
_GUARDS = _local()


class _CellGuard:
    """Held by a thread-local of the thread it guards, so freed when that thread's state
    is cleared (the thread ends): its cell then leaves ``RUNNING``, unless the entry is
    another thread's by now (idents are reused), and is emptied, so that a native carrier
    still holding it (where the thread-local is per greenlet: gevent) asks
    ``running_cell()`` for the current one."""

    __slots__ = ("ident", "cell")

    def __init__(self, ident: int, cell: list) -> None:
        self.ident = ident
        self.cell = cell

    def __del__(self) -> None:
        try:
            if _running_get(self.ident) is self.cell:
                del RUNNING[self.ident]
            self.cell.clear()
        except BaseException:  # (at interpreter shutdown the module may be half gone)
            pass


def running_cell() -> list:
    """This thread's cell of ``RUNNING``: made on first use (with its guard), repaired in
    place where it is no longer a list of one item."""
    ident = _get_ident()
    cell = _running_get(ident)
    if type(cell) is not list:
        cell = RUNNING[ident] = [None]
    elif len(cell) != 1:
        cell[:] = [None]
    guard = getattr(_GUARDS, "guard", None)
    if guard is None or guard.cell is not cell:
        _GUARDS.guard = _CellGuard(ident, cell)
    return cell


def running_origin(ident: int) -> Optional[Snapshot]:
    """The origin of the work thread ``ident`` is running now, as its cell tells."""
    cell = _running_get(ident)
    return cell[0] if type(cell) is list and cell else None

#: How many origin hops a snapshot shows (``install(chain_limit=...)``). Chains are also
#: kept physically short: a snapshot never links to more than ``2 * CHAIN_LIMIT - 1``
#: origins (see ``Snapshot._new``), so endless resubmission chains use flat memory.
DEFAULT_CHAIN_LIMIT = 8
CHAIN_LIMIT = DEFAULT_CHAIN_LIMIT
#: Hop count at which ``Snapshot._new`` shortens a chain (``2 * CHAIN_LIMIT``), and the
#: same in a list the native snapshot path reads (it links snapshots to origins too).
_SHORTEN_AT = 2 * DEFAULT_CHAIN_LIMIT
_SHORTEN_CELL = [_SHORTEN_AT]

#: A snapshot stores its hop count and dropped count in one int (one read on the hot
#: path): ``dropped << _HOP_BITS | hops``.
_HOP_BITS = 32
_HOP_MASK = (1 << _HOP_BITS) - 1


def set_chain_limit(limit: int) -> None:
    """Set the chain cap (install/uninstall; validated by the caller)."""
    global CHAIN_LIMIT, _SHORTEN_AT
    limit = min(int(limit), _HOP_MASK // 2)
    CHAIN_LIMIT = limit
    _SHORTEN_AT = 2 * limit
    _SHORTEN_CELL[0] = _SHORTEN_AT


#: Version tag of the portable form (``Snapshot.to_portable``).
PORTABLE_VERSION = 1
#: Longest source line carried in the portable form; longer lines are cut to this.
PORTABLE_LINE_MAX = 500
#: Bounds ``from_portable`` accepts (hops of a chain, frames of one hop, chars of a string).
PORTABLE_MAX_HOPS = 1024
PORTABLE_MAX_FRAMES = 10000
PORTABLE_MAX_STR = 4096


def _positions(code: CodeType) -> list:
    entry = _POSITIONS.get(id(code))
    if entry is not None and entry[0] is code:
        return entry[1]
    positions = list(code.co_positions())
    if len(_POSITIONS) >= POSITIONS_CACHE_SIZE:
        try:  # drop the oldest entry (dicts keep insertion order)
            del _POSITIONS[next(iter(_POSITIONS))]
        except (StopIteration, KeyError, RuntimeError):
            pass
    _POSITIONS[id(code)] = (code, positions)
    return positions


def frame_record(code: CodeType, lasti: int) -> FrameRecord:
    """The plain record of ``code`` at byte offset ``lasti``."""
    lineno = end_lineno = colno = end_colno = None
    if lasti >= 0:
        positions = _positions(code)
        i = lasti // 2
        if i < len(positions):
            lineno, end_lineno, colno, end_colno = positions[i]
            j = i
            while lineno is None and j > 0:  # artificial instructions carry no line
                j -= 1
                lineno, end_lineno, colno, end_colno = positions[j]
    if lineno is None:
        lineno, end_lineno, colno, end_colno = code.co_firstlineno, None, None, None
    return (code.co_filename, lineno, code.co_name, end_lineno, colno, end_colno)


def _records(node: Optional[_stack.Node], lasti: int) -> list[FrameRecord]:
    """Innermost first."""
    out = []
    while node is not None:
        out.append(frame_record(node[0], lasti))
        lasti = node[2]
        node = node[1]
    return out


class Snapshot(tuple):
    """Where a thread was: its tracked frames, innermost at the end of ``frames``.

    Cheap to take and hold (it shares the thread's stack nodes and keeps no frames or
    locals alive); everything readable is computed on first use. Immutable: it is a
    tuple ``(node, lasti, origin, records, hop counts)`` underneath -- the fastest object Python
    can build -- but that layout is private; use the methods and properties.
    """

    __slots__ = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> "Snapshot":
        raise TypeError("Snapshot objects come from monstack.snapshot()")

    @classmethod
    def _new(cls, node: Optional[_stack.Node], lasti: int, origin: Optional["Snapshot"] = None) -> "Snapshot":
        """O(1) (amortised): links to ``origin``, shortening the chain when it is too long.

        Each snapshot stores its hop count, so the cap never walks the chain. A chain
        reaching ``2 * CHAIN_LIMIT`` hops is replaced by a copy of its newest
        ``CHAIN_LIMIT`` hops (made once per origin and cached), so shortening costs O(1)
        per hop on average and memory stays flat however long a resubmission chain runs.
        """
        if origin is None:
            return _tuple_new(cls, (node, lasti, None, None, 0))
        meta = _tuple_getitem(origin, 4) + 1
        if (meta & _HOP_MASK) >= _SHORTEN_AT:
            origin = _compacted(origin, CHAIN_LIMIT)
            meta = _tuple_getitem(origin, 4) + 1
        return _tuple_new(cls, (node, lasti, origin, None, meta))

    @classmethod
    def _from_records(cls, records: tuple, origin: Optional["Snapshot"] = None, dropped: int = 0) -> "Snapshot":
        """A restored snapshot: 7-field records (the 7th the carried line, or None); a
        6-field record (an older pickle) gets None: its line is never read here."""
        linked = cls._new(None, -1, origin)
        meta = _tuple_getitem(linked, 4)
        if _tuple_getitem(linked, 2) is None:
            meta = max(0, int(dropped)) << _HOP_BITS
        recs = tuple(tuple(r[:7]) if len(r) >= 7 else tuple(r[:6]) + (None,) for r in records)
        return _tuple_new(cls, (None, -1, _tuple_getitem(linked, 2), recs, meta))

    @property
    def _node(self) -> Optional[_stack.Node]:
        return _tuple_getitem(self, 0)

    @property
    def _lasti(self) -> int:
        return _tuple_getitem(self, 1)

    @property
    def _origin(self) -> Optional["Snapshot"]:
        return _tuple_getitem(self, 2)

    @property
    def _records(self) -> Optional[tuple]:
        return _tuple_getitem(self, 3)

    @property
    def _hops(self) -> int:
        """Origins physically linked below this snapshot (the ``origin`` chain's length)."""
        return _tuple_getitem(self, 4) & _HOP_MASK

    @property
    def _dropped(self) -> int:
        """Older hops cut off the end of the physical chain by the cap."""
        return _tuple_getitem(self, 4) >> _HOP_BITS

    def __getitem__(self, index: Any) -> Any:
        return self.frames[index]

    # -- reading ---------------------------------------------------------------------------
    @property
    def origin(self) -> Optional["Snapshot"]:
        """The snapshot of where the work running this snapshot's code was created."""
        return self._origin

    @staticmethod
    def _chain_limit() -> int:
        """How many origin hops snapshots show now (``install(chain_limit=...)``)."""
        return CHAIN_LIMIT

    def chain(self, limit: Optional[int] = None) -> tuple[tuple["Snapshot", ...], int]:
        """``(origins, dropped)``: this snapshot's origins, newest first, at most ``limit``
        (default: the installed ``chain_limit``), and how many older hops are not among them."""
        if limit is None:
            limit = CHAIN_LIMIT
        out: list[Snapshot] = []
        snap = self._origin
        while snap is not None and len(out) < limit:
            out.append(snap)
            snap = snap._origin
        return tuple(out), self._hops + self._dropped - len(out)

    def records(self) -> tuple[FrameRecord, ...]:
        """Plain ``(filename, lineno, name, end_lineno, colno, end_colno)``, outermost first."""
        recs = self._records
        if recs is None:  # not cached: the shared nodes are the compact form
            return tuple(reversed(_records(self._node, self._lasti)))
        return tuple(r[:6] for r in recs)  # restored: the 7th field is the carried line

    def _display_records(self) -> tuple:
        """What formatting reads: 6-field records for a local snapshot (lines looked up
        here, lazily), 7-field ones ending in the carried line (or None) for a restored
        snapshot, whose files may be another machine's."""
        recs = self._records
        if recs is None:
            return tuple(reversed(_records(self._node, self._lasti)))
        return recs

    def source_lines(self) -> tuple[Optional[str], ...]:
        """The source line of each frame (outermost first, trailing whitespace removed),
        None where there is none: read here for a local snapshot, the carried text for a
        snapshot restored from its portable form or a pickle."""
        recs = self._records
        if recs is not None:
            return tuple(r[6] for r in recs)
        files: dict[str, list[str]] = {}
        return tuple(_line_in(files, r[0], r[1]) for r in self.records())

    def to_portable(self) -> dict:
        """This snapshot and its origin chain as JSON-safe plain data (no locals).

        ``{"v": 1, "chain": [hop, ...], "dropped": n}``: ``chain`` holds this snapshot then
        its origins, newest first (at most ``chain_limit`` origins); each hop is a list of
        frames, outermost first, each frame ``[filename, lineno, name, end_lineno, colno,
        end_colno, line]`` where ``line`` is the source text read where the snapshot was
        made (or None); ``dropped`` counts older hops not carried.
        """
        origins, dropped = self.chain(CHAIN_LIMIT)
        files: dict[str, list[str]] = {}  # each file's lines, looked up once
        chain = []
        for hop in (self,) + origins:
            recs = hop._records
            if recs is not None:  # restored: what it carries
                chain.append([list(r) for r in recs])
            else:
                chain.append([[*r, _line_in(files, r[0], r[1])] for r in reversed(_records(hop._node, hop._lasti))])
        return {"v": PORTABLE_VERSION, "chain": chain, "dropped": max(0, dropped)}

    @classmethod
    def from_portable(cls, data: Any) -> "Snapshot":
        """The snapshot ``to_portable`` described; ValueError for anything malformed."""
        try:
            chain, dropped = _parse_portable(data)
            snap: Optional[Snapshot] = None
            for i, recs in enumerate(reversed(chain)):
                snap = cls._from_records(recs, snap, dropped if i == 0 else 0)
        except ValueError:
            raise
        except Exception as exc:  # a hostile object: report it as malformed, nothing else
            raise ValueError(f"not a portable monstack snapshot: {type(exc).__name__}") from None
        assert snap is not None
        return snap

    @property
    def frames(self) -> traceback.StackSummary:
        """The frames as a ``traceback.StackSummary``, outermost first (like ``extract_stack()``).

        A restored snapshot's frames hold its carried lines ("" where none was carried, so
        ``FrameSummary.line`` never reads a local file); a carried line is one line, so
        positions spanning several lines are left out of them."""
        import traceback

        recs = self._records
        if recs is None:
            return traceback.StackSummary.from_list(
                [
                    traceback.FrameSummary(
                        fn, ln, name, lookup_line=False, end_lineno=eln, colno=col, end_colno=ecol
                    )
                    for fn, ln, name, eln, col, ecol in self.records()
                ]
            )
        out = []
        for fn, ln, name, eln, col, ecol, line in recs:
            if eln is not None and eln != ln:
                eln, col, ecol = ln, None, None
            out.append(
                traceback.FrameSummary(
                    fn, ln, name, lookup_line=False, line=line or "", end_lineno=eln, colno=col, end_colno=ecol
                )
            )
        return traceback.StackSummary.from_list(out)

    def __len__(self) -> int:
        if self._records is not None:
            return len(self._records)
        return _stack.depth(self._node)

    def __iter__(self) -> Iterator[traceback.FrameSummary]:
        return iter(self.frames)

    def __bool__(self) -> bool:
        return True

    def __contains__(self, item: object) -> bool:
        return item in self.frames

    def count(self, value: Any) -> int:  # type: ignore[override]
        return list(self.frames).count(value)

    def index(self, value: Any, *args: Any) -> int:  # type: ignore[override]
        return list(self.frames).index(value, *args)

    def format(self, color: Optional[bool] = None, *, limit: Optional[int] = None) -> str:
        """The frames in CPython's traceback layout. ``color=None``: as suits ``sys.stdout``."""
        from . import _format

        return _format.format_snapshot(self, color=color, limit=limit)

    def __str__(self) -> str:
        return self.format(color=False)

    def __repr__(self) -> str:
        recs = self.records()
        if not recs:
            return "<monstack.Snapshot: no tracked frames>"
        fn, ln, name = recs[-1][:3]
        return f"<monstack.Snapshot: {len(recs)} frames, innermost {fn}:{ln} in {name}>"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Snapshot):
            return NotImplemented
        return self.records() == other.records() and self._origin == other._origin

    def __ne__(self, other: object) -> bool:
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    __lt__ = __le__ = __gt__ = __ge__ = lambda self, other: NotImplemented  # no ordering
    __add__ = __mul__ = __rmul__ = lambda self, other: NotImplemented  # type: ignore[assignment]  # not a sequence of fields

    def __hash__(self) -> int:
        return hash(self.records())

    def __reduce__(self) -> tuple:
        return (_from_portable, (self.to_portable(),))


_tuple_new = tuple.__new__
_tuple_getitem = tuple.__getitem__


def _from_portable(data: Any) -> Snapshot:
    return Snapshot.from_portable(data)


def _restore(records: tuple, origin: Optional[Snapshot], dropped: int = 0) -> Snapshot:
    """Unpickles snapshots pickled by earlier versions (records without lines)."""
    return Snapshot._from_records(records, origin, dropped)


def _line_in(files: dict, filename: str, lineno: Optional[int]) -> Optional[str]:
    """Line ``lineno`` of ``filename`` as read here (through ``linecache``; ``files``
    caches each file's lines for one call), trailing whitespace removed and cut to
    ``PORTABLE_LINE_MAX``; None when there is none."""
    lines = files.get(filename)
    if lines is None:
        try:
            import linecache

            lines = linecache.getlines(filename)
        except Exception:  # a loader that raises, a file that vanished mid-read, ...
            lines = []
        files[filename] = lines
    if not lineno or not 0 < lineno <= len(lines):
        return None
    line = lines[lineno - 1].rstrip()
    return line[:PORTABLE_LINE_MAX] if line else None


_SEQ = (list, tuple)
_BIG = 1 << 62
_NUM = (int, type(None))
#: The types a portable frame's fields may have: str, int|None, str, three int|None, str|None.
_FRAME_TYPES = frozenset(
    (str, a, str, b, c, d, e) for a in _NUM for b in _NUM for c in _NUM for d in _NUM for e in (str, type(None))
)


def _bad(what: str) -> ValueError:
    return ValueError(f"not a portable monstack snapshot: {what}")


def _parse_portable(data: Any) -> tuple[list[tuple], int]:
    """Validated ``(hops, dropped)`` of a portable snapshot (hops newest first)."""
    if type(data) is not dict:
        raise _bad("not a dict")
    version = data.get("v")
    if type(version) is not int or version != PORTABLE_VERSION:
        raise _bad(f"version {version!r:.40}")
    chain: Any = data.get("chain")
    dropped = data.get("dropped", 0)
    if type(chain) not in _SEQ or not 0 < len(chain) <= PORTABLE_MAX_HOPS:
        raise _bad("'chain' is not a list of 1+ hops")
    if type(dropped) is not int or not 0 <= dropped < _BIG:
        raise _bad("bad 'dropped'")
    hops = []
    for hop in chain:
        if type(hop) not in _SEQ or len(hop) > PORTABLE_MAX_FRAMES:
            raise _bad("a hop is not a list of frames")
        recs = []
        for frame in hop:
            if type(frame) not in _SEQ or len(frame) != 7:
                raise _bad("a frame is not a list of 7")
            fn, ln, name, eln, col, ecol, line = frame
            if tuple(map(type, frame)) not in _FRAME_TYPES:
                raise _bad(f"a frame's fields have the wrong types: {frame!r:.80}")
            if not (-_BIG < (ln or 0) < _BIG and -_BIG < (eln or 0) < _BIG and -_BIG < (col or 0) < _BIG
                    and -_BIG < (ecol or 0) < _BIG and len(fn) <= PORTABLE_MAX_STR
                    and len(name) <= PORTABLE_MAX_STR and (line is None or len(line) <= PORTABLE_MAX_STR)):
                raise _bad(f"a frame's field is too large: {frame!r:.80}")
            recs.append((fn, ln, name, eln, col, ecol, line))
        hops.append(tuple(recs))
    return hops, dropped


#: Shortened copies made by ``_compacted``: id(snapshot) -> (snapshot, limit, copy).
#: Holding the snapshot keeps its id from being reused; the cap bounds memory.
_COMPACTED: dict[int, tuple] = {}
COMPACTED_CACHE_SIZE = 256


def _compacted(snap: Snapshot, limit: int) -> Snapshot:
    """``snap`` with at most ``limit - 1`` origins below it; the rest counted as dropped.

    Cached: the snapshots taken under one long-chained origin (a worker snapshotting
    many times) share one shortened copy. The copies share nodes and records.
    """
    if snap._hops <= limit - 1:
        return snap
    entry = _COMPACTED.get(id(snap))
    if entry is not None and entry[0] is snap and entry[1] == limit:
        return entry[2]
    keep: list[Snapshot] = []
    s: Optional[Snapshot] = snap
    while s is not None and len(keep) < limit:
        keep.append(s)
        s = s._origin
    dropped = snap._hops + snap._dropped - (len(keep) - 1)
    copy: Optional[Snapshot] = None
    hops = 0
    for orig in reversed(keep):
        copy = _tuple_new(Snapshot, (orig._node, orig._lasti, copy, orig._records, dropped << _HOP_BITS | hops))
        hops += 1
    assert copy is not None
    if len(_COMPACTED) >= COMPACTED_CACHE_SIZE:
        try:
            del _COMPACTED[next(iter(_COMPACTED))]
        except (StopIteration, KeyError, RuntimeError):
            pass
    _COMPACTED[id(snap)] = (snap, limit, copy)
    return copy
