"""The jobs of tests/integration/test_rq.py (and bench/rq_cost.py). The workers the tests start import
them by name (``rq_jobs.boom``); job bodies name their lines with ``# @marker`` comments."""

from __future__ import annotations

import os
from typing import Any, Optional

from rq import get_current_job
from rq.job import Job

import monstack


def describe(snap: Optional[monstack.Snapshot]) -> list:
    """The snapshot's innermost ``[file name, line]`` and its origins', newest first."""
    out = []
    while snap is not None:
        recs = snap.records()
        out.append([os.path.basename(recs[-1][0]), recs[-1][1]] if recs else ["(none)", 0])
        snap = snap.origin
    return out


def ok(x: int) -> dict:
    return {"x": x + 1, "list": [1, "two", 3.0], "none": None}


def boom(x: Any) -> None:
    raise ValueError(f"boom {x}")  # @boom


def where(*_: Any) -> list:
    return describe(monstack.current_origin())


def origin_id() -> int:
    return id(monstack.current_origin())


def spawn(queue_name: str) -> str:
    """A job that enqueues a failing job (the inner job chains this one's origin)."""
    job = get_current_job()
    from rq import Queue

    queue = Queue(queue_name, connection=job.connection, serializer=job.serializer)
    return queue.enqueue(boom, "nested").id  # @spawn


class CustomJob(Job):
    """A job_class with its own ``create`` and ``perform``, calling the base's."""

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> Any:
        job = super().create(*args, **kwargs)  # @custom-create
        job.meta["custom"] = "created"
        return job

    def perform(self) -> Any:
        self.meta["performed_by"] = type(self).__name__
        self.save_meta()
        return super().perform()
