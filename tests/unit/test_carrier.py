"""The native origin carrier (``native/carrier.h``, ``_origin.NativeCarrier``): what a
thread pool queues for a plain function where the install's native code runs. It must do
what ``WithOrigin.__call__`` does and answer what ``WithOrigin`` answers."""

from __future__ import annotations

import contextlib
import contextvars
import gc
import os
import pickle
import subprocess
import sys
import threading
import traceback
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

import monstack
from monstack import _capture, _env, _origin, _snapshot
from monstack._points import futures as _futures

from conftest import CONFIG, expected_backend

THIS_FILE = __file__


def line_of(marker: str) -> int:
    with open(THIS_FILE) as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith("# " + marker))


def innermost_line(snap: monstack.Snapshot) -> int:
    return snap.records()[-1][1]


def native_expected() -> bool:
    """Where the suite runs with native code: the 3.12+ callbacks, the 3.11 shim."""
    if sys.version_info >= (3, 12):
        return CONFIG == "native"
    return expected_backend() == "evalframe"


@pytest.fixture
def pool_installed():
    monstack.uninstall()
    monstack.install()
    try:
        with ThreadPoolExecutor(1) as pool:
            yield pool
    finally:
        monstack.uninstall()


@pytest.fixture
def native_new(pool_installed):
    new = _futures._fast[1]
    if new is None:
        pytest.skip("no native code in this configuration")
    return new


def job(*args, **kwargs):
    return args, kwargs, monstack.current_origin()


def failing_job():
    raise ValueError("from the job")


class Stop(BaseException):
    pass


def stopping_job():
    raise Stop()


@contextlib.contextmanager
def work_items():
    """What the pool's work items are made with in the block: a list of the callables."""
    import concurrent.futures.thread as cf_thread

    seen: list = []
    original = cf_thread._WorkItem

    class Recording(original):  # type: ignore[misc, valid-type]
        def __init__(self, future, fn, *rest):
            seen.append(fn[0] if type(fn) is tuple else fn)  # 3.14+: (fn, args, kwargs)
            original.__init__(self, future, fn, *rest)

    cf_thread._WorkItem = Recording
    try:
        yield seen
    finally:
        cf_thread._WorkItem = original


def queued(pool, fn, *args, **kwargs):
    """What the pool's work item holds for ``pool.submit(fn, ...)`` (and the future)."""
    with work_items() as seen:
        future = pool.submit(fn, *args, **kwargs)  # @queued
    return seen[0], future


def test_the_pool_queues_the_native_carrier_where_native_code_runs(pool_installed):
    carried, future = queued(pool_installed, job, 1, k=2)
    args, kwargs, origin = future.result()
    assert (args, kwargs) == ((1,), {"k": 2})
    assert innermost_line(origin) == line_of("@queued")
    if native_expected():
        assert type(carried) is _origin.NativeCarrier, _origin.native_carrier_why
        assert _origin.native_carrier_why == ""
        assert _futures._fast[0] is _capture.running().backend.capture_native
    else:
        assert type(carried) is _origin.WithOrigin
    assert carried.__wrapped__ is job and carried._sent is None


def test_without_native_code_the_python_carrier_is_queued():
    monstack.uninstall()
    kwargs = {"accelerator": False} if sys.version_info >= (3, 12) else {"backend": "walk"}
    monstack.install(**kwargs)
    try:
        with ThreadPoolExecutor(1) as pool:
            carried, future = queued(pool, job)
            assert innermost_line(future.result()[2]) == line_of("@queued")
        assert type(carried) is _origin.WithOrigin
        assert _futures._fast == [_capture.snapshot, None]
    finally:
        monstack.uninstall()


def test_native_carrier_answers_as_the_python_one(native_new):
    snap = monstack.snapshot()
    native, python = native_new(job, snap), _origin.WithOrigin(job, snap)
    assert isinstance(native, _origin.WithOrigin)
    for name in ("__name__", "__qualname__", "__module__", "__doc__", "__wrapped__", "_snap", "_sent"):
        assert getattr(native, name) == getattr(python, name), name
    assert repr(native) == repr(python)
    job.extra = "forwarded"
    try:
        assert native.extra == "forwarded"
    finally:
        del job.extra
    with pytest.raises(AttributeError):
        native._native_table  # the native table is not visible from Python
    # pickled, it arrives as the Python carrier, with the same origin
    back = pickle.loads(pickle.dumps(native))
    assert type(back) is _origin.WithOrigin and back.__wrapped__ is job
    assert back._snap.records() == snap.records()
    assert _origin.has_origin(native)


def test_native_carrier_runs_the_job_under_its_origin(native_new):
    snap = monstack.snapshot()  # @direct
    me = threading.get_ident()
    seen = {}

    def look(a, b=None):
        seen["origin"] = monstack.current_origin()
        seen["running"] = _snapshot.running_origin(me)
        return a, b

    assert native_new(look, snap)(1, b=2) == (1, 2)
    assert seen["origin"] is snap and seen["running"] is snap
    assert _snapshot.running_origin(me) is None and monstack.current_origin() is None
    # inside another origin: both are put back after
    outer = monstack.snapshot()
    with monstack.origin(outer):
        native_new(look, snap)(0)
        assert _snapshot.running_origin(me) is outer and monstack.current_origin() is outer
    assert seen["origin"] is snap


def test_the_native_carrier_writes_the_cell_other_threads_read(native_new):
    # the thread's cell of RUNNING, found through its thread-state dict: the same list
    # running_cell() made, holding the job's origin while it runs and None after
    snap = monstack.snapshot()
    seen = {}

    def look():
        me = threading.get_ident()
        seen["cell"], seen["value"] = _snapshot.RUNNING[me], _snapshot.RUNNING[me][0]
        seen["other"] = monstack.threads()[main]  # (no carrier on the main thread)
        return me

    main = threading.get_ident()
    with ThreadPoolExecutor(1) as pool:  # (a new thread: its first cell)
        carried = native_new(look, snap)
        ident = pool.submit(carried).result()
        assert seen["value"] is snap and seen["cell"] is _snapshot.RUNNING[ident]
        assert _snapshot.RUNNING[ident] == [None] and seen["other"].origin is None
        pool.submit(carried).result()  # (the second time from the thread-state dict)
        assert seen["cell"] is _snapshot.RUNNING[ident] and seen["value"] is snap


def test_a_cell_made_unusable_is_repaired_in_place(native_new):
    # a job that resizes or empties its thread's cell: the carrier still puts back what
    # the cell held, the next carrier repairs it in place (the same list: the native
    # carrier keeps it), and every job runs with its origin visible
    me = threading.get_ident()
    snap = monstack.snapshot()
    cell = _snapshot.running_cell()
    seen = []

    def look():
        seen.append(_snapshot.running_origin(me))

    def grows():
        cell.append("x")

    def empties():
        cell.clear()

    for carrier in (lambda fn: native_new(fn, snap), lambda fn: _origin.WithOrigin(fn, snap)):
        carrier(grows)()
        assert cell[0] is None and _snapshot.RUNNING[me] is cell
        carrier(look)()
        assert cell == [None] and seen.pop() is snap
        carrier(empties)()
        assert cell == [] and monstack.current_origin() is None
        carrier(look)()
        assert cell == [None] and seen.pop() is snap and _snapshot.RUNNING[me] is cell
    with monstack.origin(snap):
        cell.clear()
    assert cell == [] and monstack.current_origin() is None
    native_new(look, snap)()
    assert cell == [None] and seen.pop() is snap


def test_a_job_runs_where_its_thread_gets_no_cell(native_new, monkeypatch):
    # running_cell() failing (as it could at interpreter shutdown): the job runs, under
    # its origin, and other threads do not see it
    snap = monstack.snapshot()
    seen = {}

    def look():
        seen["origin"] = monstack.current_origin()
        return 5

    def broken(ident):
        raise RuntimeError("no cell")

    with ThreadPoolExecutor(1) as pool:  # (a new thread: no cell kept for it yet)
        monkeypatch.setattr(_snapshot, "_running_get", broken)
        assert pool.submit(native_new(look, snap)).result() == 5
        monkeypatch.undo()
        assert seen["origin"] is snap


def test_nested_carriers_are_seen_from_another_thread_at_each_level(native_new):
    # native, then Python, then an origin() block inside one job: another thread sees
    # the innermost at each level, and the outer one again as each ends
    outer, middle, inner = monstack.snapshot(), monstack.snapshot(), monstack.snapshot()
    me = threading.get_ident()
    seen = []

    def read():
        result = []
        t = threading.Thread(target=lambda: result.append(monstack.threads()[me].origin))
        t.start()
        t.join()
        seen.append(result[0])

    def level3():
        with monstack.origin(inner):
            read()
        read()

    def level2():
        read()
        native_new(level3, middle)()
        read()

    _origin.WithOrigin(lambda: native_new(level2, outer)(), middle)()
    assert seen == [outer, inner, middle, outer]
    read()
    assert seen[-1] is None


def test_a_failing_job_puts_the_cell_back(native_new):
    me = threading.get_ident()
    with pytest.raises(ValueError):
        native_new(failing_job, monstack.snapshot())()
    assert _snapshot.running_origin(me) is None and monstack.current_origin() is None


def test_cells_leave_with_their_threads(pool_installed):
    # a pool's threads each get a cell; once they have ended, RUNNING holds none of them
    with ThreadPoolExecutor(3) as pool:
        idents = set(pool.map(lambda _: threading.get_ident(), range(30)))
        workers = list(pool._threads)
    for t in workers:
        t.join()
    assert idents and not idents & set(_snapshot.RUNNING), (idents, _snapshot.RUNNING)


def test_an_entry_that_is_no_cell_is_replaced(pool_installed):
    me = threading.get_ident()
    _snapshot.RUNNING[me] = "not a cell"
    try:
        assert monstack.threads()[me] is not None
        snap = monstack.snapshot()
        assert _origin.WithOrigin(lambda: _snapshot.running_origin(me), snap)() is snap
        assert _snapshot.RUNNING[me] == [None]
    finally:
        _snapshot.running_cell()


def test_a_call_of_a_native_carrier_goes_straight_to_native_code(native_new):
    from monstack import _cdata

    snap = monstack.snapshot()
    carried = native_new(job, snap)
    # called as the pool's worker calls it (a tuple and a dict), as a vectorcall, and
    # through the class's __call__: the same
    assert carried(*(1,), **{"k": 2}) == carried(1, k=2) == _origin.NativeCarrier.__call__(carried, 1, k=2)
    assert carried(1, k=2) == ((1,), {"k": 2}, snap)
    # the type's tp_call is the native code's (not slot_tp_call, which looks __call__ up)
    blob = _capture.running().backend.native_blob
    off_call = _cdata.c_int64.from_address(blob.addr("ms_carrier_layout") + 8 * 5).value
    tp_call = _cdata.c_void_p.from_address(id(_origin.NativeCarrier) + off_call).value
    assert tp_call == blob.addr("ms_carrier_tp_call")


def test_an_exception_from_the_job_gets_the_origin_and_no_carrier_entry(pool_installed):
    future = pool_installed.submit(failing_job)  # @failing
    with pytest.raises(ValueError) as info:
        future.result()
    exc = info.value
    origin = monstack.origin_of(exc)
    assert origin is not None and innermost_line(origin) == line_of("@failing")
    entries = traceback.extract_tb(exc.__traceback__)
    assert entries[-1].name == "failing_job"
    assert entries[-2].name == "run" and entries[-2].filename.endswith("thread.py"), entries
    assert not any("monstack" in e.filename for e in entries), entries


def test_an_exception_keeps_an_origin_it_already_has(native_new):
    inner, outer = monstack.snapshot(), monstack.snapshot()

    def fails():
        raise KeyError("x")

    with pytest.raises(KeyError) as info:
        native_new(native_new(fails, inner), outer)()
    assert monstack.origin_of(info.value) is inner


def test_a_base_exception_passes_without_origin_and_state_is_put_back(native_new):
    me = threading.get_ident()
    with pytest.raises(Stop) as info:
        native_new(stopping_job, monstack.snapshot())()
    assert monstack.origin_of(info.value) is None
    assert _snapshot.running_origin(me) is None and monstack.current_origin() is None
    assert traceback.extract_tb(info.value.__traceback__)[-1].name == "stopping_job"


def test_the_origin_is_reset_in_the_context_it_was_set(native_new):
    snap = monstack.snapshot()
    ctx = contextvars.copy_context()
    assert ctx.run(native_new(monstack.current_origin, snap)) is snap
    assert ctx.get(_snapshot.CURRENT_ORIGIN) is None and monstack.current_origin() is None


def test_a_native_carrier_is_made_by_the_native_code_only(native_new):
    with pytest.raises(TypeError):
        _origin.NativeCarrier(job, monstack.snapshot())
    with pytest.raises(TypeError):
        type("Sub", (_origin.NativeCarrier,), {})
    empty = object.__new__(_origin.NativeCarrier)
    # no table to run with: an error, never a crash (CPython's SystemError, whose message
    # names the callable: here the repr of an empty carrier fails first)
    with pytest.raises((SystemError, AttributeError)):
        empty()
    with pytest.raises(SystemError):
        _origin.NativeCarrier.__call__(empty)
    carried = native_new(job, monstack.snapshot())
    del carried.__wrapped__
    with pytest.raises(AttributeError):
        carried()


def test_the_set_up_refuses_a_blob_without_the_carrier():
    class NoCarrier:
        name = "none"

        def addr(self, symbol):
            raise KeyError(symbol)

    saved = list(_origin._NATIVE), _origin.native_carrier_why
    _origin._NATIVE.clear()
    try:
        assert _origin.native_carrier(None) is None and not _origin._NATIVE  # nothing tried
        assert _origin.native_carrier(NoCarrier()) is None
        assert "KeyError" in _origin.native_carrier_why
        assert _origin.native_carrier(object()) is None  # refused once for the process
    finally:
        _origin._NATIVE[:] = saved[0]
        _origin.native_carrier_why = saved[1]


# -- the native create_task ---------------------------------------------------------------


@pytest.fixture
def loop_installed():
    with loop_installed_here() as loop:  # (installed from the fixture's frame)
        yield loop


def installed_create_task():
    import asyncio.base_events

    return asyncio.base_events.BaseEventLoop.__dict__["create_task"]


def holder_cell(replacement, name="fast"):
    """The list in ``replacement``'s closure cell ``name`` (the native code's holder is its last item)."""
    return replacement.__closure__[replacement.__code__.co_freevars.index(name)].cell_contents


async def failing_task():
    raise ValueError("from the task")


async def origin_inside():
    return monstack.current_origin()


def test_the_loop_runs_the_native_create_task_where_native_code_runs(loop_installed):
    import inspect

    replacement = installed_create_task()
    assert type(replacement) is types.FunctionType  # still a Python function, for other tools

    async def main():
        ran, task = python_calls_of(replacement.__code__, lambda: loop_installed.create_task(origin_inside()))  # @direct_task
        return ran, await task

    ran, origin = loop_installed.run_until_complete(main())
    assert innermost_line(origin) == line_of("@direct_task")
    if native_expected():
        address = _capture.running().backend.native_blob.addr("ms_create_task")
        assert _origin.vectorcall_of(replacement) == address, _origin.native_carrier_why
        assert ran == 0  # its code did not run: the native create_task did its work
    else:
        assert ran == 1
    # it answers inspect as the original does
    monstack.uninstall()
    plain = inspect.signature(loop_installed.create_task)
    monstack.install()
    assert inspect.signature(loop_installed.create_task) == plain
    assert loop_installed.create_task.__qualname__ == "BaseEventLoop.create_task"


def test_a_create_task_rewritten_in_place_runs_its_new_code(loop_installed):
    """A tool that wraps functions by rewriting their code in place (ddtrace): the native
    create_task runs that code, not its own common path."""
    replacement = installed_create_task()
    code = replacement.__code__
    rewritten = code.replace(co_name="rewritten")
    replacement.__code__ = rewritten
    try:
        async def main():
            ran, task = python_calls_of(rewritten, lambda: loop_installed.create_task(origin_inside()))  # @rewritten_task
            return ran, await task

        ran, origin = loop_installed.run_until_complete(main())
        assert ran == 1
        assert innermost_line(origin) == line_of("@rewritten_task")
    finally:
        replacement.__code__ = code


def test_a_create_task_without_its_holder_raises_and_never_crashes(loop_installed):
    if not native_expected():
        pytest.skip("the native create_task's holder")
    replacement = installed_create_task()
    cell = holder_cell(replacement, "_native")
    holder = cell[1]
    coro = origin_inside()
    try:
        cell[1] = None
        with pytest.raises(SystemError):
            loop_installed.create_task(coro)
    finally:
        cell[1] = holder
        coro.close()

    async def main():
        return await loop_installed.create_task(origin_inside())  # @after_holder

    assert innermost_line(loop_installed.run_until_complete(main())) == line_of("@after_holder")


def test_an_error_of_the_snapshot_gives_a_task_without_origin(loop_installed):
    if not native_expected():
        pytest.skip("the native create_task's holder")
    replacement = installed_create_task()
    cell = holder_cell(replacement, "_native")
    holder = cell[1]
    capture_at = holder.index(_capture.running().backend.capture_native)

    def failing_capture():
        raise RuntimeError("no snapshot")

    def stopping_capture():
        raise Stop()

    async def main():
        return await loop_installed.create_task(origin_inside())

    try:
        cell[1] = holder[:capture_at] + (failing_capture,) + holder[capture_at + 1:]
        assert loop_installed.run_until_complete(main()) is None
        cell[1] = holder[:capture_at] + (stopping_capture,) + holder[capture_at + 1:]
        coro = origin_inside()
        with pytest.raises(Stop):
            loop_installed.create_task(coro)
        coro.close()
    finally:
        cell[1] = holder


def test_a_task_runs_and_fails_under_its_creation_origin(loop_installed):
    async def main():
        inside = await loop_installed.create_task(origin_inside())  # @inside
        task = loop_installed.create_task(failing_task(), name="t", context=None)  # @failing_task
        with pytest.raises(ValueError) as info:
            await task
        return inside, info.value

    inside, exc = loop_installed.run_until_complete(main())
    assert innermost_line(inside) == line_of("@inside")
    assert innermost_line(monstack.origin_of(exc)) == line_of("@failing_task")
    assert monstack.current_origin() is None  # reset in the creator's context


def test_off_the_common_path_the_task_still_gets_its_origin(loop_installed):
    import collections.abc

    class Awaitable(collections.abc.Coroutine):
        # a coroutine that is no Python coroutine: its failure is no coroutine exit
        def send(self, value):
            raise ValueError("from a coroutine-like object")

        def throw(self, *args):
            raise ValueError("thrown")

        def close(self):
            pass

        def __await__(self):
            return self

    async def main():
        ctx = contextvars.copy_context()
        in_context = loop_installed.create_task(failing_task(), context=ctx)  # @in_context
        odd = loop_installed.create_task(Awaitable())  # @odd
        for task in (in_context, odd):
            with pytest.raises(ValueError) as info:
                await task
            yield info.value

    async def collect():
        return [exc async for exc in main()]

    in_context, odd = loop_installed.run_until_complete(collect())
    assert innermost_line(monstack.origin_of(in_context)) == line_of("@in_context")
    assert innermost_line(monstack.origin_of(odd)) == line_of("@odd")


@pytest.mark.parametrize("with_context", [False, True])
def test_an_error_of_create_task_has_no_entry_of_monstack(loop_installed, with_context):
    import asyncio

    loop = asyncio.new_event_loop()
    loop.close()
    coro = failing_task()
    kwargs = {"context": contextvars.copy_context()} if with_context else {}
    try:
        with pytest.raises(RuntimeError) as info:
            loop.create_task(coro, **kwargs)
    finally:
        coro.close()
    files = [entry.filename for entry in traceback.extract_tb(info.value.__traceback__)]
    assert not [f for f in files if "monstack" in f and "tests" not in f], files


def test_after_uninstall_a_kept_replacement_calls_through(loop_installed):
    replacement = installed_create_task()
    monstack.uninstall()
    assert installed_create_task() is not replacement  # the original is back

    async def main():
        return await replacement.__get__(loop_installed)(origin_inside())

    assert loop_installed.run_until_complete(main()) is None



# -- the task's context -------------------------------------------------------------------

VAR = contextvars.ContextVar("test_carrier_var")


async def seen_inside():
    """What the task's own context holds: the origin and VAR."""
    return monstack.current_origin(), VAR.get(None)


def context_made_here() -> bool:
    """The native create_task makes tasks' contexts (carrier.h, "The task's context")."""
    return sys.version_info >= (3, 12) and native_expected()


def variables_of(task):
    """The HAMT of the task's context (the one object a Context refers to)."""
    (vars_,) = gc.get_referents(task.get_context())
    return vars_


def test_tasks_at_one_site_share_the_context_variables_made_for_them(loop_installed):
    async def main():
        VAR.set("creator")
        before = contextvars.copy_context()
        tasks = [loop_installed.create_task(seen_inside()) for _ in range(3)]  # @shared_site
        after = contextvars.copy_context()
        return tasks, before, after, await asyncio_gather(*tasks)

    tasks, before, after, seen = loop_installed.run_until_complete(main())
    assert [innermost_line(o) for o, _ in seen] == [line_of("@shared_site")] * 3
    assert [v for _, v in seen] == ["creator"] * 3
    assert dict(after) == dict(before)  # the creator's context as it was (its own origin too)
    if context_made_here():
        assert len({id(o) for o, _ in seen}) == 1  # one snapshot
        assert len({id(t.get_context()) for t in tasks}) == 3  # a Context each
        # the first task's context is a copy of the creator's, the origin set around its
        # creation; from the second on, copies of one template
        assert len({id(variables_of(t)) for t in tasks[1:]}) == 1, "the tasks' contexts share one HAMT"


def test_a_task_sees_the_creator_variables_of_its_own_creation(loop_installed):
    async def main():
        tasks = []
        for i in range(3):
            VAR.set(i)
            tasks.append(loop_installed.create_task(seen_inside()))  # @changing_vars
        return await asyncio_gather(*tasks)

    seen = loop_installed.run_until_complete(main())
    assert [v for _, v in seen] == [0, 1, 2]
    assert {innermost_line(o) for o, _ in seen} == {line_of("@changing_vars")}


@pytest.mark.parametrize("kwargs", [{"name": "n"}, {"name": "n", "context": None}, {"context": None},
                                    {"context": None, "name": "n"}])
def test_the_keywords_reach_create_task(loop_installed, kwargs):
    async def main():
        tasks = [loop_installed.create_task(seen_inside(), **kwargs) for _ in range(3)]  # @keywords
        return tasks, await asyncio_gather(*tasks)

    tasks, seen = loop_installed.run_until_complete(main())
    assert [innermost_line(o) for o, _ in seen] == [line_of("@keywords")] * 3
    if "name" in kwargs:
        assert [t.get_name() for t in tasks] == ["n"] * 3
    if context_made_here():
        assert len({id(variables_of(t)) for t in tasks[1:]}) == 1


def test_a_task_factory_is_called_as_without_monstack(loop_installed):
    made = []

    def factory(loop, coro):  # (no context parameter: create_task passes none)
        import asyncio

        made.append(coro)
        return asyncio.Task(coro, loop=loop)

    loop_installed.set_task_factory(factory)

    async def main():
        return await loop_installed.create_task(seen_inside())  # @with_factory

    origin, _ = loop_installed.run_until_complete(main())
    assert len(made) == 2  # main's task and the one made inside
    assert innermost_line(origin) == line_of("@with_factory")


def test_a_create_task_wrapped_before_install_gets_no_context_keyword():
    """Another tool wrapped create_task first, with no ``context`` parameter: it is called
    exactly as without monstack."""
    import asyncio
    import asyncio.base_events

    cls = asyncio.base_events.BaseEventLoop
    original = cls.__dict__["create_task"]
    calls = []

    def create_task(self, coro, name=None):
        calls.append(name)
        return original(self, coro, name=name)

    monstack.uninstall()
    cls.create_task = create_task
    try:
        monstack.install()
        loop = asyncio.new_event_loop()
        try:
            async def main():
                return await loop.create_task(seen_inside(), name="w")  # @wrapped_first

            origin, _ = loop.run_until_complete(main())
        finally:
            loop.close()
            monstack.uninstall()
    finally:
        cls.create_task = original
    assert "w" in calls
    assert innermost_line(origin) == line_of("@wrapped_first")


def test_the_creator_variables_are_let_go_when_the_creator_returns(loop_installed):
    """What is kept to make the next task's context (the creator's variables) goes when the
    function that created the tasks returns: it keeps no value of that context alive."""
    import weakref

    class Value:
        pass

    async def creator():
        value = Value()
        VAR.set(value)
        tasks = [loop_installed.create_task(seen_inside()) for _ in range(2)]
        await asyncio_gather(*tasks)
        return weakref.ref(value)

    async def main():
        return await loop_installed.create_task(creator())

    ref = loop_installed.run_until_complete(main())
    assert ref() is None, gc.get_referrers(ref())


def test_a_task_class_put_in_asyncio_gets_what_it_got_without_monstack():
    import asyncio
    import asyncio.tasks

    got = []

    class Task(asyncio.tasks._PyTask):
        def __init__(self, coro, **kwargs):
            got.append(sorted(kwargs))
            super().__init__(coro, **kwargs)

    def run():
        loop = asyncio.new_event_loop()
        try:
            async def main():
                tasks = [loop.create_task(seen_inside()) for _ in range(3)]
                return [await t for t in tasks]

            return loop.run_until_complete(main())
        finally:
            loop.close()

    monstack.uninstall()
    original = asyncio.tasks.Task
    asyncio.tasks.Task = Task
    try:
        run()
        without = got[:]
        del got[:]
        monstack.install()
        seen = run()
    finally:
        asyncio.tasks.Task = original
        monstack.uninstall()
    assert got == without
    assert all(o is not None for o, _ in seen)


def test_a_base_exception_reading_the_task_factory_propagates(loop_installed):
    import asyncio

    class Loop(asyncio.SelectorEventLoop):
        stop = False

        @property
        def _task_factory(self):
            if self.stop:  # (the first read only: the one that raises is not read again)
                self.stop = False
                raise Stop()
            return None

        @_task_factory.setter
        def _task_factory(self, value):
            pass

    loop = Loop()
    coro = seen_inside()
    try:
        loop.stop = True
        with pytest.raises(Stop):
            loop.create_task(coro)
    finally:
        coro.close()
        loop.stop = False
        loop.close()


def test_a_variable_set_for_one_task_is_not_kept():
    """A creator that sets a variable for each task it creates and resets it after: nothing
    of that context outlives the task, while the creator still runs."""
    import asyncio
    import weakref

    class Value:
        pass

    def creator():
        value = Value()
        ref = weakref.ref(value)
        token = VAR.set(value)
        task = loop.create_task(seen_inside())
        VAR.reset(token)
        _, seen = loop.run_until_complete(task)
        assert seen is value
        del task, value, seen
        assert ref() is None

    with loop_installed_here() as loop:
        contextvars.copy_context().run(creator)


@contextlib.contextmanager
def loop_installed_here():
    """monstack installed and a new loop, from the test's own frame: unlike an install by a
    fixture, the frames below the test are then on the stack at install, their call sites
    known, so the snapshots of functions the test calls are the native ones, kept (which
    the task's context is made for)."""
    import asyncio

    monstack.uninstall()
    monstack.install()
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        loop.close()
        monstack.uninstall()


def test_tasks_after_the_creator_changes_its_variables_see_the_new_ones():
    def creator(loop):
        VAR.set("a")
        tasks = [loop.create_task(seen_inside()) for _ in range(3)]
        VAR.set("b")
        tasks += [loop.create_task(seen_inside()) for _ in range(3)]
        import asyncio

        return tasks, loop.run_until_complete(asyncio.gather(*tasks))

    with loop_installed_here() as loop:
        tasks, seen = contextvars.copy_context().run(creator, loop)
    assert [v for _, v in seen] == ["a"] * 3 + ["b"] * 3
    assert all(o is not None for o, _ in seen)
    if context_made_here():
        hamts = [id(variables_of(t)) for t in tasks]
        assert hamts[1] == hamts[2] and hamts[4] == hamts[5] and hamts[2] != hamts[5]  # two templates


def test_variables_set_for_each_task_are_not_kept():
    """The same, in a loop (the creator's variables, made anew for each task, may come at
    an address where the last ones were: no template is made for them)."""
    import weakref

    class Value:
        pass

    def creator(loop):
        refs = []
        for _ in range(50):
            value = Value()
            refs.append(weakref.ref(value))
            token = VAR.set(value)
            task = loop.create_task(seen_inside())
            VAR.reset(token)
            loop.run_until_complete(task)
            del task, value
        return [r for r in refs if r() is not None]

    with loop_installed_here() as loop:
        assert contextvars.copy_context().run(creator, loop) == []


def test_the_creator_variables_are_let_go_when_a_plain_creator_returns():
    import weakref

    class Value:
        pass

    def creator(loop, refs):
        value = Value()
        refs.append(weakref.ref(value))
        token = VAR.set(value)
        tasks = [loop.create_task(seen_inside()) for _ in range(3)]
        VAR.reset(token)
        import asyncio

        loop.run_until_complete(asyncio.gather(*tasks))
        shared = context_made_here() and variables_of(tasks[1]) is variables_of(tasks[2])
        del tasks, value
        if shared:
            assert refs[0]() is not None  # (the template's variables hold it)
        return shared

    refs: list = []
    with loop_installed_here() as loop:
        shared = creator(loop, refs)  # (returns: its kept snapshot, and the template, go)
        assert refs[0]() is None
    assert shared == context_made_here()


def test_uninstall_lets_go_of_the_creator_variables():
    import asyncio
    import weakref

    class Value:
        pass

    monstack.uninstall()
    monstack.install()
    loop = asyncio.new_event_loop()
    refs = []

    def creator():
        value = Value()
        refs.append(weakref.ref(value))
        VAR.set(value)
        tasks = [loop.create_task(seen_inside()) for _ in range(2)]
        loop.run_until_complete(asyncio.gather(*tasks))
        del tasks, value
        VAR.set(None)  # (the creator's context no longer holds it)
        kept = monstack.snapshotter()  # (keeps the native state alive past uninstall)
        if context_made_here():
            assert refs[0]() is not None  # (what makes the next task's context holds it)
        monstack.uninstall()  # (while this frame, whose snapshot is kept, still runs)
        assert refs[0]() is None
        del kept

    try:
        contextvars.copy_context().run(creator)
    finally:
        loop.close()
        monstack.uninstall()


def asyncio_gather(*tasks):
    import asyncio

    return asyncio.gather(*tasks)


# -- the native submit --------------------------------------------------------------------


def installed_submit():
    import concurrent.futures.thread as cf_thread

    return cf_thread.ThreadPoolExecutor.__dict__["submit"]


def python_calls_of(code, call):
    """How many times ``code`` ran as Python code (a frame of its own) during ``call()``."""
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code:
            calls.append(frame)

    sys.setprofile(profile)
    try:
        result = call()
    finally:
        sys.setprofile(None)
    return len(calls), result


def test_the_pool_submit_runs_native_code_where_native_code_runs(pool_installed):
    replacement = installed_submit()
    assert type(replacement) is types.FunctionType  # still a Python function, for other tools
    ran, future = python_calls_of(replacement.__code__, lambda: pool_installed.submit(job, 1, k=2))  # @direct-submit
    args, kwargs, origin = future.result()
    assert (args, kwargs) == ((1,), {"k": 2})
    assert innermost_line(origin) == line_of("@direct-submit")
    if native_expected():
        address = _capture.running().backend.native_blob.addr("ms_submit")
        assert _origin.vectorcall_of(replacement) == address, _origin.native_carrier_why
        assert ran == 0  # its code did not run: the native submit did its work
    else:
        assert ran == 1


def test_uninstall_puts_the_identical_submit_back():
    monstack.uninstall()
    before = installed_submit()
    default = _origin.vectorcall_of(job)
    monstack.install()
    try:
        assert installed_submit() is not before
    finally:
        monstack.uninstall()
    assert installed_submit() is before
    assert _origin.vectorcall_of(before) == default  # (None before any native submit)


def test_the_native_submit_passes_arguments_and_results(pool_installed):
    cases = [((), {}), ((1,), {}), ((1, 2), {"k": 3}), (tuple(range(20)), {"k": 1})]
    for args, kwargs in cases:  # (the last: more arguments than the native short path copies)
        carried, future = queued(pool_installed, job, *args, **kwargs)
        got_args, got_kwargs, origin = future.result()
        assert (got_args, got_kwargs) == (args, kwargs)
        assert innermost_line(origin) == line_of("@queued")
        assert type(carried) in _origin.CARRIER_TYPES and carried.__wrapped__ is job
    assert pool_installed.submit(job, fn=4).result()[:2] == ((), {"fn": 4})  # (fn is positional-only)
    # called on the class, unbound
    future = ThreadPoolExecutor.submit(pool_installed, job, 5)  # @unbound
    assert future.result()[0] == (5,) and innermost_line(future.result()[2]) == line_of("@unbound")


class Pool(ThreadPoolExecutor):
    pass


class Owner:
    def method(self):
        return monstack.current_origin()


class DictSubclass(dict):
    pass


def off_path_jobs():
    """(name, callable, whether the native short path takes it): what the Python short path
    would take, and what it leaves to the general path."""
    import functools

    def with_attribute():
        return monstack.current_origin()

    with_attribute.extra = 1

    def with_none_marker():
        return monstack.current_origin()

    with_none_marker._is_coroutine_marker = None

    def with_dict_subclass():
        return monstack.current_origin()

    with_dict_subclass.__dict__ = DictSubclass()
    return [
        ("lambda", lambda: monstack.current_origin(), True),
        ("attribute", with_attribute, True),
        ("none marker", with_none_marker, True),
        ("dict subclass", with_dict_subclass, False),
        ("bound method", Owner().method, False),
        ("partial", functools.partial(monstack.current_origin), False),
        ("builtin", _snapshot.CURRENT_ORIGIN.get, False),
    ]


def test_off_the_short_path_jobs_still_get_their_origins(pool_installed):
    code = installed_submit().__code__
    for name, fn, short in off_path_jobs():
        ran, future = python_calls_of(code, lambda: pool_installed.submit(fn))  # @off-path
        assert innermost_line(future.result()) == line_of("@off-path"), name
        if native_expected():
            assert ran == (0 if short else 1), name
    with Pool(1) as pool:
        ran, future = python_calls_of(code, lambda: pool.submit(job, 1))  # @subclass
        assert innermost_line(future.result()[2]) == line_of("@subclass")
        assert ran == 1


def test_a_marked_coroutine_function_travels_unwrapped(pool_installed):
    def marked():
        raise ValueError("from a marked function")

    marked._is_coroutine_marker = object()  # (what inspect.markcoroutinefunction sets)
    carried, future = queued(pool_installed, marked)
    assert carried is marked
    with pytest.raises(ValueError) as info:
        future.result()
    assert innermost_line(monstack.origin_of(info.value)) == line_of("@queued")  # (attached when done)

    async def coroutine_function():
        return 1

    def generator_function():
        yield 1

    for fn in (coroutine_function, generator_function):  # (what they return runs nowhere)
        carried, future = queued(pool_installed, fn)
        assert carried is fn
        future.result().close()


def test_a_failing_job_off_the_short_path_gets_its_origin(pool_installed):
    import functools

    future = pool_installed.submit(functools.partial(failing_job))  # @failing-partial
    with pytest.raises(ValueError) as info:
        future.result()
    assert innermost_line(monstack.origin_of(info.value)) == line_of("@failing-partial")
    entries = traceback.extract_tb(info.value.__traceback__)
    assert not [e for e in entries if "monstack" in e.filename], entries


def test_an_error_of_submit_has_no_entry_of_monstack(pool_installed):
    import functools

    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    for fn in (job, functools.partial(job)):  # the short path, the general one
        with pytest.raises(RuntimeError) as info:
            pool.submit(fn)
        entries = traceback.extract_tb(info.value.__traceback__)
        assert entries[0].filename == THIS_FILE, entries
        assert not [e for e in entries if "monstack" in e.filename and "tests" not in e.filename], entries
    with pytest.raises(TypeError) as info:
        pool.submit()  # (no fn: the error a call without monstack gives)
    monstack.uninstall()
    with pytest.raises(TypeError) as plain:
        pool.submit()
    assert str(info.value) == str(plain.value)


def test_the_submit_signature_is_the_original_one():
    import inspect

    monstack.uninstall()
    pool = ThreadPoolExecutor(1)
    try:
        plain = inspect.signature(pool.submit), inspect.signature(ThreadPoolExecutor.submit)
        monstack.install()
        try:
            assert (inspect.signature(pool.submit), inspect.signature(ThreadPoolExecutor.submit)) == plain
        finally:
            monstack.uninstall()
    finally:
        pool.shutdown()


def test_after_uninstall_a_kept_submit_calls_through(pool_installed):
    replacement = installed_submit()
    monstack.uninstall()
    assert installed_submit() is not replacement
    ran, future = python_calls_of(replacement.__code__, lambda: replacement(pool_installed, job, 1))
    assert future.result() == ((1,), {}, None)
    if _env.HAS_SYSMON:  # (3.11 without its PEP 523 shim inlines a Python function's call
        # whatever its vectorcall: there its code runs, with the same result)
        assert ran == (0 if native_expected() else 1)


def test_a_submit_rewritten_in_place_runs_its_new_code(pool_installed):
    """A tool that wraps functions by rewriting their code in place (ddtrace): the
    native submit runs that code, not its own short path."""
    replacement = installed_submit()
    code = replacement.__code__
    rewritten = code.replace(co_name="rewritten")
    replacement.__code__ = rewritten
    try:
        ran, future = python_calls_of(rewritten, lambda: pool_installed.submit(job, 1))  # @rewritten
        assert ran == 1
        assert innermost_line(future.result()[2]) == line_of("@rewritten")
    finally:
        replacement.__code__ = code


def test_an_error_of_the_snapshot_lets_the_job_run_without_origin(pool_installed):
    if not native_expected():
        pytest.skip("the native submit's holder")
    fast = holder_cell(installed_submit())
    holder = fast[2]
    capture_at = holder.index(_futures._fast[0])

    def failing_capture():
        raise RuntimeError("no snapshot")

    def stopping_capture():
        raise Stop()

    try:
        fast[2] = holder[:capture_at] + (failing_capture,) + holder[capture_at + 1:]
        carried, future = queued(pool_installed, job, 1)
        assert carried is job and future.result() == ((1,), {}, None)
        fast[2] = holder[:capture_at] + (stopping_capture,) + holder[capture_at + 1:]
        with pytest.raises(Stop):
            pool_installed.submit(job, 1)
        fast[2] = None  # no holder: an error, never a crash
        with pytest.raises(SystemError):
            pool_installed.submit(job, 1)
    finally:
        fast[2] = holder
    assert innermost_line(pool_installed.submit(job).result()[2]) == line_of("@after")  # @after


def reuses_carriers() -> bool:
    """Where the native submit hands a carrier out again: the native snapshot gives the
    same object again at one call site under one origin."""
    return native_expected()


def recorded_submits(pool, calls):
    """What the pool's work items hold for each ``pool.submit(fn, ...)`` of ``calls``
    (``(fn, args)`` pairs, submitted in a loop at one call site), and the futures."""
    with work_items() as seen:
        futures = [pool.submit(fn, *args) for fn, args in calls]  # @loop-submit
    return seen, futures


def make_job():
    def fresh(x):
        return x, monstack.current_origin()

    return fresh


def test_jobs_from_one_call_site_share_a_carrier_let_go_when_one_ends(pool_installed):
    gate = threading.Event()
    busy = pool_installed.submit(gate.wait)  # (a builtin: the general path) the worker waits
    other = make_job()
    try:
        seen, futures = recorded_submits(pool_installed, [(job, (0,)), (job, (1,)), (job, (2,)), (other, (3,))])
        assert [c.__wrapped__ for c in seen] == [job, job, job, other]
        if reuses_carriers():
            assert seen[0] is seen[1] is seen[2] and seen[3] is not seen[0]
            assert _origin.REUSED == [seen[3]]
        else:
            assert len({id(c) for c in seen}) == 4
    finally:
        gate.set()
    busy.result()
    results = [f.result() for f in futures]
    assert [r[0] for r in results[:3]] == [(0,), (1,), (2,)] and results[3][0] == 3
    origins = [r[2] for r in results[:3]] + [results[3][1]]
    assert all(innermost_line(o) == line_of("@loop-submit") for o in origins)
    if reuses_carriers():
        assert origins[0] is origins[1] is origins[2] is origins[3]  # one site, one snapshot
    pool_installed.shutdown(wait=True)
    assert _origin.REUSED == [None]  # let go of when its job ended


def test_jobs_sharing_a_carrier_fail_each_with_the_origin(pool_installed):
    gate = threading.Event()
    pool_installed.submit(gate.wait)
    try:
        seen, futures = recorded_submits(pool_installed, [(failing_job, ()), (failing_job, ())])
    finally:
        gate.set()
    assert (seen[0] is seen[1]) is reuses_carriers()
    for future in futures:
        exc = future.exception()
        assert type(exc) is ValueError and innermost_line(monstack.origin_of(exc)) == line_of("@loop-submit")
        entries = traceback.extract_tb(exc.__traceback__)
        assert not any("monstack" in e.filename for e in entries), entries
    assert futures[0].exception() is not futures[1].exception()


def test_a_function_is_not_kept_alive_by_its_shared_carrier():
    import weakref

    monstack.uninstall()
    monstack.install()
    try:
        fn = make_job()
        ref = weakref.ref(fn)
        with ThreadPoolExecutor(1) as pool:
            seen, futures = recorded_submits(pool, [(fn, (i,)) for i in range(3)])
            assert [f.result()[0] for f in futures] == [0, 1, 2]
        del fn, seen, futures
        gc.collect()  # (the recording class, a cycle, holds the list of carriers)
        assert ref() is None and _origin.REUSED == [None]
    finally:
        monstack.uninstall()


def test_the_carrier_of_a_job_that_never_ran_is_let_go(native_new):
    import weakref

    with ThreadPoolExecutor(1) as pool:
        gate = threading.Event()
        pool.submit(gate.wait)
        try:
            fn = make_job()
            ref = weakref.ref(fn)
            future = pool.submit(fn, 1)
            assert future.cancel()
            del fn
        finally:
            gate.set()
    if reuses_carriers():
        assert type(_origin.REUSED[0]) is _origin.NativeCarrier and ref() is not None
    native_new(job, monstack.snapshot())()  # another carrier's call ends: only REUSED held it
    assert ref() is None and _origin.REUSED == [None]
    fn = make_job()
    ref = weakref.ref(fn)
    with ThreadPoolExecutor(1) as pool:
        gate = threading.Event()
        pool.submit(gate.wait)
        try:
            pool.submit(fn, 1).cancel()
            del fn
        finally:
            gate.set()
    monstack.uninstall()  # lets go of it too
    assert ref() is None and _origin.REUSED == [None]


_FINALIZER_SUBMITS = """
import gc, sys, threading
import concurrent.futures as cf
import concurrent.futures.thread as cf_thread
import monstack
monstack.install()
pool, other = cf.ThreadPoolExecutor(1), cf.ThreadPoolExecutor(1)
gate = threading.Event()
pool.submit(gate.wait)
def job(x):
    return x
def other_job(x):
    return x
ran = []
taking = [True]
class Submits:
    def __del__(self):
        # (not inside submit's lock, where CPython's own submit would deadlock)
        if taking[0] and not cf_thread._global_shutdown_lock.locked():
            ran.append(1)
            other.submit(other_job, 0)
def loop():
    futures = []
    for i in range(200):
        gc.collect()
        garbage = Submits()
        garbage.me = garbage  # a cycle: freed by a collection, at some allocation
        del garbage
        futures.append(pool.submit(job, i))
    return futures
gc.set_threshold(1)
futures = loop()
gc.set_threshold(700)
gate.set()
print(len(ran) > 0, [f.result() for f in futures] == list(range(200)))
gc.collect()
taking[0] = False
pool.shutdown()
other.shutdown()
"""


def test_a_finalizer_that_submits_while_the_carrier_is_made(native_new):
    """Making a carrier allocates, which may run a collection (3.11: on the spot), whose
    finalizers may submit jobs themselves: the kept carrier is then another one (a
    crash when the native submit did not look again)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", _FINALIZER_SUBMITS], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.split() == ["True", "True"], out.stdout
