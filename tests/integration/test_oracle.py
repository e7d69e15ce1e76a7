"""A randomized correctness oracle: generated programs, snapshot == real stack everywhere.

Hypothesis draws a *program* -- a handful of functions, each a plain function, a
generator or a coroutine, calling each other (a DAG plus bounded self-recursion) with
exceptions raised and caught at random depths, ``try/finally``, generators driven by
``for`` or by hand (``next``/``send``/``throw``/``close``), ``yield from``, coroutines
``await``-ing each other and driven by hand (``send``/``throw``/``close``) or by asyncio,
comprehensions, lambdas, and work run on threads (several at once). The program is
rendered as Python source, written to a real file under a temp dir (so the default
policy tracks it and tracebacks show it) and run. Every ``check()`` in it -- they are
sprinkled at random points -- asserts that ``monstack.snapshot()`` equals a
``sys._getframe`` walk of the real stack under the same policy (``tests/stackcheck.py``).

For tracking backends it also asserts that the shadow stack never had to be rebuilt from
the real frames (``_stack.STATS["resync"]``) unless the program throws into a suspended
generator/coroutine -- the one case where CPython links frames without events and the
backend is documented to resynchronise. Without that second assertion a backend that
dropped pops would be masked by ``capture``'s self-repair; ``test_oracle_catches_*`` below
show both assertions firing on a deliberately broken backend.

Runs against the ``walk`` backend and the installed (auto) backend, plus
``track="all"``. Deterministic (``derandomize=True``, no deadline). Example count per
test: ``MONSTACK_ORACLE_EXAMPLES`` (default 80; e.g. 5000 for a long run).
"""

from __future__ import annotations

import itertools
import os
import sys
import textwrap

import pytest
from conftest import expected_backend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stackcheck
import monstack
from monstack import _stack

EXAMPLES = int(os.environ.get("MONSTACK_ORACLE_EXAMPLES", "80"))
ORACLE_SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

MAX_FUNCS = 6
MAX_BLOCK = 3
MAX_NEST = 2
N_EXC = 3

# --------------------------------------------------------------------------------------
# Programs as data
#
# A program is (kinds, bodies, start_n): kinds[i] in "f" (function), "g" (generator),
# "c" (coroutine); kinds[0] == "f" is the entry point. bodies[i] is a block: a list of
# statements (tuples, see render_stmt). Function i only calls functions j > i, or itself
# with n - 1 while n > 0, so every program terminates; a per-thread fuel counter bounds
# the total work.
# --------------------------------------------------------------------------------------


def _block(draw, i: int, kinds: list, level: int, ctx: str) -> list:
    """ctx: "body" (anywhere), "finally" (only checks: yields in finally break close())."""
    if ctx == "finally":
        return [("check",)] * draw(st.integers(1, 2))
    n = draw(st.integers(1 if level else 2, MAX_BLOCK + (0 if level else 1)))
    return [_stmt(draw, i, kinds, level) for _ in range(n)]


def _stmt(draw, i: int, kinds: list, level: int) -> tuple:
    kind = kinds[i]
    later = range(i + 1, len(kinds))
    fs = [j for j in later if kinds[j] == "f"]
    gs = [j for j in later if kinds[j] == "g"]
    cs = [j for j in later if kinds[j] == "c"]
    options = ["check", "raise", "recurse", "recurse", "comprehension", "lambda"]
    if fs:
        options += ["call", "call", "call", "thread"]
    if gs:
        options += ["iter", "iter", "genops", "genops"]
    if cs:
        options += ["drive", "drive", "asyncio"]
    if level < MAX_NEST:
        options += ["try", "try"]
    if kind == "g":
        options += ["yield", "yield"] + (["yield_from", "yield_from"] if gs else [])
    if kind == "c":
        options += ["suspend", "suspend"] + (["await", "await"] if cs else [])
    op = draw(st.sampled_from(options))
    if op in ("check", "comprehension", "lambda", "recurse", "yield", "suspend"):
        return (op,)
    if op == "raise":
        return ("raise", draw(st.integers(0, N_EXC - 1)), draw(st.sampled_from([True, True, False])))
    if op == "call":
        return ("call", draw(st.sampled_from(fs)))
    if op == "thread":
        return ("thread", draw(st.sampled_from(fs)), draw(st.integers(1, 3)))
    if op == "iter":
        return ("iter", draw(st.sampled_from(gs)), _block(draw, i, kinds, MAX_NEST, "body"))
    if op == "genops":
        ops = draw(st.lists(st.sampled_from(["next", "send", "throw0", "throw1", "throw2", "close"]), min_size=1, max_size=5))
        return ("genops", draw(st.sampled_from(gs)), tuple(ops))
    if op == "drive":
        return ("drive", draw(st.sampled_from(cs)), draw(st.integers(-1, 3)), draw(st.integers(0, N_EXC - 1)))
    if op == "asyncio":
        return ("asyncio", draw(st.sampled_from(cs)), draw(st.integers(1, 2)))
    if op == "try":
        body = _block(draw, i, kinds, level + 1, "body")
        exc = draw(st.integers(0, N_EXC))  # N_EXC: catch the base class
        handler = _block(draw, i, kinds, level + 1, "body") if draw(st.booleans()) else [("check",)]
        final = _block(draw, i, kinds, level + 1, "finally") if draw(st.booleans()) else None
        return ("try", body, exc, handler, final)
    if op == "yield_from":
        return ("yield_from", draw(st.sampled_from(gs)))
    if op == "await":
        return ("await", draw(st.sampled_from(cs)))
    raise AssertionError(op)


@st.composite
def programs(draw):
    count = draw(st.integers(3, MAX_FUNCS))
    kinds = ["f"] + [draw(st.sampled_from("fgc")) for _ in range(count - 1)]
    bodies = [_block(draw, i, kinds, 0, "body") for i in range(count)]
    start_n = draw(st.integers(0, 3))
    return kinds, bodies, start_n


# --------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------

PRELUDE = '''
import asyncio, threading, types
from stackcheck import check

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
    left = getattr(_fuel, "left", 400)
    _fuel.left = left - 1
    return left <= 0

def in_threads(fn, n, count):
    errors = []
    def target():
        _fuel.left = 200
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

def run_asyncio(make, n, count):
    if asyncio._get_running_loop() is not None:  # called under a running loop: drive by hand
        for _ in range(count):
            drive(make(n), -1, E0)
        return
    async def main():
        check()
        results = await asyncio.gather(*(make(n) for _ in range(count)), return_exceptions=True)
        check()
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, ProgErr):
                raise r
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
'''


def render(program) -> str:
    kinds, bodies, start_n = program
    out = [PRELUDE]
    for i, (kind, body) in enumerate(zip(kinds, bodies)):
        name = _name(kinds, i)
        header = f"async def {name}(n):" if kind == "c" else f"def {name}(n):"
        out.append(header)
        out.append("    if burn():")
        out.append("        return")
        if kind == "g":
            out.append("    if False:")
            out.append("        yield")
        if kind == "c":
            out.append("    if False:")
            out.append("        await suspend()")
        for stmt in body:
            out.extend(_render_stmt(stmt, i, kinds, 1))
        out.append("")
    out.append("def main():")
    out.append("    _fuel.left = 400")
    out.append(f"    for k in range({start_n + 1}):")
    out.append("        try:")
    out.append("            f0(k)")
    out.append("        except ProgErr:")
    out.append("            check()")
    out.append("    check()")
    return "\n".join(out) + "\n"


def _name(kinds, j) -> str:
    return f"{kinds[j]}{j}"


def _render_stmt(stmt, i, kinds, indent) -> list:
    pad = "    " * indent
    op = stmt[0]
    me = _name(kinds, i)
    if op == "check":
        return [pad + "check()"]
    if op == "comprehension":
        return [pad + "[check() for _ in range(2)]"]
    if op == "lambda":
        return [pad + "(lambda: check())()"]
    if op == "raise":
        _, k, cond = stmt
        if cond:
            return [pad + "if n % 2 == 0:", pad + f"    raise E{k}()"]
        return [pad + f"raise E{k}()"]
    if op == "recurse":
        if kinds[i] == "f":
            call = f"{me}(n - 1)"
        elif kinds[i] == "g":
            call = f"yield from {me}(n - 1)"
        else:
            call = f"await {me}(n - 1)"
        return [pad + "if n > 0:", pad + "    " + call]
    if op == "call":
        return [pad + f"{_name(kinds, stmt[1])}(n)"]
    if op == "thread":
        return [pad + f"in_threads({_name(kinds, stmt[1])}, n, {stmt[2]})"]
    if op == "iter":
        lines = [pad + f"for _x in {_name(kinds, stmt[1])}(n):"]
        for s in stmt[2]:
            lines.extend(_render_stmt(s, i, kinds, indent + 1))
        return lines
    if op == "genops":
        return [pad + f"genops({_name(kinds, stmt[1])}(n), {list(stmt[2])!r})"]
    if op == "drive":
        return [pad + f"drive({_name(kinds, stmt[1])}(n), {stmt[2]}, E{stmt[3]})"]
    if op == "asyncio":
        return [pad + f"run_asyncio({_name(kinds, stmt[1])}, n, {stmt[2]})"]
    if op == "yield":
        return [pad + "_got = yield n", pad + "check()"]
    if op == "yield_from":
        return [pad + f"yield from {_name(kinds, stmt[1])}(n)"]
    if op == "suspend":
        return [pad + "await suspend()"]
    if op == "await":
        return [pad + f"await {_name(kinds, stmt[1])}(n)"]
    if op == "try":
        _, body, exc, handler, final = stmt
        lines = [pad + "try:"]
        for s in body:
            lines.extend(_render_stmt(s, i, kinds, indent + 1))
        lines.append(pad + f"except {'ProgErr' if exc == N_EXC else f'E{exc}'}:")
        for s in handler:
            lines.extend(_render_stmt(s, i, kinds, indent + 1))
        if final:
            lines.append(pad + "finally:")
            for s in final:
                lines.extend(_render_stmt(s, i, kinds, indent + 1))
        return lines
    raise AssertionError(op)


def may_resync(program) -> bool:
    """Does the program throw into (or close) a suspended generator or coroutine?

    That is the one place CPython re-links frames without sys.monitoring events
    (PY_THROW into a delegating generator/coroutine), where resynchronising is expected.
    """
    kinds, bodies, _ = program

    def walk(block):
        for s in block:
            op = s[0]
            if op == "genops" and any(o.startswith("throw") or o == "close" for o in s[2]):
                return True
            if op == "drive" and s[2] >= 0:
                return True
            if op == "iter" and walk(s[2]):
                return True
            if op == "try" and (walk(s[1]) or walk(s[3]) or (s[4] and walk(s[4]))):
                return True
        return False

    return any(walk(b) for b in bodies)


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------

_counter = itertools.count()


@pytest.fixture(scope="module")
def progdir(tmp_path_factory):
    return tmp_path_factory.mktemp("oracle_programs")


def run_program(program, progdir, *, strict_resync: bool) -> None:
    """Render, write, exec and run ``program``; raise on any mismatch."""
    source = render(program)
    path = progdir / f"prog_{next(_counter)}.py"
    path.write_text(source)
    ns: dict = {"__name__": path.stem}
    code = compile(source, str(path), "exec")
    before = _stack.STATS["resync"]
    try:
        exec(code, ns)
        ns["main"]()
    except stackcheck.Mismatch as exc:
        raise stackcheck.Mismatch(f"{exc}\n--- program ({path}) ---\n{_numbered(source)}") from None
    resyncs = _stack.STATS["resync"] - before
    if strict_resync and resyncs and not may_resync(program):
        raise AssertionError(
            f"the shadow stack was rebuilt {resyncs} time(s) for a program with no throw into a "
            f"suspended generator/coroutine\n--- program ({path}) ---\n{_numbered(source)}"
        )


def _numbered(source: str) -> str:
    return "\n".join(f"{n:4d} {line}" for n, line in enumerate(source.splitlines(), 1))


BACKENDS = [
    pytest.param(("walk", "user"), id="walk"),
    pytest.param((None, "user"), id="installed"),  # None: MONSTACK_BACKEND or auto
    pytest.param((None, "all"), id="installed-track-all"),
]


@pytest.mark.parametrize("config", BACKENDS)
def test_generated_programs_match_the_real_stack(config, progdir):
    backend, track = config

    @ORACLE_SETTINGS
    @given(programs())
    def run(program):
        monstack.uninstall()
        name = monstack.install(backend=backend, track=track)
        try:
            run_program(program, progdir, strict_resync=name != "walk")
        finally:
            monstack.uninstall()

    run()


def test_without_install_snapshot_matches_too(progdir):
    """``snapshot()`` without ``install()`` (the implicit walk) against the oracle."""

    @settings(ORACLE_SETTINGS, max_examples=max(10, EXAMPLES // 4))
    @given(programs())
    def run(program):
        monstack.uninstall()
        run_program(program, progdir, strict_resync=False)

    run()


# --------------------------------------------------------------------------------------
# The oracle can fail: a broken backend is caught (nothing is left broken afterwards).
# --------------------------------------------------------------------------------------

FIXED_PROGRAM = (
    ["f", "f", "g", "c"],
    [
        [("check",), ("call", 1), ("check",), ("iter", 2, [("check",)]), ("drive", 3, -1, 0)],
        [("check",), ("try", [("raise", 1, False)], 1, [("check",)], [("check",)]), ("check",)],
        [("yield",), ("check",), ("yield",)],
        [("suspend",), ("check",)],
    ],
    1,
)


def test_fixed_program_passes_on_a_healthy_backend(progdir):
    monstack.install()
    run_program(FIXED_PROGRAM, progdir, strict_resync=True)


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="breaks a sys.monitoring callback")
def test_oracle_catches_a_backend_that_skips_pops(progdir, monkeypatch):
    """Every third PY_RETURN is dropped: capture() repairs the snapshot, the resync check fires."""
    real_register = sys.monitoring.register_callback
    drops = itertools.count()

    def register(tool, event, callback):
        if event == sys.monitoring.events.PY_RETURN and callback is not None:
            good = callback

            def skipping(code, offset, value):
                if next(drops) % 3 == 2:
                    return None  # the pop never happens
                return good(code, offset, value)

            callback = skipping
        return real_register(tool, event, callback)

    monkeypatch.setattr(sys.monitoring, "register_callback", register)
    monstack.install(backend="monitoring")
    monkeypatch.undo()  # only install() saw the broken callback
    try:
        with pytest.raises(AssertionError, match="rebuilt .* time"):
            run_program(FIXED_PROGRAM, progdir, strict_resync=True)
    finally:
        monstack.uninstall()


@pytest.mark.skipif(expected_backend() == "walk", reason="needs a tracking backend")
def test_oracle_catches_a_snapshot_missing_a_frame(progdir, monkeypatch):
    """A capture that loses the caller of the snapshotting frame is caught by check()."""
    monstack.install()
    from monstack import _capture

    backend = _capture._state.backend
    real_capture = backend.capture

    def lossy(frame):
        node, lasti = real_capture(frame)
        if node is not None and node[1] is not None:
            node = (node[0], node[1][1], node[1][2])  # drop one caller
        return node, lasti

    monkeypatch.setattr(backend, "capture", lossy)
    monkeypatch.setattr(_capture, "_fast", None)  # force the capture path
    monkeypatch.setattr(_capture, "_native_snapshot", None)
    with pytest.raises(stackcheck.Mismatch):
        run_program(FIXED_PROGRAM, progdir, strict_resync=False)


def test_throw_into_recursive_delegating_generator(installed):
    """Found by the oracle (1500 examples): a throw into ``yield from`` chains of the *same*
    generator function. The frames are linked without events, a snapshot resyncs and puts
    them on the shadow stack, then the exception reaching each outer level is a PY_THROW
    for a frame that is already there; pushing it again leaves a duplicate that
    ``capture()`` cannot see (same code object above and below)."""

    def g(n):
        try:
            if n > 0:
                yield from g(n - 1)
            else:
                yield
        finally:
            stackcheck.check(f"finally of g({n})")

    def run(depth):
        gen = g(depth)
        next(gen)
        with pytest.raises(ValueError):
            gen.throw(ValueError)
        stackcheck.check("after the throw")

    for depth in (1, 2, 3, 5):
        run(depth)


def test_rendered_programs_are_valid_python():
    src = render(FIXED_PROGRAM)
    compile(src, "<fixed>", "exec")
    assert "yield" in src and "async def" in src and textwrap.dedent(src) == src
