"""bench/trace_kernels.py on synthetic Chrome traces (no GPU needed): kernels are assigned to the "train step N" range
that holds the host call which launched them (correlation ids), so a graph replay launched late in a step whose kernels
run after the range closes still counts in that step, kernels launched outside every range are counted apart, and a
trace without ranges falls back to a split by kernel count. The training example's profiled steps carry those ranges
(examples/torch_training/test_train.py checks a CPU profile's trace for them)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_library  # a script test: no librdep_capi.so needed

PATH = Path(__file__).resolve().parents[2] / "bench" / "trace_kernels.py"
spec = importlib.util.spec_from_file_location("trace_kernels", PATH)
trace_kernels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace_kernels)


def _trace(ranges: bool) -> list[dict]:
    """Two steps of 100 µs host time each. Step 0 launches k_a (runs inside) and a graph replay whose k_b runs at
    t = 150, after step 0's range closed; step 1 launches k_a; one more launch at t = 250 is outside both steps."""
    ev = []
    if ranges:
        ev += [{"ph": "X", "cat": "user_annotation", "name": f"train step {s}", "ts": 100.0 * s, "dur": 99.0} for s in (0, 1)]
    launches = [(1, 10.0, "k_a", 20.0, 5.0), (2, 90.0, "k_b", 150.0, 30.0), (3, 110.0, "k_a", 120.0, 5.0),
                (4, 250.0, "k_c", 260.0, 7.0)]
    for corr, t_launch, name, t_run, dur in launches:
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t_launch, "dur": 2.0,
                   "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": t_run, "dur": dur, "args": {"correlation": corr}})
    ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5.0, "dur": 1.0})
    return ev


def test_kernels_belong_to_the_step_that_launched_them():
    ev = _trace(ranges=True)
    per_step, outside = trace_kernels.steps_by_range(ev, trace_kernels.kernels(ev))
    assert [[k["name"] for k in part] for part in per_step] == [["k_a", "k_b"], ["k_a"]]
    assert outside == 1
    table = trace_kernels.table(per_step, top=10, width=40)
    assert "0.020 ms a step (2 steps)" in table  # (5 + 30 + 5) µs over 2 steps
    assert "     15.0        0.5     30.0  k_b" in table


def test_a_trace_without_ranges_is_split_by_count(tmp_path, capsys):
    ev = _trace(ranges=False)
    assert trace_kernels.steps_by_range(ev, trace_kernels.kernels(ev)) is None
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    trace_kernels.main([str(path), "--steps", "2", "--sequence"])
    out = capsys.readouterr().out
    assert "split by kernel count" in out and "4 kernels/copies" in out


def test_a_trace_without_kernels_is_named(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}]}))
    with pytest.raises(SystemExit, match="no device kernels"):
        trace_kernels.main([str(path)])
