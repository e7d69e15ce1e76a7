"""Greenlets (monstack/_points/greenlet.py): each greenlet's snapshots are its own real frames,
and gevent's ``monkey.patch_all()`` as a program's first line works under MONSTACK=1.
Needs gevent (the ``integration`` extra)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from stackcheck import Mismatch, check

import monstack
from monstack import _stack
from monstack._points import greenlet as _greenlet

from conftest import expected_backend, integration_module

pytestmark = pytest.mark.integration

greenlet = integration_module("greenlet")
gevent = integration_module("gevent")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
tracking = pytest.mark.skipif(expected_backend() == "walk", reason="walk backend keeps no stack")


def _rec(n: int, tag: str, park, bad: list) -> None:
    _check(f"{tag} before {n}", bad)
    if n:
        _rec(n - 1, tag, park, bad)
    else:
        park()  # another greenlet runs: its frames replace ours without events
    _check(f"{tag} after {n}", bad)


def _check(where: str, bad: list) -> None:
    try:
        check(where)
    except Mismatch as exc:
        bad.append(str(exc))


@tracking
def test_raw_greenlets_running_the_same_code_at_different_depths(installed):
    """Greenlets switching by hand, each recursing through the same function to its own
    depth and switching out at the bottom: every snapshot is the running greenlet's own
    real frames (the shadow stack used to show the greenlet that ran last), with no
    rebuild after the first seed of each greenlet."""
    bad: list = []
    main = greenlet.getcurrent()
    order = []

    def make(depth: int):
        def run() -> None:
            _rec(depth, f"g{depth}", lambda: main.switch(), bad)
            order.append(depth)

        return greenlet.greenlet(run)

    def drive() -> None:
        gs = [make(d) for d in (3, 1, 2, 0)]
        for g in gs:  # each runs down to its bottom and switches back
            g.switch()
            _check("main, between", bad)
        for g in reversed(gs):  # resumed in another order: each climbs back out
            g.switch()
            _check("main, after", bad)

    resyncs = _stack.STATS["resync"]
    drive()
    assert order == [0, 2, 1, 3]
    assert bad == []
    assert _stack.STATS["resync"] == resyncs


@tracking
def test_gevent_greenlets(installed):
    """gevent's hub switching between greenlets (``gevent.sleep(0)``) at different depths
    of the same function, and a greenlet that fails: snapshots match the real frames."""
    bad: list = []

    def work(depth: int, tag: str) -> int:
        _rec(depth, tag, lambda: gevent.sleep(0), bad)
        _check(f"{tag} end", bad)
        return depth

    def main() -> list:
        gs = [gevent.spawn(work, d, f"g{d}") for d in (3, 1, 2, 0)]
        gevent.joinall(gs)
        _check("main", bad)
        return [g.value for g in gs]

    assert main() == [3, 1, 2, 0]
    assert bad == []


def test_the_trace_function_chains_and_is_put_back():
    """A greenlet trace function set before install() keeps being called, and is the one
    in place again after uninstall()."""
    seen: list = []

    def other(event, args):
        seen.append(event)

    before = greenlet.settrace(other)
    try:
        monstack.install()
        assert greenlet.gettrace() is not other
        g = greenlet.greenlet(lambda: None)
        g.switch()
        assert seen == ["switch", "switch"]  # into g, and back when it ends
        monstack.uninstall()
        assert greenlet.gettrace() is other
        assert _greenlet._tracer is None
    finally:
        monstack.uninstall()
        greenlet.settrace(before)


_PATCH_ALL_FIRST = textwrap.dedent("""\
    from gevent import monkey; monkey.patch_all()
    import sys
    sys.path.insert(0, {tests!r})
    import threading
    import gevent
    import monstack
    from stackcheck import Mismatch, check

    assert monkey.is_module_patched("threading")
    print("backend", monstack.active_backend())
    bad = []

    def rec(n):
        try:
            check("before")
        except Mismatch as exc:
            bad.append(str(exc))
        if n:
            rec(n - 1)
        else:
            gevent.sleep(0)
        try:
            check("after")
        except Mismatch as exc:
            bad.append(str(exc))

    def fails():
        raise ValueError("in a thread")

    gevent.joinall([gevent.spawn(rec, d) for d in (2, 0, 1)])
    t = threading.Thread(target=rec, args=(1,))  # a greenlet under patch_all
    t.start()
    t.join()
    print("mismatches:", len(bad))
    for b in bad[:2]:
        print(b)
""")


def test_monkey_patch_all_as_the_first_line_under_monstack_1(tmp_path):
    """``from gevent import monkey; monkey.patch_all()`` as a program's first line, run
    with MONSTACK=1 and warnings as errors: no warning, exit 0, tracking on, and the
    snapshots in greenlets (and in a patched ``threading.Thread``) are the real frames."""
    script = tmp_path / "patch_all_first.py"
    script.write_text(_PATCH_ALL_FIRST.format(tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ, MONSTACK="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-W", "error", str(script)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert f"backend {expected_backend()}" in out.stdout
    assert "mismatches: 0" in out.stdout, out.stdout


def test_what_gevent_spawn_carries(installed):
    """``gevent.spawn(fn)`` carries no origin (a new greenlet starts with an empty
    context), even under one; ``gevent.spawn(monstack.wrap(fn))`` carries the spawning
    line (docs/origins.md, "Greenlets")."""

    def origin_seen() -> bool:
        return monstack.snapshot().origin is not None

    def fails() -> None:
        raise ValueError("in a greenlet")

    def spawn_line() -> int:
        return sys._getframe(1).f_lineno

    with monstack.origin(monstack.snapshot()):
        plain = gevent.spawn(origin_seen)
        plain.join()
        failing = gevent.spawn(fails)
        failing.join()
        wrapped = gevent.spawn(monstack.wrap(fails)); line = spawn_line()  # noqa: E702 (one line)
        wrapped.join()
    assert plain.value is False
    assert monstack.origin_of(failing.exception) is None
    assert not getattr(wrapped.exception, "__notes__", None)
    report = monstack.format_exception(wrapped.exception, color=False)
    assert "Work created at" in report and f"line {line}, in test_what_gevent_spawn_carries" in report
