"""The package as `pip install .` leaves it (run by .ci/run from outside the repository, without
RDEP_LIBRARY or PYTHONPATH): rdep and its librdep_capi.so come from site-packages, and an MoE forward
and backward on the host backend match a plain PyTorch computation of the same layer (through rdep.torch's eager C++
path, compiled from the installed package's sources, when RDEP_TORCH_EAGER_EXT=1)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F


def test_installed_package_runs_an_moe_layer():
    import rdep
    import rdep.torch as rt

    here = Path(__file__).resolve().parents[2]
    pkg = Path(rdep.__file__).resolve().parent
    if os.environ.get("RDEP_LIBRARY") is None:
        assert here not in pkg.parents, f"rdep imported from the repository ({pkg}), not the installed package"
        assert (pkg / "librdep_capi.so").is_file(), f"librdep_capi.so is not inside the installed package {pkg}"
    torch.manual_seed(0)
    W, T, H, Fd, E, K = 2, 6, 8, 4, 4, 2
    layer = rt.Layer(H, Fd, E, K, T, world_size=W, backend="host")
    x = torch.randn(W, T, H, requires_grad=True)
    experts = torch.stack([torch.randperm(E)[:K] for _ in range(W * T)]).reshape(W, T, K).to(torch.int32)
    gates = torch.softmax(torch.randn(W, T, K), dim=-1).requires_grad_(True)
    w1 = (torch.randn(E, H, 2 * Fd) * 0.3).requires_grad_(True)
    w2 = (torch.randn(E, Fd, H) * 0.3).requires_grad_(True)
    y = rt.moe(layer, x, experts, gates, w1, w2)
    if os.environ.get("RDEP_TORCH_EAGER_EXT") == "1":  # .ci/run: the eager C++ path built from the installed sources
        assert type(y.grad_fn).__name__ == "CppFunction", type(y.grad_fn).__name__
        assert (pkg / "include" / "rdep" / "capi.h").is_file() or os.environ.get("RDEP_LIBRARY") is not None

    def expert(e, v):
        h = v @ w1[e]
        return (F.silu(h[..., :Fd]) * h[..., Fd:]) @ w2[e]

    ref = torch.zeros_like(x)
    for r in range(W):
        for t in range(T):
            for k in range(K):
                ref[r, t] = ref[r, t] + gates[r, t, k] * expert(int(experts[r, t, k]), x[r, t])
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, gates, w1, w2), dy)
    want = torch.autograd.grad(ref, (x, gates, w1, w2), dy)
    for name, a, b in zip(("dx", "dgates", "dw1", "dw2"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
