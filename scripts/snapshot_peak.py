"""What is live at the peak of a torch memory snapshot (torch.cuda.memory._dump_snapshot, e.g. the training
example's --memory-snapshot): replays the recorded allocations of one device, finds the moment the bytes
allocated since the recording began were highest, and lists the blocks live then, grouped by where they
were allocated (the innermost Python frames outside torch). Blocks allocated before the recording began
(parameters, optimizer states) are not in the trace; the total is relative to them.

    python3 scripts/snapshot_peak.py SNAPSHOT.pickle [--device 0] [--frames 3] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import pickle

MIB = 2.0 ** 20


def where(frames, depth: int) -> str:
    keep = [f for f in frames if "/torch/" not in f.get("filename", "") and f.get("filename", "").endswith(".py")]
    keep = keep or frames
    return " < ".join(f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line', '?')} {f.get('name', '?')}"
                      for f in keep[:depth]) or "(no frames)"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("snapshot")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--frames", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    with open(a.snapshot, "rb") as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][a.device]
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    peak_index = 0
    for i, ev in enumerate(trace):
        act = ev.get("action")
        if act == "alloc":
            live[ev["addr"]] = (ev["size"], where(ev.get("frames", []), a.frames))
            total += ev["size"]
            if total > peak:
                peak, at_peak, peak_index = total, dict(live), i
        elif act in ("free_requested", "free_completed") and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    print(f"{len(trace)} events; peak of the bytes allocated since the recording began: {peak / MIB:.1f} MiB at "
          f"event {peak_index} ({where(trace[peak_index].get('frames', []), a.frames)})")
    groups: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for size, w in at_peak.values():
        groups[w] += size
        counts[w] += 1
    for w, size in groups.most_common(a.top):
        print(f"{size / MIB:9.1f} MiB  {counts[w]:4d} blocks  {w}")


if __name__ == "__main__":
    main()
