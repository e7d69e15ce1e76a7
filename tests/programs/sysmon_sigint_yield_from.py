"""CPython, not monstack: a SIGINT pending when ``send()`` enters a ``yield from`` chain is
raised in the outermost generator, not the innermost one, as soon as *any* sys.monitoring
tool listens to PY_RESUME -- even one whose callback only returns DISABLE.

This is CPython's test_generators.SignalAndYieldFromTest.test_raise_and_yield_from
(bpo-30039) with a do-nothing tool; no monstack involved. Needs ``_testcapi``.

    python3.14 tests/programs/sysmon_sigint_yield_from.py          # no tool:   PASSED
    python3.14 tests/programs/sysmon_sigint_yield_from.py --tool   # with tool: KeyboardInterrupt in the outer generator

Exit status 0 when the KeyboardInterrupt reached the innermost generator (PASSED).
"""

import sys

import _testcapi


def generator1():
    return (yield from generator2())


def generator2():
    try:
        yield
    except KeyboardInterrupt:
        return "PASSED"
    else:
        return "FAILED"


def main() -> int:
    if "--tool" in sys.argv:
        mon = sys.monitoring
        tool = mon.PROFILER_ID
        mon.use_tool_id(tool, "dummy")
        mon.register_callback(tool, mon.events.PY_RESUME, lambda code, offset: mon.DISABLE)
        mon.set_events(tool, mon.events.PY_RESUME)
    gen = generator1()
    gen.send(None)
    try:
        _testcapi.raise_SIGINT_then_send_None(gen)
    except BaseException as exc:
        result = exc
    if type(result) is StopIteration and result.value == "PASSED":
        print("PASSED: the KeyboardInterrupt was raised in the innermost generator")
        return 0
    print(f"FAILED: send() raised {type(result).__name__}{result.args!r} instead of StopIteration('PASSED')")
    return 1


if __name__ == "__main__":
    sys.exit(main())
