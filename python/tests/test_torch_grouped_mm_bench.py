"""bench/torch_grouped_mm.py's ratios against an rdep receipt (no GPU needed): `speedups` divides torch's p50 by each
rdep path's p50 at the same mu (forward, and forward+backward where both timed it), and the script, run on the CPU with
--counts-from a small synthetic `rdep bench gemm` receipt, takes that receipt's shape and counts, prints the ratio table
and writes the ratios into its own receipt."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_library  # a script test: no librdep_capi.so needed

PATH = Path(__file__).resolve().parents[2] / "bench" / "torch_grouped_mm.py"
spec = importlib.util.spec_from_file_location("torch_grouped_mm", PATH)
tgm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tgm)


def test_speedups_are_torch_over_rdep_per_mu_and_path():
    rdep = [
        {"mu": 8, "path": "cutlass", "forward": {"p50_us": 10.0}, "forward_backward": {"p50_us": 40.0}},
        {"mu": 8, "path": "cutlass://ping_128x128///", "forward": {"p50_us": 20.0}},  # no backward timed
        {"mu": 16, "path": "cutlass", "forward": {"p50_us": 25.0}, "forward_backward": {"p50_us": 50.0}},
        {"mu": 32, "path": "cutlass", "forward": {"p50_us": 1.0}},  # torch did not time this mu
        {"mu": 8, "path": "fb-only", "forward_backward": {"p50_us": 30.0}},  # no forward p50: the other ratio stays
    ]
    torch_rows = [{"mu": 8, "p50_us": 15.0, "forward_backward_p50_us": 60.0}, {"mu": 16, "p50_us": 30.0}]
    got = tgm.speedups(rdep, torch_rows)
    assert [(q["mu"], q["path"]) for q in got] == [(8, "cutlass"), (8, "cutlass://ping_128x128///"), (16, "cutlass"), (8, "fb-only")]
    assert got[0]["forward_speedup"] == pytest.approx(1.5)
    assert got[0]["forward_backward_speedup"] == pytest.approx(1.5)
    assert got[1]["forward_speedup"] == pytest.approx(0.75)
    assert got[1]["forward_backward_speedup"] is None
    assert got[2]["forward_speedup"] == pytest.approx(1.2)
    assert got[2]["forward_backward_speedup"] is None  # torch ran without --backward at this mu
    assert got[3]["forward_speedup"] is None
    assert got[3]["forward_backward_speedup"] == pytest.approx(2.0)


def test_counts_from_a_receipt_prints_and_writes_the_ratios(tmp_path):
    pytest.importorskip("torch")
    import torch

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    receipt = {
        "workload": {"experts_local": 2, "hidden": 16, "ffn": 8, "routing": "uniform"},
        "results": [
            {"mu": 4, "path": "cutlass", "counts": [3, 5], "forward": {"p50_us": 2.0}, "forward_backward": {"p50_us": 6.0}},
            {"mu": 8, "path": "cutlass", "counts": [16, 0], "forward": {"p50_us": 4.0}, "forward_backward": {"p50_us": 9.0}},
        ],
    }
    src, out = tmp_path / "gemm.json", tmp_path / "torch.json"
    src.write_text(json.dumps(receipt))
    r = subprocess.run([sys.executable, str(PATH), "--device", "cpu", "--counts-from", str(src), "--backward", "--iters", "2",
                        "--warmup", "1", "--json", str(out)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "grouped_mm" in r.stderr and ("CPU" in r.stderr or "cpu" in r.stderr):
        pytest.skip("torch._grouped_mm does not run on this torch's CPU backend: " + r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr
    assert "torch p50 over rdep p50" in r.stdout
    rec = json.loads(out.read_text())
    assert [row["counts"] for row in rec["results"]] == [[3, 5], [16, 0]]
    ratios = rec["torch_p50_over_rdep_p50"]
    assert [(q["mu"], q["path"]) for q in ratios] == [(4, "cutlass"), (8, "cutlass")]
    for q, row, rd in zip(ratios, rec["results"], receipt["results"]):
        assert q["forward_speedup"] == pytest.approx(row["p50_us"] / rd["forward"]["p50_us"])
        assert q["forward_backward_speedup"] == pytest.approx(row["forward_backward_p50_us"] / rd["forward_backward"]["p50_us"])
