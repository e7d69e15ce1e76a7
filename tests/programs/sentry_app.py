"""Sentry scenarios for tests/integration/test_sentry.py, run in a process of their own (Sentry's
integrations patch threading for good): argv[1] is the order (``sentry-first``,
``monstack-first``, ``env``: monstack on by MONSTACK=1, Sentry imported later), argv[2] a
DSN or ``none``; prints one JSON line per scenario: the events ``before_send`` kept."""

import asyncio
import concurrent.futures
import json
import logging
import sys
import threading

order, dsn = sys.argv[1], sys.argv[2]
events = []


def keep(event, hint):
    events.append(event)
    return event if dsn != "none" else None


def start_sentry(**options):
    import sentry_sdk
    from sentry_sdk.integrations.asyncio import AsyncioIntegration

    sentry_sdk.init(dsn=None if dsn == "none" else dsn, before_send=keep, default_integrations=True,
                    integrations=[AsyncioIntegration()], **options)
    return sentry_sdk


def job():
    return 1 / 0  # the job's failing line


def worker():
    raise ValueError("failed in a thread")


def logs():
    logging.getLogger("app").error("logged in a thread")


async def task():
    raise KeyError("failed in a task")


def emit(name):
    print(json.dumps({"scenario": name, "events": events}, default=str), flush=True)
    events.clear()


if order == "monstack-first":
    import monstack

    monstack.install()
    sentry_sdk = start_sentry(project_root=sys.argv[3] if len(sys.argv) > 3 else None)
elif order == "sentry-first":
    sentry_sdk = start_sentry(project_root=sys.argv[3] if len(sys.argv) > 3 else None)
    import monstack

    monstack.install()
else:  # env: MONSTACK=1 started monstack; sentry_sdk is imported only now
    sentry_sdk = start_sentry()
    import monstack

t = threading.Thread(target=worker)
t.start()  # the thread's creating line
t.join()
emit("thread")

with concurrent.futures.ThreadPoolExecutor(1) as pool:
    future = pool.submit(job)  # the job's submitting line
    try:
        future.result()
    except ZeroDivisionError as exc:
        sentry_sdk.capture_exception(exc)
emit("job")

t = threading.Thread(target=logs)
t.start()  # the logging thread's creating line
t.join()
emit("log")


async def main():
    asyncio.get_running_loop().create_task(task())  # the task's creating line
    await asyncio.sleep(0.05)

asyncio.run(main())
import gc

gc.collect()
emit("task")

try:
    {}["no origin"]
except KeyError as exc:
    sentry_sdk.capture_exception(exc)
emit("plain")

if order != "env":
    monstack.uninstall()
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    emit("after-uninstall")
sentry_sdk.flush(5)
