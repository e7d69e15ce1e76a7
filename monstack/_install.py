"""``install()`` / ``uninstall()``: start and stop keeping stacks, propagation included.

One lock serialises install and uninstall; the hot paths (callbacks, ``snapshot``) read
``_capture``'s module globals without it. The top of the install layer: it drives a
backend (chosen by ``_select``), hands it a :class:`~monstack._backend.Host` to call back
into, and starts the propagation points.
"""

from __future__ import annotations

import _thread

from . import _capture, _propagate, _select
from ._backend import Host
from ._errors import warn
from ._policy import make_policy

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional, Sequence

    from ._capture import State

_lock = _thread.RLock()
_failure_reported = False
#: What :func:`add_hooks` registered: run after a backend starts / before it stops.
_start_hooks: list = []
_stop_hooks: list = []


def add_hooks(start: Callable[[State], None], stop: Callable[[State], None]) -> None:
    """Have every ``install()`` call ``start(state)`` once its backend and the propagation
    points run, and every ``uninstall()`` call ``stop(state)`` before it undoes them (stop
    hooks in the reverse order; one that raises is reported and the others still run; a
    start hook that raises undoes the install). Registering the same pair again does nothing.

    Who registers: the package's ``__init__``, for the dump signal (``MONSTACK_DUMP_SIGNAL``:
    ``_dumpsig`` sits in a layer above this one, so this module cannot call it, and it loads
    only when the variable is set). Nothing else does: the propagation points are started
    and stopped by ``install()``/``uninstall()`` themselves.
    """
    with _lock:
        if start not in _start_hooks:
            _start_hooks.append(start)
        if stop not in _stop_hooks:
            _stop_hooks.append(stop)


def install(
    *,
    backend: Optional[str] = None,
    track: str = "user",
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    propagate: Any = True,
    chain_limit: int = 8,
    accelerator: Optional[bool] = None,
    notes: bool = False,
) -> str:
    """Start keeping per-thread shadow stacks. Returns the name of the backend in use.

    ``backend``: ``"auto"`` (default, or ``MONSTACK_BACKEND``), ``"monitoring"``,
    ``"evalframe"`` or ``"walk"``. ``track``: ``"user"`` (default: not the standard
    library, site-packages or monstack) or ``"all"``. ``include``/``exclude``: module
    names or path prefixes; the longest matching rule wins.

    Idempotent: calling it again with the same options does nothing; with other options
    it reinstalls. Thread-safe.

    ``propagate``: True (default: every propagation point), False, or an iterable of
    the names in ``monstack.PROPAGATION_POINTS``. ``chain_limit``: how many origin hops
    a snapshot keeps (default 8). ``accelerator`` (``monitoring`` backend): None (default)
    uses the native callbacks where they can run unless ``MONSTACK_ACCELERATOR=0``; False
    uses the pure-Python ones; True requires the native ones (RuntimeError otherwise;
    ValueError with ``backend="walk"``, which runs none).

    ``notes``: also add each origin to its exception as a PEP 678 note where the work
    fails (default False: exceptions look as they would without monstack, and origins
    show where failures are reported: the excepthooks, asyncio's handler, pytest's report,
    ``monstack.logging``). For logs that print exceptions themselves; never under pytest,
    whose ``raises(match=)`` matches the notes too.
    """
    if accelerator is not None and not isinstance(accelerator, bool):
        raise ValueError(f"accelerator must be None, True or False, got {accelerator!r}")
    if not isinstance(notes, bool):
        raise ValueError(f"notes must be True or False, got {notes!r}")
    global _failure_reported
    options: dict[str, Any] = {
        "backend": backend,
        "track": track,
        "include": tuple(include) if not isinstance(include, str) else (include,),
        "exclude": tuple(exclude) if not isinstance(exclude, str) else (exclude,),
        "propagate": _propagate.check_points(propagate),
        "chain_limit": _propagate.check_chain_limit(chain_limit),
        "accelerator": accelerator,
        "notes": notes,
    }
    choice = _select.check_choice(backend)  # ValueError before touching anything
    if accelerator is True and choice == "walk":
        where = f"backend={backend!r}" if backend is not None else f"MONSTACK_BACKEND={choice!r}"
        raise ValueError(
            f"accelerator=True conflicts with {where}: the walk backend runs no native code "
            "(leave accelerator out, or choose the 'monitoring' backend)"
        )
    policy = make_policy(track, options["include"], options["exclude"])
    with _lock:
        running = _capture.running()
        if running is not None:
            if running.options == options:
                return running.backend.name
            _uninstall_locked()
        cls, reason = _select.choose(backend)
        if accelerator is True and cls.name == "walk":  # auto found nothing native to run
            raise RuntimeError(f"accelerator=True but no backend with native code can run here ({reason})")
        _failure_reported = False  # each installation reports its own failure, once
        instance = cls(policy, _HOST, accelerator=accelerator)
        instance.start()
        state = _capture.State(instance, policy, reason, options, _on_internal_error)
        _capture.set_state(state)
        try:
            _propagate.start(options)
            for hook in list(_start_hooks):
                hook(state)
        except BaseException:
            _uninstall_locked()
            raise
        return instance.name


def uninstall() -> None:
    """Stop tracking and undo everything ``install()`` changed. Idempotent, thread-safe."""
    with _lock:
        _uninstall_locked()


def status() -> dict[str, Any]:
    """What ``python -m monstack info`` prints, as typed values: ``backend`` (a name, or
    None when not installed), ``reason`` and ``policy`` (text), the backend's details
    (``tool id``: int or None; ``accelerator``: ``"native"`` or ``"none (<why>)"``;
    ``shim counters``: name -> int; ``C stack reserve``: bytes; descriptions as text),
    ``propagation`` (the points on, a list), ``waiting for import`` (the modules whose
    first import will patch a point, a list; absent when none), ``propagation failed``
    (point -> why; absent when none)."""
    out: dict[str, Any] = _capture.status()
    running = _capture.running()
    if out.get("backend") is None or running is None:
        return {"backend": None}
    backend = running.backend
    if "tool id" in out:
        tool = getattr(backend, "tool", None)
        out["tool id"] = tool if isinstance(tool, int) else None
    if "shim counters" in out:
        counters: dict[str, int] = getattr(backend, "counters", dict)()
        out["shim counters"] = {(k[2:] if k.startswith("n_") else k): int(v) for k, v in counters.items()}
    if "C stack reserve" in out:
        from ._evalframe import STACK_MARGIN

        out["C stack reserve"] = STACK_MARGIN
    text = _propagate.describe()  # the same facts as text (points and modules: no ", " inside)
    on = text.get("propagation", "off")
    out["propagation"] = [] if on == "off" else on.split(", ")
    waiting = text.get("patched at import of")
    if waiting:
        out["waiting for import"] = waiting.split(", ")
    if _propagate.FAILED:
        out["propagation failed"] = dict(_propagate.FAILED)
    return out


def current_options() -> Optional[dict]:
    """The options of the running install (as ``install()`` normalised them), or None."""
    running = _capture.running()
    return dict(running.options) if running is not None else None


def _uninstall_locked() -> None:
    state = _capture.running()
    if state is None:
        return
    _capture.set_state(None)
    try:
        for hook in list(reversed(_stop_hooks)):
            try:
                hook(state)
            except Exception as exc:  # keep undoing the rest
                warn("monstack-uninstall-failed", f"an uninstall step failed: {exc!r}")
        try:
            _propagate.stop()
        except Exception as exc:
            warn("monstack-uninstall-failed", f"undoing propagation failed: {exc!r}")
    finally:
        state.backend.stop()


def _on_internal_error(exc: BaseException) -> None:
    """A callback failed: say so once, then turn tracking off cleanly.

    Except a ``RecursionError``: the thread is at its recursion limit, where any Python
    call fails, monstack's included; that is no fault of monstack's. The event it missed
    may have left this thread's shadow stack wrong, so the stack is forgotten (the next
    event or snapshot rebuilds it from the real frames) and tracking stays on."""
    if isinstance(exc, RecursionError):
        _capture.forget_thread_stack()
        return
    global _failure_reported
    try:  # off first: the warnings machinery runs Python code that would fail again
        uninstall()
    except Exception:
        pass
    if not _failure_reported:
        _failure_reported = True
        warn("monstack-internal-error", f"internal error in tracking ({type(exc).__name__}: {exc}); tracking turned off")


#: What every backend this module starts may call back into.
_HOST = Host(_on_internal_error, _capture.disable_fast_path, _capture.snapshot)
