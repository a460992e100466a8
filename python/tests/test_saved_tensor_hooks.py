"""Saved-tensor hooks that copy what autograd saves (torch.autograd.graph.save_on_cpu with pinned copies, which copies CPU
tensors too; activation offloading) around compiled graphs, whose saved activations pass through the hooks set when
they run: the ops' ctx tensors come back to the backward as copies and the originals die. The context must then be
kept until its backward (ops._hooks_copy_saved, the layer's hold), or the next forward would take its slot and the
backward would run on another forward's state. Host backend; the CUDA cases are in test_eager_ext.py."""

from __future__ import annotations

import gc

import pytest
import torch

import rdep
import rdep.torch as rt
from rdep.torch import graph_contexts
from test_ops import make_inputs

FWD_CAPTURABLE = torch.ops.rdep.moe_forward_capturable


def _pinned_save_on_cpu():
    return torch.autograd.graph.save_on_cpu(pin_memory=True)  # copies CPU tensors too (pinned where CUDA is)


def _calls(layer, kind):
    """y of one forward through the plain ops (rdep.torch.moe on a host layer) or the capturable ones."""
    if kind == "plain":
        return lambda x, ids, g, w1, w2: rt.moe(layer, x, ids, g, w1, w2)
    return lambda x, ids, g, w1, w2: FWD_CAPTURABLE(layer.handle, layer.rep, x, ids, g, w1, w2, layer.row_bytes,
                                                    layer.keep_weight_casts, True, True)[0]


@pytest.mark.parametrize("kind", ["plain", "capturable"])
def test_compiled_forwards_under_copying_hooks_keep_their_contexts(kind):
    """Two compiled forwards under pinned save_on_cpu, the live contexts read between (a sweep), then both backwards in
    forward order: each gives the gradients of an eager forward and backward on its inputs, bit for bit, and no context
    is left. Without the hold the first context was released by the second forward (its ctx had died), which took its
    slot: the first backward ran on the second forward's state."""
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    f = _calls(layer, kind)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    inputs = [make_inputs(layer, 16, "zipf", seed=s) for s in (3, 4)]
    dys = [torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(s)) for s in (5, 6)]

    def leaves(inp):
        x, ids, g, w1, w2 = inp
        return [x.clone().requires_grad_(True), ids, g.clone().requires_grad_(True), w1.clone().requires_grad_(True),
                w2.clone().requires_grad_(True)]

    want = []
    for inp, dy in zip(inputs, dys):
        a = leaves(inp)
        y = f(*a)
        y.backward(dy)
        want.append([y.detach()] + [a[i].grad for i in (0, 2, 3, 4)])
    assert layer.live_contexts == 0
    got, ys, args = [], [], []
    with _pinned_save_on_cpu():
        for inp in inputs:
            args.append(leaves(inp))
            ys.append(compiled(*args[-1]))
    gc.collect()
    assert layer.live_contexts == 2  # read: a sweep, which must not release them
    for y, a, dy in zip(ys, args, dys):
        y.backward(dy)
        got.append([y.detach()] + [a[i].grad for i in (0, 2, 3, 4)])
    del ys
    gc.collect()
    assert layer.live_contexts == 0
    for n, (w, g) in enumerate(zip(want, got)):
        for name, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), w, g):
            assert torch.equal(a, b), f"forward {n}: {name} differs"


@pytest.mark.parametrize("kind", ["plain", "capturable"])
def test_eager_forward_under_copying_hooks_dropped_without_backward_releases_its_context(python_path, kind):
    """An eager forward under such hooks moves the layer's hold to its autograd node: a graph dropped without backward
    still releases its context (no context kept until close)."""
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    x, ids, g, w1, w2 = make_inputs(layer, 16, "uniform", seed=7)
    with _pinned_save_on_cpu():
        y = _calls(layer, kind)(x.requires_grad_(True), ids, g, w1, w2)
    assert layer.live_contexts == 1 and not layer._native.held
    del y
    gc.collect()
    assert layer.live_contexts == 0


@pytest.mark.parametrize("kind", ["plain", "capturable"])
def test_compiled_forward_under_copying_hooks_dropped_without_backward_is_held_until_released(kind):
    """A compiled forward under such hooks whose graph is dropped without backward: the hooks hid the drop (its ctx's
    death no longer says it), so its context is held until Layer.release_held_contexts() (or close()); a layer dropped
    without either is still collected (the hold keeps nothing that keeps the layer), closing its C layer."""
    import weakref

    for release in (True, False):
        layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
        x, ids, g, w1, w2 = make_inputs(layer, 16, "uniform", seed=7)
        compiled = torch.compile(_calls(layer, kind), backend="aot_eager", fullgraph=True)
        with _pinned_save_on_cpu():
            y = compiled(x.requires_grad_(True), ids, g, w1, w2)
        del y
        gc.collect()
        assert layer.live_contexts == 1
        if release:
            assert layer.release_held_contexts() == 1
            assert layer.live_contexts == 0 and layer.release_held_contexts() == 0
            continue
        native = weakref.ref(layer._native)
        del layer, compiled, x, ids, g, w1, w2
        torch._dynamo.reset()  # its caches hold the compiled function, whose closure holds the layer
        gc.collect()
        assert native() is None, "the held context kept the layer's native state alive"


def test_rows_of_another_forward_or_misaligned_are_refused():
    """graph_contexts.follow_rows: a rows tensor that is another live entry's, still where its forward left it (a direct
    op call given the wrong rows), is refused naming both contexts; at the old address of another entry's rows that
    died (a hook moved them, and this copy took their freed bytes) it is not. A copy a hook returned misaligned is
    refused naming rows."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def aligned(n):  # a 256-byte aligned uint8 view (the CPU allocator aligns less)
        buf = torch.empty(n + 256, dtype=torch.uint8)
        off = (-buf.data_ptr()) % 256
        return buf[off:off + n]

    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    native = layer._native
    mine, other = aligned(1024), aligned(1024)
    a = graph_contexts.Entry(c_id=1 << 32, address=1, storage=None, rows_at=mine.data_ptr(), rows_bytes=512,
                             rows_storage=StorageWeakRef(mine.untyped_storage()))
    b = graph_contexts.Entry(c_id=2 << 32, address=2, storage=None, rows_at=other.data_ptr(), rows_bytes=512,
                             rows_storage=StorageWeakRef(other.untyped_storage()))
    native.by_address.update({1: a, 2: b})
    try:
        with pytest.raises(rdep.FailedPreconditionError, match=r"rows: this tensor holds another forward's saved rows .*"
                                                              r"context 2\), not those of ctx's \(context 1\)"):
            graph_contexts.follow_rows(layer, a, other, capturing_now=False)
        b.rows_storage = StorageWeakRef(torch.empty(8, dtype=torch.uint8).untyped_storage())  # b's rows died
        with pytest.raises(rdep.InvalidArgumentError, match="rdep_context_rebase_rows: context 4294967296 is not a live"):
            graph_contexts.follow_rows(layer, a, other, capturing_now=False)  # followed (a here is no real context)
        off = (-mine.data_ptr()) % 256 + 8  # 8 bytes past a 256-byte boundary
        with pytest.raises(rdep.FailedPreconditionError, match="not 256-byte aligned"):
            graph_contexts.follow_rows(layer, a, mine[off:off + 512], capturing_now=False)
    finally:
        native.by_address.clear()
