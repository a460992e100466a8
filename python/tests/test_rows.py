"""rdep.torch.plan / dispatch / combine (the caller's own experts) on the host backend (fp32), against the
plain fp64 reference (reference.py): a caller computing the SwiGLU experts in PyTorch gets the reference's
y and gradients (x, gates, w1, w2); the received rows are exactly the accepted rows, in the documented
order (sentinel payloads); gradcheck; opcheck; torch.compile; context lifetime; bad input and steps out
of order named.

Tolerance (fp32 vs the fp64 reference): max|a - b| <= 1e-5 * max|b|, as test_ops.py.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

import rdep
import rdep.torch as rt
import reference as ref
from conftest import assert_rel_close
from test_ops import CASES, make_inputs

TOL = 1e-5


def swiglu_experts(recv, counts, w1, w2):
    """The caller's experts: expert e's SwiGLU MLP on its counts[e] consecutive received rows."""
    outs, start, Fd = [], 0, w2.shape[1]
    for e, c in enumerate(counts.tolist()):
        h = recv[start:start + c] @ w1[e]
        outs.append((F.silu(h[:, :Fd]) * h[:, Fd:]) @ w2[e])
        start += c
    assert start == recv.shape[0]
    return torch.cat(outs) if outs else recv[:0]


def rows_moe(layer, x, ids, gates, w1, w2):
    p = rt.plan(layer, ids, gates)
    recv = rt.dispatch(p, x)
    return rt.combine(p, swiglu_experts(recv, p.tokens_per_expert, w1, w2)), p


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dispatch_combine_match_reference(case):
    _, W, E, K, n, T, C, kind, drops = case
    layer = rt.Layer(8, 6, E, K, T, world_size=W, capacity_factor=C)
    x, ids, gates, w1, w2 = make_inputs(layer, n, kind)
    leaves = [t.clone().requires_grad_(True) for t in (x, gates, w1, w2)]
    y, p = rows_moe(layer, leaves[0], ids, *leaves[1:])
    assert y.shape == x.shape and p.tokens_per_expert.shape == (E,)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert layer.live_contexts == 0, "dispatch's backward releases the plan's context"

    rl = [t.double().requires_grad_(True) for t in (x, gates, w1, w2)]
    y_ref, acc = ref.moe_layer(rl[0], ids, rl[1], rl[2], rl[3], C, T)
    y_ref.backward(dy.double())
    assert bool((~acc).any()) == drops
    assert p.num_recv == int(acc.sum())
    assert_rel_close(y, y_ref, TOL, "y")
    for name, got, want in zip(("dx", "dgates", "dw1", "dw2"), leaves, rl):
        assert_rel_close(got.grad, want.grad, TOL, name)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_received_rows_are_the_accepted_rows_in_order(case):
    """x[r, t] = r * 1000 + t in every column (exact in fp32): each received row must be its token's row,
    under its expert, expert-major with ascending row ids inside an expert, and the received set must be
    exactly the reference's accepted rows."""
    _, W, E, K, n, T, C, kind, _ = case
    layer = rt.Layer(8, 6, E, K, T, world_size=W, capacity_factor=C)
    _, ids, gates, _, _ = make_inputs(layer, n, kind)
    x = (torch.arange(W)[:, None] * 1000 + torch.arange(n)[None, :]).float()[:, :, None].expand(W, n, 8).contiguous()
    p = rt.plan(layer, ids, gates)
    recv = rt.dispatch(p, x)
    row_ids = p.row_ids().tolist()
    assert len(row_ids) == recv.shape[0] == p.num_recv
    acc = ref.accepted(ids, E, ref.capacity(C, W, T, K, E))
    want = {((r * T + t) * K + k) for r in range(W) for t in range(n) for k in range(K) if acc[r, t, k]}
    assert set(row_ids) == want and len(row_ids) == len(want), "every accepted row exactly once"
    start = 0
    for e, c in enumerate(p.tokens_per_expert.tolist()):
        block = row_ids[start:start + c]
        assert block == sorted(block), f"expert {e}: rows not in (rank, token, slot) order"
        for j, rid in enumerate(block):
            r, t, k = rid // (T * K), (rid // K) % T, rid % K
            assert int(ids[r, t, k]) == e, f"row {rid} under expert {e}"
            assert torch.equal(recv[start + j], x[r, t]), f"row {rid}: wrong payload"
        start += c


def test_one_local_rank_takes_tokens_without_the_rank_dimension():
    layer = rt.Layer(8, 6, 4, 2, 16, world_size=1)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "zipf")
    y3, _ = rows_moe(layer, x, ids, gates, w1, w2)
    y2, _ = rows_moe(layer, x[0], ids[0], gates[0], w1, w2)
    assert y2.shape == (16, 8)
    assert torch.equal(y2, y3[0])


def test_zero_tokens():
    layer = rt.Layer(4, 4, 4, 2, 8, world_size=2)
    x, ids, gates, w1, w2 = make_inputs(layer, 0, "uniform")
    x.requires_grad_(True)
    y, p = rows_moe(layer, x, ids, gates, w1, w2)
    assert y.shape == (2, 0, 4) and p.num_recv == 0
    y.sum().backward()
    assert x.grad.shape == x.shape and layer.live_contexts == 0


def test_experts_of_any_form():
    """The experts are the caller's: here one shared linear map for every row (an expert the layer does
    not have); y and its gradients against the same map applied in the reference's routing."""
    W, E, K, n, C = 3, 5, 2, 7, 0.7
    layer = rt.Layer(6, 4, E, K, n, world_size=W, capacity_factor=C)
    x, ids, gates, _, _ = make_inputs(layer, n, "zipf", seed=3)
    A = torch.randn(6, 6, requires_grad=True)
    xl, gl = x.clone().requires_grad_(True), gates.clone().requires_grad_(True)
    p = rt.plan(layer, ids, gl)
    y = rt.combine(p, torch.tanh(rt.dispatch(p, xl) @ A))
    y.square().sum().backward()
    xr, gr, Ar = x.double().requires_grad_(True), gates.double().requires_grad_(True), A.detach().double().requires_grad_(True)
    g_eff = ref.renormalize(gr, ref.accepted(ids, E, ref.capacity(C, W, n, K, E)))
    y_ref = torch.einsum("rtk,rth->rth", g_eff, torch.tanh(xr @ Ar))  # every expert is the same map
    y_ref.square().sum().backward()
    assert_rel_close(y, y_ref, TOL, "y")
    for name, got, want in (("dx", xl, xr), ("dgates", gl, gr), ("dA", A, Ar)):
        assert_rel_close(got.grad, want.grad, TOL, name)


class _FreshPlanPerBackward(torch.autograd.Function):
    """gradcheck backpropagates one forward several times; a plan serves one backward. As in test_ops.py,
    every backward pass runs plan/dispatch/combine again and differentiates that with rdep's backward ops."""

    @staticmethod
    def forward(ctx, layer, ids, x, gates, w1, w2):
        ctx.layer, ctx.ids = layer, ids
        ctx.save_for_backward(x, gates, w1, w2)
        with torch.no_grad():
            return rows_moe(layer, x, ids, gates, w1, w2)[0]

    @staticmethod
    def backward(ctx, dy):
        leaves = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
        with torch.enable_grad():
            y, _ = rows_moe(ctx.layer, leaves[0], ctx.ids, *leaves[1:])
            grads = torch.autograd.grad(y, leaves, dy)
        return (None, None, *grads)


def test_gradcheck_fp32():
    """torch.autograd.gradcheck through dispatch/combine, W = 2 with capacity drops, in fp32 as test_ops.py
    (same step and tolerances: eps 1e-3, atol 2e-3, rtol 2e-2; gates kept >= 0.2)."""
    layer = rt.Layer(4, 3, 3, 2, 3, world_size=2, capacity_factor=0.6)
    x, ids, gates, w1, w2 = make_inputs(layer, 3, "zipf", seed=5)
    gates = gates.clamp_min(0.2)
    assert (~ref.accepted(ids, 3, ref.capacity(0.6, 2, 3, 2, 3))).any()
    inputs = tuple(t.clone().requires_grad_(True) for t in (x, gates, w1, w2))
    with pytest.warns(UserWarning):  # gradcheck warns about fp32 inputs
        assert torch.autograd.gradcheck(lambda *a: _FreshPlanPerBackward.apply(layer, ids, *a), inputs,
                                        eps=1e-3, atol=2e-3, rtol=2e-2)


def _plan_args(W=2, E=4, K=2, n=5):
    layer = rt.Layer(4, 4, E, K, n, world_size=W, capacity_factor=0.8)
    x, ids, gates, _, _ = make_inputs(layer, n, "zipf", seed=2)
    return layer, x, ids, gates


UTILS = ["test_schema", "test_autograd_registration", "test_faketensor"]


@pytest.mark.parametrize("util", UTILS)
def test_opcheck_plan(util):
    """The plan op under opcheck's utilities but test_aot_dispatch_*: those compare an eager run's output
    with a traced run's while the eager plan is still alive, so the second plan gets another context slot
    (another token) by design. test_torch_compile_fullgraph traces the ops through AOT autograd instead."""
    layer, _, ids, gates = _plan_args()
    torch.library.opcheck(torch.ops.rdep.moe_plan.default, (layer.handle, layer.rep, ids, gates), test_utils=util)


@pytest.mark.parametrize("util", UTILS)
def test_opcheck_row_ops(util):
    """Each row op with a fresh plan per opcheck utility (a plan's steps run once each; the utilities that
    run an op twice on one plan are what the context refuses)."""
    layer, x, ids, gates = _plan_args()
    p = rt.plan(layer, ids, gates)
    torch.library.opcheck(torch.ops.rdep.moe_dispatch.default, (layer.handle, layer.rep, p.ctx, p.tokens_per_expert, x), test_utils=util)
    p = rt.plan(layer, ids, gates)
    recv = rt.dispatch(p, x)
    torch.library.opcheck(torch.ops.rdep.moe_combine.default, (layer.handle, layer.rep, p.ctx, p.tokens_per_expert, recv * 2, gates),
                          test_utils=util)
    torch.library.opcheck(torch.ops.rdep.moe_combine_backward.default,
                          (layer.handle, layer.rep, p.ctx, p.tokens_per_expert, torch.randn_like(x), recv.shape[0]), test_utils=util)
    torch.library.opcheck(torch.ops.rdep.moe_dispatch_backward.default,
                          (layer.handle, layer.rep, p.ctx, p.tokens_per_expert, torch.randn_like(recv), x.shape[1]), test_utils=util)


def test_torch_compile_fullgraph():
    """plan -> dispatch -> the caller's experts -> combine traced with no graph break (the received row
    count is an unbacked size while tracing), forward and backward equal to eager."""
    layer, x, ids, gates = _plan_args(W=3, E=6, K=2, n=6)
    A = torch.randn(4, 4)

    def f(x, gates):
        p = rt.plan(layer, ids, gates)
        return rt.combine(p, torch.relu(rt.dispatch(p, x) @ A))

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves = [[t.clone().requires_grad_(True) for t in (x, gates)] for _ in range(2)]
    y_eager, y_comp = f(*leaves[0]), compiled(*leaves[1])
    assert torch.equal(y_eager, y_comp)
    dy = torch.randn_like(y_eager)
    y_eager.backward(dy)
    y_comp.backward(dy)
    for a, b in zip(*leaves):
        assert torch.equal(a.grad, b.grad)
    assert layer.live_contexts == 0


def test_context_lifetime():
    layer, x, ids, gates = _plan_args()
    p = rt.plan(layer, ids, gates)
    assert layer.live_contexts == 1
    rt.combine(p, rt.dispatch(p, x))  # no grad needed: the context lives until the plan is dropped
    assert layer.live_contexts == 1
    del p
    gc.collect()
    assert layer.live_contexts == 0
    xl = x.clone().requires_grad_(True)
    p = rt.plan(layer, ids, gates)
    rt.dispatch(p, xl).sum().backward()  # dispatch's backward alone ends the plan
    assert layer.live_contexts == 0


def test_steps_out_of_order_are_named():
    layer, x, ids, gates = _plan_args()
    p = rt.plan(layer, ids, gates)
    recv = rt.dispatch(p, x)
    with pytest.raises(rdep.FailedPreconditionError, match=r"dispatch on rank \d+: the context holds no plan"):
        rt.dispatch(p, x)  # a plan is dispatched once
    rt.combine(p, recv)
    with pytest.raises(rdep.FailedPreconditionError, match=r"combine on rank \d+: the context's rows were already combined"):
        rt.combine(p, recv)
    p2 = rt.plan(layer, ids, gates)
    with pytest.raises(rdep.FailedPreconditionError, match=r"combine on rank \d+: the context holds no dispatched rows"):
        rt.combine(p2, torch.zeros(p2.num_recv, 4))
    xl = x.clone().requires_grad_(True)
    p3 = rt.plan(layer, ids, gates)
    rt.dispatch(p3, xl).sum().backward()
    with pytest.raises(rdep.FailedPreconditionError, match="is not a live context"):
        rt.dispatch(p3, x)


@pytest.mark.parametrize("bad", ["x_dtype", "x_tokens", "x_layout", "out_width", "out_rows", "ids_dtype", "gates_shape"])
def test_bad_input_names_the_argument(bad):
    layer, x, ids, gates = _plan_args()
    if bad in ("ids_dtype", "gates_shape"):
        args = (ids.long(), gates) if bad == "ids_dtype" else (ids, gates[:, :2])
        with pytest.raises((TypeError, ValueError), match="experts" if bad == "ids_dtype" else "gates"):
            rt.plan(layer, *args)
        return
    p = rt.plan(layer, ids, gates)
    if bad.startswith("x_"):
        arg = {"x_dtype": x.double(), "x_tokens": x[:, :3].contiguous(), "x_layout": x.transpose(0, 1).contiguous().transpose(0, 1)}[bad]
        with pytest.raises((TypeError, ValueError), match="x"):
            rt.dispatch(p, arg)
        return
    recv = rt.dispatch(p, x)
    if bad == "out_width":
        with pytest.raises(ValueError, match="expert_out: expected shape"):
            rt.combine(p, recv[:, :2].contiguous())
    else:
        with pytest.raises(ValueError, match=f"expert_out: expected {recv.shape[0]} rows"):
            rt.combine(p, recv[:-1].contiguous())


def test_combine_op_checks_its_gates():
    """The registered op sizes y from its gates argument: a gates tensor of the wrong shape is refused
    (naming it) before anything is written."""
    layer, x, ids, gates = _plan_args(W=4)
    p = rt.plan(layer, ids, gates)
    recv = rt.dispatch(p, x)
    with pytest.raises(ValueError, match=r"^gates: expected shape \[L=4, n, K=2\]"):
        torch.ops.rdep.moe_combine(layer.handle, layer.rep, p.ctx, p.tokens_per_expert, recv, gates[:1])
    with pytest.raises(TypeError, match="^gates: expected dtype torch.float32"):
        torch.ops.rdep.moe_combine(layer.handle, layer.rep, p.ctx, p.tokens_per_expert, recv, gates.double())


def test_balancing_is_refused():
    layer = rt.Layer(4, 4, 4, 2, 6, world_size=2, balance="ultraep", balance_slots=1)
    _, x, ids, gates = _plan_args(W=2, E=4, K=2, n=6)
    with pytest.raises(rdep.FailedPreconditionError, match="cannot run with balancing"):
        rt.plan(layer, ids, gates)


def test_owner_reduce_is_refused():
    layer = rt.Layer(4, 4, 4, 2, 6, world_size=2, owner_reduce=True)
    _, x, ids, gates = _plan_args(W=2, E=4, K=2, n=6)
    with pytest.raises(rdep.FailedPreconditionError, match="without owner_reduce"):
        rt.plan(layer, ids, gates)
