#!/usr/bin/env python3
"""The table of scripts/sweep_gemm.sh: for each (E_loc, routing, mu) of a directory of receipt pairs
gemm_E{E}_{routing}.json (rdep bench gemm) and torch_E{E}_{routing}.json (bench/torch_grouped_mm.py
--counts-from the former, so both time the same per-expert counts): padding ratio rho, useful TFLOP/s
forward and forward+backward of each and rdep / torch, and the dense ceiling of the rdep receipt.
  python3 bench/summarize_gemm_sweep.py DIR > table.md
"""
import glob
import json
import math
import os
import sys


def truncated(x: float) -> str:
    """x to three decimals, cut rather than rounded (1.1996 -> 1.199: a ratio under a target never prints at it)."""
    # + 1e-9: a quotient that is a thousandth exactly (102.1 / 100) can land a hair below it in floating point
    return f"{math.floor(x * 1000 + 1e-9) / 1000:.3f}" if math.isfinite(x) else "nan"


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "."
    paths = sorted(glob.glob(os.path.join(d, "gemm_E*.json")), key=lambda p: (-int(p.split("_E")[1].split("_")[0]), p))
    receipts = [(p, json.load(open(p))) for p in paths]
    said = {k: sorted({str(rd["workload"].get(k, "?")) for _, rd in receipts}) for k in ("weight_gradients", "warmup", "iters")}
    print(f"rdep weight gradients: {', '.join(said['weight_gradients'])}; warmup {', '.join(said['warmup'])}, "
          f"iterations {', '.join(said['iters'])}; ratio = rdep's useful TFLOP/s over torch's (torch's p50 over rdep's), cut to three decimals\n")
    print("| E_loc (W for E = 64) | routing | path | mu | rho | rdep fwd | torch fwd | ratio | rdep f+b | torch f+b | ratio | dense |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for path, rd in receipts:
        tpath = path.replace("gemm_E", "torch_E")
        tr = json.load(open(tpath)) if os.path.exists(tpath) else {"results": []}
        E = rd["workload"]["experts_local"]
        torch_by_mu = {r["mu"]: r for r in tr["results"]}
        dense = rd.get("dense_peak", {}).get("tflops", float("nan"))
        for r in rd["results"]:
            t = torch_by_mu.get(r["mu"], {})
            tf, tfb = t.get("tflops_forward", float("nan")), t.get("tflops_forward_backward", float("nan"))
            ratio = r["tflops_forward"] / tf if tf == tf and tf > 0 else float("nan")
            ratio_fb = r["tflops_forward_backward"] / tfb if tfb == tfb and tfb > 0 else float("nan")
            print(f"| {E} ({64 // E}) | {rd['workload']['routing']} | {r['path']} | {r['mu']} | {r['rho']:.2f} | {r['tflops_forward']:.1f} | {tf:.1f} | "
                  f"{truncated(ratio)} | {r['tflops_forward_backward']:.1f} | {tfb:.1f} | {truncated(ratio_fb)} | {dense:.1f} |")


if __name__ == "__main__":
    main()
