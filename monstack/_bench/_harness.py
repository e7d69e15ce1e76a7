"""Timing for the bench: what can run here, modes (install / uninstall around a measurement),
interleaved and paired measurements, best-of, per-round ratios and their summaries.

Method (the machines are shared and noisy): every timed workload runs >= 15 ms; each
measurement is the best of two runs after a warm-up; modes are interleaved round by round
(the order rotates each round); the figure reported is the median of the per-round values
or ratios, with min and max.
"""

from __future__ import annotations

import gc
import inspect
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

import monstack
from monstack import _env


class Config:
    """Sizes of one bench run. ``full`` (default), ``quick`` (< 30 s), ``tiny`` (tests)."""

    def __init__(self, name: str, **kw: Any) -> None:
        self.name = name
        self.rounds = 7
        self.target = 0.015  # seconds: minimum duration of a timed workload
        self.depths = (10, 50, 200)
        self.pool_tasks = 100_000
        self.pool_rounds = 3  # each run of 100k tasks is seconds long: fewer rounds
        self.async_tasks = 20_000
        self.opqueue_ops = 1_800  # ~20 ms runs: pairs close in time (see _paired)
        self.opqueue_rounds = 21  # pairs (no capture, mode) per mode
        self.opqueue_depth = 30
        self.opqueue_layers = 3  # dispatch layers per op (8 helper calls each)
        self.crossover_layers = (0, 1, 2, 6, 12)
        self.crossover_rounds = 9
        self.memory_snapshots = 1_000_000
        self.memory_walk_snapshots = 20_000
        self.memory_depth = 50
        self.dump_threads = 50
        self.dump_depths = (10, 200)
        self.dump_report_depth = 50
        #: extra rows that explain a figure (default policy on pure-user workloads, where it
        #: equals track='all'; op-queue without snapshot / without propagation; mixed)
        self.diagnostics = True
        for key, value in kw.items():
            if not hasattr(self, key):
                raise TypeError(f"unknown bench setting {key!r}")
            setattr(self, key, value)

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items()}


CONFIGS = {
    "full": lambda: Config("full"),
    "quick": lambda: Config(
        "quick", rounds=3, pool_tasks=800, async_tasks=4_000, pool_rounds=3, opqueue_ops=1_800, opqueue_rounds=5,
        crossover_layers=(0, 1), crossover_rounds=2, memory_snapshots=20_000, memory_walk_snapshots=1_000, diagnostics=False,
    ),
    "tiny": lambda: Config(
        "tiny", rounds=1, target=0.0005, depths=(10, 50), pool_tasks=100, async_tasks=100, pool_rounds=1, opqueue_ops=240,
        opqueue_rounds=1, opqueue_depth=10, crossover_layers=(0, 1), crossover_rounds=1, memory_snapshots=1_000,
        memory_walk_snapshots=100, dump_threads=4, dump_depths=(10, 50), dump_report_depth=10,
    ),
}


# ---------------------------------------------------------------------------------------------
# What can run here
# ---------------------------------------------------------------------------------------------


def install_params() -> set:
    try:
        return set(inspect.signature(monstack.install).parameters)
    except (TypeError, ValueError):  # pragma: no cover
        return set()


def backend_reasons() -> dict:
    try:
        from monstack import _select

        return dict(_select.reasons())
    except Exception as exc:  # a half-built backend must not break the bench
        return {"monitoring": None if _env.HAS_SYSMON else "needs 3.12+", "walk": None, "error": repr(exc)}


def tracking_backends() -> list[str]:
    reasons = backend_reasons()
    out = []
    for name in ("monitoring", "evalframe"):
        if name in reasons and reasons[name] is None:
            if name == "evalframe" and _native_crash() is not None:
                continue
            out.append(name)
    return out


def accelerator_variants() -> tuple[bool, Optional[str]]:
    """(install() takes accelerator= and the native callbacks survived the rehearsal, why not)."""
    from monstack import _accel

    why = _accel.unavailable()
    if why is not None:
        return False, why
    crash = _native_crash()
    return (crash is None), crash


def _safe_kw() -> dict:
    """Options every install() of the bench gets: native callbacks off if they crashed."""
    if _native_crash() is not None:
        return {"accelerator": False}
    return {}


#: Set in the rehearsal child, which must not rehearse again. The bench's own variable,
#: not a user's setting: ``_settings.INTERNAL_VARS`` lists it only so that it is no misspelling.
NO_REHEARSAL_ENV = "MONSTACK_BENCH_NO_REHEARSAL"
_rehearsal: list = []


def _native_needed() -> bool:
    """Could the bench run native code here: the 3.11 shim, or the native callbacks?"""
    if backend_reasons().get("evalframe") is None:
        return True
    from monstack import _accel

    return _accel.unavailable() is None


def _native_crash() -> Optional[str]:
    """None if native code (the 3.11 shim, native callbacks) survived a tiny rehearsal of
    the whole bench in a child process, else why not -- a crash there skips the native
    variants instead of killing the bench. Run once per process, only when native code
    could be used."""
    if _rehearsal:
        return _rehearsal[0]
    why: Optional[str] = None
    if os.environ.get(NO_REHEARSAL_ENV) != "1" and _native_needed():
        import subprocess

        env = dict(os.environ)
        env[NO_REHEARSAL_ENV] = "1"
        root = os.path.dirname(os.path.dirname(os.path.abspath(monstack.__file__)))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        src = (
            "import io, monstack._bench as b\n"
            "b.run(file=io.StringIO(), config=b.CONFIGS['tiny']())\n"
            "print('rehearsal ok')\n"
        )
        try:
            proc = subprocess.run(
                [sys.executable, "-X", "faulthandler", "-c", src], env=env, capture_output=True, text=True, timeout=300
            )
            if proc.returncode != 0 or "rehearsal ok" not in proc.stdout:
                lines = proc.stderr.strip().splitlines()
                fatal = next((l for l in lines if l.startswith("Fatal Python error")), lines[-1] if lines else "no output")
                where = next((l.strip() for l in lines if l.strip().startswith("File ")), "")
                when = "at exit" if "rehearsal ok" in proc.stdout else "while running"
                why = f"native code crashed {when} in a rehearsal process (exit {proc.returncode}: {fatal}{'; ' + where if where else ''})"
        except Exception as exc:
            why = f"rehearsal process failed: {exc!r}"
    _rehearsal.append(why)
    return why


def native_skipped() -> Optional[str]:
    """Why native code was skipped in this process (a crash in the rehearsal), or None."""
    return _rehearsal[0] if _rehearsal else None


def _status_accelerator() -> Optional[str]:
    try:
        value = monstack.status().get("accelerator")
    except Exception:
        return None
    return None if value is None else str(value)


class Mode:
    """One way of running a workload: enter() before, exit() after. ``info`` says what ran."""

    def __init__(self, name: str, enter: Callable[[], Any], exit: Callable[[], Any]) -> None:
        self.name = name
        self._enter = enter
        self._exit = exit
        self.info: Optional[str] = None
        #: rounds during which monstack turned itself off (an internal error): invalid figures
        self.turned_off = 0

    def enter(self) -> None:
        info = self._enter()
        if info is not None and self.info is None:
            self.info = str(info)

    def exit(self) -> None:
        self._exit()


def installer(**opts: Any) -> Callable[[], str]:
    opts = {**_safe_kw(), **opts}
    if "backend" not in opts:
        # the backend auto would pick, unless it failed its probe (then the next one)
        tracking = tracking_backends()
        opts["backend"] = tracking[0] if tracking else "walk"

    def enter() -> str:
        monstack.uninstall()
        name = monstack.install(**opts)
        acc = _status_accelerator()
        return name + (f", accelerator: {acc}" if acc is not None else "")

    return enter


def nothing() -> None:
    monstack.uninstall()


class EmptyCallbacks:
    """Empty callbacks for monstack's six events on a free ``sys.monitoring`` tool id: the
    cost of CPython's own event machinery, below which no callback can go."""

    EVENTS = ("PY_START", "PY_RESUME", "PY_THROW", "PY_RETURN", "PY_YIELD", "PY_UNWIND")

    def __init__(self) -> None:
        self.tool: Optional[int] = None

    @staticmethod
    def unavailable() -> Optional[str]:
        if not _env.HAS_SYSMON:
            return "sys.monitoring needs 3.12+"
        if all(sys.monitoring.get_tool(t) is not None for t in range(6)):
            return "no free sys.monitoring tool id"
        return None

    def enter(self) -> str:
        monstack.uninstall()
        mon = sys.monitoring
        for tool in (5, 4, 3, 2, 1, 0):
            if mon.get_tool(tool) is None:
                mon.use_tool_id(tool, "monstack-bench-empty")
                self.tool = tool
                break
        else:
            raise RuntimeError("no free sys.monitoring tool id")

        def two(code, offset):
            pass

        def three(code, offset, arg):
            pass

        events = 0
        for name in self.EVENTS:
            ev = getattr(mon.events, name)
            mon.register_callback(self.tool, ev, two if name in ("PY_START", "PY_RESUME") else three)
            events |= ev
        mon.set_events(self.tool, events)
        return f"tool id {self.tool}"

    def exit(self) -> None:
        tool, self.tool = self.tool, None
        if tool is None:
            return
        mon = sys.monitoring
        mon.set_events(tool, 0)
        for name in self.EVENTS:
            mon.register_callback(tool, getattr(mon.events, name), None)
        mon.free_tool_id(tool)


def propagation_points() -> tuple:
    return tuple(monstack.PROPAGATION_POINTS)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def best(fn: Callable[[], Any], repeat: int = 2) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def calibrate(fn: Callable[[int], Any], target: float, start: int = 1, limit: int = 1 << 26) -> int:
    """The smallest size n (doubling from ``start``) for which ``fn(n)`` takes >= ``target``."""
    n = start
    while True:
        # best of two: one stall on a loaded machine must not stop the doubling early
        if best(lambda: fn(n)) >= target or n >= limit:
            return n
        n *= 2


def summary(values: Sequence[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def interleaved(
    work: Callable[[], Any],
    modes: Sequence[Mode],
    rounds: int,
    warm: Optional[Callable[[], Any]] = None,
    after: Optional[Callable[[str], Any]] = None,
    fresh: Optional[Callable[[], Any]] = None,
) -> dict[str, list[float]]:
    """Seconds per mode, one value per round (best of two after a warm-up); the order of
    the modes rotates each round."""
    times: dict[str, list[float]] = {m.name: [] for m in modes}
    k = len(modes)
    for r in range(rounds):
        for m in list(modes[r % k:]) + list(modes[: r % k]):
            times[m.name].append(_measure(m, work, warm, after, fresh))
    return times


def _measure(m: Mode, work: Callable[[], Any], warm: Optional[Callable[[], Any]],
             after: Optional[Callable[[str], Any]], fresh: Optional[Callable[[], Any]] = None) -> float:
    """One measurement of ``work`` in mode ``m``: best of two after a warm-up; counts the
    rounds in which monstack turned itself off.

    ``fresh`` (before the mode is entered) gives the workload new code objects. Needed on
    CPython 3.12: instrumenting a code object (what any sys.monitoring tool's events do)
    replaces its superinstructions by plain instructions for good (``_Py_Instrument`` in
    Python/instrumentation.c), so after the first install even an uninstalled run of the
    same code is ~1% slower than code never monitored, and every ratio to it would
    understate monstack's cost. 3.13 has no such superinstructions."""
    if fresh is not None:
        fresh()
    gc.collect()
    m.enter()
    try:
        was = monstack.active_backend()
        (warm or work)()
        t = best(work)
        if was is not None and monstack.active_backend() != was:
            m.turned_off += 1
    finally:
        m.exit()
    if after is not None:
        after(m.name)
    return t


def paired(
    work: Callable[[], Any],
    base: Mode,
    modes: Sequence[Mode],
    rounds: int,
    warm: Optional[Callable[[], Any]] = None,
    after: Optional[Callable[[str], Any]] = None,
    fresh: Optional[Callable[[], Any]] = None,
) -> dict[str, list[tuple[float, float]]]:
    """Per mode, one (base seconds, mode seconds) pair per round, the two measured back
    to back (best of two after a warm-up each; which goes first alternates).

    This machine's speed drifts by up to 2x over a few hundred ms: a ratio of two runs
    taken milliseconds apart is far steadier than one across a whole round of modes."""
    out: dict[str, list[tuple[float, float]]] = {m.name: [] for m in modes}
    k = len(modes)

    def measure(m: Mode) -> float:
        return _measure(m, work, warm, after, fresh)

    for r in range(rounds):
        for i, m in enumerate(list(modes[r % k:]) + list(modes[: r % k])):
            if (r + i) % 2:
                tm = measure(m)
                tb = measure(base)
            else:
                tb = measure(base)
                tm = measure(m)
            out[m.name].append((tb, tm))
    return out


def ratios(times: dict[str, list[float]], base: str, modes: Sequence[Mode] = ()) -> dict[str, dict]:
    out = {name: summary([t / b for t, b in zip(ts, times[base])]) for name, ts in times.items() if name != base}
    mark_invalid(out, modes)
    return out


def mark_invalid(summaries: dict, modes: Sequence[Mode]) -> None:
    for m in modes:
        if m.turned_off and m.name in summaries:
            summaries[m.name]["invalid"] = (
                f"monstack turned itself off (internal error) in {m.turned_off} of {summaries[m.name]['n']} rounds"
            )


def saved_install() -> Optional[dict]:
    """The running install's options (restored after the bench), or None."""
    try:
        from monstack import _install

        return _install.current_options()
    except Exception:
        return None


def restore_install(options: Optional[dict]) -> None:
    monstack.uninstall()
    if options:
        try:
            kw = dict(options)
            if "propagate" in kw and isinstance(kw["propagate"], frozenset):
                kw["propagate"] = kw["propagate"] or False
            monstack.install(**kw)
        except Exception:
            pass
