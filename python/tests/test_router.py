"""The router's linear (rdep.torch.router.router_logits): its weight gradient split over token chunks against
the one-GEMM product, in fp64 (exact up to the summation order) and under gradcheck; the chunk count it picks;
and on CUDA (skipped without one) the Router's gradients at a token count whose chunks leave a remainder,
against F.linear's, in fp32 without TF32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rdep.torch import router as rt


@pytest.mark.parametrize("n,chunks", [(1000, 1), (1000, 2), (1000, 7), (1024, 32), (63, 32), (64, 32)])
def test_split_weight_grad_matches_one_product(n, chunks):
    torch.manual_seed(n + chunks)
    g = torch.randn(n, 16, dtype=torch.float64)
    x = torch.randn(n, 24, dtype=torch.float64)
    want = g.t() @ x
    got = rt.split_weight_grad(g, x, chunks)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-12 * want.abs().max().item()


def test_split_weight_grad_reads_non_contiguous_gradients():
    torch.manual_seed(5)
    g = torch.randn(16, 300, dtype=torch.float64).t()  # [300, 16], transposed view
    x = torch.randn(300, 8, dtype=torch.float64)
    assert not g.is_contiguous()
    assert torch.allclose(rt.split_weight_grad(g, x, 4), g.t() @ x, rtol=1e-12, atol=1e-12)


def test_router_linear_gradcheck_with_chunks():
    torch.manual_seed(6)
    x = torch.randn(37, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rt._RouterLinear.apply(a, b, 3), (x, w))


def test_router_logits_keeps_leading_dimensions_and_picks_chunks():
    x = torch.randn(2, 3, 8)
    w = torch.randn(4, 8)
    out = rt.router_logits(x, w)
    assert out.shape == (2, 3, 4)
    assert torch.equal(out, F.linear(x, w))
    assert rt.wgrad_chunks(4096, torch.device("cpu")) == 1
    assert rt.wgrad_chunks(4096, torch.device("cuda")) == 32
    assert rt.wgrad_chunks(1000, torch.device("cuda")) == 7
    assert rt.wgrad_chunks(100, torch.device("cuda")) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_router_gradients_on_cuda_match_plain_linear():
    """N = 1000 tokens: 7 chunks of 142 and a remainder of 6 rows."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch.manual_seed(7)
        router = rt.Router(256, 64, 6, score_function="sigmoid", expert_bias=True, z_loss_coeff=1e-3,
                           device="cuda")
        with torch.no_grad():
            router.weight.normal_(0.0, 0.05)
        x = torch.randn(1000, 256, device="cuda", requires_grad=True)
        out = router(x)
        (out.gates.square().sum() + out.logits.sin().sum() + out.z_loss).backward()
        gx, gw = x.grad.clone(), router.weight.grad.clone()
        x.grad = None
        router.weight.grad = None
        logits = F.linear(x, router.weight)
        plain = router._route(x, logits)
        assert torch.equal(plain.experts, out.experts)
        (plain.gates.square().sum() + plain.logits.sin().sum() + plain.z_loss).backward()
        for name, got, want in (("x", gx, x.grad), ("weight", gw, router.weight.grad)):
            err = (got - want).abs().max().item()
            assert err <= 1e-5 * want.abs().max().item(), f"{name}: max error {err}"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
