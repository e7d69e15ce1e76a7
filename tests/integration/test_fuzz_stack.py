"""tools/fuzz_stack.py, the random-program fuzzer: a smoke run in this interpreter's
default configuration, and proof that it can fail (a corrupted snapshot, a crashing
child), so the smoke run cannot pass vacuously. Long runs: docs/reliability.md."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "fuzz_stack.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))

import fuzz_stack  # noqa: E402


def run_tool(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_smoke_fixed_seeds_pass():
    """A handful of programs of both default kinds (even seeds mixed, odd seeds throw)."""
    out = run_tool("--seed", "0", "--count", "8", "--batch", "8")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ran 8 programs" in out.stdout
    assert " 0 failed" in out.stdout


def test_programs_are_reproducible_from_their_seed():
    for seed in (0, 1, 7):
        assert fuzz_stack.generate(seed, fuzz_stack.DEFAULT_KINDS) == fuzz_stack.generate(seed, fuzz_stack.DEFAULT_KINDS)
    assert fuzz_stack.generate(0, ("mixed",)) != fuzz_stack.generate(2, ("mixed",))


def test_an_injected_bug_is_reported_with_seed_and_reproducer(tmp_path):
    """--inject-bug corrupts every fifth snapshot the programs compare: the fuzzer must
    fail, name the seeds and leave a runnable reproducer that fails too."""
    keep = tmp_path / "keep"
    out = run_tool("--seed", "0", "--count", "2", "--inject-bug", "--minimize-runs", "0", "--keep", str(keep))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL seed 0 (mismatch" in out.stdout and "FAIL seed 1 (mismatch" in out.stdout
    repro = keep / "seed0" / "repro.py"
    assert repro.exists()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    again = subprocess.run([sys.executable, str(repro)], capture_output=True, text=True, env=env, timeout=60)
    assert again.returncode == 1, again.stdout + again.stderr
    assert '"bad": 0' not in again.stdout


def test_a_crashing_child_is_a_failure_with_its_seed(tmp_path, monkeypatch):
    """A child killed by a signal (as a segfault would) fails the run and names the seed
    whose program was running; the programs before it in the batch still count."""
    real_render = fuzz_stack.render

    def render(prog, seed, cfg):
        src = real_render(prog, seed, cfg)
        if seed == 2:
            src = src.replace("\ndef main():\n", "\ndef main():\n    os.kill(os.getpid(), 9)\n", 1)
        return src

    monkeypatch.setattr(fuzz_stack, "render", render)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = fuzz_stack.main(["--seed", "0", "--count", "4", "--batch", "4", "--kinds", "throw",
                              "--minimize-runs", "0", "--keep", str(tmp_path)])
    text = out.getvalue()
    assert rc == 1, text
    assert "ran 4 programs" in text and "1 failed" in text
    assert "FAIL seed 2 (crash" in text
    assert (tmp_path / "seed2" / "repro.py").exists()


@pytest.mark.parametrize("kind", ["mixed", "throw", "finalizer"])
def test_every_kind_renders_valid_python(kind):
    cfg = {"opts": {"backend": None, "track": "user"}, "gc_auto": False, "inject": False}
    for seed in range(8):
        prog = fuzz_stack.generate(seed, (kind,))
        compile(fuzz_stack.render(prog, seed, cfg), f"seed{seed}", "exec")
        for cand in list(fuzz_stack.candidates(prog))[:3]:  # minimization keeps it valid too
            compile(fuzz_stack.render(cand, seed, cfg), f"seed{seed}", "exec")


# --------------------------------------------------------------------------------------
# Cases the fuzzer found
# --------------------------------------------------------------------------------------

_REINSTALL_RECURSION = '''
import sys
import monstack
sys.path.insert(0, {tests!r})
from stackcheck import real_records


def h(n, out):
    monstack.uninstall()
    monstack.install()
    if n > 0:
        h(n - 1, out)
    snap, real = monstack.snapshot(), real_records(sys._getframe())  # one line
    out.append(([tuple(r[:3]) for r in snap.records()], real))


def g(n, out):
    monstack.uninstall()
    monstack.install()
    if n > 0:
        yield from g(n - 1, out)
    snap, real = monstack.snapshot(), real_records(sys._getframe())  # one line
    out.append(([tuple(r[:3]) for r in snap.records()], real))
    yield n


monstack.install()
print(monstack.active_backend())
out = []
for _ in range(3):
    if {kind!r} == "function":
        h(1, out)
    else:
        for _ in g(1, out):
            pass
bad = [pair for pair in out if pair[0] != pair[1]]
print("mismatches:", len(bad))
for got, real in bad[:1]:
    print("  got ", [(name, line) for _f, line, name in got])
    print("  real", [(name, line) for _f, line, name in real])
'''


@pytest.mark.parametrize("kind", ["function", "generator"])
def test_snapshot_after_a_callee_of_the_same_code_reinstalled(tmp_path, kind):
    """Found by tools/fuzz_stack.py (3.11, seeds 1792, 2000, 2968, 3330, 3748 of the first
    long run, through a library's own snapshot). h(1) reinstalls and calls h(0), which
    reinstalls too and returns; h(1)'s own snapshot (no tracked call in between) must not
    show h(0). On 3.11 it did: the shadow stack rebuilt after h(0)'s reinstall kept h(0)'s
    node when h(0), pushed under the earlier install, returned (its pop belonged to that
    install), and the snapshot's fast path answered from it because its code is h(1)'s.
    The shim now empties the top when a frame of an earlier install returns (or yields:
    the generator variant)."""
    script = tmp_path / "reinstall_recursion.py"
    script.write_text(_REINSTALL_RECURSION.format(tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), kind=kind))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "mismatches: 0" in out.stdout, out.stdout
