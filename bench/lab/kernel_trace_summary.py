#!/usr/bin/env python3
"""Summarizes a kernel trace of bench/lab/kernel_trace.cc: where an iteration's time goes, kernel by kernel.

The trace is cut into iterations at each kernel whose name contains --anchor (rdep's expert MLP starts every
forward with ForwardSetupKernel). Consecutive iterations with the same sequence of kernels form a run (rdep bench
gemm times a path's forward-only iterations, then its forward+backward ones, at each mu); for each run it prints,
per position, the median
duration, the median gap before the kernel starts (its start minus the previous kernel's end; negative where
the two overlapped, as under programmatic dependent launch), and the iteration's median span (first start to
last end), the kernels' sum and the gaps' sum. Kernel names are shortened; the legend at the end gives each
short name's demangled name.

    python3 bench/lab/kernel_trace_summary.py /tmp/trace.tsv [--anchor ForwardSetupKernel] [--skip 5] [--json out.json]
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
    """Short, unique names: the base name, with #k where different demangled names share it."""

    def __init__(self):
        self.by_full: OrderedDict[str, str] = OrderedDict()
        self.count: dict[str, int] = {}

    def __call__(self, full: str, grid: str) -> str:
        key = full
        if key not in self.by_full:
            base = short_name(full)
            k = self.count.get(base, 0)
            self.count[base] = k + 1
            self.by_full[key] = base if k == 0 else f"{base}#{k}"
        return self.by_full[key]


def split_iterations(rows: list[dict], anchor: str) -> list[list[dict]]:
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


def summarize(its: list[list[dict]], names: Names, skip: int) -> list[dict]:
    runs: list[tuple[tuple, list]] = []  # consecutive iterations with the same kernels: one run (a path at one mu)
    for it in its:
        sig = tuple(names(r["name"], r["grid"]) for r in it)
        if runs and runs[-1][0] == sig:
            runs[-1][1].append(it)
        else:
            runs.append((sig, [it]))
    out = []
    for sig, members in runs:
        use = members[skip:] if len(members) > skip else members
        per = []
        for i, name in enumerate(sig):
            durs = [(m[i]["end"] - m[i]["start"]) / 1e3 for m in use]
            gaps = [(m[i]["start"] - m[i - 1]["end"]) / 1e3 for m in use] if i > 0 else []
            per.append(dict(name=name, grid=use[0][i]["grid"], us=statistics.median(durs),
                            gap_us=statistics.median(gaps) if gaps else None))
        spans = [(m[-1]["end"] - m[0]["start"]) / 1e3 for m in use]
        busy = [sum(r["end"] - r["start"] for r in m) / 1e3 for m in use]
        out.append(dict(kernels=per, iterations=len(use), span_us=statistics.median(spans),
                        kernel_sum_us=statistics.median(busy), gap_sum_us=sum(p["gap_us"] or 0 for p in per)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--anchor", default="ForwardSetupKernel", help="a kernel name (substring) that starts each iteration")
    p.add_argument("--skip", type=int, default=5, help="iterations of each run left out (warm-up)")
    p.add_argument("--min-iterations", type=int, default=3, help="runs with fewer iterations are not printed")
    p.add_argument("--json", help="also write the summary here")
    a = p.parse_args(argv)
    rows = read_trace(a.trace)
    its = split_iterations(rows, a.anchor)
    if not its:
        print(f"{a.trace}: no kernel named like {a.anchor!r} among {len(rows)} kernels", file=sys.stderr)
        return 1
    names = Names()
    groups = [g for g in summarize(its, names, a.skip) if g["iterations"] >= a.min_iterations]
    for g in groups:
        print(f"\n{len(g['kernels'])} kernels an iteration, {g['iterations']} iterations: span {g['span_us']:.1f} us, "
              f"kernels {g['kernel_sum_us']:.1f} us, gaps {g['gap_sum_us']:.1f} us (medians)")
        print(f"{'#':>3} {'kernel':<34} {'grid':>12} {'us':>9} {'gap_us':>8}")
        for i, k in enumerate(g["kernels"]):
            gap = "" if k["gap_us"] is None else f"{k['gap_us']:.1f}"
            print(f"{i:>3} {k['name'][:34]:<34} {k['grid']:>12} {k['us']:>9.1f} {gap:>8}")
    print("\nnames:")
    for full, short in names.by_full.items():
        print(f"  {short}: {full[:400]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(groups=groups, names={v: k for k, v in names.by_full.items()}), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
