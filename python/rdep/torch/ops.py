"""rdep's custom ops (namespace "rdep"), their fake implementations and their autograd formula, and the
functional entry point `moe`.

    rdep::moe_forward(Tensor handle, int layer, Tensor x, Tensor experts, Tensor gates, Tensor w1, Tensor w2,
                      bool save_context=True, bool check_routing=True) -> (Tensor y, Tensor ctx)
    rdep::moe_backward(Tensor handle, int layer, Tensor ctx, Tensor dy, Tensor w1, Tensor w2)
                      -> (Tensor dx, Tensor dgates, Tensor dw1, Tensor dw2)

`handle` is rdep.torch.Layer.handle (the layer the call runs on, found by the tensor's address) and `layer` is
Layer.rep (the oldest live layer configured alike, read by the fake implementations): layer_handles.py; x [L, n, H], experts int32 [L, n, K], gates fp32 [L, n, K] (L = the layer's
local ranks), w1 [E_local, H, 2F], w2 [E_local, F, H] (the local ranks' experts, in order). y has x's
shape and dtype; ctx is a 0-dim int64 CPU tensor naming the forward's saved state (layer_calls.py);
dw1, dw2 are fp32, or bf16 for bf16 weights on CUDA with one segment (ops._grad_dtype). Autograd: moe_forward's backward calls moe_backward, which releases the context;
gradients reach x, gates, w1 and w2 (experts is an index tensor). Double backward is not supported.

The capturable pair (graph_contexts.py), which rdep.torch.moe calls where Layer.capturable, so that CUDA graphs
record the layer:

    rdep::moe_forward_capturable(Tensor handle, int layer, Tensor x, Tensor experts, Tensor gates, Tensor w1,
                                 Tensor w2, int row_bytes, bool keep_casts, bool save_context=True,
                                 bool check_routing=True) -> (Tensor y, Tensor ctx, Tensor rows, Tensor w1c, Tensor w2c)
    rdep::moe_backward_capturable(Tensor handle, int layer, Tensor ctx, Tensor rows, Tensor w1c, Tensor w2c,
                                  Tensor dy, Tensor w1, Tensor w2) -> (Tensor dx, Tensor dgates, Tensor dw1, Tensor dw2)

ctx is a 0-dim int64 tensor on x's device, found by its address; rows (uint8 [row_bytes]) holds the context's saved
rows; w1c, w2c are the bf16 casts of fp32 weights kept for the backward (keep_casts), else empty; row_bytes and
keep_casts must be the layer's (Layer.row_bytes, keep_weight_casts).

    y = rdep.torch.moe(layer, x, experts, gates, w1, w2)   # saves a context only when grad is needed
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import eager_ext, graph_contexts, layer_calls, layer_handles, validate
from .layer import Layer, get_layer
from . import op_library


def _layer_weights(layer: Layer, w1: Tensor, w2: Tensor) -> tuple[Tensor, Tensor]:
    """The weights as the layer reads them: bf16 on CUDA (fp32 master weights cast here), fp32 on the host."""
    want = validate.ACT_DTYPE[layer.backend]
    return (w1 if w1.dtype == want else w1.to(want)), (w2 if w2.dtype == want else w2.to(want))


class _CastSource:
    """What kept casts were made from: the weights' storages (held, so that their memory cannot be reused by
    other tensors while the casts are kept) and each tensor's address, version counter (an in-place update
    bumps it; views, such as those a compiled graph makes, share it), dtype, shape and strides. A backward
    given other weights, or these updated since, casts again. Writes that bypass the version counter
    (through `.data`, `set_`) are not seen, as autograd's own check of saved tensors does not see them."""

    def __init__(self, w1: Tensor, w2: Tensor):
        self.storages = (w1.untyped_storage(), w2.untyped_storage())
        self.state = self._state(w1, w2)

    @staticmethod
    def _state(w1: Tensor, w2: Tensor) -> tuple:
        return tuple((w.untyped_storage()._cdata, w.data_ptr(), w._version, w.dtype, tuple(w.shape), w.stride())
                     for w in (w1, w2))

    def matches(self, w1: Tensor, w2: Tensor) -> bool:
        return self.state == self._state(w1, w2)


def _keep(layer: Layer, w1: Tensor, w2: Tensor, w1c: Tensor, w2c: Tensor, save_context: bool):
    """The casts to keep for backward (keep_weight_casts), or None: only when a cast was made, a context
    is saved, and the weights carry version counters (not inference tensors)."""
    if not (layer.keep_weight_casts and save_context and w1c is not w1) or w1.is_inference() or w2.is_inference():
        return None
    return (w1c, w2c, _CastSource(w1, w2))


FORWARD_SCHEMA = ("(Tensor handle, int layer, Tensor x, Tensor experts, Tensor gates, Tensor w1, Tensor w2, "
                  "bool save_context=True, bool check_routing=True) -> (Tensor, Tensor)")
BACKWARD_SCHEMA = "(Tensor handle, int layer, Tensor ctx, Tensor dy, Tensor w1, Tensor w2) -> (Tensor, Tensor, Tensor, Tensor)"
# The capturable pair: the forward also returns the saved rows (one uint8 tensor) and the weights' kept bf16 casts
# (keep_weight_casts; else empty tensors), which the backward takes: every tensor it keeps is one autograd saves.
# row_bytes and keep_casts are the layer's (Layer.row_bytes, keep_weight_casts), passed so that the outputs' shapes
# follow from the arguments: a compiled graph holds them as constants, so inductor's caches (keyed by the graph)
# never serve a graph traced for another layer configuration.
CAPTURABLE_FORWARD_SCHEMA = ("(Tensor handle, int layer, Tensor x, Tensor experts, Tensor gates, Tensor w1, Tensor w2, int row_bytes, "
                             "bool keep_casts, bool save_context=True, bool check_routing=True) "
                             "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
CAPTURABLE_BACKWARD_SCHEMA = ("(Tensor handle, int layer, Tensor ctx, Tensor rows, Tensor w1c, Tensor w2c, Tensor dy, Tensor w1, "
                              "Tensor w2) -> (Tensor, Tensor, Tensor, Tensor)")


# The real implementations find the layer by its handle; the fake ones read the representative `layer`, whose id a
# compiled graph holds as a constant (layer_handles.py).
def _moe_forward(handle: Tensor, layer: int, x: Tensor, experts: Tensor, gates: Tensor, w1: Tensor, w2: Tensor,
                save_context: bool = True, check_routing: bool = True) -> tuple[Tensor, Tensor]:
    h = layer_handles.resolve(handle, layer)
    validate.check_forward(h, x, experts, gates, w1, w2)
    w1c, w2c = _layer_weights(h, w1, w2)
    keep = _keep(h, w1, w2, w1c, w2c, save_context)
    return layer_calls.forward(h, x, experts, gates, w1c, w2c, save_context, keep_casts=keep, check_routing=check_routing,
                               hold=save_context and _hooks_copy_saved())


def _moe_forward_fake(handle, layer, x, experts, gates, w1, w2, save_context=True, check_routing=True):
    layer_handles.check_handle(handle)
    validate.check_forward(layer_handles.traced(layer), x, experts, gates, w1, w2)
    return torch.empty_like(x), torch.empty((), dtype=torch.int64, device="cpu")


def _keeps_casts(h: Layer, w1: Tensor, keep_casts: bool, save_context: bool) -> bool:
    """Whether the capturable forward returns its weight casts for the backward: keep_weight_casts, a saved
    context, and weights in another dtype than the layer's (fp32 master weights on CUDA)."""
    return keep_casts and save_context and w1.dtype != validate.ACT_DTYPE[h.backend]


def _moe_forward_capturable(handle: Tensor, layer: int, x: Tensor, experts: Tensor, gates: Tensor, w1: Tensor, w2: Tensor,
                            row_bytes: int, keep_casts: bool, save_context: bool = True,
                            check_routing: bool = True) -> tuple[Tensor, ...]:
    h = layer_handles.resolve(handle, layer)
    validate.check_forward(h, x, experts, gates, w1, w2)
    validate.check_capturable_args(h, row_bytes, keep_casts)
    w1c, w2c = _layer_weights(h, w1, w2)
    y, ctx, rows = layer_calls.forward(h, x, experts, gates, w1c, w2c, save_context, check_routing=check_routing,
                                       device_ctx=True, hold=save_context and _hooks_copy_saved())
    if _keeps_casts(h, w1, keep_casts, save_context):
        return y, ctx, rows, w1c, w2c
    act = validate.ACT_DTYPE[h.backend]
    return y, ctx, rows, w1.new_empty((0,), dtype=act), w2.new_empty((0,), dtype=act)


def _moe_forward_capturable_fake(handle, layer, x, experts, gates, w1, w2, row_bytes, keep_casts, save_context=True,
                                 check_routing=True):
    layer_handles.check_handle(handle)
    h = layer_handles.traced(layer)
    validate.check_forward(h, x, experts, gates, w1, w2)
    validate.check_capturable_args(h, row_bytes, keep_casts)
    act = validate.ACT_DTYPE[h.backend]
    keep = _keeps_casts(h, w1, keep_casts, save_context)
    return (torch.empty_like(x), torch.empty((), dtype=torch.int64, device=x.device),
            torch.empty(row_bytes, dtype=torch.uint8, device=x.device),
            w1.new_empty(w1.shape if keep else (0,), dtype=act), w2.new_empty(w2.shape if keep else (0,), dtype=act))


def _moe_backward(handle: Tensor, layer: int, ctx: Tensor, dy: Tensor, w1: Tensor, w2: Tensor, *,
                  device_ctx: bool = False, casts=None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """casts: the capturable forward's kept casts (w1c, w2c), which autograd saved with w1, w2."""
    return _backward_on(layer_handles.resolve(handle, layer), ctx, dy, w1, w2, device_ctx=device_ctx, casts=casts)


def _backward_on(h: Layer, ctx: Tensor, dy: Tensor, w1: Tensor, w2: Tensor, *, device_ctx: bool,
                 casts, rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward of both op pairs on the layer their handle named (rows: the capturable pair's)."""
    validate.check_backward(h, ctx, dy, w1, w2, device_ctx=device_ctx)
    grad_dtype = _grad_dtype(h, w1)
    kept = None if device_ctx else layer_calls.kept_casts(h, ctx)  # the forward's casts, when made from these weights
    if casts is not None:
        w1, w2 = casts
    elif kept is not None and kept[2].matches(w1, w2):
        w1, w2 = kept[0], kept[1]
        if w1.is_cuda:  # made on the forward's stream, read on this one: not reused before this backward ends
            stream = torch.cuda.current_stream(w1.device)
            w1.record_stream(stream)
            w2.record_stream(stream)
    elif _casts_in_grads(h, w1, w2, grad_dtype):
        return layer_calls.backward(h, ctx, dy, w1, w2, grad_dtype, casts_in_grads=True, device_ctx=device_ctx,
                                    rows=rows)
    else:
        w1, w2 = _layer_weights(h, w1, w2)
    return layer_calls.backward(h, ctx, dy, w1, w2, grad_dtype, device_ctx=device_ctx, rows=rows)


def _moe_backward_capturable(handle: Tensor, layer: int, ctx: Tensor, rows: Tensor, w1c: Tensor, w2c: Tensor, dy: Tensor,
                             w1: Tensor, w2: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """rows (the forward's third output): the context's saved rows are pieces of it, and taking it keeps it alive (and,
    in a compiled graph, saved) until this backward; where a saved-tensor hook moved it, the context reads the copy
    (graph_contexts.follow_rows). w1c, w2c: the forward's kept casts of w1, w2 (read in their place), or empty (cast
    here, as the plain backward does)."""
    h = layer_handles.resolve(handle, layer)
    validate.check_rows(h, rows)
    keep = validate.check_kept_casts(h, w1c, w2c, w1, w2)
    return _backward_on(h, ctx, dy, w1, w2, device_ctx=True, casts=(w1c, w2c) if keep else None, rows=rows)


def _one_segment(layer: Layer) -> bool:
    """Whether every forward of the layer runs in one segment (segment_tokens 0 or at least W*T)."""
    return layer.segment_tokens == 0 or layer.segment_tokens >= layer.world_size * layer.max_tokens


def _layer_reads_casts_in_grads(layer: Layer) -> bool:
    """The layer's part of _casts_in_grads: its backward reads each weight before it writes that weight's gradient
    (C ABI 13: CUDA, CUTLASS compute, one segment, no balancing, one node). Also read by eager_ext.py."""
    return (layer.backend == "cuda" and layer.expert_compute == "cutlass" and layer.balance == "off" and layer.nodes <= 1
            and _one_segment(layer))


def _casts_in_grads(layer: Layer, w1: Tensor, w2: Tensor, grad_dtype: torch.dtype) -> bool:
    """Whether the backward's bf16 casts of fp32 master weights go into the fp32 gradient buffers it is about
    to write (layer_calls.backward): where the layer's backward reads each weight before it writes that
    weight's gradient (_layer_reads_casts_in_grads), so that no separate copy of the weights (3 * H * F * 2 bytes
    an expert) is alive during the backward."""
    return (_layer_reads_casts_in_grads(layer) and grad_dtype == torch.float32 and w1.dtype == torch.float32
            and w2.dtype == torch.float32)


def _layer_writes_bf16_grads(layer: Layer) -> bool:
    """The layer's part of _grad_dtype: bf16 weights get bf16 gradients on CUDA when every forward runs in one segment
    and balancing is off. Also read by eager_ext.py."""
    # With balancing, replica gradients are reduced into fp32 main-expert gradients (the layer refuses bf16 ones).
    return layer.backend == "cuda" and _one_segment(layer) and layer.balance == "off"


def _grad_dtype(layer: Layer, w1: Tensor) -> torch.dtype:
    """The weight gradients' dtype: bf16 for bf16 weights on CUDA when the forward ran in one segment
    (the layer's GEMMs write them directly), fp32 otherwise (fp32 master weights, the host backend,
    several segments, whose gradients accumulate in fp32, or balancing, whose replica gradients are
    added into fp32 ones)."""
    if w1.dtype == torch.bfloat16 and _layer_writes_bf16_grads(layer):
        return torch.bfloat16
    return torch.float32


def _moe_backward_fake(handle, layer, ctx, dy, w1, w2):
    layer_handles.check_handle(handle)
    h = layer_handles.traced(layer)
    validate.check_backward(h, ctx, dy, w1, w2)
    return _backward_outputs_like(h, dy, w1, w2)


def _moe_backward_capturable_fake(handle, layer, ctx, rows, w1c, w2c, dy, w1, w2):
    layer_handles.check_handle(handle)
    h = layer_handles.traced(layer)
    validate.check_rows(h, rows)
    validate.check_kept_casts(h, w1c, w2c, w1, w2)
    validate.check_backward(h, ctx, dy, w1, w2, device_ctx=True)
    return _backward_outputs_like(h, dy, w1, w2)


def _backward_outputs_like(h: Layer, dy, w1, w2):
    L, n, K = dy.shape[0], dy.shape[1], h.topk
    g = _grad_dtype(h, w1)
    return (torch.empty_like(dy), dy.new_empty((L, n, K), dtype=torch.float32),
            w1.new_empty(w1.shape, dtype=g), w2.new_empty(w2.shape, dtype=g))


def _no_zero_grads(ctx, y: Tensor) -> None:
    """The outputs other than y (ctx, the saved rows, the kept casts) get no gradient: without this autograd
    would fill a zero tensor for each before every backward (for the rows, row_bytes of memset a call: 36 µs
    of 1.05 ms at the example's layer shape, H200). y's gradient is then None only where y reached no loss
    (zeros made here, as autograd would)."""
    ctx.set_materialize_grads(False)
    ctx.y_like = (y.shape, y.dtype, y.device)


def _setup_context(ctx, inputs, output):
    handle, layer, _x, _experts, _gates, w1, w2, save_context, _check_routing = inputs
    y, context = output
    _no_zero_grads(ctx, y)
    ctx.layer = layer
    ctx.saved_context = save_context
    ctx.backward_ran = False
    ctx.save_for_backward(handle, context, w1, w2)
    if save_context:
        _keep_by_node(ctx, handle, layer, context, capturable=False)


def _setup_capturable_context(ctx, inputs, output):
    handle, layer, _x, _experts, _gates, w1, w2, _row_bytes, _keep, save_context, _check_routing = inputs
    y, context, rows, w1c, w2c = output
    ctx.mark_non_differentiable(context, rows, w1c, w2c)  # saved state, not results: no gradient flows into them
    _no_zero_grads(ctx, y)
    ctx.layer = layer
    ctx.saved_context = save_context
    ctx.backward_ran = False
    ctx.save_for_backward(handle, context, rows, w1c, w2c, w1, w2)
    if save_context:
        _keep_by_node(ctx, handle, layer, context, capturable=True)


def _keep_by_node(ctx, handle, layer, context: Tensor, capturable: bool) -> None:
    """A forward under saved-tensor hooks that may copy ctx keeps its context past the death of the ctx it returned
    (_hooks_copy_saved; held by the layer until its backward or close). Called eagerly (real tensors; not while
    AOTAutograd traces, whose compiled graphs keep the layer's hold), the hold moves to the autograd node: the node keeps
    the original ctx alive, so a graph dropped without backward still releases the context."""
    if _saved_tensor_hooks() is None:
        return  # no hooks: nothing was held (the common case; the hooks are those the kernel saw)
    if type(context) is not torch.Tensor or type(handle) is not torch.Tensor:
        return  # traced (FakeTensor, FunctionalTensor): the compiled graph's runs keep the layer's hold
    h = layer_handles.resolve(handle, layer)
    with h._native.lock:
        moved = graph_contexts.keep_by_node(h._native, context) if capturable else layer_calls.keep_by_node(h, context)
    if moved:
        ctx.held_ctx = context  # an int64 tensor no gradient flows through: no reference cycle


def _autograd_formula(backward_op, capturable: bool):
    """moe_forward's (or moe_forward_capturable's) backward: calls backward_op, which releases the context."""

    def formula(ctx, dy, *_dsaved):
        if not ctx.saved_context:
            raise RuntimeError("rdep::moe_forward ran with save_context=False, so it kept no state for a backward "
                               "(rdep.torch.moe passes save_context=True whenever grad is enabled and an input requires grad)")
        if ctx.backward_ran:
            raise RuntimeError("rdep::moe_forward: a second backward through the same forward (retain_graph=True) is not "
                               "supported; the layer's backward consumes the forward's saved state. Run the forward again.")
        ctx.backward_ran = True
        if dy is None:
            shape, dtype, device = ctx.y_like
            dy = torch.zeros(shape, dtype=dtype, device=device)
        saved = ctx.saved_tensors
        if capturable:
            handle, context, rows, w1c, w2c, w1, w2 = saved
            args = (handle, ctx.layer, context, rows, w1c, w2c, dy.contiguous(), w1, w2)
        else:
            handle, context, w1, w2 = saved
            args = (handle, ctx.layer, context, dy.contiguous(), w1, w2)
        if op_library.direct_ok(dy, *saved):
            dx, dgates, dw1, dw2 = op_library.call(backward_op, *args)
        else:
            dx, dgates, dw1, dw2 = backward_op(*args)
        grads = (None, None, dx, None, dgates, dw1.to(w1.dtype), dw2.to(w2.dtype))
        return grads + (None,) * (4 if capturable else 2)

    return formula


moe_forward = op_library.define("moe_forward", FORWARD_SCHEMA, _moe_forward, _moe_forward_fake)
moe_backward = op_library.define("moe_backward", BACKWARD_SCHEMA, _moe_backward, _moe_backward_fake)
op_library.register_autograd(moe_forward, _autograd_formula(moe_backward, False), setup_context=_setup_context)
# The capturable pair (graph_contexts.py): ctx on x's device, named by its address, the saved rows a tensor
# autograd keeps, and no cudagraph_unsafe tag.
moe_forward_capturable = op_library.define("moe_forward_capturable", CAPTURABLE_FORWARD_SCHEMA, _moe_forward_capturable,
                                           _moe_forward_capturable_fake, capturable=True)
moe_backward_capturable = op_library.define("moe_backward_capturable", CAPTURABLE_BACKWARD_SCHEMA,
                                            _moe_backward_capturable, _moe_backward_capturable_fake, capturable=True)
op_library.register_autograd(moe_forward_capturable, _autograd_formula(moe_backward_capturable, True),
                             setup_context=_setup_capturable_context)


def _double_backward(ctx, *grads):
    raise RuntimeError("rdep::moe_backward has no derivative: double backward (create_graph=True through an rdep "
                       "MoE layer) is not supported")


# Registered so that a create_graph=True backward fails with that message when differentiated again,
# rather than with autograd's generic missing-kernel error.
for _op in (moe_backward, moe_backward_capturable):
    op_library.register_autograd(_op, _double_backward, setup_context=lambda ctx, inputs, output: None)


_top_saved_tensor_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _saved_tensor_hooks():
    """The innermost saved-tensor hooks set, (pack, unpack), or None (also on a torch without the query). Such hooks
    act on autograd's saved tensors: non-reentrant activation checkpointing drops them after the forward and
    recomputes them in the backward; save_on_cpu (or a caller's torch.autograd.graph.saved_tensors_hooks) copies
    them to host memory and back."""
    return None if _top_saved_tensor_hooks is None else _top_saved_tensor_hooks(False)


def _recomputes(hooks) -> bool:
    """Whether hooks are activation checkpointing's (torch.utils.checkpoint, non-reentrant: its forward's hooks and
    its recomputation's), which drop the saved tensors after the forward."""
    return getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


def _hooks_copy_saved() -> bool:
    """Whether saved-tensor hooks other than checkpointing's are set (save_on_cpu, activation offloading, a caller's
    torch.autograd.graph.saved_tensors_hooks), read by the ops' kernels when they run (also inside a compiled graph,
    whose saved activations pass through the hooks set when it runs). Such hooks may hand the backward a copy of ctx
    and drop the tensor the forward returned, whose death would otherwise release the context (a dropped graph): the
    context is then held until its backward or the layer's close (layer_calls.forward's hold). Checkpointing's hooks
    drop the saved tensors on purpose (the recomputation makes another context): not held."""
    hooks = _saved_tensor_hooks()
    return hooks is not None and not _recomputes(hooks)


def moe(layer, x: Tensor, experts: Tensor, gates: Tensor, w1: Tensor, w2: Tensor, *, check_routing: bool = True) -> Tensor:
    """y = sum_k g'_k expert_{e_k}(x) for the local ranks' tokens, through rdep (see the module docstring).

    layer is an rdep.torch.Layer (or its id). A context is saved for backward only when grad is enabled
    and one of x, gates, w1, w2 requires grad; otherwise it is released inside the call. check_routing
    (CUDA, no context saved): wait for the device's check of the routing before releasing the context, so
    that a bad slot raises here (the sync-free CUTLASS forward does not wait for it, and no backward will
    report it); False skips that wait, for routing known to be valid (rdep.torch.MoE's own router)."""
    h = get_layer(layer) if isinstance(layer, int) else layer
    save = torch.is_grad_enabled() and (x.requires_grad or gates.requires_grad or w1.requires_grad or w2.requires_grad)
    direct = op_library.direct_ok(x, experts, gates, w1, w2)  # eager: no trace, mode or transform needs the dispatcher
    # Saved-tensor hooks (_saved_tensor_hooks), read where the call runs eagerly (not while torch.compile traces):
    # under checkpointing's the plain ops, whose context and rows go back with the ctx tensor the checkpoint drops
    # (the C++ path's node would keep them to the backward); under other hooks the C++ path, whose rows no hook can
    # move, else the plain ops, whose rows are the library's (the capturable ops' rows are a saved device tensor, which
    # save_on_cpu moves: their context follows the copy, graph_contexts.follow_rows, which compiled graphs need).
    hooks = _saved_tensor_hooks() if save and not torch.compiler.is_compiling() else None
    if direct and save and (hooks is None or not _recomputes(hooks)):  # the C++ path (eager_ext.py), where it is
        y = eager_ext.forward(h, x, experts, gates, w1, w2)          # built and no capture runs
        if y is not None:
            return y
    if h.capturable and hooks is None:
        op, args = moe_forward_capturable, (h.handle, h.rep, x, experts, gates, w1, w2, h.row_bytes, h.keep_weight_casts,
                                            save, check_routing)
    else:
        op, args = moe_forward, (h.handle, h.rep, x, experts, gates, w1, w2, save, check_routing)
    if direct:  # the same kernel and formula as the op's, without the dispatcher
        return op_library.call(op, *args)[0]
    return op(*args)[0]
