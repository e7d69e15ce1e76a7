"""A thread-pool job blocked on an event that is never set; the main thread waits for it."""
import threading
from concurrent.futures import ThreadPoolExecutor

import _hang

_hang.setup()

never = threading.Event()
started = threading.Event()


def blocked_job(n):
    started.set()
    never.wait()  # WAITS-JOB
    return n


def submit_work(pool):
    return pool.submit(blocked_job, 1)  # SUBMITS


def main():
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pool")
    future = submit_work(pool)
    started.wait()
    _hang.ready()
    future.result()  # MAIN-WAITS


main()
