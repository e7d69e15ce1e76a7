"""The explicit origin API: wrap, origin, attach, origin_of, format/print_exception, the
chain cap in snapshots, and the op-queue demo."""

from __future__ import annotations

import gc
import io
import operator
import pickle
import queue
import threading
import traceback
from typing import Any, Optional

import pytest

from conftest import chain_of

import stackcheck

import monstack
from monstack import _origin

from monstack import attach, current_origin, format_exception, origin, origin_of, print_exception, wrap

HEADING = "Work created at (most recent call last):"
THIS_FILE = __file__
line_of = stackcheck.marker_lines(__file__)


def innermost(snap: Optional[monstack.Snapshot]) -> tuple[str, int]:
    assert snap is not None, "no origin"
    rec = snap.records()[-1]
    return rec[0], rec[1]


#: ``here()``: a snapshot of the calling line (``monstack.snapshot`` itself is untracked).
here = monstack.snapshot


def our_notes(exc: BaseException) -> list[str]:
    return [n for n in getattr(exc, "__notes__", []) if isinstance(n, str) and n.startswith(HEADING)]


class Boom(Exception):
    pass


@pytest.fixture(params=["installed", "not installed"])
def mode(request):
    """The explicit API works with monstack installed and without (walk backend)."""
    monstack.uninstall()
    if request.param == "installed":
        monstack.install(propagate=False)  # explicit API only: no automatic help
    yield request.param
    monstack.uninstall()


def test_public_exports():
    """monstack/__init__.py must export the API (wired by the package owner)."""
    for name in ("wrap", "origin", "attach", "origin_of", "current_origin", "format_exception",
                 "print_exception", "PROPAGATION_POINTS"):
        assert name in monstack.__all__, name
        assert hasattr(monstack, name), name
    assert monstack.wrap is _origin.wrap


# -- wrap ---------------------------------------------------------------------------------------------


def test_wrap_runs_later_on_another_thread_with_origin(mode):
    seen = {}

    def work(x):
        seen["origin"] = current_origin()
        seen["snap"] = monstack.snapshot()
        if x:
            raise Boom("in the worker")
        return "ok"

    ok = wrap(work)  # @wrap-ok
    bad = wrap(work)  # @wrap-bad
    errors: list = []

    def worker():
        assert ok(0) == "ok"
        assert current_origin() is None  # restored after the call
        try:
            bad(1)
        except Boom as exc:
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert innermost(seen["snap"].origin) == (THIS_FILE, line_of("wrap-bad"))
    (exc,) = errors
    assert innermost(origin_of(exc)) == (THIS_FILE, line_of("wrap-bad"))
    # The caught exception looks as it would without monstack; its report shows the origin.
    assert str(exc) == "in the worker" and exc.args == ("in the worker",)
    assert not hasattr(exc, "__notes__")
    assert f'line {line_of("wrap-bad")}, in test_wrap_runs_later' in format_exception(exc, color=False)


def test_wrap_rejects_non_callables():
    with pytest.raises(TypeError, match="callable"):
        wrap(42)  # type: ignore[arg-type]


def test_wrap_keeps_the_name_and_pickles():
    def named():
        pass

    w = wrap(named)
    assert w.__name__ == "named" and w.__wrapped__ is named
    assert "named" in repr(w)
    assert threading.Thread(target=w).name.endswith("(named)")
    original = wrap(operator.add)
    p = pickle.loads(pickle.dumps(original))
    assert p(2, 3) == 5
    assert p._snap.records() == original._snap.records()


def test_wrapped_origin_is_pickled_once_and_unpickled_once(monkeypatch):
    """A pool's map pickles one wrapper per task: its snapshot is pickled once (bytes),
    and the receiving side unpickles each distinct one once (bounded cache)."""
    from monstack import _origin

    calls = []
    real = monstack.Snapshot.__reduce__
    monkeypatch.setattr(monstack.Snapshot, "__reduce__", lambda self: calls.append(1) or real(self))
    monkeypatch.setattr(_origin, "_RECEIVED", {})
    w = wrap(operator.add)
    backs = [pickle.loads(pickle.dumps(w)) for _ in range(5)]
    assert len(calls) == 1
    assert all(b(2, 3) == 5 for b in backs)
    assert all(b._snap is backs[0]._snap for b in backs)
    assert backs[0]._snap.records() == w._snap.records()
    def at(depth):
        return at(depth - 1) if depth else wrap(operator.add)

    for depth in range(_origin._RECEIVED_MAX + 5):  # distinct snapshots: the cache stays bounded
        pickle.loads(pickle.dumps(at(depth)))
        assert 0 < len(_origin._RECEIVED) <= _origin._RECEIVED_MAX
    with pytest.raises(TypeError, match="must be a Snapshot"):
        _origin.carrier_from_bytes(operator.add, pickle.dumps(42))


def test_wrap_inside_work_chains(mode):
    def inner():
        return monstack.snapshot()

    def outer():
        return wrap(inner)  # @chain-inner

    w = wrap(outer)()  # @chain-outer
    snap = w()
    assert innermost(snap.origin) == (THIS_FILE, line_of("chain-inner"))
    assert innermost(snap.origin.origin) == (THIS_FILE, line_of("chain-outer"))
    assert snap.origin.origin.origin is None


# -- origin() ---------------------------------------------------------------------------------------


def test_origin_block_sets_and_resets(mode):
    snap = here()
    assert current_origin() is None
    with origin(snap) as entered:
        assert entered is snap
        assert current_origin() is snap
        assert monstack.snapshot().origin is snap
        with origin(None):
            assert current_origin() is None
        assert current_origin() is snap
    assert current_origin() is None


def test_origin_block_attaches_to_escaping_exception_once(mode):
    snap = here()
    other = here()
    with pytest.raises(Boom) as info:
        with origin(snap):
            with origin(other):
                raise Boom("x")
    assert origin_of(info.value) is other  # the innermost origin wins
    assert not hasattr(info.value, "__notes__")
    assert format_exception(info.value, color=False).count(HEADING) == 1


def test_origin_rejects_non_snapshots():
    with pytest.raises(TypeError, match="Snapshot"):
        origin("not a snapshot")  # type: ignore[arg-type]


def test_origin_is_per_thread():
    snap = here()
    seen = []
    with origin(snap):
        t = threading.Thread(target=lambda: seen.append(current_origin()))
        t.start()  # not installed: threads do not inherit
        t.join()
    assert seen == [None]


# -- attach / origin_of ---------------------------------------------------------------------------


def test_attach_leaves_the_exception_as_it_was_and_replaces_the_origin():
    exc = Boom("x")
    exc.add_note("a user note")
    first = here()  # @attach-first
    second = here()  # @attach-second
    assert attach(exc, first) is exc
    assert origin_of(exc) is first
    attach(exc, second)
    assert origin_of(exc) is second
    assert exc.__notes__ == ["a user note"] and str(exc) == "x" and exc.args == ("x",)
    text = format_exception(exc, color=False)
    assert text.count(HEADING) == 1 and "a user note" in text
    assert f'line {line_of("attach-second")},' in text
    assert f'line {line_of("attach-first")},' not in text


def test_notes_mode_note_is_added_once_and_replaced():
    """What notes mode (install(notes=True), outside pytest) does to an exception."""
    exc = Boom("x")
    exc.add_note("a user note")
    first = here()  # @note-first
    second = here()  # @note-second
    _origin.set_note(exc, first)
    _origin.set_note(exc, first)
    assert len(our_notes(exc)) == 1
    _origin.set_note(exc, second)
    assert exc.__notes__[0] == "a user note"
    (note,) = our_notes(exc)
    assert f'line {line_of("note-second")},' in note
    assert f'line {line_of("note-first")},' not in note
    # Every tool that prints exceptions shows the note:
    assert note in "".join(traceback.format_exception(exc))
    # An origin with no frames to show gives no note at all.
    bare = Boom("y")
    _origin.set_note(bare, _FramelessSnap())
    assert not hasattr(bare, "__notes__")


def _FramelessSnap() -> monstack.Snapshot:
    """A snapshot with nothing to show (what work created from untracked code gets)."""
    return monstack.Snapshot._from_records(())


def test_an_origin_without_frames_is_never_attached_nor_shown():
    exc = Boom("x")
    _origin.attach_if_absent(exc, _FramelessSnap())
    assert origin_of(exc) is None
    assert "(no tracked frames)" not in format_exception(exc, color=False)
    attach(exc, _FramelessSnap())  # explicitly: recorded, still not shown
    text = format_exception(exc, color=False)
    assert HEADING not in text and "(no tracked frames)" not in text
    snap = here()
    _origin.attach_if_absent(exc, snap)  # (not absent: the explicit one stays)
    assert origin_of(exc).records() == ()


def test_attach_and_origin_of_bad_input():
    snap = here()
    with pytest.raises(TypeError, match="exception instance"):
        attach("not an exception", snap)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="exception instance"):
        attach(Boom, snap)  # type: ignore[arg-type]  # the class, not an instance
    with pytest.raises(TypeError, match="Snapshot"):
        attach(Boom(), "not a snapshot")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        attach(Boom(), None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        origin_of("x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        format_exception("x")  # type: ignore[arg-type]
    assert origin_of(Boom()) is None


class Frozen(Exception):
    """Refuses attributes (so notes too)."""

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen")


class Unhashable(Frozen):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = None  # type: ignore[assignment]


@pytest.mark.parametrize("cls", [Frozen, Unhashable])
def test_exception_refusing_attributes_is_still_reported(cls):
    exc = cls("cold")
    snap = here()  # @frozen
    assert attach(exc, snap) is exc
    assert origin_of(exc) is snap
    assert not hasattr(exc, "__notes__")
    text = format_exception(exc, color=False)
    assert "cold" in text and HEADING in text and f"line {line_of('frozen')}," in text
    # The side table does not keep the exception alive, nor outlive it.
    key = id(exc)
    del exc
    gc.collect()
    assert key not in _origin._SIDE


def test_notes_that_are_not_a_list():
    exc = Boom("x")
    exc.__notes__ = ("a tuple",)  # add_note would raise TypeError
    snap = here()
    attach(exc, snap)
    assert origin_of(exc) is snap
    assert exc.__notes__ == ("a tuple",)
    assert HEADING in format_exception(exc, color=False)


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ fails")

    def __repr__(self) -> str:
        raise RuntimeError("__repr__ fails")


class BadNote:
    def __str__(self) -> str:
        raise RuntimeError("note __str__ fails")

    __repr__ = __str__


def test_failing_str_and_repr_never_break_the_report():
    exc = BadStr()
    try:
        raise exc
    except BadStr:
        pass
    exc.__notes__ = [BadNote()]
    snap = here()
    attach(exc, snap)
    text = format_exception(exc, color=False)
    assert "BadStr" in text and HEADING in text
    out = io.StringIO()
    print_exception(exc, file=out, color=False)
    assert out.getvalue() == text
    # A wrapped callable whose repr fails still has a repr.
    assert "monstack.wrap" in repr(wrap(BadNote))  # BadNote instances are not involved
    obj = BadNote()
    assert "BadNote" in repr(_origin.WithOrigin(obj, snap))  # type: ignore[arg-type]


def test_notes_attribute_that_raises():
    class Weird(Exception):
        @property
        def __notes__(self):  # type: ignore[override]
            raise RuntimeError("no notes for you")

    exc = Weird("w")
    snap = here()
    attach(exc, snap)
    assert origin_of(exc) is snap
    assert HEADING in format_exception(exc, color=False)


def test_origin_survives_pickling_the_exception():
    exc = Boom("x")
    snap = here()  # @pickled
    attach(exc, snap)
    back = pickle.loads(pickle.dumps(exc))
    assert innermost(origin_of(back)) == (THIS_FILE, line_of("pickled"))
    assert not hasattr(back, "__notes__") and str(back) == "x"
    text = format_exception(back, color=False)
    assert text.count(HEADING) == 1


# -- formatting ---------------------------------------------------------------------------------------


def _failed() -> Boom:
    try:
        raise Boom("formatted")
    except Boom as exc:
        return exc


def test_format_exception_layout_and_colour(monkeypatch):
    exc = _failed()
    attach(exc, here())  # @fmt
    plain = format_exception(exc, color=False)
    assert plain.startswith("Traceback (most recent call last):\n")
    assert "Boom: formatted\n" in plain
    assert plain.index("Boom: formatted") < plain.index(HEADING)
    assert f'  File "{THIS_FILE}", line {line_of("fmt")}, in test_format_exception_layout_and_colour\n' in plain
    assert "\x1b[" not in plain
    coloured = format_exception(exc, color=True)
    assert "\x1b[" in coloured and HEADING in coloured
    # color=None: CPython's rules for sys.stderr.
    monkeypatch.delenv("PYTHON_COLORS", raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\x1b[" not in format_exception(exc)
    monkeypatch.delenv("NO_COLOR")
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert "\x1b[" in format_exception(exc)


def test_print_exception_defaults_to_stderr(capsys):
    exc = _failed()
    attach(exc, here())
    print_exception(exc, color=False)
    err = capsys.readouterr().err
    assert "Boom: formatted" in err and HEADING in err


def test_format_exception_hides_monstack_frames():
    def work():
        raise Boom("inner")

    try:
        wrap(work)()
    except Boom as exc:
        text = format_exception(exc, color=False)
    assert "monstack" + "/_origin.py" not in text.replace("\\", "/")
    assert "in work" in text


def test_exception_without_origin_formats_like_cpython():
    exc = _failed()
    assert format_exception(exc, color=False) == "".join(traceback.format_exception(exc))


# -- the chain and its cap ----------------------------------------------------------------------------




@pytest.mark.parametrize("limit", [1, 3, 8])
def test_cap_counts_and_keeps_memory_flat(limit):
    monstack.install(chain_limit=limit)
    for n in (0, 1, limit - 1, limit, limit + 1, 2 * limit, 5 * limit + 3, 500):
        snap = chain_of(n)
        shown, dropped = snap.chain()
        assert len(shown) == min(n, limit), n
        assert len(shown) + dropped == n, n
        physical, s = 0, snap.origin
        while s is not None:
            physical, s = physical + 1, s.origin
        assert physical <= 2 * limit - 1, (n, physical)
        # pickling keeps the count of dropped hops
        back = pickle.loads(pickle.dumps(snap))
        assert back.chain()[1] == dropped and back.records() == snap.records()


def test_cap_message_in_reports():
    monstack.install(chain_limit=2)
    exc = Boom("deep")
    attach(exc, chain_of(6))  # the origin plus 6 older hops: 2 shown, 5 dropped
    text = format_exception(exc, color=False)
    assert text.count("created at (most recent call last):") == 2
    assert "[5 more hops dropped (chain_limit=2)]" in text
    _origin.set_note(exc, origin_of(exc))  # notes mode's note says so too
    assert "[5 more hops dropped (chain_limit=2)]" in our_notes(exc)[0]


def test_many_snapshots_under_one_long_origin_share_one_shortened_copy():
    monstack.install(chain_limit=2)
    deep = chain_of(3)  # 3 hops: the next snapshot under it reaches 2 * limit
    with origin(deep):
        a, b = monstack.snapshot(), monstack.snapshot()
    assert a.origin is b.origin  # shortened once, cached
    assert a.chain()[1] == b.chain()[1] == 4 - 2


def test_snapshot_without_origin_is_unchanged(mode):
    snap = here()
    assert snap.origin is None
    assert snap.chain() == ((), 0)


# -- the demo ---------------------------------------------------------------------------------------


def test_demo_shows_the_users_line():
    from monstack import _demo

    out = io.StringIO()
    assert _demo.run_demo(file=out) == 0
    text = out.getvalue()
    app_lines = _demo.APP_SOURCE.splitlines()
    culprit = next(i + 1 for i, t in enumerate(app_lines) if '"activations", 4096' in t)
    tail = text.split("With monstack")[1]
    assert f'File "{_demo.APP_FILE}", line {culprit}, in build_model' in tail.split(HEADING)[1]
    assert "out of memory" in tail
    assert monstack.active_backend() is None  # it uninstalled what it installed


def test_demo_queue_case_by_hand():
    """The op-queue pattern with the public API, as the README shows it."""
    ops: queue.Queue = queue.Queue()
    errors: list = []

    def worker():
        while (item := ops.get()) is not None:
            try:
                item()
            except Exception as exc:
                errors.append(exc)

    def oom():
        raise MemoryError("out of memory")

    t = threading.Thread(target=worker)
    t.start()
    ops.put(wrap(oom))  # @queued
    ops.put(None)
    t.join()
    assert innermost(origin_of(errors[0])) == (THIS_FILE, line_of("queued"))


# -- wrappers answer as the callable does -----------------------------------------------------------


def documented(a: int, b: int = 2) -> int:
    """Adds two numbers."""
    return a + b


async def coroutine_function() -> None:
    pass


def generator_function():
    yield 1


async def async_generator_function():
    yield 1


class Holder:
    async def method(self) -> None:
        pass

    def plain(self) -> int:
        return 1


def test_wrapper_answers_as_the_callable_does():
    import inspect

    w = wrap(documented)
    for name in ("__name__", "__qualname__", "__module__", "__doc__", "__annotations__", "__defaults__"):
        assert getattr(w, name) == getattr(documented, name), name
    assert inspect.signature(w) == inspect.signature(documented)
    assert inspect.getdoc(w) == "Adds two numbers."
    assert not inspect.iscoroutinefunction(w) and not inspect.iscoroutinefunction(documented)
    assert w(1) == 3
    back = pickle.loads(pickle.dumps(w))
    assert (back.__name__, back.__qualname__, back.__module__, back.__doc__) == (
        "documented", "documented", __name__, "Adds two numbers.")
    assert back._snap.records() == w._snap.records()
    # The class itself is still an ordinary class.
    assert _origin.WithOrigin.__name__ == "WithOrigin"


def test_callables_no_wrapper_can_stand_in_for_travel_unwrapped():
    import contextvars
    import functools
    import inspect

    snap = monstack.snapshot()
    kinds = [coroutine_function, generator_function, async_generator_function, Holder().method,
             functools.partial(coroutine_function), "not callable", coroutine_function()]
    if hasattr(inspect, "markcoroutinefunction"):  # 3.12+
        kinds.append(inspect.markcoroutinefunction(lambda: None))
    try:
        for fn in kinds:
            assert _origin.carry(fn, snap) is fn, fn
    finally:
        kinds[6].close()
    assert type(_origin.carry(documented, snap)) is _origin.WithOrigin
    assert type(_origin.carry(Holder().plain, snap)) is _origin.WithOrigin
    # partial(ctx.run, f): what asyncio.to_thread hands over; f gets the origin inside it
    ctx = contextvars.copy_context()
    inner = _origin.carry(functools.partial(ctx.run, documented, 1), snap)
    assert inner.func == ctx.run and type(inner.args[0]) is _origin.WithOrigin and inner.args[1:] == (1,)
    assert inner() == 3 and _origin.has_origin(inner)
    coro_call = functools.partial(ctx.run, coroutine_function)
    assert _origin.carry(coro_call, snap) is coro_call
