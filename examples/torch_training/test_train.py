"""Fast CPU test of the training example (train.py) at a tiny shape: hidden 32, 2 layers (1 dense + 1 MoE of
8 experts top-2 plus 2 shared), 6 steps, on the host backend.

  RDEP_LIBRARY=build/lib/librdep_capi.so PYTHONPATH=python python3 -m pytest examples/torch_training -q

Checks: losses finite and falling; rdep and the baseline start from the same weights (first-step losses
agree: exactly up to fp32 rounding against the torch reference MoE, within bf16 rounding against
TorchTitan's MoE, whose experts run in bf16 even on the CPU); rdep driving 2 ranks in one process gives the
single-rank losses; the JSON receipt has its fields; --moe torchtitan says what it ran when torchtitan does
not import.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import train  # noqa: E402
from moe_variants import REFERENCE_LABEL, torchtitan_status  # noqa: E402

TINY = ["--device", "cpu", "--hidden", "32", "--heads", "2", "--layers", "2", "--dense-layers", "1",
        "--dense-ffn", "64", "--moe-ffn", "16", "--experts", "8", "--topk", "2", "--seq-len", "32",
        "--batch", "4", "--steps", "6", "--lr", "3e-3", "--warmup", "1", "--eval-batches", "1",
        "--print-every", "100"]

VARIANT_FIELDS = {"kind", "label", "loss", "tokens_per_s", "step_ms", "peak_mem_mib", "val_loss",
                  "tokens_per_s_median", "peak_mem_mib_max", "peak_whole_mib", "peak_whole_mib_max"}


def _rdep_available() -> bool:
    try:
        import rdep  # noqa: F401
        import rdep.torch  # noqa: F401

        rdep.library_info()
        return True
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _rdep_available(), reason="rdep (python/ and librdep_capi.so) not importable; "
                                "set PYTHONPATH=python and RDEP_LIBRARY")


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """rdep then the torch reference MoE, one process, same seed."""
    out = tmp_path_factory.mktemp("receipt") / "receipt.json"
    receipt = train.main(TINY + ["--moe", "both", "--baseline", "reference", "--json", str(out),
                                 "--png", str(out.with_suffix(".png"))])
    return receipt, out


def test_rdep_and_reference_train_from_the_same_weights(both):
    receipt, _ = both
    rdep_run, ref_run = receipt["variants"]
    assert rdep_run["label"] == "rdep" and ref_run["label"] == REFERENCE_LABEL
    for run in (rdep_run, ref_run):
        assert len(run["loss"]) == 6 and all(math.isfinite(x) for x in run["loss"]), run["loss"]
        assert run["loss"][-1] < run["loss"][0], f"{run['label']}: loss did not fall: {run['loss']}"
        assert run["loss"][0] == pytest.approx(math.log(256), abs=0.1)  # an untrained byte model
    # Same data, seed and weights, both fp32 on the CPU: the curves agree to fp32 rounding.
    for a, b in zip(rdep_run["loss"], ref_run["loss"]):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-4)
    assert receipt["comparison"]["first_loss_abs_diff"] < 1e-4


def test_receipt_fields(both):
    receipt, path = both
    on_disk = json.loads(path.read_text())
    for key in ("config", "torch", "device", "corpus", "torchtitan", "variants", "comparison"):
        assert key in on_disk, key
    assert on_disk["config"]["model"]["experts"] == 8 and on_disk["config"]["model"]["topk"] == 2
    assert on_disk["corpus"]["bytes"] > 100_000 and len(on_disk["corpus"]["sha256"]) == 64
    for run in on_disk["variants"]:
        assert VARIANT_FIELDS <= set(run), VARIANT_FIELDS - set(run)
        assert run["peak_mem_mib"] == [None] * 6 and run["peak_whole_mib"] == [None] * 6  # CPU: n/a
        assert run["peak_whole_mib_max"] is None
        assert all(t > 0 for t in run["tokens_per_s"])
    cmp = on_disk["comparison"]
    assert cmp["peak_ratio"] is None and cmp["torch_peak_ratio"] is None  # CPU: no device memory to compare
    ag = cmp["agreement"]
    assert ag["agree"] is True and ag["window"] == [3, 6], ag
    # The plot is written, or the receipt says why not (matplotlib missing).
    assert Path(on_disk["png"]).exists() or "matplotlib is not installed" in on_disk["png"]


def test_receipts_of_separate_runs_compare_as_one_process_compares(both, tmp_path, capsys):
    """compare_receipts.py on the two variants written as receipts of one variant each gives the comparison the
    process made; a receipt of two variants, or runs of another model or seed, are refused naming what differs."""
    import compare_receipts

    receipt, path = both
    paths = []
    for i, run in enumerate(receipt["variants"]):
        one = dict(json.loads(path.read_text()), variants=[run])
        one.pop("comparison")
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(one))
    got = compare_receipts.main([str(paths[0]), str(paths[1]), "--agree-from", "3", "--agree-to", "6"])
    assert json.loads(json.dumps(got)) == json.loads(json.dumps(receipt["comparison"]))
    assert "tokens/s, rdep / baseline" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="expected a receipt of one variant"):
        compare_receipts.main([str(path), str(paths[1])])
    other = json.loads(paths[1].read_text())
    del other["config"]["args"]["timing"]  # a receipt from before --timing: synced
    paths[1].write_text(json.dumps(other))
    compare_receipts.main([str(paths[0]), str(paths[1])])
    other["config"]["args"]["timing"] = "overlapped"
    paths[1].write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="config.args.timing differs"):
        compare_receipts.main([str(paths[0]), str(paths[1])])
    other["config"]["args"]["timing"] = "synced"
    # Compiled runs: a receipt from before the setting was recorded ran under torch's default, same_as_forward.
    first = json.loads(paths[0].read_text())
    first["config"]["args"]["compile"] = other["config"]["args"]["compile"] = True
    first["config"].pop("compiled_backward_autocast")
    paths[0].write_text(json.dumps(first))
    other["config"]["compiled_backward_autocast"] = "same_as_forward"
    paths[1].write_text(json.dumps(other))
    compare_receipts.main([str(paths[0]), str(paths[1])])
    other["config"]["compiled_backward_autocast"] = "off"
    paths[1].write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="config.compiled_backward_autocast differs: same_as_forward in .* off in"):
        compare_receipts.main([str(paths[0]), str(paths[1])])
    other["config"]["compiled_backward_autocast"] = "same_as_forward"
    other["config"]["args"]["seed"] += 1
    paths[1].write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="config.args.seed differs"):
        compare_receipts.main([str(paths[0]), str(paths[1])])


def test_profiled_steps_are_named_ranges_in_the_trace(tmp_path):
    """--profile-steps with --profile-trace: each profiled step is a "train step N" range in the Chrome trace, which
    bench/trace_kernels.py splits a trace's kernels by (its own tests: python/tests/test_trace_kernels.py)."""
    prefix = tmp_path / "trace"
    train.main(TINY + ["--moe", "rdep", "--profile-steps", "2", "--profile-at", "2", "--profile-trace", str(prefix)])
    events = json.loads(Path(f"{prefix}.rdep.r0.json").read_text())["traceEvents"]
    names = sorted(e["name"] for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("train step"))
    assert names == ["train step 2", "train step 3"], names


def test_rdep_two_ranks_in_one_process_match_one_rank(both):
    receipt, _ = both
    two = train.main(TINY + ["--moe", "rdep", "--ranks-per-process", "2"])
    assert two["variants"][0]["rdep_layer"].startswith("W=2 "), two["variants"][0]["rdep_layer"]
    for a, b in zip(two["variants"][0]["loss"], receipt["variants"][0]["loss"]):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-4)


def test_torchtitan_choice_is_labeled_honestly():
    receipt = train.main(TINY + ["--moe", "torchtitan", "--steps", "2"])
    run = receipt["variants"][0]
    ok, _ = torchtitan_status()
    if ok:
        assert run["kind"] == "torchtitan" and run["label"].startswith("TorchTitan MoE")
        # TorchTitan's experts run in bf16 even on the CPU: the first loss agrees within bf16 rounding.
        ref = train.main(TINY + ["--moe", "reference", "--steps", "1"])
        assert run["loss"][0] == pytest.approx(ref["variants"][0]["loss"][0], abs=1e-2)
    else:
        assert run["kind"] == "reference" and run["label"] == REFERENCE_LABEL
        assert "torchtitan does not import" in run["note"]
    assert all(math.isfinite(x) for x in run["loss"])


def test_compiled_rdep_model_trains_like_the_eager_one(both):
    """--compile: torch.compile traces the model through rdep's custom ops (fake implementations) and the
    compiled steps give the eager losses (the same ops; inductor may reorder fp32 sums, so a tolerance)."""
    receipt, _ = both
    compiled = train.main(TINY + ["--moe", "rdep", "--steps", "3", "--compile"])
    assert compiled["config"]["args"]["compile"] is True
    # the compiled backward runs without autocast, as the eager one (train.set_compiled_backward_autocast)
    assert compiled["config"]["compiled_backward_autocast"] == "off"
    assert receipt["config"]["compiled_backward_autocast"] is None
    # AOTAutograd's cache may keep the graph holding rdep's router function (train.set_autograd_cache_functions)
    forced = os.environ.get("TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD")  # the environment wins over the flag
    want = "off" if forced == "0" else "on"
    assert compiled["config"]["autograd_cache_functions"] in (want, "not settable in this torch")
    assert receipt["config"]["autograd_cache_functions"] is None
    for a, b in zip(compiled["variants"][0]["loss"], receipt["variants"][0]["loss"][:3]):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-3)


def test_interleaved_runs_train_like_the_sequential_ones(both):
    """--interleave: both models built first and stepped in turn give the sequential losses (each model
    its own state; the order of the steps between models does not change either's math)."""
    receipt, _ = both
    inter = train.main(TINY + ["--moe", "both", "--baseline", "reference", "--interleave"])
    assert [r["kind"] for r in inter["variants"]] == ["rdep", "reference"]
    for run, seq in zip(inter["variants"], receipt["variants"]):
        assert len(run["loss"]) == 6
        for a, b in zip(run["loss"], seq["loss"]):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
        assert run["peak_whole_mib_max"] is None and "interleaved" in run["memory_note"]
    assert inter["comparison"]["speedup"] > 0


@pytest.mark.parametrize("args, why", [
    (["--moe", "rdep", "--interleave"], "--interleave: needs --moe both"),
    (["--moe", "both", "--interleave", "--profile-steps", "2"], "profilers would overlap"),
    (["--moe", "both", "--interleave", "--timing", "overlapped"], "--interleave with --timing overlapped"),
    (["--moe", "both", "--memory-step", "3"], "--memory-step: needs --device cuda"),
    (["--moe", "both", "--memory-snapshot", "/tmp/x"], "--memory-snapshot: needs --memory-step"),
    (["--moe", "both", "--profile-trace", "/tmp/t"], "--profile-trace: needs --profile-steps"),
    (["--moe", "rdep", "--expert-weights", "bf16-master"], "--expert-weights bf16-master: needs --device cuda"),
    (["--moe", "both", "--baseline-expert-weights", "bf16-master"], "--baseline-expert-weights bf16-master: needs"),
])
def test_option_combinations_that_would_measure_nothing_are_refused(args, why, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(TINY + args)
    assert why in capsys.readouterr().err


@pytest.mark.parametrize("choice, want", [
    ([], [False, True]), (["--keep-weight-casts"], [True, True]), (["--keep-weight-casts", "all"], [True, True]),
    (["--keep-weight-casts", "after-first"], [False, True]), (["--keep-weight-casts", "none"], [False, False]),
])
def test_keep_weight_casts_choice_reaches_each_moe_layer(choice, want):
    """--keep-weight-casts [none|all|after-first]: which MoE layers keep their forward's casts (after-first:
    every one but the first MoE block, whose backward runs last, at the step's memory peak)."""
    a = train.parse_args(TINY + ["--moe", "rdep", "--layers", "3"] + choice)
    model = train.build_model("rdep", train.model_config(a), a, train.Dist("cpu"))
    assert [m.moe.layer.keep_weight_casts for m in model.moe_layers()] == want


@pytest.mark.parametrize("flag, want", [([], False), (["--owner-reduce"], True)])
def test_owner_reduce_flag_reaches_each_moe_layer(flag, want):
    """--owner-reduce: every MoE layer's owner sums a token's rows before they return (off by default)."""
    a = train.parse_args(TINY + ["--moe", "rdep", "--layers", "3"] + flag)
    model = train.build_model("rdep", train.model_config(a), a, train.Dist("cpu"))
    assert [m.moe.layer.owner_reduce for m in model.moe_layers()] == [want, want]


def test_expert_master_weights_split_the_parameters_between_two_optimizers():
    """--expert-weights bf16-master: rdep.torch.MasterAdamW takes the routed experts (made bf16, their fp32 values
    its masters), torch's AdamW the rest; each parameter in exactly one, the clip's coefficient reaching the experts
    through the step. Built on the CPU model (the optimizers only: the host backend itself computes in fp32)."""
    import torch

    from variant_run import MasterExpertOptimizer, expert_and_dense, make_optimizer

    a = train.parse_args(TINY + ["--moe", "rdep", "--layers", "3"])
    model = train.build_model("rdep", train.model_config(a), a, train.Dist("cpu"))
    experts, dense = expert_and_dense(model)
    before = [p.detach().clone() for p in experts]
    a.expert_weights = "bf16-master"
    opt = make_optimizer(model, a, torch.device("cpu"), "rdep")
    assert isinstance(opt, MasterExpertOptimizer)
    assert all(p.dtype == torch.bfloat16 for p in experts) and all(p.dtype == torch.float32 for p in dense)
    grouped = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters()), "each parameter in exactly one group"
    for p, b in zip(experts, before):
        assert torch.equal(opt.experts.state[p]["master"], b)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step(grad_multiplier=torch.tensor(0.5))
    for p, b in zip(experts, before):  # AdamW's first step moves each weight by ~lr (sign of the gradient)
        assert torch.allclose(opt.experts.state[p]["master"], b * (1 - a.lr * a.weight_decay) - a.lr, rtol=0, atol=1e-6)
    assert make_optimizer(model, a, torch.device("cpu"), "reference").__class__ is torch.optim.AdamW
    a.baseline_expert_weights = "bf16-master"  # the baseline's experts given the same treatment (its own model)
    ref = train.build_model("reference", train.model_config(a), a, train.Dist("cpu"))
    assert isinstance(make_optimizer(ref, a, torch.device("cpu"), "reference"), MasterExpertOptimizer)
    assert all(p.dtype == torch.bfloat16 for p in expert_and_dense(ref)[0])


def test_clip_folded_into_the_expert_optimizer():
    """clip_gradients(scale_experts=False, expert_factor=f): the norm counts the experts' gradients times f (1/W not
    yet applied), only the dense gradients are scaled, and the experts' multiplier is the clip's coefficient times f."""
    from types import SimpleNamespace

    import torch

    from variant_run import clip_gradients

    e = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2, 2))]
    d = [torch.nn.Parameter(torch.zeros(3))]
    for p in e:
        p.grad = torch.full_like(p, 2.0)
    d[0].grad = torch.full((3,), 1.0)
    dd = SimpleNamespace(group=None, device=torch.device("cpu"))
    norm, mult = clip_gradients(e, d, 1.0, dd, scale_experts=False, expert_factor=0.5)
    want = math.sqrt(3 * 1.0 + 8 * (2.0 * 0.5) ** 2)
    assert norm.item() == pytest.approx(want, rel=1e-6)
    clip = 1.0 / (want + 1e-6)
    assert mult.item() == pytest.approx(clip * 0.5, rel=1e-6)
    assert torch.equal(e[0].grad, torch.full((4,), 2.0)), "the experts' gradients are left to the optimizer"
    assert d[0].grad[0].item() == pytest.approx(clip, rel=1e-6)
    norm, mult = clip_gradients(e, d, 0.0, dd, scale_experts=False, expert_factor=0.5)  # no clip: the factor alone
    assert mult.item() == 0.5
    assert clip_gradients(e, d, 0.0, dd)[1] is None


@pytest.mark.parametrize("args, want", [
    (["--device", "cpu"], "fp32"), (["--device", "cuda"], "bf16-master"),
    (["--device", "cuda", "--grad-accum", "2"], "bf16-master"), (["--device", "cuda", "--expert-weights", "fp32"], "fp32"),
])
def test_expert_weights_auto_is_bf16_master_where_it_runs(args, want):
    """--expert-weights auto (the default): bf16-master on CUDA (with --grad-accum too: MasterAdamW then sums the
    micro-batches' gradients in fp32), fp32 on the host backend (which computes in fp32)."""
    assert train.parse_args(TINY + ["--moe", "rdep"] + args).expert_weights == want


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("ranks, accum", [(1, 1), (2, 1), (1, 2)])
def test_expert_master_weights_train_like_fp32_experts_on_cuda(ranks, accum):
    """The same model from the same weights with fp32 experts (cast per call) and with bf16 experts under
    MasterAdamW: the first step's loss is the same (the same bf16 weights reach the GEMMs), later ones agree to
    the gradients' bf16 rounding, and both fall; also with 2 ranks sharing the GPU (each holding half the experts),
    and with two micro-batches a step (MasterAdamW summing the experts' gradients in fp32)."""
    cuda = [x if x != "cpu" else "cuda" for x in TINY] + ["--ranks-per-process", str(ranks), "--grad-accum", str(accum)]
    import torch
    import variant_run

    fp32 = train.main(cuda + ["--moe", "rdep", "--expert-weights", "fp32"])["variants"][0]
    made = []
    real = variant_run.make_optimizer

    def spy(*args, **kw):
        made.append(real(*args, **kw))
        return made[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(variant_run, "make_optimizer", spy)
        master = train.main(cuda + ["--moe", "rdep", "--expert-weights", "bf16-master"])["variants"][0]
    assert made and made[0].experts._fp32_grads == (accum > 1), "micro-batches summed in fp32 with --grad-accum"
    if accum > 1:
        assert all(p.main_grad.dtype == torch.float32 for p in made[0].experts.param_groups[0]["params"])
    assert "MasterAdamW" in master["label"] and "MasterAdamW" not in fp32["label"]
    assert master["loss"][0] == pytest.approx(fp32["loss"][0], rel=1e-6)
    for a, b in zip(master["loss"], fp32["loss"]):
        assert math.isfinite(a) and a == pytest.approx(b, rel=2e-2)
    assert master["loss"][-1] < master["loss"][0]


def test_grad_accum_steps_once_per_micro_batches(monkeypatch):
    """--grad-accum 2: a step is two micro-batches (batches 2s and 2s + 1), their mean loss recorded, twice the tokens,
    one optimizer step and one expert-bias update per MoE layer a step. With the weights and the expert bias held (lr 0,
    bias rate 0, no clip) every forward sees the initial model, so step s's loss is the mean of the single-micro-batch
    run's losses of batches 2s and 2s + 1, and the gradients the optimizer is given are the mean of those two runs'
    (to fp32 rounding; rdep and the torch reference alike for the losses); a refused value is named."""
    import torch

    import rdep.torch as rt

    grads, bias_updates = [], []
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    hook = register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: grads.append([p.grad.detach().clone() if p.grad is not None else None
                                                for grp in opt.param_groups for p in grp["params"]]))
    update = rt.MoE.update_expert_bias
    monkeypatch.setattr(rt.MoE, "update_expert_bias", lambda self, *a, **k: bias_updates.append(1) or update(self, *a, **k))
    held = ["--lr", "0", "--bias-rate", "0", "--clip", "0"]
    base = [a for a in TINY]
    try:
        base[base.index("--steps") + 1] = "4"
        single = train.main(base + held + ["--moe", "both", "--baseline", "reference"])
        single_grads = grads[:4]  # rdep's run first
        base[base.index("--steps") + 1] = "2"
        grads.clear()
        bias_updates.clear()
        accum = train.main(base + held + ["--moe", "both", "--baseline", "reference", "--grad-accum", "2"])
    finally:
        hook.remove()
    assert accum["config"]["tokens_per_step"] == 2 * single["config"]["tokens_per_step"]
    assert len(grads) == 4 and len(bias_updates) == 2  # 2 steps a model; rdep's one MoE layer updated once a step
    for one, two in zip(single["variants"], accum["variants"]):
        assert one["label"] == two["label"] and len(two["loss"]) == 2
        for s in range(2):
            want = (one["loss"][2 * s] + one["loss"][2 * s + 1]) / 2
            assert two["loss"][s] == pytest.approx(want, rel=1e-5, abs=1e-6), (two["label"], s)
    for s in range(2):
        for i, (got, g0, g1) in enumerate(zip(grads[s], single_grads[2 * s], single_grads[2 * s + 1])):
            if got is None:
                assert g0 is None and g1 is None
                continue
            torch.testing.assert_close(got, (g0 + g1) / 2, rtol=1e-5, atol=1e-7, msg=lambda m: f"step {s} param {i}: {m}")
    with pytest.raises(SystemExit):
        train.main(TINY + ["--grad-accum", "0"])


def test_overlapped_timing_trains_as_the_synced_run(both):
    """--timing overlapped: each step launched before the one before it is read back gives the synced run's
    losses (the same math: only when the host reads the figures back changes), a step time for every step, the
    host's launch time beside it, and the timing named in the receipt."""
    receipt, _ = both
    over = train.main(TINY + ["--moe", "both", "--baseline", "reference", "--timing", "overlapped"])
    for run, seq in zip(over["variants"], receipt["variants"]):
        assert run["timing"] == "overlapped" and seq["timing"] == "synced"
        assert run["loss"] == seq["loss"], run["label"]
        assert len(run["step_ms"]) == len(run["host_launch_ms"]) == 6 and all(t > 0 for t in run["step_ms"])
        assert run["max_load_ratio"][0] is not None and run["max_load_ratio"][0] >= 1.0
        assert "host_launch_ms" not in seq
    assert over["comparison"]["speedup"] > 0


def test_overlapped_figures_are_reduced_over_ranks_once():
    """Overlapped timing keeps each rank's step times and memory and reduces them at the end: the maximum, memory
    not measured (None) left as it is, tokens/s from the reduced step time; the loss, summed over the ranks on the
    device each step, is not reduced again."""
    from types import SimpleNamespace

    from variant_run import VariantRun

    class TwoRanks:  # the other rank's figures: step 20 ms, peaks 5 MiB
        group, world = object(), 2

        def reduce(self, values, op):
            assert op == "max", op
            other = [20.0, 20.0] + [5.0] * (len(values) - 2)
            return [b if a != a else max(a, b) for a, b in zip(values, other)]  # NaN (not measured) loses, as in NCCL's max

    def rec(mem):
        return {"loss": [1.0, 2.0], "step_ms": [10.0, 30.0], "peak_mem_mib": mem, "device_used_mib": mem,
                "peak_whole_mib": mem, "tokens_per_s": [0.0, 0.0]}

    measured = rec([7.0, 1.0])
    VariantRun._reduce_over_ranks(SimpleNamespace(dd=TwoRanks(), rec=measured, memory=True, tokens_global=1000))
    assert measured["loss"] == [1.0, 2.0] and measured["step_ms"] == [20.0, 30.0]
    assert measured["tokens_per_s"] == pytest.approx([50000.0, 1000 / 0.030])
    assert measured["peak_mem_mib"] == measured["device_used_mib"] == measured["peak_whole_mib"] == [7.0, 5.0]
    unmeasured = rec([None, None])
    VariantRun._reduce_over_ranks(SimpleNamespace(dd=TwoRanks(), rec=unmeasured, memory=False, tokens_global=1000))
    assert unmeasured["step_ms"] == [20.0, 30.0] and unmeasured["peak_mem_mib"] == [None, None]
    assert unmeasured["peak_whole_mib"] == [None, None]


def test_overlapped_timing_under_torchrun_matches_synced(tmp_path):
    """Two processes under torchrun (gloo, the torch reference MoE): overlapped timing's loss, summed over the ranks
    on the device each step, and its step times, reduced at the end, give the synced run's losses and a time for
    every step."""
    import os
    import subprocess

    args = [a for a in TINY]
    args[args.index("--steps") + 1] = "3"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parents[1] / "python"), os.environ.get("PYTHONPATH", "")]))
    runs = {}
    for timing in ("synced", "overlapped"):
        out = tmp_path / f"{timing}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(HERE / "train.py"),
               *args, "--moe", "reference", "--timing", timing, "--json", str(out)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        runs[timing] = json.loads(out.read_text())
    synced, over = (runs[t]["variants"][0] for t in ("synced", "overlapped"))
    assert runs["overlapped"]["config"]["world_size"] == 2
    assert over["loss"] == synced["loss"] and len(over["step_ms"]) == 3 and all(t > 0 for t in over["step_ms"])
