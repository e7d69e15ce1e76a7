"""A cyclic-garbage finalizer that runs while monstack decides about a code object's
first evaluation (3.11: the evalframe shim's policy call, which nothing tracks).

Its first snapshot rebuilds the shadow stack from the real frames; those nodes are never
popped and the frames it calls next are never pushed, so its next snapshots answer
stale from the fast path. Found by a fuzzer; run by tests/unit/test_stack.py
(test_finalizers_run_inside_monstack_machinery). Prints "mismatches: N".
"""
import gc
import sys

import monstack
from mismatch import bad, check


def work():
    check()


class Del:
    def __del__(self):
        check()  # right: the capture rebuilds from the real frames
        work()   # not pushed
        check()  # stale: answers the first check's node (line of the first call)


def callee(x):
    check()


def one_round():
    gc.collect()  # the count starts from zero: the collection lands at the same point every run
    d = Del()
    d.cyc = d
    del d
    gc.set_threshold(1)
    callee(0)  # the first allocation from here on (the policy call's) triggers the collection
    gc.set_threshold(700)
    check()


monstack.install()
print(sys.version.split()[0], monstack.active_backend())
for i in range(20):
    one_round()
print("mismatches:", len(bad))
for got, real in bad:
    print("  got ", got)
    print("  real", real)
