"""The main thread sleeping, a few calls deep; a worker thread sleeping too."""
import threading
import time

import _hang

_hang.setup()


def worker():
    time.sleep(3600)  # WAITS-WORKER


def nap():
    time.sleep(3600)  # MAIN-SLEEPS


def main():
    threading.Thread(target=worker, name="sleeper", daemon=True).start()  # STARTS-WORKER
    _hang.ready()
    nap()


main()
