#!/usr/bin/env python3
"""Device kernels of a torch.profiler Chrome trace (examples/torch_training/train.py --profile-trace), summed
per step: where a training step's device time goes, with full kernel names (the profiler's table cuts them).

  python3 bench/trace_kernels.py TRACE.json [--steps N] [--top 60] [--sequence]

Steps: the training example names each profiled step a range ("train step N", torch.profiler.record_function); a
kernel belongs to the step whose range holds the host call that launched it (the trace's correlation ids), so a
graph replay's kernels count in the step that launched the replay. Kernels launched outside every range (before
the first, after the last) are counted apart. A trace without such ranges is split into --steps parts of equal
kernel count instead, which is approximate where steps launch different numbers of kernels (copies, sorts).
--sequence: also list one step's kernels in launch order with their start (µs from the step's first kernel), so a
block's kernels can be told apart (the second step, the first may hold the profiler's start-up).
"""
import argparse
import collections
import json
import re

STEP_RANGE = re.compile(r"^train step (\d+)$")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def load(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)["traceEvents"]


def kernels(events: list[dict]) -> list[dict]:
    ks = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ks.sort(key=lambda e: e["ts"])
    return ks


def steps_by_range(events: list[dict], ks: list[dict]) -> tuple[list[list[dict]], int] | None:
    """(each annotated step's kernels in order, kernels outside every step), or None without "train step N" ranges."""
    ranges = sorted((e["ts"], e["ts"] + e["dur"], int(m.group(1))) for e in events
                    if e.get("ph") == "X" and e.get("cat") == "user_annotation" and (m := STEP_RANGE.match(e.get("name", ""))))
    if not ranges:
        return None
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    per_step: list[list[dict]] = [[] for _ in ranges]
    outside = 0
    for k in ks:
        t = launched.get(k.get("args", {}).get("correlation"))
        i = next((i for i, (lo, hi, _) in enumerate(ranges) if t is not None and lo <= t <= hi), None)
        if i is None:
            outside += 1
        else:
            per_step[i].append(k)
    return per_step, outside


def steps_by_count(ks: list[dict], steps: int) -> list[list[dict]]:
    """The kernels split into `steps` parts of equal count (the last takes the remainder)."""
    n = len(ks) // steps
    return [ks[i * n:(i + 1) * n] if i < steps - 1 else ks[i * n:] for i in range(steps)]


def short(name: str, width: int) -> str:
    """The name on one line (whitespace runs collapsed), cut to `width` characters."""
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[:width - 3] + "..."


def table(per_step: list[list[dict]], top: int, width: int) -> str:
    steps = len(per_step)
    total = collections.Counter()
    count = collections.Counter()
    for k in (k for part in per_step for k in part):
        total[k["name"]] += k["dur"]
        count[k["name"]] += 1
    all_us = sum(total.values())
    lines = [f"device time: {all_us / 1e3:.3f} ms in {sum(count.values())} kernels/copies, {all_us / 1e3 / steps:.3f} ms "
             f"a step ({steps} steps)", f"{'us/step':>9} {'calls/step':>10} {'us/call':>8}  name"]
    for name, us in total.most_common(top):
        lines.append(f"{us / steps:9.1f} {count[name] / steps:10.1f} {us / count[name]:8.1f}  {short(name, width)}")
    rest = all_us - sum(us for _, us in total.most_common(top))
    lines.append(f"{rest / steps:9.1f} {'':>10} {'':>8}  (the rest)")
    return "\n".join(lines)


def sequence(part: list[dict], width: int) -> str:
    t0 = part[0]["ts"] if part else 0
    return "\n".join(f"{k['ts'] - t0:10.1f} {k['dur']:8.1f}  {short(k['name'], width)}" for k in part)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=1, help="steps in a trace without 'train step N' ranges")
    p.add_argument("--top", type=int, default=60)
    p.add_argument("--width", type=int, default=160)
    p.add_argument("--sequence", action="store_true")
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error("--steps: at least 1")
    events = load(a.trace)
    ks = kernels(events)
    if not ks:
        raise SystemExit(f"{a.trace}: no device kernels in the trace (was it recorded with the CUDA activity?)")
    ranged = steps_by_range(events, ks)
    if ranged is not None:
        per_step, outside = ranged
        how = f"steps split by their 'train step N' ranges; {outside} kernels/copies launched outside them, not counted"
    else:
        per_step = steps_by_count(ks, a.steps)
        how = "no 'train step N' ranges: the trace split by kernel count (approximate)"
    print(how)
    print(table(per_step, a.top, a.width))
    if a.sequence:
        part = per_step[1] if len(per_step) > 1 else per_step[0]
        print("\n--- one step's kernels in order (start us, duration us, name)")
        print(sequence(part, a.width))


if __name__ == "__main__":
    main()
