"""scripts/trace_gaps.py on a synthetic torch.profiler trace: the GPU's idle gaps, each charged to the host op
open where the work after it was launched (outermost and innermost), a launch made before the gap charged to
the device-side dependency, gaps under the threshold counted in the total only, overlapping GPU work merged."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "trace_gaps.py"
spec = importlib.util.spec_from_file_location("trace_gaps", SCRIPT)
trace_gaps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace_gaps)


def op(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def launch(corr, ts, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid,
            "args": {"correlation": corr}}


def kernel(name, corr, ts, dur, device=0):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": 7,
            "args": {"correlation": corr, "device": device}}


EVENTS = [
    op("Outer", 0, 100), op("inner_a", 10, 20), op("OtherThread", 0, 100, tid=2),
    launch(1, 12), launch(2, 60), launch(3, 5), launch(4, 96, tid=3), launch(5, 13),
    kernel("k1", 1, 20, 20), kernel("k5", 5, 25, 10),  # overlapping work: one busy stretch [20, 40)
    kernel("k2", 2, 70, 10),   # gap 30 after 40, launched at 60 inside Outer (inner_a closed at 30)
    kernel("k3", 3, 90, 5),    # gap 10 after 80, launched at 5: a device-side dependency
    kernel("k4", 4, 97, 2),    # gap 2 after 95: under the threshold
]


def test_gaps_are_charged_to_the_launching_op():
    r = trace_gaps.analyse(EVENTS, min_us=5)
    assert r["window_us"] == 79 and r["busy_us"] == 37 and r["idle_us"] == 42
    assert r["small_gaps_us"] == 2
    assert r["by_outer_us"] == {"Outer": 30, "(launched before the gap)": 10}
    assert r["by_inner_us"] == {"Outer": 30, "(launched before the gap)": 10}
    assert [g["next"] for g in r["largest"]] == ["k2", "k3"]


def test_innermost_op_is_named_when_the_launch_is_nested():
    events = EVENTS + [op("Step2", 100, 50), op("rdep::moe_forward", 104, 10), launch(9, 106), kernel("k9", 9, 110, 5)]
    r = trace_gaps.analyse(events, min_us=5)
    assert r["by_outer_us"]["Step2"] == pytest.approx(110 - 99)
    assert r["by_inner_us"]["rdep::moe_forward"] == pytest.approx(110 - 99)
    assert r["by_inner_us"]["Outer"] == 30


def test_cli_writes_json_and_refuses_a_trace_without_gpu_events(tmp_path, capsys):
    good, bad = tmp_path / "t.json", tmp_path / "cpu.json"
    good.write_text(json.dumps({"traceEvents": EVENTS}))
    bad.write_text(json.dumps({"traceEvents": [op("x", 0, 1)]}))
    out = tmp_path / "gaps.json"
    assert trace_gaps.main([str(good), "--json", str(out)]) == 0
    assert json.loads(out.read_text())[str(good)]["idle_us"] == 42
    assert "idle charged to the outermost" in capsys.readouterr().out
    assert trace_gaps.main([str(bad)]) == 2
    assert "no GPU events" in capsys.readouterr().err


def test_ops_of_another_process_with_the_same_thread_id_are_not_enclosing():
    events = EVENTS + [dict(op("OtherProcess", 0, 200), pid=99)]
    r = trace_gaps.analyse([dict(e, pid=e.get("pid", 1)) for e in events], min_us=5)
    assert r["by_outer_us"] == {"Outer": 30, "(launched before the gap)": 10}


def test_a_trace_of_two_gpus_needs_a_device():
    events = EVENTS + [kernel("other_gpu", 5, 41, 28, device=1)]  # would fill the gap 40-70 if merged
    with pytest.raises(ValueError, match="name one with --device"):
        trace_gaps.analyse(events, min_us=5)
    r = trace_gaps.analyse(events, min_us=5, device=0)
    assert r["by_outer_us"] == {"Outer": 30, "(launched before the gap)": 10}
    with pytest.raises(ValueError, match="no GPU events of device 3"):
        trace_gaps.analyse(events, min_us=5, device=3)
