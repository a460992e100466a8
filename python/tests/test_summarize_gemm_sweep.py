"""bench/summarize_gemm_sweep.py on a directory of synthetic receipt pairs (no GPU needed): one row per (E_loc, routing,
mu), E_loc descending, the ratios as rdep's TFLOP/s over torch's cut to three decimals (a ratio of 1.1996 must not print
as 1.20 or 1.200), a missing torch receipt or mu as nan, and the weight gradients and iterations said above the table."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_library  # a script test: no librdep_capi.so needed

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "summarize_gemm_sweep.py"
spec = importlib.util.spec_from_file_location("summarize_gemm_sweep", SCRIPT)
sgs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sgs)


def receipt(E, routing, rows, grads="bf16"):
    return {"workload": {"experts_local": E, "routing": routing, "weight_gradients": grads, "warmup": 5, "iters": 30},
            "dense_peak": {"tflops": 800.0},
            "results": [{"mu": mu, "path": "cutlass", "rho": 1.05, "tflops_forward": f, "tflops_forward_backward": fb}
                        for mu, f, fb in rows]}


def test_truncation_is_exact_at_a_thousandth():
    assert sgs.truncated(102.1 / 100) == "1.021" and sgs.truncated(1.1996) == "1.199" and sgs.truncated(float("nan")) == "nan"


def test_rows_ratios_and_header(tmp_path):
    (tmp_path / "gemm_E16_uniform.json").write_text(json.dumps(receipt(16, "uniform", [(128, 599.8, 500.0), (384, 600.0, 480.0)])))
    (tmp_path / "torch_E16_uniform.json").write_text(json.dumps(
        {"results": [{"mu": 128, "tflops_forward": 500.0, "tflops_forward_backward": 400.0}]}))  # no mu = 384
    (tmp_path / "gemm_E64_zipf1.json").write_text(json.dumps(receipt(64, "zipf:1", [(128, 300.0, 250.0)], grads="fp32")))  # no torch
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0].startswith("rdep weight gradients: bf16, fp32; warmup 5, iterations 30")  # every value the receipts hold
    rows = [l for l in lines if l.startswith("| ") and not l.startswith("| E_loc") and not l.startswith("| ---")]
    assert [r.split("|")[1].strip() for r in rows] == ["64 (1)", "16 (4)", "16 (4)"]  # E_loc descending
    cells = [c.strip() for c in rows[1].strip().strip("|").split("|")]
    assert cells[1:7] == ["uniform", "cutlass", "128", "1.05", "599.8", "500.0"]  # routing, path, mu, rho, rdep fwd, torch fwd
    assert cells[7] == "1.199" and cells[10] == "1.250"  # 599.8 / 500 = 1.1996: cut, not rounded
    assert cells[8:10] == ["500.0", "400.0"] and cells[11] == "800.0"  # f+b rdep and torch, the dense ceiling
    assert [c.strip() for c in rows[2].strip().strip("|").split("|")][7] == "nan"  # torch did not time mu = 384
    assert [c.strip() for c in rows[0].strip().strip("|").split("|")][7] == "nan"  # no torch receipt at all
