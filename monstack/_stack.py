"""Shadow-stack nodes and per-thread state: the one core every backend feeds.

A *node* is a tuple ``(code, parent, parent_lasti)``:

- ``code``: the code object of a tracked frame (never the frame: nothing here keeps
  frames or locals alive);
- ``parent``: the node of the nearest tracked caller, or None at the bottom;
- ``parent_lasti``: the byte offset (``f_lasti`` convention) of the instruction in the
  *parent's* code that was running when this frame was entered, i.e. the call site;
  ``UNKNOWN`` (-1) until somebody needs it.

Nodes are immutable and shared: a snapshot is a reference to the top node plus the
snapshotting frame's own offset, O(1) whatever the depth.

Backends push nodes with ``parent_lasti = UNKNOWN`` when learning the call site would
cost a frame lookup per call (pure-Python ``sys.monitoring`` callbacks). ``capture``
fills those in lazily from the real frames -- a node's call site never changes while
the node is on the stack -- replacing the unfilled top segment with filled copies.
Every node is therefore filled at most once, and a snapshot costs O(frames pushed since
the last snapshot on this path), which is O(1) in a loop. Filling also checks the shadow
stack against the real one and rebuilds it from the real frames on any disagreement.

Per-thread state: ``TLS.cell`` is a one-element list ``[top]`` for each thread that has
been seeded; a missing attribute means "not seeded yet" (the thread was running before
install, or started since). Native backends share exactly this structure.
"""

from __future__ import annotations

import _thread
import sys
from _weakref import ref as _weakref

from . import _env

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import CodeType, FrameType
    from typing import Any, Callable, Optional, Tuple

    from ._policy import Policy

    Node = Tuple[CodeType, Optional["Node"], int]  # type: ignore[misc]

#: ``parent_lasti`` of a node whose call site has not been looked up yet.
UNKNOWN = -1

#: Code flags of frames that can be suspended and later resumed by a throw (generators,
#: coroutines, async generators, @types.coroutine generators).
#: (inspect.CO_GENERATOR | CO_COROUTINE | CO_ITERABLE_COROUTINE | CO_ASYNC_GENERATOR, without
#: importing inspect at start-up; tests check the values.)
SUSPENDABLE = 0x20 | 0x80 | 0x100 | 0x200

# Where a generator frame linked in by gen.throw() sits (see _env.DELEGATION_OP).
_RESUME_AFTER_YIELD = _env.RESUME_AFTER_YIELD
DELEGATION_OP: int = _env.DELEGATION_OP


def linked_suspended(frame: FrameType) -> bool:
    """``frame`` (a generator or coroutine frame) is suspended at its delegation point
    though frames above it run: ``gen.throw()`` linked it in without resuming it."""
    code = frame.f_code
    at = frame.f_lasti
    raw = code.co_code
    if not (code.co_flags & SUSPENDABLE) or not 0 <= at < len(raw) - 1:
        return False
    return raw[at] == DELEGATION_OP and (not _RESUME_AFTER_YIELD or (raw[at + 1] & 3) >= 2)


def _thread_local_type() -> Any:
    """``_thread._local`` itself: the native code reads its per-thread dicts. gevent's
    ``monkey.patch_all()`` replaces it with a greenlet-local class; when that happened
    before monstack was imported, gevent keeps the original."""
    local = _thread._local
    if getattr(local, "__module__", None) != "_thread":
        import sys

        monkey = sys.modules.get("gevent.monkey")
        try:
            original = monkey.get_original("_thread", "_local")  # type: ignore[union-attr]
            if getattr(original, "__module__", None) == "_thread":
                return original
        except Exception:
            pass
    return local


_LOCAL = _thread_local_type()


def register(tls: Any = None) -> None:
    """Make this thread's stack readable from other threads (``monstack.threads()``,
    dumps): records its ``TLS`` dict in ``REGISTRY``. Called wherever Python code creates
    or replaces a thread's cell (seeding, resync: rare); the callbacks replace a thread's
    cell but never its dict, so the registry always leads to the current cell. Never
    raises (the thread then stays readable from its frames only)."""
    try:
        d = (TLS if tls is None else tls).__dict__
        ident = _get_ident()
        entry = REGISTRY.get(ident)
        if entry is None or entry[0] is not d:
            threading = _sys_modules.get("threading")
            active = getattr(threading, "_active", None) if threading is not None else None
            owner = active.get(ident) if active is not None else None
            # (weakly: a finished Thread must be freed by reference counting, as without us)
            REGISTRY[ident] = (d, _weakref(owner) if owner is not None else None)
    except Exception:
        pass


class _SelfRegistering(_LOCAL):  # type: ignore[misc,valid-type]
    """A ``_thread._local`` that registers each thread's dict itself, for a backend whose
    native code creates cells (the 3.11 shim seeds a thread with a C ``setattr``): CPython
    calls ``__init__`` in each thread at its first use of the local, from C too. Not the
    default: a subclass's attribute reads take the generic path, about 10 ns more per read
    of ``TLS.cell`` by the pure-Python callbacks. No slots of its own: the layout the native
    code reads is ``_thread._local``'s (``_LOCAL``: gevent's original when it patched)."""

    __slots__ = ()

    def __init__(self) -> None:
        register(self)


#: ident -> (that thread's dict of ``TLS``, a weak reference to its ``threading.Thread`` at
#: registration, or None). Written by each thread for itself (one dict store: atomic under the GIL), read by
#: any; entries of dead threads stay until a reader prunes them (``registered``).
REGISTRY: dict = {}
_get_ident = _thread.get_ident
_sys_modules = sys.modules

#: Per-thread state shared by all tracking backends (see module docstring).
TLS = _LOCAL()

#: Filled copies of other threads' tops whose call sites were unknown (``_threads``):
#: id(top) -> (top, filled). Another thread's cell is never written (it may push or pop
#: meanwhile); a thread whose stack has not changed since the last ``threads()`` (a hung
#: one) is answered in O(1) again. Holding ``top`` keeps its id from being reused (and the
#: native callbacks from recycling it); nodes never change, and the frames below a node
#: cannot change while it is on the stack. Bounded (the oldest go first); emptied with TLS.
FILLED: dict = {}
FILLED_CACHE_SIZE = 1024

#: How often a thread's stack was seeded from / rebuilt after disagreeing with the real
#: frames ("resync": the slow path; tests assert ordinary code never needs one) / rebuilt
#: because a throw entered a generator ("throw": by design, see ``_sysmon.on_throw``).
#: ``recursion``: threads' stacks forgotten because a callback or a snapshot ran into the
#: recursion limit (see ``_install._on_internal_error``).
STATS = {"seed": 0, "resync": 0, "throw": 0, "recursion": 0}


def reset_tls(self_registering: bool = False) -> None:
    """Forget every thread's stack at once (install/uninstall): a new ``_thread._local``
    (``self_registering``: one that registers each thread's dict by itself, for native
    code that creates cells).

    Threads keep running while monstack is off, so old stacks are stale; each thread
    reseeds from its real frames at its next event.
    """
    global TLS
    REGISTRY.clear()
    FILLED.clear()
    TLS = _SelfRegistering() if self_registering else _LOCAL()


#: ``TLS.__dict__`` key holding, while a garbage collection runs on the thread, the cell
#: the collection found (None: the thread had none); see ``on_collection``.
COLLECTING = "collecting"


def on_collection(phase: str, info: Any) -> None:
    """A ``gc.callbacks`` entry, registered while a tracking backend runs.

    A collection runs finalizers (``__del__``, weakref callbacks, the ``finally:`` of an
    abandoned generator) wherever an allocation triggers it, also inside monstack's own
    machinery (a native or Python callback, the 3.11 shim's bookkeeping, a policy
    decision), where ``tstate->tracing`` is raised and no events reach the backend: the
    finalizer's frames are never pushed or popped. Nothing cheap tells from here which
    case this is, so every collection unseeds the thread for its duration and puts the
    thread's cell back when it ends:

    - events reach the finalizers: their first event seeds a fresh cell from the real
      frames and tracking goes on as usual (the frames it describes all return before
      the collection ends);
    - events do not reach them: nothing seeds, and a snapshot without a cell builds
      from the real frames without storing (``make_capture``): right every time;
    - either way the callback or snapshot the collection interrupted finds its cell (the
      same list, kept alive here) as it left it.
    """
    try:
        d = TLS.__dict__
        if phase == "start":
            d[COLLECTING] = d.pop("cell", None)
        elif COLLECTING in d:
            saved = d.pop(COLLECTING)
            if saved is None:
                d.pop("cell", None)
            else:
                d["cell"] = saved
    except Exception:  # never fail a collection (a thread-local torn down at exit, say)
        pass


def watch_collections(on: bool) -> None:
    """Register (``on``) or remove ``on_collection`` in ``gc.callbacks`` (the tracking
    backends' start and stop)."""
    import gc  # (built in: no import cost)

    callbacks = gc.callbacks
    while on_collection in callbacks:
        callbacks.remove(on_collection)
    if on:
        callbacks.append(on_collection)



def registered(live: "Optional[Any]" = None) -> dict:
    """``ident -> (dict, thread)`` of the threads whose ``TLS`` dict is registered, without
    the threads not in ``live`` (idents of live threads, e.g. ``sys._current_frames()``),
    whose entries are pruned. A copy: safe to iterate while threads come and go."""
    for _ in range(100):
        try:
            reg = dict(REGISTRY)
            break
        except RuntimeError:  # changed size during the copy (free-threaded builds)
            continue
    else:
        return {}
    if live is not None:
        dead = [i for i in reg if i not in live]
        for ident in dead:
            entry = reg.pop(ident)
            # Only when many are dead: a thread starting now may take a dead one's ident
            # and register between the test and the pop (then it is unreadable until the
            # next install); idents are reused, so dead entries stay few anyway.
            if len(dead) > 16 and REGISTRY.get(ident) is entry:
                REGISTRY.pop(ident, None)
    return reg


def get_cell() -> list:
    """This thread's ``[top]`` cell, creating an empty (unseeded -> seeded empty) one."""
    try:
        return TLS.cell
    except AttributeError:
        cell = TLS.cell = [None]
        register()
        return cell


def clear_cell() -> None:
    """Forget this thread's stack (it is reseeded from the real frames on next use)."""
    try:
        del TLS.cell
    except AttributeError:
        pass


def _tracked(frame: FrameType, policy: "Policy", by_file: dict) -> bool:
    code = frame.f_code
    decision = by_file.get(code.co_filename)
    if decision is None:
        decision = policy.is_tracked(code, frame.f_globals.get("__name__"))
    return decision


def first_tracked(frame: Optional[FrameType], policy: "Policy") -> Optional[FrameType]:
    """``frame`` or its nearest caller that runs tracked code, or None."""
    by_file = policy.tracked_files()
    while frame is not None and not _tracked(frame, policy, by_file):
        frame = frame.f_back
    return frame


def build(
    frame: Optional[FrameType],
    policy: "Policy",
    unverified: Optional[Callable[[FrameType], bool]] = None,
    answerers: Optional[list] = None,
    filled: Optional[list] = None,
    check_first: bool = False,
) -> Tuple[Optional[Node], int]:
    """Nodes for the tracked frames from ``frame`` outwards, built from the real frames.

    Returns ``(top, lasti)``: the node of the first tracked frame (or None) and that
    frame's current offset. O(depth): used by the ``walk`` backend and to (re)seed.

    ``unverified(f)`` (asked about generator and coroutine frames only: it runs at
    every throw, and a Python call per frame cost deep stacks ~50% more) true for a
    frame past ``frame``: that frame's node and every node
    above it get UNKNOWN call sites although the sites are known, so that the next
    ``capture`` through them checks them against the real frames again (a frame that may
    leave without an event: see ``_sysmon.on_throw``). The whole top segment, because
    ``_fill`` trusts everything below the first known call site.

    ``answerers`` (with ``unverified``): gets, for each run of such frames, the code of
    the tracked frame just before the run (nearer ``frame``) if it is a generator's or
    coroutine's: the one whose yield may answer the throw that linked the run in.

    ``filled`` (a list, with ``unverified``): gets the top of the same chain with every
    call site known, for a snapshot (whose records need them), while the returned top,
    left unverified where ``unverified`` says so, goes to the cell. Both share the nodes
    below the unverified segment (the same node when there is none).

    ``check_first``: ask ``unverified`` about ``frame`` too (by default it is exempt: a
    throw's rebuild starts at the frame thrown into, which still sits at its yield). A
    snapshot's or a resync's rebuild starts at a running frame, or at one that
    ``gen.throw()`` linked in (a library's snapshot or a frame called from C looked past
    to it), which must be left unverified as well.
    """
    by_file = policy.tracked_files()
    codes: list = []
    lastis: list = []
    doubtful = -1  # nodes 0..doubtful (from the top) are left unverified
    f = frame
    exempt = None if check_first else frame
    is_tracked = policy.is_tracked
    while f is not None:
        code = f.f_code  # (_tracked, inlined: this loop runs at every throw)
        decision = by_file.get(code.co_filename)
        if decision is None:
            decision = is_tracked(code, f.f_globals.get("__name__"))
        if decision:
            if unverified is not None and code.co_flags & SUSPENDABLE and f is not exempt and unverified(f):
                k = len(codes)
                if answerers is not None and doubtful != k - 1 and k:
                    prev = codes[-1]
                    if prev.co_flags & SUSPENDABLE:
                        answerers.append(prev)
                doubtful = k
            codes.append(code)
            lastis.append(f.f_lasti)
        f = f.f_back
    node: Any = None  # Optional[Node]; mypy cannot follow the recursive tuple
    n = len(codes)
    if doubtful >= 0:
        # _fill compares codes down to the first known node. Stale nodes on top of a run
        # of the same code (the thrower's callers running the linked generator's code)
        # would line up with the real frames one level shifted: extend the unverified
        # segment until the first known node's code is not in it, which no shift matches.
        seen = set(codes[: doubtful + 1])
        while doubtful + 1 < n and codes[doubtful + 1] in seen:
            doubtful += 1
    if n:
        last = n - 1
        node = (codes[last], None, UNKNOWN if doubtful == last else 0)
        for i in range(last - 1, doubtful, -1):
            node = (codes[i], node, lastis[i + 1])
        if doubtful >= 0:
            if filled is not None:  # the same segment, call sites known
                known = node if doubtful < last else (codes[last], None, 0)
                for i in range(min(doubtful, last - 1), -1, -1):
                    known = (codes[i], known, lastis[i + 1])
                filled.append(known)
            for i in range(min(doubtful, last - 1), -1, -1):
                node = (codes[i], node, UNKNOWN)
        elif filled is not None:
            filled.append(node)
    elif filled is not None:
        filled.append(None)
    return node, (lastis[0] if n else UNKNOWN)


#: ``_fill``'s answer when its walk met a frame ``gen.throw()`` linked in.
LINKED: Node = (None, None, UNKNOWN)  # type: ignore[assignment]


def rebuild(frame: Optional[FrameType], policy: "Policy") -> Tuple[Optional[Node], Optional[Node]]:
    """``(for the cell, for a snapshot)``: the nodes of the tracked frames from ``frame``
    outwards, built from the real frames, the second with every call site known, the
    first with the frames ``gen.throw()`` linked in (and all above) left unverified.

    A snapshot taken while a throw runs sees those frames really there; if a library
    level then yields (no event), they leave with the throw and no event pops their
    nodes. Left unverified, the next capture through them checks them again, as after
    the throw's own rebuild. Outside a throw both are the same chain (one Python call per
    generator or coroutine frame to tell)."""
    out: list = []
    top = build(frame, policy, linked_suspended, None, out, True)[0]
    return top, out[0]


def _fill(top: Node, frame: FrameType, policy: "Policy") -> Optional[Node]:
    """Fill the call sites of the unfilled top segment, checking it against the frames.

    ``frame`` is the real frame of ``top``. Returns the filled replacement of ``top``,
    None when the shadow stack disagrees with the real one, or ``LINKED`` (the caller
    rebuilds, see ``rebuild``) when it met a frame ``gen.throw()`` linked in.

    A real frame on the way that ``gen.throw()`` linked in (``linked_suspended``) got no
    event: the node it lines up with may be another frame's of the same code (the
    thrower's, when it runs the linked generator's code; a frame a throw() method or
    getter called from C was pushed above the thrower's node), shifting the rest of the
    walk by one level where no code differs. Codes cannot tell, so the stack is rebuilt
    from the real frames instead (O(depth), during a throw only, as the throw's own
    rebuild; counted as one).
    """
    by_file = policy.tracked_files()
    is_tracked = policy.is_tracked
    pending: list = []
    node: Optional[Node] = top
    f: Optional[FrameType] = frame
    anchor: Optional[Node] = None
    while node is not None and node[2] == UNKNOWN:
        parent = node[1]
        f = f.f_back if f is not None else None
        while f is not None:  # (_tracked, inlined: this loop runs at most snapshots)
            code = f.f_code
            decision = by_file.get(code.co_filename)
            if decision is None:
                decision = is_tracked(code, f.f_globals.get("__name__"))
            if decision:
                break
            f = f.f_back
        if parent is None:
            if f is not None:
                return None  # a tracked caller is missing from the shadow stack
            pending.append((node[0], 0))
            break
        if f is None or code is not parent[0]:
            return None
        lasti = f.f_lasti
        raw = code.co_code  # (linked_suspended(f), inlined; only generator code has that op)
        if raw[lasti] == DELEGATION_OP and (not _RESUME_AFTER_YIELD or raw[lasti + 1] & 2):
            STATS["throw"] += 1
            return LINKED
        pending.append((node[0], lasti))
        node = parent
    else:
        anchor = node
    filled = anchor
    for code, lasti in reversed(pending):
        filled = (code, filled, lasti)
    return filled


#: ``TLS.linked`` when there is none: ``(cell top, filled top)`` of the last rebuild
#: that left frames ``gen.throw()`` linked in unverified (see ``make_capture``).
_NO_MEMO = (LINKED, None)


def make_capture(policy: "Policy"):
    """A ``capture(frame) -> (top, lasti)`` for tracking backends, bound to ``policy``.

    ``frame`` may be untracked (monstack's own frames, a library): the snapshot starts at
    its nearest tracked caller. The fast path -- top node is this frame's code, call site
    known -- is a handful of attribute reads. Otherwise it fills unknown call sites, and
    resynchronises from the real frames when the shadow and real stacks disagree.
    """
    tracked_set = policy.tracked_set()
    by_file = policy.tracked_files()
    is_tracked = policy.is_tracked

    def capture(frame: Optional[FrameType]) -> Tuple[Optional[Node], int]:
        f = frame
        while f is not None:
            code = f.f_code
            filename = code.co_filename
            if filename in tracked_set:
                break
            if by_file.get(filename) is None and is_tracked(code, f.f_globals.get("__name__")):
                break
            f = f.f_back
        tls = TLS
        try:
            cell = tls.cell
        except AttributeError:
            if COLLECTING in tls.__dict__:
                # a finalizer run by a collection: its frames may get no events (see
                # on_collection), so nothing is stored that the next snapshot would trust
                return build(f, policy)[0], (f.f_lasti if f is not None else UNKNOWN)
            cell = tls.cell = [None]
            register(tls)
            STATS["seed"] += 1
            cell[0], top = rebuild(f, policy)
            return top, (f.f_lasti if f is not None else UNKNOWN)
        top = cell[0]
        if f is None:
            if top is not None:
                cell[0] = None
            return None, UNKNOWN
        if top is None or top[0] is not code:
            STATS["resync"] += 1
        elif top[2] != UNKNOWN:
            return top, f.f_lasti
        elif top is getattr(tls, "linked", _NO_MEMO)[0]:
            # the same frame's snapshot again, nothing pushed since the rebuild below
            return tls.linked[1], f.f_lasti
        elif f is not frame and code.co_flags & SUSPENDABLE and linked_suspended(f):
            # looked past a library to a frame gen.throw() linked in (a library level
            # the throw resumed, taking a snapshot): _fill checks the frames past f only
            STATS["throw"] += 1
        else:
            filled = _fill(top, f, policy)
            if filled is LINKED:
                pass
            elif filled is not None:
                cell[0] = filled
                return filled, f.f_lasti
            else:
                STATS["resync"] += 1
        # rebuilt from the real frames, the linked ones left unverified in the cell
        cell[0], top = rebuild(f, policy)
        # While the throw runs, this frame's next snapshots (nothing pushed since: its
        # node still on top, so the frames below are the same) reuse the filled chain
        # instead of rebuilding. (Only the snapshotting frame's own node: a linked frame
        # looked past to leaves without an event, and its node stays.)
        # (Stored only when it changes: the native callbacks cache the cell by the
        # version of this thread-local's dict.)
        if cell[0] is not top and f is frame:
            tls.linked = (cell[0], top)
        elif getattr(tls, "linked", _NO_MEMO) is not _NO_MEMO:
            tls.linked = _NO_MEMO
        return top, f.f_lasti

    return capture


def capture(frame: Optional[FrameType], policy: "Policy") -> Tuple[Optional[Node], int]:
    """One-off form of :func:`make_capture` (slower: binds the policy on every call)."""
    return make_capture(policy)(frame)


def depth(node: Optional[Node]) -> int:
    n = 0
    while node is not None:
        n += 1
        node = node[1]
    return n
