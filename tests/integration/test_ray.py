"""The ``ray`` propagation point: a failed Ray task, actor creation or actor method raises
on the driver with the ``.remote()`` line that submitted it, shown exactly once.

Every test here is marked ``integration``: one local Ray instance for the module
(``ray.init(num_cpus=1, include_dashboard=False, object_store_memory=80 MB)``, a temporary
``HOME`` and temp dir, usage stats off), whose workers run with ``MONSTACK=1`` (the job's
``runtime_env``) and import the tasks of ``programs/ray_tasks.py``. Needs ray (the
``engines`` extra, where Ray has wheels); where it is missing the tests skip with the
reason, and fail in CI unless Ray has no release for this CPython."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import traceback
from typing import Any, Iterator

import pytest

import stackcheck
from conftest import engine_module

import monstack
from monstack import _propagate
from monstack._errors import MonstackWarning

ray = engine_module("ray")

from monstack import _points  # noqa: E402
from monstack._points import ray as _ray  # noqa: E402

PROGRAMS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "programs")
sys.path.insert(0, PROGRAMS)
import ray_tasks  # noqa: E402

pytestmark = pytest.mark.integration

THIS_FILE = __file__
line_of = stackcheck.marker_lines(__file__)
tasks_line = stackcheck.marker_lines(ray_tasks.__file__)


#: The workers' environment (the job's runtime_env): monstack on, this tree and the tasks importable.
WORKER_ENV = {"MONSTACK": "1", "RAY_USAGE_STATS_ENABLED": "0",
              "PYTHONPATH": os.pathsep.join([PROGRAMS] + [p for p in sys.path if p])}


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """One local Ray instance for the module (about 5-8 s to start here)."""
    saved = {k: os.environ.get(k) for k in ("HOME", "RAY_USAGE_STATS_ENABLED")}
    home = tempfile.mkdtemp(prefix="monstack-ray-home-")
    temp = tempfile.mkdtemp(prefix="msr", dir="/tmp")  # (Ray's socket paths must stay short)
    os.environ["HOME"] = home
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    try:
        context = ray.init(num_cpus=1, include_dashboard=False, object_store_memory=80 * 1024**2,
                           _temp_dir=temp, log_to_driver=False, runtime_env={"env_vars": WORKER_ENV})
        yield context.address_info["address"]
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(temp, ignore_errors=True)


def where(marker: str, path: str = THIS_FILE, lines: Any = line_of) -> str:
    return f'File "{path}", line {lines(marker)}'


def assert_shown_once(exc: BaseException, marker: str) -> str:
    """The report shows the ``.remote()`` line at ``marker`` exactly once, after the
    traceback; the exception itself (its text, notes, a plain traceback) is Ray's."""
    text = monstack.format_exception(exc, color=False)
    assert text.count(where(marker)) == 1, text
    assert text.count("Work created at (most recent call last):") == 1, text
    assert text.find(where(marker)) > text.find("Work created at"), text
    plain = "".join(traceback.format_exception(exc))
    assert "Work created at" not in plain and where(marker) not in plain, plain
    assert "Work created at" not in str(exc)
    return text


# -- tasks ------------------------------------------------------------------------------------------


def test_a_failing_task_shows_the_remote_line_once(cluster, installed):
    ref = ray_tasks.boom.remote(1)  # @task
    with pytest.raises(ValueError, match="boom 1") as info:
        ray.get(ref)
    exc = info.value
    assert isinstance(exc, ray.exceptions.RayTaskError)
    snap = monstack.origin_of(exc)
    assert snap is not None and snap.records()[-1][:2] == (THIS_FILE, line_of("task"))
    text = assert_shown_once(exc, "task")
    assert where("boom", ray_tasks.__file__, tasks_line) in text  # the worker's frame, in Ray's text
    assert "monstack" not in str(exc)


def test_await_and_future_get_the_origin_too(cluster, installed):
    async def main() -> BaseException:
        ref = ray_tasks.boom.remote("await")  # @await
        try:
            await ref
        except ValueError as exc:
            return exc
        raise AssertionError("no error")

    assert_shown_once(asyncio.run(main()), "await")
    future = ray_tasks.boom.remote("future").future()  # @future
    with pytest.raises(ValueError, match="boom future") as info:
        future.result(timeout=60)
    assert_shown_once(info.value, "future")


def test_options_and_a_list_of_refs(cluster, installed):
    refs = [ray_tasks.ok.remote(1), ray_tasks.boom.options(name="named").remote("list")]  # @list
    with pytest.raises(ValueError, match="boom list") as info:
        ray.get(refs)
    assert_shown_once(info.value, "list")


def test_a_succeeding_task_is_unaffected(cluster):
    results = []
    for points in (True, [p for p in monstack.PROPAGATION_POINTS if p != "ray"]):
        monstack.install(propagate=points)
        try:
            ref = ray_tasks.ok.remote(41)
            results.append(ray.get(ref))
            assert ref.binary() not in _ray._REFS  # fetched: its snapshot is dropped
        finally:
            monstack.uninstall()
    assert results == [{"x": 42, "list": [1, "two", 3.0], "none": None}] * 2


def test_point_off_attaches_nothing(cluster):
    monstack.install(propagate=[p for p in monstack.PROPAGATION_POINTS if p != "ray"])
    try:
        ref = ray_tasks.boom.remote("off")
        with pytest.raises(ValueError) as info:
            ray.get(ref)
    finally:
        monstack.uninstall()
    assert monstack.origin_of(info.value) is None and not _ray._REFS


def test_a_task_that_submits_a_task_chains_the_origins(cluster, installed):
    ref = ray_tasks.outer.remote("nested")  # @outer
    with pytest.raises(ValueError, match="boom nested") as info:
        ray.get(ref)
    text = monstack.format_exception(info.value, color=False)
    inner = text.find(where("inner-submit", ray_tasks.__file__, tasks_line), text.find("Work created at"))
    chained = text.find("Which ran in work created at")
    assert 0 < inner < chained < text.find(where("outer")), text
    assert text.count(where("outer")) == 1 and text.count("Which ran in") == 1, text
    snap = monstack.origin_of(info.value)
    assert snap.records()[-1][:2] == (ray_tasks.__file__, tasks_line("inner-submit"))
    assert snap.origin.records()[-1][:2] == (THIS_FILE, line_of("outer"))


# -- actors ------------------------------------------------------------------------------------------


def test_a_failing_actor_method_shows_its_remote_line(cluster, installed):
    counter = ray_tasks.Counter.remote()
    assert ray.get(counter.add.remote(2)) == 2
    ref = counter.fail.remote("m")  # @method-call
    with pytest.raises(ValueError, match="method m") as info:
        ray.get(ref)
    assert_shown_once(info.value, "method-call")
    assert where("method", ray_tasks.__file__, tasks_line) in str(info.value)
    ray.kill(counter)


def test_a_failing_actor_creation_shows_the_creating_line(cluster, installed):
    counter = ray_tasks.Counter.remote(fail=True)  # @create
    ref = counter.add.remote(1)
    with pytest.raises(ray.exceptions.ActorDiedError) as info:
        ray.get(ref)
    assert "init failed" in str(info.value)
    assert_shown_once(info.value, "create")


# -- the rest ------------------------------------------------------------------------------------------


def test_notes_mode_adds_the_note_once(cluster, tmp_path):
    """In notes mode (not under pytest: a driver of its own, connected to the module's
    instance) the exception a plain traceback prints shows the line once."""
    script = tmp_path / "notes_driver.py"
    script.write_text(textwrap.dedent(f"""\
        import sys, traceback
        sys.path.insert(0, {PROGRAMS!r})
        import monstack
        monstack.install(notes=True)
        import ray, ray_tasks
        ray.init(address={cluster!r}, log_to_driver=False, runtime_env={{"env_vars": {WORKER_ENV!r}}})
        for make in (lambda: ray_tasks.outer.remote("n"), lambda: ray_tasks.boom.remote("n")):
            try:
                ray.get(make())
            except ValueError as exc:
                traceback.print_exception(exc, file=sys.stdout)
                print("=" * 20)
        """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([p for p in sys.path if p]))
    for name in [n for n in env if n.startswith("MONSTACK")]:
        del env[name]
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    nested, plain, _ = out.stdout.split("=" * 20 + "\n")
    driver = f'File "{script}", line 9'
    for text in (nested, plain):
        assert text.count("Work created at (most recent call last):") == 1, text
        assert text.count(driver) == 2, text  # the traceback's frame, and the note's
    inner = where("inner-submit", ray_tasks.__file__, tasks_line)
    assert nested.count(inner) == 1 and nested.count("Which ran in work created at") == 1, nested


def test_refs_kept_are_bounded(cluster, installed, monkeypatch):
    monkeypatch.setattr(_ray, "MAX_REFS", 3)
    _ray._REFS.clear()
    refs = [ray_tasks.inc.remote(i) for i in range(5)]
    assert list(_ray._REFS) == [r.binary() for r in refs[-3:]]
    assert ray.get(refs) == [1, 2, 3, 4, 5] and not _ray._REFS


def test_a_failure_inside_the_point_warns_and_the_task_runs_on(cluster, installed, monkeypatch):
    def broken(result: Any, snap: Any) -> None:
        raise RuntimeError("inside")

    monkeypatch.setattr(_ray, "_remember", broken)
    monkeypatch.setattr("monstack._errors._said", set())  # (said once per process)
    with pytest.warns(MonstackWarning, match="monstack-point-failed: the ray point failed in submit"):
        ref = ray_tasks.inc.remote(1)
    assert ray.get(ref) == 2


def test_ray_is_not_imported_by_install():
    code = "import sys, monstack; monstack.install(); print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("MONSTACK", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_an_unsupported_ray_is_reported_and_left_alone(cluster, monkeypatch):
    monkeypatch.setitem(_points.MIN_VERSIONS, "ray", (99, 0))
    with pytest.warns(MonstackWarning, match="could not patch propagation point 'ray'"):
        monstack.install()
    try:
        assert "needs ray >= 99.0" in _propagate.FAILED["ray"]
        assert not [a for o, a, _ in _propagate.patched() if str(getattr(o, "__module__", "")).startswith("ray")]
        with pytest.raises(ValueError) as info:
            ray.get(ray_tasks.boom.remote("old"))
        assert monstack.origin_of(info.value) is None
    finally:
        monstack.uninstall()


def test_uninstall_puts_rays_methods_back(cluster):
    owners = [(ray.remote_function.RemoteFunction, "_remote"), (ray.actor.ActorClass, "_remote"),
              (ray.actor.ActorMethod, "_remote"), (ray._private.worker.Worker, "deserialize_objects")]
    before = [owner.__dict__[name] for owner, name in owners]
    monstack.install()
    assert [owner.__dict__[name] for owner, name in owners] != before
    monstack.uninstall()
    assert all(owner.__dict__[name] is b for (owner, name), b in zip(owners, before))


def test_the_oldest_supported_version_is_what_is_installed_or_newer():
    version = tuple(int(p) for p in ray.__version__.split(".")[:2])
    assert version >= _points.MIN_VERSIONS["ray"]
    _ray.recognise()
