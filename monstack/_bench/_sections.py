"""The bench's four sections: snapshot cost, tracking tax, op-queue, memory.

Each takes the run's ``Config`` and the workload module and returns a JSON-ready dict;
``_report`` prints them.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import statistics
import sys
import time
import traceback
import types
from typing import Any, Callable, Optional, Sequence

import monstack

from ._harness import (
    Config,
    EmptyCallbacks,
    Mode,
    accelerator_variants,
    backend_reasons,
    best,
    calibrate,
    installer,
    interleaved,
    mark_invalid,
    nothing,
    paired,
    propagation_points,
    ratios,
    summary,
    tracking_backends,
)
from ._report import main_snapshot_method
from ._workloads import FRAMEWORK_MODULE, WORKLOAD_MODULE, OpQueue, make_framework, make_workloads

# ---------------------------------------------------------------------------------------------
# Snapshot cost
# ---------------------------------------------------------------------------------------------


def _plain_walk() -> list:
    f: Optional[types.FrameType] = sys._getframe(1)
    out = []
    while f is not None:
        out.append((f.f_code, f.f_lasti))
        f = f.f_back
    return out


def _asyncio_debug() -> traceback.StackSummary:
    # asyncio.format_helpers.extract_stack, as asyncio's debug mode calls it per task/handle
    stack = traceback.StackSummary.extract(traceback.walk_stack(sys._getframe(1)), limit=10, lookup_lines=False)
    stack.reverse()
    return stack


def _find_attr(candidates: Sequence[tuple[str, str]]) -> Optional[Callable]:
    for module, attr in candidates:
        try:
            obj: Any = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except Exception:
            continue
        if callable(obj):
            return obj
    return None


def _native_captures() -> dict[str, Callable[[], Any]]:
    """jax's and torch's native stack capture, when those packages import (else nothing)."""
    out: dict[str, Callable[[], Any]] = {}
    if importlib.util.find_spec("jax") is not None or importlib.util.find_spec("jaxlib") is not None:
        fn = _find_attr([
            ("jax._src.lib", "_jax.Traceback.get_traceback"),
            ("jax._src.lib", "xla_client.Traceback.get_traceback"),
            ("jaxlib.xla_extension", "Traceback.get_traceback"),
            ("jaxlib.xla_client", "Traceback.get_traceback"),
        ])
        if fn is not None:
            out["jax Traceback.get_traceback"] = fn
    if importlib.util.find_spec("torch") is not None:
        gather = _find_attr([("torch._C._profiler", "gather_traceback")])
        if gather is not None:
            out["torch gather_traceback"] = lambda: gather(True, False, False)
        extract = _find_attr([("torch.utils._traceback", "CapturedTraceback.extract")])
        if extract is not None:
            out["torch CapturedTraceback.extract"] = extract
    for name, fn in list(out.items()):
        try:
            fn()
        except Exception:
            del out[name]
    return out


def _frames_in(result: Any) -> Optional[int]:
    for attr in ("frames", "summary"):
        try:
            value = getattr(result, attr)
            value = value() if callable(value) and attr == "summary" else value
            return len(value)
        except Exception:
            pass
    try:
        return len(result)
    except Exception:
        pass
    # torch gather_traceback's torch._C._profiler.CapturedTraceback is opaque until symbolized
    profiler = sys.modules.get("torch._C._profiler")
    if profiler is not None and isinstance(result, getattr(profiler, "CapturedTraceback", ())):
        try:
            return len(profiler.symbolize_tracebacks([result])[0])
        except Exception:
            pass
    return None


def snapshot_costs(cfg: Config, w: Any = None) -> dict:
    """Seconds per capture at each depth for each method; frames each capture returned."""
    w = w or make_workloads()
    at_depth, snap_loop = w.at_depth, w.snap_loop
    snap = monstack.snapshot
    accel, _why = accelerator_variants()

    methods: list[tuple[str, Any, Mode]] = []
    none = Mode("none", nothing, nothing)
    for backend in tracking_backends():
        if accel and backend == "monitoring":
            methods.append((f"monstack {backend} native", snap, Mode("n", installer(backend=backend, accelerator=True), nothing)))
            # resolved after install: the function a framework binds once
            methods.append((f"monstack {backend} native, snapshotter()", _LATE_SNAPSHOTTER,
                            Mode("s", installer(backend=backend, accelerator=True), nothing)))
            methods.append((f"monstack {backend} pure-Python", snap, Mode("p", installer(backend=backend, accelerator=False), nothing)))
            # every thread, pool job and task started after install() has an origin
            # (the snapshot links to it: another native branch)
            methods.append((f"monstack {backend} native, snapshotter(), under an origin", _LATE_SNAPSHOTTER,
                            _under_origin("o", installer(backend=backend, accelerator=True))))
        else:
            methods.append((f"monstack {backend}", snap, Mode("m", installer(backend=backend), nothing)))
    methods.append(("monstack walk backend", snap, Mode("w", installer(backend="walk"), nothing)))
    methods.append(("plain sys._getframe walk", _plain_walk, none))
    methods.append(("asyncio debug (limit=10)", _asyncio_debug, none))
    methods.append(("traceback.extract_stack()", traceback.extract_stack, none))
    for name, fn in _native_captures().items():
        methods.append((name, fn, none))
    methods.append(("empty loop (no-op call)", w.noop, none))
    skipped = {} if len(_native_captures_names(methods)) else {"jax/torch": "not importable"}

    out: dict = {"unit": "seconds per capture", "depths": list(cfg.depths), "methods": {}, "frames": {}, "backend info": {}}
    for name, _fn, _mode in methods:
        out["methods"][name] = {}
        out["frames"][name] = {}
    sizes: dict = {}
    for depth in cfg.depths:
        for name, fn, mode in methods:
            mode.enter()
            try:
                fn = _resolve(fn)
                sizes[name, depth] = calibrate(lambda n, fn=fn: at_depth(depth, snap_loop, fn, n), cfg.target, 16)  # type: ignore[misc]
                got = at_depth(depth, fn)
                out["frames"][name][str(depth)] = _frames_in(got)
                if mode.info:
                    out["backend info"][name] = mode.info
            finally:
                mode.exit()
    # Rounds outermost, so that every ratio (between methods, between depths) compares
    # figures measured moments apart; the order of the methods rotates each round.
    per: dict = {(name, depth): [] for name, _f, _m in methods for depth in cfg.depths}
    k = len(methods)
    for r in range(cfg.rounds):
        for depth in cfg.depths:
            for name, fn, mode in methods[r % k:] + methods[: r % k]:
                n = sizes[name, depth]
                mode.enter()
                try:
                    fn = _resolve(fn)
                    at_depth(depth, snap_loop, fn, max(1, n // 4))  # warm-up
                    t = best(lambda: at_depth(depth, snap_loop, fn, n))
                finally:
                    mode.exit()
                per[name, depth].append(t / n)
    for (name, depth), values in per.items():
        out["methods"][name][str(depth)] = summary(values)
    main = main_snapshot_method(out["methods"])
    out["main method"] = main
    if main is not None:
        # per-round ratios: method / main at the same depth, and main at depth d / depth 10
        out["ratio to main"] = {
            name: {
                str(d): summary([a / b for a, b in zip(per[name, d], per[main, d])]) for d in cfg.depths
            }
            for name, _f, _m in methods if name != main
        }
        d0 = cfg.depths[0]
        out["main depth ratios"] = {
            f"{d}/{d0}": summary([a / b for a, b in zip(per[main, d], per[main, d0])]) for d in cfg.depths[1:]
        }
    out["skipped"] = skipped
    return out


_LATE_SNAPSHOTTER = object()  # a snapshot method standing for monstack.snapshotter() after install


def _under_origin(name: str, enter: Callable[[], str]) -> Mode:
    """``enter``, then a current origin set in this context, as a started thread has."""
    from monstack import _snapshot

    tokens: list = []

    def go() -> str:
        info = enter()
        tokens.append(_snapshot.CURRENT_ORIGIN.set(monstack.snapshot()))
        return info + ", origin set"

    def leave() -> None:
        while tokens:
            _snapshot.CURRENT_ORIGIN.reset(tokens.pop())
        monstack.uninstall()

    return Mode(name, go, leave)


def _resolve(fn: Any) -> Callable:
    return monstack.snapshotter() if fn is _LATE_SNAPSHOTTER else fn


def _native_captures_names(methods: list) -> list:
    return [m[0] for m in methods if m[0].startswith(("jax", "torch"))]


# ---------------------------------------------------------------------------------------------
# Tracking tax
# ---------------------------------------------------------------------------------------------


def _modes_for_tax(*, filtered: bool, default: bool = True, extra: Sequence[Mode] = ()) -> tuple[list[Mode], dict]:
    accel, accel_why = accelerator_variants()
    skipped: dict = {}
    modes = [Mode("no monstack", nothing, nothing)]
    empty = EmptyCallbacks()
    why = empty.unavailable()
    if why is None:
        modes.append(Mode("empty callbacks", empty.enter, empty.exit))
    else:
        skipped["empty callbacks"] = why
    tracking = tracking_backends()
    if not tracking:
        skipped["tracked modes"] = "no tracking backend can run here: " + "; ".join(
            f"{k}: {v}" for k, v in backend_reasons().items() if v
        )
        return modes + list(extra), skipped
    modes.append(Mode("track='all'", installer(track="all"), nothing))
    if accel and "monitoring" in tracking:
        modes.append(Mode("track='all', pure-Python", installer(track="all", accelerator=False), nothing))
    else:
        skipped["native vs pure-Python callbacks"] = accel_why or "needs the monitoring backend"
    if default:
        modes.append(Mode("default policy", installer(), nothing))
    if filtered:
        modes.append(Mode("workload filtered", installer(exclude=[WORKLOAD_MODULE]), nothing))
    return modes + list(extra), skipped


def tracking_tax(cfg: Config, w: Any = None) -> dict:
    """Tracked time / untracked time per workload and mode."""
    w = w or make_workloads()
    monstack.uninstall()
    sizes: dict[str, int] = {}
    nfib = 10
    while True:  # fib size with >= target untracked
        if best(lambda: w.fib(nfib)) >= cfg.target or nfib >= 32:
            break
        nfib += 1
    sizes["call-heavy (fib)"] = nfib
    for name, fn, start in (
        ("method-heavy", w.method_heavy, 64),
        ("generator pipeline", w.gen_pipeline, 256),
        ("exception-heavy", w.exception_heavy, 64),
        ("mixed", w.mixed, 64),
    ):
        fn(start)
        sizes[name] = calibrate(fn, cfg.target, start)
    sizes["thread pool"] = cfg.pool_tasks
    sizes["asyncio tasks"] = cfg.async_tasks
    # the warm-up runs a quarter of the size: enough to decide the policy and specialise
    # each measurement gets new code objects (see _measure): cur[0] is the live module
    cur = [w]
    pool_done = [0]

    def fresh() -> None:
        pool_done[0] += cur[0].POOL_DONE[0]
        cur[0] = make_workloads()

    q = lambda name: max(1, sizes[name] // 4)  # noqa: E731
    work: dict[str, tuple[Callable, Optional[Callable]]] = {
        "call-heavy (fib)": (lambda: cur[0].fib(nfib), lambda: cur[0].fib(max(1, nfib - 3))),
        "method-heavy": (lambda: cur[0].method_heavy(sizes["method-heavy"]), lambda: cur[0].method_heavy(q("method-heavy"))),
        "generator pipeline": (lambda: cur[0].gen_pipeline(sizes["generator pipeline"]), lambda: cur[0].gen_pipeline(q("generator pipeline"))),
        "exception-heavy": (lambda: cur[0].exception_heavy(sizes["exception-heavy"]), lambda: cur[0].exception_heavy(q("exception-heavy"))),
        "mixed": (lambda: cur[0].mixed(sizes["mixed"]), lambda: cur[0].mixed(q("mixed"))),
        "thread pool": (lambda: cur[0].pool_run(cfg.pool_tasks), lambda: cur[0].pool_run(q("thread pool"))),
        "asyncio tasks": (lambda: cur[0].tasks_run(cfg.async_tasks), lambda: cur[0].tasks_run(q("asyncio tasks"))),
    }
    hops = {"thread pool": cfg.pool_tasks, "asyncio tasks": cfg.async_tasks}
    propagation = propagation_points()
    extra = []
    if propagation:
        extra.append(Mode("default, propagate=False", installer(propagate=False), nothing))
    out: dict = {"sizes": sizes, "untracked seconds": {}, "ratios": {}, "mode info": {}, "skipped": {},
                 "us per hop": {}}
    if not cfg.diagnostics:
        del work["mixed"], sizes["mixed"]
        out["note"] = ("quick: the default policy is measured on the hop workloads only (on the other workloads, "
                       "which call no library code, it tracks what track='all' tracks); no mixed workload")
    for wname, (fn, warm) in work.items():
        modes, skipped = _modes_for_tax(
            filtered=True,
            default=cfg.diagnostics or wname in hops,
            extra=extra if wname in hops and cfg.diagnostics else (),
        )
        out["skipped"].update(skipped)
        rounds = cfg.pool_rounds if wname == "thread pool" else cfg.rounds
        times = interleaved(fn, modes, rounds, warm=warm, fresh=fresh)
        out["untracked seconds"][wname] = statistics.median(times["no monstack"])
        out["ratios"][wname] = ratios(times, "no monstack", modes)
        if wname in hops:  # a hop's cost: (mode - no monstack) / hops, per round
            n = hops[wname]
            out["us per hop"][wname] = {
                "no monstack": summary([t / n * 1e6 for t in times["no monstack"]]),
                **{name: summary([(t - b) / n * 1e6 for t, b in zip(ts, times["no monstack"])])
                   for name, ts in times.items() if name != "no monstack"},
            }
        for m in modes:
            if m.info:
                out["mode info"][m.name] = m.info
    out["pool tasks run"] = pool_done[0] + cur[0].POOL_DONE[0]
    return out


# ---------------------------------------------------------------------------------------------
# Op-queue
# ---------------------------------------------------------------------------------------------


NOISE_FLOOR = "no capture again (noise)"
#: installed with every code object of the workload excluded, no snapshot: what the
#: tracking machinery costs before monstack tracks anything (on 3.12, CPython's own
#: instrumentation: code instrumented once loses its superinstructions for good)
FILTERED_FLOOR = "every code filtered, no snapshot"


def _opqueue_modes(oq: OpQueue, diagnostics: bool = True) -> tuple[list[Mode], dict]:
    accel, _why = accelerator_variants()
    skipped: dict = {}

    def with_capture(enter: Callable[[], Any], capture: Any) -> Callable[[], Any]:
        def go() -> Any:
            info = enter()
            oq.configure(capture)
            return info

        return go

    modes = [Mode("no capture", with_capture(nothing, False), nothing)]
    # the same as the base, paired like every mode: how far from 1.00 noise alone moves a ratio
    modes.append(Mode(NOISE_FLOOR, with_capture(nothing, False), nothing))
    if tracking_backends():
        modes.append(Mode("default policy", with_capture(installer(), True), nothing))
        modes.append(Mode(FILTERED_FLOOR, with_capture(installer(exclude=[WORKLOAD_MODULE]), False), nothing))
        modes.append(Mode("default policy, snapshot()", with_capture(installer(), "snapshot"), nothing))
        if accel and "monitoring" in tracking_backends():
            modes.append(Mode("default policy, pure-Python", with_capture(installer(accelerator=False), True), nothing))
        if diagnostics and propagation_points():
            modes.append(Mode("default, propagate=False", with_capture(installer(propagate=False), True), nothing))
        if diagnostics:
            modes.append(Mode("default policy, no snapshot", with_capture(installer(), False), nothing))
        modes.append(Mode("track='all'", with_capture(installer(track="all"), True), nothing))
    else:
        skipped["tracked modes"] = "no tracking backend can run here"
    modes.append(Mode("walk per op", with_capture(installer(backend="walk"), True), nothing))
    return modes, skipped


def opqueue(cfg: Config, w: Any = None) -> dict:
    w = w or make_workloads()
    fw = make_framework()
    fw.LAYERS = cfg.opqueue_layers
    oq = OpQueue(w, fw, cfg.opqueue_ops, cfg.opqueue_depth)
    try:
        return _opqueue_run(cfg, oq)
    finally:
        oq.fw._capture = None
        oq.close()


def _opqueue_run(cfg: Config, oq: OpQueue) -> dict:
    fw, w = oq.fw, oq.w
    out: dict = {
        "ops per run": oq.ops,
        "user depth": cfg.opqueue_depth,
        "dispatch layers per op": cfg.opqueue_layers,
        "helper calls per op": 8 * cfg.opqueue_layers + 2,
    }
    # The policy really treats the framework as a library and the model as user code.
    try:
        from monstack._policy import Policy

        pol = Policy("user")
        out["framework excluded by default policy"] = not pol.is_tracked(fw.dispatch.__code__, FRAMEWORK_MODULE)
        out["model tracked by default policy"] = pol.is_tracked(w.Linear.forward.__code__, WORKLOAD_MODULE)
    except Exception as exc:  # pragma: no cover
        out["policy check failed"] = repr(exc)

    modes, skipped = _opqueue_modes(oq, cfg.diagnostics)
    per_mode: dict[str, dict] = {m.name: {"issued": 0, "ran": 0, "snapshots": 0} for m in modes}
    last_snap: dict[str, Any] = {}

    def account(name: str) -> None:
        rec = per_mode[name]
        rec["issued"] += oq.issued
        rec["ran"] += oq.ran
        rec["snapshots"] += oq.snapshots
        if oq.last_snapshot is not None:
            last_snap[name] = oq.last_snapshot
        oq.issued = oq.ran = oq.snapshots = 0
        oq.last_snapshot = None

    pairs = paired(oq.run, modes[0], modes[1:], cfg.opqueue_rounds, warm=oq.warm, after=account, fresh=oq.renew)
    base = [b for ps in pairs.values() for b, _ in ps]
    out["ratios"] = {name: summary([t / b for b, t in ps]) for name, ps in pairs.items()}
    mark_invalid(out["ratios"], modes)
    out["us per op"] = {"no capture": summary([b / oq.ops * 1e6 for b in base])}
    out["us per op"].update({name: summary([t / oq.ops * 1e6 for _, t in ps]) for name, ps in pairs.items()})
    out["overhead us per op"] = {name: summary([(t - b) / oq.ops * 1e6 for b, t in ps]) for name, ps in pairs.items()}
    out["method"] = "paired: each mode measured back to back with no capture, per-pair ratios"
    out["checks"] = per_mode
    out["snapshot depth"] = {}
    out["snapshot top"] = {}
    for name, snap in last_snap.items():
        try:
            out["snapshot depth"][name] = len(snap)
            top = snap.frames[-1]
            out["snapshot top"][name] = f"{top.name} ({os.path.basename(top.filename)})"
        except Exception as exc:
            out["snapshot top"][name] = f"unreadable: {exc!r}"
    out["mode info"] = {m.name: m.info for m in modes if m.info}
    out["skipped"] = skipped
    out["crossover"] = _crossover(cfg, oq, out)
    return out


def _crossover(cfg: Config, oq: OpQueue, main: dict) -> dict:
    """Default policy / no capture as the op gets lighter (fewer dispatch layers)."""
    if not tracking_backends():
        return {"skipped": "no tracking backend can run here"}
    def no_capture() -> None:
        nothing()
        oq.configure(False)

    def default_policy() -> None:
        installer()()
        oq.configure(True)

    none = Mode("no capture", no_capture, nothing)
    tracked = Mode("default policy", default_policy, nothing)
    points = []
    for layers in cfg.crossover_layers:
        oq.fw.LAYERS = layers
        ps = paired(oq.run, none, [tracked], cfg.crossover_rounds, warm=oq.warm, fresh=oq.renew)["default policy"]
        base_us = statistics.median([b for b, _ in ps]) / oq.ops * 1e6
        overhead_us = statistics.median([(t - b) / oq.ops * 1e6 for b, t in ps])
        ratio = summary([t / b for b, t in ps])
        points.append({
            "dispatch layers": layers,
            "helper calls per op": 8 * layers + 2,
            "op us (no capture)": base_us,
            "overhead us per op": overhead_us,
            "ratio": ratio,
        })
    oq.fw.LAYERS = cfg.opqueue_layers
    oq.issued = oq.ran = oq.snapshots = 0
    # The overhead is what monstack adds per op whatever the op's weight (a snapshot from
    # the same frames, the same tracked user calls): take it from the main run (more ops,
    # more rounds); the sweep shows the ratios directly.
    main_overhead = main["overhead us per op"].get("default policy", {}).get("median")
    if main_overhead is None:
        main_overhead = statistics.median([p["overhead us per op"] for p in points])
    per_op = max(main_overhead, 0.0)
    # the lightest op measured whose ratio stays <= 1.10, and the op cost where it would cross
    ok = [p["op us (no capture)"] for p in points if p["ratio"]["median"] <= 1.10]
    return {
        "points": points,
        "overhead us per op (main run)": per_op,
        "crossover op us (overhead / 0.10)": per_op / 0.10,
        "lightest measured op within 1.10x (us)": min(ok) if ok else None,
    }


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


def _rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except Exception:
        return None


def peak_rss_bytes() -> int:
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _bytes_per_snapshot(w: Any, fill: Callable, n: int, depth: int) -> dict:
    import tracemalloc

    out: dict = {"snapshots": n}
    # pass 1: RSS (no tracemalloc overhead); pass 2: tracemalloc (exact Python allocations)
    holder: list = [None] * n
    gc.collect()
    rss0 = _rss_bytes()
    t0 = time.perf_counter()
    w.at_depth(depth, fill, holder, n)
    out["seconds per snapshot"] = (time.perf_counter() - t0) / n
    rss1 = _rss_bytes()
    out["frames per snapshot"] = len(holder[-1])
    if rss0 is not None and rss1 is not None:
        out["rss bytes per snapshot"] = (rss1 - rss0) / n
    holder = [None] * n
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        w.at_depth(depth, fill, holder, n)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    out["bytes per snapshot"] = (after - before) / n
    del holder
    gc.collect()
    return out


def frames_reachable(roots: Sequence[Any], limit: int = 100_000) -> int:
    """Frame objects reachable from ``roots`` through gc referents (bounded search)."""
    seen: set[int] = set()
    todo = list(roots)
    frames = 0
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FrameType):
            frames += 1
            continue
        if isinstance(obj, (types.ModuleType, type)):
            continue  # modules/classes reach everything; frames would not hide there
        todo.extend(gc.get_referents(obj))
    return frames


def _liveness(w: Any, depth: int) -> dict:
    ref, snaps = w.liveness(depth)
    dead_without_gc = ref() is None
    gc.collect()
    dead = ref() is None
    text = str(snaps[0])
    return {
        "snapshots held": len(snaps),
        "frames per snapshot": [len(s) for s in snaps],
        "local dead without gc": dead_without_gc,
        "local dead after gc": dead,
        "frame objects reachable from snapshots": frames_reachable(snaps),
        "snapshot still readable": "_take_snaps" in text,
    }


def memory(cfg: Config, w: Any = None) -> dict:
    w = w or make_workloads()
    out: dict = {"depth": cfg.memory_depth, "runs": {}, "liveness": {}}
    try:
        from monstack._snapshot import Snapshot  # noqa: F401

        probe_mode = installer()
        probe_mode()
        s = w.at_depth(3, w._leaf)
        out["sys.getsizeof(snapshot)"] = sys.getsizeof(s)
        out["sys.getsizeof(node)"] = sys.getsizeof(s._node) if getattr(s, "_node", None) is not None else None
    except Exception:
        pass
    finally:
        monstack.uninstall()
    backends: list[tuple[str, dict, int]] = []
    for backend in tracking_backends():
        backends.append((backend, dict(backend=backend), cfg.memory_snapshots))
    backends.append(("walk", dict(backend="walk"), cfg.memory_walk_snapshots))
    rss_start = _rss_bytes()
    for name, opts, n in backends:
        monstack.uninstall()
        info = installer(**opts)()
        try:
            out["runs"][f"{name}, same frame"] = dict(_bytes_per_snapshot(w, w.snap_fill, n, cfg.memory_depth), backend=info)
            out["runs"][f"{name}, new frame each"] = dict(_bytes_per_snapshot(w, w.snap_fill_fresh, n, cfg.memory_depth), backend=info)
            out["liveness"][name] = _liveness(w, cfg.memory_depth)
        finally:
            monstack.uninstall()
    monstack.uninstall()
    out["liveness"]["not installed"] = _liveness(w, cfg.memory_depth)
    out["rss at start bytes"] = rss_start
    out["peak rss bytes"] = peak_rss_bytes()
    return out


# ---------------------------------------------------------------------------------------------
# Dump: threads() and the hang report, beside sys._current_frames() and faulthandler
# ---------------------------------------------------------------------------------------------


class _Parked:
    """``count`` threads parked ``depth`` calls deep in workload (tracked) code."""

    def __init__(self, w: Any, count: int, depth: int) -> None:
        import threading

        self.release = threading.Event()
        self.threads = []
        readies = []
        for _ in range(count):
            ready = threading.Event()

            def park(ready: Any = ready) -> None:
                w.at_depth(depth, _park_leaf, ready, self.release)

            t = threading.Thread(target=park, daemon=True)
            t.start()
            self.threads.append(t)
            readies.append(ready)
        for ready in readies:
            ready.wait(60)

    def close(self) -> None:
        self.release.set()
        for t in self.threads:
            t.join(60)


def _park_leaf(ready: Any, release: Any) -> None:
    ready.set()
    release.wait()


def _threads_cold() -> Any:
    """threads() as its first call on these stacks: call sites the native callbacks left
    unknown (a thread that never took a snapshot) filled from the frames again."""
    from monstack import _stack

    _stack.FILLED.clear()
    return monstack.threads()


def _frames_and_extract_stack() -> int:
    frames = sys._current_frames()
    n = 0
    for frame in frames.values():
        n += len(traceback.extract_stack(frame))
    return n


def _frames_and_walk() -> int:
    frames = sys._current_frames()
    n = 0
    for frame in frames.values():
        f: Optional[types.FrameType] = frame
        while f is not None:
            f.f_code, f.f_lasti
            f = f.f_back
            n += 1
    return n


def _py_spy() -> Optional[str]:
    import shutil

    exe = shutil.which("py-spy")
    if exe is None:
        scripts = os.path.join(os.path.dirname(sys.executable), "py-spy")
        exe = scripts if os.path.exists(scripts) else None
    return exe


def _timed(fn: Callable[[], Any], target: float) -> Callable[[], float]:
    """A function timing ``fn`` (seconds per call, best of two loops of >= ``target``)."""
    n = calibrate(lambda k: [fn() for _ in range(k)], target)

    def measure() -> float:
        fn()  # warm-up
        return best(lambda: [fn() for _ in range(n)]) / n

    return measure


def dump_costs(cfg: Config, w: Any = None) -> dict:
    """``threads()`` for ``dump_threads`` parked threads at each of ``dump_depths`` (and the
    same threads through ``sys._current_frames()`` plus ``traceback.extract_stack``), and
    the whole report (``dump``) at ``dump_report_depth`` beside ``faulthandler``."""
    import faulthandler
    import subprocess

    from monstack import _dump

    w = w or make_workloads()
    out: dict = {"unit": "seconds per call", "threads": cfg.dump_threads, "depths": list(cfg.dump_depths),
                 "report depth": cfg.dump_report_depth, "threads()": {}, "report": {}}
    monstack.uninstall()
    out["backend"] = installer()()
    devnull = open(os.devnull, "w")
    try:
        per: dict = {}
        for r in range(cfg.rounds):
            for depth in cfg.dump_depths:
                parked = _Parked(w, cfg.dump_threads, depth)
                try:
                    for name, fn in (("monstack.threads()", monstack.threads),
                                     ("monstack.threads(), first call (no fill memo)", _threads_cold),
                                     ("sys._current_frames() + traceback.extract_stack", _frames_and_extract_stack),
                                     ("sys._current_frames() + frame walk", _frames_and_walk)):
                        per.setdefault((name, depth), []).append(_timed(fn, cfg.target)())
                    if r == 0:
                        snaps = monstack.threads()
                        out.setdefault("frames per thread", {})[str(depth)] = max(
                            len(snaps[t.ident]) for t in parked.threads if t.ident is not None)
                finally:
                    parked.close()
            parked = _Parked(w, cfg.dump_threads, cfg.dump_report_depth)
            try:
                fd = devnull.fileno()
                methods = [("monstack.dump() (report text, no colour)", lambda: _dump.report(color=False)),
                           ("faulthandler.dump_traceback(all_threads=True)",
                            lambda: faulthandler.dump_traceback(file=fd, all_threads=True))]
                for name, fn in methods:
                    per.setdefault((name, "report"), []).append(_timed(fn, cfg.target)())
                if r == 0:
                    out["report bytes"] = len(_dump.report(color=False).encode())
                exe = _py_spy()
                if exe is not None and r == 0:  # (a subprocess: ~0.4 s; once)
                    t0 = time.perf_counter()
                    proc = subprocess.run([exe, "dump", "--pid", str(os.getpid())], capture_output=True, text=True, timeout=120)
                    if proc.returncode == 0:
                        per.setdefault(("py-spy dump (a subprocess attaching)", "report"), []).append(time.perf_counter() - t0)
                    else:
                        out["py-spy"] = f"failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"
            finally:
                parked.close()
        if _py_spy() is None:
            out["py-spy"] = "not installed"
        for (name, depth), values in per.items():
            key = "report" if depth == "report" else "threads()"
            out[key].setdefault(name, {})[str(depth)] = summary(values)
        d0, d1 = cfg.dump_depths[0], cfg.dump_depths[-1]
        mt = "monstack.threads()"
        out["threads() depth ratio"] = summary([a / b for a, b in zip(per[mt, d1], per[mt, d0])])
        out["threads() / extract_stack"] = {
            str(d): summary([a / b for a, b in zip(per[mt, d], per["sys._current_frames() + traceback.extract_stack", d])])
            for d in cfg.dump_depths
        }
        md = "monstack.dump() (report text, no colour)"
        out["report ratios"] = {
            name: summary([a / b for a, b in zip(per[name, "report"], per["faulthandler.dump_traceback(all_threads=True)", "report"])])
            for name, _ in [(md, None)] + [(n, None) for (n, d) in per if d == "report" and n.startswith("py-spy")]
        }
    finally:
        devnull.close()
        monstack.uninstall()
    return out
