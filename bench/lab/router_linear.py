#!/usr/bin/env python3
"""Lab: the router's fp32 linear (logits = x W^T, W [E, H]) and its two gradients on one GPU, as the
training example runs them (TF32 allowed), with the weight gradient split over token chunks
(rdep.torch.router.split_weight_grad) and the forward split over H, against the plain ops.

  python3 bench/lab/router_linear.py [--json OUT.json]

Each figure: the p50 over 15 samples of (20 back-to-back calls between two CUDA events) / 20, in us.
'router fwd+bwd': rdep.torch.Router's forward and backward through the logits alone (sum of the logits as
the loss), with the weight-gradient chunks rdep picks against one chunk, eager and under torch.compile.
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from rdep.torch import router as rt  # noqa: E402

SHAPES = {"example": (4096, 1024, 64), "moonlight": (4096, 2048, 64), "dsv3": (4096, 7168, 256)}


def time_us(fn, inner: int = 20, samples: int = 15) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(samples):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / inner)
    return statistics.median(out)


def split_forward(x: torch.Tensor, w: torch.Tensor, chunks: int) -> torch.Tensor:
    """x W^T as the sum over `chunks` slices of H (one batched GEMM)."""
    n, h = x.shape
    e = w.shape[0]
    return torch.bmm(x.view(n, chunks, h // chunks).transpose(0, 1),
                     w.view(e, chunks, h // chunks).permute(1, 2, 0)).sum(0)


def router_step(x: torch.Tensor, w: torch.Tensor) -> None:
    rt.router_logits(x, w).sum().backward()


def zeroed(step, x: torch.Tensor, w: torch.Tensor):
    def run():
        x.grad = w.grad = None
        step(x, w)
    return run


def lab_shape(name: str, n: int, h: int, e: int, dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(n, h, device=dev, generator=g).bfloat16().float()
    w = torch.randn(e, h, device=dev, generator=g) * 0.02
    dl = torch.randn(n, e, device=dev, generator=g)
    ref = dl.t() @ x
    r: dict = {"shape": {"N": n, "H": h, "E": e}}
    r["fwd linear"] = time_us(lambda: F.linear(x, w))
    for c in (2, 4, 8):
        if h % c == 0:
            got = split_forward(x, w, c)
            assert torch.allclose(got, F.linear(x, w), rtol=1e-2, atol=1e-2), f"split forward {c} disagrees"
            r[f"fwd split-H {c}"] = time_us(lambda c=c: split_forward(x, w, c))
    r["dx  dL W"] = time_us(lambda: dl @ w)
    r["dw  dL^T x"] = time_us(lambda: dl.t() @ x)
    r["dw  (x^T dL)^T"] = time_us(lambda: (x.t() @ dl).t())
    for c in (4, 8, 16, 32, 64):
        got = rt.split_weight_grad(dl, x, c)
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, f"split wgrad {c}: relative error {err}"
        r[f"dw  split {c}"] = time_us(lambda c=c: rt.split_weight_grad(dl, x, c))
    xa = x.clone().requires_grad_(True)
    wa = w.clone().requires_grad_(True)
    auto = rt.wgrad_chunks(n, x.device)
    r["router chunks"] = auto
    orig = rt.wgrad_chunks
    compiled = torch.compile(router_step)
    for label, chunks in (("auto", auto), ("1", 1)):
        rt.wgrad_chunks = lambda tokens, device, c=chunks: c
        try:
            torch._dynamo.reset()
            r[f"router fwd+bwd eager chunks={label}"] = time_us(zeroed(router_step, xa, wa))
            r[f"router fwd+bwd compiled chunks={label}"] = time_us(zeroed(compiled, xa, wa))
        finally:
            rt.wgrad_chunks = orig
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="")
    p.add_argument("--shapes", default=",".join(SHAPES))
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("router_linear: needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tf32": True, "results": []}
    for name in a.shapes.split(","):
        r = lab_shape(name, *SHAPES[name], dev)
        r["name"] = name
        out["results"].append(r)
        print(f"--- {name}: N={r['shape']['N']} H={r['shape']['H']} E={r['shape']['E']} (router picks {r['router chunks']} chunks)")
        for k, v in r.items():
            if isinstance(v, float):
                print(f"  {k:40s} {v:9.1f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
