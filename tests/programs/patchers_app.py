"""A program for tests/integration/test_patchers.py: another patcher of threads and pools (Sentry,
OpenTelemetry's threading or asyncio instrumentation, wrapt, a functools.wraps-style patch,
gevent, ddtrace) and monstack, in the order
``argv[2]`` names; prints what it saw as JSON.

``python patchers_app.py TOOL ORDER`` with ORDER one of ``tool-first``, ``monstack-first``
or ``env`` (monstack is already on: MONSTACK=1 installed it at start-up). ``LIBRARY_DIR`` in
the environment: a directory standing for site-packages (a tool installed with ``pip install
--target``), which monstack is told not to track.
"""

import json
import os
import sys

TOOL, ORDER = sys.argv[1], sys.argv[2]
if TOOL == "gevent" and ORDER == "tool-first":
    from gevent import monkey

    monkey.patch_all()

import concurrent.futures as cf  # noqa: E402
import functools  # noqa: E402
import threading  # noqa: E402

import monstack  # noqa: E402

out: dict = {"tool": TOOL, "order": ORDER}
events: list = []
seen: dict = {"start": [], "submit": []}
otel: dict = {}


def tool_on() -> None:
    if TOOL == "sentry":
        import sentry_sdk

        out["version"] = sentry_sdk.VERSION

        def before_send(event, hint):
            events.append(event)
            return None  # kept in this process: nothing is sent

        sentry_sdk.init(dsn="https://public@127.0.0.1:9/1", before_send=before_send, default_integrations=True,
                        auto_enabling_integrations=False)
        sentry_sdk.set_tag("where", "main")
    elif TOOL in ("otel", "otel-asyncio"):
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from monstack.otel import OriginSpanProcessor

        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(OriginSpanProcessor())
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        if TOOL == "otel":
            from opentelemetry.instrumentation.threading import ThreadingInstrumentor

            ThreadingInstrumentor().instrument()
        else:
            import os

            # the instrumentation's own switches: a span for these coroutines and to_thread functions
            os.environ["OTEL_PYTHON_ASYNCIO_COROUTINE_NAMES_TO_TRACE"] = "task_ok,task_fail"
            os.environ["OTEL_PYTHON_ASYNCIO_TO_THREAD_FUNCTION_NAMES_TO_TRACE"] = "in_thread"
            from opentelemetry.instrumentation.asyncio import AsyncioInstrumentor

            AsyncioInstrumentor().instrument()
        otel.update(trace=trace, tracer=trace.get_tracer("patchers"), exporter=exporter)
    elif TOOL == "ddtrace":
        import ddtrace
        from ddtrace.trace import tracer

        # ThreadPoolExecutor.submit and BaseEventLoop.create_task, rewritten in place (their __code__)
        ddtrace.patch(futures=True, asyncio=True)
        out["version"] = ddtrace.__version__
        otel.update(tracer=tracer)
    elif TOOL == "wrapt":
        import wrapt

        def on_start(wrapped, instance, args, kwargs):
            seen["start"].append(instance is not None and isinstance(instance, threading.Thread))
            return wrapped(*args, **kwargs)

        def on_submit(wrapped, instance, args, kwargs):
            seen["submit"].append(isinstance(instance, cf.ThreadPoolExecutor))
            return wrapped(*args, **kwargs)

        wrapt.wrap_function_wrapper(threading.Thread, "start", on_start)
        wrapt.wrap_function_wrapper(cf.ThreadPoolExecutor, "submit", on_submit)
    elif TOOL == "wraps":
        old_start, old_submit = threading.Thread.start, cf.ThreadPoolExecutor.submit

        @functools.wraps(old_start)
        def start(self, *args, **kwargs):
            seen["start"].append(isinstance(self, threading.Thread))
            return old_start(self, *args, **kwargs)

        @functools.wraps(old_submit)
        def submit(self, fn, /, *args, **kwargs):
            seen["submit"].append(isinstance(self, cf.ThreadPoolExecutor))
            return old_submit(self, fn, *args, **kwargs)

        threading.Thread.start = start
        cf.ThreadPoolExecutor.submit = submit
    elif TOOL == "gevent" and ORDER != "tool-first":
        from gevent import monkey

        monkey.patch_all(thread=True)


def monstack_on() -> None:
    if ORDER != "env":
        library = os.environ.get("LIBRARY_DIR")
        monstack.install(exclude=[library] if library else ())


def last_line(snap) -> list:
    """The lines of the origin's frames (the creating line last), [] for no origin."""
    return [f.line for f in snap.frames] if snap is not None else []


def thread_effect() -> object:
    """What the other tool makes visible inside the work."""
    if TOOL in ("otel", "otel-asyncio"):
        return otel["trace"].get_current_span().get_span_context().span_id
    if TOOL == "ddtrace":
        context = otel["tracer"].current_trace_context()
        return context.span_id if context is not None else None
    return None


def run_tasks(label: str) -> dict:
    """asyncio tasks (their coroutines traced by OTel's asyncio instrumentation) and a
    to_thread function."""
    import asyncio

    got: dict = {}

    async def task_ok() -> int:
        got["task_origin"] = last_line(monstack.current_origin())
        got["task_effect"] = thread_effect()
        return 7

    async def task_fail() -> None:
        raise LookupError(f"boom-task-{label}")

    def in_thread() -> int:
        got["to_thread_origin"] = last_line(monstack.current_origin())
        return 8

    async def main() -> None:
        got["task_value"] = await asyncio.create_task(task_ok())  # @task-ok
        failing = asyncio.create_task(task_fail())  # @task-fail
        try:
            await failing
        except LookupError as exc:
            got["task_error"] = str(exc)
            got["task_fail_origin"] = last_line(monstack.origin_of(exc))
        got["to_thread_value"] = await asyncio.to_thread(in_thread)  # @to-thread

    asyncio.run(main())
    return got


def run_work(label: str) -> dict:
    got: dict = {}
    caught: list = []
    threading.excepthook = lambda args: caught.append(args.exc_value)

    def ok() -> None:
        got["origin"] = last_line(monstack.current_origin())
        got["effect"] = thread_effect()

    def fail() -> None:
        raise ValueError(f"boom-thread-{label}")

    def job(x: int) -> int:
        got["job_effect"] = thread_effect()
        if x < 0:
            raise KeyError(f"boom-job-{label}")
        return x * 2

    parent = None
    if TOOL in ("otel", "otel-asyncio"):
        otel["exporter"].clear()
        span_cm = otel["tracer"].start_as_current_span(f"parent-{label}")
        parent = span_cm.__enter__()
    elif TOOL == "ddtrace":
        span_cm = otel["tracer"].trace(f"parent-{label}")
        parent = span_cm.__enter__()
    try:
        t = threading.Thread(target=ok)
        t.start()  # @thread-ok
        t.join()
        t = threading.Thread(target=fail)
        t.start()  # @thread-fail
        t.join()
        with cf.ThreadPoolExecutor(1) as pool:
            value = pool.submit(job, 21).result()
            try:
                pool.submit(job, -1).result()  # @submit-fail
                job_error = None
            except KeyError as exc:
                job_error = exc
        if TOOL in ("otel-asyncio", "ddtrace"):
            tasks = run_tasks(label)
    finally:
        if TOOL in ("otel", "otel-asyncio", "ddtrace"):
            span_cm.__exit__(None, None, None)
    res = {
        "thread_origin": got.get("origin", []),
        "thread_failed": [str(e) for e in caught],
        "thread_fail_origin": last_line(monstack.origin_of(caught[0])) if caught else [],
        "job_value": value,
        "job_error": str(job_error),
        "job_origin": last_line(monstack.origin_of(job_error)) if job_error is not None else [],
    }
    if TOOL == "otel-asyncio":
        res.update(tasks)
        res["task_effect_is_parent"] = tasks.get("task_effect") == parent.get_span_context().span_id
        res["spans"] = {}
        for span in otel["exporter"].get_finished_spans():
            if span.name.startswith("asyncio "):
                res["spans"][span.name] = {
                    "parent_is_parent": span.parent is not None and span.parent.span_id == parent.get_span_context().span_id,
                    "error": span.status.status_code.name == "ERROR",
                    "site": span.attributes.get("monstack.created_at"),
                }
    if TOOL == "ddtrace":
        res.update(tasks)
        res["job_effect_is_parent"] = got.get("job_effect") == parent.span_id
        res["task_effect_is_parent"] = tasks.get("task_effect") == parent.span_id
    if TOOL in ("otel", "otel-asyncio"):
        res["effect_is_parent"] = got.get("effect") == parent.get_span_context().span_id
        res["job_effect_is_parent"] = got.get("job_effect") == parent.get_span_context().span_id
    if TOOL == "sentry":
        mine = [e for e in events if any(f"boom-thread-{label}" in (v.get("value") or "")
                                         for v in e.get("exception", {}).get("values", []))]
        res["sentry_events"] = len(mine)
        res["sentry_tag"] = mine[0].get("tags", {}).get("where") if mine else None
    if TOOL in ("wrapt", "wraps"):
        res["seen"] = {k: list(v) for k, v in seen.items()}
        for v in seen.values():
            v.clear()
    if TOOL == "gevent":
        import gevent.monkey

        res["gevent_patched"] = gevent.monkey.is_module_patched("threading")
    return res


if ORDER == "tool-first":
    tool_on()
    monstack_on()
else:
    monstack_on()
    tool_on()
out["on"] = run_work("on")
if ORDER != "env":
    monstack.uninstall()
    out["after_uninstall"] = run_work("off")
print(json.dumps(out))
