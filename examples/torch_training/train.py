#!/usr/bin/env python3
"""End-to-end MoE training: a small Moonlight-architecture language model (model.py) trained on a real text
corpus with byte-level tokens, its MoE layers from rdep (rdep.torch.MoE) or from a baseline (TorchTitan's
MoE module when the `torchtitan` package imports, else a plain "torch reference MoE"; moe_variants.py).
With --moe both the two run one after the other in the same process from the same data, seed and initial
weights, and a side-by-side summary compares loss curves, tokens/s and peak memory. With --interleave the two
models are built first and trained step by step in turn (the order alternating), so that the tokens/s ratio
is measured under the same machine state (host load, clocks); memory is not measured then (both resident).

  # CPU, tiny (seconds); the library path as built by the repo's CMake build
  RDEP_LIBRARY=build/lib/librdep_capi.so PYTHONPATH=python python3 examples/torch_training/train.py \
      --device cpu --moe both --hidden 64 --heads 4 --layers 2 --dense-ffn 128 --moe-ffn 32 --experts 8 \
      --topk 2 --seq-len 64 --batch 8 --steps 30 --lr 3e-3 --json /tmp/receipt.json --png /tmp/loss.png
  # one GPU, defaults (hidden 1024, 4 layers = 1 dense + 3 MoE of 64 experts top-6 + 2 shared, 200 steps)
  python3 examples/torch_training/train.py --device cuda --moe both --json receipt.json --png loss.png
  # every local GPU: one process per GPU, experts sharded over the processes
  torchrun --nproc-per-node=$(nvidia-smi -L | wc -l) examples/torch_training/train.py --device cuda --moe both

Parallelism. Under torchrun (WORLD_SIZE set) torch.distributed starts from the environment (NCCL on CUDA,
gloo on the CPU); each process is one rank with its own batch; dense parameters are replicated and their
gradients averaged with one all-reduce per step; expert parameters are sharded (each rank holds E/W
experts, the same contiguous blocks in every variant) and never all-reduced: their gradients already
sum every rank's tokens through the MoE's combine backward, so they are scaled by 1/W to match the
averaged loss. Without torchrun there is one process; --ranks-per-process L > 1 makes rdep drive L ranks in
it (host backend threads on the CPU, ranks sharing the GPU on CUDA), each with 1/L of the batch's tokens
(the baselines compute the same math in one piece; dropless routing makes it the same model).

Loss agreement criterion (computed in the summary): over the steps [--agree-from, --agree-to) (default
100-200, the second half of the run when it is shorter), D = mean_t |L_rdep(t) - L_base(t)| and the loss's
own step-to-step noise sigma = std_t(L_base(t) - L_base(t-1)) / sqrt(2) (each step draws a new batch);
the curves agree when D <= sigma. Tokens/s is the median over the steps after --warmup-steps-timing;
peak memory is torch.cuda.max_memory_allocated (max over ranks) plus the device memory outside torch's
allocator (in use minus torch's reserved: the CUDA context, libraries' workspaces and rdep's own buffers and
pooled contexts) - the comparison's peak_ratio; torch_peak_ratio compares torch's allocator alone; the device
memory in use (total - free, PyTorch's cache included) is reported too.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model import ModelConfig, MoonlightLM  # noqa: E402
from moe_variants import (REFERENCE_LABEL, ReferenceMoE, RdepMoE, TitanMoE, canonical_moe,  # noqa: E402
                          torchtitan_status)
from variant_run import VariantRun  # noqa: E402



# --- arguments --------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    d = ModelConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--moe", choices=("rdep", "torchtitan", "reference", "both"), default="both",
                   help="which MoE: both = rdep then the baseline (--baseline)")
    p.add_argument("--baseline", choices=("auto", "torchtitan", "reference"), default="auto",
                   help="baseline for --moe both: auto = torchtitan if it imports, else the torch reference MoE")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--expert-compute", choices=("auto", "cublaslt", "cutlass"), default="auto",
                   help="rdep's expert compute on CUDA: cutlass reads the per-expert counts on the GPU, so the layer "
                        "never waits on the host and the step can run ahead; auto: cutlass where it runs (sm_90 GPUs), "
                        "else cublaslt")
    p.add_argument("--ranks-per-process", type=int, default=1,
                   help="rdep ranks driven by this process (without torchrun): host threads / ranks sharing a GPU")
    m = p.add_argument_group("model (Moonlight architecture, scaled down)")
    m.add_argument("--hidden", type=int, default=d.hidden)
    m.add_argument("--layers", type=int, default=d.layers)
    m.add_argument("--dense-layers", type=int, default=d.dense_layers)
    m.add_argument("--heads", type=int, default=d.heads)
    m.add_argument("--dense-ffn", type=int, default=d.dense_ffn)
    m.add_argument("--moe-ffn", type=int, default=d.moe_ffn)
    m.add_argument("--experts", type=int, default=d.experts)
    m.add_argument("--topk", type=int, default=d.topk)
    m.add_argument("--shared-experts", type=int, default=d.shared_experts)
    m.add_argument("--score", choices=("sigmoid", "softmax"), default=d.score)
    m.add_argument("--groups", type=int, default=d.groups)
    m.add_argument("--topk-groups", type=int, default=d.topk_groups)
    m.add_argument("--route-scale", type=float, default=d.route_scale)
    m.add_argument("--seq-len", type=int, default=d.seq_len)
    t = p.add_argument_group("training")
    t.add_argument("--batch", type=int, default=8, help="sequences per process per micro-batch (per step with --grad-accum 1)")
    t.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per step: each one's forward and backward (gradients summed, the loss scaled by "
                        "1/N), then the gradients' sync, the clip, the optimizer and the expert-bias update once per step, "
                        "as training with a large global batch runs them (default 1: every step one micro-batch)")
    t.add_argument("--steps", type=int, default=200)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup", type=int, default=20, help="linear LR warmup steps (then cosine to 10%%)")
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    t.add_argument("--bias-rate", type=float, default=1e-2,
                   help="aux-loss-free expert bias update rate (1e-2: at DeepSeek-V3's 1e-3 the routing of a "
                        "200-step run stays collapsed on one expert set, README.md)")
    t.add_argument("--seed", type=int, default=1)
    t.add_argument("--eval-batches", type=int, default=4, help="held-out batches for the final validation loss")
    o = p.add_argument_group("output")
    o.add_argument("--json", default="", help="write the receipt (JSON) here")
    o.add_argument("--png", default="", help="write the loss-curve plot here (needs matplotlib)")
    o.add_argument("--agree-from", type=int, default=100)
    o.add_argument("--agree-to", type=int, default=200)
    o.add_argument("--warmup-steps-timing", type=int, default=5, help="steps left out of the tokens/s median")
    o.add_argument("--print-every", type=int, default=1)
    o.add_argument("--compile", action="store_true",
                   help="torch.compile each variant's model (nn.Module.compile; TorchTitan trains compiled by default)")
    o.add_argument("--compile-mode", choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"), default="default",
                   help="torch.compile's mode (implies --compile). reduce-overhead: CUDA graphs, with inductor's graph "
                        "partitioning on; rdep's ops are recorded in the graphs where its layer is capturable "
                        "(rdep.torch.Layer.capturable: CUTLASS, one rank a process), else run between captured partitions")
    o.add_argument("--compiled-backward-autocast", choices=("off", "same_as_forward"), default="off",
                   help="compiled models: the autocast state their backward is traced under (torch._functorch.config."
                        "backward_pass_autocast). off (the default): none, as eager runs a backward; same_as_forward "
                        "(torch's default through 2.15): the forward caller's bf16 autocast, which ignores the MoE "
                        "block's autocast(enabled=False) and so runs the gradients of a model compiled whole through "
                        "its fp32 parts (shared experts, a plain router) in bf16")
    o.add_argument("--autograd-cache-functions", choices=("on", "off"), default="on",
                   help="compiled models: let AOTAutograd's cache keep graphs that hold a torch.autograd.Function "
                        "(torch._functorch.config.autograd_cache_allow_custom_autograd_functions, off in torch by "
                        "default). rdep's router is one (its backward turns autocast off), so with off a warm "
                        "compile of rdep's model misses the cache and traces again. Process-wide: it covers every "
                        "autograd.Function in either variant's compiled graphs (their traced forward and backward "
                        "are in the cache key; a Function reading other Python state would be cached wrongly). "
                        "Both variants alike; the graphs and the steps are the same either way")
    o.add_argument("--profile-steps", type=int, default=0,
                   help="profile this many steps (torch.profiler) from --profile-at; print the top ops by device time")
    o.add_argument("--profile-at", type=int, default=20)
    p.add_argument("--keep-weight-casts", nargs="?", choices=("none", "all", "after-first"), const="all",
                   default="after-first",
                   help="rdep: keep each forward's bf16 casts of the fp32 expert weights for its backward "
                        "(rdep.torch.MoE(keep_weight_casts=True)) instead of casting again there: in every MoE block "
                        "(all; the flag alone), in every one but the first (after-first: the first MoE block's "
                        "backward runs last, where every layer's gradients are live and the step's memory peaks, so "
                        "it alone casts again, into its gradients' bytes; the default), or in none")
    p.add_argument("--expert-weights", choices=("auto", "fp32", "bf16-master"), default="auto",
                   help="rdep: fp32 routed-expert weights as the baselines' (cast to bf16 per call, fp32 gradients, "
                        "torch's AdamW), or bf16-master: bf16 expert weights and gradients with fp32 master weights in "
                        "rdep.torch.MasterAdamW (one fused pass a tensor updates the master, the moments and the bf16 "
                        "weight; no casts, half the gradient bytes, the clip's coefficient applied in that pass; the same "
                        "bytes of memory per weight; with --grad-accum the micro-batches' gradients are summed in fp32, "
                        "MasterAdamW(fp32_grads=True): 4 bytes more a weight). auto (default): bf16-master on CUDA, "
                        "fp32 on the host backend. "
                        "The initial weights are the same fp32 values; the receipt's label says which ran")
    p.add_argument("--baseline-expert-weights", choices=("fp32", "bf16-master"), default="fp32",
                   help="the baseline's routed experts (TorchTitan's or the reference MoE): fp32 (default, as TorchTitan "
                        "trains them) or bf16-master, the same treatment as rdep's --expert-weights bf16-master "
                        "(bf16 weights and gradients, fp32 masters in rdep.torch.MasterAdamW): the A/B that leaves the "
                        "MoE implementations as the only difference")
    p.add_argument("--capturable-ops", choices=["on", "off"], default="on",
                   help="rdep: on (the binding's default) calls the ops a CUDA graph may record where the layer allows "
                        "(rdep.torch.MoE(capturable_ops=True)); off keeps the plain ops, which reduce-overhead runs "
                        "between its captured partitions (the A/B of the two)")
    p.add_argument("--gate-in-expert", choices=["auto", "on", "off"], default="auto",
                   help="rdep: the gate multiplied before W2 (rdep.torch.MoE(gate_in_expert=...)): auto (the binding's "
                        "default) is on where rdep's expert compute is cutlass on CUDA (--expert-compute auto picks it on sm_90), where it keeps no expert outputs for the "
                        "router's gradient; off weights the rows at the combine")
    p.add_argument("--owner-reduce", action="store_true",
                   help="rdep: each owner sums a token's rows before they go back (rdep.torch.MoE(owner_reduce=True)): "
                        "one row per (token, owner) returns instead of one per (token, slot)")
    o.add_argument("--timing", choices=("synced", "overlapped"), default="synced",
                   help="synced: each step timed between two device synchronizations (the host's time to launch a "
                        "step adds where the GPU waits for it); overlapped: as a training loop that does not wait for "
                        "the GPU each step, step s+1 launched before step s is read back and each step timed on the "
                        "GPU between the events that end it and the step before (variant_run.py's docstring)")
    o.add_argument("--interleave", action="store_true",
                   help="with --moe both: build both models, then train them step by step in turn (the tokens/s "
                        "ratio under the same machine state); memory is not measured then")
    o.add_argument("--memory-step", type=int, default=-1,
                   help="CUDA: at this step, print torch's peak memory in each phase (forward, backward, clip, "
                        "optimizer); the step waits for the GPU between phases and is left out of the timing")
    o.add_argument("--memory-snapshot", default="",
                   help="with --memory-step: record torch's allocations over that step and write the snapshot "
                        "(torch.cuda.memory._dump_snapshot) as PREFIX.<variant>.pickle")
    o.add_argument("--profile-trace", default="",
                   help="with --profile-steps: also write each variant's Chrome trace as PREFIX.<variant>.json")
    a = p.parse_args(argv)
    a.compile = a.compile or a.compile_mode != "default"
    refuse = [(a.compile_mode == "reduce-overhead" and a.device != "cuda", "--compile-mode reduce-overhead: CUDA graphs "
               "need --device cuda"),
              (a.interleave and a.moe != "both", "--interleave: needs --moe both (two models to interleave)"),
              (a.interleave and a.timing == "overlapped", "--interleave with --timing overlapped: each step of "
               "one model would be timed across the other's; interleave with --timing synced"),
              (a.interleave and a.profile_steps > 0, "--interleave with --profile-steps: the two variants' profilers "
               "would overlap; profile without --interleave"),
              (a.interleave and a.memory_step >= 0, "--interleave with --memory-step: memory is not measured when "
               "both models are resident; run without --interleave"),
              (a.memory_step >= 0 and a.device != "cuda", "--memory-step: needs --device cuda (torch's CUDA allocator)"),
              (bool(a.memory_snapshot) and a.memory_step < 0, "--memory-snapshot: needs --memory-step S (the step recorded)"),
              (bool(a.profile_trace) and a.profile_steps <= 0, "--profile-trace: needs --profile-steps N"),
              (a.grad_accum < 1, f"--grad-accum: expected an int >= 1, got {a.grad_accum}"),
              (a.expert_weights == "bf16-master" and a.device != "cuda", "--expert-weights bf16-master: needs --device "
               "cuda (the host backend computes in fp32)"),
              (a.baseline_expert_weights == "bf16-master" and a.device != "cuda", "--baseline-expert-weights "
               "bf16-master: needs --device cuda"),
]
    for bad, why in refuse:
        if bad:
            p.error(why)
    if a.expert_weights == "auto":
        a.expert_weights = "bf16-master" if a.device == "cuda" else "fp32"
    return a


def model_config(a) -> ModelConfig:
    return ModelConfig(hidden=a.hidden, layers=a.layers, dense_layers=a.dense_layers, heads=a.heads,
                       dense_ffn=a.dense_ffn, moe_ffn=a.moe_ffn, experts=a.experts, topk=a.topk,
                       shared_experts=a.shared_experts, score=a.score, groups=a.groups, topk_groups=a.topk_groups,
                       route_scale=a.route_scale, seq_len=a.seq_len)


# --- distributed ------------------------------------------------------------------------------------------

class Dist:
    """This process's place: rank, world size, device, the process group (None without torchrun)."""

    def __init__(self, device_kind: str):
        self.group = None
        self.rank, self.world = 0, 1
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            if device_kind == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            if not dist.is_initialized():
                dist.init_process_group("nccl" if device_kind == "cuda" else "gloo")
            self.group = dist.group.WORLD
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if device_kind == "cuda":
            if not torch.cuda.is_available():
                raise SystemExit("--device cuda: torch.cuda.is_available() is False (use --device cpu)")
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def print(self, *args, **kw) -> None:
        if self.main:
            print(*args, **kw, flush=True)

    def reduce(self, values: list[float], op: str = "sum") -> list[float]:
        if self.group is None:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# --- data -------------------------------------------------------------------------------------------------

class Corpus:
    """CPython's language reference and library topic texts (pydoc_data.topics: in every Python install,
    offline), the topics joined in sorted key order, as bytes: byte-level tokens, vocabulary 256. The last
    10% is held out for the validation loss. Batches are drawn from (seed, step) alone, so every variant
    sees the same batches; a process takes its rows [rank * B, (rank + 1) * B) of the global batch."""

    def __init__(self, seq_len: int):
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
        self.sha256 = hashlib.sha256(text).hexdigest()
        self.bytes = len(text)
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        n_val = max(len(data) // 10, 4 * (seq_len + 1))
        self.train, self.val = data[:-n_val], data[-n_val:]
        self.seq_len = seq_len
        if len(self.val) <= seq_len + 1:
            raise ValueError(f"--seq-len {seq_len} is too long for the corpus ({self.bytes} bytes)")

    def batch(self, split: str, step: int, seed: int, rank: int, world: int, batch: int, device):
        data = self.train if split == "train" else self.val
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 2 + (split != "train"))
        starts = torch.randint(0, len(data) - self.seq_len - 1, (world * batch,), generator=g)
        starts = starts[rank * batch:(rank + 1) * batch]
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        seqs = data[idx].long().to(device, non_blocking=True)
        return seqs[:, :-1], seqs[:, 1:]


# --- one variant ------------------------------------------------------------------------------------------

def resolve_kind(kind: str) -> tuple[str, str]:
    """(kind to build, note): 'torchtitan' falls back to 'reference' when torchtitan does not import."""
    if kind == "torchtitan":
        ok, why = torchtitan_status()
        if not ok:
            return "reference", f"torchtitan does not import ({why}); using the {REFERENCE_LABEL} instead"
    return kind, ""


def build_model(kind: str, cfg: ModelConfig, a, dd: Dist) -> MoonlightLM:
    tokens = a.batch * cfg.seq_len
    domain = []  # rdep: the first MoE layer's domain, shared by the others

    def make_moe(layer: int):
        if kind == "rdep":
            moe = RdepMoE(cfg, layer, device=dd.device, tokens=tokens, group=dd.group,
                          ranks=a.ranks_per_process, seed=a.seed,
                          expert_compute=a.expert_compute if dd.device.type == "cuda" else "auto",
                          domain=domain[0] if domain else None,
                          keep_weight_casts=a.keep_weight_casts == "all" or (a.keep_weight_casts == "after-first"
                                                                              and layer > cfg.dense_layers),
                          capturable_ops=a.capturable_ops == "on", owner_reduce=a.owner_reduce,
                          gate_in_expert={"auto": None, "on": True, "off": False}[a.gate_in_expert] if dd.device.type == "cuda" else None)
            domain[:] = [moe.moe.layer.domain]
            return moe
        if kind == "torchtitan":
            return TitanMoE(cfg, layer, group=dd.group, device=dd.device, bias_rate=a.bias_rate)
        return ReferenceMoE(cfg, layer, group=dd.group)

    model = MoonlightLM(cfg, make_moe)
    # Same initial weights in every variant: the dense parameters from (seed, name), each MoE layer's from
    # one canonical draw (moe_variants.canonical_moe) copied into the variant's own layout.
    model.init_dense(a.seed)
    for i, block in enumerate(model.blocks):
        if block.is_moe:
            block.moe.load_canonical(canonical_moe(cfg, i, block.moe.local_experts, a.seed))
    return model.to(dd.device)


def compiled_backward_autocast() -> str:
    """The setting in force (set_compiled_backward_autocast), for the receipt."""
    import torch._functorch.config as functorch_config

    return getattr(functorch_config, "backward_pass_autocast", "not settable in this torch")


def set_compiled_backward_autocast(mode: str) -> None:
    """The autocast state compiled backward passes are traced under (--compiled-backward-autocast). By default
    torch traces a compiled region's backward under the autocast state of its forward's caller
    (torch._functorch.config.backward_pass_autocast = "same_as_forward"), not under the autocast(enabled=False)
    regions its forward ran in. The MoE block runs outside autocast (model.py), so a model compiled whole
    takes its shared experts' (and a plain router's) gradients in bf16 there, while a model whose MoE breaks the
    graph takes them in fp32: the two variants would not train the same model. "off" runs every compiled
    backward as eager does (compiled_backward_autocast reads the setting in force)."""
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "backward_pass_autocast"):
        functorch_config.backward_pass_autocast = mode


def set_autograd_cache_functions(mode: str) -> None:
    """Whether AOTAutograd's cache keeps compiled graphs that hold a torch.autograd.Function
    (--autograd-cache-functions). torch bypasses the cache for such graphs by default, as a Function's backward
    may read Python state the cache key does not see; rdep's router function (rdep.torch.router) reads none, its
    traced forward and backward are part of the key. Only a warm compile's time changes."""
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "autograd_cache_allow_custom_autograd_functions"):
        functorch_config.autograd_cache_allow_custom_autograd_functions = mode == "on"


def autograd_cache_functions() -> str:
    """The setting in force (set_autograd_cache_functions), for the receipt."""
    import torch._functorch.config as functorch_config

    v = getattr(functorch_config, "autograd_cache_allow_custom_autograd_functions", None)
    return "not settable in this torch" if v is None else ("on" if v else "off")


def start_variant(kind: str, note: str, cfg: ModelConfig, corpus: Corpus, a, dd: Dist,
                  measure_memory: bool = True) -> VariantRun:
    torch.manual_seed(a.seed)
    if dd.device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dd.device)
    model = build_model(kind, cfg, a, dd)
    if a.compile:
        set_compiled_backward_autocast(a.compiled_backward_autocast)
        set_autograd_cache_functions(a.autograd_cache_functions)
        if a.compile_mode == "reduce-overhead":
            import torch._inductor.config as inductor_config

            if hasattr(inductor_config, "graph_partition"):  # capture around rdep's ops rather than skip their graphs
                inductor_config.graph_partition = True
        model.compile(mode=a.compile_mode)  # in place: the module and its MoE layers stay reachable as before
    tokens_global = a.batch * cfg.seq_len * dd.world * a.grad_accum
    v = VariantRun(kind, note, model, corpus, a, dd, tokens_global, measure_memory)
    dd.print(f"\n=== {v.describe()}, W={dd.world}, {tokens_global} tokens/step" + (f"\n    note: {note}" if note else ""))
    if kind == "rdep" and model.moe_layers():
        dd.print("    " + repr(model.moe_layers()[0].moe.layer))
    return v


def run_variant(kind: str, note: str, cfg: ModelConfig, corpus: Corpus, a, dd: Dist) -> dict:
    v = start_variant(kind, note, cfg, corpus, a, dd)
    for step in range(a.steps):
        if not v.step(step):
            break
    rec = v.finish()
    # The compiled model's state outlives the model otherwise: dynamo's caches and, under reduce-overhead, CUDA
    # graph trees, whose graphs hold their static inputs (the parameters) and share one memory pool with the
    # next variant's graphs, so the next variant's memory and time would be measured beside this one's leftovers.
    if a.compile:
        torch._dynamo.reset()
    return rec


def run_interleaved(kinds: list, cfg: ModelConfig, corpus: Corpus, a, dd: Dist) -> list:
    """--interleave: every variant built first, then step by step, in turn (the order alternating from one
    step to the next), so that the machine's state (clocks, host load) is the same for both. Memory is
    not measured (both models are resident)."""
    runs = [start_variant(*resolve_kind(kind), cfg, corpus, a, dd, measure_memory=False) for kind in kinds]
    for step in range(a.steps):
        for v in (runs if step % 2 == 0 else runs[::-1]):
            if v.alive:
                v.step(step)
    return [v.finish() for v in runs]


# --- comparison -------------------------------------------------------------------------------------------

def agreement(a_loss: list, b_loss: list, lo: int, hi: int) -> dict:
    """The criterion of the module docstring, on steps [lo, hi) (the second half when the run is shorter)."""
    n = min(len(a_loss), len(b_loss))
    if n < hi or lo >= hi:
        lo, hi = n // 2, n
    if hi - lo < 3:
        return {"window": [lo, hi], "agree": None, "why": "fewer than 3 steps in the window"}
    d = statistics.fmean(abs(a_loss[t] - b_loss[t]) for t in range(lo, hi))
    bias = statistics.fmean(a_loss[t] - b_loss[t] for t in range(lo, hi))
    steps = [b_loss[t] - b_loss[t - 1] for t in range(max(lo, 1), hi)]
    sigma = statistics.pstdev(steps) / math.sqrt(2) if len(steps) > 1 else float("nan")
    return {"window": [lo, hi], "mean_abs_diff": d, "mean_diff": bias, "noise_sigma": sigma,
            "ratio": d / sigma if sigma > 0 else float("inf"), "agree": bool(d <= sigma),
            "criterion": "mean_t |L_rdep - L_base| <= std_t(L_base(t) - L_base(t-1)) / sqrt(2)"}


def print_summary(recs: list, cmp: dict, dd: Dist, cuda: bool) -> None:
    a, b = recs
    w = max(26, len(a["label"]) + 2, len(b["label"]) + 2)

    def row(name, fa, fb, fmt):
        def f(v):
            return "n/a" if v is None else format(v, fmt)
        dd.print(f"{name:<34}{f(fa):>{w}}{f(fb):>{w}}")

    def tail_mean(r, k=10):
        xs = r["loss"][-k:]
        return statistics.fmean(xs) if xs else None

    dd.print("\n" + "=" * (34 + 2 * w))
    dd.print(f"{'summary (same data, seed, weights)':<34}{a['label']:>{w}}{b['label']:>{w}}")
    row("first-step loss", a["loss"][0] if a["loss"] else None, b["loss"][0] if b["loss"] else None, ".5f")
    row("mean loss, last 10 steps", tail_mean(a), tail_mean(b), ".4f")
    row("validation loss", a["val_loss"], b["val_loss"], ".4f")
    row("tokens/s (median)", a["tokens_per_s_median"], b["tokens_per_s_median"], ",.0f")
    row("step time ms (median)", a["step_ms_median"], b["step_ms_median"], ".1f")
    row("peak torch memory MiB (max rank)", a["peak_mem_mib_max"], b["peak_mem_mib_max"], ".1f")
    row("peak + memory outside torch MiB", a["peak_whole_mib_max"], b["peak_whole_mib_max"], ".1f")
    row("device memory in use MiB (max)", a["device_used_mib_max"], b["device_used_mib_max"], ".1f")
    dd.print("-" * (34 + 2 * w))
    if a["tokens_per_s_median"] and b["tokens_per_s_median"]:
        dd.print(f"tokens/s, rdep / baseline: {cmp['speedup']:.3f}x")
    if cuda and cmp.get("peak_ratio") is not None:
        dd.print(f"peak memory with what lies outside torch's allocator, rdep / baseline: {cmp['peak_ratio']:.3f} "
                 f"(torch's allocator alone: {cmp['torch_peak_ratio']:.3f})")
    dd.print(f"first-step loss |difference|: {cmp['first_loss_abs_diff']:.3g}")
    ag = cmp["agreement"]
    if ag.get("agree") is None:
        dd.print(f"loss agreement: not computed ({ag['why']})")
    else:
        dd.print(f"loss agreement over steps [{ag['window'][0]}, {ag['window'][1]}): mean |dL| = {ag['mean_abs_diff']:.4f}"
                 f", mean dL = {ag['mean_diff']:+.4f}, noise sigma = {ag['noise_sigma']:.4f}, ratio {ag['ratio']:.2f}"
                 f" -> {'AGREE' if ag['agree'] else 'DISAGREE'} (criterion: mean |dL| <= sigma)")


def compare(recs: list, a) -> dict:
    r, b = recs
    out = {"baseline": b["label"], "agreement": agreement(r["loss"], b["loss"], a.agree_from, a.agree_to),
           "first_loss_abs_diff": abs(r["loss"][0] - b["loss"][0]) if r["loss"] and b["loss"] else None,
           "speedup": (r["tokens_per_s_median"] / b["tokens_per_s_median"])
           if r["tokens_per_s_median"] and b["tokens_per_s_median"] else None,
           "peak_ratio": (r["peak_whole_mib_max"] / b["peak_whole_mib_max"])
           if r.get("peak_whole_mib_max") and b.get("peak_whole_mib_max") else None,
           "torch_peak_ratio": (r["peak_mem_mib_max"] / b["peak_mem_mib_max"])
           if r.get("peak_mem_mib_max") and b.get("peak_mem_mib_max") else None}
    return out


def plot(recs: list, path: str, dd: Dist, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        msg = "matplotlib is not installed: skipping the loss-curve plot (--png); pip install matplotlib"
        dd.print(msg)
        return msg
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in recs:
        ax1.plot(range(len(r["loss"])), r["loss"], label=r["label"], linewidth=1)
        ax2.plot(range(len(r["tokens_per_s"])), r["tokens_per_s"], label=r["label"], linewidth=1)
    ax1.set_xlabel("step"), ax1.set_ylabel("training loss (nats/byte)"), ax1.legend(), ax1.grid(alpha=0.3)
    ax2.set_xlabel("step"), ax2.set_ylabel("tokens/s"), ax2.legend(), ax2.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    dd.print(f"wrote {path}")
    return path


# --- main -------------------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    a = parse_args(argv)
    dd = Dist(a.device)
    cuda = dd.device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    cfg = model_config(a)
    if a.ranks_per_process > 1 and dd.group is not None:
        raise SystemExit("--ranks-per-process: under torchrun each process is one rank")
    if dd.group is not None and not cuda and a.moe in ("rdep", "both"):
        raise SystemExit("--moe rdep under torchrun needs --device cuda (one rank per GPU); on the CPU, run "
                         "without torchrun and use --ranks-per-process for several host-backend ranks")
    kinds = {"rdep": ["rdep"], "torchtitan": ["torchtitan"], "reference": ["reference"]}.get(a.moe)
    if kinds is None:
        base = "torchtitan" if a.baseline in ("auto", "torchtitan") else "reference"
        kinds = ["rdep", base]
    corpus = Corpus(cfg.seq_len)
    tt_ok, tt_info = torchtitan_status()
    dev_name = torch.cuda.get_device_name(dd.device) if cuda else (platform.processor() or platform.machine() or "cpu")
    dd.print(f"torch {torch.__version__} | device {dev_name} | W={dd.world} | ranks/process {a.ranks_per_process} | "
             f"corpus pydoc_data.topics {corpus.bytes} bytes (sha256 {corpus.sha256[:12]}) | "
             f"torchtitan: {tt_info if tt_ok else 'not importable (' + tt_info + ')'}")
    dd.print(f"model: {cfg}")

    if a.interleave and len(kinds) == 2:
        recs = run_interleaved(kinds, cfg, corpus, a, dd)
    else:
        recs = [run_variant(*resolve_kind(kind), cfg, corpus, a, dd) for kind in kinds]

    receipt = {
        "config": {"args": vars(a), "model": cfg.as_dict(), "world_size": dd.world,
                   "tokens_per_step": a.batch * cfg.seq_len * dd.world * a.grad_accum,
                   "compiled_backward_autocast": compiled_backward_autocast() if a.compile else None,
                   "autograd_cache_functions": autograd_cache_functions() if a.compile else None},
        "torch": torch.__version__, "python": platform.python_version(), "device": dev_name,
        "cuda": torch.version.cuda if cuda else None,
        "corpus": {"name": "pydoc_data.topics (CPython language reference / library topics)",
                   "bytes": corpus.bytes, "sha256": corpus.sha256, "tokens": "bytes (vocab 256)"},
        "torchtitan": {"importable": tt_ok, "info": tt_info},
        "variants": recs,
    }
    if len(recs) == 2:
        receipt["comparison"] = compare(recs, a)
        print_summary(recs, receipt["comparison"], dd, cuda)
    if dd.main and a.png:
        title = (f"{cfg.layers} layers H={cfg.hidden} E={cfg.experts} K={cfg.topk}, W={dd.world}, {dev_name}, "
                 f"torch {torch.__version__}")
        receipt["png"] = plot(recs, a.png, dd, title)
    if dd.main and a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(receipt, indent=1, default=str) + "\n")
        dd.print(f"wrote {a.json}")
    return receipt


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
