"""An asyncio task awaiting forever, in a loop running in another thread; the main
thread waits on an event."""
import asyncio
import threading

import _hang

_hang.setup()

loop_ready = threading.Event()


async def wait_forever():
    await asyncio.Event().wait()  # WAITS-TASK


async def supervisor():
    task = asyncio.create_task(wait_forever(), name="forever")  # CREATES-TASK
    await asyncio.sleep(0)
    loop_ready.set()
    await task  # WAITS-SUPERVISOR


def run_loop():
    asyncio.run(supervisor())


def main():
    t = threading.Thread(target=run_loop, name="event-loop", daemon=True)
    t.start()  # STARTS-LOOP
    loop_ready.wait()
    _hang.ready()
    threading.Event().wait()  # MAIN-WAITS


main()
