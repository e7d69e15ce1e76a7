"""Sentry: every event for work that has an origin carries it, in either order of
``sentry_sdk.init()`` and ``monstack.install()``.

Not a hop of its own: the point ``sentry`` registers a global event processor
(``sentry_sdk.scope.add_global_event_processor``) when ``sentry_sdk`` is imported while
monstack is on, and takes it off when propagation stops. For each event the processor takes
the origin of the event's exception (``monstack.origin_of``, its cause and context too) or,
for an event captured inside propagated work (Sentry's threading and asyncio integrations
capture there, and so do log events), the current origin. It adds:

- one ``threads`` entry per hop of the origin chain, each with a stacktrace of Sentry's
  frames (a context alone renders no frames): ``monstack: work created at`` first, then
  ``monstack: which ran in work created at``...; ``in_app``, ``include_source_context``
  and ``project_root`` follow the client's options, like Sentry's own frames;
- the tag ``monstack.created_at``: the innermost site, ``file.py:LINE``, to search by.

The exception's value keeps no monstack text (a note monstack attached is taken out of it)
and no exception is added: Sentry's grouping is unchanged. An event without an origin is
returned untouched. Never raises: an error leaves the event as it was.
"""

from __future__ import annotations

import os

from . import MIN_VERSIONS, ON, CannotEnable

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional

#: The tag an event gets: the innermost frame of where its work was created.
TAG = "monstack.created_at"
#: The names of the ``threads`` entries, newest hop first.
FIRST = "monstack: work created at"
NEXT = "monstack: which ran in work created at"
#: How many lines of source around each line, as Sentry's own frames have.
CONTEXT_LINES = 5

_registered: list = []


def apply(*, for_integration: bool = False) -> None:
    """Register the event processor (once per ``sentry_sdk`` module). ``for_integration``:
    for ``MonstackIntegration``, whose processor stays when monstack uninstalls."""
    try:  # (imported by the program already: this runs when it imports sentry_sdk)
        import sentry_sdk
        import sentry_sdk.scope as scope_module
    except ImportError as exc:
        raise CannotEnable(f"sentry_sdk cannot be imported ({exc})") from None

    version = tuple(int(p) for p in str(getattr(sentry_sdk, "VERSION", "0")).split(".")[:2] if p.isdigit())
    if version < MIN_VERSIONS["sentry"]:
        raise CannotEnable(f"sentry-sdk {getattr(sentry_sdk, 'VERSION', '?')} is older than "
                           f"{'.'.join(map(str, MIN_VERSIONS['sentry']))}")
    add = getattr(scope_module, "add_global_event_processor", None)
    processors = getattr(scope_module, "global_event_processors", None)
    if add is None or not isinstance(processors, list):
        raise CannotEnable("this sentry-sdk has no global event processors (add_global_event_processor)")
    if process not in processors:
        add(process)
        if not for_integration and scope_module not in _registered:
            _registered.append(scope_module)
    elif for_integration and scope_module in _registered:
        _registered.remove(scope_module)  # the integration's now: it stays after uninstall()


def stop() -> None:
    """Take the processor off again (uninstall)."""
    while _registered:
        scope_module = _registered.pop()
        processors = getattr(scope_module, "global_event_processors", None)
        try:
            while process in processors:  # type: ignore[operator]
                processors.remove(process)  # type: ignore[union-attr]
        except Exception:
            pass


def process(event: Any, hint: Any) -> Any:
    """The global event processor: ``event`` with the origin added, or as it was. It acts
    while the point ``sentry`` is on, or when the client has ``MonstackIntegration`` (whose
    options it then follows)."""
    try:
        options = _integration_options()
        if options is None:
            if "sentry" not in ON:
                return event
            options = {}
        _add_origin(event, hint, options)
    except Exception:
        pass
    return event


def _integration_options() -> Optional[dict]:
    """The options of the client's ``MonstackIntegration``, or None without one."""
    try:
        import sentry_sdk

        integration = sentry_sdk.get_client().get_integration("monstack")
    except Exception:
        return None
    if integration is None:
        return None
    return {"tag": getattr(integration, "tag", True), "stacktrace": getattr(integration, "stacktrace", True)}


def _origin_for(hint: Any) -> tuple[Optional[Any], Optional[BaseException]]:
    from .._origin import current_origin, origin_of

    exc = None
    exc_info = hint.get("exc_info") if isinstance(hint, dict) else None
    if isinstance(exc_info, tuple) and len(exc_info) == 3 and isinstance(exc_info[1], BaseException):
        exc = exc_info[1]
        seen = set()
        link: Optional[BaseException] = exc
        while link is not None and id(link) not in seen:
            seen.add(id(link))
            found = origin_of(link)
            if found is not None and len(found):
                return found, exc
            link = link.__cause__ or link.__context__
    current = current_origin()
    return (current if current is not None and len(current) else None), exc


def _add_origin(event: Any, hint: Any, wanted: dict) -> None:
    if not isinstance(event, dict):
        return
    threads = event.get("threads")
    if isinstance(threads, dict) and any(
        isinstance(v, dict) and str(v.get("id", "")).startswith("monstack-origin-") for v in threads.get("values") or ()
    ):
        return  # done already (the processor registered twice: two sentry_sdk modules)
    origin, exc = _origin_for(hint)
    if exc is not None:
        _strip_notes(event, exc)
    if origin is None:
        return
    options = _client_options()
    older, _dropped = origin.chain()  # the origins of the work that created it, newest first
    hops = [origin, *older]
    entries: list[dict[str, Any]] = []
    for i, hop in enumerate(hops):
        frames = _frames(hop, options)
        if not frames:
            continue
        entries.append({
            "id": f"monstack-origin-{i}",
            "name": FIRST if i == 0 else NEXT,
            "crashed": False,
            "current": False,
            "stacktrace": {"frames": frames},
        })
    if not entries:
        return
    if wanted.get("stacktrace", True):
        _add_threads(event, entries)
    if wanted.get("tag", True):
        innermost = entries[0]["stacktrace"]["frames"][-1]
        tags = event.get("tags")
        if not isinstance(tags, dict):
            tags = event["tags"] = {}
        where = os.path.basename(innermost.get("abs_path") or innermost.get("filename") or "?")
        tags[TAG] = f"{where}:{innermost.get('lineno')}"


def _add_threads(event: dict, entries: list) -> None:
    threads = event.get("threads")
    if not isinstance(threads, dict) or not isinstance(threads.get("values"), list):
        threads = event["threads"] = {"values": []}
    threads["values"].extend(entries)


def _client_options() -> dict:
    try:
        import sentry_sdk

        options = sentry_sdk.get_client().options
        return options if isinstance(options, dict) else {}
    except Exception:
        return {}


def _frames(snap: Any, options: dict) -> list[dict]:
    """Sentry's frames (outermost first) for the snapshot's own frames."""
    import linecache

    source_context = options.get("include_source_context", True)
    frames = []
    for summary in snap.frames:
        filename = summary.filename
        lineno = summary.lineno
        frame: dict = {
            "filename": _short_path(filename),
            "abs_path": filename,
            "function": summary.name,
            "lineno": lineno,
        }
        module = _module_of(filename)
        if module:
            frame["module"] = module
        if source_context:
            line = summary.line
            if line:
                frame["context_line"] = line
            if isinstance(lineno, int) and lineno > 0 and not filename.startswith("<"):
                lines = linecache.getlines(filename)
                if lines:
                    frame["pre_context"] = [x.rstrip("\n") for x in lines[max(0, lineno - 1 - CONTEXT_LINES):lineno - 1]]
                    frame["context_line"] = lines[lineno - 1].rstrip("\n") if lineno <= len(lines) else line
                    frame["post_context"] = [x.rstrip("\n") for x in lines[lineno:lineno + CONTEXT_LINES]]
        frames.append(frame)
    try:
        from sentry_sdk.utils import set_in_app_in_frames

        set_in_app_in_frames(frames, options.get("in_app_exclude"), options.get("in_app_include"),
                             options.get("project_root"))
    except Exception:
        pass
    return frames


def _short_path(filename: str) -> str:
    """What Sentry shows as a frame's file: the path below the import root it was found on."""
    import sys

    best = ""
    for entry in sys.path:
        if entry and filename.startswith(entry.rstrip(os.sep) + os.sep) and len(entry) > len(best):
            best = entry.rstrip(os.sep)
    return filename[len(best) + 1:] if best else filename


def _module_of(filename: str) -> Optional[str]:
    short = _short_path(filename)
    if short == filename or not short.endswith(".py"):
        return None
    parts = short[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or None


def _strip_notes(event: Any, exc: BaseException) -> None:
    """Take monstack's notes out of the exception values: Sentry appends ``__notes__`` to
    the value, which is the text an issue is searched and shown by."""
    try:
        from .._origin import NOTE_HEADING
    except ImportError:  # no notes to take out
        return
    notes: list[str] = []
    seen = set()
    link: Optional[BaseException] = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        for note in getattr(link, "__notes__", None) or ():
            if isinstance(note, str) and note.startswith(NOTE_HEADING):
                notes.append(note)
        link = link.__cause__ or link.__context__
    if not notes:
        return
    values = (event.get("exception") or {}).get("values") if isinstance(event.get("exception"), dict) else None
    for value in values or ():
        text = value.get("value") if isinstance(value, dict) else None
        if isinstance(text, str):
            for note in notes:
                text = text.replace("\n" + note, "")
            value["value"] = text
