"""The tasks and actors of tests/integration/test_ray.py. Ray's workers
import them by name (this folder is on their ``PYTHONPATH``); lines are named with
``# @marker`` comments."""

from __future__ import annotations

from typing import Any

import ray


@ray.remote
def boom(x: Any) -> None:
    raise ValueError(f"boom {x}")  # @boom


@ray.remote
def ok(x: int) -> dict:
    return {"x": x + 1, "list": [1, "two", 3.0], "none": None}


@ray.remote
def inc(x: int) -> int:
    return x + 1


@ray.remote
def outer(x: Any) -> None:
    """A task that submits a failing task and waits for it (in the worker)."""
    ref = boom.remote(x)  # @inner-submit
    ray.get(ref)


@ray.remote
class Counter:
    def __init__(self, fail: bool = False) -> None:
        if fail:
            raise KeyError("init failed")  # @init
        self.n = 0

    def add(self, k: int) -> int:
        self.n += k
        return self.n

    def fail(self, why: str) -> None:
        raise ValueError(f"method {why}")  # @method
