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
        # rdep.torch's own functions: the C calls inside them, inside the host time (the plain ops on the host backend).
        assert 0 < b["c:rdep_layer_forward"] <= b["py:layer_calls.forward"] < b["host"]
        assert b["calls:py:layer_calls.forward"] == 1 and b["calls:py:validate.check_forward"] == 1
        if backward:
            assert 0 < b["c:rdep_layer_backward"] <= b["py:layer_calls.backward"] <= b["py:ops._backward_on"] < b["host"]
        else:
            assert "py:layer_calls.backward" not in b
    assert rec["torch_peak_allocated_gib"] is None and rec["device"] == "the host backend (CPU)"


def test_stack_times_chained_layers(tmp_path, monkeypatch, capsys):
    """--stack N times N layers chained (one backward through all) beside the single layer, and prints it per layer."""
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--backend", "host", "--tokens", "4", "--hidden", "8", "--ffn", "8",
                                      "--experts", "4", "--topk", "2", "--warmup", "1", "--iters", "3", "--stack", "3",
                                      "--json", str(out)])
    monkeypatch.syspath_prepend(str(BENCH.parent))
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCH), run_name="__main__")
    assert done.value.code == 0
    rec = json.loads(out.read_text())
    assert sorted(rec["p50_ms"]) == ["forward", "forward+backward", "stack3 f+b"]
    assert rec["p50_ms"]["stack3 f+b"] > 0 and len(rec["samples_ms"]["stack3 f+b"]) == 3
    assert "(stack3 f+b / 3)" in capsys.readouterr().out


def test_graph_needs_a_capturable_layer(monkeypatch, capsys):
    """--graph on a layer that CUDA graphs cannot record (here the host backend) is refused with the reason."""
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--backend", "host", "--tokens", "4", "--hidden", "8", "--ffn", "8",
                                      "--experts", "4", "--topk", "2", "--graph"])
    monkeypatch.syspath_prepend(str(BENCH.parent))
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCH), run_name="__main__")
    assert done.value.code == 2
    assert "--graph needs a capturable layer" in capsys.readouterr().err


@pytest.mark.parametrize("flags, refused", [(["--backend", "host"], "--backend host"),
                                            (["--backend", "cuda", "--kernels", "3", "--cprofile", "2"], "--kernels, --cprofile"),
                                            (["--backend", "cuda", "--native-profile", "1", "--timeline", "3", "--stack", "2"],
                                             "--native-profile, --timeline, --stack")])
def test_torchrun_refuses_what_it_cannot_time_per_rank(monkeypatch, capsys, flags, refused):
    """Under torchrun (WORLD_SIZE > 1) the bench times the CUDA layer's calls only: the host backend and the per-process
    tables (--kernels, --profile, --host-breakdown, --cprofile) are refused, naming what, before any process group."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # the refusal comes first, even without a GPU
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--tokens", "4", "--hidden", "8", "--ffn", "8", "--experts", "4",
                                      "--topk", "2"] + flags)
    monkeypatch.syspath_prepend(str(BENCH.parent))
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCH), run_name="__main__")
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "under torchrun (WORLD_SIZE=2)" in err and f"(refused: {refused})" in err


def test_make_inputs_gives_each_rank_its_tokens_and_its_experts_slice(monkeypatch):
    """At W > 1 each rank draws its own tokens (seed + rank) and takes its experts' slices of one draw of all the
    experts' weights (the same on every rank); W = 1 keeps every expert."""
    import argparse

    import torch

    monkeypatch.syspath_prepend(str(BENCH.parent))
    bench = runpy.run_path(str(BENCH), run_name="not_main")
    a = argparse.Namespace(seed=3, tokens=6, hidden=8, ffn=4, experts=4, topk=2, routing_from="")
    cpu = torch.device("cpu")
    whole = bench["make_inputs"](a, cpu, torch.float32)
    r0 = bench["make_inputs"](a, cpu, torch.float32, 0, 2, range(0, 2))
    r1 = bench["make_inputs"](a, cpu, torch.float32, 1, 2, range(2, 4))
    assert whole[3].shape == (4, 8, 8) and r0[3].shape == r1[3].shape == (2, 8, 8)
    assert torch.equal(r0[3].detach(), whole[3][:2].detach()) and torch.equal(r1[4].detach(), whole[4][2:].detach())
    assert torch.equal(r0[0].detach(), whole[0].detach()) and not torch.equal(r1[0].detach(), r0[0].detach())


def test_routing_from_reads_each_ranks_file(monkeypatch, tmp_path):
    """--routing-from FILE: at W = 1 the file itself, under torchrun rank r's FILE.rank<r> (as `rdep bench layer --ranks W
    --routing-out FILE` writes them: int64 tokens, int64 topk, int32 experts, fp32 gates)."""
    import argparse

    import torch

    monkeypatch.syspath_prepend(str(BENCH.parent))
    bench = runpy.run_path(str(BENCH), run_name="not_main")
    T, K, E = 3, 2, 4
    drawn = {}
    for r in range(2):
        ids = torch.tensor([[0, 1], [2, 3], [1, r + 2]], dtype=torch.int32)
        gates = torch.full((T, K), 0.5 + r, dtype=torch.float32)
        head = torch.tensor([T, K], dtype=torch.int64)
        (tmp_path / f"route.bin.rank{r}").write_bytes(head.numpy().tobytes() + ids.numpy().tobytes() + gates.numpy().tobytes())
        drawn[r] = (ids, gates)
    a = argparse.Namespace(seed=0, tokens=T, hidden=4, ffn=2, experts=E, topk=K, routing_from=str(tmp_path / "route.bin"))
    cpu = torch.device("cpu")
    for r in range(2):
        _, ids, gates, *_ = bench["make_inputs"](a, cpu, torch.float32, r, 2, range(2 * r, 2 * r + 2))
        assert torch.equal(ids[0], drawn[r][0]) and torch.equal(gates[0].detach(), drawn[r][1])
    with pytest.raises(FileNotFoundError):
        bench["make_inputs"](a, cpu, torch.float32)  # W = 1 reads FILE itself, which is not there


def test_busy_and_idle_merge_overlapping_kernel_intervals(monkeypatch):
    """--kernels' busy row is the union of the kernels' intervals (overlaps counted once), its idle row the time
    between the first start and the last end that no kernel covers."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    bench = runpy.run_path(str(BENCH), run_name="not_main")
    busy_and_idle = bench["busy_and_idle"]
    assert busy_and_idle([]) == (0.0, 0.0)
    assert busy_and_idle([(20, 25), (0, 10), (5, 12), (24, 30)]) == (22, 8)  # unsorted, overlapping, a gap of 8
    assert busy_and_idle([(0, 10), (2, 3)]) == (10, 0)  # nested


def test_the_probe_puts_back_what_it_wrapped(monkeypatch):
    """binding_host_time.instrumented wraps rdep.torch's functions, torch's allocating functions, the C library and the
    caching allocator's calls while its block runs, and puts every original back when the block ends or raises."""
    import importlib

    import torch

    from rdep import _capi

    monkeypatch.syspath_prepend(str(BENCH.parent))
    import binding_host_time as bht

    def current():
        fns = {(m, f): getattr(importlib.import_module(f"rdep.torch.{m}"), f) for m, f in bht.PY_FUNCS}
        fns.update({("torch", f): getattr(torch, f) for f in bht.TORCH_FUNCS})
        fns[("cuda", "alloc")] = torch.cuda.caching_allocator_alloc
        fns[("cuda", "free")] = torch.cuda.caching_allocator_delete
        return fns

    before, lib = current(), _capi.lib()
    with pytest.raises(RuntimeError, match="inside"):
        with bht.instrumented() as probe:
            during = current()
            assert all(during[k] is not before[k] for k in before) and _capi.lib() is probe.lib
            torch.empty(3)
            assert probe.py_calls["torch.empty"] == 1
            raise RuntimeError("inside")
    after = current()
    assert all(after[k] is before[k] for k in before) and _capi.lib() is lib


def test_native_profile_sums_the_samples_of_the_calls(monkeypatch):
    """native_host_profile.summarize on py-spy's raw format (one stack a line, its count last): the main thread counts
    inside _issue_call only, other threads always, samples between calls (_idle_wait) never; the main thread's samples
    blocked on another thread (pthread_cond_wait) count apart, the other threads' blocked ones not at all; µs per call =
    samples / rate / calls, by thread, by the leaf frame's library and by the innermost Python function."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    import native_host_profile as nhp

    main = "thread (1): MainThread;<module> (t.py:1);record (native_host_profile.py:60);_issue_call (native_host_profile.py:35)"
    raw = "\n".join([
        f"{main};forward (rdep/torch/layer_calls.py:122);0x1 (_ctypes.so);cuLaunchKernel (libcuda.so.580) 30",
        f"{main};forward (rdep/torch/layer_calls.py:97);torch::empty_like (libtorch_python.so) 10",
        f"{main};backward (torch/autograd/__init__.py:351) 5",
        f"{main};run (graph.py:9);ReadyQueue::pop (libtorch_cpu.so);pthread_cond_wait (libc.so.6);0x3 (libc.so.6) 20",
        "thread (1): MainThread;<module> (t.py:1);record (native_host_profile.py:58);_idle_wait (native_host_profile.py:39);"
        "cudaDeviceSynchronize (libcudart.so.13) 400",
        "thread (1): MainThread;<module> (t.py:1);sleep (time.py:1) 7",  # the main thread outside a call: left out
        "thread (2);thread_main (libtorch_cpu.so);backward (rdep/torch/layer_calls.py:255);0x2 (librdep_capi.so) 15",
        "thread (2);thread_main (libtorch_cpu.so);pthread_cond_wait (libc.so.6) 99",  # waiting for work: left out
        "thread (3);0x4 (libcuda.so.580);poll (libc.so.6) 50",  # a driver thread polling: left out
        "not a sample line",
    ])
    s = nhp.summarize(raw, calls=10, done=4, rate=100)
    us = 1e6 / 100 / 10  # one sample, per call
    assert s["calls"] == 10 and s["device_done_at_return"] == 4
    assert s["us_per_call_by_thread"] == pytest.approx({"main (issuing)": 45 * us, "thread (2)": 15 * us})
    assert s["us_per_call_blocked_while_issuing"] == pytest.approx({"main (issuing)": 20 * us})
    assert s["us_per_call_by_leaf_library"] == pytest.approx({"libcuda": 30 * us, "libtorch_python": 10 * us,
                                                              "python": 5 * us, "librdep_capi": 15 * us})
    assert s["us_per_call_by_python_function"] == pytest.approx({"layer_calls.py:forward": 40 * us,
                                                                 "layer_calls.py:backward": 15 * us,
                                                                 "__init__.py:backward": 5 * us})


def test_backward_timeline_splits_the_host_time_and_puts_the_formulas_back(monkeypatch):
    """backward_timeline on the host backend (torch.cuda's synchronize and Event stood in for): the formula's own time
    is inside the forward+backward's, with and without the engine's threads, and the formulas it wrapped are back after."""
    import types

    import torch

    import rdep.torch as rt
    from rdep.torch import eager_ext, op_library

    monkeypatch.syspath_prepend(str(BENCH.parent))
    import backward_timeline as bt

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "Event", lambda: types.SimpleNamespace(record=lambda: None, query=lambda: True))
    before = {fn: fn.backward for fn in op_library._FUNCTIONS.values()}
    layer = rt.Layer(8, 8, 4, 2, 4, world_size=1, backend="host")
    try:
        g = torch.Generator().manual_seed(3)
        x = torch.randn(1, 4, 8, generator=g, requires_grad=True)
        gates = torch.rand(1, 4, 2, generator=g, requires_grad=True)
        experts = torch.tensor([[[0, 1], [1, 2], [2, 3], [3, 0]]], dtype=torch.int32)
        w1 = torch.randn(4, 8, 16, generator=g, requires_grad=True)
        w2 = torch.randn(4, 8, 8, generator=g, requires_grad=True)
        t = bt.timeline(lambda: rt.moe(layer, x, experts, gates, w1, w2), torch.randn(1, 4, 8, generator=g),
                        (x, gates, w1, w2), 4, python_path_too=True)
    finally:
        layer.close()
    assert sorted(t) == ["one thread", "one thread py", "threads", "threads py"]
    ext = eager_ext.module() is not None
    for mode, r in t.items():
        assert r["calls"] == 4 and r["device_done_at_return"] == 4  # 4 rounds of 1
        assert 0 < r["forward"] < r["forward+backward"] and 0 < r["backward"] < r["forward+backward"]
        if mode.endswith(" py") or not ext:  # the Python formula, wrapped
            assert 0 < r["formula"] < r["forward+backward"]
            assert r["handoff in"] > 0 and r["handoff out"] > 0
        else:  # the C++ path: no Python formula to split the backward at
            assert "formula" not in r
    assert {fn: fn.backward for fn in op_library._FUNCTIONS.values()} == before
    assert eager_ext.enabled


def test_floor_bench_times_the_pair_and_rdep_stubbed(tmp_path):
    """bench/torch_autograd_floor.py on the CPU runs every case: torch's ops, the op pair shaped as rdep's (forward and
    backward through its autograd registration) and, with --rdep, rdep.torch.moe with the compute calls stubbed; in a
    subprocess, since the stub stays installed for the rest of its run."""
    import os
    import subprocess

    out = tmp_path / "floor.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH.parents[1] / "python"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(BENCH.parent / "torch_autograd_floor.py"), "--iters", "3", "--rdep",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    us = json.loads(out.read_text())["host_us"]
    for name in ("op f+b", "pair forward", "pair f+b", "empty", "full", "rdep stubbed forward (plain ops)",
                 "rdep stubbed f+b (plain ops)"):
        assert us[f"cpu {name}"] > 0, name


def test_floor_bench_builds_and_times_the_cpp_pair(tmp_path):
    """--cpp compiles bench/torch_floor_pair.cpp (torch.utils.cpp_extension) and times the pair as C++ ops; skipped
    where no C++ compiler or ninja is installed."""
    import os
    import shutil
    import subprocess

    if shutil.which("ninja") is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("needs ninja and a C++ compiler (torch.utils.cpp_extension)")
    out = tmp_path / "floor.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH.parents[1] / "python"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(BENCH.parent / "torch_autograd_floor.py"), "--iters", "3", "--cpp",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    us = json.loads(out.read_text())["host_us"]
    assert us["cpu cpp pair forward"] > 0 and us["cpu cpp pair f+b"] > 0 and us["cpu pair f+b"] > 0
