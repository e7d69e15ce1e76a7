"""Task functions for tests/integration/test_dask.py, imported by name on the Dask workers (a
module of its own: the workers need not import pytest or the test module). Lines
marked ``# @name`` are looked up by the tests."""

from __future__ import annotations

import os
import threading


def inc(x: int) -> int:
    return x + 1


def fail(x: int) -> int:
    raise ValueError(f"task failed on {x}")  # @fail


def origin_here() -> tuple:
    """What the worker sees: the innermost frame of the current origin, whether
    monstack is tracking there, and the carried source line."""
    import monstack

    snap = monstack.current_origin()
    if snap is None:
        return (None, None, monstack.active_backend(), None)
    fn, ln = snap.records()[-1][:2]
    return (fn, ln, monstack.active_backend(), snap.source_lines()[-1])


def submit_inner(x: int) -> int:
    from distributed import get_client

    client = get_client()
    return client.submit(fail, x).result()  # @inner-submit


def die(x: int) -> int:
    os._exit(3)


class Unpicklable(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.lock = threading.Lock()  # cannot be pickled: Dask sends another exception


def fail_unpicklable(x: int) -> int:
    raise Unpicklable(f"unpicklable {x}")


def fail_long(x: int) -> int:
    raise ValueError("long " + "x" * 20000)  # longer than distributed.admin.max-error-length


def line_of(tag: str, path: str = __file__) -> int:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.rstrip().endswith(f"# @{tag}"):
                return n
    raise LookupError(tag)
