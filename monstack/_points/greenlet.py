"""Greenlets (gevent, eventlet, greenlet itself): one shadow stack per greenlet.

A greenlet switch swaps the thread's whole Python frame chain for another greenlet's
without any ``sys.monitoring`` event or eval_frame call: the frames left behind get no
PY_YIELD, the frames resumed no PY_RESUME. The thread's one shadow stack would then
describe the greenlet that ran last, and a snapshot whose frame runs the same code as
that stack's top (two greenlets running the same function at different depths, the
common gevent case) would answer from the wrong greenlet's stack.

So while monstack is installed, a greenlet trace function (``greenlet.settrace``, called
by greenlet right after every switch, in the greenlet switched to, with
``tstate->tracing`` raised) gives each greenlet its own cell: the cell of the greenlet
switched away from is put aside (keyed by the greenlet's id, while it is started and
not finished: nothing keeps a greenlet alive), and the one of the greenlet switched to is put in its place; a greenlet
that has none yet (new, or running since before install) starts unseeded and is seeded
from its own real frames at its next event or snapshot, as a thread is. A trace function
set before monstack's keeps being called.

``greenlet.settrace`` is per thread: the trace function is set on the thread that
installs monstack (or that imports greenlet after install), where gevent's hub runs in
nearly every program. Greenlets switching in other threads are not followed (see
docs/known-gaps.md).
"""

from __future__ import annotations

import sys

from .. import _stack

TYPE_CHECKING = False  # (no typing import at start-up)
if TYPE_CHECKING:
    from typing import Any, Optional

#: The trace function in place (ours), the one it replaced, the thread it was set on.
#: ``_live``: the trace function that swaps cells (one left on another thread's greenlet
#: state after stop() only calls through).
_live: list = []
_tracer: Any = None
_previous: Any = None
_thread_id: Optional[int] = None


def start() -> None:
    """Set the trace function on this thread if greenlet is imported (and ours is not
    set already)."""
    global _tracer, _previous, _thread_id
    greenlet = sys.modules.get("greenlet")
    settrace = getattr(greenlet, "settrace", None)
    if settrace is None or _tracer is not None:
        return
    import _thread

    # id(greenlet) -> its cell while it is switched out. An entry exists only for a
    # greenlet that started and has not finished; its last switch out (as it finishes,
    # or is killed when collected) removes it, so no entry outlives its greenlet and no
    # greenlet is kept alive (a weak mapping cost ~5 us per switch). The thread's TLS
    # dict is kept with its TLS: the trace function runs on this thread only.
    saved: dict = {}
    tls_now = [_stack.TLS, _stack.TLS.__dict__]
    on = [True]
    pop = saved.pop
    stack = _stack

    def tracer(event: str, args: Any) -> None:
        if on[0] and (event == "switch" or event == "throw"):
            try:
                origin, target = args
                if stack.TLS is not tls_now[0]:  # installed again since: the cells aside are stale
                    tls_now[0] = stack.TLS
                    tls_now[1] = stack.TLS.__dict__
                    saved.clear()
                d = tls_now[1]
                cell = d.pop("cell", None)
                if cell is not None and not origin.dead:
                    saved[id(origin)] = cell
                else:
                    pop(id(origin), None)
                mine = pop(id(target), None)
                if mine is not None:
                    d["cell"] = mine
                # else: unseeded; its next event or snapshot seeds it from its own frames
            except Exception:  # never break a switch
                pass
        if previous is not None:
            previous(event, args)

    previous = settrace(tracer)
    _live.append(on)
    _tracer, _previous, _thread_id = tracer, previous, _thread.get_ident()


def stop() -> None:
    """Put the replaced trace function back (on the thread it was set on, if ours is
    still the one there)."""
    global _tracer, _previous, _thread_id
    tracer, previous, _tracer, _previous, _thread_id = _tracer, _previous, None, None, None
    for on in _live:
        on[0] = False
    _live.clear()
    greenlet = sys.modules.get("greenlet")
    if tracer is None or greenlet is None:
        return
    try:
        if greenlet.gettrace() is tracer:
            greenlet.settrace(previous)
    except Exception:
        pass
