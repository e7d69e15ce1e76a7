"""The bench's workloads, compiled into synthetic modules.

``monstack_bench_workload`` is "user code" (tracked by the default policy): call-heavy
(fib), method-heavy, a generator pipeline, exception-heavy, mixed, a thread pool, asyncio
tasks, a
model for the op-queue, and the snapshot loops of the memory section.
``monstack_bench_framework.ops`` is an eager framework's dispatch in miniature, compiled
with a file name inside site-packages, so the default policy excludes it exactly as it
excludes an installed framework. ``OpQueue`` drives the two: user model -> framework
dispatch -> snapshot -> queue -> worker thread.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import types
from typing import Any, Optional

import monstack

WORKLOAD_MODULE = "monstack_bench_workload"
FRAMEWORK_MODULE = "monstack_bench_framework.ops"

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

# -- mixed: objects, dicts, str(), an exception now and then, a generator --------------------
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

# -- asyncio tasks ----------------------------------------------------------------------------
async def _trivial(i):
    return i

async def _tasks_main(n):
    import asyncio
    tasks = [asyncio.create_task(_trivial(i)) for i in range(n)]
    return sum(await asyncio.gather(*tasks))

def tasks_run(n):
    import asyncio
    return asyncio.run(_tasks_main(n))

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


def _make_module(name: str, src: str, filename: str) -> Any:
    """A module made from source at run time (typed Any: its names are the source's)."""
    mod = types.ModuleType(name)
    mod.__file__ = filename
    exec(compile(src, filename, "exec"), mod.__dict__)
    return mod


def make_workloads() -> Any:
    mod = _make_module(WORKLOAD_MODULE, _WORKLOAD_SRC, "<monstack-bench-workload>")
    mod.snapshot = monstack.snapshot
    return mod


def make_framework() -> Any:
    return _make_module(FRAMEWORK_MODULE, _FRAMEWORK_SRC, _framework_filename())


class OpQueue:
    """The op-queue workload: user model code -> framework dispatch -> snapshot -> queue ->
    worker thread. ``run()`` issues ``ops`` ops and returns when the worker ran them all."""

    N_BLOCKS = 4

    def __init__(self, w: Any, fw: Any, ops: int, depth: int) -> None:
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
            self.fw._capture = monstack.snapshotter()
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
            q: Any = self._queue_cls()
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
        self.w = make_workloads()
        self.fw = make_framework()
        self.fw.LAYERS = layers
        self.model = self.w.Model(self.fw, self.N_BLOCKS, 16)
        self.x = self.fw.Tensor((8, 16))
