#!/usr/bin/env python3
"""Device kernels of a torch.profiler Chrome trace (examples/torch_training/train.py --profile-trace), summed
per step: where a training step's device time goes, with full kernel names (the profiler's table cuts them).

  python3 bench/trace_kernels.py TRACE.json [--steps N] [--top 60] [--sequence]

--steps: how many training steps the trace covers (the per-step column divides by it).
--sequence: also list one step's kernels in launch order with their start (µs from the first kernel), so a
block's kernels can be told apart. A step is taken as the trace's kernels split into --steps parts of equal count (no
step marker is read), so where steps launch different numbers of kernels (copies, sorts) the listed span can start
or end a few kernels into a neighbouring step.
"""
import argparse
import collections
import json
import re


def kernels(path: str) -> list[dict]:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    ks = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ks.sort(key=lambda e: e["ts"])
    return ks


def short(name: str, width: int) -> str:
    """The name on one line (whitespace runs collapsed), cut to `width` characters."""
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[:width - 3] + "..."


def table(ks: list[dict], steps: int, top: int, width: int) -> str:
    total = collections.Counter()
    count = collections.Counter()
    for k in ks:
        total[k["name"]] += k["dur"]
        count[k["name"]] += 1
    all_us = sum(total.values())
    lines = [f"device time: {all_us / 1e3:.3f} ms in {len(ks)} kernels/copies, {all_us / 1e3 / steps:.3f} ms a step "
             f"({steps} steps)", f"{'us/step':>9} {'calls/step':>10} {'us/call':>8}  name"]
    for name, us in total.most_common(top):
        lines.append(f"{us / steps:9.1f} {count[name] / steps:10.1f} {us / count[name]:8.1f}  {short(name, width)}")
    rest = all_us - sum(us for _, us in total.most_common(top))
    lines.append(f"{rest / steps:9.1f} {'':>10} {'':>8}  (the rest)")
    return "\n".join(lines)


def sequence(ks: list[dict], steps: int, width: int) -> str:
    """One step's kernels in order: the trace's kernels split into `steps` parts of equal count, the second part
    (the first may hold the profiler's start-up); approximate where steps launch different numbers of kernels."""
    n = len(ks) // steps
    part = ks[n:2 * n] if steps > 1 else ks
    t0 = part[0]["ts"] if part else 0
    return "\n".join(f"{k['ts'] - t0:10.1f} {k['dur']:8.1f}  {short(k['name'], width)}" for k in part)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--top", type=int, default=60)
    p.add_argument("--width", type=int, default=160)
    p.add_argument("--sequence", action="store_true")
    a = p.parse_args()
    if a.steps < 1:
        p.error("--steps: at least 1")
    ks = kernels(a.trace)
    if not ks:
        raise SystemExit(f"{a.trace}: no device kernels in the trace (was it recorded with the CUDA activity?)")
    print(table(ks, a.steps, a.top, a.width))
    if a.sequence:
        print("\n--- one step's kernels in order (start us, duration us, name; the trace split by kernel count)")
        print(sequence(ks, a.steps, a.width))


if __name__ == "__main__":
    main()
