#!/usr/bin/env python3
"""Where a GPU waits for its host: the idle gaps between the device's work in a torch.profiler Chrome trace,
each charged to the host operation that launched the work that ended it.

The device's busy time is the union of its kernels, copies and memsets; a gap is the time between two busy
stretches (inside the traced window). The work after a gap was launched by a CUDA runtime call (matched by
its correlation id); the CPU ops open on that call's thread at that moment name who the GPU waited for: the
outermost (a compiled graph, the optimizer step, an rdep op) and the innermost. A gap whose next launch was
issued before the gap began is a device-side dependency (an event wait), charged to "(launched before the
gap)". Gaps shorter than --min-us are counted in the total only.

    python3 scripts/trace_gaps.py TRACE.json [--min-us 5] [--top 20] [--device N] [--json out.json]
(TRACE from examples/torch_training/train.py --profile-steps N --profile-trace PREFIX, or any torch.profiler
export_chrome_trace with CPU and CUDA activities.)
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}


def load_events(path: str) -> list:
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def busy_intervals(gpu: list) -> list:
    """The union of the GPU events' [start, end) as sorted, disjoint (start, end, first event) triples."""
    out = []
    for e in sorted(gpu, key=lambda e: e["ts"]):
        s, t = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        if out and s <= out[-1][1]:
            if t > out[-1][1]:
                out[-1] = (out[-1][0], t, out[-1][2])
        else:
            out.append((s, t, e))
    return out


def open_ops(events: list, queries: list) -> list:
    """For each ((pid, tid), t) in queries, the names of the CPU ops (cat cpu_op or user_annotation) open on that
    thread at time t, outermost first. Ops nest on a thread, so one sweep in time order with a stack answers all."""
    ops = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            ops[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), -(float(e["ts"]) + float(e.get("dur", 0))), e["name"]))
    by_tid = collections.defaultdict(list)
    for qi, (tid, t) in enumerate(queries):
        by_tid[tid].append((t, qi))
    out = [[] for _ in queries]
    for tid, qs in by_tid.items():
        todo = sorted(ops.get(tid, []))  # by start, the longer first when two start together
        qs.sort()
        stack, i = [], 0
        for t, qi in qs:
            while i < len(todo) and todo[i][0] <= t:
                start, neg_end, name = todo[i]
                while stack and stack[-1][0] < start:
                    stack.pop()
                stack.append((-neg_end, name))
                i += 1
            while stack and stack[-1][0] < t:
                stack.pop()
            out[qi] = [name for end, name in stack if end >= t]
    return out


def gpu_device(e: dict):
    return e.get("args", {}).get("device", e.get("pid"))


def analyse(events: list, min_us: float, device=None) -> dict:
    """The gaps of one GPU's work: `device` (the GPU events' args.device), or the only one in the trace."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    if not gpu:
        raise ValueError("the trace has no GPU events (profile with CUDA activities)")
    devices = sorted({gpu_device(e) for e in gpu}, key=str)
    if device is None and len(devices) > 1:
        raise ValueError(f"the trace has GPU events of devices {devices}: name one with --device")
    if device is not None:
        gpu = [e for e in gpu if str(gpu_device(e)) == str(device)]
        if not gpu:
            raise ValueError(f"no GPU events of device {device} (the trace has {devices})")
    launches = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
    busy = busy_intervals(gpu)
    window = busy[-1][1] - busy[0][0]
    busy_us = sum(t - s for s, t, _ in busy)
    gaps, queries = [], []
    small = 0.0
    for (_s0, t0, _), (s1, _t1, first) in zip(busy, busy[1:]):
        gap = s1 - t0
        if gap < min_us:
            small += gap
            continue
        launch = launches.get(first.get("args", {}).get("correlation"))
        g = {"start_us": t0, "gap_us": gap, "next": first.get("name", "")[:80]}
        if launch is None:
            g["outer"] = g["inner"] = "(no launch record)"
        elif float(launch["ts"]) + float(launch.get("dur", 0)) <= t0:
            g["outer"] = g["inner"] = "(launched before the gap)"
        else:
            g["query"], g["launch"] = len(queries), launch["name"]
            queries.append(((launch.get("pid"), launch.get("tid")), float(launch["ts"])))
        gaps.append(g)
    names = open_ops(events, queries)
    by_outer, by_inner, counts = collections.Counter(), collections.Counter(), collections.Counter()
    for g in gaps:
        if "query" in g:
            found = names[g.pop("query")]
            g["outer"] = found[0] if found else f"(no op: {g['launch']})"
            g["inner"] = found[-1] if found else g["outer"]
            del g["launch"]
        by_outer[g["outer"]] += g["gap_us"]
        by_inner[g["inner"]] += g["gap_us"]
        counts[g["outer"]] += 1
    return {"window_us": window, "busy_us": busy_us, "idle_us": window - busy_us, "small_gaps_us": small,
            "by_outer_us": dict(by_outer.most_common()), "by_inner_us": dict(by_inner.most_common()),
            "gaps_by_outer": dict(counts), "largest": sorted(gaps, key=lambda g: -g["gap_us"])[:20]}


def report(r: dict, top: int, title: str) -> None:
    print(f"{title}: window {r['window_us'] / 1e3:.3f} ms, GPU busy {r['busy_us'] / 1e3:.3f} ms, idle "
          f"{r['idle_us'] / 1e3:.3f} ms ({r['small_gaps_us'] / 1e3:.3f} ms of it in gaps under the threshold)")
    print("  idle charged to the outermost host op that launched the work after the gap (ms, gaps):")
    for name, us in list(r["by_outer_us"].items())[:top]:
        print(f"    {us / 1e3:8.3f}  {r['gaps_by_outer'][name]:5d}  {name[:110]}")
    print("  ... to the innermost op (ms):")
    for name, us in list(r["by_inner_us"].items())[:top]:
        print(f"    {us / 1e3:8.3f}  {name[:110]}")
    print("  largest gaps (us, before what, outermost op):")
    for g in r["largest"][:10]:
        print(f"    {g['gap_us']:9.1f}  {g['next'][:60]:60s}  {g['outer'][:60]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", nargs="+")
    p.add_argument("--min-us", type=float, default=5.0)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--device", default=None, help="the GPU whose gaps to charge (a trace of several GPUs needs it)")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    out = {}
    for path in a.trace:
        try:
            out[path] = analyse(load_events(path), a.min_us, a.device)
        except (OSError, ValueError, KeyError) as e:
            print(f"trace_gaps: {path}: {e}", file=sys.stderr)
            return 2
        report(out[path], a.top, path)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
