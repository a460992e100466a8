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
--gaps US: where each ranged step's GPU sits idle: the step's host range against the union of its kernels' busy time,
the idle time before the first kernel and after the last, and the idle gaps of at least US µs between kernels, each
with the kernel that ended it, how long after the gap began the host launched that kernel (a gap the host caused),
the host calls that launch sat in (on the launching thread: autograd runs a backward on a thread of its own), and the
top-level host calls of the step's thread and the launching thread that ran during the gap. The profiler slows
the host, so the gaps are upper bounds of an unprofiled step's. For traces of synced steps (the example's default
--timing): with --timing overlapped a step's kernels run after its range, beside the next step's launches.
--waits US: the CUDA API calls in each ranged step that lasted at least US µs (a graph launch that long is host
launch cost, not a wait) and the synchronizing ones (device, stream or event synchronizations, blocking copies, frees)
that lasted at least US/10 µs, each with the host calls it sat in: where a loop that should keep ahead of the GPU
(--timing overlapped) waits for it.
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


def step_ranges(events: list[dict]) -> list[dict]:
    """The "train step N" range events in time order."""
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                   and STEP_RANGE.match(e.get("name", ""))), key=lambda e: e["ts"])


def launches(events: list[dict]) -> dict:
    """correlation id -> the host call (runtime or driver API event) that launched the kernel or copy."""
    return {e["args"]["correlation"]: e for e in events
            if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}


def steps_by_range(events: list[dict], ks: list[dict]) -> tuple[list[list[dict]], int] | None:
    """(each annotated step's kernels in order, kernels outside every step), or None without "train step N" ranges."""
    ranges = [(e["ts"], e["ts"] + e["dur"]) for e in step_ranges(events)]
    if not ranges:
        return None
    launched = launches(events)
    per_step: list[list[dict]] = [[] for _ in ranges]
    outside = 0
    for k in ks:
        t = launched.get(k.get("args", {}).get("correlation"), {}).get("ts")
        i = next((i for i, (lo, hi) in enumerate(ranges) if t is not None and lo <= t <= hi), None)
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


HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function")


def busy_intervals(part: list[dict]) -> list[tuple[float, float, dict]]:
    """The union of the kernels' [start, end) intervals, each with the kernel that opened it."""
    out: list[list] = []
    for k in sorted(part, key=lambda k: k["ts"]):
        end = k["ts"] + k["dur"]
        if out and k["ts"] <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([k["ts"], end, k])
    return [tuple(iv) for iv in out]


def host_calls(events: list[dict], rng: dict, tid) -> list[dict]:
    """The host calls of thread tid in a step's range, each with its depth (0: not inside another of them): on the
    range's own thread those inside it (the range left out), on another (autograd's device thread, which runs a
    backward) those overlapping it."""
    lo, hi = rng["ts"], rng["ts"] + rng["dur"]
    calls = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES and e is not rng
                    and e.get("tid") == tid and (e["ts"] + e["dur"] >= lo and e["ts"] <= hi if tid != rng.get("tid")
                                                  else lo <= e["ts"] and e["ts"] + e["dur"] <= hi)),
                   key=lambda e: (e["ts"], -e["dur"]))
    stack: list[float] = []
    out = []
    for e in calls:
        while stack and e["ts"] >= stack[-1]:
            stack.pop()
        out.append({**e, "depth": len(stack)})
        stack.append(e["ts"] + e["dur"])
    return out


def thread_calls(events: list[dict], rng: dict):
    """tid -> host_calls(events, rng, tid), each thread's computed once."""
    cache: dict = {}

    def of(tid):
        if tid not in cache:
            cache[tid] = host_calls(events, rng, tid)
        return cache[tid]
    return of


def inside(calls: list[dict], t, width: int) -> str:
    """The innermost three of `calls` open at time t, outermost first ('-' for none, or no t)."""
    chain = [c["name"] for c in calls if t is not None and c["ts"] <= t <= c["ts"] + c["dur"]][-3:]
    return " > ".join(short(n, width // 3) for n in chain) or "-"


def gaps(events: list[dict], per_step: list[list[dict]], min_gap: float, width: int, top: int = 8) -> str:
    """Each ranged step's GPU idle time and its gaps of at least min_gap µs (see --gaps)."""
    launched = launches(events)
    lines = []
    for rng, part in zip(step_ranges(events), per_step):
        lo, hi = rng["ts"], rng["ts"] + rng["dur"]
        busy = busy_intervals(part)
        if not busy:
            lines.append(f"{rng['name']}: no kernels")
            continue
        calls_of = thread_calls(events, rng)
        held = [(busy[i][1], busy[i + 1][0], busy[i + 1][2]) for i in range(len(busy) - 1)
                if busy[i + 1][0] - busy[i][1] >= min_gap]
        busy_us = sum(b - a for a, b, _ in busy)
        lines.append(f"{rng['name']}: host range {hi - lo:.0f} us, GPU busy {busy_us:.0f} us, idle {hi - lo - busy_us:.0f} us: "
                     f"{busy[0][0] - lo:.0f} before the first kernel, {max(0.0, hi - busy[-1][1]):.0f} after the last, "
                     f"{sum(g1 - g0 for g0, g1, _ in held):.0f} in {len(held)} gaps of >= {min_gap:g} us")
        for g0, g1, k in sorted(held, key=lambda g: g[0] - g[1])[:top]:
            launch = launched.get(k.get("args", {}).get("correlation"), {})
            t = launch.get("ts")
            tids = [rng.get("tid")] + ([launch["tid"]] if launch.get("tid", rng.get("tid")) != rng.get("tid") else [])
            during = sorted(((min(g1, c["ts"] + c["dur"]) - max(g0, c["ts"]), c["name"]) for tid in tids for c in calls_of(tid)
                             if c["depth"] == 0 and c["ts"] < g1 and c["ts"] + c["dur"] > g0), reverse=True)[:3]
            late = f"launched {t - g0:+.0f} us into it" if t is not None else "launch not in the trace"
            lines.append(f"  at +{g0 - lo:.0f} us: {g1 - g0:.0f} us idle, {late}; ended by {short(k['name'], 60)}")
            lines.append(f"      launched inside: {inside(calls_of(launch.get('tid')), t, width)}")
            lines.append(f"      top-level host calls meanwhile: "
                         f"{', '.join(f'{short(n, width // 3)} ({us:.0f} us)' for us, n in during) or '-'}")
    return "\n".join(lines)


WAIT_NAMES = re.compile(r"Synchronize|^cudaMemcpy$|^cuMemcpy(DtoH|HtoD)?(_v2)?$|^cudaFree(Host)?$|^cuMemFree(Host)?(_v2)?$")


def waits(events: list[dict], min_us: float, width: int) -> str:
    """The CUDA API calls of each ranged step (on any thread) that lasted at least min_us, or that synchronize
    (WAIT_NAMES) and lasted at least min_us / 10, with the host calls they sat in (see --waits)."""
    api = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATEGORIES
                  and (e["dur"] >= min_us or (WAIT_NAMES.search(e.get("name", "")) and e["dur"] >= min_us / 10))),
                 key=lambda e: e["ts"])
    lines = []
    for rng in step_ranges(events):
        lo, hi = rng["ts"], rng["ts"] + rng["dur"]
        mine = [e for e in api if lo <= e["ts"] <= hi]
        syncs = [e for e in mine if WAIT_NAMES.search(e.get("name", ""))]
        lines.append(f"{rng['name']}: host range {hi - lo:.0f} us, {len(mine)} long or synchronizing calls, "
                     f"{sum(e['dur'] for e in mine):.0f} us ({len(syncs)} synchronizing, {sum(e['dur'] for e in syncs):.0f} us)")
        calls_of = thread_calls(events, rng)
        for e in mine:
            lines.append(f"  at +{e['ts'] - lo:.0f} us: {e['name']} {e['dur']:.0f} us, inside: "
                         f"{inside(calls_of(e.get('tid')), e['ts'], width)}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=1, help="steps in a trace without 'train step N' ranges")
    p.add_argument("--top", type=int, default=60)
    p.add_argument("--width", type=int, default=160)
    p.add_argument("--sequence", action="store_true")
    p.add_argument("--gaps", type=float, default=0.0, metavar="US",
                   help="list each ranged step's GPU idle gaps of at least US microseconds (synced steps' traces)")
    p.add_argument("--waits", type=float, default=0.0, metavar="US",
                   help="list each ranged step's host calls that waited for the device at least US microseconds")
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error("--steps: at least 1")
    if a.gaps < 0:
        p.error("--gaps: a gap length in microseconds, at least 0")
    if a.waits < 0:
        p.error("--waits: a duration in microseconds, at least 0")
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
    if a.gaps > 0:
        if ranged is None:
            print("\n--- gaps: not computed (no 'train step N' ranges in the trace)")
        else:
            print(f"\n--- where the GPU sits idle in each step (gaps >= {a.gaps:g} us)")
            print(gaps(events, per_step, a.gaps, a.width))
    if a.waits > 0:
        print(f"\n--- where the host waits in each step (CUDA API calls >= {a.waits:g} us; synchronizing ones >= {a.waits / 10:g} us)")
        print(waits(events, a.waits, a.width) if ranged is not None else "no 'train step N' ranges in the trace")


if __name__ == "__main__":
    main()
