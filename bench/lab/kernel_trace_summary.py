#!/usr/bin/env python3
"""Summarizes a kernel trace of bench/lab/kernel_trace.cc: where an iteration's time goes, kernel by kernel.

The trace is cut into iterations at each kernel whose name contains --anchor (rdep's expert MLP starts every
forward with ForwardSetupKernel). Consecutive iterations with the same kernels (names, grids, blocks) form a run
(rdep bench gemm times a path's forward-only iterations, then its forward+backward ones, at each mu); each run's
first --skip iterations are left out as warm-up. For each run it prints, per position, the median duration and the
median gap before the kernel (its start minus the latest end among the kernels that started before it: negative
where they overlapped, as under programmatic dependent launch or on another stream), and the medians over
iterations of the span (first start to last end), the kernels' sum and the idle time (the span less the time some
kernel ran). Kernel names are shortened; the legend at the end gives each short name's full name.

    python3 bench/lab/kernel_trace_summary.py /tmp/trace.tsv [--anchor ForwardSetupKernel] [--skip 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import OrderedDict


def read_trace(path: str) -> list[dict]:
    rows, names = [], {}
    with open(path) as f:
        header = f.readline().rstrip("\n").split("\t")
        want = ["start_ns", "end_ns", "stream", "grid", "block", "name_id"]
        if header != want:
            raise SystemExit(f"{path}: expected the header {want}, got {header}")
        for n, line in enumerate(f, start=2):
            parts = line.rstrip("\n").split("\t")
            if parts[0] == "#name" and len(parts) == 3:
                names[parts[1]] = parts[2]
                continue
            if len(parts) != 6:
                raise SystemExit(f"{path}:{n}: expected 6 tab-separated fields, got {len(parts)}")
            rows.append(dict(start=int(parts[0]), end=int(parts[1]), stream=int(parts[2]), grid=parts[3],
                             block=parts[4], name=parts[5]))
    for r in rows:
        if r["name"] not in names:
            raise SystemExit(f"{path}: kernel name id {r['name']} has no #name line")
        r["name"] = names[r["name"]]
    rows.sort(key=lambda r: r["start"])
    return rows


def short_name(full: str) -> str:
    """The function's name without namespaces or template arguments: 'ForwardSetupKernel'. A name the tracer could
    not demangle (CUTLASS's kernels) gives what can be read from it: 'cutlass coop MMA_64x256 mc' (schedule, the
    warpgroup's MMA shape, mc where TMA loads multicast over a cluster)."""
    if full.startswith("_Z"):
        if "device_kernel" not in full:
            m = re.search(r"\d+([A-Za-z_]+Kernel)", full)
            return m.group(1) if m else full[:40]
        sched = "ping" if "Pingpong" in full else "coop" if "Cooperative" in full else "gemm"
        mma = re.search(r"MMA_(\d+x\d+)x\d+", full)
        return " ".join(x for x in ("cutlass", sched, mma.group(1) if mma else "", "mc" if "MULTICAST" in full else "") if x)
    depth, base = 0, []
    for c in full:
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif depth == 0:
            base.append(c)
    s = "".join(base).replace("(anonymous namespace)::", "")
    s = re.sub(r"^void\s+", "", s)
    s = s.split("(")[0].strip()
    return s.split("::")[-1] or full[:40]


class Names:
    """Short, unique names: the base name, with #k where different full names share it."""

    def __init__(self):
        self.by_full: OrderedDict[str, str] = OrderedDict()
        self.count: dict[str, int] = {}

    def __call__(self, full: str) -> str:
        if full not in self.by_full:
            base = short_name(full)
            k = self.count.get(base, 0)
            self.count[base] = k + 1
            self.by_full[full] = base if k == 0 else f"{base}#{k}"
        return self.by_full[full]


def split_iterations(rows: list[dict], anchor: str) -> list[list[dict]]:
    """The kernels (in start order) from each kernel whose name holds `anchor` up to the next one; kernels before the
    first anchor are left out."""
    its, cur = [], None
    for r in rows:
        if anchor in r["name"]:
            if cur:
                its.append(cur)
            cur = [r]
        elif cur is not None:
            cur.append(r)
    if cur:
        its.append(cur)
    return its


def iteration_times(it: list[dict]) -> tuple[list[float], list[float], float, float, float]:
    """Per kernel its duration and the gap before it (its start minus the latest end among the kernels that started
    before it: negative where it overlapped them, on one stream or several; none for the first); the span (first
    start to last end), the kernels' sum and the idle time (the span less the time some kernel ran), all in us."""
    durs, gaps, busy_until, idle = [], [], None, 0.0
    for r in it:
        durs.append((r["end"] - r["start"]) / 1e3)
        if busy_until is not None:
            gap = (r["start"] - busy_until) / 1e3
            gaps.append(gap)
            idle += max(gap, 0.0)
        busy_until = r["end"] if busy_until is None else max(busy_until, r["end"])
    span = (max(r["end"] for r in it) - min(r["start"] for r in it)) / 1e3
    return durs, gaps, span, sum(durs), idle


def summarize(its: list[list[dict]], names: Names, skip: int) -> list[dict]:
    """Runs of consecutive iterations with the same kernels (names, grids and blocks); each run's first `skip`
    iterations are left out (all are kept, and warmup_kept is set, where a run has no more than that). Per position the
    median duration and gap; the run's span, kernel sum and idle time are medians of the per-iteration values."""
    runs: list[tuple[tuple, list]] = []
    for it in its:
        sig = tuple((names(r["name"]), r["grid"], r["block"]) for r in it)
        if runs and runs[-1][0] == sig:
            runs[-1][1].append(it)
        else:
            runs.append((sig, [it]))
    out = []
    for sig, members in runs:
        kept = len(members) <= skip
        use = members if kept else members[skip:]
        times = [iteration_times(m) for m in use]
        per = []
        for i, (name, grid, block) in enumerate(sig):
            per.append(dict(name=name, grid=grid, block=block, us=statistics.median(t[0][i] for t in times),
                            gap_us=statistics.median(t[1][i - 1] for t in times) if i > 0 else None))
        out.append(dict(kernels=per, iterations=len(use), warmup_kept=kept,
                        span_us=statistics.median(t[2] for t in times), kernel_sum_us=statistics.median(t[3] for t in times),
                        idle_us=statistics.median(t[4] for t in times)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--anchor", default="ForwardSetupKernel", help="a kernel name (substring) that starts each iteration")
    p.add_argument("--skip", type=int, default=20,
                   help="iterations of each run left out (warm-up; rdep bench gemm's default --warmup is 20)")
    p.add_argument("--min-iterations", type=int, default=3, help="runs with fewer iterations are not printed")
    p.add_argument("--json", help="also write the summary here")
    a = p.parse_args(argv)
    if a.skip < 0 or a.min_iterations < 1:
        p.error("--skip must be >= 0 and --min-iterations >= 1")
    rows = read_trace(a.trace)
    its = split_iterations(rows, a.anchor)
    if not its:
        print(f"{a.trace}: no kernel named like {a.anchor!r} among {len(rows)} kernels", file=sys.stderr)
        return 1
    names = Names()
    runs = summarize(its, names, a.skip)
    groups = [g for g in runs if g["iterations"] >= a.min_iterations]
    short = sum(g["iterations"] for g in runs if g["iterations"] < a.min_iterations)
    if short:
        print(f"{a.trace}: {short} iterations in runs of fewer than {a.min_iterations} left out (a run's last iteration "
              "also holds the kernels launched after it, which makes it a run of its own)", file=sys.stderr)
    for g in groups:
        note = " (no more iterations than --skip: warm-up kept)" if g["warmup_kept"] else ""
        print(f"\n{len(g['kernels'])} kernels an iteration, {g['iterations']} iterations{note}: span {g['span_us']:.1f} us, "
              f"kernels {g['kernel_sum_us']:.1f} us, idle {g['idle_us']:.1f} us (medians over iterations)")
        print(f"{'#':>3} {'kernel':<34} {'grid':>12} {'us':>9} {'gap_us':>8}")
        for i, k in enumerate(g["kernels"]):
            gap = "" if k["gap_us"] is None else f"{k['gap_us']:.1f}"
            print(f"{i:>3} {k['name'][:34]:<34} {k['grid']:>12} {k['us']:>9.1f} {gap:>8}")
    print("\nnames:")
    for full, short_name_ in names.by_full.items():
        print(f"  {short_name_}: {full[:400]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(groups=groups, names={v: k for k, v in names.by_full.items()}), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
