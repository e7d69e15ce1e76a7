"""What the programs here share: ``check()`` compares a snapshot with the real frames
(the current policy's tracked ones) and keeps each disagreement in ``bad``."""
import sys

import monstack
from monstack._capture import current_policy

bad: list = []


def real_records(f):
    policy = current_policy()
    out = []
    while f is not None:
        if policy.is_tracked(f.f_code, f.f_globals.get("__name__")):
            out.append((f.f_code.co_name, f.f_lineno))
        f = f.f_back
    return out[::-1]


def check():
    snap, real = monstack.snapshot(), real_records(sys._getframe())
    got = [(r[2], r[1]) for r in snap.records()]
    if got != real:
        bad.append((got, real))
