"""The ``monitoring`` backend: PEP 669 ``sys.monitoring`` callbacks keep the stacks.

Push on PY_START / PY_RESUME / PY_THROW, pop on PY_RETURN / PY_YIELD / PY_UNWIND.
Callbacks run on the thread that runs the code, so each reads its own ``TLS.cell``.
Pushes do not look up the caller's frame (that would cost ~2x the whole callback):
they record an unknown call site that ``_stack.capture`` fills lazily. Pops check the
code object against the top and resynchronise from the real frames on disagreement.

Filtered code: its first PY_START/PY_RESUME/PY_RETURN/PY_YIELD returns
``sys.monitoring.DISABLE``, so its later events are never delivered. PY_THROW and
PY_UNWIND cannot be disabled; those callbacks ignore filtered code.

PY_UNWIND also reports coroutine exits (``Backend.reports_coroutine_exits``): an
``Exception`` leaving a coroutine frame whose caller awaits nothing (tracked code or not).
"""

from __future__ import annotations

import _thread
import sys

from . import _env, _stack
from ._backend import CO_COROUTINE, CO_SUSPENDABLE, COROUTINE_EXIT, EXITS_REPORTED
from ._policy import Policy
from ._settings import env_accelerator_off

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import CodeType, FrameType
    from typing import Any, Callable, Optional

    from ._backend import Host

#: Tool ids tried in order. 0-2 are the conventional ids of debuggers, coverage
#: tools and profilers: monstack takes them only when 3-5 are all held.
TOOL_ORDER = (3, 4, 5, 2, 1, 0)
TOOL_NAME = "monstack"


class ToolIdsBusy(RuntimeError):
    """Every sys.monitoring tool id is held by another tool."""


def tool_holders() -> dict[int, str]:
    """Which tool holds each sys.monitoring id (those in use only)."""
    mon = sys.monitoring
    out = {}
    for tool in range(6):
        name = mon.get_tool(tool)
        if name is not None:
            out[tool] = name
    return out


_SUSPENDABLE = _stack.SUSPENDABLE

#: ``frame`` (a generator or coroutine frame) was linked in by ``gen.throw()`` and is
#: suspended at its delegation point (see ``_stack.linked_suspended``).
_linked_suspended = _stack.linked_suspended


def _drop_linked(cell: list, frame: FrameType, drop: bool = True) -> bool:
    """After ``frame`` (a tracked generator) yielded and was popped: pop the nodes of the
    generators ``gen.throw()`` had linked in above it (unless ``drop`` is false: the node
    below was not a generator's). They will not run -- the throw returns the value just
    yielded to its caller -- and leave without any event.

    Returns whether ``frame`` ran just above a linked generator: whether its yield answered
    a throw."""
    f = frame.f_back
    if f is None or not _linked_suspended(f):
        return False
    while drop:
        top = cell[0]
        if top is not None and top[0] is f.f_code:
            cell[0] = top[1]
        f = f.f_back
        if f is None or not _linked_suspended(f):
            break
    return True


def _callbacks(policy: Policy, tls, on_error: Callable[[BaseException], None]):
    """The six callbacks, as closures over their state (locals are the fastest reads)."""
    mon = sys.monitoring
    DISABLE = mon.DISABLE
    getframe = sys._getframe
    get_ident = _thread.get_ident
    tracked_set = policy.tracked_set()
    by_file = policy.tracked_files()
    is_tracked = policy.is_tracked
    build = _stack.build
    register = _stack.register
    UNKNOWN = _stack.UNKNOWN
    stats = _stack.STATS

    def decide(code: CodeType) -> bool:
        # Not in tracked_set: filtered (decided) or not decided yet. Frame 2 is the frame
        # running ``code`` (0: decide, 1: the callback); its module name feeds the policy.
        decision = by_file.get(code.co_filename)
        if decision is None:
            decision = is_tracked(code, getframe(2).f_globals.get("__name__"))
        return decision

    # seed/resync: frames gen.throw() linked in get unverified nodes (see _stack.rebuild:
    # a throw may be running; the first caller may be such a frame, a throw() method's)
    def seed():
        # Thread not seeded: build from the caller of the frame whose event this is.
        # Frames: 0 seed, 1 callback, 2 the frame of the event, 3 its caller.
        try:
            caller = getframe(3)
        except ValueError:  # the event's frame is the thread's first (threading bootstrap)
            caller = None
        cell = tls.cell = [build(caller, policy, _linked_suspended, None, None, True)[0]]
        register(tls)
        stats["seed"] += 1
        return cell

    def resync():
        try:
            caller = getframe(3)
        except ValueError:  # the event's frame is the thread's first
            caller = None
        tls.cell = [build(caller, policy, _linked_suspended, None, None, True)[0]]
        register(tls)
        stats["resync"] += 1

    # The codes whose yield may answer a running throw while outer generators are linked
    # in (see on_throw and _drop_linked): only their yields look at the real frames -- a
    # frame lookup on every yield cost generator-heavy code ~75% more instructions. A
    # listed code's yield that answers (runs just above a linked generator) takes its
    # entry out; one that does not (say, another instance of the catcher's code that the
    # catcher runs) leaves it for the real answer. The list empties itself: each level a
    # throw resumes gets a PY_THROW, whose rebuild lists again (nothing once no generator
    # is linked in). Per yield, while it is empty: one test (it was ``thrown[0] is
    # code``, a little dearer). Per thread (a thread's throw must not replace another's
    # list, nor its yield take another's entry): ``{thread ident: list}``, an entry
    # removed once its list is empty, so a yield looks its thread up only while some
    # thread's list is not empty.
    thrown: dict = {}

    def on_start(code: CodeType, offset: int):
        try:
            if code.co_filename in tracked_set or decide(code):
                try:
                    cell = tls.cell
                except AttributeError:
                    cell = seed()
                cell[0] = (code, cell[0], UNKNOWN)
                return None
            return DISABLE
        except Exception as exc:  # never let an internal error reach user code
            on_error(exc)
            return None

    def on_throw(code: CodeType, offset: int, exc: BaseException):
        # A throw (gen.throw/close, a task cancellation: never per call) may enter frames
        # CPython linked without events (a delegating ``yield from``/``await`` chain), and
        # the frame thrown into may already be on the shadow stack (a snapshot resynced
        # it in while the inner frames ran). Pushing could duplicate it, and a duplicate
        # of a recursive generator is invisible to capture()'s check (same code above and
        # below). So a throw rebuilds the stack from the real frames, itself included.
        # A throw into *library* code that tracked generators delegate to links their
        # frames without events too, and fires PY_THROW for the library frame only:
        # rebuild as well when the nearest tracked caller is a generator or coroutine
        # frame (it may be one of those; a plain function frame was pushed normally).
        try:
            frame = getframe(1)
            if not (code.co_filename in tracked_set or decide(code)):
                f = frame.f_back
                while f is not None:
                    c = f.f_code
                    name = c.co_filename
                    if name in tracked_set or (by_file.get(name) is None and is_tracked(c, f.f_globals.get("__name__"))):
                        break
                    f = f.f_back
                if f is None or not (f.f_code.co_flags & _SUSPENDABLE):
                    return
            # The generators the throw linked in (suspended at their delegation point)
            # get unverified nodes: if the delegate catches and yields, they leave with no
            # event -- for a library delegate not even a PY_YIELD that _drop_linked could
            # answer -- and the next capture through them must check them again.
            answerers: list = []
            top = build(frame, policy, _linked_suspended, answerers)[0]
            try:
                tls.cell[0] = top
            except AttributeError:
                tls.cell = [top]
                register(tls)
                stats["seed"] += 1
            stats["throw"] += 1
            # The yields that may answer a throw while generators are linked in: those of
            # the tracked generators running just above a run of linked ones -- this
            # frame, and, for a throw nested inside a catcher, the outer throw's catcher,
            # whose linked frames this rebuild sees too. (A linked level that resumes
            # later, the level above it having returned, gets a PY_THROW of its own,
            # which lists again.) So each throw's list replaces the thread's last one.
            ident = get_ident()
            if answerers:
                thrown[ident] = answerers
                if len(thrown) > 1:  # drop the lists of threads that ended unanswered
                    alive = sys._current_frames()
                    for gone in [t for t in list(thrown) if t not in alive]:
                        thrown.pop(gone, None)
            else:
                thrown.pop(ident, None)
        except Exception as err:
            on_error(err)

    def on_return(code: CodeType, offset: int, value: object):
        try:
            try:
                cell = tls.cell
            except AttributeError:
                cell = None
            if cell is not None:
                top = cell[0]
                if top is not None and top[0] is code:
                    cell[0] = top[1]
                    return None
            if not (code.co_filename in tracked_set or decide(code)):
                return DISABLE
            resync()
        except Exception as exc:
            on_error(exc)
        return None

    def on_yield(code: CodeType, offset: int, value: object):
        # as on_return, plus _drop_linked for the yield answering a throw
        try:
            try:
                cell = tls.cell
            except AttributeError:
                cell = None
            if cell is not None:
                top = cell[0]
                if top is not None and top[0] is code:
                    below = cell[0] = top[1]
                    if thrown:
                        mine = thrown.get(get_ident())
                        if mine and code in mine:
                            suspendable = below is not None and below[0].co_flags & _SUSPENDABLE
                            if _drop_linked(cell, getframe(1), suspendable):
                                mine.remove(code)  # answered (one entry per throw)
                                if not mine:
                                    thrown.pop(get_ident(), None)
                    return None
            if not (code.co_filename in tracked_set or decide(code)):
                return DISABLE
            resync()
        except Exception as exc:
            on_error(exc)
        return None

    exit_slot = COROUTINE_EXIT

    def coroutine_exit(code: CodeType, exc: BaseException) -> None:
        # frames: 0 this, 1 on_unwind, 2 the event's (still the current one), 3 its caller
        frame = getframe(2)
        if frame.f_code is code:
            back = frame.f_back  # (skips the C entry frame of a coroutine resumed from C)
            if back is None or not back.f_code.co_flags & CO_SUSPENDABLE:
                hook = exit_slot[0]
                if hook is not None:
                    hook(code, exc)

    def on_unwind(code: CodeType, offset: int, exc: BaseException):
        # PY_UNWIND cannot be disabled: filtered code reports every frame an exception
        # leaves, often on a thread with no stack (where reading tls.cell raises). Its
        # code has no node on any stack (every stack is built under this policy since
        # start()): nothing to pop, so it is asked about first.
        try:
            if code.co_flags & CO_COROUTINE and exit_slot[0] is not None and isinstance(exc, Exception):
                coroutine_exit(code, exc)
            if code.co_filename not in tracked_set and not decide(code):
                return
            try:
                cell = tls.cell
            except AttributeError:
                cell = None
            if cell is not None:
                top = cell[0]
                if top is not None and top[0] is code:
                    cell[0] = top[1]
                    return
            resync()  # tracked code whose node is not the top
        except Exception as err:
            on_error(err)

    E = mon.events
    return {
        E.PY_START: on_start,
        E.PY_RESUME: on_start,
        E.PY_THROW: on_throw,
        E.PY_RETURN: on_return,
        E.PY_YIELD: on_yield,
        E.PY_UNWIND: on_unwind,
    }


class MonitoringBackend:
    """Tracking through ``sys.monitoring`` (CPython 3.12+)."""

    name = "monitoring"
    tracking = True

    @staticmethod
    def unavailable() -> Optional[str]:
        if _env.NO_SYSMON_REASON:
            return _env.NO_SYSMON_REASON
        free = [t for t in TOOL_ORDER if sys.monitoring.get_tool(t) is None]
        if not free:
            return "every sys.monitoring tool id is in use: " + _holders_text()
        return None

    def __init__(self, policy: Policy, host: Host, accelerator: Optional[bool] = None) -> None:
        self.policy = policy
        self.host = host
        self.on_error = host.on_error
        self.tool: Optional[int] = None
        self.capture = _stack.make_capture(policy)
        #: None: native callbacks where they can run (unless MONSTACK_ACCELERATOR=0);
        #: True: require them; False: the pure-Python callbacks.
        self.accelerator = accelerator
        self.native = False
        self.accel_reason = "not started"
        #: Native whole-snapshot fast path (``_accel.snapshot_new``), or None.
        self.snapshot_native: Optional[Callable[[], Any]] = None
        #: ``monstack.snapshotter()``'s native function (``_accel.capture_function``), or None.
        self.capture_native: Optional[Callable[[], Any]] = None
        #: The native callbacks' blob while they run (the origin carrier comes from it).
        self.native_blob: Any = None
        self._native_cb: Any = None

    def _choose_callbacks(self) -> bool:
        """Native callbacks or not, recording why (for ``info``)."""
        if self.accelerator is False:
            self.accel_reason = "turned off (accelerator=False)"
            return False
        if self.accelerator is None and env_accelerator_off():
            self.accel_reason = "turned off (MONSTACK_ACCELERATOR=0)"
            return False
        why: Optional[str]
        try:
            from . import _accel  # imports _ctypes: only when it may be used
        except ImportError as exc:  # 3.12: _ctypes refuses subinterpreters with their own GIL
            why = f"ctypes cannot be imported here ({exc})"
        else:
            why = _accel.unavailable()
        if why:
            if self.accelerator:
                raise RuntimeError(f"accelerator=True but the native callbacks cannot run here: {why}")
            self.accel_reason = why
            return False
        self.accel_reason = "native"
        return True

    def start(self) -> None:
        mon = sys.monitoring
        native = self._choose_callbacks()
        for tool in TOOL_ORDER:
            try:
                mon.use_tool_id(tool, TOOL_NAME)
            except ValueError:
                continue
            self.tool = tool
            break
        else:
            raise ToolIdsBusy(
                "monstack cannot install: every sys.monitoring tool id is in use ("
                + _holders_text() + "); uninstall one of those tools or use backend='walk'"
            )
        _stack.reset_tls()
        # Events this tool id had DISABLEd under an earlier owner or an earlier policy
        # stay disabled across free_tool_id/use_tool_id: a code object filtered before
        # would then never be pushed. restart_events() re-enables them (for every tool:
        # others see each disabled location fire once more and disable it again).
        mon.restart_events()
        if native:
            from . import _accel

            callbacks = _accel.callbacks(self.policy, _stack.TLS, self.on_error, _callbacks)
            cb = callbacks[mon.events.PY_START]
            self.snapshot_native = _accel.snapshot_new(cb, self.host.snapshot)
            if self.snapshot_native is not None:
                self.capture_native = _accel.capture_function(cb)
                self._native_cb = cb
            self.native_blob = _accel.loaded_blob()
        else:
            callbacks = _callbacks(self.policy, _stack.TLS, self.on_error)
        self.native = native
        events = 0
        for event, callback in callbacks.items():
            mon.register_callback(self.tool, event, callback)
            events |= event
        mon.set_events(self.tool, events)
        _stack.watch_collections(True)
        EXITS_REPORTED[0] = True

    def retire_fast(self) -> None:
        """The native snapshot paths stop answering (uninstall, or a shadow stack that can
        no longer be trusted); handed-out ``snapshotter()`` functions fall back to
        ``monstack.snapshot``."""
        cb, self._native_cb = self._native_cb, None
        self.snapshot_native = None
        self.capture_native = None
        if cb is not None:
            from . import _accel

            _accel.retire(cb)

    def stop(self) -> None:
        tool = self.tool
        if tool is None:
            return
        mon = sys.monitoring
        self.tool = None
        EXITS_REPORTED[0] = False
        self.retire_fast()
        _stack.watch_collections(False)
        if mon.get_tool(tool) != TOOL_NAME:
            return  # somebody freed it under us; nothing of ours is left there
        mon.set_events(tool, 0)
        for event in (
            mon.events.PY_START, mon.events.PY_RESUME, mon.events.PY_THROW,
            mon.events.PY_RETURN, mon.events.PY_YIELD, mon.events.PY_UNWIND,
        ):
            mon.register_callback(tool, event, None)
        mon.free_tool_id(tool)
        _stack.reset_tls()

    def describe(self) -> dict[str, str]:
        out = {
            "tool id": str(self.tool) if self.tool is not None else "-",
            "accelerator": "native" if self.native else f"none ({self.accel_reason})",
        }
        if self.native:
            from . import _accel, _native

            why = _accel.direct_calls_refused
            out["native calls"] = "direct (vectorcall)" if not why else f"through cfunction_vectorcall ({why})"
            out["native checks"] = _native.checked.get(_accel.blob_name(), "-")
        return out


def _holders_text() -> str:
    return ", ".join(f"id {t}: {n!r}" for t, n in sorted(tool_holders().items())) or "none"
