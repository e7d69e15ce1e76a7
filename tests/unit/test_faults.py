"""Fault injection: a failing tracking callback warns once, turns monstack off cleanly, and
never raises into user code.

Faults are injected by wrapping two things the ``sys.monitoring`` callbacks call --
``Policy.is_tracked`` (the first-event decision) and ``_stack.build`` (seeding a thread and
resynchronising) -- so that they raise *only when called from a callback* (the caller's
file is ``_sysmon.py``) and only while armed. Each event kind's failure path is reached:
PY_START (decision), the first event on a new thread (seed), PY_RETURN and PY_UNWIND
(resync after a disagreement), PY_THROW (seed), and ``snapshot()``'s own capture.
"""

from __future__ import annotations

import sys
import threading
import warnings

import pytest
from conftest import expected_backend, needs_sysmon
from stackcheck import check

import monstack
from monstack import _capture, _install, _stack
from monstack._policy import Policy


class Injected(RuntimeError):
    """The fault this module injects."""


_ARMED: dict = {"on": False, "count": 0, "file": None, "exc": None}


#: Files whose functions run inside monstack's tracking hooks.
HOOK_FILES = ("_sysmon.py", "_accel.py", "_evalframe.py")


def _from_callback() -> bool:
    f = sys._getframe(2)
    return f.f_code.co_filename.endswith(HOOK_FILES)


@pytest.fixture
def faults(monkeypatch):
    """Wrap the callees; ``faults.arm()`` / ``faults.disarm()``. Resets warn-once state."""
    real_is_tracked = Policy.is_tracked
    real_build = _stack.build

    def is_tracked(self, code, module=None):
        if _ARMED["on"] and code.co_filename == _ARMED["file"] and _from_callback():
            _ARMED["count"] += 1
            raise (_ARMED["exc"] or Injected)("injected fault in Policy.is_tracked")
        return real_is_tracked(self, code, module)

    def build(frame, policy, *args):
        if _ARMED["on"] and _from_callback():
            _ARMED["count"] += 1
            raise (_ARMED["exc"] or Injected)("injected fault in _stack.build")
        return real_build(frame, policy, *args)

    monkeypatch.setattr(Policy, "is_tracked", is_tracked)
    monkeypatch.setattr(_stack, "build", build)
    monkeypatch.setattr(_install, "_failure_reported", False)
    _ARMED["count"] = 0

    class Control:
        @staticmethod
        def arm(file=None, exc=None):
            """Fail every build() called by a callback, and is_tracked() for ``file``
            (raising ``exc``, by default ``Injected``)."""
            _ARMED["count"] = 0
            _ARMED["file"] = file
            _ARMED["exc"] = exc
            _ARMED["on"] = True

        @staticmethod
        def disarm():
            _ARMED["on"] = False

        @staticmethod
        def fired() -> int:
            return _ARMED["count"]

    try:
        yield Control
    finally:
        _ARMED["on"] = False


def fresh_module(tmp_path, name: str, source: str) -> dict:
    """Compile ``source`` under a new real file name (so its code is undecided, tracked)."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    ns: dict = {"__name__": name, "check": check, "__file__": str(path)}
    exec(compile(source, str(path), "exec"), ns)
    return ns


def monstack_tool_ids() -> list[int]:
    if not hasattr(sys, "monitoring"):
        return []
    return [t for t in range(6) if sys.monitoring.get_tool(t) == "monstack"]


def assert_cleanly_off(tool: int | None) -> None:
    assert monstack.active_backend() is None
    assert _capture._state is None and _capture._fast is None and _capture._native_snapshot is None
    assert monstack_tool_ids() == []
    if tool is not None:
        assert sys.monitoring.get_tool(tool) is None
        for event in range(20):  # no callback of ours left registered on that id
            try:
                cb = sys.monitoring.register_callback(tool, 1 << event, None)
            except ValueError:
                continue
            assert cb is None


def installed_tool() -> int:
    name = monstack.install()
    assert name == "monitoring"
    tool = _capture._state.backend.tool
    assert sys.monitoring.get_tool(tool) == "monstack"
    return tool


def monstack_warnings(record) -> list:
    return [w for w in record if issubclass(w.category, monstack.MonstackWarning)]


@needs_sysmon
def test_fault_in_first_event_decision(faults, tmp_path):
    ns = fresh_module(tmp_path, "fault_start", "def f(x):\n    return [x * i for i in range(3)]\n")
    tool = installed_tool()
    with pytest.warns(monstack.MonstackWarning, match="internal error in tracking.*Injected.*tracking turned off") as rec:
        faults.arm(ns["__file__"])
        result = ns["f"](2)  # PY_START of an undecided file: the decision raises
    faults.disarm()
    assert result == [0, 2, 4]
    assert faults.fired() >= 1
    assert len(monstack_warnings(rec)) == 1
    assert_cleanly_off(tool)


@needs_sysmon
def test_recursion_error_in_a_callback_keeps_tracking_on(faults, tmp_path):
    """A RecursionError inside a callback means the thread is at its recursion limit,
    not that monstack is broken: no warning, tracking stays on, the thread's stack is
    forgotten and rebuilt from the real frames."""
    ns = fresh_module(tmp_path, "recursion_start", "def f(x):\n    check()\n    return x + 1\n")
    installed_tool()
    before = _stack.STATS["recursion"]
    faults.arm(ns["__file__"], RecursionError)
    try:
        assert ns["f"](1) == 2  # PY_START of an undecided file: the decision raises
    finally:
        faults.disarm()
    assert faults.fired() >= 1
    assert _stack.STATS["recursion"] > before
    assert monstack.active_backend() == "monitoring"
    assert ns["f"](2) == 3  # tracked again, the stack right (check() compares it)
    check()


def test_snapshots_at_the_recursion_limit_keep_tracking_on():
    """A program recursing into its limit asks where it is on the way back up (what an
    error reporter does). monstack stays on; snapshot() may raise RecursionError only at
    the limit itself, where any call fails; afterwards the stack is right."""
    backend = monstack.install()
    limit = sys.getrecursionlimit()

    def snap_here():
        try:
            monstack.snapshot()
        except RecursionError:
            pass

    def rec(i, every):
        try:
            rec(i + 1, every)
        except RecursionError:
            if i % every == 0:
                snap_here()
            raise

    for every in (1, 2, 3, 5):
        for room in (100, 101, 102):
            sys.setrecursionlimit(len(real_stack()) + room)
            try:
                rec(0, every)
            except RecursionError:
                pass
            finally:
                sys.setrecursionlimit(limit)
            assert monstack.active_backend() == backend, (every, room)
            check()


def real_stack() -> list:
    f, out = sys._getframe(1), []
    while f is not None:
        out.append(f)
        f = f.f_back
    return out


@pytest.mark.skipif(expected_backend() != "evalframe", reason="the 3.11 evalframe backend")
def test_evalframe_fault_in_decision_is_reported_once_and_uninstalls(faults, tmp_path):
    ns = fresh_module(tmp_path, "fault_eval", "def f(x):\n    return x + 1\n")
    assert monstack.install() == "evalframe"
    with pytest.warns(monstack.MonstackWarning, match="internal error") as rec:
        faults.arm(ns["__file__"])
        assert ns["f"](1) == 2  # the shim's decision raises: recorded, user code unaffected
        faults.disarm()

        def fresh():
            return monstack.snapshot()  # the failure is reported here, outside the shim

        snap = fresh()
    assert faults.fired() >= 1
    assert [r[2] for r in snap.records()][-1] == "fresh"
    assert len(monstack_warnings(rec)) == 1
    assert monstack.active_backend() is None


@pytest.mark.skipif(expected_backend() != "evalframe", reason="the 3.11 evalframe backend")
def test_evalframe_repeated_decision_faults_keep_memory_flat(faults, tmp_path):
    """Until a snapshot reports it, a failing decision must not pile up (one exception
    with its traceback per call of the undecided code would grow without bound)."""
    import gc

    ns = fresh_module(tmp_path, "fault_eval_many", "def f(x):\n    return x + 1\n")
    assert monstack.install() == "evalframe"
    faults.arm(ns["__file__"])
    f = ns["f"]
    for i in range(200):  # warm up
        f(i)
    gc.collect()
    before = sys.getallocatedblocks()
    for i in range(20000):
        f(i)
    gc.collect()
    grown = sys.getallocatedblocks() - before
    faults.disarm()
    with pytest.warns(monstack.MonstackWarning):
        monstack.snapshot()
    assert grown < 1000, f"{grown} blocks kept by 20000 failing decisions"


@needs_sysmon
def test_fault_when_seeding_a_new_thread(faults, tmp_path):
    ns = fresh_module(tmp_path, "fault_seed", "def work(out):\n    out.append(sum(range(10)))\n")
    ns["work"]([])  # decided (tracked) while healthy
    tool = installed_tool()
    out: list = []
    errors: list = []

    def target():
        try:
            ns["work"](out)  # first event on this thread: seed() -> build() raises
        except BaseException as exc:  # noqa: BLE001 - must not happen
            errors.append(exc)

    with pytest.warns(monstack.MonstackWarning) as rec:
        faults.arm()
        t = threading.Thread(target=target)
        t.start()
        t.join()
    faults.disarm()
    assert errors == [] and out == [45]
    assert faults.fired() >= 1
    assert len(monstack_warnings(rec)) == 1
    assert_cleanly_off(tool)


@needs_sysmon
def test_fault_in_pop_resync(faults, tmp_path):
    ns = fresh_module(
        tmp_path,
        "fault_return",
        "def inner(corrupt):\n    corrupt()\n    return 7\n\ndef outer(corrupt):\n    return inner(corrupt) + 1\n",
    )
    tool = installed_tool()
    ns["outer"](lambda: None)  # warm: decided, seeded

    def corrupt():
        # A lie about this thread: PY_RETURN of inner() finds another code on top.
        cell = _stack.get_cell()
        cell[0] = (corrupt.__code__, None, 0)
        faults.arm()

    with pytest.warns(monstack.MonstackWarning) as rec:
        assert ns["outer"](corrupt) == 8
    faults.disarm()
    assert faults.fired() >= 1
    assert len(monstack_warnings(rec)) == 1
    assert_cleanly_off(tool)


@needs_sysmon
def test_fault_in_unwind_resync_keeps_the_users_exception(faults, tmp_path):
    ns = fresh_module(
        tmp_path,
        "fault_unwind",
        "def inner(corrupt):\n    corrupt()\n    raise KeyError('mine')\n\n"
        "def outer(corrupt):\n    try:\n        inner(corrupt)\n    except KeyError as exc:\n        return exc.args\n",
    )
    tool = installed_tool()
    assert ns["outer"](lambda: None) == ("mine",)

    def corrupt():
        _stack.get_cell()[0] = (corrupt.__code__, None, 0)
        faults.arm()

    with pytest.warns(monstack.MonstackWarning) as rec:
        assert ns["outer"](corrupt) == ("mine",)  # the user's exception, handled as usual
    faults.disarm()
    assert faults.fired() >= 1
    assert len(monstack_warnings(rec)) == 1
    assert_cleanly_off(tool)


@needs_sysmon
def test_fault_in_throw_into_generator_on_unseeded_thread(faults, tmp_path):
    ns = fresh_module(
        tmp_path,
        "fault_throw",
        "def gen():\n    try:\n        yield 1\n    except ValueError:\n        yield 'caught'\n",
    )
    tool = installed_tool()
    g = ns["gen"]()
    assert next(g) == 1
    out: list = []

    def target():
        # Only untracked frames (threading, this C call) before the generator's PY_THROW:
        # the thread's first tracked event is the throw, which seeds -> build() raises.
        out.append(g.throw(ValueError))

    with pytest.warns(monstack.MonstackWarning) as rec:
        faults.arm()
        t = threading.Thread(target=target)
        t.start()
        t.join()
    faults.disarm()
    assert out == ["caught"]
    assert faults.fired() >= 1
    assert len(monstack_warnings(rec)) == 1
    assert_cleanly_off(tool)


def test_fault_in_snapshot_capture_falls_back_to_walk(faults, monkeypatch):
    monstack.install()
    state = _capture._state
    if not state.backend.tracking:
        pytest.skip("the walk backend has no separate capture to break")
    tool = getattr(state.backend, "tool", None)

    def broken_capture(frame):
        raise Injected("injected fault in capture")

    monkeypatch.setattr(state.backend, "capture", broken_capture)
    monkeypatch.setattr(_capture, "_fast", None)  # no inline fast path: through capture()
    monkeypatch.setattr(_capture, "_native_snapshot", None)

    def fresh():
        return monstack.snapshot()

    with pytest.warns(monstack.MonstackWarning) as rec:
        snap = fresh()
    assert len(monstack_warnings(rec)) == 1
    assert [r[2] for r in snap.records()][-1] == "fresh"
    assert monstack.active_backend() is None
    if tool is not None:
        assert_cleanly_off(tool)


@needs_sysmon
def test_many_threads_failing_at_once_warn_exactly_once(faults, tmp_path):
    ns = fresh_module(tmp_path, "fault_many", "def work(n):\n    return n * 2\n")
    tool = installed_tool()
    barrier = threading.Barrier(8)
    out: list = []
    errors: list = []

    def target(i):
        try:
            barrier.wait()
            out.append(ns["work"](i))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    with pytest.warns(monstack.MonstackWarning) as rec:
        faults.arm(ns["__file__"])
        threads = [threading.Thread(target=target, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    faults.disarm()
    assert errors == [] and sorted(out) == [i * 2 for i in range(8)]
    assert len(monstack_warnings(rec)) == 1
    assert_cleanly_off(tool)


@needs_sysmon
def test_warnings_as_errors_still_no_exception_and_message_on_stderr(faults, tmp_path, capsys):
    ns = fresh_module(tmp_path, "fault_strict", "def f():\n    return 'ok'\n")
    tool = installed_tool()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # what pytest -W error / python -W error do
        faults.arm(ns["__file__"])
        assert ns["f"]() == "ok"
    faults.disarm()
    err = capsys.readouterr().err
    assert err.count("MonstackWarning: monstack-internal-error: internal error in tracking") == 1
    assert "Injected" in err and "Traceback" not in err
    assert_cleanly_off(tool)


@needs_sysmon
def test_monstack_works_again_after_a_fault_and_reinstall(faults, tmp_path):
    ns = fresh_module(tmp_path, "fault_again", "def f():\n    return check('in f')\n")
    installed_tool()
    with pytest.warns(monstack.MonstackWarning):
        faults.arm(ns["__file__"])
        ns["f"]()
    faults.disarm()
    assert monstack.active_backend() is None
    tool = installed_tool()
    before = _stack.STATS["resync"]

    def g(n):
        return check("after reinstall") if n == 0 else g(n - 1)

    assert g(5) >= 6
    assert ns["f"]() >= 1
    assert _stack.STATS["resync"] == before
    monstack.uninstall()
    assert_cleanly_off(tool)


def test_failing_start_hook_leaves_nothing_installed(monkeypatch):
    def bad_hook(state):
        raise Injected("start hook")

    monkeypatch.setattr(_install, "_start_hooks", [bad_hook])
    with pytest.raises(Injected):
        monstack.install()
    assert monstack.active_backend() is None
    assert monstack_tool_ids() == []
    monkeypatch.setattr(_install, "_start_hooks", [])
    assert monstack.install()  # and a later install works
    check("after failed install")


def test_failing_stop_hook_still_uninstalls_and_warns(monkeypatch):
    def bad_hook(state):
        raise Injected("stop hook")

    monstack.install()
    monkeypatch.setattr(_install, "_stop_hooks", [bad_hook])
    with pytest.warns(monstack.MonstackWarning, match="uninstall step failed"):
        monstack.uninstall()
    assert monstack.active_backend() is None
    assert monstack_tool_ids() == []


@needs_sysmon
def test_injection_really_reaches_the_callbacks(faults, tmp_path):
    """Guard against a test that cannot fail: without arming, nothing fires or warns."""
    ns = fresh_module(tmp_path, "fault_guard", "def f():\n    return check('guard')\n")
    installed_tool()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ns["f"]()
    assert faults.fired() == 0
    assert monstack.active_backend() == "monitoring"


@pytest.mark.parametrize(
    "fake",
    [
        {"EVALFRAME_SEES_GETITEM": False},  # 3.11.0-3.11.3: before gh-104405 was fixed
        {"EVALFRAME_FOR_VERSION": False, "VERSION_TEXT": "3.10.13"},
        {"EVALFRAME_FOR_VERSION": False, "VERSION_TEXT": "3.12.1"},
        {"IMPLEMENTATION": "pypy", "CPYTHON": False},
        {"LINUX": False},
        {"POINTER_BITS": 32},
    ],
    ids=["3.11.2", "3.10", "3.12", "pypy", "not-linux", "32-bit"],
)
def test_evalframe_shim_refuses_unknown_interpreters(fake, monkeypatch):
    """The 3.11 native shim is refused, with a reason, on any interpreter it was not built for."""
    from monstack import _env, _evalframe

    for name, value in fake.items():
        monkeypatch.setattr(_env, name, value)
    why = _evalframe.EvalFrameBackend.unavailable()
    assert isinstance(why, str) and why
    with pytest.raises(RuntimeError, match="cannot run here"):
        monstack.install(backend="evalframe")
    assert monstack.active_backend() is None
    # auto never picks it there
    name = monstack.install()
    assert name != "evalframe"
    monstack.uninstall()


def test_evalframe_refuses_a_debug_build(monkeypatch):
    from monstack import _env, _evalframe

    monkeypatch.setattr(_env, "DEBUG_BUILD", True)
    assert "debug build" in (_evalframe.EvalFrameBackend.unavailable() or "")
