"""monstack.threads(): every thread's stack and current origin, checked against the real
frames (``sys._current_frames()``, the oracle) in every configuration (the suite runs
with the native and the pure-Python callbacks, the 3.11 shim, and here with ``walk`` and
without install too)."""

from __future__ import annotations

import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest

import monstack
from monstack import _capture, _snapshot, _stack, _threads

from conftest import tracking

HERE = __file__


def oracle(ident: int) -> list:
    """(name, line) of the tracked frames of thread ``ident``, outermost first, from the
    real frames (this file's frames: the tests run nothing else tracked)."""
    frame = sys._current_frames()[ident]
    policy = _capture.current_policy()
    out = []
    f = frame
    while f is not None:
        if policy.is_tracked(f.f_code, f.f_globals.get("__name__")):
            out.append((f.f_code.co_name, f.f_lineno))
        f = f.f_back
    del frame, f
    return out[::-1]


def got(snap) -> list:
    return [(r[2], r[1]) for r in snap.records()]


def recurse(n: int, ready: threading.Event, release: threading.Event) -> None:
    if n:
        recurse(n - 1, ready, release)
        return
    ready.set()
    release.wait()  # the line every parked thread waits at


class Parked:
    """``count`` threads parked ``depth`` calls deep until ``release()``."""

    def __init__(self, count: int = 3, depth: int = 5, name: str = "parked") -> None:
        self.release_event = threading.Event()
        self.threads = []
        readies = []
        for i in range(count):
            ready = threading.Event()
            t = threading.Thread(target=recurse, args=(depth, ready, self.release_event), name=f"{name}-{i}", daemon=True)
            t.start()  # STARTED
            self.threads.append(t)
            readies.append(ready)
        for ready in readies:
            assert ready.wait(30)

    def release(self) -> None:
        self.release_event.set()
        for t in self.threads:
            t.join(30)

    def __enter__(self) -> "Parked":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _line_of(marker: str) -> int:
    with open(HERE) as f:
        for n, line in enumerate(f, 1):
            if marker in line and "_line_of" not in line:
                return n
    raise LookupError(marker)


def check_against_oracle(parked: Parked) -> dict:
    snaps = monstack.threads()
    for t in parked.threads:
        assert got(snaps[t.ident]) == oracle(t.ident)
        assert got(snaps[t.ident])[-1] == ("recurse", _line_of("the line every parked thread waits at"))
    return snaps


def test_keys_are_the_live_threads():
    with Parked():
        snaps = monstack.threads()
        assert set(snaps) == set(sys._current_frames())
        assert all(isinstance(s, monstack.Snapshot) for s in snaps.values())


def test_not_installed_walks_like_snapshot():
    assert monstack.active_backend() is None
    with Parked() as parked:
        snaps = check_against_oracle(parked)
        assert all(snaps[t.ident].origin is None for t in parked.threads)
        me = monstack.threads()[threading.get_ident()]
        assert got(me)[-1][0] == "test_not_installed_walks_like_snapshot"


@pytest.mark.parametrize("backend", ["auto", "walk"])
def test_matches_the_real_frames(backend):
    monstack.install(backend=backend)
    with Parked(count=4, depth=7) as parked:
        snaps = check_against_oracle(parked)
        started = _line_of("t.start()  # STARTED")
        for t in parked.threads:
            origin = snaps[t.ident].origin
            assert origin is not None and origin.records()[-1][1] == started
        # the calling thread: as snapshot() there
        mine, here = monstack.threads()[threading.get_ident()], monstack.snapshot()
        assert got(mine) == got(here)


@tracking
def test_reads_the_registered_cells_without_copying():
    """With call sites known at push (native callbacks, the 3.11 shim) a thread's answer
    is its cell's top node itself: O(1), no frame walk past its innermost tracked frame."""
    monstack.install()
    with Parked() as parked:
        snaps = check_against_oracle(parked)
        registry = _stack.registered(sys._current_frames())
        for t in parked.threads:
            assert t.ident in registry
            top = registry[t.ident][0]["cell"][0]
            if top[2] != _stack.UNKNOWN:  # (pure-Python callbacks: filled copies)
                assert snaps[t.ident]._node is top


@tracking
def test_a_stale_or_foreign_cell_is_not_trusted():
    """An entry that disagrees with the frames (a dead thread's, under a reused ident) is
    answered from the frames."""
    monstack.install()
    with Parked(count=1) as parked:
        ident = parked.threads[0].ident
        bogus = ({"cell": [(got.__code__, None, 0)]}, None)
        saved = _stack.REGISTRY[ident]
        _stack.REGISTRY[ident] = bogus
        try:
            assert got(monstack.threads()[ident]) == oracle(ident)
            # an entry registered by another Thread object than the one now under the ident
            other = threading.Thread(target=lambda: None)
            _stack.REGISTRY[ident] = (saved[0], weakref.ref(other))
            assert got(monstack.threads()[ident]) == oracle(ident)
        finally:
            _stack.REGISTRY[ident] = saved


@tracking
def test_registry_is_reset_by_install_and_uninstall():
    monstack.install()
    with Parked(count=2) as parked:
        monstack.threads()
        assert {t.ident for t in parked.threads} <= set(_stack.REGISTRY)
        monstack.uninstall()  # a new TLS: at most the thread that made it is registered
        assert set(_stack.REGISTRY) <= {threading.get_ident()}
        monstack.install()
        check_against_oracle(parked)


def pool_job(ready: threading.Event, release: threading.Event) -> None:
    ready.set()
    release.wait()


def test_pool_job_origin_is_its_submit_line():
    monstack.install()
    ready, release = threading.Event(), threading.Event()
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(pool_job, ready, release)  # SUBMIT
        try:
            assert ready.wait(30)
            worker = next(t for t in threading.enumerate() if t.name.startswith("ThreadPoolExecutor"))
            snap = monstack.threads()[worker.ident]
            assert got(snap) == oracle(worker.ident)
            assert snap.origin.records()[-1][1] == _line_of("pool.submit(pool_job, ready, release)  # SUBMIT")
        finally:
            release.set()
        fut.result()
    # between jobs (and after) a worker runs no work: no origin recorded for it
    assert all(_snapshot.running_origin(k) is None for k in _snapshot.RUNNING if k != threading.get_ident())


def test_origin_block_is_visible_from_other_threads():
    monstack.install()
    marker = monstack.snapshot()
    seen = {}
    me = threading.get_ident()

    def look():
        seen["snap"] = monstack.threads()[me]

    with monstack.origin(marker):
        t = threading.Thread(target=look)
        t.start()
        t.join()
    assert seen["snap"].origin is marker
    assert _snapshot.running_origin(me) is None


def test_unreadable_thread_gets_an_empty_snapshot(monkeypatch):
    monstack.install()

    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(_threads, "top_of", broken)
    snaps = monstack.threads()
    assert snaps and all(len(s) == 0 for s in snaps.values())


def test_threads_coming_and_going():
    """Threads start and end while threads() runs: every answer is a Snapshot, and a
    parked thread's is right."""
    monstack.install()
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            ts = [threading.Thread(target=lambda: None) for _ in range(4)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

    churners = [threading.Thread(target=churn, daemon=True) for _ in range(2)]
    for c in churners:
        c.start()
    try:
        with Parked(count=2) as parked:
            for _ in range(200):
                check_against_oracle(parked)
    finally:
        stop.set()
        for c in churners:
            c.join(30)
