"""Snapshots: an O(1) handle on "where this thread is", read lazily.

A live snapshot is the top node of the thread's shadow stack plus the snapshotting
frame's offset. File names, line numbers and source lines are computed only when the
snapshot is read, through per-code caches that keep their code objects alive and are
bounded. A pickled snapshot travels as plain ``(filename, lineno, name, ...)`` records.
"""

from __future__ import annotations

import contextvars
import traceback
from types import CodeType
from typing import Any, Iterator, Optional, Tuple

from . import _stack

#: Per-code cache of ``co_positions()``: id(code) -> (code, positions). Holding the
#: code keeps its id from being reused while cached; the cap keeps memory bounded.
_POSITIONS: dict[int, tuple[CodeType, list]] = {}
POSITIONS_CACHE_SIZE = 2048

#: The snapshot of where the work now running was created (see ``monstack.origin``).
#: Each thread and asyncio task has its own; ``snapshot()`` links new snapshots to it.
CURRENT_ORIGIN: "contextvars.ContextVar[Optional[Snapshot]]" = contextvars.ContextVar(
    "monstack_current_origin", default=None
)

#: ident -> the origin of the work that thread is running now, for other threads to read
#: (``monstack.threads()``): ``CURRENT_ORIGIN`` is invisible outside its thread. Each
#: wrapper that runs work with an origin (``_origin``, ``_propagate``) sets its own
#: thread's key and restores it after (one dict store each way: atomic under the GIL;
#: a pool worker between jobs keeps a None entry, a thread's own start wrapper removes it).
RUNNING: dict = {}

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


#: One frame as plain data: filename, lineno, name, end_lineno, colno, end_colno.
FrameRecord = Tuple[str, Optional[int], str, Optional[int], Optional[int], Optional[int]]


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
        linked = cls._new(None, -1, origin)
        meta = _tuple_getitem(linked, 4)
        if _tuple_getitem(linked, 2) is None:
            meta = max(0, int(dropped)) << _HOP_BITS
        recs = tuple(tuple(r) for r in records)
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
            recs = tuple(reversed(_records(self._node, self._lasti)))
        return recs

    @property
    def frames(self) -> traceback.StackSummary:
        """The frames as a ``traceback.StackSummary``, outermost first (like ``extract_stack()``)."""
        return traceback.StackSummary.from_list(
            [
                traceback.FrameSummary(
                    fn, ln, name, lookup_line=False, end_lineno=eln, colno=col, end_colno=ecol
                )
                for fn, ln, name, eln, col, ecol in self.records()
            ]
        )

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
        if self._origin is None and self._dropped:
            return (_restore, (self.records(), None, self._dropped))
        return (_restore, (self.records(), self._origin))


_tuple_new = tuple.__new__
_tuple_getitem = tuple.__getitem__


def _restore(records: tuple, origin: Optional[Snapshot], dropped: int = 0) -> Snapshot:
    return Snapshot._from_records(records, origin, dropped)


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
