"""The capturable ops (rdep::moe_forward_capturable / moe_backward_capturable) on the host backend: the same
results as the plain ops, their contexts named by the ctx tensor's address (graph_contexts.py) and released
after backward, when the graph is dropped, or never once pinned; bad contexts refused naming ctx; opcheck.
The CUDA graph captures themselves are in test_cuda_graphs.py (GPU)."""

from __future__ import annotations

import gc

import pytest
import torch

import rdep
import rdep.torch as rt
from rdep.torch import graph_contexts
from test_ops import make_inputs

FWD, BWD = torch.ops.rdep.moe_forward_capturable, torch.ops.rdep.moe_backward_capturable


def _layer(**kw):
    return rt.Layer(8, 6, 6, 2, 16, world_size=kw.pop("world_size", 2), **kw)


@pytest.mark.parametrize("requires", ["all", "w1 only", "none"])
def test_eager_call_without_the_dispatcher_matches_the_op(requires):
    """The capturable pair through op_library.call (the eager path rdep.torch.moe takes) and through the op: bitwise the
    same outputs and gradients, with every input, only w1, or none requiring grad; contexts released after each."""
    from rdep.torch import op_library

    layer = _layer(world_size=1, capacity_factor=0.7)
    inputs = make_inputs(layer, 16, "zipf")
    outs = []
    for direct in (True, False):
        x, ids, gates, w1, w2 = [t.clone() for t in inputs]
        leaves = {"x": x, "gates": gates, "w1": w1, "w2": w2}
        wanted = {"all": ("x", "gates", "w1", "w2"), "w1 only": ("w1",), "none": ()}[requires]
        for name in wanted:
            leaves[name].requires_grad_(True)
        args = (layer.handle, layer.rep, x, ids, gates, w1, w2, layer.row_bytes, layer.keep_weight_casts, bool(wanted), True)
        assert op_library.direct_ok(x, ids, gates, w1, w2)
        y = op_library.call(FWD.default, *args)[0] if direct else FWD(*args)[0]
        if wanted:
            grads = torch.autograd.grad(y, [leaves[n] for n in wanted], torch.linspace(-1, 1, y.numel()).reshape(y.shape))
        else:
            grads = ()
            assert y.grad_fn is None
        outs.append((y.detach(),) + tuple(grads))
        assert layer.live_contexts == 0
    assert len(outs[0]) == len(outs[1])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_same_results_as_the_plain_ops():
    """Forward and backward through autograd give bitwise what the plain ops give (the same C calls)."""
    layer = _layer(world_size=4, capacity_factor=0.7)
    inputs = make_inputs(layer, 16, "zipf")
    outs = []
    for op in (torch.ops.rdep.moe_forward, FWD):
        x, ids, gates, w1, w2 = [t.clone() for t in inputs]
        leaves = [t.requires_grad_(True) for t in (x, gates, w1, w2)]
        extra = (0, False) if op is FWD else ()
        y = op(layer.handle, layer.rep, leaves[0], ids, leaves[1], leaves[2], leaves[3], *extra, True)[0]
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
        outs.append([y.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(["y", "dx", "dgates", "dw1", "dw2"], outs[1], outs[0]):
        assert torch.equal(a, b), name
    assert layer.live_contexts == 0 and layer.pinned_contexts == 0


def test_ctx_is_a_token_on_the_layers_device_and_is_released_by_backward():
    """ctx: 0-dim int64 on x's device; rows: the saved rows' uint8 tensor (empty on the host backend, whose
    layer keeps its own rows: Layer.row_bytes 0)."""
    layer = _layer()
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    y, ctx, rows, w1c, w2c = FWD(layer.handle, layer.rep, x, ids, gates, w1, w2, 0, False, True)
    assert layer.row_bytes == 0 and rows.dtype == torch.uint8 and rows.shape == (0,) and rows.device == x.device
    assert w1c.shape == (0,) and w2c.shape == (0,)  # fp32 weights are the host backend's own: nothing cast
    assert ctx.device == x.device and ctx.dtype == torch.int64 and ctx.dim() == 0 and int(ctx) >= 0
    assert layer.live_contexts == 1 and layer.context_bytes() > 0
    BWD(layer.handle, layer.rep, ctx, rows, w1c, w2c, torch.ones_like(y), w1, w2)
    assert layer.live_contexts == 0
    with pytest.raises(rdep.FailedPreconditionError, match=r"ctx: no live context of layer \d+ is named by this tensor"):
        BWD(layer.handle, layer.rep, ctx, rows, w1c, w2c, torch.ones_like(y), w1, w2)  # one backward per forward


def test_grad_off_saves_nothing():
    layer = _layer()
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    y, ctx, rows, w1c, w2c = FWD(layer.handle, layer.rep, x, ids, gates, w1, w2, 0, False, False)
    assert layer.live_contexts == 0 and int(ctx) == -1
    with pytest.raises(rdep.FailedPreconditionError, match="no live context"):
        BWD(layer.handle, layer.rep, ctx, rows, w1c, w2c, torch.ones_like(y), w1, w2)


def test_a_dropped_graph_releases_its_context_at_the_next_forward():
    """A ctx freed without backward: its entry is released by the layer's next capturable forward (or when
    live_contexts is read), whether or not the new ctx lands at the freed one's address."""
    layer = _layer()
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    w1.requires_grad_(True)
    for _ in range(3):
        y, ctx, rows, w1c, w2c = FWD(layer.handle, layer.rep, x, ids, gates, w1, w2, 0, False, True)
        assert len(layer._native.live) == 1
        del y, ctx, rows, w1c, w2c
        gc.collect()
    assert len(layer._native.live) == 1  # not swept yet
    y, ctx, rows, w1c, w2c = FWD(layer.handle, layer.rep, x, ids, gates, w1, w2, 0, False, True)
    assert layer.live_contexts == 1  # the dropped ones were released, this one is live
    BWD(layer.handle, layer.rep, ctx, rows, w1c, w2c, torch.ones_like(y), w1, w2.detach())
    assert layer.live_contexts == 0
    y, ctx, rows, w1c, w2c = FWD(layer.handle, layer.rep, x, ids, gates, w1, w2, 0, False, True)
    del y, ctx, rows, w1c, w2c
    assert layer.live_contexts == 0  # reading it sweeps


def test_a_tensor_that_is_no_ctx_is_refused():
    """A tensor at no entry's address is looked up by its value, the token (as the plain ops' copies of ctx
    are): a value no live context has is refused, as are wrong shapes and dtypes; a copy of ctx works."""
    layer = _layer()
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    y, ctx, rows, w1c, w2c = FWD(layer.handle, layer.rep, x, ids, gates, w1, w2, 0, False, True)
    with pytest.raises(rdep.FailedPreconditionError, match="no live context"):
        BWD(layer.handle, layer.rep, torch.full((), 12345, dtype=torch.int64), rows, w1c, w2c, torch.ones_like(y), w1, w2)
    with pytest.raises(ValueError, match=r"ctx: expected shape \[\]"):
        BWD(layer.handle, layer.rep, torch.zeros(1, dtype=torch.int64), rows, w1c, w2c, torch.ones_like(y), w1, w2)
    with pytest.raises(TypeError, match="ctx: expected dtype torch.int64"):
        BWD(layer.handle, layer.rep, ctx.int(), rows, w1c, w2c, torch.ones_like(y), w1, w2)
    with pytest.raises(ValueError, match=r"w2c: expected shape \[0\] \(the kept cast moe_forward_capturable returned\)"):
        BWD(layer.handle, layer.rep, ctx, rows, w1c, w2, torch.ones_like(y), w1, w2)  # kept casts: both or neither
    with pytest.raises(ValueError, match=r"rows: expected shape \[0\] \(the saved rows moe_forward_capturable returned\)"):
        BWD(layer.handle, layer.rep, ctx, torch.zeros(3, dtype=torch.uint8), w1c, w2c, torch.ones_like(y), w1, w2)
    BWD(layer.handle, layer.rep, ctx.clone(), rows, w1c, w2c, torch.ones_like(y), w1, w2)  # a copy names the same context
    assert layer.live_contexts == 0


def test_pinned_contexts_are_kept_and_refuse_an_eager_backward_after_theirs():
    """What a capture leaves (simulated on the host: the entry pinned as a recorded forward pins it): backward
    keeps the context, a second eager backward is refused naming the cause, and nothing is released."""
    layer = _layer()
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    y, ctx, rows, w1c, w2c = FWD(layer.handle, layer.rep, x, ids, gates, w1, w2, 0, False, True)
    native = layer._native
    e = graph_contexts.entry_of(native, ctx)
    e.pinned = True
    native.pinned.add(e.c_id)
    assert layer.live_contexts == 0 and layer.pinned_contexts == 1
    BWD(layer.handle, layer.rep, ctx, rows, w1c, w2c, torch.ones_like(y), w1, w2)  # the first backward runs on it
    assert layer.pinned_contexts == 1
    with pytest.raises(rdep.FailedPreconditionError, match="recorded in a CUDA graph whose backward already ran"):
        BWD(layer.handle, layer.rep, ctx, rows, w1c, w2c, torch.ones_like(y), w1, w2)
    del y, ctx, rows, w1c, w2c
    gc.collect()
    FWD(layer.handle, layer.rep, x, ids, gates, w1, w2, 0, False, False)  # a sweep does not release pinned contexts
    assert layer.pinned_contexts == 1 and e.c_id in native.live.values()
    with pytest.raises(rdep.FailedPreconditionError, match="names a context a CUDA graph recorded"):
        torch.ops.rdep.moe_backward(layer.handle, layer.rep, torch.tensor(e.c_id >> 32), torch.ones_like(x), w1, w2)  # the plain op
    native.release(e.c_id, e.c_id >> 32)  # no path but release_graph_contexts and close releases it
    assert layer.pinned_contexts == 1
    assert layer.release_graph_contexts() == 1
    assert layer.pinned_contexts == 0 and layer.live_contexts == 0 and not native.live


def test_opcheck():
    """opcheck on the forward (schema, autograd registration, fake tensor, AOT dispatch with its gradients)
    and on the backward's utilities that run it once per forward (as test_ops.test_opcheck_backward)."""
    layer = _layer(world_size=4, capacity_factor=0.7)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "zipf")
    grads = [t.clone().requires_grad_(True) for t in (x, gates, w1, w2)]
    torch.library.opcheck(FWD.default, (layer.handle, layer.rep, grads[0], ids, grads[1], grads[2], grads[3], 0, False, True))
    torch.library.opcheck(FWD.default, (layer.handle, layer.rep, x, ids, gates, w1, w2, 0, False, False))
    for util in ("test_schema", "test_autograd_registration", "test_faketensor"):
        _, ctx, rows, w1c, w2c = FWD(layer.handle, layer.rep, x, ids, gates, w1, w2, 0, False, True)
        dy = torch.randn_like(x).requires_grad_(util == "test_autograd_registration")
        torch.library.opcheck(BWD.default, (layer.handle, layer.rep, ctx, rows, w1c, w2c, dy, w1, w2), test_utils=util)
    gc.collect()
    FWD(layer.handle, layer.rep, x, ids, gates, w1, w2, 0, False, False)  # sweeps what opcheck dropped
    assert layer.live_contexts == 0


def test_schemas_and_tags():
    assert str(FWD.default._schema) == (
        "rdep::moe_forward_capturable(Tensor handle, int layer, Tensor x, Tensor experts, Tensor gates, Tensor w1, Tensor w2, "
        "int row_bytes, bool keep_casts, bool save_context=True, bool check_routing=True) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
    assert str(BWD.default._schema) == (
        "rdep::moe_backward_capturable(Tensor handle, int layer, Tensor ctx, Tensor rows, Tensor w1c, Tensor w2c, Tensor dy, "
        "Tensor w1, Tensor w2) -> (Tensor, Tensor, Tensor, Tensor)")
    unsafe = getattr(torch.Tag, "cudagraph_unsafe", None)
    if unsafe is not None:
        assert unsafe not in FWD.default.tags and unsafe not in BWD.default.tags
        assert unsafe in torch.ops.rdep.moe_forward.default.tags


def test_shape_arguments_must_be_the_layers():
    """row_bytes and keep_casts fix the outputs' shapes (so that compiled graphs' caches key on them): a value
    that is not the layer's is refused naming it."""
    layer = _layer()
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    with pytest.raises(ValueError, match=r"row_bytes: expected the layer's Layer.row_bytes \(0\), got 256"):
        FWD(layer.handle, layer.rep, x, ids, gates, w1, w2, 256, False, True)
    with pytest.raises(ValueError, match=r"keep_casts: expected the layer's keep_weight_casts \(False\), got True"):
        FWD(layer.handle, layer.rep, x, ids, gates, w1, w2, 0, True, True)


def test_capturable_layers():
    """Layer.capturable: the CUDA sync-free layer with one local rank only; the host backend never (rt.moe then uses the
    plain ops)."""
    assert not _layer().capturable and not _layer(world_size=1).capturable
    layer = _layer(world_size=1)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    y = rt.moe(layer, x, ids, gates, w1.requires_grad_(True), w2)
    assert y.requires_grad and layer.live_contexts == 1 and not layer._native.by_address  # the plain ops' context


def test_row_allocator_gives_back_only_its_own_blocks(monkeypatch):
    """The row allocator's free (the C library calls it for blocks it took from the allocator; the capturable forward's
    rows, pieces of its rows tensor, never reach it: row_arena_test.cc) gives torch only the blocks it handed out."""
    from rdep.torch import layer as L

    key = next(L._row_keys)
    monkeypatch.setitem(L._TORCH_BLOCKS, key, {1 << 20})
    deleted = []
    monkeypatch.setattr(torch.cuda, "caching_allocator_delete", deleted.append)
    L._torch_row_free(key, 2 << 20, 256, 0)  # not one of its blocks: nothing given to torch
    assert deleted == [] and L._TORCH_BLOCKS[key] == {1 << 20}
    L._torch_row_free(key, 1 << 20, 256, 0)
    assert deleted == [1 << 20] and L._TORCH_BLOCKS[key] == set()


def test_rows_moved_under_a_recorded_context_are_refused():
    """A rows tensor a saved-tensor hook moved cannot be followed by a context a CUDA graph recorded (its replays read the
    recorded addresses): refused naming rows and the cause. Rows where the forward left them, or a forward that took
    none from an arena (rows_bytes 0, the host backend), need nothing."""
    layer = _layer()
    rows = torch.empty(512, dtype=torch.uint8)
    e = graph_contexts.Entry(c_id=1 << 32, address=0, storage=None, pinned=True, rows_at=rows.data_ptr() + 256, rows_bytes=512)
    with pytest.raises(rdep.FailedPreconditionError, match=r"rows: layer \d+'s saved rows tensor moved .* a CUDA graph recorded"):
        graph_contexts.follow_rows(layer, e, rows, capturing_now=False)
    e.pinned = False
    with pytest.raises(rdep.FailedPreconditionError, match="a CUDA graph recorded"):
        graph_contexts.follow_rows(layer, e, rows, capturing_now=True)
    e.rows_at = rows.data_ptr()
    graph_contexts.follow_rows(layer, e, rows, capturing_now=True)  # not moved: nothing to do
    e.rows_at, e.rows_bytes = 0, 0
    graph_contexts.follow_rows(layer, e, rows, capturing_now=False)  # no arena rows


def test_a_backward_recorded_again_finds_its_forward_by_ctx_and_rows():
    """A backward captured again for a recorded forward whose backward ran (CUDA graph trees re-record a backward node
    under a replayed forward node) follows the forward whose ctx *and* rows tensors had the addresses it is given: the
    newest entry at ctx's address where its rows match, else the one displaced recorded entry whose rows do. Several is
    refused naming the ambiguity (graph trees reuse their pool's addresses across nodes), none naming moved rows."""
    layer = _layer()
    native = layer._native
    rows_a = torch.empty(512, dtype=torch.uint8)
    rows_b = torch.empty(512, dtype=torch.uint8)

    def entry(c, rows):
        return graph_contexts.Entry(c_id=c << 32, address=4096, storage=None, pinned=True, backward_ran=True,
                                    rows_at=rows.data_ptr(), rows_bytes=512)

    newest, older = entry(7, rows_b), entry(6, rows_a)
    native.displaced.append(older)
    try:
        assert graph_contexts.recorded_entry(layer, newest, rows_b) is newest
        assert graph_contexts.recorded_entry(layer, newest, rows_a) is older  # the newest's rows are elsewhere
        native.displaced.append(entry(5, rows_a))
        with pytest.raises(rdep.FailedPreconditionError, match="recorded again for a ctx at 0x1000 .* ambiguous"):
            graph_contexts.recorded_entry(layer, newest, rows_a)
        elsewhere = torch.empty(512, dtype=torch.uint8)
        with pytest.raises(rdep.FailedPreconditionError, match="no recorded forward's outputs were at both addresses: a "
                                                                "saved-tensor hook moved the rows"):
            graph_contexts.recorded_entry(layer, newest, elsewhere)
        newest.backward_ran = False  # its first backward: follow_rows names the moved rows
        assert graph_contexts.recorded_entry(layer, newest, elsewhere) is newest
    finally:
        native.displaced.clear()
