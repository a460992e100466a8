#!/usr/bin/env python3
"""The expert weights' optimizer step alone: rdep.torch.MasterAdamW over bf16 parameters and gradients (fp32
master weights and moments) against torch.optim.AdamW(fused=True) over fp32 parameters and gradients, the same
tensor shapes, in the same process. Both move 28 bytes an element (read 14 + write 14 for MasterAdamW; read 16
+ write 12 for torch's), so the floor is 28 * N bytes over the memory's bandwidth. Also times what the fp32
setting does around its step and bf16 weights do not need: the bf16 casts of the weights a forward makes (one
per weight; a backward that does not keep them makes a second), and the clip's pass over the gradients, which
MasterAdamW folds into its step (grad_multiplier). With fp32_grads=True (gradient accumulation in fp32) the step
reads an fp32 gradient (30 bytes an element: 16 read, 14 written) and each micro-batch's backward adds its bf16
gradient into the fp32 buffer (the hook: rdep_grad_accumulate, 10 bytes an element, 6 for the first micro-batch, a
copy): both are timed too, and the same add through torch's main_grad.add_(grad) between two timings of the hook's.

Default shapes: the training example's three MoE blocks (64 experts, hidden 1024, ffn 704: w1 [64, 1024, 1408],
w2 [64, 704, 1024] each). CUDA events, p50/p99 over --iters after --warmup.
  python3 bench/optim_step.py --json optim.json
"""
import argparse
import json
import statistics

import torch

import rdep.torch as rt


def pct(xs, q):
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def timed(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    ms = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return {"p50_ms": statistics.median(ms), "p99_ms": pct(ms, 99)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    shapes = [s for _ in range(a.layers) for s in ((a.experts, a.hidden, 2 * a.ffn), (a.experts, a.ffn, a.hidden))]
    n = sum(torch.Size(s).numel() for s in shapes)
    g = torch.Generator(device=dev).manual_seed(0)
    f32 = [torch.nn.Parameter(torch.randn(s, device=dev, generator=g) * 0.02) for s in shapes]
    for p in f32:
        p.grad = torch.randn(p.shape, device=dev, generator=g) * 1e-3
    b16 = [torch.nn.Parameter(p.detach().clone()) for p in f32]
    torch_opt = torch.optim.AdamW(f32, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    mine = rt.MasterAdamW(b16, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)  # adopts: bf16 parameters
    for p, q in zip(b16, f32):
        p.grad = q.grad.to(torch.bfloat16)
    scale = torch.tensor(0.5, device=dev)
    res = {"numel": n, "tensors": len(shapes), "shapes": [list(s) for s in shapes], "device": torch.cuda.get_device_name(),
           "bytes_per_element": 28}
    res["torch_fused_adamw_fp32"] = timed(torch_opt.step, a.warmup, a.iters)
    res["master_adamw_bf16"] = timed(mine.step, a.warmup, a.iters)
    res["master_adamw_bf16_with_multiplier"] = timed(lambda: mine.step(grad_multiplier=scale), a.warmup, a.iters)
    res["casts_fp32_to_bf16"] = timed(lambda: [p.detach().to(torch.bfloat16) for p in f32], a.warmup, a.iters)
    res["clip_mul_fp32_grads"] = timed(lambda: torch._foreach_mul_([p.grad for p in f32], scale), a.warmup, a.iters)
    res["clip_mul_bf16_grads"] = timed(lambda: torch._foreach_mul_([p.grad for p in b16], scale), a.warmup, a.iters)
    b32 = [torch.nn.Parameter(p.detach().clone()) for p in f32]
    mine32 = rt.MasterAdamW(b32, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fp32_grads=True)
    grads16 = [q.grad.to(torch.bfloat16) for q in f32]
    for p, g16 in zip(b32, grads16):
        p.grad = g16.clone()
    mine32.step()  # moves the assigned gradients into main_grad (as the hook would), then steps

    def accumulate():  # what the hook does with each micro-batch's gradient after the first
        for p, g16 in zip(b32, grads16):
            p.grad = g16
            mine32._accumulate(p)

    def torch_add():  # the same move as torch's mixed-dtype add_ (the hook's way until the thirty-fifth session)
        for p, g16 in zip(b32, grads16):
            p.main_grad.add_(g16)

    res["master_adamw_fp32_grads"] = timed(mine32.step, a.warmup, a.iters)
    res["fp32_grads_accumulate_micro_batch"] = timed(accumulate, a.warmup, a.iters)
    res["torch_add_micro_batch"] = timed(torch_add, a.warmup, a.iters)
    res["fp32_grads_accumulate_micro_batch_again"] = timed(accumulate, a.warmup, a.iters)  # A, B, A
    for k in ("torch_fused_adamw_fp32", "master_adamw_bf16", "master_adamw_bf16_with_multiplier"):
        res[k]["GB_per_s"] = 28 * n / (res[k]["p50_ms"] * 1e-3) / 1e9
    res["master_adamw_fp32_grads"]["GB_per_s"] = 30 * n / (res["master_adamw_fp32_grads"]["p50_ms"] * 1e-3) / 1e9
    for k in ("fp32_grads_accumulate_micro_batch", "torch_add_micro_batch", "fp32_grads_accumulate_micro_batch_again"):
        res[k]["GB_per_s"] = 10 * n / (res[k]["p50_ms"] * 1e-3) / 1e9
    res["casts_fp32_to_bf16"]["GB_per_s"] = 6 * n / (res["casts_fp32_to_bf16"]["p50_ms"] * 1e-3) / 1e9
    for k, b in (("clip_mul_fp32_grads", 8), ("clip_mul_bf16_grads", 4)):
        res[k]["GB_per_s"] = b * n / (res[k]["p50_ms"] * 1e-3) / 1e9
    print(f"{n / 1e6:.1f}M elements in {len(shapes)} tensors on {res['device']}")
    for k, v in res.items():
        if isinstance(v, dict):
            print(f"  {k:36s} p50 {v['p50_ms']:.3f} ms  p99 {v['p99_ms']:.3f} ms  {v['GB_per_s']:.0f} GB/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
