"""The router's gradients stay fp32 under torch.compile inside bf16 autocast: torch.compile traces a backward under
the autocast state of the forward's caller (torch._functorch.config.backward_pass_autocast = "same_as_forward", its
default through torch 2.15), not the autocast(enabled=False) region the router's forward runs in, so a plain F.linear
router would take its weight and input gradients in bf16 there. rdep.torch.router.router_logits is an autograd
function whose backward runs with autocast off. Checked on the host (CPU autocast,
bf16), where torch.compile shows the same behaviour, with that setting forced for these tests (an earlier test, or the
training example, may have changed it for the process): the compiled router's gradients equal the eager ones (fp32)
to fp32 rounding, and a plain F.linear's compiled gradients do not (the check can fail). A compiled graph holding
the function is AOTAutograd-cacheable only with torch's setting that allows autograd functions.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from rdep.torch import router as rt

pytestmark = pytest.mark.no_library  # the router is plain PyTorch: no librdep_capi.so needed


@pytest.fixture(autouse=True)
def backward_under_forward_autocast():
    """torch's default, whatever this process set before (train.py sets "off"); fresh dynamo state."""
    import torch._functorch.config as cfg

    if not hasattr(cfg, "backward_pass_autocast"):
        yield
        return
    torch._dynamo.reset()
    with cfg.patch(backward_pass_autocast="same_as_forward"):
        yield
    torch._dynamo.reset()


def _inputs(seed: int):
    torch.manual_seed(seed)
    x = torch.randn(64, 48)
    w = torch.randn(16, 48) * 0.3
    return x, w


def _grads(linear, x0, w0, compiled: bool):
    """Gradients of x and w through [bf16 projection under autocast] -> [fp32 linear with autocast off]."""
    x = x0.clone().requires_grad_(True)
    w = w0.clone().requires_grad_(True)
    proj = torch.eye(48) + 0.01 * torch.arange(48.0).reshape(1, 48) / 48

    def f(x, w):
        h = x @ proj  # bf16 under autocast: what a model's norm and projections hand the router
        with torch.autocast(device_type="cpu", enabled=False):
            logits = linear(h.float(), w)
            return (logits.sin() * 1.7).sum()

    fn = torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        loss = fn(x, w)
    loss.backward()
    return x.grad, w.grad


def _max_rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_router_logits_keeps_fp32_gradients_under_compile_and_autocast():
    x, w = _inputs(1)
    gx_e, gw_e = _grads(rt.router_logits, x, w, compiled=False)
    gx_c, gw_c = _grads(rt.router_logits, x, w, compiled=True)
    assert gw_c.dtype == torch.float32 and gx_c.dtype == torch.float32
    assert _max_rel(gw_c, gw_e) < 1e-5, "router weight gradient: compiled differs from eager beyond fp32 rounding"
    assert _max_rel(gx_c, gx_e) < 1e-2  # x's gradient leaves through the bf16 projection in both


def test_router_graph_is_aot_cacheable_once_autograd_functions_are_allowed():
    """router_logits is a torch.autograd.Function, so AOTAutograd's cache bypasses a compiled graph holding it unless
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions is on (the training example's
    --autograd-cache-functions, its default); with it on the graph is saved to or found in the cache, and the compiled
    gradients are the eager ones (both checks can fail: the counters are the cache's own)."""
    import torch._functorch.config as cfg
    from torch._dynamo.utils import counters

    if not hasattr(cfg, "autograd_cache_allow_custom_autograd_functions"):
        pytest.skip("this torch has no autograd_cache_allow_custom_autograd_functions")
    if "TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD" in os.environ:
        pytest.skip("TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD forces the setting this test turns")
    try:
        from torch._functorch._aot_autograd.autograd_cache import should_use_local_autograd_cache
    except ImportError:
        pytest.skip("this torch's AOTAutograd cache has no should_use_local_autograd_cache")
    if not should_use_local_autograd_cache():
        pytest.skip("AOTAutograd's local cache is off in this environment")

    def f(x, w):
        with torch.autocast(device_type="cpu", enabled=False):
            return rt.router_logits(x, w).sin().sum()

    x0, w0 = _inputs(6)
    want = torch.func.grad(lambda w: F.linear(x0, w).sin().sum())(w0)
    seen = {}
    for allow in (False, True):
        torch._dynamo.reset()
        counters.clear()
        w = w0.clone().requires_grad_(True)
        with cfg.patch(autograd_cache_allow_custom_autograd_functions=allow):
            torch.compile(f, backend="inductor", fullgraph=True)(x0, w).backward()
        seen[allow] = dict(counters["aot_autograd"])
        assert _max_rel(w.grad, want) < 1e-5
    assert seen[False].get("autograd_cache_bypass", 0) >= 1, seen
    assert seen[True].get("autograd_cache_bypass", 0) == 0, seen
    assert seen[True].get("autograd_cache_saved", 0) + seen[True].get("autograd_cache_hit", 0) >= 1, seen


def test_plain_linear_loses_fp32_gradients_under_compile_and_autocast():
    """The behaviour router_logits guards against, under the setting the fixture forces."""
    x, w = _inputs(2)
    _, gw_e = _grads(F.linear, x, w, compiled=False)
    _, gw_c = _grads(F.linear, x, w, compiled=True)
    assert _max_rel(gw_c, gw_e) > 1e-4, "expected the compiled F.linear's weight gradient in bf16"


def test_router_logits_matches_linear_and_gradcheck():
    torch.manual_seed(3)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    assert torch.equal(rt.router_logits(x, w), F.linear(x, w))
    assert torch.autograd.gradcheck(rt.router_logits, (x, w))
    xt = torch.randn(8, 6, dtype=torch.float64).t().requires_grad_(True)  # non-contiguous [6, 8]
    assert torch.autograd.gradcheck(rt.router_logits, (xt, w))
    assert torch.autograd.gradcheck(lambda w: rt.router_logits(x.detach(), w), (w,))  # x without a gradient
    # torch.func: vmap over a batch of weights, and grad through the vmapped call
    ws = torch.randn(3, 4, 8, dtype=torch.float64)
    got = torch.func.vmap(lambda w: rt.router_logits(x.detach(), w))(ws)
    assert torch.allclose(got, torch.stack([F.linear(x.detach(), wi) for wi in ws]))
    g = torch.func.grad(lambda w: torch.func.vmap(lambda wi: rt.router_logits(x.detach(), wi))(w).sin().sum())(ws)
    want = torch.func.grad(lambda w: torch.func.vmap(lambda wi: F.linear(x.detach(), wi))(w).sin().sum())(ws)
    assert torch.allclose(g, want)


def test_router_module_weight_gradient_is_fp32_under_compile_and_autocast():
    """The Router module end to end (sigmoid scores, expert bias, z-loss), compiled against eager."""
    grads = []
    for compiled in (False, True):
        torch.manual_seed(4)
        router = rt.Router(48, 16, 4, score_function="sigmoid", expert_bias=True, z_loss_coeff=1e-2)
        with torch.no_grad():
            router.weight.normal_(0.0, 0.3)
        x = torch.randn(64, 48)
        proj = torch.eye(48) * 1.01

        def f(x):
            h = x @ proj  # bf16 under autocast, as a model's last projection before its MoE block
            with torch.autocast(device_type="cpu", enabled=False):
                out = router(h.float())
                return (out.gates * torch.arange(4.0)).sum() + out.logits.square().mean() + out.z_loss

        fn = torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            loss = fn(x)
        loss.backward()  # outside autocast, as torch recommends (on the CPU, backward runs on this thread)
        grads.append(router.weight.grad)
    assert _max_rel(grads[1], grads[0]) < 1e-5
