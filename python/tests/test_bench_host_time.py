"""bench/torch_layer_bench.py on the host backend at a tiny shape: the receipt's host breakdown adds up (the C
library's calls plus Python make the host time), names the C calls each kind makes, and the timings are
there for every call kind, compiled ones included. The CUDA measurement runs on a GPU machine
(scripts/receipts_w4.sh host2, host3); this checks the script itself.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "torch_layer_bench.py"


@pytest.mark.parametrize("compiled", [False, True])
def test_host_breakdown_adds_up_on_the_host_backend(tmp_path, monkeypatch, compiled):
    out = tmp_path / "bench.json"
    argv = [str(BENCH), "--backend", "host", "--tokens", "4", "--hidden", "8", "--ffn", "8", "--experts", "4", "--topk", "2",
            "--warmup", "2", "--iters", "5", "--host-breakdown", "5", "--json", str(out)] + (["--compile"] if compiled else [])
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.syspath_prepend(str(BENCH.parent))
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCH), run_name="__main__")
    assert done.value.code == 0
    rec = json.loads(out.read_text())
    kinds = ["forward", "forward+backward"] + (["compiled forward", "compiled f+b"] if compiled else [])
    assert sorted(rec["p50_ms"]) == sorted(kinds) and sorted(rec["host_breakdown_us"]) == sorted(kinds)
    for kind in kinds:
        b = rec["host_breakdown_us"][kind]
        assert b["host"] > 0 and rec["p50_ms"][kind] > 0 and len(rec["samples_ms"][kind]) == 5
        c_calls = [k for k in b if k.startswith("c:")]
        assert b["c_total"] == pytest.approx(sum(b[k] for k in c_calls))
        assert b["python"] == pytest.approx(b["host"] - b["c_total"])
        assert 0 < b["c_total"] < b["host"]
        assert b["calls:rdep_layer_forward"] == 1 and b["calls:rdep_context_acquire"] == 1
        assert b.get("calls:rdep_layer_backward", 0) == (1 if kind.endswith(("backward", "f+b")) else 0)
    assert rec["torch_peak_allocated_gib"] is None and rec["device"] == "the host backend (CPU)"
