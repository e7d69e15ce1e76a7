"""OpenTelemetry: ``monstack.otel.OriginSpanProcessor`` sets ``monstack.created_at`` and
``monstack.created_at.stack`` on the first span of work that has an origin (a thread, a pool
job, an asyncio task), nothing on its child spans or on spans outside such work. Against the
real SDK (``InMemorySpanExporter``), with and without contrib's threading instrumentation."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from pathlib import Path

import pytest

import monstack
from conftest import integration_module

pytestmark = pytest.mark.integration
integration_module("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from monstack.otel import SITE, STACK, OriginSpanProcessor  # noqa: E402

HERE = Path(__file__).name


def _line(marker: str) -> int:
    return [i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if line.rstrip().endswith(marker)][0]


@pytest.fixture
def spans(installed):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(OriginSpanProcessor())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    yield tracer, exporter
    provider.shutdown()


def _by_name(exporter) -> dict:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_the_first_span_of_a_thread_a_job_and_a_task_names_its_origin(spans):
    tracer, exporter = spans

    def work(name):
        with tracer.start_as_current_span(name):
            with tracer.start_as_current_span(name + "-child"):
                pass

    with tracer.start_as_current_span("outside"):
        t = threading.Thread(target=work, args=("thread",))
        t.start()  # MARK-thread
        t.join()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(work, "job").result()  # MARK-job

    async def coro():
        work("task")

    async def main():
        await asyncio.get_running_loop().create_task(coro())  # MARK-task

    asyncio.run(main())
    got = _by_name(exporter)
    for name in ("thread", "job", "task"):
        attrs = got[name].attributes
        assert attrs[SITE] == f"{HERE}:{_line('MARK-' + name)}", (name, dict(attrs))
        assert attrs[STACK].startswith("Work created at (most recent call last):")
        assert f"MARK-{name}" in attrs[STACK]
        assert SITE not in got[name + "-child"].attributes  # not the first span of that work
        assert "code.stacktrace" not in attrs
    assert SITE not in got["outside"].attributes


def test_with_contribs_threading_instrumentation_the_parent_is_propagated_too(spans):
    threading_instrumentation = integration_module("opentelemetry.instrumentation.threading")
    tracer, exporter = spans
    instrumentor = threading_instrumentation.ThreadingInstrumentor()
    instrumentor.instrument()
    try:
        def work():
            with tracer.start_as_current_span("in-thread"):
                pass

        with tracer.start_as_current_span("parent"):
            t = threading.Thread(target=work)
            t.start()  # MARK-instrumented
            t.join()
    finally:
        instrumentor.uninstrument()
    got = _by_name(exporter)
    child = got["in-thread"]
    assert child.parent is not None and child.parent.span_id == got["parent"].context.span_id  # OTel's effect kept
    assert child.attributes[SITE] == f"{HERE}:{_line('MARK-instrumented')}"


def test_no_origin_no_attributes_and_stack_can_be_left_out(installed):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(OriginSpanProcessor(stack=False))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("plain"):
        pass

    def work():
        with tracer.start_as_current_span("job"):
            pass

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(work).result()
    provider.shutdown()
    got = _by_name(exporter)
    assert dict(got["plain"].attributes) == {}
    assert SITE in got["job"].attributes and STACK not in got["job"].attributes


def test_without_monstack_installed_nothing_is_added():
    monstack.uninstall()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(OriginSpanProcessor())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")

    def work():
        with tracer.start_as_current_span("thread"):
            pass

    t = threading.Thread(target=work)
    t.start()
    t.join()
    provider.shutdown()
    assert SITE not in _by_name(exporter)["thread"].attributes
