"""What is live at the peak of a torch memory snapshot (torch.cuda.memory._dump_snapshot, e.g. the training
example's --memory-snapshot): replays the recorded allocations of one device, finds the moment the bytes
allocated since the recording began were highest, and lists the blocks live then, grouped by where they
were allocated (the innermost Python frames outside torch). Blocks allocated before the recording began
(parameters, optimizer states) are not in the trace; the total is relative to them (their frees, which
the trace does hold, count against it).

    python3 scripts/snapshot_peak.py SNAPSHOT.pickle [--device D] [--frames 3] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import os
import pickle

try:  # only to tell torch's own frames apart (the snapshot is a plain pickle)
    import torch
except ImportError:
    torch = None

MIB = 2.0 ** 20


TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep if torch is not None else None


def outside_torch(filename: str) -> bool:
    if TORCH_DIR is not None:
        return not os.path.abspath(filename).startswith(TORCH_DIR)
    return "site-packages/torch/" not in filename


def where(frames, depth: int) -> str:
    keep = [f for f in frames if f.get("filename", "").endswith(".py") and outside_torch(f.get("filename", ""))]
    keep = keep or frames
    return " < ".join(f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line', '?')} {f.get('name', '?')}"
                      for f in keep[:depth]) or "(no frames)"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("snapshot")
    p.add_argument("--device", type=int, default=None, help="default: the device with allocations")
    p.add_argument("--max-entries", type=int, default=200000, help="the recording's limit (train.py's)")
    p.add_argument("--frames", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    with open(a.snapshot, "rb") as f:
        snap = pickle.load(f)
    traces = snap.get("device_traces", [])
    device = a.device
    if device is None:  # the device that allocated something (one per process under torchrun)
        device = next((d for d, t in enumerate(traces) if any(ev.get("action") == "alloc" for ev in t)), None)
    if device is None or not 0 <= device < len(traces):
        raise SystemExit(f"{a.snapshot}: no allocations recorded" + (f" on device {a.device}" if a.device is not None else ""))
    trace = traces[device]
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    peak_index = -1
    for i, ev in enumerate(trace):
        act = ev.get("action")
        if act == "alloc":
            live[ev["addr"]] = (ev["size"], where(ev.get("frames", []), a.frames))
            total += ev["size"]
            if total > peak:
                peak, at_peak, peak_index = total, dict(live), i
        elif act == "free_requested":  # what torch's allocated-bytes count drops at (free_completed follows)
            total -= ev["size"]  # also for a block allocated before the recording began
            live.pop(ev["addr"], None)
    if peak_index < 0:
        raise SystemExit(f"{a.snapshot}: device {device} allocated nothing while recording")
    if len(trace) >= a.max_entries:
        print(f"warning: {len(trace)} events, the recording's limit: the earliest ones may have been dropped")
    print(f"device {device}, {len(trace)} events; peak of the bytes allocated since the recording began: "
          f"{peak / MIB:.1f} MiB at event {peak_index} ({where(trace[peak_index].get('frames', []), a.frames)})")
    groups: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for size, w in at_peak.values():
        groups[w] += size
        counts[w] += 1
    for w, size in groups.most_common(a.top):
        print(f"{size / MIB:9.1f} MiB  {counts[w]:4d} blocks  {w}")


if __name__ == "__main__":
    main()
