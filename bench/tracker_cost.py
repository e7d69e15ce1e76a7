"""What the error-tracker integrations add per event and per span (docs/integrations.md).

- ``sentry``: ``sentry_sdk.capture_exception`` of a pool job's failure (the exception has an
  origin) and of a plain exception (none), each with the ``sentry`` point on and off
  (``install(propagate=[... without "sentry"])``); events are dropped by ``before_send``, so
  the figure is the SDK's whole capture path plus monstack's processor.
- ``otel``: starting and ending a span inside a pool job (the first span of work with an
  origin) and outside any work, with and without ``OriginSpanProcessor`` on the provider
  (a ``SimpleSpanProcessor`` with an in-memory exporter is there in both).

Method: each figure is the best of two timed runs of at least 15 ms after a warm-up, the
modes interleaved round by round; the ratio is the median of the per-round ratios, with
[min-max]. Needs sentry-sdk and opentelemetry-sdk. Another sentry-sdk goes first on
PYTHONPATH (it is not tracked, as an installed one would not be), e.g. the 3.x the tests
install: ``PYTHONPATH=.venvs/cache/sentry-sdk-3-cpython-312:.``.

    PYTHONPATH=. python3.12 bench/tracker_cost.py [ROUNDS]
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import sys
import time

import monstack


def _time(fn, n: int) -> float:
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / n


def _size(fn) -> int:
    n = 16
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t0 >= 0.015:
            return n
        n *= 2


def _measure(pairs: dict, rounds: int) -> None:
    """pairs: name -> (baseline fn, with fn, setup(on: bool))."""
    for name, (base, with_, setup) in pairs.items():
        ratios, b_us, w_us = [], [], []
        setup(True)
        n = _size(with_)
        base()
        with_()
        for r in range(rounds):
            order = [(False, base), (True, with_)] if r % 2 == 0 else [(True, with_), (False, base)]
            got = {}
            for on, fn in order:
                setup(on)
                got[on] = _time(fn, n)
            ratios.append(got[True] / got[False])
            b_us.append(got[False] * 1e6)
            w_us.append(got[True] * 1e6)
        print(f"{name:<44} {statistics.median(b_us):8.2f} us -> {statistics.median(w_us):8.2f} us   "
              f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}]")


def sentry(rounds: int) -> None:
    import sentry_sdk

    sentry_sdk.init(before_send=lambda e, h: None, default_integrations=False)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            pool.submit(lambda: 1 / 0).result()
        except ZeroDivisionError as exc:
            with_origin = exc
    try:
        {}["x"]
    except KeyError as exc:
        plain = exc
    assert monstack.origin_of(with_origin) is not None and monstack.origin_of(plain) is None
    everything = [p for p in monstack.PROPAGATION_POINTS]
    without = [p for p in everything if p != "sentry"]

    sdk_home = os.path.dirname(os.path.dirname(os.path.abspath(sentry_sdk.__file__)))
    print(f"sentry-sdk {sentry_sdk.VERSION}")

    def setup(on: bool) -> None:
        monstack.install(propagate=everything if on else without, exclude=[sdk_home])

    _measure({
        "sentry: capture_exception, exception with an origin": (
            lambda: sentry_sdk.capture_exception(with_origin), lambda: sentry_sdk.capture_exception(with_origin), setup),
        "sentry: capture_exception, no origin": (
            lambda: sentry_sdk.capture_exception(plain), lambda: sentry_sdk.capture_exception(plain), setup),
    }, rounds)


def otel(rounds: int) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from monstack.otel import OriginSpanProcessor

    monstack.install()
    tracers = {}
    for on in (False, True):
        provider = TracerProvider()
        if on:
            provider.add_span_processor(OriginSpanProcessor())
        exporter = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracers[on] = (provider.get_tracer("bench"), exporter)
    current = {"on": False}

    def span() -> None:
        tracer, exporter = tracers[current["on"]]
        with tracer.start_as_current_span("s"):
            pass
        exporter.clear()

    def setup(on: bool) -> None:
        current["on"] = on

    pool = concurrent.futures.ThreadPoolExecutor(1)
    origin = pool.submit(monstack.snapshot).result().origin
    assert origin is not None

    def in_work() -> None:
        with monstack.origin(origin):
            span()

    _measure({
        "otel: a span, first of work with an origin": (in_work, in_work, setup),
        "otel: a span outside any work": (span, span, setup),
    }, rounds)
    pool.shutdown()


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    print(f"CPython {sys.version.split()[0]}, {monstack.install()} backend")
    sentry(rounds)
    otel(rounds)
