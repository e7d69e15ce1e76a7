"""Finalizers that snapshot at interpreter exit, after monstack's own atexit handler (on
3.11 it makes the eval_frame shim inert: snapshots must then walk the real frames, right
and without a "another tool replaced monstack's eval_frame function" warning). Run by
tests/unit/test_stack.py (test_finalizer_programs). Prints "mismatches: N" from the last
atexit handler (registered first, so it runs after monstack's)."""
import atexit
import gc
import sys

import monstack
from mismatch import bad, check


def report():
    work()
    gc.collect()  # frees the cycle below: its finalizer snapshots
    check()
    print("mismatches:", len(bad))
    for got, real in bad:
        print("  got ", got)
        print("  real", real)
    sys.stdout.flush()


def work():
    check()


class Del:
    def __del__(self):
        check()
        work()
        check()


def leave_garbage():
    d = Del()
    d.cyc = d


atexit.register(report)  # before install(): runs after monstack's handler
monstack.install()
print(sys.version.split()[0], monstack.active_backend())
work()
gc.disable()
leave_garbage()
