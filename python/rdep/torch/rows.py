"""Dispatch and combine for experts the caller brings (in the manner of DeepEP's Buffer API): rdep moves
the rows, the caller computes them.

    plan = rdep.torch.plan(layer, experts, gates)   # routing: counts, the owners' capacity decision
    recv = rdep.torch.dispatch(plan, x)              # [M, H] this process's received rows
    out = my_experts(recv, plan.tokens_per_expert)   # one output row per received row
    y = rdep.torch.combine(plan, out)                # y_t = sum_k g'_k out(t, k), x's shape

recv is expert-major over layer.local_experts (plan.tokens_per_expert rows each, an int64 CPU tensor
[E_local]); within an expert the rows come by source rank, token, slot (plan.row_ids() names each
row: (source rank * T + token) * K + slot). g' are the gates after the capacity rule (dropped slots 0,
the token's survivors renormalized). Autograd: combine's backward gives the gradients of out (g'_k dy_t
per row) and of the gates given to plan (through the renormalization), dispatch's backward the gradient
of x (the rows' gradients summed per token). x, experts, gates are [L, n, ...] (L = the layer's local
ranks) or, with one local rank, [n, ...]. Dtypes as rdep.torch.moe: fp32 on the host backend; bf16 rows
and fp32 gates on CUDA (one segment per forward: segment_tokens 0, the default). Not with balancing or
nodes. A plan is used once: plan, dispatch, combine, then backward.

The registered ops (torch.library, fake implementations for torch.compile; dispatch's row count is
data-dependent, an unbacked size while tracing):
    rdep::moe_plan(Tensor handle, int layer, Tensor experts, Tensor gates) -> (Tensor ctx, Tensor counts)
    rdep::moe_dispatch(Tensor handle, int layer, Tensor ctx, Tensor counts, Tensor x) -> Tensor recv
    rdep::moe_combine(Tensor handle, int layer, Tensor ctx, Tensor counts, Tensor expert_out, Tensor gates) -> Tensor y
    rdep::moe_combine_backward(Tensor handle, int layer, Tensor ctx, Tensor counts, Tensor dy, SymInt num_recv) -> (d_out, dgates)
    rdep::moe_dispatch_backward(Tensor handle, int layer, Tensor ctx, Tensor counts, Tensor d_recv, SymInt num_tokens) -> dx
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import layer_handles, rows_calls, validate
from .layer import Layer, get_layer
from . import op_library

PLAN_SCHEMA = "(Tensor handle, int layer, Tensor experts, Tensor gates) -> (Tensor, Tensor)"
DISPATCH_SCHEMA = "(Tensor handle, int layer, Tensor ctx, Tensor counts, Tensor x) -> Tensor"
DISPATCH_BACKWARD_SCHEMA = "(Tensor handle, int layer, Tensor ctx, Tensor counts, Tensor d_recv, SymInt num_tokens) -> Tensor"
COMBINE_SCHEMA = "(Tensor handle, int layer, Tensor ctx, Tensor counts, Tensor expert_out, Tensor gates) -> Tensor"
COMBINE_BACKWARD_SCHEMA = "(Tensor handle, int layer, Tensor ctx, Tensor counts, Tensor dy, SymInt num_recv) -> (Tensor, Tensor)"


def _moe_plan(handle: Tensor, layer: int, experts: Tensor, gates: Tensor) -> tuple[Tensor, Tensor]:
    h = layer_handles.resolve(handle, layer)
    validate.check_plan(h, experts, gates)
    return rows_calls.plan(h, experts, gates)


def _moe_plan_fake(handle, layer, experts, gates):
    layer_handles.check_handle(handle)
    h = layer_handles.traced(layer)
    validate.check_plan(h, experts, gates)
    cpu = torch.device("cpu")
    return torch.empty((), dtype=torch.int64, device=cpu), torch.empty((h.num_local_experts,), dtype=torch.int64, device=cpu)


def _moe_dispatch(handle: Tensor, layer: int, ctx: Tensor, counts: Tensor, x: Tensor) -> Tensor:
    h = layer_handles.resolve(handle, layer)
    validate.check_plan_handles(h, ctx, counts)
    validate.check_token_rows("x", h, x)
    recv = x.new_empty((sum(rows_calls.rank_rows(h, counts)), h.hidden))
    rows_calls.run_step(rows_calls.DISPATCH, h, ctx, counts, x, recv)
    return recv


def _moe_dispatch_fake(handle, layer, ctx, counts, x):
    layer_handles.check_handle(handle)
    h = layer_handles.traced(layer)
    validate.check_plan_handles(h, ctx, counts)
    validate.check_token_rows("x", h, x)
    return x.new_empty((torch.library.get_ctx().new_dynamic_size(), h.hidden))


def _moe_dispatch_backward(handle: Tensor, layer: int, ctx: Tensor, counts: Tensor, d_recv: Tensor, num_tokens: int) -> Tensor:
    h = layer_handles.resolve(handle, layer)
    validate.check_plan_handles(h, ctx, counts)
    validate.check_received_rows("d_recv", h, d_recv)
    dx = d_recv.new_empty((h.num_local_ranks, num_tokens, h.hidden))
    rows_calls.run_step(rows_calls.DISPATCH_BACKWARD, h, ctx, counts, d_recv, dx)
    return dx


def _moe_dispatch_backward_fake(handle, layer, ctx, counts, d_recv, num_tokens):
    layer_handles.check_handle(handle)
    h = layer_handles.traced(layer)
    validate.check_received_rows("d_recv", h, d_recv)
    return d_recv.new_empty((h.num_local_ranks, num_tokens, h.hidden))


def _moe_combine(handle: Tensor, layer: int, ctx: Tensor, counts: Tensor, expert_out: Tensor, gates: Tensor) -> Tensor:
    h = layer_handles.resolve(handle, layer)
    validate.check_plan_handles(h, ctx, counts)
    validate.check_received_rows("expert_out", h, expert_out)
    validate.check_combine_gates(h, gates)  # y's shape comes from it
    y = expert_out.new_empty((h.num_local_ranks, gates.shape[1], h.hidden))
    rows_calls.run_step(rows_calls.COMBINE, h, ctx, counts, expert_out, y)
    return y


def _moe_combine_fake(handle, layer, ctx, counts, expert_out, gates):
    layer_handles.check_handle(handle)
    h = layer_handles.traced(layer)
    validate.check_received_rows("expert_out", h, expert_out)
    validate.check_combine_gates(h, gates)
    return expert_out.new_empty((h.num_local_ranks, gates.shape[1], h.hidden))


def _moe_combine_backward(handle: Tensor, layer: int, ctx: Tensor, counts: Tensor, dy: Tensor, num_recv: int) -> tuple[Tensor, Tensor]:
    h = layer_handles.resolve(handle, layer)
    validate.check_plan_handles(h, ctx, counts)
    validate.check_token_rows("dy", h, dy)
    d_out = dy.new_empty((num_recv, h.hidden))
    dgates = torch.empty((dy.shape[0], dy.shape[1], h.topk), dtype=torch.float32, device=dy.device)
    rows_calls.run_step(rows_calls.COMBINE_BACKWARD, h, ctx, counts, dy, d_out, dgates)
    return d_out, dgates


def _moe_combine_backward_fake(handle, layer, ctx, counts, dy, num_recv):
    layer_handles.check_handle(handle)
    h = layer_handles.traced(layer)
    validate.check_token_rows("dy", h, dy)
    return dy.new_empty((num_recv, h.hidden)), dy.new_empty((dy.shape[0], dy.shape[1], h.topk), dtype=torch.float32)


def _dispatch_setup(ctx, inputs, output):
    handle, layer, context, counts, x = inputs
    ctx.layer, ctx.num_tokens = layer, x.shape[1]
    ctx.save_for_backward(handle, context, counts)


def _dispatch_grad(ctx, d_recv):
    handle, context, counts = ctx.saved_tensors
    dx = torch.ops.rdep.moe_dispatch_backward(handle, ctx.layer, context, counts, d_recv.contiguous(), ctx.num_tokens)
    return None, None, None, None, dx


def _combine_setup(ctx, inputs, output):
    handle, layer, context, counts, expert_out, _gates = inputs
    ctx.layer, ctx.num_recv = layer, expert_out.shape[0]
    ctx.save_for_backward(handle, context, counts)


def _combine_grad(ctx, dy):
    handle, context, counts = ctx.saved_tensors
    d_out, dgates = torch.ops.rdep.moe_combine_backward(handle, ctx.layer, context, counts, dy.contiguous(), ctx.num_recv)
    return None, None, None, None, d_out, dgates


def _no_double_backward(ctx, *grads):
    raise RuntimeError("rdep's dispatch/combine backward ops have no derivative: double backward (create_graph=True "
                       "through rdep.torch.dispatch/combine) is not supported")


moe_plan = op_library.define("moe_plan", PLAN_SCHEMA, _moe_plan, _moe_plan_fake)
moe_dispatch = op_library.define("moe_dispatch", DISPATCH_SCHEMA, _moe_dispatch, _moe_dispatch_fake)
moe_dispatch_backward = op_library.define("moe_dispatch_backward", DISPATCH_BACKWARD_SCHEMA, _moe_dispatch_backward,
                                          _moe_dispatch_backward_fake)
moe_combine = op_library.define("moe_combine", COMBINE_SCHEMA, _moe_combine, _moe_combine_fake)
moe_combine_backward = op_library.define("moe_combine_backward", COMBINE_BACKWARD_SCHEMA, _moe_combine_backward,
                                         _moe_combine_backward_fake)
op_library.register_autograd(moe_dispatch, _dispatch_grad, setup_context=_dispatch_setup)
op_library.register_autograd(moe_combine, _combine_grad, setup_context=_combine_setup)
op_library.register_autograd(moe_dispatch_backward, _no_double_backward, setup_context=lambda ctx, inputs, output: None)
op_library.register_autograd(moe_combine_backward, _no_double_backward, setup_context=lambda ctx, inputs, output: None)


class RoutingPlan:
    """One forward's routing through a layer (see the module docstring): made by plan(), used once by
    dispatch() and combine(). tokens_per_expert [E_local] int64 (CPU) are the rows this process receives
    per local expert; num_recv their sum."""

    def __init__(self, layer: Layer, ctx: Tensor, counts: Tensor, gates: Tensor, tokens_first: bool):
        self.layer, self.ctx, self.tokens_per_expert, self.gates = layer, ctx, counts, gates
        self._tokens_first = tokens_first  # x came as [n, H] (one local rank)

    @property
    def num_tokens(self) -> int:
        return self.gates.shape[1]

    @property
    def num_recv(self) -> int:
        return int(self.tokens_per_expert.sum())

    def row_ids(self) -> Tensor:
        """The received rows' ids [M] int64 (CPU): (source rank * T + token) * K + slot; after dispatch."""
        return rows_calls.row_ids(self.layer, self.ctx, self.tokens_per_expert)

    def __repr__(self) -> str:
        return f"rdep.torch.RoutingPlan(layer={self.layer.id}, tokens={self.num_tokens}, local experts={self.layer.num_local_experts})"


def _layer_of(layer) -> Layer:
    return layer if isinstance(layer, Layer) else get_layer(layer)


def _as_ranks(name: str, t: Tensor, layer: Layer) -> tuple[Tensor, bool]:
    """[L, n, ...] as is; [n, ...] with one local rank as [1, n, ...]."""
    if isinstance(t, Tensor) and t.dim() == 2 and layer.num_local_ranks == 1:
        return t.unsqueeze(0), True
    return t, False


def plan(layer, experts: Tensor, gates: Tensor) -> RoutingPlan:
    """The routing plan of one forward (collective over the layer's ranks). layer is an rdep.torch.Layer
    (or its id); experts int32 and gates fp32, [L, n, K] or [n, K] with one local rank."""
    h = _layer_of(layer)
    experts3, squeezed = _as_ranks("experts", experts, h)
    gates3, _ = _as_ranks("gates", gates, h)
    ctx, counts = torch.ops.rdep.moe_plan(h.handle, h.rep, experts3, gates3)
    return RoutingPlan(h, ctx, counts, gates3, squeezed)


def dispatch(plan: RoutingPlan, x: Tensor) -> Tensor:
    """The received rows [M, H] of this process's experts for the tokens x (collective)."""
    x3, _ = _as_ranks("x", x, plan.layer)
    if isinstance(x3, Tensor) and x3.dim() == 3 and x3.shape[1] != plan.num_tokens:
        raise ValueError(f"x: {x3.shape[1]} tokens per rank, but the plan routed {plan.num_tokens}")
    return torch.ops.rdep.moe_dispatch(plan.layer.handle, plan.layer.rep, plan.ctx, plan.tokens_per_expert, x3)


def combine(plan: RoutingPlan, expert_out: Tensor) -> Tensor:
    """y_t = sum_k g'_k expert_out(t, k) (collective), in the layout x had; its gradient reaches expert_out
    and the gates given to plan."""
    y = torch.ops.rdep.moe_combine(plan.layer.handle, plan.layer.rep, plan.ctx, plan.tokens_per_expert, expert_out, plan.gates)
    return y.squeeze(0) if plan._tokens_first else y
