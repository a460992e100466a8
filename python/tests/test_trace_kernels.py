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


def test_gaps_name_the_idle_time_and_the_host_calls_that_caused_it(tmp_path, capsys):
    """One 200 µs step: k1 runs 30-50 µs (launched from a compiled forward), k2 172-190 µs, launched at 170 µs from the
    optimizer's step, which began at 100 µs: the GPU idles 122 µs between them, and the host launched k2 120 µs into
    that gap. 30 µs before the first kernel and 10 µs after the last are idle too."""
    ev = [{"ph": "X", "cat": "user_annotation", "name": "train step 7", "ts": 0.0, "dur": 200.0, "tid": 1},
          {"ph": "X", "cat": "cpu_op", "name": "CompiledFunction", "ts": 10.0, "dur": 50.0, "tid": 1},
          {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 15.0, "dur": 5.0, "tid": 1},
          {"ph": "X", "cat": "cpu_op", "name": "Optimizer.step", "ts": 100.0, "dur": 80.0, "tid": 1},
          {"ph": "X", "cat": "cpu_op", "name": "other thread's op", "ts": 60.0, "dur": 100.0, "tid": 2}]
    for corr, t_launch, name, t_run, dur in [(1, 18.0, "k1", 30.0, 20.0), (2, 170.0, "k2", 172.0, 18.0)]:
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t_launch, "dur": 1.0, "tid": 1,
                   "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": t_run, "dur": dur, "args": {"correlation": corr}})
    per_step, _ = trace_kernels.steps_by_range(ev, trace_kernels.kernels(ev))
    out = trace_kernels.gaps(ev, per_step, 50.0, 120)
    assert "train step 7: host range 200 us, GPU busy 38 us, idle 162 us: 30 before the first kernel, 10 after the last, " \
           "122 in 1 gaps of >= 50 us" in out
    assert "at +50 us: 122 us idle, launched +120 us into it; ended by k2" in out
    assert "launched inside: Optimizer.step\n" in out
    assert "top-level host calls meanwhile: Optimizer.step (72 us), CompiledFunction (10 us)" in out
    assert "other thread" not in out  # a thread that launched nothing in the gap
    none = trace_kernels.gaps(ev, per_step, 200.0, 120)  # no gap that long: none listed
    assert "0 in 0 gaps of >= 200 us" in none and "at +" not in none
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    trace_kernels.main([str(path), "--gaps", "50"])
    assert "where the GPU sits idle in each step (gaps >= 50 us)" in capsys.readouterr().out


def test_a_gap_ended_by_another_threads_launch_names_that_threads_calls():
    """A backward launched from autograd's device thread (tid 2), 40 µs after the forward's last kernel ended: the gap
    names the call it was launched inside on that thread and that thread's top-level call meanwhile."""
    ev = [{"ph": "X", "cat": "user_annotation", "name": "train step 3", "ts": 0.0, "dur": 300.0, "tid": 1},
          {"ph": "X", "cat": "cpu_op", "name": "forward", "ts": 0.0, "dur": 20.0, "tid": 1},
          {"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function", "ts": 50.0, "dur": 100.0, "tid": 2},
          {"ph": "X", "cat": "cpu_op", "name": "CompiledFunctionBackward", "ts": 60.0, "dur": 80.0, "tid": 2}]
    for corr, tid, t_launch, name, t_run, dur in [(1, 1, 10.0, "fwd", 20.0, 30.0), (2, 2, 90.0, "bwd", 90.0, 10.0)]:
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t_launch, "dur": 1.0, "tid": tid,
                   "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": t_run, "dur": dur, "args": {"correlation": corr}})
    per_step, _ = trace_kernels.steps_by_range(ev, trace_kernels.kernels(ev))
    out = trace_kernels.gaps(ev, per_step, 30.0, 120)
    assert "at +50 us: 40 us idle, launched +40 us into it; ended by bwd" in out
    assert "launched inside: autograd::engine::evaluate_function > CompiledFunctionBackward\n" in out
    assert "top-level host calls meanwhile: autograd::engine::evaluate_function (40 us)" in out


def test_waits_name_the_synchronizations_and_where_they_sat(tmp_path, capsys):
    """Step 0 holds a 400 µs cudaStreamSynchronize inside aten::copy_ (inside a python call), a 40 µs
    cudaEventSynchronize (a synchronization: listed from a tenth of the threshold) and a 40 µs kernel launch (not
    listed: under the threshold, not a synchronization); step 1 holds a 300 µs cudaLaunchKernel (any API call that
    long is listed) on another thread."""
    ev = [{"ph": "X", "cat": "user_annotation", "name": f"train step {s}", "ts": 1000.0 * s, "dur": 900.0, "tid": 1}
          for s in (0, 1)]
    ev += [{"ph": "X", "cat": "python_function", "name": "train.py: batch", "ts": 10.0, "dur": 500.0, "tid": 1},
           {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 20.0, "dur": 450.0, "tid": 1},
           {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 30.0, "dur": 400.0, "tid": 1},
           {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 600.0, "dur": 40.0, "tid": 1},
           {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 700.0, "dur": 40.0, "tid": 1,
            "args": {"correlation": 1}},
           {"ph": "X", "cat": "kernel", "name": "k", "ts": 750.0, "dur": 5.0, "args": {"correlation": 1}},
           {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1100.0, "dur": 300.0, "tid": 2}]
    out = trace_kernels.waits(ev, 200.0, 120)
    lines = out.splitlines()
    assert lines[0] == "train step 0: host range 900 us, 2 long or synchronizing calls, 440 us (2 synchronizing, 440 us)"
    assert lines[1] == "  at +30 us: cudaStreamSynchronize 400 us, inside: train.py: batch > aten::copy_"
    assert lines[2] == "  at +600 us: cudaEventSynchronize 40 us, inside: -"
    assert lines[3] == "train step 1: host range 900 us, 1 long or synchronizing calls, 300 us (0 synchronizing, 0 us)"
    assert lines[4] == "  at +100 us: cudaLaunchKernel 300 us, inside: -"
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    trace_kernels.main([str(path), "--waits", "200"])
    assert "--- where the host waits in each step" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        trace_kernels.main([str(path), "--waits", "-1"])
