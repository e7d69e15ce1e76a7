"""The bench's table output (the JSON output is the results dict itself)."""

from __future__ import annotations

from typing import Any, Callable, Optional

#: The goals each section's figures are measured against (stated for CPython 3.12), printed
#: under the section's heading; the bench reports figures and leaves the verdicts to the reader.
GOALS = {
    "snapshot": "monstack's snapshot() <= 0.3 us at every depth; at depth 200 <= 1.3x its cost at depth 10",
    "tax": "call-heavy with track='all' <= 5x, and within 1.5x of empty callbacks; workload filtered <= 1.1x",
    "opqueue": "default policy <= 1.05x no capture",
    "memory": "< 120 bytes per snapshot taken in the same frame; no frames kept alive",
    "dump": "threads() for 50 threads: depth 200 <= 1.5x depth 10, and less than "
            "sys._current_frames() + traceback.extract_stack",
}


def _goal(section: str, w: Callable) -> None:
    w(f"  goal (CPython 3.12): {GOALS[section]}\n")


def _get(d: Any, *path: Any) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def main_snapshot_method(methods: dict) -> Optional[str]:
    for name in methods:
        if name.startswith("monstack ") and "walk" not in name and "pure-Python" not in name:
            return name
    return None


def _us(s: float) -> str:
    return f"{s * 1e6:.2f}" if s < 1e-4 else f"{s * 1e6:.0f}"


def _rx(s: dict) -> str:
    return f"{'INVALID ' if s.get('invalid') else ''}{s['median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}]"


def print_table(r: dict, file: Any) -> None:
    w = file.write
    w(f"monstack bench: CPython {r['python']} {r['machine']}, {r['cpus']} cpus, {r['config']} sizes, "
      f"{r['rounds']} rounds; median of per-round figures [min-max]. Figures are machine-dependent.\n")
    be = ", ".join(f"{k}: {'yes' if v is None else 'no'}" for k, v in r["backends"].items() if k != "error")
    w(f"backends: {be}; accelerator option: {'yes' if r['accelerator option'] else 'no'}; "
      f"propagation points: {', '.join(r['propagation points']) or 'none'}\n")
    if "snapshot" in r:
        _print_snapshot(r["snapshot"], w)
    if "tax" in r:
        _print_tax(r["tax"], w)
    if "opqueue" in r:
        _print_opqueue(r["opqueue"], w)
    if "memory" in r:
        _print_memory(r["memory"], w)
    if "dump" in r:
        _print_dump(r["dump"], w)
    if r.get("native skipped"):
        w(f"\nNATIVE CODE SKIPPED in this run: {r['native skipped']}\n")
    for text in r.get("warnings", []):
        w(f"\nWARNING during the bench: {text}\n")
    secs = ", ".join(f"{k} {v:.1f}s" for k, v in r.get("section seconds", {}).items())
    w(f"\nelapsed {r['elapsed seconds']:.1f} s ({secs}); peak RSS {r['peak rss bytes'] / 2**20:.0f} MiB\n")


def _error(section: dict, w: Callable) -> bool:
    if "error" in section:
        w(f"  section failed: {section['error']}\n")
        return True
    return False


def _print_snapshot(s: dict, w: Callable) -> None:
    w("\nSnapshot: cost per capture in us, median [min-max]; (median of per-round ratios to the first monstack row)\n")
    _goal("snapshot", w)
    if _error(s, w):
        return
    depths = s["depths"]
    main = main_snapshot_method(s["methods"]) or next(iter(s["methods"]))
    nw = max([30] + [len(n) + 1 for n in s["methods"]])
    w(f"  {'method':{nw}s}" + "".join(f"{'depth ' + str(d):>30s}" for d in depths) + "   frames\n")
    for name, per in s["methods"].items():
        cells = []
        for d in depths:
            v = per[str(d)]
            ratio = _get(s, "ratio to main", name, str(d), "median")
            if ratio is None:
                ratio = v["median"] / s["methods"][main][str(d)]["median"]
            cells.append(f"{_us(v['median'])} [{_us(v['min'])}-{_us(v['max'])}] ({ratio:.1f}x)")
        frames = "/".join(str(s["frames"][name].get(str(d))) for d in depths)
        w(f"  {name:{nw}s}" + "".join(f"{c:>30s}" for c in cells) + f"   {frames}\n")
    for key, v in s.get("main depth ratios", {}).items():
        w(f"  {main}, depth {key}: {_rx(v)} (per-round ratios)\n")
    for name, info in s.get("backend info", {}).items():
        w(f"  {name}: {info}\n")
    for name, why in s.get("skipped", {}).items():
        if name != "jax/torch":  # absent jax/torch are skipped silently
            w(f"  skipped {name}: {why}\n")


def _print_tax(t: dict, w: Callable) -> None:
    w("\nTracking tax: time with monstack / time without, median [min-max]\n")
    _goal("tax", w)
    if _error(t, w):
        return
    modes: list[str] = []
    for per in t["ratios"].values():
        for m in per:
            if m not in modes:
                modes.append(m)
    w(f"  {'workload':20s}{'untracked':>11s}" + "".join(f"{m:>26s}" for m in modes) + "\n")
    for wname, per in t["ratios"].items():
        cells = [(_rx(per[m]) if m in per else "-") for m in modes]
        w(f"  {wname:20s}{t['untracked seconds'][wname] * 1e3:>8.1f} ms" + "".join(f"{c:>26s}" for c in cells) + "\n")
    _print_invalid(t["ratios"], w)
    for wname, per in t.get("us per hop", {}).items():
        base = per.get("no monstack")
        added = ", ".join(f"{m} +{v['median']:.2f}" for m, v in per.items() if m != "no monstack")
        if base:
            w(f"  {wname}, us per hop: no monstack {base['median']:.2f}; added: {added}\n")
    if t.get("note"):
        w(f"  note: {t['note']}\n")
    sizes = ", ".join(f"{k} {v}" for k, v in t["sizes"].items())
    w(f"  sizes: {sizes}\n")
    for name, info in t.get("mode info", {}).items():
        w(f"  {name}: {info}\n")
    for name, why in t.get("skipped", {}).items():
        w(f"  skipped {name}: {why}\n")


def _print_opqueue(o: dict, w: Callable) -> None:
    w(f"\nOp-queue: user model {o.get('user depth')} frames deep -> framework dispatch "
      f"({o.get('helper calls per op')} helper calls) -> snapshot -> queue -> worker thread; "
      f"{o.get('ops per run')} ops per run\n")
    _goal("opqueue", w)
    if _error(o, w):
        return
    base = o["us per op"]["no capture"]
    w(f"  {'mode':30s}{'ratio to no capture':>26s}{'us per op':>12s}{'overhead us/op':>16s}  checks\n")
    w(f"  {'no capture':30s}{'1.00x':>26s}{base['median']:>12.2f}{'':>16s}\n")
    for name, ratio in o["ratios"].items():
        ck = o["checks"][name]
        depth = o["snapshot depth"].get(name)
        top = o["snapshot top"].get(name)
        extra = f"ran {ck['ran']}/{ck['issued']}, snapshots {ck['snapshots']}"
        if depth is not None:
            extra += f", last: {depth} frames, top {top}"
        w(f"  {name:30s}{_rx(ratio):>26s}{o['us per op'][name]['median']:>12.2f}"
          f"{o['overhead us per op'][name]['median']:>16.2f}  {extra}\n")
    _print_invalid({"op-queue": o["ratios"]}, w)
    w(f"  framework excluded by default policy: {o.get('framework excluded by default policy')}; "
      f"model tracked: {o.get('model tracked by default policy')}\n")
    for name, info in o.get("mode info", {}).items():
        w(f"  {name}: {info}\n")
    c = o.get("crossover", {})
    if "points" in c:
        w("  crossover (default policy / no capture as the op gets lighter):\n")
        for p in c["points"]:
            w(f"    {p['helper calls per op']:3d} helper calls, op {p['op us (no capture)']:6.2f} us: "
              f"{_rx(p['ratio'])}, overhead {p['overhead us per op']:.2f} us/op\n")
        w(f"    overhead per op {c['overhead us per op (main run)']:.2f} us -> the default policy costs more than 10% "
          f"for ops lighter than ~{c['crossover op us (overhead / 0.10)']:.1f} us"
          f" (lightest measured op within 1.10x: {_fmtnum(c['lightest measured op within 1.10x (us)'])})\n")
    elif c:
        w(f"  crossover skipped: {c.get('skipped')}\n")


def _print_invalid(per_workload: dict, w: Callable) -> None:
    for wname, per in per_workload.items():
        for mname, s in per.items():
            if s.get("invalid"):
                w(f"  INVALID {wname} / {mname}: {s['invalid']}\n")


def _fmtnum(v: Any) -> str:
    return "none of them" if v is None else f"{v:.2f} us"


def _print_memory(m: dict, w: Callable) -> None:
    w(f"\nMemory: snapshots held in a list at depth {m.get('depth')}\n")
    _goal("memory", w)
    if _error(m, w):
        return
    if m.get("sys.getsizeof(snapshot)"):
        w(f"  sys.getsizeof: snapshot {m['sys.getsizeof(snapshot)']} B, node {m.get('sys.getsizeof(node)')} B\n")
    for name, run in m["runs"].items():
        rss = run.get("rss bytes per snapshot")
        w(f"  {name:32s} {run['snapshots']:>9d} snapshots: {run['bytes per snapshot']:8.1f} B each (tracemalloc), "
          f"{'-' if rss is None else f'{rss:.1f}'} B (RSS), {run['frames per snapshot']} frames, "
          f"{run['seconds per snapshot'] * 1e6:.2f} us each\n")
    for name, lv in m["liveness"].items():
        w(f"  no frames kept alive ({name}): local dead without gc {lv['local dead without gc']}, "
          f"frames reachable from snapshots {lv['frame objects reachable from snapshots']}, "
          f"snapshot frames {lv['frames per snapshot']}, readable {lv['snapshot still readable']}\n")
    w(f"  peak RSS {m['peak rss bytes'] / 2**20:.0f} MiB\n")


def _print_dump(d: dict, w: Callable) -> None:
    w(f"\nDump: {d.get('threads')} parked threads; us per call, median [min-max] (backend {d.get('backend')})\n")
    _goal("dump", w)
    if _error(d, w):
        return
    depths = d["depths"]
    w(f"  {'threads of depth':50s}" + "".join(f"{x:>22}" for x in depths) + "\n")
    for name, by in d["threads()"].items():
        cells = "".join(f"{_us(by[str(x)]['median']):>10} [{_us(by[str(x)]['min'])}-{_us(by[str(x)]['max'])}]".rjust(22)
                        for x in depths)
        w(f"  {name:50s}{cells}\n")
    w(f"  threads(): depth {depths[-1]} / depth {depths[0]}: {_rx(d['threads() depth ratio'])}\n")
    for x, s in d["threads() / extract_stack"].items():
        w(f"  threads() / (sys._current_frames() + extract_stack) at depth {x}: {_rx(s)}\n")
    w(f"  whole report, {d.get('threads')} threads at depth {d.get('report depth')} "
      f"({d.get('report bytes')} bytes of text):\n")
    for name, by in d["report"].items():
        s = by["report"]
        w(f"    {name:50s} {_us(s['median']):>10} us [{_us(s['min'])}-{_us(s['max'])}]\n")
    for name, s in d.get("report ratios", {}).items():
        w(f"    {name} / faulthandler: {_rx(s)}\n")
    if d.get("py-spy"):
        w(f"    py-spy dump: {d['py-spy']}\n")
