"""The oracle: the real interpreter stack, under monstack's own tracking policy."""

from __future__ import annotations

import sys

import monstack
from monstack._capture import current_policy


def real_records(frame=None) -> list[tuple[str, int, str]]:
    """(filename, lineno, name) of the tracked real frames, outermost first."""
    policy = current_policy()
    f = frame if frame is not None else sys._getframe(1)
    out = []
    while f is not None:
        if policy.is_tracked(f.f_code, f.f_globals.get("__name__")):
            out.append((f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    out.reverse()
    return out


def shadow_records(snap) -> list[tuple[str, int, str]]:
    return [tuple(r[:3]) for r in snap.records()]


class Mismatch(AssertionError):
    pass


def check(where: str = "") -> int:
    """Assert the snapshot taken here equals the real stack; return its depth."""
    snap, real = monstack.snapshot(), real_records(sys._getframe())
    got = shadow_records(snap)
    if got != real:
        raise Mismatch(f"shadow stack != real stack {where}\nshadow: {_fmt(got)}\nreal:   {_fmt(real)}")
    return len(got)


def _fmt(recs) -> str:
    return " > ".join(f"{name}:{line}" for _f, line, name in recs)


def marker_lines(path: str):
    """``line_of(marker)`` for the file at ``path``: the line number of the one line
    ending in ``# @marker`` (tests name creating lines this way, not by number)."""
    with open(path, encoding="utf-8") as fh:
        source = fh.read().splitlines()

    def line_of(marker: str) -> int:
        hits = [i + 1 for i, text in enumerate(source) if text.rstrip().endswith(f"# @{marker}")]
        assert len(hits) == 1, f"marker {marker!r} found {len(hits)} times"
        return hits[0]

    return line_of


#: A library module whose ``dispatch`` takes the snapshot for its user (``op`` -> ``dispatch``).
SNAPSHOTTING_LIBRARY = (
    "import monstack\n"
    "def op(n):\n"
    "    return dispatch(n)\n"
    "def dispatch(n):\n"
    "    return monstack.snapshot()\n"
)


def library_module(tmp_path, name: str, src: str = SNAPSHOTTING_LIBRARY) -> dict:
    """``src`` written to ``tmp_path/<name>.py`` and run as module ``name`` (its frames
    carry that file name, so ``install(exclude=[str(tmp_path)])`` filters it); returns
    its namespace."""
    lib = tmp_path / f"{name}.py"
    lib.write_text(src)
    ns: dict = {"__name__": name}
    exec(compile(src, str(lib), "exec"), ns)
    return ns


def captures_for_library_snapshots(op, backend, monkeypatch, rounds: int = 5) -> int:
    """Calls ``op`` (a library's entry that takes the snapshot, see SNAPSHOTTING_LIBRARY)
    from a user function ``rounds`` times; each snapshot must equal the real stack and end
    in ``user``. Returns how often ``backend.capture`` (the full Python capture) ran."""

    def user(i):
        return op(i), real_records()  # one line

    op(0)  # the library's file gets decided (filtered) on its first events
    user(0)
    calls = []
    real_capture = backend.capture
    monkeypatch.setattr(backend, "capture", lambda frame: calls.append(1) or real_capture(frame))
    for i in range(rounds):
        snap, real = user(i)
        assert shadow_records(snap) == real
        assert shadow_records(snap)[-1][2] == "user"
    return len(calls)


def snapshots_at_one_site(cap, origins) -> tuple[list, list]:
    """``cap()`` at one call site under each of ``origins`` in turn (the current origin set
    around it), then ``monstack.snapshot()`` at two other lines: ``(those, the two)``."""
    from monstack._snapshot import CURRENT_ORIGIN

    out = []
    for origin in origins:
        token = CURRENT_ORIGIN.set(origin)
        try:
            out.append(cap())
        finally:
            CURRENT_ORIGIN.reset(token)
    return out, [monstack.snapshot(), monstack.snapshot()]


def assert_one_site_one_snapshot(cap) -> None:
    """The native snapshot hands out the object it built last while the same one would be
    built: one call site under one origin gives one object, anything else another."""
    first = cap()
    (a, b, c, d, e), (x, y) = snapshots_at_one_site(cap, [None, None, first, first, None])
    assert a is b and c is d and a is not e and c is not a
    assert c.origin is first and a.origin is None and e.origin is None
    assert tuple.__getitem__(a, slice(None)) == tuple.__getitem__(e, slice(None))  # (e: equal, made anew)
    assert x is not y and x.records()[-1][1] != a.records()[-1][1]  # (x, y: two calls, one line)
