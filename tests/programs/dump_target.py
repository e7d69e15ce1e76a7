"""A hung program for the dump command's tests: a worker thread waits on an event forever
and the main thread does what argv[1] says, after printing "ready" (and its pid).

- ``loop``: runs Python (sleeps 10 ms at a time): reachable by sys.remote_exec;
- ``sleep``: blocked in one long time.sleep;
- ``lock``: blocked in lock.acquire() on a lock nobody releases;
- ``join``: blocked in joining the worker;
- ``sleep-then-loop``: blocked for argv[2] seconds, then loops (a late remote script runs).
"""

import sys
import threading
import time

event = threading.Event()


def worker():
    event.wait()  # the worker's waiting line


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "loop"
    thread = threading.Thread(target=worker, name="stuck-worker", daemon=True)
    thread.start()  # the worker's creating line
    print("ready", flush=True)
    if mode == "sleep":
        time.sleep(3600)  # main: sleeping
    elif mode == "lock":
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # main: waiting for a lock
    elif mode == "join":
        thread.join()  # main: joining
    elif mode == "sleep-then-loop":
        time.sleep(float(sys.argv[2]))
        for _ in range(int(float(sys.argv[3]) * 100)):
            time.sleep(0.01)
        print("done", flush=True)
        return
    while True:
        time.sleep(0.01)  # main: looping


if __name__ == "__main__":
    main()
