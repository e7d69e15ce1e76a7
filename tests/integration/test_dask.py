"""The ``dask`` propagation point (monstack/_points/dask.py) against a real
``distributed.LocalCluster`` with worker processes on 127.0.0.1 (one cluster for the
module: the workers boot monstack themselves, from ``MONSTACK=1`` in their environment)."""

from __future__ import annotations

import functools
import operator
import os
import sys
import warnings

import pytest
from conftest import engine_module

distributed = engine_module("distributed")

import dask_tasks as tasks  # noqa: E402

import monstack  # noqa: E402
from monstack import _format, _propagate  # noqa: E402
from monstack._points import dask as _dask  # noqa: E402
from monstack._errors import MonstackWarning  # noqa: E402

TASKS = tasks.__file__
THIS = __file__


def line_of(tag: str) -> int:
    return tasks.line_of(tag, THIS)


def notes(exc: BaseException) -> str:
    """The origin chain a report shows for ``exc`` (its origin travels with it, as the
    worker attached it or the client did; the exception gets no note)."""
    assert not getattr(exc, "__notes__", None), exc.__notes__
    snap = monstack.origin_of(exc)
    return "".join(_format.format_origin(snap)) if snap is not None else ""


# -- without a cluster ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [
    tasks.inc, lambda x: x, functools.partial(operator.add, 1), len, operator.methodcaller("upper"),
    tasks.Unpicklable,
], ids=["function", "lambda", "partial", "builtin", "methodcaller", "class"])
def test_the_wrapper_is_named_and_tokenized_as_the_function(installed, fn):
    from dask.base import tokenize
    from dask.utils import funcname

    wrapped = _dask._carried(fn, monstack.snapshot())
    assert isinstance(wrapped, _dask._Submitted)
    assert funcname(wrapped) == funcname(fn)
    assert tokenize(wrapped, {}, 1, "a") == tokenize(fn, {}, 1, "a")
    assert tokenize(tokenize(wrapped, {"k": 2}), (3,)) == tokenize(tokenize(fn, {"k": 2}), (3,))


def test_coroutine_functions_and_wrapped_functions_travel_as_they_are(installed):
    async def coro(x):
        return x

    w = monstack.wrap(tasks.inc)
    snap = monstack.snapshot()
    assert _dask._carried(coro, snap) is coro
    assert _dask._carried(w, snap) is w


def test_the_wrapper_pickles_as_itself_and_keeps_its_token(installed):
    import pickle

    from dask.base import tokenize
    from dask.utils import funcname

    fn = functools.partial(operator.add, 1)
    wrapped = _dask._carried(fn, monstack.snapshot())  # @pickled
    back = pickle.loads(pickle.dumps(wrapped))
    assert type(back) is _dask._Submitted and back(1) == 2
    assert back._snap.records()[-1][:2] == (THIS, line_of("pickled"))
    assert funcname(back) == funcname(fn) and tokenize(back) == tokenize(fn)
    assert back._sent == wrapped._sent  # passed on (scheduler -> worker) as it came
    again = pickle.loads(pickle.dumps(back))
    assert again._snap is back._snap  # each distinct snapshot is unpickled once


def test_a_received_task_tokenizes_where_the_point_is_not_installed(installed):
    import pickle

    from dask.base import tokenize

    data = pickle.dumps(_dask._carried(tasks.inc, monstack.snapshot()))
    monstack.uninstall()
    _dask._DASK.clear()  # a worker that never patched: normalize_token is looked up
    assert tokenize(pickle.loads(data)) == tokenize(tasks.inc)


def test_an_unrecognised_distributed_is_reported_and_left_alone(monkeypatch):
    client_mod = sys.modules["distributed.client"]

    def set_error(self, exception, traceback, extra):  # not the signature the patch knows
        pass

    monkeypatch.setattr(client_mod.FutureState, "set_error", set_error)
    originals = {a: client_mod.Client.__dict__[a] for a in ("submit", "map", "_release_key")}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        monstack.install()
    assert "dask" in _propagate.FAILED and "FutureState.set_error" in _propagate.FAILED["dask"]
    assert any(issubclass(w.category, MonstackWarning) and "'dask'" in str(w.message) for w in seen)
    assert all(client_mod.Client.__dict__[a] is o for a, o in originals.items())
    assert client_mod.FutureState.__dict__["set_error"] is set_error
    assert "threading" not in _propagate.FAILED  # the other points are in place


def test_install_patches_and_uninstall_restores_the_dask_point():
    client_mod = sys.modules["distributed.client"]
    targets = [(client_mod.Client, a) for a in ("submit", "map", "_release_key")]
    targets.append((client_mod.FutureState, "set_error"))
    originals = {t: t[0].__dict__[t[1]] for t in targets}
    monstack.install(propagate=["dask"])
    assert all(t[0].__dict__[t[1]] is not o for t, o in originals.items())
    assert "dask" not in _propagate.FAILED
    monstack.uninstall()
    assert all(t[0].__dict__[t[1]] is o for t, o in originals.items())


def test_install_imports_no_engine_and_patches_distributed_when_the_program_imports_it():
    import subprocess
    import textwrap

    code = textwrap.dedent(
        """
        import sys, monstack
        monstack.install()
        engine = {"dask", "distributed", "monstack._dask"} & set(sys.modules)
        assert not engine, sorted(engine)
        import distributed
        from monstack import _propagate
        names = sorted((o.__name__, a) for o, a, _x in _propagate.patched()
                       if getattr(o, "__module__", None) == "distributed.client")
        assert names == [("Client", "_release_key"), ("Client", "map"), ("Client", "submit"),
                         ("FutureState", "set_error")], names
        assert "dask" not in _propagate.FAILED
        monstack.uninstall()
        assert not _propagate.patched()
        print("ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env.pop("MONSTACK", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# -- a real cluster ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    """Two single-thread worker processes; each boots monstack from MONSTACK=1 (the
    environment a spawned worker inherits), and a dead one is not retried."""
    import dask

    monstack.uninstall()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MONSTACK", "1")
        with dask.config.set({"distributed.scheduler.allowed-failures": 0,
                              "distributed.worker.daemon": False}):
            lc = distributed.LocalCluster(
                n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                host="127.0.0.1", worker_dashboard_address=None,
            )
    try:
        yield lc
    finally:
        lc.close()


@pytest.fixture
def client(cluster):
    """A client made after install(), as a program with MONSTACK=1 makes it."""
    monstack.install()
    with distributed.Client(cluster) as c:
        yield c


def _raised(future) -> BaseException:
    with pytest.raises(Exception) as info:
        future.result(timeout=60)
    return info.value


@pytest.mark.integration
def test_submit_runs_under_the_submitting_line_and_its_failure_shows_it(client):
    fn, ln, backend, text = client.submit(tasks.origin_here, pure=False).result(timeout=60)  # @here
    assert (fn, ln) == (THIS, line_of("here"))
    assert backend is not None  # the worker booted monstack from MONSTACK=1
    assert text is not None and text.strip().startswith("fn, ln, backend, text = client.submit(")
    future = client.submit(tasks.fail, 1)  # @submit
    _dask.stop()  # the client cannot attach it: the origin comes from the worker
    exc = _raised(future)
    assert isinstance(exc, ValueError) and str(exc) == "task failed on 1"
    text = notes(exc)
    assert text.startswith(_format.ORIGIN_HEADING)
    assert f'File "{THIS}", line {line_of("submit")}, in test_submit' in text
    assert "future = client.submit(tasks.fail, 1)  # @submit" in text
    assert text.count("Work created at") == 1


@pytest.mark.integration
def test_map_carries_its_line_and_keys_and_sharing_do_not_change(client):
    futures = client.map(tasks.fail, [1, 2])  # @map
    exc = _raised(futures[1])
    assert f'line {line_of("map")}, in test_map' in notes(exc)
    # keys are Dask's own: the same with the point off, and pure submits share one future
    with_point = ([f.key for f in client.map(tasks.inc, [5, 6])], client.submit(tasks.inc, 7).key,
                  client.submit(tasks.fail, 8).key)
    first = client.submit(tasks.fail, 9)  # @first
    second = client.submit(tasks.fail, 9)  # @second
    assert first.key == second.key
    text = notes(_raised(second))
    assert f'line {line_of("first")}, in test_map' in text and f'line {line_of("second")},' not in text
    monstack.uninstall()
    without = ([f.key for f in client.map(tasks.inc, [5, 6])], client.submit(tasks.inc, 7).key,
               client.submit(tasks.fail, 8).key)
    assert with_point == without
    assert [f.result(timeout=60) for f in client.map(tasks.inc, [5, 6])] == [6, 7]


@pytest.mark.integration
def test_a_task_that_submits_a_task_shows_both_lines(client):
    exc = _raised(client.submit(tasks.submit_inner, 3))  # @outer
    text = notes(exc)
    inner = f'File "{TASKS}", line {tasks.line_of("inner-submit")}, in submit_inner'
    outer = f'File "{THIS}", line {line_of("outer")}, in test_a_task'
    assert inner in text and outer in text and text.index(inner) < text.index(outer)
    assert "Which ran in work created at" in text
    assert str(exc) == "task failed on 3"


@pytest.mark.integration
@pytest.mark.parametrize("task", [tasks.fail_unpicklable, tasks.fail_long], ids=["unpicklable", "too-long"])
def test_exceptions_dask_replaces_get_the_origin_on_the_client(client, task):
    exc = _raised(client.submit(task, 4))  # @replaced
    assert not isinstance(exc, tasks.Unpicklable)
    assert f'line {line_of("replaced")}, in test_exceptions' in notes(exc)


@pytest.mark.integration
def test_the_point_switched_off_carries_nothing(cluster):
    points = [p for p in _propagate.PROPAGATION_POINTS if p != "dask"]
    monstack.install(propagate=points)
    with distributed.Client(cluster) as c:
        fn, _ln, backend, _text = c.submit(tasks.origin_here, pure=False).result(timeout=60)
        assert fn is None or fn != THIS
        exc = _raised(c.submit(tasks.fail, 5))  # @off
    assert f'line {line_of("off")},' not in notes(exc)
    assert _dask._ORIGINS == {}


@pytest.mark.integration
def test_a_worker_that_dies_mid_task_shows_the_origin_on_killedworker(client):
    exc = _raised(client.submit(tasks.die, 6))  # @dies
    assert type(exc).__name__ == "KilledWorker"
    assert f'line {line_of("dies")}, in test_a_worker' in notes(exc)
