"""The propagation points: one contract, the registry, and the state the points share.

The families (one module each: ``threading``, ``futures``, ``asyncio``,
``multiprocessing``, ``trio``, ``celery``, ``dask``, ``rq``, ``ray``, ``greenlet``) hold the points' code;
``monstack._propagate`` (the switch, above) turns them on and off. This module sits below
both: each family imports what it shares from here, never the switch.

**The contract.** :data:`REGISTRY` names, for each point of ``install(propagate=...)``,
its parts: ``(trigger module, "family.function")``. When the trigger module is imported
(or at ``install()`` if it already is), the switch imports ``monstack._points.<family>``
and calls ``<function>()`` with no arguments. That function:

- patches through :func:`patch` (so ``uninstall()`` puts the identical originals back),
  with replacements that check ``point in ON`` on every call and otherwise call straight
  through (a patch somebody laid over ours keeps working after ``uninstall()``);
- calls what it replaced as Python would (:func:`binder`: through the descriptor
  protocol), so other patchers' wrappers (wrapt's, ``functools.wraps``-style) see the
  instance they expect (a plain function is called as before, at no cost);
- binds everything its replacements need when it runs: nothing is imported on a hop's
  path (at interpreter shutdown an import fails where CPython's own error is due);
- takes the creating side's snapshot with :func:`take` (None where that fails: the work
  then runs without an origin, never with an error);
- raises :class:`CannotEnable` where the installed library is not one it knows (a version
  older than :data:`MIN_VERSIONS`, internals that moved): the program runs on, that
  point's work gets no origin, and the user is told once.

A family may define ``stop()``: called (if the family is loaded) when propagation stops,
after the patches are undone. Families are imported only when a trigger is: MONSTACK=1
start-up loads only the ``threading`` family (``_thread`` is always imported).
"""

from __future__ import annotations

import sys

from .. import _capture

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional

    from .._snapshot import Snapshot


class CannotEnable(RuntimeError):
    """A point cannot be enabled here: the library's version or internals are not the
    ones its patch knows. The switch reports it and the program runs on without it."""


#: Third-party minimum versions (major, minor) of the engines a point patches.
MIN_VERSIONS: dict[str, tuple[int, int]] = {
    "celery": (5, 3),  # a retry keeps the task's custom headers (celery#7523)
    "rq": (2, 0),
    "ray": (2, 40),  # accepted where its internals are the ones the patch knows (recognise)
    "sentry": (2, 0),  # sentry-sdk: the scope API and global event processors of 2.x
}

#: Each point: its parts, ``(module whose import makes it patchable, "family.function")``.
REGISTRY: dict[str, tuple[tuple[str, str], ...]] = {
    "threading": (("threading", "threading.apply_thread_start"),),
    "start_new_thread": (("_thread", "threading.apply_start_new_thread"),),
    "thread_pool": (("concurrent.futures.thread", "futures.apply_thread_pool"),),
    "process_pool": (("concurrent.futures.process", "futures.apply_process_pool"),),
    "asyncio_tasks": (("asyncio", "asyncio.apply_tasks"), ("uvloop", "asyncio.apply_uvloop_tasks")),
    "asyncio_executor": (("asyncio", "asyncio.apply_executor"), ("uvloop", "asyncio.apply_uvloop_executor")),
    "process": (("multiprocessing.process", "multiprocessing.apply_process"),),
    "mp_pool": (("multiprocessing.pool", "multiprocessing.apply_pool"),),
    "trio": (("trio", "trio.apply"),),
    "celery": (("celery.signals", "celery.apply_signals"), ("celery.app.trace", "celery.apply_trace"),
               ("celery.result", "celery.apply_result")),
    "dask": (("distributed.client", "dask.apply"),),
    "rq": (("rq.job", "rq.apply"), ("rq.worker", "rq.apply_worker")),
    "ray": (("ray", "ray.apply"),),
    # not a hop: events of work that has an origin carry it (a global event processor)
    "sentry": (("sentry_sdk", "sentry.apply"),),
}

#: Not a point of its own: while installed, each greenlet gets its own shadow stack
#: (``greenlet.start``; in :data:`ON` while installed).
GREENLETS = "(greenlet switches)"
GREENLET_PARTS: tuple[tuple[str, str], ...] = (("greenlet", "greenlet.start"),)

#: Not a point either: while installed, the hooks that report uncaught failures show
#: their origins (``reports``; in :data:`ON` while installed).
REPORTS = "(reports)"
REPORT_PARTS: tuple[tuple[str, str], ...] = (
    ("sys", "reports.apply_excepthook"),
    ("threading", "reports.apply_threading_excepthook"),
    ("asyncio", "reports.apply_asyncio"),
)

#: Points switched on now (read by the replacements on every call).
ON: set = set()
#: Applied patches: (owner, attribute name, original object, replacement).
PATCHES: list[tuple[Any, str, Any, Any]] = []
#: (owner, attribute) patched on a class that only inherited it (uvloop.Loop).
INHERITED: set = set()

capture_snapshot = _capture.snapshot


def take() -> Optional[Snapshot]:
    """A snapshot for new work, or None if that fails (never break the host program)."""
    try:
        return capture_snapshot()
    except Exception:
        return None


def patch(owner: Any, attr: str, make: Callable[[Any], Any], inherited: bool = False) -> None:
    """Set ``owner.attr`` to ``make(original)``; recorded for :func:`undo`."""
    if inherited and attr not in owner.__dict__:
        original = getattr(owner, attr)
        INHERITED.add((owner, attr))
    else:
        original = owner.__dict__[attr]
    replacement = make(original)
    try:
        update_wrapper(replacement, original)
    except Exception:
        pass
    setattr(owner, attr, replacement)
    PATCHES.append((owner, attr, original, replacement))
    CODES[id(replacement)] = getattr(replacement, "__code__", None)


#: id(replacement) -> its code when made: a tool that wraps a function in place (ddtrace
#: rewrites ``__code__``) has laid its patch over ours without replacing the attribute.
CODES: dict[int, Any] = {}


def undo() -> None:
    """Put the identical originals back wherever our replacement is still in place (a
    patch laid over ours stays: ours then only calls through; so does ours when another
    tool rewrote its code in place)."""
    while PATCHES:
        owner, attr, original, replacement = PATCHES.pop()
        try:
            if owner.__dict__.get(attr) is replacement and getattr(replacement, "__code__", None) is CODES.get(
                    id(replacement), getattr(replacement, "__code__", None)):
                if (owner, attr) in INHERITED:
                    delattr(owner, attr)  # it was the base class's: show that one again
                else:
                    setattr(owner, attr, original)
        except Exception:
            pass
    INHERITED.clear()
    CODES.clear()


def binder(original: Any) -> Callable[..., Any]:
    """``call(instance, *args, **kwargs)``: what ``instance.attr(*args, **kwargs)`` does when
    the class attribute is ``original``, so a replacement calls what it replaced as Python
    would (through ``__get__``): a wrapt ``FunctionWrapper`` sees its instance, an object
    with no ``__get__`` is called as it is. For a plain function or a C method descriptor
    that is ``original(instance, ...)``: ``original`` itself, at no cost per call."""
    kind = type(original)
    if kind is _FUNCTION or kind is _METHOD_DESCRIPTOR or kind is _WRAPPER_DESCRIPTOR:
        return original  # type: ignore[no-any-return]
    get = getattr(kind, "__get__", None)
    if get is None:
        return lambda _instance, *args, **kwargs: original(*args, **kwargs)

    def call(instance: Any, *args: Any, **kwargs: Any) -> Any:
        return get(original, instance, type(instance))(*args, **kwargs)

    return call


_FUNCTION = type(binder)
_METHOD_DESCRIPTOR = type(str.join)
_WRAPPER_DESCRIPTOR = type(object.__init__)


def update_wrapper(wrapper: Any, wrapped: Any) -> None:
    """``functools.update_wrapper``; without importing functools before the program does
    (``_thread``'s patch, at start-up, is on builtins: there it copies the same)."""
    functools = sys.modules.get("functools")
    if functools is not None:
        functools.update_wrapper(wrapper, wrapped)
        return
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        try:
            setattr(wrapper, attr, getattr(wrapped, attr))
        except AttributeError:
            pass
    wrapper.__dict__.update(getattr(wrapped, "__dict__", {}))
    wrapper.__wrapped__ = wrapped


def check_version(package: str) -> None:
    """Raise :class:`CannotEnable` if the imported ``package`` is older than its minimum."""
    minimum = MIN_VERSIONS[package]
    text = str(getattr(sys.modules.get(package), "__version__", "") or "")
    try:
        version = tuple(int(p) for p in text.split(".")[:2])
    except ValueError:
        version = ()
    if len(version) < 2 or version < minimum:
        oldest = ".".join(map(str, minimum))
        raise CannotEnable(f"{package} {text or '(unknown version)'} is not supported "
                           f"(needs {package} >= {oldest})")
