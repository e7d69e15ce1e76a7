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
start-up loads none: the parts whose triggers are always imported (``_thread``, ``sys``) are
named ``"function"`` (no family), functions of this module (:func:`apply_start_new_thread`,
:func:`apply_excepthook`) whose replacements load their family's code on first use.
"""

from __future__ import annotations

import _thread
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
    "start_new_thread": (("_thread", "apply_start_new_thread"),),  # (a function of this module)
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
    ("sys", "apply_excepthook"),  # (a function of this module: no family loads at install())
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


# -- applied at install() without loading a family -------------------------------------------------

_ORIGIN_MODULE = __name__.rsplit(".", 1)[0] + "._origin"


def family(name: str) -> Any:
    """The family ``monstack._points.<name>``, imported now if it is not yet: by name, as the
    registry names the families (this module sits below them and imports none itself)."""
    module_name = f"{__name__}.{name}"
    module = sys.modules.get(module_name)
    if module is None:
        __import__(module_name)
        module = sys.modules[module_name]
    return module


def drop_own_entry(exc: BaseException, frame: Any) -> None:
    """``monstack._origin.drop_own_entry`` (the same code, for replacements that run before
    ``_origin`` is loaded): take ``frame``'s entry off the head of ``exc``'s traceback."""
    try:
        tb = exc.__traceback__
        if tb is not None and tb.tb_frame is frame:
            exc.__traceback__ = tb.tb_next
    except Exception:
        pass


def apply_start_new_thread() -> None:
    """The ``start_new_thread`` point, applied at ``install()`` (``_thread`` is always
    imported; ``threading`` binds it when imported on 3.11/3.12) without loading its
    family: the replacement calls the one ``threading.start_new_thread_for`` makes, loaded
    with the first thread started while the point is on. Where that import fails (a thread
    started at interpreter shutdown) the thread meets CPython's own error, without an
    origin."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        made: list = []

        def start_new_thread(function: Any, args: Any, *kwargs: Any) -> Any:
            try:
                if "start_new_thread" not in ON:
                    return original(function, args, *kwargs)
                if not made:
                    try:
                        made[:] = [family("threading").start_new_thread_for(original)]
                    except Exception:
                        pass
                    if not made:  # (called outside the handler: no context on its error)
                        return original(function, args, *kwargs)
                return made[0](function, args, *kwargs)
            except BaseException as exc:  # (the traceback a direct call gives)
                drop_own_entry(exc, sys._getframe())
                raise

        return start_new_thread

    patch(_thread, "start_new_thread", make)
    if "start_new" in _thread.__dict__:  # the obsolete synonym (its own builtin)
        patch(_thread, "start_new", make)


def apply_excepthook() -> None:
    """``sys.excepthook``'s part of :data:`REPORTS`. Until ``monstack._origin`` is loaded no
    exception has an origin, so the replacement calls what it replaced; from then on it is
    ``reports.excepthook`` (loaded with the first uncaught exception: a report at
    interpreter exit still runs before the interpreter is torn down; if that import fails,
    the hook it replaced reports the exception as it would without monstack)."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def excepthook(exc_type: Any, exc_value: Any, exc_tb: Any) -> Any:
            if REPORTS in ON and _ORIGIN_MODULE in sys.modules:
                try:
                    report = family("reports").excepthook
                except Exception:
                    report = None
                if report is not None:
                    return report(original, exc_type, exc_value, exc_tb)
            return original(exc_type, exc_value, exc_tb)

        return excepthook

    patch(sys, "excepthook", make)
