"""monstack.logging: the origin on log records from threads, pools, asyncio tasks and queues."""

from __future__ import annotations

import asyncio
import io
import os
import logging
import logging.config
import logging.handlers
import queue
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import monstack
from monstack import _format
from monstack import origin
from monstack.logging import OriginFilter, OriginFormatter, OriginFormatterMixin, annotate, where

HEADING = "Work created at (most recent call last):"
THIS = __file__


def here() -> int:
    """The caller's current line (to name creating lines without hard-coding numbers)."""
    return sys._getframe(1).f_lineno


class Capture:
    """A logger with one handler writing to a string; filter and formatter as asked."""

    def __init__(self, fmt: str = "%(levelname)s %(message)s |%(monstack_where)s|", *, use_filter: bool = True,
                 formatter: logging.Formatter | None = None) -> None:
        self.stream = io.StringIO()
        self.handler = logging.StreamHandler(self.stream)
        self.handler.setFormatter(formatter or OriginFormatter(fmt))
        self.logger = logging.getLogger(f"monstack.test.{id(self)}")
        self.logger.propagate = False
        self.logger.setLevel(logging.DEBUG)
        self.logger.addHandler(self.handler)
        self.filter = OriginFilter() if use_filter else None
        if self.filter is not None:
            self.logger.addFilter(self.filter)

    @property
    def text(self) -> str:
        return self.stream.getvalue()

    def close(self) -> None:
        self.logger.removeHandler(self.handler)
        if self.filter is not None:
            self.logger.removeFilter(self.filter)


@pytest.fixture
def cap():
    c = Capture()
    yield c
    c.close()


def at(line: int, func: str = "") -> str:
    return f"{THIS}:{line} in {func}" if func else f"{THIS}:{line} in "


# -- the filter ----------------------------------------------------------------------------


def test_filter_without_origin_sets_none_and_empty(cap):
    records = []
    cap.handler.addFilter(lambda r: records.append(r) or True)
    cap.logger.info("plain")
    assert records[0].monstack_origin is None and records[0].monstack_where == ""
    assert cap.text == "INFO plain ||\n"


def test_filter_in_a_thread_names_the_line_that_started_it(installed, cap):
    def work():
        cap.logger.warning("in worker")

    t = threading.Thread(target=work)
    t.start(); line = here()  # noqa: E702
    t.join()
    assert cap.text == f"WARNING in worker |{at(line, 'test_filter_in_a_thread_names_the_line_that_started_it')}|\n"


def test_filter_first_annotation_wins():
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    snap = monstack.snapshot(); line = here()  # noqa: E702
    with origin(snap):
        annotate(record)
    annotate(record)  # later, elsewhere: kept
    assert record.monstack_origin is snap
    assert record.monstack_where == at(line, "test_filter_first_annotation_wins")
    assert where(None) == ""


def test_annotate_from_another_thread_does_not_guess():
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    record.thread = -1  # made by some other thread
    with origin(monstack.snapshot()):
        annotate(record)
    assert record.monstack_origin is None and record.monstack_where == ""


def test_dict_config(installed):
    stream = io.StringIO()
    logging.config.dictConfig(
        {
            "version": 1,
            "disable_existing_loggers": False,
            "filters": {"origin": {"()": "monstack.logging.OriginFilter"}},
            "formatters": {
                "origin": {"class": "monstack.logging.OriginFormatter", "format": "%(message)s from %(monstack_where)s"}
            },
            "handlers": {
                "mem": {"class": "logging.StreamHandler", "stream": stream, "formatter": "origin", "filters": ["origin"]}
            },
            "loggers": {"monstack.test.dict": {"handlers": ["mem"], "level": "INFO", "propagate": False}},
        }
    )
    log = logging.getLogger("monstack.test.dict")
    try:
        with ThreadPoolExecutor(1) as pool:
            pool.submit(log.info, "hello").result(); line = here()  # noqa: E702
        assert stream.getvalue() == f"hello from {at(line, 'test_dict_config')}\n"
    finally:
        for h in list(log.handlers):
            log.removeHandler(h)


def test_no_global_record_factory_is_replaced(installed, cap):
    # what was there stays (logging's own class, or another library's factory: importing ray
    # sets one), and monstack installed none of its own on the way
    factory = logging.getLogRecordFactory()
    with ThreadPoolExecutor(1) as pool:
        pool.submit(cap.logger.error, "x").result()
    assert logging.getLogRecordFactory() is factory
    assert getattr(factory, "__module__", "").split(".")[0] != "monstack"


# -- the formatter: tracebacks -------------------------------------------------------------


def test_exception_logged_in_the_worker_gets_the_chain_after_the_traceback(installed, cap):
    def work():
        try:
            raise KeyError("missing")
        except KeyError:
            cap.logger.exception("failed")

    t = threading.Thread(target=work)
    t.start(); line = here()  # noqa: E702
    t.join()
    text = cap.text
    first, rest = text.split("\n", 1)
    assert first == f"ERROR failed |{at(line, 'test_exception_logged_in_the_worker_gets_the_chain_after_the_traceback')}|"
    traceback_part, chain = rest.split(HEADING)
    assert traceback_part.startswith("Traceback (most recent call last):") and "KeyError: 'missing'\n" in traceback_part
    assert chain.startswith(f'\n  File "{THIS}", line {line}, in test_exception_logged')
    assert text.count(HEADING) == 1


def test_exception_that_carries_its_origin_is_not_reported_twice(installed, cap):
    def job():
        raise ValueError("bad op")

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(job); line = here()  # noqa: E702
        try:
            future.result()
        except ValueError as exc:
            caught = exc
            cap.logger.exception("op failed")  # no current origin here: the exception's own
    # The exception carries no note: the formatter reads its origin (monstack.origin_of)
    # and prints the chain after the traceback, once.
    assert not hasattr(caught, "__notes__")
    text = cap.text
    assert text.count(HEADING) == 1
    assert text.index("ValueError: bad op") < text.index(HEADING)
    assert f'  File "{THIS}", line {line}, in test_exception_that_carries' in text.split(HEADING)[1]


def test_exc_text_cached_by_another_formatter_does_not_hide_the_origin(installed, cap):
    plain_stream = io.StringIO()
    plain = logging.StreamHandler(plain_stream)  # first, with the stock formatter
    cap.logger.handlers.insert(0, plain)

    def work():
        try:
            1 / 0
        except ZeroDivisionError:
            cap.logger.exception("div")

    t = threading.Thread(target=work)
    t.start()
    t.join()
    cap.logger.removeHandler(plain)
    assert HEADING not in plain_stream.getvalue()  # the stock formatter's text is its own
    assert cap.text.count(HEADING) == 1


def test_stack_info_shows_the_causal_stack(installed, cap):
    def inner():
        cap.logger.info("where am I", stack_info=True)

    async def task_body():
        inner()

    async def main():
        await asyncio.create_task(task_body()); return here()  # noqa: E702

    line = asyncio.run(main())
    text = cap.text
    stack, chain = text.split(HEADING)
    assert "Stack (most recent call last):" in stack and "in inner\n" in stack
    assert chain.startswith(f'\n  File "{THIS}", line ')  # outermost first: the test function
    assert chain.rstrip("\n").endswith(f'  File "{THIS}", line {line}, in main\n    await asyncio.create_task(task_body()); return here()  # noqa: E702')


def test_color_only_when_asked(installed):
    plain, colored = Capture(), Capture(formatter=OriginFormatter("%(message)s", color=True))
    try:
        def work():
            for c in (plain, colored):
                c.logger.info("s", stack_info=True)

        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert "\x1b[" not in plain.text and HEADING in plain.text
        assert "\x1b[" in colored.text
    finally:
        plain.close()
        colored.close()


def test_mixin_on_a_user_formatter(installed):
    class Upper(logging.Formatter):
        def formatMessage(self, record: logging.LogRecord) -> str:
            return super().formatMessage(record).upper()

    class UpperWithOrigin(OriginFormatterMixin, Upper):
        pass

    c = Capture(formatter=UpperWithOrigin("%(message)s"))
    try:
        def work():
            try:
                raise OSError("disk")
            except OSError:
                c.logger.exception("io")

        t = threading.Thread(target=work)
        t.start(); line = here()  # noqa: E702
        t.join()
        assert c.text.startswith("IO\nTraceback")
        assert f'line {line}, in test_mixin_on_a_user_formatter' in c.text.split(HEADING)[1]
    finally:
        c.close()


def test_a_failing_core_never_breaks_logging(installed, cap, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("formatting core broken")

    monkeypatch.setattr(_format, "format_origin", broken)

    def work():
        try:
            raise KeyError("k")
        except KeyError:
            cap.logger.exception("e")

    t = threading.Thread(target=work)
    t.start(); line = here()  # noqa: E702
    t.join()
    # The fallback renders the snapshot's own frames.
    assert f'line {line}, in test_a_failing_core_never_breaks_logging' in cap.text.split(HEADING)[1]


# -- pools, asyncio, queues ------------------------------------------------------------------


def test_thread_pool_records_name_the_submitting_line(installed, cap):
    def job(n: int) -> None:
        cap.logger.info("job %d", n)

    lines = []
    with ThreadPoolExecutor(2) as pool:
        f1 = pool.submit(job, 1); lines.append(here())  # noqa: E702
        f2 = pool.submit(job, 2); lines.append(here())  # noqa: E702
        f1.result(), f2.result()
    got = sorted(cap.text.splitlines())
    name = "test_thread_pool_records_name_the_submitting_line"
    assert got == [f"INFO job 1 |{at(lines[0], name)}|", f"INFO job 2 |{at(lines[1], name)}|"]


def test_asyncio_tasks_each_have_their_own_origin(installed, cap):
    async def step(name: str) -> None:
        await asyncio.sleep(0)
        cap.logger.info(name)
        await asyncio.sleep(0)
        cap.logger.info(name)

    async def main() -> list[int]:
        lines = []
        a = asyncio.create_task(step("a")); lines.append(here())  # noqa: E702
        b = asyncio.ensure_future(step("b")); lines.append(here())  # noqa: E702
        await asyncio.gather(a, b)
        cap.logger.info("main")
        return lines

    la, lb = asyncio.run(main())
    got = cap.text.splitlines()
    assert sorted(got[:4]) == sorted([f"INFO a |{at(la, 'main')}|"] * 2 + [f"INFO b |{at(lb, 'main')}|"] * 2)
    assert got[4] == "INFO main ||"


def test_queue_listener_gets_the_emitting_threads_origin(installed):
    """Filter on the QueueHandler (emitting thread), formatter on the listener's handler."""
    q: queue.Queue = queue.Queue()
    qh = logging.handlers.QueueHandler(q)
    qh.addFilter(OriginFilter())
    stream = io.StringIO()
    out = logging.StreamHandler(stream)
    out.setFormatter(OriginFormatter("%(message)s |%(monstack_where)s|"))
    unfiltered = io.StringIO()
    out2 = logging.StreamHandler(unfiltered)  # a listener-side formatter without the filter
    out2.setFormatter(OriginFormatter("%(message)s |%(monstack_where)s|"))
    q2: queue.Queue = queue.Queue()
    qh2 = logging.handlers.QueueHandler(q2)
    log = logging.getLogger("monstack.test.queue")
    log2 = logging.getLogger("monstack.test.queue.unfiltered")
    for lg, h in ((log, qh), (log2, qh2)):
        lg.propagate = False
        lg.setLevel(logging.INFO)
        lg.addHandler(h)
    # Started under install(), so the listener threads have an origin of their own: the
    # records must not get it.
    listener = logging.handlers.QueueListener(q, out)
    listener2 = logging.handlers.QueueListener(q2, out2)
    listener.start(); listener2.start()  # noqa: E702
    try:
        def work():
            log.info("from worker")
            log2.info("from worker")

        t = threading.Thread(target=work)
        t.start(); line = here()  # noqa: E702
        t.join()
        log.info("from main")
        log2.info("from main")
    finally:
        listener.stop(); listener2.stop()  # noqa: E702
        log.removeHandler(qh)
        log2.removeHandler(qh2)
    name = "test_queue_listener_gets_the_emitting_threads_origin"
    assert stream.getvalue() == f"from worker |{at(line, name)}|\nfrom main ||\n"
    assert unfiltered.getvalue() == "from worker ||\nfrom main ||\n"  # unknown, never the listener's


def test_the_readmes_logging_recipe_prints_what_it_shows_and_no_empty_brackets(tmp_path):
    """The README's "Logging" example, run as written, plus a line logged outside any
    work: that line ends with the message (no ``[created at ]``)."""
    import re
    import subprocess
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("\n## Logging\n"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    shown = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    app = tmp_path / "app.py"
    app.write_text(code + "for t in threading.enumerate():\n    t is threading.current_thread() or t.join()\n"
                   "log.info('outside any work')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MONSTACK")}
    out = subprocess.run([sys.executable, str(app)], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    creator = code.splitlines().index(next(l for l in code.splitlines() if "<- the line" in l)) + 1
    expect = [l.replace("/home/me/app.py", str(app)).replace(":19 ", f":{creator} ") for l in shown.splitlines()]
    expect = [l for l in expect if not set(l.strip()) <= set("~^")]  # (3.11+ carets vary)
    assert [l for l in lines if not set(l.strip()) <= set("~^")][: len(expect)] == [
        l.replace(", line 15,", f", line {creator - 4},") for l in expect]
    assert lines[-1] == "INFO outside any work"
