"""install() / uninstall(): choices, idempotence, thread safety, restoring everything
(which backend is chosen, and why: test_select.py)."""

from __future__ import annotations

import os
import sys
import textwrap
import threading

import pytest
from conftest import expected_backend, needs_sysmon, tracking
from stackcheck import captures_for_library_snapshots, check, library_module, real_records, shadow_records

import monstack
from monstack import _stack


def test_install_returns_backend_and_uninstall_is_idempotent():
    assert monstack.active_backend() is None
    name = monstack.install()
    assert name == monstack.active_backend() == expected_backend()
    assert monstack.install() == name  # same options: nothing happens
    monstack.uninstall()
    monstack.uninstall()
    assert monstack.active_backend() is None


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"backend": "turbo"}, "valid choices: 'auto', 'monitoring', 'evalframe', 'walk'"),
        ({"track": "some"}, "valid choices: 'user', 'all'"),
        ({"include": [""]}, "non-empty"),
        ({"chain_limit": 0}, "positive"),
    ],
)
def test_bad_options_raise_valueerror_naming_valid_choices(kwargs, fragment):
    with pytest.raises(ValueError) as info:
        monstack.install(**kwargs)
    assert fragment in str(info.value)
    assert monstack.active_backend() is None


def test_walk_backend_explicitly():
    assert monstack.install(backend="walk") == "walk"
    check("walk")


def test_snapshot_without_install_walks_and_never_raises():
    assert monstack.active_backend() is None
    snap = monstack.snapshot()
    assert shadow_records(snap)[-1][2] == "test_snapshot_without_install_walks_and_never_raises"
    check("uninstalled")


def test_reinstall_with_other_options_reconfigures():
    monstack.install(track="user")
    assert monstack.status()["policy"] == "track=user"
    monstack.install(track="all")
    assert monstack.status()["policy"] == "track=all"


def test_install_uninstall_from_many_threads():
    errors = []
    barrier = threading.Barrier(6)

    def churn(i):
        try:
            barrier.wait()
            for j in range(20):
                if (i + j) % 2:
                    monstack.install()
                else:
                    monstack.uninstall()
                check("churn")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


@needs_sysmon
def test_uninstall_frees_the_tool_id_and_callbacks():
    mon = sys.monitoring
    before = {t: mon.get_tool(t) for t in range(6)}
    monstack.install(backend="monitoring")
    tool = int(monstack.status()["tool id"])
    assert mon.get_tool(tool) == "monstack"
    assert mon.get_events(tool) != 0
    monstack.uninstall()
    assert {t: mon.get_tool(t) for t in range(6)} == before
    for event in (mon.events.PY_START, mon.events.PY_RETURN, mon.events.PY_UNWIND):
        assert mon.register_callback(tool, event, None) is None  # nothing of ours left


@needs_sysmon
def test_tool_ids_in_use_are_never_stolen():
    mon = sys.monitoring
    taken = []
    try:
        for tool in (3, 4):
            if mon.get_tool(tool) is None:
                mon.use_tool_id(tool, f"other-{tool}")
                taken.append(tool)
        monstack.install(backend="monitoring")
        assert int(monstack.status()["tool id"]) not in (3, 4)
        monstack.uninstall()
        for tool in range(6):
            if mon.get_tool(tool) is None:
                mon.use_tool_id(tool, f"other-{tool}")
                taken.append(tool)
        with pytest.raises(RuntimeError, match="other-3"):
            monstack.install(backend="monitoring")
        assert monstack.active_backend() is None
        # auto falls back to the next backend and says why
        assert monstack.install() != "monitoring"
        assert "tool id" in monstack.status()["reason"]
    finally:
        for tool in taken:
            mon.free_tool_id(tool)


@needs_sysmon
def test_filtered_code_events_stop_after_the_first(monkeypatch, tmp_path):
    from monstack import _sysmon

    counts: dict = {}
    real = _sysmon._callbacks

    def counting(policy, tls, on_error):
        cbs = real(policy, tls, on_error)

        def wrap(event, cb):
            def counted(code, *args):
                counts[(event, code.co_name)] = counts.get((event, code.co_name), 0) + 1
                return cb(code, *args)

            return counted

        return {event: wrap(event, cb) for event, cb in cbs.items()}

    monkeypatch.setattr(_sysmon, "_callbacks", counting)
    mod = tmp_path / "filtered_mod_for_test.py"
    mod.write_text("def lib():\n    return 1\n\ndef gen():\n    yield 1\n    yield 2\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import filtered_mod_for_test as m
    finally:
        sys.path.remove(str(tmp_path))

    def user():
        return 2

    monstack.install(backend="monitoring", exclude=[str(tmp_path)], accelerator=False)  # counts the Python callbacks; test_accel covers native
    for _ in range(200):
        m.lib()
        user()
        list(m.gen())
    monstack.uninstall()
    E = sys.monitoring.events
    assert counts[(E.PY_START, "lib")] == 1 and counts[(E.PY_RETURN, "lib")] == 1
    assert counts[(E.PY_START, "gen")] == 1 and counts[(E.PY_RESUME, "gen")] <= 2
    assert counts[(E.PY_START, "user")] == 200 and counts[(E.PY_RETURN, "user")] == 200


@needs_sysmon
def test_disabled_code_is_tracked_again_after_reinstall_with_another_policy(tmp_path):
    mod = tmp_path / "policy_swap_mod.py"
    mod.write_text(
        textwrap.dedent(
            """
            import monstack
            def lib(cb):
                return cb()
            """
        )
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import policy_swap_mod as m
    finally:
        sys.path.remove(str(tmp_path))

    def names():
        return [r[2] for r in shadow_records(monstack.snapshot())]

    monstack.install(backend="monitoring", exclude=["policy_swap_mod"])
    assert "lib" not in m.lib(names)
    m.lib(check)
    monstack.uninstall()
    monstack.install(backend="monitoring")
    assert "lib" in m.lib(names)
    m.lib(check)


def test_internal_error_in_a_callback_warns_once_and_uninstalls(monkeypatch):
    if expected_backend() != "monitoring":
        pytest.skip("this checks the sys.monitoring callbacks")
    monstack.install()
    # Break the thread state the callbacks read: the next event fails inside a callback.
    _stack.TLS.cell = None
    with pytest.warns(monstack.MonstackWarning, match="tracking turned off"):

        def user_code():
            return 42

        assert user_code() == 42  # the user's code still runs and returns normally
    assert monstack.active_backend() is None


# --------------------------------------------------------------------------- snapshotter()
def _nested(fn, depth=3):
    """fn() and the real records, called ``depth`` frames down."""
    if depth:
        return _nested(fn, depth - 1)
    return fn(), real_records()  # one line: same lineno


def test_snapshotter_is_snapshot_when_nothing_faster_exists():
    assert monstack.snapshotter() is monstack.snapshot  # not installed
    monstack.install(backend="walk")
    assert monstack.snapshotter() is monstack.snapshot


@pytest.mark.parametrize("phase", ["installed", "after uninstall", "after reinstall"])
def test_snapshotter_gives_what_snapshot_gives(phase):
    """Bound once, called per op: the same records as snapshot() and the real stack,
    also once the install it came from is gone (it falls back to snapshot())."""
    monstack.install()
    cap = monstack.snapshotter()
    if phase != "installed":
        monstack.uninstall()
    if phase == "after reinstall":
        monstack.install()
    for _ in range(3):
        snap, real = _nested(cap)
        assert shadow_records(snap) == real
    # through C (map) and with an origin set: still its caller's stack, origin attached
    [(snap, real)] = list(map(lambda _: (cap(), real_records()), [0]))
    assert shadow_records(snap) == real
    parent = monstack.snapshot()
    with monstack.origin(parent):
        snap = cap()
    assert snap.origin is not None and shadow_records(snap.origin) == shadow_records(parent)


@needs_sysmon
def test_snapshotter_is_native_where_the_accelerator_runs_and_retires_cleanly(monkeypatch):
    from monstack import _accel, _capture

    why = _accel.unavailable()
    if why or os.environ.get("MONSTACK_ACCELERATOR") == "0":
        pytest.skip(f"native accelerator not in use: {why}")
    monstack.install()
    cap = monstack.snapshotter()
    assert cap is not monstack.snapshot and type(cap).__name__ == "builtin_function_or_method"
    backend = _capture._state.backend
    calls = []
    real_capture = backend.capture
    monkeypatch.setattr(backend, "capture", lambda frame: calls.append(1) or real_capture(frame))
    _nested(cap)  # nodes filled
    snap, real = _nested(cap)
    assert shadow_records(snap) == real
    assert calls == []  # answered natively
    # a backend that stops trusting its shadow stack retires the native paths too
    _capture.disable_fast_path()
    snap, real = _nested(cap)
    assert shadow_records(snap) == real and calls
    with pytest.raises(TypeError):
        cap(1)


@tracking
def test_inline_snapshot_looks_through_filtered_callers(tmp_path, monkeypatch):
    """snapshot()'s Python fast path (the one 3.11 and the pure-Python callbacks use),
    called by a framework for its user: it looks through the framework's frames to the
    user's instead of falling back to the full capture."""
    from monstack import _capture

    op = library_module(tmp_path, "fw_for_inline_snapshot")["op"]
    monstack.install(exclude=[str(tmp_path)])
    monkeypatch.setattr(_capture, "_native_snapshot", None)  # the Python path only
    backend = _capture._state.backend
    calls = captures_for_library_snapshots(op, backend, monkeypatch)
    # pure-Python pushes leave call sites to the capture's fill; native ones record them
    if backend.name == "evalframe" or getattr(backend, "native", False):
        assert calls == 0


@pytest.mark.parametrize("how", ["not installed", "installed", "walk"])
def test_snapshot_called_with_no_python_frame_at_all_does_not_raise(how, capfd):
    """_thread.start_new_thread(fn, ()) calls fn straight from C: no Python caller. The
    snapshot is then empty, never an exception (snapshotter()'s function falls back to
    snapshot() and must not raise either)."""
    import _thread

    if how == "installed":
        monstack.install()
    elif how == "walk":
        monstack.install(backend="walk")
    before = _thread._count()
    for fn in (monstack.snapshot, monstack.snapshotter()):
        _thread.start_new_thread(fn, ())  # fn is the thread's function: no frame at all
    deadline = threading.Event()
    for _ in range(1000):  # wait (bounded) until both bare threads have finished
        if _thread._count() <= before:
            break
        deadline.wait(0.01)
    assert _thread._count() <= before
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception" not in err, err


def test_accelerator_with_the_walk_backend_is_refused_naming_the_conflict(monkeypatch):
    with pytest.raises(ValueError, match=r"accelerator=True conflicts with backend='walk'"):
        monstack.install(backend="walk", accelerator=True)
    monkeypatch.setenv("MONSTACK_BACKEND", "walk")
    with pytest.raises(ValueError, match=r"accelerator=True conflicts with MONSTACK_BACKEND='walk'"):
        monstack.install(accelerator=True)
    assert monstack.active_backend() is None  # refused before touching anything
    assert monstack.install(backend="walk", accelerator=False) == "walk"  # no native code asked for: fine


def test_hooks_are_registered_through_add_hooks_and_run_around_each_install(monkeypatch):
    """The package registers the dump signal's hooks once, through ``_install.add_hooks``;
    a registered pair runs after each install() (with the running state) and before each
    uninstall() stops the backend, in reverse order, and registering it again adds nothing."""
    from monstack import _capture, _install

    assert _install._start_hooks.count(monstack._dump_signal_start) == 1
    assert _install._stop_hooks.count(monstack._dump_signal_stop) == 1
    package = os.path.dirname(_install.__file__)
    for root, _dirs, names in os.walk(package):
        for name in names:
            path = os.path.join(root, name)
            if name.endswith(".py") and path != _install.__file__:
                with open(path, encoding="utf-8") as f:
                    source = f.read()
                assert "_start_hooks" not in source and "_stop_hooks" not in source, path  # add_hooks() only
    monkeypatch.setattr(_install, "_start_hooks", list(_install._start_hooks))
    monkeypatch.setattr(_install, "_stop_hooks", list(_install._stop_hooks))
    seen = []

    def pair(tag):
        def start(state):  # the running install, its propagation points already on
            seen.append(("start", tag, state is _capture.running(), monstack.status()["propagation"] != []))
            states.append(state)

        def stop(state):  # the install being undone
            seen.append(("stop", tag, state is states[0]))

        return start, stop

    states: list = []

    first, second = pair(1), pair(2)
    _install.add_hooks(*first)
    _install.add_hooks(*second)
    _install.add_hooks(*first)  # again: nothing added
    monstack.install()
    monstack.uninstall()
    assert seen == [("start", 1, True, True), ("start", 2, True, True), ("stop", 2, True), ("stop", 1, True)]
