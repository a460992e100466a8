#!/usr/bin/env python3
"""Baseline for `rdep bench gemm`: the owner's SwiGLU expert MLP forward through torch._grouped_mm, the
way TorchTitan's EP layer calls it (../shared/baselines/torch_ep_moe.py): w1 [El,H,2F], w2 [El,F,H],
offs = int32 cumsum of the per-expert counts, h.chunk(2) -> silu(gate) * up.
Same workload as rdep bench gemm: M = mu*El rows drawn by a multinomial over the experts (uniform or
zipf:A) or, with --counts-from, exactly the per-expert counts an `rdep bench gemm --json` receipt used for
each mu; forward timed with CUDA events (p50/p99 over --iters after --warmup); with --backward also
forward+backward (autograd.grad of the output against a fixed dout, for x, w1 and w2: bf16 weight
gradients, where rdep writes fp32 ones); useful TFLOP/s count 6*M*H*F FLOPs forward, 3x that forward+
backward (real rows only). With --counts-from it also prints, and writes into its receipt, torch's p50 over each
rdep path's p50 at the same mu (forward and forward+backward, rdep's from that receipt; > 1: rdep faster): the
ratios issue 14's targets are stated in.
  python3 bench/torch_grouped_mm.py --experts 16 --hidden 2048 --ffn 1408 --mu 128,384,768,1536,3072
  python3 bench/torch_grouped_mm.py --counts-from gemm.json --backward --json torch.json
"""
import argparse
import json
import statistics
import time

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


def fmt(v, width, digits):
    return f"{v:>{width}.{digits}f}" if v is not None else f"{'-':>{width}}"


def speedups(rdep_rows, torch_rows):
    """torch's p50 over each rdep path's p50 at the same mu (forward; forward+backward where both timed it)."""
    by_mu = {r["mu"]: r for r in torch_rows}
    out = []
    for r in rdep_rows:
        t = by_mu.get(int(r["mu"]))
        fwd = (r.get("forward") or {}).get("p50_us")
        fb = (r.get("forward_backward") or {}).get("p50_us")
        tfb = t.get("forward_backward_p50_us") if t is not None else None
        if t is None or not (fwd or (fb and tfb)):
            continue
        out.append({"mu": int(r["mu"]), "path": r.get("path", "?"), "rdep_forward_p50_us": fwd,
                    "forward_speedup": t["p50_us"] / fwd if fwd else None,
                    "rdep_forward_backward_p50_us": fb,
                    "forward_backward_speedup": tfb / fb if fb and tfb else None})
    return out


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
    ap.add_argument("--counts-from", default="", help="an rdep bench gemm receipt: its shape, routing, mu list and counts")
    ap.add_argument("--backward", action="store_true", help="also time forward+backward")
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke test of this script: "
                    "wall-clock times, no memory figures)")
    a = ap.parse_args()
    given = {}  # mu -> counts, from an rdep receipt
    rdep_rows = []  # that receipt's results (mu, path, p50s), for the ratios
    if a.counts_from:
        with open(a.counts_from) as f:
            rec = json.load(f)
        wl = rec["workload"] if "workload" in rec else rec
        a.experts, a.hidden, a.ffn, a.routing = wl["experts_local"], wl["hidden"], wl["ffn"], wl["routing"]
        for r in rec["results"]:
            given.setdefault(int(r["mu"]), r["counts"])
            rdep_rows.append(r)
        a.mu = ",".join(str(m) for m in sorted(given))
    alpha = 0.0 if a.routing == "uniform" else float(a.routing.split(":", 1)[1])
    E, H, F = a.experts, a.hidden, a.ffn
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    torch.manual_seed(a.seed)
    w1 = (torch.rand(E, H, 2 * F, device=dev) * 2 - 1).mul_(H ** -0.5).to(torch.bfloat16).requires_grad_(a.backward)
    w2 = (torch.rand(E, F, H, device=dev) * 2 - 1).mul_(F ** -0.5).to(torch.bfloat16).requires_grad_(a.backward)

    def forward(x, offs):
        h = torch._grouped_mm(x, w1, offs=offs)
        g, u = h.chunk(2, -1)
        return torch._grouped_mm(F_.silu(g) * u, w2, offs=offs)

    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"torch._grouped_mm baseline: {gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"E_loc={E} H={H} F={F}, routing {a.routing}, {a.warmup} warmup + {a.iters} iters")
    def timed(fn, iters):
        if not cuda:
            out = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e6)
            return out
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for s, e in ev:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1000.0 for s, e in ev]

    print(f"{'mu':>6}{'M':>8}{'rho':>7}{'fwd p50':>11}{'fwd p99':>11}{'TFLOP/s':>10}{'f+b p50':>11}{'TFLOP/s':>10}{'peak MiB':>10}")
    rows_out = []
    for mu in [int(v) for v in a.mu.split(",")]:
        counts = torch.tensor(given[mu], dtype=torch.long) if given else counts_for(E, mu * E, alpha, a.seed + mu)
        M = int(counts.sum())
        rho = E * int(counts.max()) / M if M else 1.0
        offs = counts.cumsum(0).to(torch.int32).to(dev)
        x = (torch.rand(M, H, device=dev) * 2 - 1).to(torch.bfloat16).requires_grad_(a.backward)
        dout = (torch.rand(M, H, device=dev) * 2 - 1).to(torch.bfloat16)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            for _ in range(a.warmup):
                forward(x, offs)
            us = timed(lambda: forward(x, offs), a.iters)
        p50, p99 = statistics.median(us), pct(us, 99)
        tf = 6.0 * M * H * F / (p50 * 1e-6) / 1e12 if M else 0.0
        row = {"mu": mu, "rows": M, "rho": rho, "counts": counts.tolist(), "p50_us": p50, "p99_us": p99,
               "tflops_forward": tf, "times_us": us}
        fb50, tf_fb = float("nan"), float("nan")
        if a.backward:
            def fwd_bwd():
                torch.autograd.grad(forward(x, offs), (x, w1, w2), dout)
            for _ in range(a.warmup):
                fwd_bwd()
            fb = timed(fwd_bwd, a.iters)
            fb50 = statistics.median(fb)
            tf_fb = 18.0 * M * H * F / (fb50 * 1e-6) / 1e12 if M else 0.0
            row.update({"forward_backward_p50_us": fb50, "forward_backward_p99_us": pct(fb, 99),
                        "tflops_forward_backward": tf_fb, "forward_backward_times_us": fb})
        peak_bytes = torch.cuda.max_memory_allocated() if cuda else 0
        peak = peak_bytes / 2**20
        row["peak_allocated_bytes"] = peak_bytes
        print(f"{mu:>6}{M:>8}{rho:>7.2f}{p50:>11.1f}{p99:>11.1f}{tf:>10.1f}{fb50:>11.1f}{tf_fb:>10.1f}{peak:>10.1f}")
        rows_out.append(row)
        del x, dout
    ratios = speedups(rdep_rows, rows_out)
    if ratios:
        print("torch p50 over rdep p50 (rdep from the --counts-from receipt; > 1: rdep faster)")
        print(f"{'mu':>6}  {'path':<34}{'rdep fwd':>10}{'fwd x':>8}{'rdep f+b':>10}{'f+b x':>8}")
        for q in ratios:
            print(f"{q['mu']:>6}  {q['path']:<34}{fmt(q['rdep_forward_p50_us'], 10, 1)}{fmt(q['forward_speedup'], 8, 2)}"
                  f"{fmt(q['rdep_forward_backward_p50_us'], 10, 1)}{fmt(q['forward_backward_speedup'], 8, 2)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"benchmark": "torch._grouped_mm expert MLP forward" + (" and forward+backward" if a.backward else ""),
                       "gpu": gpu, "counts_from": a.counts_from or None,
                       "torch": torch.__version__, "cuda": torch.version.cuda,
                       "workload": {"experts_local": E, "hidden": H, "ffn": F, "routing": a.routing,
                                    "warmup": a.warmup, "iters": a.iters, "seed": a.seed},
                       "normalization": "useful TFLOP/s = 6*M*H*F over the p50 forward time (18*M*H*F forward+backward), "
                                        "M = real rows",
                       "results": rows_out, "torch_p50_over_rdep_p50": ratios}, f, indent=1)
        print("wrote", a.json)


if __name__ == "__main__":
    main()
