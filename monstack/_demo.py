"""``python -m monstack demo``: the op-queue case.

A tiny "framework" queues operations and runs them later on a worker thread, the way
GPU runtimes, database drivers and job queues do. One op fails in the worker ("out of
memory"). The worker's traceback alone shows the framework's loop; monstack also shows
the line of the *user's* code that queued the failing op.

The demo's two modules are compiled from the source below under their own file names
(registered with ``linecache`` so source lines print): monstack never tracks its own
files, and the demo must look like user code to be shown.
"""

from __future__ import annotations

import linecache
import sys
from typing import IO, Any, Optional

OPQUEUE_FILE = "<demo>/opqueue.py"
APP_FILE = "<demo>/app.py"

OPQUEUE_SOURCE = '''\
"""A tiny framework: ops are queued by the caller and run later, in order, on a worker."""
import queue
import threading

import monstack


class OpQueue:
    def __init__(self):
        self._ops = queue.Queue()
        self._errors = []
        self._worker = threading.Thread(target=self._work, name="op-worker", daemon=True)
        self._worker.start()

    def submit(self, op, *args):
        # monstack.wrap() remembers the line that called submit(): the op carries it.
        self._ops.put((monstack.wrap(op), args))

    def synchronize(self):
        """Wait for every queued op; re-raise the first failure (like a device sync)."""
        self._ops.put(None)
        self._worker.join()
        if self._errors:
            raise self._errors[0]

    def _work(self):
        while (item := self._ops.get()) is not None:
            op, args = item
            try:
                op(*args)
            except Exception as exc:
                self._errors.append(exc)
'''

APP_SOURCE = '''\
"""The user's program: builds a model by queueing allocations."""

FREE_MB = 2048


def allocate(name, mb):
    global FREE_MB
    if mb > FREE_MB:
        raise RuntimeError(f"out of memory: {name} needs {mb} MB, {FREE_MB} MB free")
    FREE_MB -= mb


def build_model(ops):
    ops.submit(allocate, "weights", 512)
    ops.submit(allocate, "activations", 4096)
    ops.submit(allocate, "gradients", 512)


def main(ops):
    build_model(ops)
    ops.synchronize()
'''


def _load(filename: str, source: str, namespace: dict) -> dict:
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)  # mtime None: never evicted
    exec(compile(source, filename, "exec"), namespace)
    return namespace


def _listing(source: str) -> str:
    """``source`` with line numbers, as the tracebacks above number its lines."""
    lines = source.splitlines()
    width = len(str(len(lines)))
    return "".join(f"{number:>{width}}  {line}".rstrip() + "\n" for number, line in enumerate(lines, 1))


def run_demo(file: Optional[IO[str]] = None) -> int:
    """Run the op-queue demo, writing what a user would see to ``file`` (default stdout).

    Installs monstack for the run if it is not installed (and uninstalls it afterwards).
    Returns 0 when the origin of the failing op was shown, 1 otherwise.
    """
    import monstack
    from . import _format
    from ._colorize import resolve
    from ._origin import format_exception, origin_of

    out: IO[str] = file if file is not None else sys.stdout
    color = resolve(None, out)
    installed_here = monstack.active_backend() is None
    if installed_here:
        monstack.install()
    try:
        framework = _load(OPQUEUE_FILE, OPQUEUE_SOURCE, {"__name__": "demo.opqueue"})
        app = _load(APP_FILE, APP_SOURCE, {"__name__": "demo.app"})
        ops = framework["OpQueue"]()
        try:
            app["main"](ops)
        except RuntimeError as exc:
            failure: Any = exc
        else:  # pragma: no cover - the demo always fails
            out.write("the demo op did not fail?\n")
            return 1
        w = out.write
        w(_format.heading("monstack demo: an op queued by user code fails later on a worker thread", color))
        w(f"(backend: {monstack.active_backend()}; see {APP_FILE} below)\n\n")
        w("Without monstack, the traceback shows the worker loop and allocate(), not which\n")
        w("submit() queued the failing op:\n\n")
        w(_format.format_traceback(failure, color) + "\n")
        w("With monstack, the same exception also says which line of *your* code queued the op:\n\n")
        w(format_exception(failure, color=color))
        w("\n" + _format.heading(f"{APP_FILE}, the program the lines above point into", color))
        w(_listing(APP_SOURCE))
        return 0 if origin_of(failure) is not None else 1
    finally:
        if installed_here:
            monstack.uninstall()
