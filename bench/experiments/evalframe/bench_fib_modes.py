"""fib tracking tax on 3.11: off / pass-through shim / filtered / track=all native / Python hook shim.

Method: fib(N) >= 15 ms, best of 2 after a warm-up, modes interleaved (order rotates),
median of per-round ratios to 'off'.

Usage (from the repository root, CPython 3.11, x86-64):
    # build the bench-only Python-hook variant of the shim (calls a Python push and pop per frame)
    mkdir -p /tmp/hook/out && cp native/build.py native/shim311.h native/offsets.c /tmp/hook/
    cp bench/experiments/evalframe/hookshim311.c /tmp/hook/shim311.c
    python3.11 /tmp/hook/build.py --arch x86_64 --out /tmp/hook/out
    HOOK_DIR=/tmp/hook/out PYTHONPATH=. python3.11 bench/experiments/evalframe/bench_fib_modes.py 26 9
"""
import os, sys, time, json, statistics, importlib.util, tempfile, ctypes
import monstack
from monstack import _evalframe, _stack, _env
from monstack._policy import Policy
src = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
d = tempfile.mkdtemp(); path = os.path.join(d, "fibmod.py"); open(path, "w").write(src)
spec = importlib.util.spec_from_file_location("fibmod", path); mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
fib = mod.fib
N = int(sys.argv[1]); ROUNDS = int(sys.argv[2])
HOOK_DIR = os.environ.get("HOOK_DIR", "/tmp/hook/out")

# the Python-hook variant (bench only)
hook_meta = json.load(open(HOOK_DIR + "/evalframe311.json"))["arches"][_env.MACHINE]
hblob = _evalframe.NativeBlob(open(HOOK_DIR + "/evalframe311-x86_64.bin", "rb").read(),
                              hook_meta["data_offset"], hook_meta["data_size"], hook_meta["data_align"])
hblob.fill_table(hook_meta["table"]); hblob.make_executable()
HOOK_ENTRY = hblob.base + hook_meta["entry"]
hook_keep = []

def hook_install():
    _stack.reset_tls(); tls = _stack.TLS
    pol = Policy("all"); pol.is_tracked(fib.__code__)
    tracked = pol.tracked_set()
    def push(code):
        if code.co_filename in tracked:
            try:
                cell = tls.cell
            except AttributeError:
                cell = tls.cell = [None]
            cell[0] = (code, cell[0], -1)
    def pop(code):
        if code.co_filename in tracked:
            cell = tls.cell
            top = cell[0]
            if top is not None and top[0] is code:
                cell[0] = top[1]
    hook_keep[:] = [push, pop]
    f = hook_meta["fields"]
    hblob.put_ptr(f["decide"], id(push)); hblob.put_ptr(f["tls"], id(pop)); hblob.put_i64(f["enabled"], 1)
    nat = _evalframe._load()
    _evalframe._set_eval(nat, HOOK_ENTRY)

def hook_uninstall():
    nat = _evalframe._load()
    if _evalframe._current_eval(nat) == HOOK_ENTRY:
        _evalframe._set_eval(nat, nat.default)
    hblob.put_i64(hook_meta["fields"]["enabled"], 0)

def run():
    best = 1e9
    for _ in range(2):
        t = time.perf_counter(); fib(N); best = min(best, time.perf_counter() - t)
    return best

def mode(name):
    monstack.uninstall(); hook_uninstall()
    if name == "off": return
    if name == "track='all' (native push/pop)": monstack.install(track="all")
    elif name == "filtered (excluded file)": monstack.install(track="all", exclude=[d + "/"])
    elif name == "pass-through shim (floor)":
        monstack.install(track="all")
        nat = _evalframe._native; nat.blob.put_i64(nat.arch["fields"]["enabled"], 0)
    elif name == "Python hook per frame": hook_install()
    fib(12)

modes = ["off", "pass-through shim (floor)", "filtered (excluded file)", "track='all' (native push/pop)", "Python hook per frame"]
ratios = {m: [] for m in modes}; times = {m: [] for m in modes}
for rnd in range(ROUNDS):
    order = modes[rnd % len(modes):] + modes[:rnd % len(modes)]
    r = {}
    for m in order:
        mode(m); run(); r[m] = run(); times[m].append(r[m])
    for m in modes: ratios[m].append(r[m] / r["off"])
monstack.uninstall(); hook_uninstall()
print(f"CPython {sys.version.split()[0]}, fib({N}): off median {statistics.median(times['off'])*1e3:.1f} ms, {ROUNDS} rounds")
for m in modes:
    print(f"  {m:32s} {statistics.median(ratios[m]):5.2f}x  (min {min(ratios[m]):.2f}, max {max(ratios[m]):.2f})")
