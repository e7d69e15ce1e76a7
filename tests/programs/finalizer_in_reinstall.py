"""An abandoned generator chain whose finalization (GeneratorExit, ``finally:`` blocks
running user code that snapshots) happens inside monstack.uninstall()/install(): the
cyclic GC fires in monstack's own code, where no events reach the backend. Snapshots
taken by that code are stale afterwards. Found by a fuzzer; run by tests/unit/test_stack.py
(test_finalizers_run_inside_monstack_machinery). Prints "mismatches: N".
"""
import gc
import sys
import warnings

import monstack
from mismatch import bad, check

warnings.simplefilter("always")


class E0(Exception): pass
class E1(Exception): pass
class E2(Exception): pass


def reinstall():
    monstack.uninstall()
    monstack.install()
    check()


def abandon(gen, k):
    for _ in range(k):
        try:
            next(gen)
        except (E0, E1, E2, RuntimeError, StopIteration):
            return


def f0(n):
    try:
        abandon(g2(n), 2)
    finally:
        [check() for _ in range(2)]


def g2(n):
    try:
        try:
            yield n
            if n % 2 == 0:
                raise StopIteration
        except (E0, E1, E2, RuntimeError, StopIteration):
            try:
                yield n
            except* E1:
                check()
        finally:
            try:
                {k: check() for k in range(2)}
                [[check() for _ in range(1)] for _ in range(2)]
                if n > 0:
                    yield from g2(n - 1)
            except E1:
                check()
    except Exception:
        check()


def main():
    gc.set_threshold(56)  # (where its collections land inside reinstall() on 3.12-3.14; they follow allocation counts)
    for k in range(4):
        try:
            f0(k)
        except (E0, E1, E2, RuntimeError):
            check()
        reinstall()
    gc.set_threshold(700)


monstack.install()
print(sys.version.split()[0], monstack.active_backend(), monstack.status().get("accelerator", "-"))
main()
print("mismatches:", len(bad))
for got, real in bad[:2]:
    print("  got ", got)
    print("  real", real)
