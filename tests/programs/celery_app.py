"""The Celery app of tests/integration/test_celery.py. The workers the tests start import it
(``celery -A celery_app worker``, broker and result serializer from the environment);
the tests build their own client apps with ``make_app``. Task bodies name their lines
with ``# @marker`` comments."""

from __future__ import annotations

import os
from typing import Any, Optional

from celery import Celery, chain

import monstack


def describe(snap: Optional[monstack.Snapshot]) -> list:
    """The snapshot's innermost ``[file name, line]`` and its origins', newest first."""
    out = []
    while snap is not None:
        recs = snap.records()
        out.append([os.path.basename(recs[-1][0]), recs[-1][1]] if recs else ["(none)", 0])
        snap = snap.origin
    return out


def make_app(broker: str, result_serializer: str = "json", eager: bool = False) -> Celery:
    backend = "cache+memory://" if broker.startswith("memory") else broker
    app = Celery("celery_app", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer=result_serializer,
        accept_content=["json"],  # task messages: JSON (a root worker refuses pickle)
        result_accept_content=["json", "pickle"],
        task_always_eager=eager,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )

    @app.task(name="celery_app.ok", shared=False)
    def ok(x: int) -> int:
        return x + 1

    @app.task(name="celery_app.boom", shared=False)
    def boom(x: Any) -> None:
        raise ValueError(f"boom {x}")  # @boom

    @app.task(name="celery_app.where", shared=False)
    def where(*_: Any) -> list:
        return describe(monstack.current_origin())

    @app.task(name="celery_app.headers_seen", shared=False, bind=True)
    def headers_seen(self: Any) -> list:
        return sorted((self.request.headers or {}).keys())

    @app.task(name="celery_app.flaky", shared=False, bind=True, max_retries=2, default_retry_delay=0)
    def flaky(self: Any) -> None:
        if self.request.retries < 2:
            raise self.retry(countdown=0)  # @retry
        custom = (self.request.headers or {}).get("custom")
        raise ValueError(f"gave up; origin {describe(monstack.current_origin())}; custom {custom!r}")

    @app.task(name="celery_app.spawn", shared=False)
    def spawn() -> str:
        return boom.delay("nested").id  # @spawn

    @app.task(name="celery_app.spawn_chain", shared=False)
    def spawn_chain() -> str:
        return chain(ok.s(1), where.s()).apply_async().id  # @spawn-chain

    return app


app = make_app(os.environ.get("CT_BROKER", "memory://"), os.environ.get("CT_RESULT_SERIALIZER", "json"))
