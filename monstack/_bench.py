"""``python -m monstack bench``: what monstack costs, next to the alternatives, in one run.

Sections (``--only`` selects some):

- ``snapshot``: cost of one capture at depth 10/50/200 -- ``monstack.snapshot()`` on every
  backend that can run here (and native / pure-Python callbacks when ``install()`` takes
  ``accelerator``), a plain ``sys._getframe`` walk, ``traceback.extract_stack()``, the
  asyncio debug-mode capture, and jax's / torch's native capture when they import.
- ``tax``: tracking tax, tracked time / untracked time, on call-heavy, method-heavy,
  generator, exception-heavy, mixed and thread-pool workloads; with ``track="all"``, the
  default policy, the workload filtered out, and empty ``sys.monitoring`` callbacks (the
  CPython floor).
- ``opqueue``: user model code a few dozen frames deep calls an excluded "framework" whose
  every op does eager-framework-like Python dispatch, takes a snapshot and queues the op to
  a worker thread. Ratios to no capture at all, cost per op, and the crossover (how light an
  op can be before the default policy costs more than 10%).
- ``memory``: bytes per snapshot over many snapshots at depth 50, peak RSS, and proof that
  snapshots keep no frames alive.

Method (the machines are shared and noisy): every timed workload runs >= 15 ms; each
measurement is the best of two runs after a warm-up; modes are interleaved round by round
(the order rotates each round); the figure reported is the median of the per-round values
or ratios, with min and max. Timing targets live here, never in the unit tests.

Workloads are compiled into synthetic modules: ``monstack_bench_workload`` is "user code"
(tracked by the default policy); ``monstack_bench_framework.ops`` is compiled with a file
name inside site-packages, so the default policy excludes it exactly as it excludes an
installed framework. monstack's own files are never tracked.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import os
import statistics
import sys
import sysconfig
import time
import traceback
import types
import warnings
from typing import Any, Callable, Optional, Sequence

import monstack
from monstack import _env

SCHEMA = 2
SECTIONS = ("snapshot", "tax", "opqueue", "memory")
WORKLOAD_MODULE = "monstack_bench_workload"
FRAMEWORK_MODULE = "monstack_bench_framework.ops"


class Config:
    """Sizes of one bench run. ``full`` (default), ``quick`` (< 30 s), ``tiny`` (tests)."""

    def __init__(self, name: str, **kw: Any) -> None:
        self.name = name
        self.rounds = 7
        self.target = 0.015  # seconds: minimum duration of a timed workload
        self.depths = (10, 50, 200)
        self.pool_tasks = 100_000
        self.pool_rounds = 3  # each run of 100k tasks is seconds long: fewer rounds
        self.opqueue_ops = 1_800  # ~20 ms runs: pairs close in time (see _paired)
        self.opqueue_rounds = 21  # pairs (no capture, mode) per mode
        self.opqueue_depth = 30
        self.opqueue_layers = 3  # dispatch layers per op (8 helper calls each)
        self.crossover_layers = (0, 1, 2, 6, 12)
        self.crossover_rounds = 9
        self.memory_snapshots = 1_000_000
        self.memory_walk_snapshots = 20_000
        self.memory_depth = 50
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
        "quick", rounds=3, pool_tasks=800, pool_rounds=3, opqueue_ops=1_800, opqueue_rounds=5,
        crossover_layers=(0, 1), crossover_rounds=2, memory_snapshots=20_000, memory_walk_snapshots=1_000, diagnostics=False,
    ),
    "tiny": lambda: Config(
        "tiny", rounds=1, target=0.0005, depths=(10, 50), pool_tasks=100, pool_rounds=1, opqueue_ops=240,
        opqueue_rounds=1, opqueue_depth=10, crossover_layers=(0, 1), crossover_rounds=1, memory_snapshots=1_000,
        memory_walk_snapshots=100,
    ),
}


# ---------------------------------------------------------------------------------------------
# Workloads: synthetic "user" module and "framework" module
# ---------------------------------------------------------------------------------------------

_WORKLOAD_SRC = '''
import sys
import weakref
from concurrent.futures import ThreadPoolExecutor

snapshot = None  # set by the bench: monstack.snapshot

def at_depth(depth, fn, *args):
    if depth <= 1:
        return fn(*args)
    return at_depth(depth - 1, fn, *args)

def snap_loop(fn, n):
    for _ in range(n):
        fn()

def noop():
    pass

# -- call-heavy -------------------------------------------------------------------------------
def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)

# -- method-heavy -----------------------------------------------------------------------------
class Account:
    __slots__ = ("balance", "entries")
    def __init__(self):
        self.balance = 0
        self.entries = 0
    @property
    def value(self):
        return self.balance
    def deposit(self, x):
        self.balance += x
        self._log()
        return self
    def _log(self):
        self.entries += 1
    def __len__(self):
        return self.entries

class Point:
    __slots__ = ("x", "y")
    def __init__(self, x, y):
        self.x = x
        self.y = y
    def scaled(self, k):
        return Point(self.x * k, self.y * k)
    def norm1(self):
        return abs(self.x) + abs(self.y)
    def __add__(self, other):
        return Point(self.x + other.x, self.y + other.y)

def method_heavy(n):
    a = Account()
    t = 0
    origin = Point(0, 0)
    for i in range(n):
        a.deposit(i)
        t += a.value + len(a)
        p = Point(i, -i).scaled(2) + origin
        t += p.norm1()
    return t

# -- generator pipeline -----------------------------------------------------------------------
def numbers(n):
    for i in range(n):
        yield i

def evens(it):
    for x in it:
        if x % 2 == 0:
            yield x

def squares(it):
    for x in it:
        yield x * x

def relay(it):
    yield from it

def chunks(it, k):
    buf = []
    for x in it:
        buf.append(x)
        if len(buf) == k:
            yield buf
            buf = []
    if buf:
        yield buf

def gen_pipeline(n):
    total = sum(sum(c) for c in chunks(relay(squares(evens(numbers(n)))), 8))
    return total + sum(y + 1 for y in range(n // 4))

# -- exception-heavy --------------------------------------------------------------------------
def _raise3(i):
    raise KeyError(i)

def _raise2(i):
    return _raise3(i)

def _raise1(i):
    return _raise2(i)

def exception_heavy(n):
    c = 0
    d = {}
    for i in range(n):
        try:
            _raise1(i)
        except KeyError:
            c += 1
        try:
            d[i]
        except KeyError:
            c += 1
    return c

# -- mixed (issue 3's) ------------------------------------------------------------------------
class Vec:
    __slots__ = ("x", "y")
    def __init__(self, x, y):
        self.x = x; self.y = y
    def add(self, o):
        return Vec(self.x + o.x, self.y + o.y)
    def norm2(self):
        return self.x * self.x + self.y * self.y

def gen(n):
    for i in range(n):
        yield i * 2

def mixed(n):
    total = 0
    acc = Vec(0, 0)
    for i in range(n):
        acc = acc.add(Vec(i, -i))
        d = {"k%d" % (i % 7): i}
        total += len(str(d)) + acc.norm2() % 7
        if i % 50 == 0:
            try:
                raise ValueError(i)
            except ValueError:
                total += 1
    total += sum(x for x in gen(n // 10))
    return total

# -- thread pool ------------------------------------------------------------------------------
def _small(x):
    return (x * 7) % 13

def pool_task(i):
    return _small(i) + _small(i + 1)

POOL_DONE = [0]

def pool_run(n, workers=4):
    with ThreadPoolExecutor(workers) as ex:
        futs = [ex.submit(pool_task, i) for i in range(n)]
        total = 0
        for f in futs:
            total += f.result()
    POOL_DONE[0] += n
    return total

# -- op-queue: the user's model, calling the framework ----------------------------------------
class Linear:
    def __init__(self, fw, n_in, n_out):
        self.fw = fw
        self.w = fw.Tensor((n_in, n_out))
        self.b = fw.Tensor((n_out,))
        self.scale = fw.Tensor((1,))
    def __call__(self, x):
        return self.forward(x)
    def forward(self, x):
        fw = self.fw
        h = fw.matmul(x, self.w)
        h = fw.add(h, self.b)
        return fw.mul(h, self.scale)

class Block:
    def __init__(self, fw, width):
        self.first = Linear(fw, width, width)
        self.second = Linear(fw, width, width)
    def __call__(self, x):
        return self.forward(x)
    def forward(self, x):
        return self.second(self.first(x))

class Model:
    OPS_PER_STEP_PER_BLOCK = 6
    def __init__(self, fw, n_blocks, width):
        self.blocks = [Block(fw, width) for _ in range(n_blocks)]
    def __call__(self, x):
        return self.forward(x)
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

def train(model, x, steps):
    for _ in range(steps):
        model(x)

def run_model(depth, model, x, steps):
    return at_depth(depth, train, model, x, steps)

# -- memory / liveness ------------------------------------------------------------------------
def snap_fill(out, n):
    for i in range(n):
        out[i] = snapshot()

def _leaf():
    return snapshot()

def snap_fill_fresh(out, n):
    for i in range(n):
        out[i] = _leaf()

class Marker:
    pass

def _snap_gen():
    yield snapshot()
    yield snapshot()

def _take_snaps(marker):
    snaps = [snapshot()]
    g = _snap_gen()
    snaps.append(next(g))
    g.close()
    try:
        _raise1(marker)
    except KeyError:
        snaps.append(snapshot())
    snaps.append(_leaf())
    return snaps

def liveness(depth):
    marker = Marker()
    ref = weakref.ref(marker)
    snaps = at_depth(depth, _take_snaps, marker)
    return ref, snaps
'''

_FRAMEWORK_SRC = '''
# An eager framework's Python-side dispatch, in miniature: argument checks, dtype and
# device canonicalisation, promotion, broadcasting, kernel lookup, version counters.
import threading

_capture = None   # set by the bench: monstack.snapshot, or None for "no capture"
_put = None       # the queue's put
LAYERS = 4        # dispatch layers per op; each makes 8 small helper calls

_DTYPES = {"float32": "float32", "f32": "float32", "float": "float32", "int64": "int64"}
_PROMOTE = {("float32", "float32"): "float32", ("float32", "int64"): "float32",
            ("int64", "float32"): "float32", ("int64", "int64"): "int64"}
_DEVICES = {"cpu": "cpu", "cpu:0": "cpu"}

class Tensor:
    __slots__ = ("shape", "dtype", "device", "requires_grad", "version")
    def __init__(self, shape, dtype="float32", device="cpu", requires_grad=False):
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.requires_grad = requires_grad
        self.version = 0

def _check_tensor(x):
    if not isinstance(x, Tensor):
        raise TypeError("expected a Tensor, got %r" % (type(x),))
    return x

def _canon_dtype(d):
    return _DTYPES.get(d, d)

def _canon_device(d):
    return _DEVICES[d]

def _result_dtype(a, b):
    return _PROMOTE[(_canon_dtype(a.dtype), _canon_dtype(b.dtype))]

def _bdim(x, y):
    if x == y or y == 1:
        return x
    if x == 1:
        return y
    raise ValueError("shapes do not broadcast")

def _broadcast(sa, sb):
    n = max(len(sa), len(sb))
    sa = (1,) * (n - len(sa)) + tuple(sa)
    sb = (1,) * (n - len(sb)) + tuple(sb)
    return tuple([_bdim(x, y) for x, y in zip(sa, sb)])

def _same_device(a, b):
    da = _canon_device(a.device)
    if da != _canon_device(b.device):
        raise RuntimeError("tensors on different devices")
    return da

def _needs_grad(a, b):
    return a.requires_grad or b.requires_grad

def _layer(name, a, b):
    _check_tensor(a)
    _check_tensor(b)
    dtype = _result_dtype(a, b)
    device = _same_device(a, b)
    shape = _broadcast(a.shape[-1:], b.shape[-1:])
    grad = _needs_grad(a, b)
    return (name, dtype, device), shape, grad

def _kernel(a, b, out):
    out.version += 1

_KERNELS = {}
for _n in ("matmul", "add", "mul"):
    for _d in ("float32", "int64"):
        _KERNELS[(_n, _d, "cpu")] = _kernel

def dispatch(name, a, b):
    key = shape = grad = None
    for _ in range(LAYERS):
        key, shape, grad = _layer(name, a, b)
    kernel = _KERNELS[key] if key is not None else _kernel
    out = Tensor(shape or a.shape, a.dtype, a.device, bool(grad))
    capture = _capture
    _put((kernel, a, b, out, capture() if capture is not None else None))
    return out

def matmul(a, b):
    return dispatch("matmul", a, b)

def add(a, b):
    return dispatch("add", a, b)

def mul(a, b):
    return dispatch("mul", a, b)

class Worker:
    """Runs queued ops on its own long-lived thread, as a framework's worker does. An
    Event queued after a run's ops is set once they have all run; the counts it saw in
    that run (the bench checks them) are set just before."""
    def __init__(self, get):
        self.get = get
        self.ops = 0
        self.snapshots = 0
        self.last_snapshot = None
        self.thread = threading.Thread(target=self.run, name="bench-op-worker", daemon=True)
    def run(self):
        get = self.get
        ops = snaps = 0
        last = None
        while True:
            item = get()
            if item.__class__ is not tuple:
                if item is None:
                    break
                self.ops, self.snapshots, self.last_snapshot = ops, snaps, last
                ops = snaps = 0
                last = None
                item.set()
                continue
            kernel, a, b, out, snap = item
            kernel(a, b, out)
            ops += 1
            if snap is not None:
                snaps += 1
                last = snap
'''


def _framework_filename() -> str:
    base = sysconfig.get_paths().get("purelib") or os.path.join(sys.prefix, "site-packages")
    return os.path.join(base, "monstack_bench_framework", "ops.py")


def _make_module(name: str, src: str, filename: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = filename
    exec(compile(src, filename, "exec"), mod.__dict__)
    return mod


def _workloads() -> types.ModuleType:
    mod = _make_module(WORKLOAD_MODULE, _WORKLOAD_SRC, "<monstack-bench-workload>")
    mod.snapshot = monstack.snapshot
    return mod


def _framework() -> types.ModuleType:
    return _make_module(FRAMEWORK_MODULE, _FRAMEWORK_SRC, _framework_filename())


# ---------------------------------------------------------------------------------------------
# What can run here
# ---------------------------------------------------------------------------------------------


def _install_params() -> set:
    try:
        return set(inspect.signature(monstack.install).parameters)
    except (TypeError, ValueError):  # pragma: no cover
        return set()


def _backend_reasons() -> dict:
    try:
        from monstack import _backend

        return dict(_backend.reasons())
    except Exception as exc:  # a half-built backend must not break the bench
        return {"monitoring": None if _env.HAS_SYSMON else "needs 3.12+", "walk": None, "error": repr(exc)}


def _tracking_backends() -> list[str]:
    reasons = _backend_reasons()
    out = []
    for name in ("monitoring", "evalframe"):
        if name in reasons and reasons[name] is None:
            if name == "evalframe" and _native_crash() is not None:
                continue
            out.append(name)
    return out


def _accelerator_variants() -> tuple[bool, Optional[str]]:
    """(install() takes accelerator= and the native callbacks survived the rehearsal, why not)."""
    if "accelerator" not in _install_params():
        why = "install() has no accelerator option in this build"
        try:
            from monstack import _accel

            ok, reason = _accel.available()
            why += f" (monstack._accel present: {'its native code loads' if ok else reason})"
        except Exception:
            pass
        return False, why
    crash = _native_crash()
    return (crash is None), crash


def _safe_kw() -> dict:
    """Options every install() of the bench gets: native callbacks off if they crashed."""
    if "accelerator" in _install_params() and _native_crash() is not None:
        return {"accelerator": False}
    return {}


#: Set in the rehearsal child (and by tests) to skip the rehearsal.
NO_REHEARSAL_ENV = "MONSTACK_BENCH_NO_REHEARSAL"
_rehearsal: list = []


def _native_needed() -> bool:
    reasons = _backend_reasons()
    return reasons.get("evalframe") is None or "accelerator" in _install_params()


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


def _installer(**opts: Any) -> Callable[[], str]:
    opts = {**_safe_kw(), **opts}
    if "backend" not in opts:
        # the backend auto would pick, unless it failed its probe (then the next one)
        tracking = _tracking_backends()
        opts["backend"] = tracking[0] if tracking else "walk"

    def enter() -> str:
        monstack.uninstall()
        name = monstack.install(**opts)
        acc = _status_accelerator()
        return name + (f", accelerator: {acc}" if acc is not None else "")

    return enter


def _nothing() -> None:
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


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def _best(fn: Callable[[], Any], repeat: int = 2) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _calibrate(fn: Callable[[int], Any], target: float, start: int = 1, limit: int = 1 << 26) -> int:
    """The smallest size n (doubling from ``start``) for which ``fn(n)`` takes >= ``target``."""
    n = start
    while True:
        # best of two: one stall on a loaded machine must not stop the doubling early
        if _best(lambda: fn(n)) >= target or n >= limit:
            return n
        n *= 2


def _summary(values: Sequence[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _interleaved(
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
        t = _best(work)
        if was is not None and monstack.active_backend() != was:
            m.turned_off += 1
    finally:
        m.exit()
    if after is not None:
        after(m.name)
    return t


def _paired(
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


def _ratios(times: dict[str, list[float]], base: str, modes: Sequence[Mode] = ()) -> dict[str, dict]:
    out = {name: _summary([t / b for t, b in zip(ts, times[base])]) for name, ts in times.items() if name != base}
    _mark_invalid(out, modes)
    return out


def _mark_invalid(summaries: dict, modes: Sequence[Mode]) -> None:
    for m in modes:
        if m.turned_off and m.name in summaries:
            summaries[m.name]["invalid"] = (
                f"monstack turned itself off (internal error) in {m.turned_off} of {summaries[m.name]['n']} rounds"
            )


def _saved_install() -> Optional[dict]:
    try:
        from monstack import _install

        state = _install._state
        return dict(state.options) if state is not None else None
    except Exception:
        return None


def _restore_install(options: Optional[dict]) -> None:
    monstack.uninstall()
    if options:
        try:
            kw = {k: v for k, v in options.items() if k in _install_params()}
            if "propagate" in kw and isinstance(kw["propagate"], frozenset):
                kw["propagate"] = kw["propagate"] or False
            monstack.install(**kw)
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------
# Section: snapshot cost
# ---------------------------------------------------------------------------------------------


def _plain_walk() -> list:
    f = sys._getframe(1)
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


def snapshot_costs(cfg: Config, w: Optional[types.ModuleType] = None) -> dict:
    """Seconds per capture at each depth for each method; frames each capture returned."""
    w = w or _workloads()
    at_depth, snap_loop = w.at_depth, w.snap_loop
    snap = monstack.snapshot
    accel, _why = _accelerator_variants()

    methods: list[tuple[str, Callable, Mode]] = []
    none = Mode("none", _nothing, _nothing)
    for backend in _tracking_backends():
        if accel and backend == "monitoring":
            methods.append((f"monstack {backend} native", snap, Mode("n", _installer(backend=backend, accelerator=True), _nothing)))
            if hasattr(monstack, "snapshotter"):
                # resolved after install: the function a framework binds once
                methods.append((f"monstack {backend} native, snapshotter()", _LATE_SNAPSHOTTER,
                                Mode("s", _installer(backend=backend, accelerator=True), _nothing)))
            methods.append((f"monstack {backend} pure-Python", snap, Mode("p", _installer(backend=backend, accelerator=False), _nothing)))
            if hasattr(monstack, "snapshotter"):
                # every thread, pool job and task started after install() has an origin
                # (the snapshot links to it: another native branch)
                methods.append((f"monstack {backend} native, snapshotter(), under an origin", _LATE_SNAPSHOTTER,
                                _under_origin("o", _installer(backend=backend, accelerator=True))))
        else:
            methods.append((f"monstack {backend}", snap, Mode("m", _installer(backend=backend), _nothing)))
    methods.append(("monstack walk backend", snap, Mode("w", _installer(backend="walk"), _nothing)))
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
                sizes[name, depth] = _calibrate(lambda n, fn=fn: at_depth(depth, snap_loop, fn, n), cfg.target, 16)
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
                    t = _best(lambda: at_depth(depth, snap_loop, fn, n))
                finally:
                    mode.exit()
                per[name, depth].append(t / n)
    for (name, depth), values in per.items():
        out["methods"][name][str(depth)] = _summary(values)
    main = _main_snapshot_method(out["methods"])
    out["main method"] = main
    if main is not None:
        # per-round ratios: method / main at the same depth, and main at depth d / depth 10
        out["ratio to main"] = {
            name: {
                str(d): _summary([a / b for a, b in zip(per[name, d], per[main, d])]) for d in cfg.depths
            }
            for name, _f, _m in methods if name != main
        }
        d0 = cfg.depths[0]
        out["main depth ratios"] = {
            f"{d}/{d0}": _summary([a / b for a, b in zip(per[main, d], per[main, d0])]) for d in cfg.depths[1:]
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
# Section: tracking tax
# ---------------------------------------------------------------------------------------------


def _modes_for_tax(*, filtered: bool, default: bool = True, extra: Sequence[Mode] = ()) -> tuple[list[Mode], dict]:
    accel, accel_why = _accelerator_variants()
    skipped: dict = {}
    modes = [Mode("no monstack", _nothing, _nothing)]
    empty = EmptyCallbacks()
    why = empty.unavailable()
    if why is None:
        modes.append(Mode("empty callbacks", empty.enter, empty.exit))
    else:
        skipped["empty callbacks"] = why
    tracking = _tracking_backends()
    if not tracking:
        skipped["tracked modes"] = "no tracking backend can run here: " + "; ".join(
            f"{k}: {v}" for k, v in _backend_reasons().items() if v
        )
        return modes + list(extra), skipped
    modes.append(Mode("track='all'", _installer(track="all"), _nothing))
    if accel and "monitoring" in tracking:
        modes.append(Mode("track='all', pure-Python", _installer(track="all", accelerator=False), _nothing))
    else:
        skipped["native vs pure-Python callbacks"] = accel_why or "needs the monitoring backend"
    if default:
        modes.append(Mode("default policy", _installer(), _nothing))
    if filtered:
        modes.append(Mode("workload filtered", _installer(exclude=[WORKLOAD_MODULE]), _nothing))
    return modes + list(extra), skipped


def tracking_tax(cfg: Config, w: Optional[types.ModuleType] = None) -> dict:
    """Tracked time / untracked time per workload and mode."""
    w = w or _workloads()
    monstack.uninstall()
    sizes: dict[str, int] = {}
    nfib = 10
    while True:  # fib size with >= target untracked
        if _best(lambda: w.fib(nfib)) >= cfg.target or nfib >= 32:
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
        sizes[name] = _calibrate(fn, cfg.target, start)
    sizes["thread pool"] = cfg.pool_tasks
    # the warm-up runs a quarter of the size: enough to decide the policy and specialise
    # each measurement gets new code objects (see _measure): cur[0] is the live module
    cur = [w]
    pool_done = [0]

    def fresh() -> None:
        pool_done[0] += cur[0].POOL_DONE[0]
        cur[0] = _workloads()

    q = lambda name: max(1, sizes[name] // 4)  # noqa: E731
    work: dict[str, tuple[Callable, Optional[Callable]]] = {
        "call-heavy (fib)": (lambda: cur[0].fib(nfib), lambda: cur[0].fib(max(1, nfib - 3))),
        "method-heavy": (lambda: cur[0].method_heavy(sizes["method-heavy"]), lambda: cur[0].method_heavy(q("method-heavy"))),
        "generator pipeline": (lambda: cur[0].gen_pipeline(sizes["generator pipeline"]), lambda: cur[0].gen_pipeline(q("generator pipeline"))),
        "exception-heavy": (lambda: cur[0].exception_heavy(sizes["exception-heavy"]), lambda: cur[0].exception_heavy(q("exception-heavy"))),
        "mixed": (lambda: cur[0].mixed(sizes["mixed"]), lambda: cur[0].mixed(q("mixed"))),
        "thread pool": (lambda: cur[0].pool_run(cfg.pool_tasks), lambda: cur[0].pool_run(q("thread pool"))),
    }
    propagation = _propagation_points()
    extra = []
    if propagation:
        extra.append(Mode("default, propagate=False", _installer(propagate=False), _nothing))
    out: dict = {"sizes": sizes, "untracked seconds": {}, "ratios": {}, "mode info": {}, "skipped": {}}
    if not cfg.diagnostics:
        del work["mixed"], sizes["mixed"]
        out["note"] = ("quick: the default policy is measured on the thread pool only (on the other workloads, "
                       "which call no library code, it tracks what track='all' tracks); no mixed workload")
    for wname, (fn, warm) in work.items():
        modes, skipped = _modes_for_tax(
            filtered=True,
            default=cfg.diagnostics or wname == "thread pool",
            extra=extra if wname == "thread pool" and cfg.diagnostics else (),
        )
        out["skipped"].update(skipped)
        rounds = cfg.pool_rounds if wname == "thread pool" else cfg.rounds
        times = _interleaved(fn, modes, rounds, warm=warm, fresh=fresh)
        out["untracked seconds"][wname] = statistics.median(times["no monstack"])
        out["ratios"][wname] = _ratios(times, "no monstack", modes)
        for m in modes:
            if m.info:
                out["mode info"][m.name] = m.info
    out["pool tasks run"] = pool_done[0] + cur[0].POOL_DONE[0]
    return out


def _propagation_points() -> tuple:
    try:
        from monstack import _propagate

        return tuple(getattr(_propagate, "PROPAGATION_POINTS", ()))
    except Exception:
        return ()


# ---------------------------------------------------------------------------------------------
# Section: op-queue
# ---------------------------------------------------------------------------------------------


class OpQueue:
    """The op-queue workload: user model code -> framework dispatch -> snapshot -> queue ->
    worker thread. ``run()`` issues ``ops`` ops and returns when the worker ran them all."""

    N_BLOCKS = 4

    def __init__(self, w: types.ModuleType, fw: types.ModuleType, ops: int, depth: int) -> None:
        import queue

        self.w = w
        self.fw = fw
        self.depth = depth
        self.model = w.Model(fw, self.N_BLOCKS, 16)
        self.x = fw.Tensor((8, 16))
        per_step = self.N_BLOCKS * w.Model.OPS_PER_STEP_PER_BLOCK
        self.steps = max(1, ops // per_step)
        self.ops = self.steps * per_step
        self._queue_cls = queue.SimpleQueue
        self.issued = 0
        self.ran = 0
        self.snapshots = 0
        self.last_snapshot: Any = None
        self._running: Any = None  # (queue, Worker) once started

    def configure(self, capture: Any, layers: Optional[int] = None) -> None:
        """capture: False (none), True (what a framework would bind: ``snapshotter()``,
        resolved after install) or "snapshot" (``monstack.snapshot`` itself)."""
        if capture == "snapshot":
            self.fw._capture = monstack.snapshot
        elif capture:
            get = getattr(monstack, "snapshotter", None)
            self.fw._capture = get() if get is not None else monstack.snapshot
        else:
            self.fw._capture = None
        if layers is not None:
            self.fw.LAYERS = layers

    def _worker(self) -> Any:
        """The worker thread, started on first use and kept: a framework's worker lives
        as long as the program, so starting one is not part of an op's cost (and a
        thread start per run would add its own noise, and monstack's per-thread cost,
        to every run)."""
        if self._running is None:
            q = self._queue_cls()
            self.fw._put = q.put
            worker = self.fw.Worker(q.get)
            worker.thread.start()
            self._running = (q, worker)
        return self._running

    def run(self, steps: Optional[int] = None) -> None:
        import threading

        q, worker = self._worker()
        self.fw._put = q.put
        steps = self.steps if steps is None else steps
        done = threading.Event()
        try:
            self.w.run_model(self.depth, self.model, self.x, steps)
        finally:
            q.put(done)
            if not done.wait(60):
                raise RuntimeError("the op-queue worker thread did not finish its ops in 60 s")
        self.issued += steps * self.N_BLOCKS * self.w.Model.OPS_PER_STEP_PER_BLOCK
        self.ran += worker.ops
        self.snapshots += worker.snapshots
        if worker.last_snapshot is not None:
            self.last_snapshot = worker.last_snapshot
        worker.last_snapshot = None

    def close(self) -> None:
        """Stop the worker thread (it is a daemon: a bench that fails still exits)."""
        if self._running is not None:
            q, worker = self._running
            self._running = None
            q.put(None)
            worker.thread.join(60)
        self.fw._put = None

    def warm(self) -> None:
        self.run(max(1, self.steps // 4))

    def renew(self) -> None:
        """Model, framework and worker anew, from new code objects (see ``_measure``); the
        next run starts the worker thread (the warm-up does, untimed)."""
        layers = self.fw.LAYERS
        self.close()
        self.w = _workloads()
        self.fw = _framework()
        self.fw.LAYERS = layers
        self.model = self.w.Model(self.fw, self.N_BLOCKS, 16)
        self.x = self.fw.Tensor((8, 16))


NOISE_FLOOR = "no capture again (noise)"
#: installed with every code object of the workload excluded, no snapshot: what the
#: tracking machinery costs before monstack tracks anything (on 3.12, CPython's own
#: instrumentation: code instrumented once loses its superinstructions for good)
FILTERED_FLOOR = "every code filtered, no snapshot"


def _opqueue_modes(oq: OpQueue, diagnostics: bool = True) -> tuple[list[Mode], dict]:
    accel, _why = _accelerator_variants()
    skipped: dict = {}

    def with_capture(enter: Callable[[], Any], capture: Any) -> Callable[[], Any]:
        def go() -> Any:
            info = enter()
            oq.configure(capture)
            return info

        return go

    modes = [Mode("no capture", with_capture(_nothing, False), _nothing)]
    # the same as the base, paired like every mode: how far from 1.00 noise alone moves a ratio
    modes.append(Mode(NOISE_FLOOR, with_capture(_nothing, False), _nothing))
    if _tracking_backends():
        modes.append(Mode("default policy", with_capture(_installer(), True), _nothing))
        modes.append(Mode(FILTERED_FLOOR, with_capture(_installer(exclude=[WORKLOAD_MODULE]), False), _nothing))
        if hasattr(monstack, "snapshotter"):
            modes.append(Mode("default policy, snapshot()", with_capture(_installer(), "snapshot"), _nothing))
        if accel and "monitoring" in _tracking_backends():
            modes.append(Mode("default policy, pure-Python", with_capture(_installer(accelerator=False), True), _nothing))
        if diagnostics and _propagation_points():
            modes.append(Mode("default, propagate=False", with_capture(_installer(propagate=False), True), _nothing))
        if diagnostics:
            modes.append(Mode("default policy, no snapshot", with_capture(_installer(), False), _nothing))
        modes.append(Mode("track='all'", with_capture(_installer(track="all"), True), _nothing))
    else:
        skipped["tracked modes"] = "no tracking backend can run here"
    modes.append(Mode("walk per op", with_capture(_installer(backend="walk"), True), _nothing))
    return modes, skipped


def opqueue(cfg: Config, w: Optional[types.ModuleType] = None) -> dict:
    w = w or _workloads()
    fw = _framework()
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

    pairs = _paired(oq.run, modes[0], modes[1:], cfg.opqueue_rounds, warm=oq.warm, after=account, fresh=oq.renew)
    base = [b for ps in pairs.values() for b, _ in ps]
    out["ratios"] = {name: _summary([t / b for b, t in ps]) for name, ps in pairs.items()}
    _mark_invalid(out["ratios"], modes)
    out["us per op"] = {"no capture": _summary([b / oq.ops * 1e6 for b in base])}
    out["us per op"].update({name: _summary([t / oq.ops * 1e6 for _, t in ps]) for name, ps in pairs.items()})
    out["overhead us per op"] = {name: _summary([(t - b) / oq.ops * 1e6 for b, t in ps]) for name, ps in pairs.items()}
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
    if not _tracking_backends():
        return {"skipped": "no tracking backend can run here"}
    none = Mode("no capture", lambda: (_nothing(), oq.configure(False))[1], _nothing)
    tracked = Mode("default policy", lambda: (_installer()(), oq.configure(True))[1], _nothing)
    points = []
    for layers in cfg.crossover_layers:
        oq.fw.LAYERS = layers
        ps = _paired(oq.run, none, [tracked], cfg.crossover_rounds, warm=oq.warm, fresh=oq.renew)["default policy"]
        base_us = statistics.median([b for b, _ in ps]) / oq.ops * 1e6
        overhead_us = statistics.median([(t - b) / oq.ops * 1e6 for b, t in ps])
        ratio = _summary([t / b for b, t in ps])
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
# Section: memory
# ---------------------------------------------------------------------------------------------


def _rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except Exception:
        return None


def _peak_rss_bytes() -> int:
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _bytes_per_snapshot(w: types.ModuleType, fill: Callable, n: int, depth: int) -> dict:
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


def _frames_reachable(roots: Sequence[Any], limit: int = 100_000) -> int:
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


def _liveness(w: types.ModuleType, depth: int) -> dict:
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
        "frame objects reachable from snapshots": _frames_reachable(snaps),
        "snapshot still readable": "_take_snaps" in text,
    }


def memory(cfg: Config, w: Optional[types.ModuleType] = None) -> dict:
    w = w or _workloads()
    out: dict = {"depth": cfg.memory_depth, "runs": {}, "liveness": {}}
    try:
        from monstack._snapshot import Snapshot  # noqa: F401

        probe_mode = _installer()
        probe_mode()
        s = w.at_depth(3, w._leaf)
        out["sys.getsizeof(snapshot)"] = sys.getsizeof(s)
        out["sys.getsizeof(node)"] = sys.getsizeof(s._node) if getattr(s, "_node", None) is not None else None
    except Exception:
        pass
    finally:
        monstack.uninstall()
    backends: list[tuple[str, dict, int]] = []
    for backend in _tracking_backends():
        backends.append((backend, dict(backend=backend), cfg.memory_snapshots))
    backends.append(("walk", dict(backend="walk"), cfg.memory_walk_snapshots))
    rss_start = _rss_bytes()
    for name, opts, n in backends:
        monstack.uninstall()
        info = _installer(**opts)()
        try:
            out["runs"][f"{name}, same frame"] = dict(_bytes_per_snapshot(w, w.snap_fill, n, cfg.memory_depth), backend=info)
            out["runs"][f"{name}, new frame each"] = dict(_bytes_per_snapshot(w, w.snap_fill_fresh, n, cfg.memory_depth), backend=info)
            out["liveness"][name] = _liveness(w, cfg.memory_depth)
        finally:
            monstack.uninstall()
    monstack.uninstall()
    out["liveness"]["not installed"] = _liveness(w, cfg.memory_depth)
    out["rss at start bytes"] = rss_start
    out["peak rss bytes"] = _peak_rss_bytes()
    return out


# ---------------------------------------------------------------------------------------------
# Targets (issues 3, 7, 10) -- evaluated on whatever interpreter runs the bench
# ---------------------------------------------------------------------------------------------


def _get(d: Any, *path: Any) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def targets(r: dict) -> list[dict]:
    out: list[dict] = []

    def add(issue: int, what: str, value: Any, met: Optional[bool], note: str = "", *invalid: Any) -> None:
        bad = [i["invalid"] for i in invalid if isinstance(i, dict) and i.get("invalid")]
        if bad:
            met, note = None, "INVALID: " + bad[0]
        out.append({"issue": issue, "target": what, "value": value, "met": met, "note": note})

    snap = r.get("snapshot") or {}
    methods = snap.get("methods", {})
    main = _main_snapshot_method(methods)
    med = lambda name, depth: _get(methods, name, str(depth), "median")  # noqa: E731
    if main:
        d10, d50, d200 = med(main, 10), med(main, 50), med(main, 200)
        r200 = _get(snap, "main depth ratios", "200/10", "median")
        if r200 is None and d10 and d200:
            r200 = d200 / d10
        if r200 is not None:
            add(3, "snapshot depth 200 <= 1.3x depth 10", round(r200, 2), r200 <= 1.3, main)
        rw = _get(snap, "ratio to main", "plain sys._getframe walk", "50", "median")
        if rw is not None:
            add(3, "plain walk at depth 50 >= 20x snapshot", round(rw, 1), rw >= 20, main)
        worst = max(v for v in (d10, d50, d200) if v is not None) if any((d10, d50, d200)) else None
        if worst is not None:
            add(10, "snapshot at depth 10/50/200 <= 0.3 us", f"{worst * 1e6:.3f} us (worst depth)", worst <= 0.3e-6, main)
        fast = f"{main}, snapshotter()"
        vals = [v for v in (med(fast, d) for d in (10, 50, 200)) if v is not None]
        if vals:
            add(10, "snapshot at depth 10/50/200 <= 0.3 us, snapshotter()", f"{max(vals) * 1e6:.3f} us (worst depth)",
                max(vals) <= 0.3e-6, fast)
        rj = _get(snap, "ratio to main", "jax Traceback.get_traceback", "50", "median")
        add(7, "snapshot depth 50 <= jax get_traceback", None if rj is None else f"jax = {rj:.2f}x monstack",
            None if rj is None else rj >= 1.0, "jax not importable" if rj is None else "")
    tax = r.get("tax") or {}
    fib = _get(tax, "ratios", "call-heavy (fib)") or {}
    all_ = _get(fib, "track='all'", "median")
    if all_ is not None:
        inv = fib.get("track='all'")
        add(3, "fib tax track='all' <= 8x", round(all_, 2), all_ <= 8, "", inv)
        add(10, "fib tax track='all' <= 5x", round(all_, 2), all_ <= 5,
            tax.get("mode info", {}).get("track='all'", ""), inv)
        empty = _get(fib, "empty callbacks", "median")
        if empty:
            add(10, "fib tax track='all' within 1.5x of empty callbacks", f"{all_ / empty:.2f}x of {empty:.2f}x",
                all_ / empty <= 1.5, "", inv)
    filt = _get(fib, "workload filtered", "median")
    if filt is not None:
        add(3, "fib tax with the workload filtered <= 1.1x", round(filt, 2), filt <= 1.1, "", fib.get("workload filtered"))
    oq = r.get("opqueue") or {}
    dflt = _get(oq, "ratios", "default policy", "median")
    walk = _get(oq, "ratios", "walk per op", "median")
    if dflt is not None:
        inv = _get(oq, "ratios", "default policy")
        how = "framework binds snapshotter()"
        floor = _get(oq, "ratios", NOISE_FLOOR)
        if floor:
            how += f"; noise floor {floor['median']:.3f}x [{floor['min']:.2f}-{floor['max']:.2f}]"
        filtered = _get(oq, "ratios", FILTERED_FLOOR, "median")
        if filtered is not None:
            how += f"; every code filtered {filtered:.3f}x"
        add(7, "op-queue default policy <= 1.10x no capture", round(dflt, 3), dflt <= 1.10, how, inv)
        add(10, "op-queue default policy <= 1.05x no capture", round(dflt, 3), dflt <= 1.05, how, inv)
        plain = _get(oq, "ratios", "default policy, snapshot()", "median")
        if plain is not None:
            add(10, "op-queue default policy <= 1.05x, calling snapshot()", round(plain, 3), plain <= 1.05,
                "framework calls monstack.snapshot", _get(oq, "ratios", "default policy, snapshot()"))
        if walk is not None:
            add(7, "op-queue default policy faster than a walk per op", f"{dflt:.3f}x vs {walk:.3f}x", dflt < walk, "", inv)
    mem = r.get("memory") or {}
    for name, run in (mem.get("runs") or {}).items():
        if name.endswith("same frame") and not name.startswith("walk"):
            b = run.get("bytes per snapshot")
            add(7, f"< 120 bytes per snapshot ({name})", round(b, 1), b < 120)
        if name.endswith("new frame each") and not name.startswith("walk"):
            b = run.get("bytes per snapshot")
            # not the issue's measure (a loop in one frame): shown for what a fresh call costs
            add(7, f"bytes per snapshot ({name}), for information", round(b, 1), None,
                "each snapshot here also fills a new 64-B node for its new frame")
    for name, lv in (mem.get("liveness") or {}).items():
        ok = lv.get("local dead without gc") and lv.get("frame objects reachable from snapshots") == 0
        add(7, f"no frames kept alive ({name})", ok, bool(ok))
    if r.get("quick") and r.get("elapsed seconds") is not None and r.get("sections") == list(SECTIONS):
        add(7, "--quick under 30 s", round(r["elapsed seconds"], 1), r["elapsed seconds"] < 30)
    return out


def _main_snapshot_method(methods: dict) -> Optional[str]:
    for name in methods:
        if name.startswith("monstack ") and "walk" not in name and "pure-Python" not in name:
            return name
    return None


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def run(
    quick: bool = False,
    as_json: bool = False,
    file: Any = None,
    *,
    config: Optional[Config] = None,
    sections: Optional[Sequence[str]] = None,
) -> dict:
    """Run the bench, print it (table or JSON) to ``file`` and return the results."""
    file = file or sys.stdout
    cfg = config or CONFIGS["quick" if quick else "full"]()
    sections = list(sections) if sections else list(SECTIONS)
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise ValueError(f"unknown bench section(s) {bad}; valid choices: {list(SECTIONS)}")
    saved = _saved_install()
    t0 = time.perf_counter()
    reasons = _backend_reasons()
    results: dict = {
        "schema": SCHEMA,
        "python": sys.version.split()[0],
        "implementation": _env.IMPLEMENTATION,
        "machine": _env.MACHINE,
        "platform": sys.platform,
        "cpus": os.cpu_count(),
        "config": cfg.name,
        "quick": cfg.name == "quick",
        "rounds": cfg.rounds,
        "sections": sections,
        "backends": {k: (None if v is None else str(v)) for k, v in reasons.items()},
        "accelerator option": "accelerator" in _install_params(),
        "propagation points": list(_propagation_points()),
    }
    w = _workloads()
    caught: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run_sections(cfg, w, sections, results, saved)
    results["warnings"] = sorted({f"{type(c.message).__name__}: {c.message}" for c in caught})
    results["native skipped"] = _rehearsal[0] if _rehearsal else None
    results["elapsed seconds"] = time.perf_counter() - t0
    results["peak rss bytes"] = _peak_rss_bytes()
    results["targets"] = targets(results)
    if as_json:
        json.dump(results, file, indent=2, default=str)
        file.write("\n")
    else:
        _print(results, file)
    return results


def _run_sections(cfg: Config, w: types.ModuleType, sections: list, results: dict, saved: Optional[dict]) -> None:
    try:
        for section, fn in (("snapshot", snapshot_costs), ("tax", tracking_tax), ("opqueue", opqueue), ("memory", memory)):
            if section in sections:
                t = time.perf_counter()
                try:
                    results[section] = fn(cfg, w)
                except Exception as exc:  # one broken section must not hide the others
                    results[section] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
                results.setdefault("section seconds", {})[section] = time.perf_counter() - t
    finally:
        _restore_install(saved)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """argv-style entry: ``[--quick] [--json] [--only SECTION[,SECTION]] [--rounds N]``."""
    p = argparse.ArgumentParser(prog="python -m monstack bench", description="what monstack costs, as ratios measured in one run")
    p.add_argument("--quick", action="store_true", help="smaller sizes, 3 rounds (< 30 s)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--only", default="", help="comma-separated sections: " + ",".join(SECTIONS))
    p.add_argument("--rounds", type=int, default=None, help="rounds of every section (default 7, --quick 3; op-queue pairs: 21, --quick 5)")
    p.add_argument("--config", choices=sorted(CONFIGS), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cfg = CONFIGS[args.config or ("quick" if args.quick else "full")]()
    if args.rounds:
        cfg.rounds = cfg.opqueue_rounds = max(1, args.rounds)
    sections = [s.strip() for s in args.only.split(",") if s.strip()] or None
    run(as_json=args.json, config=cfg, sections=sections)
    return 0


# ---------------------------------------------------------------------------------------------
# Table output
# ---------------------------------------------------------------------------------------------


def _us(s: float) -> str:
    return f"{s * 1e6:.2f}" if s < 1e-4 else f"{s * 1e6:.0f}"


def _rx(s: dict) -> str:
    return f"{'INVALID ' if s.get('invalid') else ''}{s['median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}]"


def _print(r: dict, file: Any) -> None:
    w = file.write
    w(f"monstack bench: CPython {r['python']} {r['machine']}, {r['cpus']} cpus, {r['config']} sizes, "
      f"{r['rounds']} rounds; median of per-round figures [min-max]. Figures are machine-dependent.\n")
    be = ", ".join(f"{k}: {'yes' if v is None else 'no'}" for k, v in r["backends"].items() if k != "error")
    w(f"backends: {be}; accelerator option: {'yes' if r['accelerator option'] else 'no'}; "
      f"propagation points: {', '.join(r['propagation points']) or 'none'}\n")
    if "snapshot" in r:
        _print_snapshot(r["snapshot"], w)
    if "tax" in r:
        _print_tax(r["tax"], w)
    if "opqueue" in r:
        _print_opqueue(r["opqueue"], w)
    if "memory" in r:
        _print_memory(r["memory"], w)
    if r.get("native skipped"):
        w(f"\nNATIVE CODE SKIPPED in this run: {r['native skipped']}\n")
    for text in r.get("warnings", []):
        w(f"\nWARNING during the bench: {text}\n")
    w("\nTargets (issues 3, 7, 10; stated for CPython 3.12):\n")
    for t in r["targets"]:
        verdict = {True: "met", False: "NOT MET", None: "n/a"}[t["met"]]
        note = f"  ({t['note']})" if t["note"] else ""
        w(f"  #{t['issue']:<3d}{t['target']:58s} {str(t['value']):>22s}  {verdict}{note}\n")
    secs = ", ".join(f"{k} {v:.1f}s" for k, v in r.get("section seconds", {}).items())
    w(f"\nelapsed {r['elapsed seconds']:.1f} s ({secs}); peak RSS {r['peak rss bytes'] / 2**20:.0f} MiB\n")


def _error(section: dict, w: Callable) -> bool:
    if "error" in section:
        w(f"  section failed: {section['error']}\n")
        return True
    return False


def _print_snapshot(s: dict, w: Callable) -> None:
    w("\nSnapshot: cost per capture in us, median [min-max]; (median of per-round ratios to the first monstack row)\n")
    if _error(s, w):
        return
    depths = s["depths"]
    main = _main_snapshot_method(s["methods"]) or next(iter(s["methods"]))
    nw = max([30] + [len(n) + 1 for n in s["methods"]])
    w(f"  {'method':{nw}s}" + "".join(f"{'depth ' + str(d):>30s}" for d in depths) + "   frames\n")
    for name, per in s["methods"].items():
        cells = []
        for d in depths:
            v = per[str(d)]
            ratio = _get(s, "ratio to main", name, str(d), "median")
            if ratio is None:
                ratio = v["median"] / s["methods"][main][str(d)]["median"]
            cells.append(f"{_us(v['median'])} [{_us(v['min'])}-{_us(v['max'])}] ({ratio:.1f}x)")
        frames = "/".join(str(s["frames"][name].get(str(d))) for d in depths)
        w(f"  {name:{nw}s}" + "".join(f"{c:>30s}" for c in cells) + f"   {frames}\n")
    for key, v in s.get("main depth ratios", {}).items():
        w(f"  {main}, depth {key}: {_rx(v)} (per-round ratios)\n")
    for name, info in s.get("backend info", {}).items():
        w(f"  {name}: {info}\n")
    for name, why in s.get("skipped", {}).items():
        if name != "jax/torch":  # absent jax/torch are skipped silently
            w(f"  skipped {name}: {why}\n")


def _print_tax(t: dict, w: Callable) -> None:
    w("\nTracking tax: time with monstack / time without, median [min-max]\n")
    if _error(t, w):
        return
    modes: list[str] = []
    for per in t["ratios"].values():
        for m in per:
            if m not in modes:
                modes.append(m)
    w(f"  {'workload':20s}{'untracked':>11s}" + "".join(f"{m:>26s}" for m in modes) + "\n")
    for wname, per in t["ratios"].items():
        cells = [(_rx(per[m]) if m in per else "-") for m in modes]
        w(f"  {wname:20s}{t['untracked seconds'][wname] * 1e3:>8.1f} ms" + "".join(f"{c:>26s}" for c in cells) + "\n")
    _print_invalid(t["ratios"], w)
    if t.get("note"):
        w(f"  note: {t['note']}\n")
    sizes = ", ".join(f"{k} {v}" for k, v in t["sizes"].items())
    w(f"  sizes: {sizes}\n")
    for name, info in t.get("mode info", {}).items():
        w(f"  {name}: {info}\n")
    for name, why in t.get("skipped", {}).items():
        w(f"  skipped {name}: {why}\n")


def _print_opqueue(o: dict, w: Callable) -> None:
    w(f"\nOp-queue: user model {o.get('user depth')} frames deep -> framework dispatch "
      f"({o.get('helper calls per op')} helper calls) -> snapshot -> queue -> worker thread; "
      f"{o.get('ops per run')} ops per run\n")
    if _error(o, w):
        return
    base = o["us per op"]["no capture"]
    w(f"  {'mode':30s}{'ratio to no capture':>26s}{'us per op':>12s}{'overhead us/op':>16s}  checks\n")
    w(f"  {'no capture':30s}{'1.00x':>26s}{base['median']:>12.2f}{'':>16s}\n")
    for name, ratio in o["ratios"].items():
        ck = o["checks"][name]
        depth = o["snapshot depth"].get(name)
        top = o["snapshot top"].get(name)
        extra = f"ran {ck['ran']}/{ck['issued']}, snapshots {ck['snapshots']}"
        if depth is not None:
            extra += f", last: {depth} frames, top {top}"
        w(f"  {name:30s}{_rx(ratio):>26s}{o['us per op'][name]['median']:>12.2f}"
          f"{o['overhead us per op'][name]['median']:>16.2f}  {extra}\n")
    _print_invalid({"op-queue": o["ratios"]}, w)
    w(f"  framework excluded by default policy: {o.get('framework excluded by default policy')}; "
      f"model tracked: {o.get('model tracked by default policy')}\n")
    for name, info in o.get("mode info", {}).items():
        w(f"  {name}: {info}\n")
    c = o.get("crossover", {})
    if "points" in c:
        w("  crossover (default policy / no capture as the op gets lighter):\n")
        for p in c["points"]:
            w(f"    {p['helper calls per op']:3d} helper calls, op {p['op us (no capture)']:6.2f} us: "
              f"{_rx(p['ratio'])}, overhead {p['overhead us per op']:.2f} us/op\n")
        w(f"    overhead per op {c['overhead us per op (main run)']:.2f} us -> the default policy costs more than 10% "
          f"for ops lighter than ~{c['crossover op us (overhead / 0.10)']:.1f} us"
          f" (lightest measured op within 1.10x: {_fmtnum(c['lightest measured op within 1.10x (us)'])})\n")
    elif c:
        w(f"  crossover skipped: {c.get('skipped')}\n")


def _print_invalid(per_workload: dict, w: Callable) -> None:
    for wname, per in per_workload.items():
        for mname, s in per.items():
            if s.get("invalid"):
                w(f"  INVALID {wname} / {mname}: {s['invalid']}\n")


def _fmtnum(v: Any) -> str:
    return "none of them" if v is None else f"{v:.2f} us"


def _print_memory(m: dict, w: Callable) -> None:
    w(f"\nMemory: snapshots held in a list at depth {m.get('depth')}\n")
    if _error(m, w):
        return
    if m.get("sys.getsizeof(snapshot)"):
        w(f"  sys.getsizeof: snapshot {m['sys.getsizeof(snapshot)']} B, node {m.get('sys.getsizeof(node)')} B\n")
    for name, run in m["runs"].items():
        rss = run.get("rss bytes per snapshot")
        w(f"  {name:32s} {run['snapshots']:>9d} snapshots: {run['bytes per snapshot']:8.1f} B each (tracemalloc), "
          f"{'-' if rss is None else f'{rss:.1f}'} B (RSS), {run['frames per snapshot']} frames, "
          f"{run['seconds per snapshot'] * 1e6:.2f} us each\n")
    for name, lv in m["liveness"].items():
        w(f"  no frames kept alive ({name}): local dead without gc {lv['local dead without gc']}, "
          f"frames reachable from snapshots {lv['frame objects reachable from snapshots']}, "
          f"snapshot frames {lv['frames per snapshot']}, readable {lv['snapshot still readable']}\n")
    w(f"  peak RSS {m['peak rss bytes'] / 2**20:.0f} MiB\n")
