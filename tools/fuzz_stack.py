#!/usr/bin/env python3
"""Random-program fuzzer for monstack's shadow stack (a developer tool, stdlib only).

Generates random Python programs from a seed (the same seed always gives the same
program), runs them in child processes under monstack with one configuration, and at
many points compares ``monstack.snapshot()`` with the real frames under the same
tracking policy (file, line and function of every tracked frame, as tests/stackcheck.py
does). Program kinds (``--kinds``):

``mixed``
    functions, generators and coroutines calling each other: recursion (bounded, plus
    deep chains), exceptions raised and caught at various levels, try/finally,
    generators driven by ``for`` or by hand (next/send/throw/close), ``yield from``,
    coroutines driven by hand and by asyncio (gather, tasks, cancellation, TaskGroup),
    context managers (classes, ``contextlib.contextmanager``, ``async with``),
    callbacks through C (map, sorted/min keys, functools.reduce, filter), library code
    (a module in a filtered directory) calling back, driving generators and taking its
    own snapshots, threads, and uninstall/install mid-stack.
``throw``
    ``gen.throw()``/``close()`` into chains of one recursive generator (or coroutine):
    levels that are tracked, library generators, delegate objects with Python
    ``throw()`` methods (tracked or library), catchers that return, yield, raise,
    call back, reinstall or throw into another chain; throwers that run the same code
    (under callers of the same code), plain functions, library code or another thread.
``finalizer`` (opt-in)
    ``mixed`` plus ``__del__`` of cyclic garbage and abandoned generators (in cycles or
    not) whose ``finally:`` blocks take snapshots, with ``gc.collect()`` at chosen
    points. Automatic collection is off in every kind (``--gc auto`` turns it on):
    a collection at an arbitrary allocation can land inside monstack's own machinery,
    a known gap (docs/known-gaps.md) this tool does not recognise; explicit collections
    run finalizers at points where events reach monstack.

Known gaps that are recognised and reported as "known", not as failures: on 3.11
(``evalframe``), a library level's own snapshot taken while a ``gen.throw()`` of the same
thread is running (docs/known-gaps.md, "a library level's own snapshot after a caught
throw").

A mismatch, an unexpected exception escaping a program, a crash (signal) or a hang of a
child is a failure: the program is minimized (greedy statement removal, bounded) and the
reproducer is written to ``--keep`` (default: a temp dir) as ``seed<N>/repro.py`` with
its library module; run it from the repository root with ``PYTHONPATH=. python
DIR/seed<N>/repro.py``. Exit status 1 if any failure, 0 otherwise.

    PYTHONPATH=. python3.12 tools/fuzz_stack.py --seed 0 --count 2000
    PYTHONPATH=. MONSTACK_ACCELERATOR=0 python3.12 tools/fuzz_stack.py --seed 0 --count 2000
    PYTHONPATH=. python3.11 tools/fuzz_stack.py --seed 5000 --count 500 --kinds throw --keep /tmp/fz
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

KINDS = ("mixed", "throw", "finalizer")
DEFAULT_KINDS = ("mixed", "throw")

# ======================================================================================
# What every program file starts with: the comparison (the oracle) and the configuration.
# ======================================================================================

HARNESS = r'''
import asyncio, contextlib, functools, gc, json, os, sys, threading, traceback, types

import monstack
from monstack._capture import current_policy

SEED = {seed}
KIND = {kind!r}
OPTS = {opts!r}
GC_AUTO = {gc_auto!r}
INJECT = {inject!r}
LIBDIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib")
OPTS["exclude"] = [LIBDIR]
if LIBDIR not in sys.path:
    sys.path.insert(0, LIBDIR)
import fuzzlib

BAD = []      # real mismatches: (where, shadow, real)
KNOWN = []    # mismatches of a recognised known gap: (gap, where, shadow, real)
_checks = [0]
_T = threading.local()   # _T.throwing: gen.throw() calls running on this thread


def _real(frame, policy):
    out = []
    f = frame
    while f is not None:
        if policy.is_tracked(f.f_code, f.f_globals.get("__name__")):
            out.append((f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    out.reverse()
    return out


def _report(snap, real, desc, where, lib=False):
    if current_policy().describe() != desc[0] or _generation[0] != desc[1]:
        return  # another thread uninstalled or installed around the snapshot
    got = [tuple(r[:3]) for r in snap.records()]
    _checks[0] += 1
    if INJECT and _checks[0] % 5 == 0 and got:  # --inject-bug: a corrupted shadow stack
        got = got[:-2] + got[-1:] if len(got) > 1 else [(got[0][0], got[0][1] + 1000, got[0][2])]
    if got == real:
        return
    backend = monstack.active_backend()
    if lib and backend == "evalframe" and getattr(_T, "throwing", 0):
        KNOWN.append(("3.11-library-snapshot-during-throw", where, got, real))
        return
    BAD.append((where, got, real))


def check(where=""):
    """Compare the snapshot taken here with the real frames (same policy)."""
    frame = sys._getframe()
    if not where:
        where = "line %d" % frame.f_back.f_lineno
    desc = current_policy().describe(), _generation[0]
    snap, real = monstack.snapshot(), _real(frame, current_policy())  # one line: same f_lineno
    return _report(snap, real, desc, where)



_generation = [0]  # changes around every uninstall()/install() the program makes
_gen_lock = threading.Lock()


def _bump():
    with _gen_lock:
        _generation[0] += 1


def uninstall():
    _bump()
    monstack.uninstall()
    _bump()


def install():
    _bump()
    monstack.install(**OPTS)
    _bump()


fuzzlib.REPORT, fuzzlib.REAL, fuzzlib.GENERATION = _report, _real, _generation


def cmp_here(generation, snap, frame):
    """The second half of an inline check, ``cmp_here(_generation[0], monstack.snapshot(),
    sys._getframe())``: the snapshot is taken by the checked frame itself (check() is a
    call, a tracked frame of its own)."""
    real = _real(frame, current_policy())
    return _report(snap, real, (current_policy().describe(), generation), "line %d (inline)" % frame.f_lineno)


def reinstall():
    uninstall()
    check()
    install()
    check()


def off_call(fn, *args):
    uninstall()
    check()
    try:
        return fn(*args)
    finally:
        install()
        check()


def _fuzz_run():
    if not GC_AUTO:
        gc.disable()
    monstack.install(**OPTS)
    error = None
    try:
        main()
    except BaseException:
        error = traceback.format_exc(limit=-8)
    finally:
        monstack.uninstall()
    gc.collect()
    fmt = lambda recs: " > ".join("%s:%d" % (name, line) for _f, line, name in recs)
    first = None
    if BAD:
        where, got, real = BAD[0]
        first = "at %s\n  shadow: %s\n  real:   %s" % (where, fmt(got), fmt(real))
    return {{"seed": SEED, "bad": len(BAD), "known": len(KNOWN), "error": error, "first": first,
            "known_gaps": sorted({{k[0] for k in KNOWN}}), "checks": _checks[0]}}
'''

FOOTER = r'''

if __name__ == "__main__":
    result = _fuzz_run()
    print(sys.version.split()[0], monstack.__name__, OPTS)
    print(json.dumps(result, indent=1))
    sys.exit(1 if result["bad"] or result["error"] else 0)
'''

LIBRARY = r'''"""Library code (in a filtered directory): calls back, drives and relays generators,
takes its own snapshots."""
import sys, types

import monstack
from monstack._capture import current_policy

REPORT = REAL = GENERATION = None


def call(fn, *args):
    return fn(*args)


def catching(fn, n, exc):
    try:
        return fn(n)
    except exc:
        return None


def drain(gen):
    for _ in gen:
        pass


def relay(gen):
    r = yield from gen
    return r


async def relay_co(coro):
    return await coro


def lib_check(where="library"):
    frame = sys._getframe()
    desc = current_policy().describe(), GENERATION[0]
    snap, real = monstack.snapshot(), REAL(frame, current_policy())  # one line
    return REPORT(snap, real, desc, where, True)


def lib_mid(inner, cb):
    r = yield from inner
    cb()
    yield r
    return r


def lib_mid_snap(inner):
    r = yield from inner
    frame = sys._getframe()  # the level's own snapshot, as a framework's would be
    desc = current_policy().describe(), GENERATION[0]
    snap, real = monstack.snapshot(), REAL(frame, current_policy())  # one line
    REPORT(snap, real, desc, "lib_mid_snap", True)
    yield r
    return r


def lib_catch(cb, exc):
    try:
        yield 1
    except exc:
        cb()
        yield "caught"
    return "lib"


async def lib_mid_co(inner, cb):
    r = await inner
    cb()
    await suspend(r)
    return r


@types.coroutine
def suspend(value=None):
    return (yield value)


class Delegate:
    """A delegate whose throw() is a Python method (library version)."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        return self

    def __next__(self):
        return self.inner.send(None)

    def send(self, value):
        return self.inner.send(value)

    def throw(self, *args):
        return self.inner.throw(*args)

    def close(self):
        return self.inner.close()


class Awaitable:
    def __init__(self, inner):
        self.inner = inner

    def __await__(self):
        return Delegate(self.inner)
'''

# ======================================================================================
# mixed (and finalizer): functions, generators, coroutines calling each other
# ======================================================================================

MIXED_PRELUDE = r'''
class ProgErr(Exception):
    pass

class E0(ProgErr):
    pass

class E1(ProgErr):
    pass

class E2(ProgErr):
    pass

EXC = (E0, E1, E2, ProgErr)
_fuel = threading.local()


def burn():
    left = getattr(_fuel, "left", 300)
    _fuel.left = left - 1
    return left <= 0


def _prog_only(exc):
    if isinstance(exc, ProgErr):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(_prog_only(e) for e in exc.exceptions)
    return False


def in_threads(fn, n, count):
    errors = []
    def target():
        _fuel.left = 150
        try:
            check()
            fn(n)
        except ProgErr:
            check()
        except BaseException as exc:
            errors.append(exc)
    threads = [threading.Thread(target=target) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@types.coroutine
def suspend():
    check()
    yield
    check()


def drive(coro, throw_at, exc):
    step = 0
    try:
        while True:
            if step == throw_at:
                coro.throw(exc())
            else:
                coro.send(None)
            step += 1
            check()
    except StopIteration:
        check()
    except ProgErr:
        check()
    finally:
        coro.close()


def run_asyncio(make, n, count, mode):
    if asyncio._get_running_loop() is not None:  # under a running loop: drive by hand
        for _ in range(count):
            drive(make(n), -1, E0)
        return
    async def main():
        check()
        if mode == "gather":
            results = await asyncio.gather(*(make(n) for _ in range(count)), return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException) and not _prog_only(r):
                    raise r
        elif mode == "task":
            tasks = [asyncio.ensure_future(make(n)) for _ in range(count)]
            check()
            for t in tasks:
                try:
                    await t
                except ProgErr:
                    check()
        elif mode == "cancel":
            t = asyncio.ensure_future(make(n))
            for _ in range(count):
                await asyncio.sleep(0)
                check()
            t.cancel()
            try:
                await t
            except (asyncio.CancelledError, ProgErr):
                check()
        else:  # taskgroup
            try:
                async with asyncio.TaskGroup() as tg:
                    for _ in range(count):
                        tg.create_task(make(n))
                    check()
            except BaseException as exc:
                if not _prog_only(exc):
                    raise
                check()
        check()
    asyncio.run(main())


def genops(gen, ops):
    try:
        for op in ops:
            try:
                if op == "next":
                    next(gen)
                elif op == "send":
                    gen.send(1)
                elif op == "close":
                    gen.close()
                else:
                    gen.throw(EXC[int(op[-1])]())
            except (StopIteration, ProgErr):
                check()
            except TypeError:  # send() to a just-started generator
                check()
    finally:
        gen.close()


class CM:
    def __init__(self, k):
        self.k = k

    def __enter__(self):
        check()
        return self

    def __exit__(self, typ, value, tb):
        check()
        return typ is not None and issubclass(typ, EXC[self.k])


@contextlib.contextmanager
def cmgen(k):
    check()
    try:
        yield
    except EXC[k]:
        check()
    finally:
        check()


class ACM:
    async def __aenter__(self):
        check()
        await suspend()
        return self

    async def __aexit__(self, typ, value, tb):
        check()
        return False


def via_c(fn, n, how):
    if how == 0:
        return list(map(fn, [n, n]))
    if how == 1:
        return sorted([2, 1], key=lambda k: (fn(n), k)[1])
    if how == 2:
        return functools.reduce(lambda a, b: (fn(n), a)[1], [1, 2], 0)
    if how == 3:
        return list(filter(lambda k: fn(n) or True, [1]))
    return min([1, 2], key=lambda k: (fn(n), k)[1])


def deep(d, fn, n):
    if d:
        return deep(d - 1, fn, n)
    check()
    return fn(n)


class Del:
    """A finalizer that snapshots and calls tracked code."""

    def __init__(self, cyclic):
        if cyclic:
            self.me = self

    def __del__(self):
        check()
        _del_work()
        check()


def _del_work():
    check()


def abandon(gen, k, cyclic):
    for _ in range(k):
        try:
            next(gen)
        except (StopIteration, ProgErr):
            return
    if cyclic:
        box = [gen]
        box.append(box)


def collect():
    check()
    gc.collect()
    check()
'''

MAX_NEST = 2
N_EXC = 3


def gen_mixed(rnd: random.Random, finalizers: bool):
    count = rnd.randint(3, 7)
    kinds = tuple(["f"] + [rnd.choice("fffggc") for _ in range(count - 1)])
    bodies = tuple(_block(rnd, i, kinds, 0, finalizers) for i in range(count))
    return {"kind": "finalizer" if finalizers else "mixed", "kinds": kinds, "bodies": bodies,
            "rounds": [rnd.randint(0, 3) for _ in range(rnd.randint(1, 3))]}


def _block(rnd, i, kinds, level, fin, lo=None):
    n = rnd.randint(lo if lo is not None else (1 if level else 2), 3 if level else 5)
    return [_stmt(rnd, i, kinds, level, fin) for _ in range(n)]


def _stmt(rnd, i, kinds, level, fin):
    kind = kinds[i]
    later = range(i + 1, len(kinds))
    fs = [j for j in later if kinds[j] == "f"]
    gs = [j for j in later if kinds[j] == "g"]
    cs = [j for j in later if kinds[j] == "c"]
    options = ["check", "icheck", "raise", "recurse", "recurse", "comprehension", "lambda", "libcheck"]
    if fs:
        options += ["call", "call", "call", "thread", "viac", "viac", "lib", "lib", "deep"]
        options += ["reinstall", "offcall"] if rnd.random() < 0.5 else []
    if gs:
        options += ["iter", "iter", "genops", "genops", "libdrain"]
    if cs:
        options += ["drive", "drive", "asyncio", "asyncio"]
    if level < MAX_NEST:
        options += ["try", "try", "with", "with"]
    if kind == "g":
        options += ["yield", "yield"] + (["yield_from", "yield_from", "librelay"] if gs else [])
    if kind == "c":
        options += ["suspend", "suspend"] + (["await", "await", "librelayco"] if cs else [])
        if level < MAX_NEST:
            options += ["asyncwith"]
    if fin:
        options += ["del", "del", "collect", "collect"] + (["abandon", "abandon"] if gs else [])
    op = rnd.choice(options)
    if op in ("check", "icheck", "comprehension", "lambda", "recurse", "yield", "suspend", "libcheck",
              "reinstall", "collect"):
        return (op,)
    if op == "raise":
        return ("raise", rnd.randrange(N_EXC), rnd.choice([True, True, False]))
    if op in ("call", "offcall"):
        return (op, rnd.choice(fs))
    if op == "deep":
        return ("deep", rnd.choice(fs), rnd.randint(5, 60))
    if op == "viac":
        return ("viac", rnd.choice(fs), rnd.randrange(5))
    if op == "lib":
        return ("lib", rnd.choice(fs), rnd.choice(["call", "catching"]))
    if op == "thread":
        return ("thread", rnd.choice(fs), rnd.randint(1, 3))
    if op == "iter":
        return ("iter", rnd.choice(gs), _block(rnd, i, kinds, MAX_NEST, fin))
    if op == "libdrain":
        return ("libdrain", rnd.choice(gs))
    if op == "genops":
        ops = [rnd.choice(["next", "next", "send", "throw0", "throw1", "throw2", "close"])
               for _ in range(rnd.randint(1, 5))]
        return ("genops", rnd.choice(gs), ops)
    if op == "drive":
        return ("drive", rnd.choice(cs), rnd.randint(-1, 3), rnd.randrange(N_EXC))
    if op == "asyncio":
        return ("asyncio", rnd.choice(cs), rnd.randint(1, 2), rnd.choice(["gather", "task", "cancel", "taskgroup"]))
    if op == "try":
        body = _block(rnd, i, kinds, level + 1, fin)
        exc = rnd.randint(0, N_EXC)  # N_EXC: the base class
        handler = _block(rnd, i, kinds, level + 1, fin) if rnd.random() < 0.5 else [("check",)]
        final = [("check",)] * rnd.randint(1, 2) if rnd.random() < 0.5 else None
        return ("try", body, exc, handler, final)
    if op == "with":
        return ("with", rnd.choice(["cls", "gen"]), rnd.randrange(N_EXC), _block(rnd, i, kinds, level + 1, fin))
    if op == "asyncwith":
        return ("asyncwith", _block(rnd, i, kinds, level + 1, fin))
    if op == "yield_from":
        return ("yield_from", rnd.choice(gs))
    if op == "librelay":
        return ("librelay", rnd.choice(gs))
    if op == "await":
        return ("await", rnd.choice(cs))
    if op == "librelayco":
        return ("librelayco", rnd.choice(cs))
    if op == "del":
        return ("del", rnd.choice([True, False]))
    if op == "abandon":
        return ("abandon", rnd.choice(gs), rnd.randint(0, 2), rnd.choice([True, False]))
    raise AssertionError(op)


def render_mixed(prog) -> str:
    kinds, bodies = prog["kinds"], prog["bodies"]
    out = [MIXED_PRELUDE]
    for i, (kind, body) in enumerate(zip(kinds, bodies)):
        name = f"{kind}{i}"
        out.append(f"async def {name}(n):" if kind == "c" else f"def {name}(n):")
        out.append("    if burn():")
        out.append("        return")
        if kind == "g":
            out += ["    if False:", "        yield"]
        if kind == "c":
            out += ["    if False:", "        await suspend()"]
        for stmt in body:
            out.extend(_render_stmt(stmt, i, kinds, 1))
        out.append("")
    out.append("def main():")
    out.append("    _fuel.left = 300")
    for k in prog["rounds"]:
        out += ["    try:", f"        f0({k})", "    except ProgErr:", "        check()"]
    if prog["kind"] == "finalizer":
        out.append("    collect()")
    out.append("    check()")
    return "\n".join(out) + "\n"


def _block_lines(block, i, kinds, indent):
    lines = []
    for s in block:
        lines.extend(_render_stmt(s, i, kinds, indent))
    return lines or ["    " * indent + "pass"]


def _render_stmt(stmt, i, kinds, indent) -> list:
    pad = "    " * indent
    op = stmt[0]
    me = f"{kinds[i]}{i}"
    nm = lambda j: f"{kinds[j]}{j}"  # noqa: E731
    if op == "check":
        return [pad + "check()"]
    if op == "libcheck":
        return [pad + "fuzzlib.lib_check()"]
    if op == "icheck":
        return [pad + "cmp_here(_generation[0], monstack.snapshot(), sys._getframe())"]
    if op == "comprehension":
        return [pad + "[check() for _ in range(2)]"]
    if op == "lambda":
        return [pad + "(lambda: check())()"]
    if op == "reinstall":
        return [pad + "reinstall()"]
    if op == "collect":
        return [pad + "collect()"]
    if op == "raise":
        _, k, cond = stmt
        if cond:
            return [pad + "if n % 2 == 0:", pad + f"    raise E{k}()"]
        return [pad + f"raise E{k}()"]
    if op == "recurse":
        call = {"f": f"{me}(n - 1)", "g": f"yield from {me}(n - 1)", "c": f"await {me}(n - 1)"}[kinds[i]]
        return [pad + "if n > 0:", pad + "    " + call]
    if op == "call":
        return [pad + f"{nm(stmt[1])}(n)"]
    if op == "offcall":
        return [pad + f"off_call({nm(stmt[1])}, n)"]
    if op == "deep":
        return [pad + f"deep({stmt[2]}, {nm(stmt[1])}, n)"]
    if op == "viac":
        return [pad + f"via_c({nm(stmt[1])}, n, {stmt[2]})"]
    if op == "lib":
        if stmt[2] == "call":
            return [pad + f"fuzzlib.call({nm(stmt[1])}, n)"]
        return [pad + f"fuzzlib.catching({nm(stmt[1])}, n, ProgErr)"]
    if op == "thread":
        return [pad + f"in_threads({nm(stmt[1])}, n, {stmt[2]})"]
    if op == "iter":
        return [pad + f"for _x in {nm(stmt[1])}(n):"] + _block_lines(stmt[2], i, kinds, indent + 1)
    if op == "libdrain":
        return [pad + f"fuzzlib.drain({nm(stmt[1])}(n))"]
    if op == "genops":
        return [pad + f"genops({nm(stmt[1])}(n), {list(stmt[2])!r})"]
    if op == "drive":
        return [pad + f"drive({nm(stmt[1])}(n), {stmt[2]}, E{stmt[3]})"]
    if op == "asyncio":
        return [pad + f"run_asyncio({nm(stmt[1])}, n, {stmt[2]}, {stmt[3]!r})"]
    if op == "yield":
        return [pad + "_got = yield n", pad + "check()"]
    if op == "yield_from":
        return [pad + f"yield from {nm(stmt[1])}(n)"]
    if op == "librelay":
        return [pad + f"yield from fuzzlib.relay({nm(stmt[1])}(n))"]
    if op == "suspend":
        return [pad + "await suspend()"]
    if op == "await":
        return [pad + f"await {nm(stmt[1])}(n)"]
    if op == "librelayco":
        return [pad + f"await fuzzlib.relay_co({nm(stmt[1])}(n))"]
    if op == "try":
        _, body, exc, handler, final = stmt
        lines = [pad + "try:"] + _block_lines(body, i, kinds, indent + 1)
        lines.append(pad + f"except {'ProgErr' if exc == N_EXC else f'E{exc}'}:")
        lines += _block_lines(handler, i, kinds, indent + 1)
        if final:
            lines += [pad + "finally:"] + _block_lines(final, i, kinds, indent + 1)
        return lines
    if op == "with":
        _, how, k, body = stmt
        head = f"with CM({k}):" if how == "cls" else f"with cmgen({k}):"
        return [pad + head] + _block_lines(body, i, kinds, indent + 1)
    if op == "asyncwith":
        return [pad + "async with ACM():"] + _block_lines(stmt[1], i, kinds, indent + 1)
    if op == "del":
        return [pad + f"Del({stmt[1]})"]
    if op == "abandon":
        return [pad + f"abandon({nm(stmt[1])}(n), {stmt[2]}, {stmt[3]})"]
    raise AssertionError(op)


# ======================================================================================
# throw: gen.throw()/close() into chains of one recursive generator (or coroutine)
# ======================================================================================

THROW_PRELUDE = r'''
class E(Exception):
    pass

class E2(Exception):
    pass

CAUGHT = (E, E2, StopIteration, RuntimeError, ValueError, GeneratorExit)


def leaf():
    check()


def cb():
    check()
    leaf()


@types.coroutine
def suspend(value=None):
    return (yield value)


class Delegate:
    """A delegate whose throw() is a Python method (tracked version)."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        return self

    def __next__(self):
        return self.inner.send(None)

    def send(self, value):
        return self.inner.send(value)

    def throw(self, *args):
        check()
        return self.inner.throw(*args)

    def close(self):
        return self.inner.close()


class Awaitable:
    def __init__(self, inner):
        self.inner = inner

    def __await__(self):
        return Delegate(self.inner)


def _throw(target, how):
    _T.throwing = getattr(_T, "throwing", 0) + 1
    try:
        if how == "close":
            target.close()
            return "closed"
        if how == "throw2":
            return target.throw(E2())
        return target.throw(E())
    finally:
        _T.throwing -= 1


def throw_from(target, how):
    check()
    try:
        got = _throw(target, how)
    except CAUGHT as exc:
        got = type(exc).__name__
    check()
    return got


def g(lv, cat, i, target=None, outer=0, how="throw"):
    """One recursive generator: level i of the chain lv (catcher cat), or a thrower."""
    if outer:
        check()
        return (yield from g(lv, cat, i, target, outer - 1, how))
    if target is not None:  # the thrower runs the same code
        check()
        _T.throwing = getattr(_T, "throwing", 0) + 1
        try:
            got = target.close() if how == "close" else target.throw(E2() if how == "throw2" else E())
        except CAUGHT as exc:
            got = type(exc).__name__
        finally:
            _T.throwing -= 1
        check()
        yield got
        check()
        return got
    if i == len(lv):  # the innermost level: the catcher, same code
        if cat == "libcatch":
            return (yield from fuzzlib.lib_catch(cb, E))
        if cat == "none":
            yield 1
            yield 2
            return "none"
        try:
            yield 1
            yield 2
        except E:
            check()
            if cat == "ret":
                return "caught"
            if cat == "yield":
                yield "caught"
                check()
                return "after"
            if cat == "raise":
                raise E2()
            if cat == "cb":
                cb()
                return "cb"
            if cat == "reinst":
                reinstall()
                return "reinst"
            if cat == "nested":
                other = g([("g", "check"), ("lib", "yield")], "ret", 0)
                next(other)
                got = throw_from(other, "throw")
                check()
                other.close()
                return got
        return "end"
    kind, after = lv[i]
    if kind == "g":
        r = yield from g(lv, cat, i + 1)
    elif kind == "gtry":
        try:
            r = yield from g(lv, cat, i + 1)
        except E2:
            check()
            r = "e2"
    elif kind == "lib":
        r = yield from fuzzlib.lib_mid(g(lv, cat, i + 1), cb)
    elif kind == "libsnap":
        r = yield from fuzzlib.lib_mid_snap(g(lv, cat, i + 1))
    elif kind == "deleg":
        r = yield from Delegate(g(lv, cat, i + 1))
    else:  # libdeleg
        r = yield from fuzzlib.Delegate(g(lv, cat, i + 1))
    if after == "check":
        check()
    elif after == "yield":
        check()
        yield r
        check()
    elif after == "call":
        cb()
        yield r
    return r


async def co(lv, cat, i, target=None, outer=0, how="throw"):
    """The coroutine form of g."""
    if outer:
        check()
        return await co(lv, cat, i, target, outer - 1, how)
    if target is not None:  # the thrower runs the same code
        check()
        _T.throwing = getattr(_T, "throwing", 0) + 1
        try:
            got = target.close() if how == "close" else target.throw(E2() if how == "throw2" else E())
        except CAUGHT as exc:
            got = type(exc).__name__
        finally:
            _T.throwing -= 1
        check()
        await suspend(got)
        check()
        return got
    if i == len(lv):  # the innermost level: the catcher, same code
        try:
            await suspend(1)
            await suspend(2)
        except E:
            check()
            if cat in ("ret", "libcatch", "nested"):
                return "caught"
            if cat == "yield":
                await suspend("caught")
                check()
                return "after"
            if cat == "raise":
                raise E2()
            if cat == "cb":
                cb()
                return "cb"
            if cat == "reinst":
                reinstall()
                return "reinst"
            raise
        return "end"
    kind, after = lv[i]
    if kind in ("g", "gtry"):
        try:
            r = await co(lv, cat, i + 1)
        except E2:
            if kind == "g":
                raise
            check()
            r = "e2"
    elif kind in ("lib", "libsnap"):
        r = await fuzzlib.lib_mid_co(co(lv, cat, i + 1), cb)
    elif kind == "deleg":
        r = await Awaitable(co(lv, cat, i + 1))
    else:
        r = await fuzzlib.Awaitable(co(lv, cat, i + 1))
    if after == "check":
        check()
    elif after in ("yield", "call"):
        if after == "call":
            cb()
        check()
        await suspend(r)
        check()
    return r


def _finish(chain, after):
    try:
        if after == "drain":
            for _x in chain:
                check()
        elif after == "throw":
            _throw(chain, "throw")
    except CAUGHT:
        check()
    chain.close()
    check()


def scenario(lv, cat, thrower, outer, how, after, pre):
    if pre:
        uninstall()
    chain = g(lv, cat, 0)
    try:
        next(chain)
    finally:
        if pre:
            install()
    check()
    if thrower == "gen":
        t = g(lv, cat, 0, chain, outer, how)
        try:
            next(t)
        except CAUGHT:
            pass
        check()
        t.close()
    elif thrower == "func":
        throw_from(chain, how)
    elif thrower == "lib":
        fuzzlib.call(throw_from, chain, how)
    else:  # thread
        th = threading.Thread(target=throw_from, args=(chain, how))
        th.start()
        th.join()
    check()
    _finish(chain, after)


def co_scenario(lv, cat, thrower, outer, how, after, pre):
    chain = co(lv, cat, 0)
    try:
        chain.send(None)
    except CAUGHT:
        return
    check()
    if thrower == "gen":
        t = co(lv, cat, 0, chain, outer, how)
        try:
            t.send(None)
        except CAUGHT:
            pass
        check()
        t.close()
    elif thrower == "thread":
        th = threading.Thread(target=throw_from, args=(chain, how))
        th.start()
        th.join()
    else:
        throw_from(chain, how)
    check()
    try:
        if after == "drain":
            while True:
                chain.send(None)
                check()
        elif after == "throw":
            _throw(chain, "throw")
    except CAUGHT:
        check()
    chain.close()
    check()
'''

LEVELS = ["g", "g", "g", "gtry", "lib", "libsnap", "deleg", "libdeleg"]
AFTERS = ["ret", "check", "yield", "yield", "call"]
CATCHERS = ["ret", "ret", "yield", "yield", "raise", "cb", "nested", "libcatch", "none", "reinst"]


def gen_throw(rnd: random.Random):
    scenarios = []
    for _ in range(rnd.randint(3, 10)):
        coro = rnd.random() < 0.25
        lv = [(rnd.choice(LEVELS), rnd.choice(AFTERS)) for _ in range(rnd.randint(1, 5))]
        scenarios.append((
            "co_scenario" if coro else "scenario", lv, rnd.choice(CATCHERS),
            rnd.choice(["gen", "gen", "gen", "func", "lib", "thread"]), rnd.choice([0, 0, 1, 2]),
            rnd.choice(["throw", "throw", "throw", "throw2", "close"]),
            rnd.choice(["drain", "drain", "close", "throw"]), rnd.random() < 0.15,
        ))
    return {"kind": "throw", "scenarios": scenarios}


def render_throw(prog) -> str:
    out = [THROW_PRELUDE, "def main():"]
    for fn, lv, cat, thrower, outer, how, after, pre in prog["scenarios"]:
        out.append(f"    {fn}({[tuple(x) for x in lv]!r}, {cat!r}, {thrower!r}, {outer}, {how!r}, {after!r}, {pre})")
    out.append("    check()")
    return "\n".join(out) + "\n"


# ======================================================================================
# Programs: generation, rendering, minimization candidates
# ======================================================================================


def generate(seed: int, kinds) -> dict:
    rnd = random.Random(seed)
    kind = kinds[seed % len(kinds)] if len(kinds) > 1 else kinds[0]
    if kind == "throw":
        return gen_throw(rnd)
    return gen_mixed(rnd, kind == "finalizer")


def render(prog, seed: int, cfg: dict) -> str:
    head = HARNESS.format(seed=seed, kind=prog["kind"], opts=cfg["opts"], gc_auto=cfg["gc_auto"],
                          inject=cfg["inject"])
    body = render_throw(prog) if prog["kind"] == "throw" else render_mixed(prog)
    doc = (f'"""monstack fuzz program: seed {seed}, kind {prog["kind"]} (tools/fuzz_stack.py).\n'
           f'Run from the repository root: PYTHONPATH=. python THIS_FILE"""\n')
    return doc + head + body + FOOTER


def _lists(obj, path=()):
    """Every list inside the program (each element is removable), with its path."""
    if isinstance(obj, list):
        yield path, obj
    if isinstance(obj, (list, tuple)):
        for k, x in enumerate(obj):
            yield from _lists(x, path + (k,))
    elif isinstance(obj, dict):
        for key in sorted(obj):
            yield from _lists(obj[key], path + (key,))


def _get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def candidates(prog):
    """Smaller variants: one list element removed (outermost lists first)."""
    spots = [(path, k) for path, lst in _lists(prog) for k in range(len(lst))]
    spots.sort(key=lambda s: len(s[0]))
    for path, k in spots:
        if prog["kind"] != "throw" and path[:1] == ("rounds",) and len(prog["rounds"]) == 1:
            continue
        c = copy.deepcopy(prog)
        del _get(c, path)[k]
        yield c


# ======================================================================================
# Running
# ======================================================================================

RUNNER = r'''
import json, runpy, sys
for path in sys.argv[1:]:
    ns = runpy.run_path(path, run_name="fuzzprog")
    print("RESULT " + json.dumps(ns["_fuzz_run"]()), flush=True)
'''


class Runner:
    def __init__(self, args, workdir):
        self.args = args
        self.workdir = workdir
        self.python = args.python or sys.executable
        opts = {"backend": args.backend, "track": args.track}
        if args.accelerator is not None:
            opts["accelerator"] = bool(args.accelerator)
        self.cfg = {"opts": opts, "gc_auto": args.gc == "auto", "inject": args.inject_bug}
        self.env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.env["PYTHONPATH"] = root + os.pathsep + self.env.get("PYTHONPATH", "")
        if args.accelerator is not None:
            self.env["MONSTACK_ACCELERATOR"] = str(args.accelerator)
        self.env.pop("MONSTACK", None)
        self.kinds = args.kinds
        self._n = 0
        _write_lib(workdir)

    def write(self, prog, seed, directory=None) -> str:
        directory = directory or self.workdir
        self._n += 1
        path = os.path.join(directory, f"prog_{seed}_{self._n}.py")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(render(prog, seed, self.cfg))
        return path

    def run_batch(self, items):
        """items: [(seed, prog)]. Returns {seed: outcome}; outcome is a dict with "fail":
        None or a category ("mismatch", "error", "crash", "timeout") and details."""
        paths = [self.write(prog, seed) for seed, prog in items]
        try:
            proc = subprocess.run([self.python, "-c", RUNNER, *paths], capture_output=True, text=True,
                                  env=self.env, timeout=self.args.timeout * len(items))
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            stderr, rc = "timeout", "timeout"
        finally:
            if not self.args.keep_programs:
                for p in paths:
                    os.unlink(p)
        results = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]
        out = {}
        for (seed, _prog), res in zip(items, results):
            fail = "mismatch" if res["bad"] else "error" if res["error"] else None
            out[seed] = dict(res, fail=fail)
        if len(results) < len(items):  # the child died in the next program
            seed = items[len(results)][0]
            cat = "timeout" if rc == "timeout" else "crash"
            tail = "\n".join(stderr.strip().splitlines()[-15:])
            out[seed] = {"seed": seed, "fail": cat, "rc": rc, "error": tail, "bad": 0, "known": 0,
                         "known_gaps": [], "first": None, "checks": 0}
            for seed, _prog in items[len(results) + 1:]:
                out[seed] = None  # not run: the caller reruns these
        return out

    def fails(self, prog, seed, category) -> bool:
        res = self.run_batch([(seed, prog)])[seed]
        return res is not None and res["fail"] == category


def _write_lib(directory):
    libdir = os.path.join(directory, "lib")
    os.makedirs(libdir, exist_ok=True)
    with open(os.path.join(libdir, "fuzzlib.py"), "w", encoding="utf-8") as fh:
        fh.write(LIBRARY)


def minimize(runner, prog, seed, category, budget_s, budget_runs):
    """Greedy: drop list elements while the program still fails the same way."""
    start, runs = time.monotonic(), 0
    progress = True
    while progress:
        progress = False
        for cand in candidates(prog):
            if time.monotonic() - start > budget_s or runs >= budget_runs:
                return prog, runs
            runs += 1
            if runner.fails(cand, seed, category):
                prog, progress = cand, True
                break
    return prog, runs


def keep_reproducer(runner, keep, prog, seed, res):
    d = os.path.join(keep, f"seed{seed}")
    os.makedirs(d, exist_ok=True)
    _write_lib(d)
    path = os.path.join(d, "repro.py")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(render(prog, seed, runner.cfg))
    with open(os.path.join(d, "outcome.txt"), "w", encoding="utf-8") as fh:
        fh.write(json.dumps(res, indent=1) + "\n")
    return path


def describe_config(runner, args) -> str:
    """What the child interpreter installs with this configuration (version, backend, callbacks)."""
    extra = "" if args.accelerator is None else f", accelerator={bool(args.accelerator)}"
    code = (f"import sys, monstack; b = monstack.install(backend={args.backend!r}, track={args.track!r}{extra}); "
            "print(sys.version.split()[0], b, monstack.status().get('accelerator', '-'))")
    out = subprocess.run([runner.python, "-c", code], capture_output=True, text=True, env=runner.env)
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[-1] if lines else "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    ap.add_argument("--count", type=int, default=100, help="programs to run (seeds SEED..SEED+COUNT-1)")
    ap.add_argument("--kinds", default=",".join(DEFAULT_KINDS),
                    help="comma-separated program kinds: mixed, throw, finalizer (default mixed,throw)")
    ap.add_argument("--backend", default=None, help="install(backend=...): auto (default), monitoring, evalframe, walk")
    ap.add_argument("--track", default="user", choices=["user", "all"])
    ap.add_argument("--accelerator", type=int, choices=[0, 1], default=None,
                    help="0: pure-Python sys.monitoring callbacks, 1: require the native ones "
                         "(default: monstack's default, MONSTACK_ACCELERATOR is honoured)")
    ap.add_argument("--gc", choices=["off", "auto"], default="off",
                    help="automatic garbage collection in the programs (default off: collections only "
                         "where programs ask; 'auto': collections wherever allocations trigger them)")
    ap.add_argument("--keep", default=None, help="directory for reproducers (default: a new temp dir)")
    ap.add_argument("--python", default=None, help="interpreter for the programs (default: this one)")
    ap.add_argument("--batch", type=int, default=10, help="programs per child process (default 10)")
    ap.add_argument("--jobs", type=int, default=1, help="child processes at once (default 1)")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per program before a hang is reported")
    ap.add_argument("--max-time", type=float, default=None, help="stop starting new batches after this many seconds")
    ap.add_argument("--minimize-runs", type=int, default=150, help="at most this many runs to minimize one failure")
    ap.add_argument("--minimize-seconds", type=float, default=90.0)
    ap.add_argument("--inject-bug", action="store_true",
                    help="self-test: corrupt every fifth snapshot the programs check (must report mismatches)")
    ap.add_argument("--keep-programs", action="store_true", help="do not delete the generated programs")
    ap.add_argument("--print-program", type=int, metavar="SEED", default=None,
                    help="print the program of SEED (for --kinds and the configuration) and exit")
    args = ap.parse_args(argv)
    args.kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    bad_kinds = [k for k in args.kinds if k not in KINDS]
    if bad_kinds or not args.kinds:
        ap.error(f"unknown kinds {bad_kinds}; choose from {', '.join(KINDS)}")

    workdir = tempfile.mkdtemp(prefix="fuzz_stack_")
    try:
        runner = Runner(args, workdir)
        if args.print_program is not None:
            print(render(generate(args.print_program, args.kinds), args.print_program, runner.cfg))
            return 0
        python = runner.python
        config = describe_config(runner, args)
        print(f"fuzz_stack: {python} ({config}), kinds {','.join(args.kinds)}, seeds "
              f"{args.seed}..{args.seed + args.count - 1}, gc {args.gc}"
              + (", INJECTED BUG" if args.inject_bug else ""), flush=True)
        seeds = list(range(args.seed, args.seed + args.count))
        batches = [seeds[k:k + max(1, args.batch)] for k in range(0, len(seeds), max(1, args.batch))]
        t0 = time.monotonic()
        results: dict = {}

        def run(batch):
            if args.max_time is not None and time.monotonic() - t0 > args.max_time:
                return {}
            pending = [(s, generate(s, args.kinds)) for s in batch]
            out = {}
            while pending:
                got = runner.run_batch(pending)
                out.update({s: r for s, r in got.items() if r is not None})
                pending = [(s, p) for s, p in pending if got.get(s) is None]
            return out

        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for got in pool.map(run, batches):
                results.update(got)
        elapsed = time.monotonic() - t0
        failures = [r for s, r in sorted(results.items()) if r["fail"]]
        known = [r for s, r in sorted(results.items()) if r["known"] and not r["fail"]]
        checks = sum(r.get("checks", 0) for r in results.values())
        print(f"ran {len(results)} programs ({checks} checks) in {elapsed:.0f}s: "
              f"{len(failures)} failed, {len(known)} with known gaps only", flush=True)
        for r in known[:10]:
            print(f"  known: seed {r['seed']}: {r['known']} snapshot(s), {', '.join(r['known_gaps'])}")
        if not failures:
            return 0
        keep = args.keep or tempfile.mkdtemp(prefix="fuzz_stack_keep_")
        os.makedirs(keep, exist_ok=True)
        for r in failures[:10]:
            seed = r["seed"]
            prog = generate(seed, args.kinds)
            runs = 0
            if r["fail"] in ("mismatch", "error", "crash") and runner.fails(prog, seed, r["fail"]):
                prog, runs = minimize(runner, prog, seed, r["fail"], args.minimize_seconds, args.minimize_runs)
                final = runner.run_batch([(seed, prog)])[seed] or r
                note = f"minimized in {runs} runs"
            else:
                final = r
                note = "did not fail again when run alone: not minimized"
            path = keep_reproducer(runner, keep, prog, seed, final)
            print(f"FAIL seed {seed} ({r['fail']}, {note}): {path}")
            detail = r.get("first") or r.get("error") or ""
            print("  " + "\n  ".join(detail.strip().splitlines()[-12:]))
        if len(failures) > 10:
            print(f"... and {len(failures) - 10} more failing seeds (not minimized, no reproducer)")
        seeds = [r["seed"] for r in failures]
        print(f"reproducers in {keep}; {len(seeds)} failing seeds: {seeds[:40]}{' ...' if len(seeds) > 40 else ''}")
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
