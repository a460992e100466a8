"""scripts/snapshot_peak.py on synthetic snapshots (the shape torch.cuda.memory._dump_snapshot writes): the
peak's place and contents, frees of blocks allocated before the recording counted, the device with
allocations found, an empty recording named."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "snapshot_peak.py"
MIB = 2 ** 20


def frames(name: str, line: int) -> list:
    return [{"filename": f"/work/x/{name}", "line": line, "name": "fn"}]


def run(tmp_path: Path, traces: list) -> subprocess.CompletedProcess:
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"device_traces": traces, "segments": []}))
    return subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True)


def test_peak_counts_frees_of_blocks_allocated_before_the_recording(tmp_path):
    trace = [
        {"action": "alloc", "addr": 1, "size": 100 * MIB, "frames": frames("a.py", 1)},
        {"action": "free_requested", "addr": 99, "size": 1000 * MIB, "frames": []},  # allocated before recording
        {"action": "free_completed", "addr": 99, "size": 1000 * MIB, "frames": []},
        {"action": "alloc", "addr": 2, "size": 500 * MIB, "frames": frames("b.py", 2)},
        {"action": "free_requested", "addr": 1, "size": 100 * MIB, "frames": []},
    ]
    r = run(tmp_path, [[], trace])  # device 0 recorded nothing: device 1 is the one read
    assert r.returncode == 0, r.stderr
    head, *rows = r.stdout.strip().splitlines()
    assert head.startswith("device 1, 5 events") and "100.0 MiB at event 0 (a.py:1 fn)" in head
    assert rows == ["    100.0 MiB     1 blocks  a.py:1 fn"]


def test_empty_recording_is_named(tmp_path):
    r = run(tmp_path, [[]])
    assert r.returncode != 0 and "no allocations recorded" in r.stderr


def test_frames_of_torch_itself_are_skipped_not_rdeps(tmp_path):
    import torch

    torch_file = str(Path(torch.__file__).resolve().parent / "nn" / "modules" / "module.py")
    stack = [{"filename": torch_file, "line": 7, "name": "_call_impl"},
             {"filename": "/repo/python/rdep/torch/ops.py", "line": 30, "name": "_layer_weights"},
             {"filename": "/repo/examples/torch_training/model.py", "line": 134, "name": "forward"}]
    r = run(tmp_path, [[{"action": "alloc", "addr": 1, "size": MIB, "frames": stack}]])
    assert r.returncode == 0, r.stderr
    assert "ops.py:30 _layer_weights < model.py:134 forward" in r.stdout
