"""bench/torch_layer_bench.py on the host backend at a tiny shape: the receipt's host breakdown names the C calls
each kind makes, how often, and puts them inside the host time, and the timings are there for every call kind,
compiled ones included. The CUDA measurement runs on a GPU machine
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
        assert 0 < b["c_total"] < b["host"] and b["host_median"] > 0
        # The binding's C calls per call: one acquire and one forward; a backward, and its release besides the
        # context tensor's finalizer (a no-op for a released id), with grad.
        backward = kind.endswith(("backward", "f+b"))
        calls = {k[len("calls:"):]: v for k, v in b.items() if k.startswith("calls:rdep_")}
        assert calls == {"rdep_context_acquire": 1, "rdep_layer_forward": 1, "rdep_context_release": 2 if backward else 1,
                         **({"rdep_layer_backward": 1} if backward else {})}
    assert rec["torch_peak_allocated_gib"] is None and rec["device"] == "the host backend (CPU)"


def test_graph_needs_a_capturable_layer(monkeypatch, capsys):
    """--graph on a layer that CUDA graphs cannot record (here the host backend) is refused with the reason."""
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--backend", "host", "--tokens", "4", "--hidden", "8", "--ffn", "8",
                                      "--experts", "4", "--topk", "2", "--graph"])
    monkeypatch.syspath_prepend(str(BENCH.parent))
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCH), run_name="__main__")
    assert done.value.code == 2
    assert "--graph needs a capturable layer" in capsys.readouterr().err


def test_busy_and_idle_merge_overlapping_kernel_intervals(monkeypatch):
    """--kernels' busy row is the union of the kernels' intervals (overlaps counted once), its idle row the time
    between the first start and the last end that no kernel covers."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    bench = runpy.run_path(str(BENCH), run_name="not_main")
    busy_and_idle = bench["busy_and_idle"]
    assert busy_and_idle([]) == (0.0, 0.0)
    assert busy_and_idle([(20, 25), (0, 10), (5, 12), (24, 30)]) == (22, 8)  # unsorted, overlapping, a gap of 8
    assert busy_and_idle([(0, 10), (2, 3)]) == (10, 0)  # nested
