"""What the PyTorch binding adds to the layer: rdep.torch.moe (custom op, autograd, validation, ctypes
call, stream joins) timed like `rdep bench layer --ranks 1` at the same shape, on one GPU.

Forward: y = moe(layer, x, experts, gates, w1, w2) with x, gates, w1, w2 requiring grad (a context is
saved, as in training; it is released when y is dropped). Forward+backward: the same, then
y.backward(dy). Each iteration is timed with CUDA events on the current stream (p50 / p99 over the
measured window after warmup). Weights bf16 (as the C++ benchmark's); the weight gradients come back
fp32 from the layer and autograd casts them to the parameters' dtype, which this timing includes.
Routing: each token's K experts drawn uniformly without replacement, gates a softmax over them (the
distribution of `rdep bench layer --routing uniform`, not the same draw).

    python3 bench/torch_layer_bench.py --expert-compute cutlass --json out.json
Compare with, in the same device call (bf16 weight gradients there too, the same work):
    build-dev/bin/rdep bench layer --ranks 1 --expert-compute cutlass --grads bf16 --json layer.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def percentile(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(round(q / 100.0 * (len(s) - 1))))]


def make_inputs(a, device):
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    T, H, F, E, K = a.tokens, a.hidden, a.ffn, a.experts, a.topk
    experts = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
    gates = torch.softmax(torch.randn(T, K, generator=g), dim=1)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E, H, 2 * F, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, F, H, generator=g) / F ** 0.5).to(torch.bfloat16)
    dy = torch.randn(T, H, generator=g).to(torch.bfloat16)
    out = [t.to(device).unsqueeze(0) if t.dim() == 2 else t.to(device) for t in (x, experts, gates, w1, w2, dy)]
    x, experts, gates, w1, w2, dy = out
    for t in (x, gates, w1, w2):
        t.requires_grad_(True)
    return x, experts, gates, w1, w2, dy


def time_loop(fn, warmup: int, iters: int) -> tuple[list[float], list[float]]:
    """GPU time per call (events on the current stream around each call) and host time per call (the
    Python call's wall time, which includes any host wait of the layer: with cuBLASLt one per forward for
    the per-expert counts). As `rdep bench layer` does, the loop synchronizes only at its end, so a layer
    that does not wait on the host lets the host run ahead and the events time the GPU's work."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events, host = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in events], host


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--expert-compute", default="auto", choices=["auto", "cublaslt", "cutlass"],
                   help="the layer's expert compute (cutlass: no host wait, as rdep bench layer --expert-compute cutlass)")
    p.add_argument("--gate-in-expert", action="store_true",
                   help="the gate before W2 (as rdep bench layer --gate-in-expert); off otherwise, as the C++ bench's default")
    p.add_argument("--profile", type=int, default=0,
                   help="after the timing: N forward+backward iterations under torch.profiler (CPU and CUDA), the host "
                        "time by operation and CUDA runtime call (self CPU time)")
    p.add_argument("--json", default="")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("torch_layer_bench: no CUDA device", file=sys.stderr)
        return 2
    import rdep.torch as rt

    device = torch.device("cuda", torch.cuda.current_device())
    layer = rt.Layer(a.hidden, a.ffn, a.experts, a.topk, a.tokens, world_size=1, backend="cuda", device=device,
                     expert_compute=a.expert_compute, gate_in_expert=a.gate_in_expert)
    x, experts, gates, w1, w2, dy = make_inputs(a, device)

    def forward():
        y = rt.moe(layer, x, experts, gates, w1, w2)
        del y

    def forward_backward():
        y = rt.moe(layer, x, experts, gates, w1, w2)
        y.backward(dy)
        x.grad = gates.grad = w1.grad = w2.grad = None

    fwd, fwd_host = time_loop(forward, a.warmup, a.iters)
    fb, fb_host = time_loop(forward_backward, a.warmup, a.iters)
    if a.profile > 0:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(a.profile):
                forward_backward()
            torch.cuda.synchronize()
        print(f"torch.profiler over {a.profile} forward+backward calls (self CPU time: host work by operation):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    torch.cuda.reset_peak_memory_stats(device)
    forward_backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    rows = {"forward": fwd, "forward+backward": fb}
    print(f"torch_layer_bench: W=1 T={a.tokens} H={a.hidden} D_ff={a.ffn} E={a.experts} K={a.topk}, bf16, "
          f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    print(f"  layer: {layer.describe()}")
    host = {"forward": fwd_host, "forward+backward": fb_host}
    print(f"  {'':18s} {'p50 ms':>9s} {'p99 ms':>9s} {'host p50 ms':>12s}")
    for name, t in rows.items():
        print(f"  {name:18s} {statistics.median(t):9.3f} {percentile(t, 99):9.3f} {statistics.median(host[name]):12.3f}")
    print(f"  torch peak allocated (activations, grads; excludes the layer's own buffers): {peak:.3f} GiB")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bench": "torch_layer", "shape": vars(a), "device": torch.cuda.get_device_name(device),
                       "expert_compute": layer.expert_compute, "expert_compute_note": layer.expert_compute_note,
                       "torch": torch.__version__,
                       "p50_ms": {k: statistics.median(v) for k, v in rows.items()},
                       "p99_ms": {k: percentile(v, 99) for k, v in rows.items()},
                       "host_p50_ms": {k: statistics.median(v) for k, v in host.items()},
                       "torch_peak_allocated_gib": peak, "samples_ms": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
