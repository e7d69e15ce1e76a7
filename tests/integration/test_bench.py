"""The bench machinery (``python -m monstack bench``) on tiny sizes.

No timing assertions -- timing targets live in the bench output only. These tests check
that every figure is actually measured (ops ran, snapshots were taken, frames were
captured), that the JSON has its keys, and that the table renders.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import subprocess
import sys

import pytest

import monstack
from monstack import _bench, _env
from monstack._bench import _harness, _report, _sections, _workloads


def _tracking_available() -> bool:
    return bool(_harness.tracking_backends())


@pytest.fixture(scope="module")
def results():
    monstack.uninstall()
    out = io.StringIO()
    res = _bench.run(as_json=True, file=out, config=_bench.CONFIGS["tiny"]())
    monstack.uninstall()
    parsed = json.loads(out.getvalue())
    return res, parsed


def _positive_summary(s: dict) -> None:
    assert s["n"] >= 1
    assert 0 < s["min"] <= s["median"] <= s["max"]


def test_json_top_level(results):
    res, parsed = results
    for key in ("schema", "python", "machine", "config", "rounds", "sections", "backends",
                "accelerator option", "propagation points", "snapshot", "tax", "opqueue", "memory",
                "warnings", "elapsed seconds", "peak rss bytes", "section seconds"):
        assert key in parsed, key
    assert parsed["python"] == sys.version.split()[0]
    assert parsed["config"] == "tiny"
    assert parsed["sections"] == list(_bench.SECTIONS)
    for section in _bench.SECTIONS:
        assert "error" not in parsed[section], parsed[section].get("traceback")
    assert parsed["peak rss bytes"] > 0


def test_snapshot_section(results):
    _res, parsed = results
    snap = parsed["snapshot"]
    depths = [str(d) for d in snap["depths"]]
    methods = snap["methods"]
    for name in ("monstack walk backend", "plain sys._getframe walk", "asyncio debug (limit=10)",
                 "traceback.extract_stack()", "empty loop (no-op call)"):
        assert name in methods
    if _tracking_available():
        assert _report.main_snapshot_method(methods) is not None
    if "monstack monitoring native, snapshotter()" in methods:  # where the accelerator runs
        row = "monstack monitoring native, snapshotter(), under an origin"
        assert row in methods and snap["backend info"][row].endswith("accelerator: native, origin set")
    for name, per in methods.items():
        for d in depths:
            _positive_summary(per[d])
    for name, per in snap["frames"].items():
        for d in depths:
            if name.startswith("monstack"):
                # the snapshot really covered the stack it was taken in
                assert per[d] >= int(d), (name, d, per[d])
            elif name.startswith(("plain", "traceback")):
                assert per[d] > int(d)
            elif name.startswith("asyncio"):
                assert per[d] == 10


def test_tax_section(results):
    _res, parsed = results
    tax = parsed["tax"]
    workloads = ("call-heavy (fib)", "method-heavy", "generator pipeline", "exception-heavy", "thread pool")
    for wname in workloads:
        assert tax["untracked seconds"][wname] > 0
        assert tax["sizes"][wname] >= 1
        ratios = tax["ratios"][wname]
        if _tracking_available():
            for mode in ("track='all'", "default policy", "workload filtered"):
                _positive_summary(ratios[mode])
        else:
            assert "tracked modes" in tax["skipped"]
    if _harness.EmptyCallbacks.unavailable() is None:
        _positive_summary(tax["ratios"]["call-heavy (fib)"]["empty callbacks"])
    # the thread pool really ran its tasks: warm-up + 2 timed runs per mode per round
    assert tax["pool tasks run"] >= tax["sizes"]["thread pool"] * 2


def test_opqueue_section_really_ran(results):
    _res, parsed = results
    oq = parsed["opqueue"]
    assert oq["framework excluded by default policy"] is True
    assert oq["model tracked by default policy"] is True
    assert oq["ops per run"] > 0
    assert oq["us per op"]["no capture"]["median"] > 0
    expected = {"no capture", _sections.NOISE_FLOOR, "walk per op"}
    if _tracking_available():
        expected |= {"default policy", "track='all'", _sections.FILTERED_FLOOR}
    assert expected <= set(oq["checks"])
    for mode, ck in oq["checks"].items():
        # every op issued reached the worker thread
        assert ck["issued"] > 0 and ck["ran"] == ck["issued"], (mode, ck)
        if mode.startswith("no capture") or "no snapshot" in mode:
            assert ck["snapshots"] == 0, mode
        else:
            # every op took a snapshot, as deep as the user's model code
            assert ck["snapshots"] == ck["issued"], (mode, ck)
            assert oq["snapshot depth"][mode] >= oq["user depth"]
            top = oq["snapshot top"][mode]
            if mode.startswith("track='all'"):
                # the framework is tracked too (unless monstack turned itself off)
                if not oq["ratios"][mode].get("invalid"):
                    assert top.startswith("dispatch "), (mode, top)
            else:
                # the default policy shows the user's line, not the framework's
                assert top.startswith("forward "), (mode, top)
    cross = oq["crossover"]
    if _tracking_available():
        assert len(cross["points"]) == len(_bench.CONFIGS["tiny"]().crossover_layers)
        for p in cross["points"]:
            assert p["op us (no capture)"] > 0
            _positive_summary(p["ratio"])
        assert cross["crossover op us (overhead / 0.10)"] >= 0


def test_memory_section(results):
    _res, parsed = results
    mem = parsed["memory"]
    assert mem["runs"]
    for name, run in mem["runs"].items():
        assert run["snapshots"] > 0
        assert run["bytes per snapshot"] > 0, name
        assert run["frames per snapshot"] >= mem["depth"]
    assert "walk" in mem["liveness"] and "not installed" in mem["liveness"]
    for name, lv in mem["liveness"].items():
        assert lv["local dead without gc"] is True, name
        assert lv["frame objects reachable from snapshots"] == 0, name
        assert lv["snapshot still readable"] is True, name
        assert min(lv["frames per snapshot"]) >= mem["depth"]


def test_table(results):
    _res, parsed = results
    text = io.StringIO()
    _report.print_table(parsed, text)  # renders from the JSON form too
    out = text.getvalue()
    for heading in ("Snapshot:", "Tracking tax:", "Op-queue:", "Memory:"):
        assert heading in out
    for goal in _report.GOALS.values():
        assert f"goal (CPython 3.12): {goal}" in out


def test_dump_section(results):
    """Every figure of the dump section was measured, on the parked threads it says."""
    _res, parsed = results
    d = parsed["dump"]
    assert "error" not in d, d.get("traceback")
    cfg = _bench.CONFIGS["tiny"]()
    assert d["threads"] == cfg.dump_threads and d["depths"] == list(cfg.dump_depths)
    for depth in cfg.dump_depths:
        # the parked threads' stacks were as deep as asked (the workload's at_depth frames)
        assert d["frames per thread"][str(depth)] == depth
        for name in ("monstack.threads()", "monstack.threads(), first call (no fill memo)",
                     "sys._current_frames() + traceback.extract_stack", "sys._current_frames() + frame walk"):
            _positive_summary(d["threads()"][name][str(depth)])
        _positive_summary(d["threads() / extract_stack"][str(depth)])
    _positive_summary(d["threads() depth ratio"])
    assert d["report bytes"] > 0
    for name in ("monstack.dump() (report text, no colour)", "faulthandler.dump_traceback(all_threads=True)"):
        _positive_summary(d["report"][name]["report"])
    _positive_summary(d["report ratios"]["monstack.dump() (report text, no colour)"])


def test_the_bench_package_names_no_issue():
    """The shipped bench states figures and goals, not the project's issue numbers."""
    pkg = os.path.dirname(_bench.__file__)
    found = []
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
            with open(os.path.join(pkg, name), encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if re.search(r"#\d+|issues? \d+", line, re.IGNORECASE):
                        found.append(f"{name}:{n}: {line.strip()}")
    assert found == []


def test_the_rehearsal_variable_is_the_bench_s_own():
    """MONSTACK_BENCH_NO_REHEARSAL is internal: no user's setting, but no misspelling either."""
    from monstack import _settings

    assert _harness.NO_REHEARSAL_ENV in _settings.INTERNAL_VARS
    assert _harness.NO_REHEARSAL_ENV not in [s.var for s in _settings.SETTINGS]
    assert _settings.unknown_variable(_harness.NO_REHEARSAL_ENV) is None


def test_frames_reachable_detects_frames():
    frame = sys._getframe()
    assert _sections.frames_reachable([[(frame,)]]) == 1
    assert _sections.frames_reachable([[(1, 2)]]) == 0


@pytest.mark.skipif(_harness.EmptyCallbacks.unavailable() is not None, reason=str(_harness.EmptyCallbacks.unavailable()))
def test_empty_callbacks_free_their_tool_id():
    before = {t: sys.monitoring.get_tool(t) for t in range(6)}
    empty = _harness.EmptyCallbacks()
    empty.enter()
    try:
        assert sys.monitoring.get_tool(empty.tool) == "monstack-bench-empty"
    finally:
        empty.exit()
    assert {t: sys.monitoring.get_tool(t) for t in range(6)} == before


def test_main_only_section_and_install_state_restored(capsys):
    monstack.uninstall()
    name = monstack.install()
    try:
        assert _bench.main(["--config", "tiny", "--only", "memory", "--json"]) == 0
        assert monstack.active_backend() == name
    finally:
        monstack.uninstall()
    parsed = json.loads(capsys.readouterr().out)
    assert parsed["sections"] == ["memory"]
    assert "snapshot" not in parsed and "memory" in parsed


def test_unknown_section_is_refused():
    with pytest.raises(ValueError, match="valid choices"):
        _bench.run(file=io.StringIO(), config=_bench.CONFIGS["tiny"](), sections=["nope"])


def test_opqueue_cost_script_runs(tmp_path):
    """bench/opqueue_cost.py (the README's instruction counts and long pair runs) works
    on this checkout: a tiny pairs run and a tiny instructions run."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "bench", "opqueue_cost.py")
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, script, "pairs", "1", "240", "--no-worker"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    for row in ("no capture again", "every code filtered", "installed, no snapshot", "snapshotter()", "snapshot()"):
        assert row in out.stdout
    out = subprocess.run([sys.executable, script, "instructions", "snapshotter", "240"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    if _env.HAS_SYSMON:
        out = subprocess.run([sys.executable, script, "floor", "1"],
                             capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        for row in ("no tool again", "PY_START ", "PY_START/RESUME/RETURN/YIELD", "CALL "):
            assert row in out.stdout
    out = subprocess.run([sys.executable, script, "ab", "1", "1", root, root],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("snapshotter  median") == 2


def test_each_measurement_renews_the_workload_before_entering_its_mode():
    """``fresh`` runs before every measurement, outside the mode (see _harness._measure)."""
    calls: list = []
    m = _harness.Mode("m", lambda: calls.append("enter"), lambda: calls.append("exit"))
    base = _harness.Mode("base", lambda: calls.append("enter base"), lambda: calls.append("exit base"))
    _harness.interleaved(lambda: calls.append("work"), [m], 2, fresh=lambda: calls.append("fresh"))
    assert calls == ["fresh", "enter", "work", "work", "work", "exit"] * 2
    calls.clear()
    _harness.paired(lambda: calls.append("work"), base, [m], 1, fresh=lambda: calls.append("fresh"))
    assert calls == (["fresh", "enter base", "work", "work", "work", "exit base",
                      "fresh", "enter", "work", "work", "work", "exit"])


def test_opqueue_renew_gives_new_code_objects_and_a_worker_that_runs_every_op():
    oq = _workloads.OpQueue(_workloads.make_workloads(), _workloads.make_framework(), 48, 5)
    try:
        oq.configure(False)
        oq.run()
        first_worker = oq._running[1]
        code = oq.w.Linear.forward.__code__
        oq.renew()
        assert oq._running is None and not first_worker.thread.is_alive()
        assert oq.w.Linear.forward.__code__ is not code
        if _tracking_available():
            monstack.install()
            oq.configure(True)
        oq.run()
        oq.run()  # the same worker thread serves both runs
        assert oq.issued == oq.ran == 3 * oq.ops
        assert oq.snapshots == (2 * oq.ops if _tracking_available() else 0)
    finally:
        oq.close()
        monstack.uninstall()


@pytest.mark.skipif(sys.version_info[:2] != (3, 12), reason="3.12's superinstructions (3.13 has none)")
def test_312_code_once_monitored_loses_its_superinstructions_for_good():
    """Why the bench renews its workload per measurement: on 3.12, code that ran while
    monstack (any sys.monitoring tool) had events set keeps plain instructions where it
    had superinstructions, after uninstall too."""
    import dis

    if "monitoring" not in _harness.tracking_backends():
        pytest.skip("needs the monitoring backend")
    ns: dict = {}
    exec("def f(a, b):\n    return a + b\n", ns)
    f = ns["f"]
    ops = lambda: {i.opname for i in dis.get_instructions(f, adaptive=True)}  # noqa: E731
    f(1, 2)
    assert "LOAD_FAST__LOAD_FAST" in ops()
    monstack.install(track="all")
    try:
        f(1, 2)
    finally:
        monstack.uninstall()
    f(1, 2)
    assert "LOAD_FAST__LOAD_FAST" not in ops()


def _experiment(name: str):
    """(checkout root, path, module) of bench/experiments/NAME.py."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "bench", "experiments", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"monstack_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return root, path, mod


def _opqueue_parts():
    return _experiment("opqueue_parts")


def _skip_unless_the_blob_builds(root: str, parts) -> None:
    """Skip unless a ``*_parts.py`` experiment can build the running CPython's native blob
    here and this configuration runs native code."""
    from conftest import CONFIG

    try:
        blob = parts.blob_name()
    except parts.Refused as exc:
        pytest.skip(str(exc))
    if CONFIG == "python":
        pytest.skip("the variants measure native code (this configuration turns it off)")
    sys.path.insert(0, os.path.join(root, "tests", "unit"))  # test_native's loader of native/build.py
    from test_native import _build_module

    build = _build_module()
    t = build.target(blob)
    why = build.why_not(t, "x86_64", build.find_include(t.python, t.headers))
    if why:
        pytest.skip(why)


def test_opqueue_parts_edits_still_apply_to_the_native_source():
    """bench/experiments/opqueue_parts.py takes the native snapshot apart by editing
    native/sysmon.c: each edit must still find its text exactly once (update EDITS when
    the source changes), and the tool refuses one that does not, in one line."""
    root, _path, parts = _opqueue_parts()
    with open(os.path.join(root, "native", "sysmon.c")) as f:
        text = f.read()
    assert parts.edited_source(text, "shipped") == text
    for variant, (old, new) in parts.EDITS.items():
        edited = parts.edited_source(text, variant)
        assert edited != text and edited.count(new) == 1, variant
    with pytest.raises(parts.Refused, match="no-walk: its edit no longer applies"):
        parts.edited_source(text.replace(parts.EDITS["no-walk"][0], ""), "no-walk")


def test_opqueue_parts_refuses_bad_input_in_one_line():
    _root, path, _parts = _opqueue_parts()
    for args, msg in ((["variants", "--only", "bogus"], "unknown variant 'bogus'"),
                      (["variants", "--procs", "0"], "--procs and --pairs must be at least 1"),
                      (["probes", "0"], "ROUNDS must be at least 1")):
        out = subprocess.run([sys.executable, path, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and out.stdout == "", out
        assert out.stderr.startswith(f"opqueue_parts: {msg}") and out.stderr.count("\n") == 1, out.stderr


def test_opqueue_parts_builds_a_variant_that_loads_and_measures_it():
    """One variant built, loaded natively and measured (one process, one pair): the tool
    works on this checkout. Needs the compiler and headers of the running CPython's blob."""
    root, path, parts = _opqueue_parts()
    _skip_unless_the_blob_builds(root, parts)
    out = subprocess.run([sys.executable, path, "variants", "--only", "call-only", "--procs", "1", "--pairs", "1"],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [ln.split() for ln in out.stdout.splitlines()[2:]]
    assert [r[0] for r in rows] == ["shipped", "call-only"], out.stdout
    for r in rows:
        assert 0.5 < float(r[1]) < 3 and 0.5 < float(r[2]) < 3, out.stdout


def _pool_parts():
    return _experiment("pool_parts")


def test_pool_parts_edits_still_apply_to_the_native_source():
    """bench/experiments/pool_parts.py takes the native submit and carrier apart by editing
    native/carrier.h: each edit must still find its text exactly once, in order (update
    EDITS when the source changes), and the tool refuses one that does not, in one line."""
    root, _path, parts = _pool_parts()
    with open(os.path.join(root, "native", "carrier.h")) as f:
        text = f.read()
    assert parts.edited_source(text, "shipped") == text
    for variant, edits in parts.EDITS.items():
        edited = parts.edited_source(text, variant)
        assert edited != text and all(edited.count(new) == 1 for _old, new in edits), variant
    with pytest.raises(parts.Refused, match="no-carrier: its edit no longer applies"):
        parts.edited_source(text.replace(parts.EDITS["no-carrier"][0][0], ""), "no-carrier")


def test_pool_parts_refuses_bad_input_in_one_line():
    _root, path, _parts = _pool_parts()
    for args, msg in ((["variants", "--only", "bogus"], "unknown variant 'bogus'"),
                      (["variants", "--procs", "0"], "--procs must be at least 1"),
                      (["variants", "--cpu", "100000"], "--cpu 100000: not one of the CPUs")):
        out = subprocess.run([sys.executable, path, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and out.stdout == "", out
        assert out.stderr.startswith("pool_parts: ") and out.stderr.count("\n") == 1, out.stderr
        if not out.stderr.startswith("pool_parts: the variants are of the sysmon blob"):  # (3.11)
            assert out.stderr.startswith(f"pool_parts: {msg}"), out.stderr


def test_pool_parts_builds_a_variant_that_loads_and_measures_it():
    """One variant built, loaded natively and measured (one process each): the tool works
    on this checkout. Needs the compiler and headers of the running CPython's blob."""
    root, path, parts = _pool_parts()
    _skip_unless_the_blob_builds(root, parts)
    out = subprocess.run([sys.executable, path, "variants", "--only", "no-state", "--procs", "1"],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [ln.split() for ln in out.stdout.splitlines()[2:]]
    assert [r[0] for r in rows] == ["off", "shipped", "no-state"], out.stdout
    for r in rows:
        assert len(r) == 8 and 0.3 < float(r[1]) < 100 and 0.3 < float(r[5]) < 100, out.stdout
        assert r[7].endswith("x") and float(r[7][:-1]) > 0, out.stdout


def test_hop_wallclock_refuses_bad_input_in_one_line():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "bench", "hop_wallclock.py")
    for args, env, msg in ((["pool", "0", "off"], {}, "usage: "),
                           (["nothing", "1", "off"], {}, "usage: "),
                           (["pool", "1", "default"], {}, "the modes must include off"),
                           (["pool", "1", "off"], {"PIN": "100000"}, "PIN=100000: not a comma-separated list"),
                           (["pool", "1", "off"], {"PIN": "x"}, "PIN=x: not a comma-separated list")):
        out = subprocess.run([sys.executable, path, *args], capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, **env))
        assert out.returncode == 2 and out.stdout == "", out
        assert out.stderr.startswith(f"hop_wallclock: {msg}") and out.stderr.count("\n") == 1, out.stderr
