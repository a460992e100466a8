#!/usr/bin/env python3
"""Baseline for `rdep bench gemm`: the owner's SwiGLU expert MLP forward through torch._grouped_mm, the
way TorchTitan's EP layer calls it (../shared/baselines/torch_ep_moe.py): w1 [El,H,2F], w2 [El,F,H],
offs = int32 cumsum of the per-expert counts, h.chunk(2) -> silu(gate) * up.
Same workload as rdep bench gemm: M = mu*El rows drawn by a multinomial over the experts (uniform or
zipf:A), forward timed with CUDA events (p50/p99 over --iters after --warmup); useful TFLOP/s count
6*M*H*F FLOPs (real rows only).
  python3 bench/torch_grouped_mm.py --experts 16 --hidden 2048 --ffn 1408 --mu 128,384,768,1536,3072
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F_


def counts_for(E, rows, alpha, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.ones(E, dtype=torch.float64) if alpha <= 0 else torch.arange(1, E + 1, dtype=torch.float64) ** -alpha
    idx = torch.multinomial(p / p.sum(), rows, replacement=True, generator=g) if rows > 0 else torch.zeros(0, dtype=torch.long)
    return torch.bincount(idx, minlength=E)


def pct(xs, q):
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--mu", default="128,384,768,1536,3072")
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    alpha = 0.0 if a.routing == "uniform" else float(a.routing.split(":", 1)[1])
    E, H, F = a.experts, a.hidden, a.ffn
    dev = torch.device("cuda")
    torch.manual_seed(a.seed)
    w1 = (torch.rand(E, H, 2 * F, device=dev) * 2 - 1).mul_(H ** -0.5).to(torch.bfloat16)
    w2 = (torch.rand(E, F, H, device=dev) * 2 - 1).mul_(F ** -0.5).to(torch.bfloat16)

    def forward(x, offs):
        h = torch._grouped_mm(x, w1, offs=offs)
        g, u = h.chunk(2, -1)
        return torch._grouped_mm(F_.silu(g) * u, w2, offs=offs)

    print(f"torch._grouped_mm baseline: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"E_loc={E} H={H} F={F}, routing {a.routing}, {a.warmup} warmup + {a.iters} iters")
    print(f"{'mu':>6}{'M':>8}{'rho':>7}{'fwd p50':>11}{'fwd p99':>11}{'TFLOP/s':>10}{'peak MiB':>10}")
    rows_out = []
    for mu in [int(v) for v in a.mu.split(",")]:
        M = mu * E
        counts = counts_for(E, M, alpha, a.seed + mu)
        rho = E * int(counts.max()) / M if M else 1.0
        offs = counts.cumsum(0).to(torch.int32).to(dev)
        x = (torch.rand(M, H, device=dev) * 2 - 1).to(torch.bfloat16)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(a.warmup):
            forward(x, offs)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(a.iters)]
        for s, e in ev:
            s.record()
            forward(x, offs)
            e.record()
        torch.cuda.synchronize()
        us = [s.elapsed_time(e) * 1000.0 for s, e in ev]
        p50, p99 = statistics.median(us), pct(us, 99)
        tf = 6.0 * M * H * F / (p50 * 1e-6) / 1e12 if M else 0.0
        peak = torch.cuda.max_memory_allocated() / 2**20
        print(f"{mu:>6}{M:>8}{rho:>7.2f}{p50:>11.1f}{p99:>11.1f}{tf:>10.1f}{peak:>10.1f}")
        rows_out.append({"mu": mu, "rows": M, "rho": rho, "counts": counts.tolist(), "p50_us": p50, "p99_us": p99,
                         "tflops_forward": tf, "peak_allocated_bytes": torch.cuda.max_memory_allocated(), "times_us": us})
        del x
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"benchmark": "torch._grouped_mm expert MLP forward", "gpu": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "cuda": torch.version.cuda,
                       "workload": {"experts_local": E, "hidden": H, "ffn": F, "routing": a.routing,
                                    "warmup": a.warmup, "iters": a.iters, "seed": a.seed},
                       "normalization": "useful TFLOP/s = 6*M*H*F over the p50 forward time, M = real rows",
                       "results": rows_out}, f, indent=1)
        print("wrote", a.json)


if __name__ == "__main__":
    main()
