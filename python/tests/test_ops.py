"""The custom ops rdep::moe_forward / rdep::moe_backward on the host backend (fp32), against the plain
fp64 reference (reference.py): outputs and gradients, with W = 1 and several ranks in one process,
uniform / skewed / all-to-one routing, capacity drops, E not divisible by W, W > E; gradcheck;
opcheck; forward-context lifetime; bad input naming the argument.

Tolerance (fp32 layer vs fp64 reference): max|a - b| <= 1e-5 * max|b| for y, dx, dgates, dw1, dw2.
"""

from __future__ import annotations

import gc

import pytest
import torch

import rdep
import rdep.torch as rt
import reference as ref
from conftest import assert_rel_close

TOL = 1e-5


def make_routing(W, n, E, K, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        ids = torch.rand(W * n, E, generator=g).argsort(-1)[:, :K]
    elif kind == "zipf":  # expert e drawn with weight 1/(e+1)^1.5, K distinct per token
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.5
        ids = torch.multinomial(p.expand(W * n, E), K, replacement=False, generator=g)
    elif kind == "one_expert":  # every token to the same K experts
        ids = torch.arange(K).expand(W * n, K)
    else:
        raise ValueError(kind)
    gates = torch.rand(W * n, K, generator=g) * 0.9 + 0.1
    return ids.reshape(W, n, K).to(torch.int32).contiguous(), gates.reshape(W, n, K).contiguous()


def make_inputs(layer, n, kind, seed=0):
    W, H, F, E, K = layer.num_local_ranks, layer.hidden, layer.ffn, layer.num_experts, layer.topk
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(W, n, H, generator=g)
    w1 = torch.randn(E, H, 2 * F, generator=g) / H ** 0.5
    w2 = torch.randn(E, F, H, generator=g) / F ** 0.5
    ids, gates = make_routing(W, n, E, K, kind, seed)
    return x, ids, gates, w1, w2


CASES = [
    # id, W, E, K, n, T, capacity_factor, routing, expect drops
    ("W1_E4_K2_uniform", 1, 4, 2, 16, 16, 0.0, "uniform", False),
    ("W4_E8_K2_zipf", 4, 8, 2, 12, 12, 0.0, "zipf", False),
    ("W4_E6_K3_zipf_C0.5", 4, 6, 3, 10, 12, 0.5, "zipf", True),
    ("W3_E7_K2_one_expert_C1", 3, 7, 2, 8, 8, 1.0, "one_expert", True),
    ("W4_E3_K1_uniform_W_gt_E", 4, 3, 1, 9, 9, 0.0, "uniform", False),
    ("W2_E5_K5_uniform_C0.8", 2, 5, 5, 6, 6, 0.8, "uniform", True),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_backward_match_reference(case):
    _, W, E, K, n, T, C, kind, drops = case
    H, F = 8, 6
    layer = rt.Layer(H, F, E, K, T, world_size=W, capacity_factor=C)
    assert layer.backend == "host" and layer.num_local_ranks == W and layer.num_local_experts == E
    x, ids, gates, w1, w2 = make_inputs(layer, n, kind)
    leaves = [t.clone().requires_grad_(True) for t in (x, gates, w1, w2)]
    y = rt.moe(layer, leaves[0], ids, leaves[1], leaves[2], leaves[3])
    dy = torch.randn_like(y)
    y.backward(dy)
    assert layer.live_contexts == 0

    rl = [t.double().requires_grad_(True) for t in (x, gates, w1, w2)]
    y_ref, acc = ref.moe_layer(rl[0], ids, rl[1], rl[2], rl[3], C, T)
    y_ref.backward(dy.double())
    if drops:
        assert (~acc).any(), "the case was meant to drop rows"
        assert acc.any()
    else:
        assert acc.all()
    assert_rel_close(y, y_ref, TOL, "y")
    for name, got, want in zip(("dx", "dgates", "dw1", "dw2"), leaves, rl):
        assert_rel_close(got.grad, want.grad, TOL, name)


def test_ownership_E_not_divisible_by_W():
    layer = rt.Layer(4, 4, 6, 2, 8, world_size=4)
    assert [layer.owned_experts(r) for r in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 1)]
    layer = rt.Layer(4, 4, 3, 1, 8, world_size=4)  # W > E: the last rank owns none
    assert [layer.owned_experts(r)[1] for r in range(4)] == [1, 1, 1, 0]


def test_zero_tokens():
    layer = rt.Layer(4, 4, 4, 2, 8, world_size=2)
    x, ids, gates, w1, w2 = make_inputs(layer, 0, "uniform")
    x.requires_grad_(True)
    w1.requires_grad_(True)
    y = rt.moe(layer, x, ids, gates, w1, w2)
    assert y.shape == (2, 0, 4)
    y.sum().backward()
    assert torch.equal(w1.grad, torch.zeros_like(w1))


class _FreshForwardPerBackward(torch.autograd.Function):
    """gradcheck differentiates one forward several times (retain_graph=True: one pass per output
    row, and again to check reentrancy), while an rdep context serves exactly one backward. This wrapper
    runs rdep's forward again for every backward pass and differentiates that with rdep's backward op,
    so the analytic gradient gradcheck sees is still rdep's."""

    @staticmethod
    def forward(ctx, layer, ids, x, gates, w1, w2):
        ctx.layer, ctx.ids = layer, ids
        ctx.save_for_backward(x, gates, w1, w2)
        with torch.no_grad():
            return rt.moe(layer, x, ids, gates, w1, w2)

    @staticmethod
    def backward(ctx, dy):
        leaves = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
        with torch.enable_grad():
            y = rt.moe(ctx.layer, leaves[0], ctx.ids, *leaves[1:])
            grads = torch.autograd.grad(y, leaves, dy)
        return (None, None, *grads)


def test_gradcheck_fp32():
    """torch.autograd.gradcheck of the op (through _FreshForwardPerBackward), W = 2 ranks, with capacity
    drops. The host backend computes in fp32, so the check runs in fp32 (the op refuses fp64, see the
    next test): central differences with eps = 1e-3 carry ~1e-4 absolute error from fp32 rounding,
    hence atol = 2e-3, rtol = 2e-2. Gates stay in [0.2, 1] so that +-eps keeps them >= 0."""
    layer = rt.Layer(4, 3, 3, 2, 3, world_size=2, capacity_factor=0.6)
    x, ids, gates, w1, w2 = make_inputs(layer, 3, "zipf", seed=5)
    gates = gates.clamp_min(0.2)
    acc = ref.accepted(ids, 3, ref.capacity(0.6, 2, 3, 2, 3))
    assert (~acc).any()
    inputs = tuple(t.clone().requires_grad_(True) for t in (x, gates, w1, w2))

    def fn(x, gates, w1, w2):
        return _FreshForwardPerBackward.apply(layer, ids, x, gates, w1, w2)

    with pytest.warns(UserWarning):  # gradcheck warns about fp32 inputs
        assert torch.autograd.gradcheck(fn, inputs, eps=1e-3, atol=2e-3, rtol=2e-2)
    gc.collect()
    assert layer.live_contexts == 0


def test_float64_is_refused_naming_the_argument():
    layer = rt.Layer(4, 3, 3, 2, 3, world_size=2)
    x, ids, gates, w1, w2 = make_inputs(layer, 3, "uniform")
    with pytest.raises(TypeError, match=r"x: expected dtype torch.float32 on the host backend, got torch.float64"):
        rt.moe(layer, x.double(), ids, gates, w1, w2)


def test_opcheck_forward():
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=4, capacity_factor=0.7)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "zipf")
    grads = [t.clone().requires_grad_(True) for t in (x, gates, w1, w2)]
    op = torch.ops.rdep.moe_forward.default
    torch.library.opcheck(op, (layer.handle, layer.rep, grads[0], ids, grads[1], grads[2], grads[3], True))
    torch.library.opcheck(op, (layer.handle, layer.rep, x, ids, gates, w1, w2, False))
    gc.collect()
    assert layer.live_contexts == 0


@pytest.mark.parametrize("util", ["test_schema", "test_autograd_registration", "test_faketensor"])
def test_opcheck_backward(util):
    """moe_backward consumes its forward's context (the C ABI allows one backward per forward), so each
    opcheck utility gets a fresh forward. test_aot_dispatch_* run the op twice on one context, which the
    C ABI refuses; the op runs under AOT dispatch in test_opcheck_forward (its gradient check) and in
    test_moe.py's torch.compile test."""
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=4, capacity_factor=0.7)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "zipf")
    _, ctx = torch.ops.rdep.moe_forward(layer.handle, layer.rep, x, ids, gates, w1, w2, True)
    dy = torch.randn_like(x).requires_grad_(util == "test_autograd_registration")
    torch.library.opcheck(torch.ops.rdep.moe_backward.default, (layer.handle, layer.rep, ctx, dy, w1, w2), test_utils=util)


def test_context_lifetime():
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    w1.requires_grad_(True)
    y = rt.moe(layer, x, ids, gates, w1, w2)
    assert layer.live_contexts == 1 and layer.context_bytes() > 0
    y.sum().backward()
    assert layer.live_contexts == 0  # released by backward

    with torch.no_grad():
        rt.moe(layer, x, ids, gates, w1, w2)
    assert layer.live_contexts == 0  # grad off: released inside the call
    rt.moe(layer, x, ids, gates, w1.detach(), w2)
    assert layer.live_contexts == 0  # nothing requires grad

    y = rt.moe(layer, x, ids, gates, w1, w2)
    assert layer.live_contexts == 1
    del y  # graph dropped without backward: the context tensor's finalizer releases the slot
    gc.collect()
    assert layer.live_contexts == 0


def test_second_backward_is_refused():
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    w1.requires_grad_(True)
    loss = rt.moe(layer, x, ids, gates, w1, w2).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


@pytest.mark.parametrize("grad", [True, False])
def test_eager_call_skips_the_dispatcher_with_the_same_results(monkeypatch, grad, python_path):
    """rdep.torch.moe in eager mode calls the op's kernel and formula without the dispatcher (op_library.call): bitwise
    the results and gradients of the op called through torch.ops, and its kernel not run below the dispatcher's
    autograd; under a dispatch mode (the profiler's, FakeTensorMode's, ...) it takes the op."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from rdep.torch import layer_calls

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    below = []
    real = layer_calls.forward

    def forward(*args, **kwargs):
        below.append(torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradFunctionality))
        return real(*args, **kwargs)

    monkeypatch.setattr(layer_calls, "forward", forward)
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    inputs = make_inputs(layer, 16, "zipf")
    outs = []
    for how in ("moe", "op", "moe under a mode"):
        x, ids, gates, w1, w2 = [t.clone() for t in inputs]
        leaves = [t.requires_grad_(grad) for t in (x, gates, w1, w2)]
        if how == "op":
            y = torch.ops.rdep.moe_forward(layer.handle, layer.rep, *leaves[:1], ids, *leaves[1:], grad, True)[0]
        elif how == "moe":
            y = rt.moe(layer, leaves[0], ids, leaves[1], leaves[2], leaves[3])
        else:
            with PassThrough():
                y = rt.moe(layer, leaves[0], ids, leaves[1], leaves[2], leaves[3])
        if grad:
            y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
        outs.append([y.detach()] + ([t.grad for t in leaves] if grad else []))
    assert below == [False, True, True]
    for got in outs[::2]:
        for name, a, b in zip(["y", "dx", "dgates", "dw1", "dw2"], got, outs[1]):
            assert torch.equal(a, b), name
    assert layer.live_contexts == 0


def test_double_backward_is_refused_on_the_eager_path():
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    w1.requires_grad_(True)
    (g,) = torch.autograd.grad(rt.moe(layer, x, ids, gates, w1, w2).sum(), w1, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


def test_stale_context_is_refused():
    """An old context tensor whose slot was released and then reused by another forward is refused."""
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    op_f, op_b = torch.ops.rdep.moe_forward, torch.ops.rdep.moe_backward
    y, old = op_f(layer.handle, layer.rep, x, ids, gates, w1, w2, True)
    op_b(layer.handle, layer.rep, old, torch.ones_like(y), w1, w2)
    with pytest.raises(rdep.FailedPreconditionError, match="not a live context"):
        op_b(layer.handle, layer.rep, old, torch.ones_like(y), w1, w2)
    y, new = op_f(layer.handle, layer.rep, x, ids, gates, w1, w2, True)
    assert int(new) == int(old)  # the same slot again
    with pytest.raises(rdep.FailedPreconditionError, match="older forward"):
        op_b(layer.handle, layer.rep, old, torch.ones_like(y), w1, w2)
    op_b(layer.handle, layer.rep, new, torch.ones_like(y), w1, w2)  # the live one still works


def test_closed_layer():
    layer = rt.Layer(8, 6, 6, 2, 16)
    x, ids, gates, w1, w2 = make_inputs(layer, 4, "uniform")
    lid = layer.id
    layer.close()
    with pytest.raises(ValueError, match=f"layer: {lid} is not a live rdep layer handle"):
        rt.moe(lid, x, ids, gates, w1, w2)


def _bad_inputs():
    """(name, mutate(x, ids, gates, w1, w2) -> tuple, exception, message regex)."""

    def nc(t):  # same shape, not contiguous
        return t.transpose(0, 1).contiguous().transpose(0, 1)

    return [
        ("x_dtype", lambda x, i, g, a, b: (x.double(), i, g, a, b), TypeError, r"^x: expected dtype torch.float32"),
        ("experts_dtype", lambda x, i, g, a, b: (x, i.long(), g, a, b), TypeError, r"^experts: expected dtype torch.int32"),
        ("gates_dtype", lambda x, i, g, a, b: (x, i, g.half(), a, b), TypeError, r"^gates: expected dtype torch.float32"),
        ("w1_dtype", lambda x, i, g, a, b: (x, i, g, a.bfloat16(), b), TypeError, r"^w1: expected dtype torch.float32"),
        ("x_device", lambda x, i, g, a, b: (x.to("meta"), i, g, a, b), ValueError, r"^x: expected a tensor on cpu"),
        ("w2_device", lambda x, i, g, a, b: (x, i, g, a, b.to("meta")), ValueError, r"^w2: expected a tensor on cpu"),
        ("x_hidden", lambda x, i, g, a, b: (x[..., :-1].contiguous(), i, g, a, b), ValueError, r"^x: expected shape \[L=2, n, H=8\]"),
        ("x_ranks", lambda x, i, g, a, b: (x[:1].contiguous(), i, g, a, b), ValueError, r"^x: expected shape \[L=2"),
        ("x_too_many_tokens", lambda x, i, g, a, b: (torch.cat([x, x], 1), torch.cat([i, i], 1), torch.cat([g, g], 1), a, b),
         ValueError, r"^x: 32 tokens per rank exceed the layer's max_tokens T=16"),
        ("experts_shape", lambda x, i, g, a, b: (x, i[..., :1].contiguous(), g, a, b), ValueError, r"^experts: expected shape \[L=2, n=16, K=2\]"),
        ("gates_shape", lambda x, i, g, a, b: (x, i, g[:, :3].contiguous(), a, b), ValueError, r"^gates: expected shape"),
        ("w1_experts", lambda x, i, g, a, b: (x, i, g, a[:5].contiguous(), b), ValueError, r"^w1: expected shape \[E_local=6, H=8, 2F=12\]"),
        ("w2_shape", lambda x, i, g, a, b: (x, i, g, a, b.transpose(1, 2).contiguous()), ValueError, r"^w2: expected shape \[E_local=6, F=6, H=8\]"),
        ("x_noncontiguous", lambda x, i, g, a, b: (nc(x), i, g, a, b), ValueError, r"^x: expected a contiguous tensor"),
        ("gates_noncontiguous", lambda x, i, g, a, b: (x, i, nc(g), a, b), ValueError, r"^gates: expected a contiguous tensor"),
        ("w1_noncontiguous", lambda x, i, g, a, b: (x, i, g, nc(a), b), ValueError, r"^w1: expected a contiguous tensor"),
    ]


@pytest.mark.parametrize("bad", _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_bad_input_names_the_argument(bad):
    _, mutate, exc, pattern = bad
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    args = mutate(*make_inputs(layer, 16, "uniform"))
    with pytest.raises(exc, match=pattern):
        rt.moe(layer, *args)
    assert layer.live_contexts == 0


def test_bad_backward_input_names_the_argument():
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    y, ctx = torch.ops.rdep.moe_forward(layer.handle, layer.rep, x, ids, gates, w1, w2, True)
    with pytest.raises(TypeError, match=r"^dy: expected dtype torch.float32 on the host backend, got torch.float64"):
        torch.ops.rdep.moe_backward(layer.handle, layer.rep, ctx, y.double(), w1, w2)
    with pytest.raises(TypeError, match=r"^ctx: expected dtype torch.int64"):
        torch.ops.rdep.moe_backward(layer.handle, layer.rep, ctx.int(), y, w1, w2)
    with pytest.raises(ValueError, match=r"^dy: expected a contiguous tensor"):
        torch.ops.rdep.moe_backward(layer.handle, layer.rep, ctx, y.transpose(0, 1).contiguous().transpose(0, 1), w1, w2)
    torch.ops.rdep.moe_backward(layer.handle, layer.rep, ctx, y, w1, w2)


@pytest.mark.parametrize("what", ["expert_out_of_range", "expert_twice", "negative_gate", "nan_gate"])
def test_bad_routing_values_are_invalid_argument(what):
    """Routing values are checked by the C library (no device sync in Python): rdep.InvalidArgumentError,
    a ValueError, whose message names the rank and token."""
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    if what == "expert_out_of_range":
        ids[1, 3, 0] = 6
    elif what == "expert_twice":
        ids[1, 3, 1] = ids[1, 3, 0]
    elif what == "negative_gate":
        gates[1, 3, 1] = -0.5
    else:
        gates[1, 3, 1] = float("nan")
    with pytest.raises(rdep.InvalidArgumentError, match=r"rank 1.*token 3|token 3.*rank 1") as info:
        rt.moe(layer, x, ids, gates, w1, w2)
    assert isinstance(info.value, ValueError)
    assert layer.live_contexts == 0
    ids, gates = make_routing(2, 16, 6, 2, "uniform")  # the layer still works afterwards
    rt.moe(layer, x, ids, gates, w1, w2)


def test_schemas():
    assert str(torch.ops.rdep.moe_forward.default._schema) == (
        "rdep::moe_forward(Tensor handle, int layer, Tensor x, Tensor experts, Tensor gates, Tensor w1, Tensor w2, "
        "bool save_context=True, bool check_routing=True) -> (Tensor, Tensor)")
    assert str(torch.ops.rdep.moe_backward.default._schema) == (
        "rdep::moe_backward(Tensor handle, int layer, Tensor ctx, Tensor dy, Tensor w1, Tensor w2) -> (Tensor, Tensor, Tensor, Tensor)")


def test_backward_casts_go_into_each_ranks_own_gradients():
    """layer_calls._casts_into_grads (what the CUDA backward does with fp32 master weights, C ABI 13): each
    local rank's bf16 casts of w1, w2 lie in the first half of that rank's fp32 gradient bytes, hold the
    weights' bf16 values and leave the other bytes alone; a rank without experts gets None. Checked on CPU
    tensors (the placement is the same); which layers do it is ops._casts_in_grads."""
    from types import SimpleNamespace

    from rdep.torch import layer_calls, ops

    H, F = 16, 8
    fake = SimpleNamespace(hidden=H, ffn=F, _rank_experts=((0, 2), (2, 0), (2, 3)))
    w1, w2 = torch.randn(5, H, 2 * F), torch.randn(5, F, H)
    dw1, dw2 = torch.full((5, H, 2 * F), 7.0), torch.full((5, F, H), 7.0)
    ptrs = layer_calls._casts_into_grads(fake, w1, w2, dw1, dw2)
    assert ptrs[1] is None, "a rank without experts: nothing cast, its io keeps the addresses it had"
    for (e0, n), rank_ptrs in zip(fake._rank_experts, ptrs):
        if n == 0:
            continue
        p1, p2 = rank_ptrs
        for p, w, g in ((p1, w1, dw1), (p2, w2, dw2)):
            per = w[0].numel()
            assert p == g[e0].data_ptr(), "the rank's casts start at its own gradients"
            got = g[e0:e0 + n].view(torch.bfloat16).reshape(-1)[:n * per].view(w[e0:e0 + n].shape)
            assert torch.equal(got, w[e0:e0 + n].to(torch.bfloat16))
            rest = g[e0:e0 + n].reshape(-1)[n * per // 2:]  # the fp32 elements past the casts' bytes
            assert torch.equal(rest, torch.full_like(rest, 7.0)), "bytes past the casts untouched"
    layer = rt.Layer(16, 8, 4, 2, 8, world_size=1)  # the host backend: fp32 weights are read directly
    assert not ops._casts_in_grads(layer, w1, w2, torch.float32)
