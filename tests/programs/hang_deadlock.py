"""Two threads in a lock-order deadlock; the main thread joins them."""
import threading
import time

import _hang

_hang.setup()

first = threading.Lock()
second = threading.Lock()
both_hold = threading.Barrier(2)


def take_first_then_second():
    with first:
        both_hold.wait()
        with second:  # WAITS-A
            pass


def take_second_then_first():
    with second:
        both_hold.wait()
        with first:  # WAITS-B
            pass


def main():
    a = threading.Thread(target=take_first_then_second, name="alpha")
    b = threading.Thread(target=take_second_then_first, name="beta")
    a.start()  # STARTS-A
    b.start()  # STARTS-B
    while both_hold.n_waiting or not (first.locked() and second.locked()):
        time.sleep(0.01)
    _hang.ready()
    a.join()  # MAIN-WAITS


main()
