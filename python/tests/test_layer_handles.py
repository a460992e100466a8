"""How the ops name their layer (rdep/torch/layer_handles.py), on the host backend: Layer.handle finds the layer
by its address (a copy by its value), Layer.rep is the oldest live layer configured alike and moves on when it
closes, the fake implementations read a snapshot that outlives the layer, and a handle and a `layer` of differently configured layers, or a handle that is not one, are refused
naming `layer`."""

from __future__ import annotations

import gc

import pytest
import torch

import rdep.torch as rt
from rdep.torch import layer_handles
from test_ops import make_inputs


def _call(layer, handle=None, rep=None):
    """y of the plain forward op (grad off: no context kept) on fresh inputs for `layer`."""
    x, ids, gates, w1, w2 = make_inputs(layer, 4, "uniform", seed=3)
    handle = layer.handle if handle is None else handle
    rep = layer.rep if rep is None else rep
    return torch.ops.rdep.moe_forward(handle, rep, x, ids, gates, w1, w2, False)[0], (x, ids, gates, w1, w2)


def test_equal_layers_share_a_representative_and_distinct_handles():
    a, b, c = rt.Layer(8, 6, 6, 2, 16), rt.Layer(8, 6, 6, 2, 16), rt.Layer(8, 6, 6, 3, 16)
    assert a.rep == b.rep == a.id and c.rep == c.id != a.id
    assert a.handle.dtype == torch.int64 and a.handle.shape == (1,) and int(a.handle) == a.id
    assert a.handle.data_ptr() != b.handle.data_ptr()
    assert layer_handles.resolve(b.handle, b.rep) is b and layer_handles.resolve(a.handle, a.rep) is a


def test_representative_moves_to_the_next_oldest_when_it_closes():
    a, b, c = (rt.Layer(8, 6, 6, 2, 16, capacity_factor=1.5) for _ in range(3))
    assert a.rep == b.rep == c.rep == a.id
    a.close()
    assert b.rep == c.rep == b.id
    del b
    gc.collect()  # the finalizer queues b; the next call (or registration, or close) forgets it
    y, _ = _call(c)
    assert torch.isfinite(y).all()
    assert c.rep == c.id


def test_a_graph_holding_a_closed_representative_still_runs():
    """A compiled graph keeps the `layer` it traced with; the real implementation runs on the handle's layer."""
    a, b = rt.Layer(8, 6, 6, 2, 16), rt.Layer(8, 6, 6, 2, 16)
    old_rep = b.rep
    want, inputs = _call(b)
    a.close()
    got = torch.ops.rdep.moe_forward(b.handle, old_rep, *inputs, False)[0]
    assert torch.equal(got, want)


def test_a_copy_of_a_handle_names_the_same_layer():
    layer = rt.Layer(8, 6, 6, 2, 16)
    want, inputs = _call(layer)
    copy = layer.handle.clone()
    assert copy.data_ptr() != layer.handle.data_ptr()
    assert layer_handles.resolve(copy, layer.rep) is layer
    assert torch.equal(torch.ops.rdep.moe_forward(copy, layer.rep, *inputs, False)[0], want)


def test_a_handle_and_a_differently_configured_layer_are_refused():
    a, b = rt.Layer(8, 6, 6, 2, 16), rt.Layer(8, 6, 6, 3, 16)
    x, ids, gates, w1, w2 = make_inputs(a, 4, "uniform")
    with pytest.raises(ValueError, match=rf"^layer: the handle names layer {a.id}, whose configuration differs"):
        torch.ops.rdep.moe_forward(a.handle, b.rep, x, ids, gates, w1, w2, False)


@pytest.mark.parametrize("bad", ["int32", "two_elements", "not_a_tensor_value"])
def test_what_is_not_a_handle_is_refused_naming_layer(bad):
    layer = rt.Layer(8, 6, 6, 2, 16)
    handle = {"int32": layer.handle.int(), "two_elements": torch.tensor([layer.id, layer.id]),
              "not_a_tensor_value": torch.tensor([10 ** 9])}[bad]
    x, ids, gates, w1, w2 = make_inputs(layer, 4, "uniform")
    err = ValueError if bad == "not_a_tensor_value" else TypeError
    with pytest.raises(err, match=r"^layer: "):
        torch.ops.rdep.moe_forward(handle, layer.rep, x, ids, gates, w1, w2, False)


def test_a_closed_layers_handle_is_refused():
    layer = rt.Layer(8, 6, 6, 2, 16)
    x, ids, gates, w1, w2 = make_inputs(layer, 4, "uniform")
    handle, rep, lid = layer.handle, layer.rep, layer.id
    layer.close()
    with pytest.raises(ValueError, match=rf"^layer: {lid} is not a live rdep layer handle"):
        torch.ops.rdep.moe_forward(handle, rep, x, ids, gates, w1, w2, False)


def test_the_fake_implementation_reads_a_closed_representatives_snapshot():
    """Inductor compiles a backward lazily, after the representative may have been closed: the fake implementations
    read a snapshot taken when the layer was made (layer_handles.traced), which outlives it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    a, b = rt.Layer(8, 6, 6, 2, 16), rt.Layer(8, 6, 6, 2, 16)
    rep = b.rep
    a.close()
    x, ids, gates, w1, w2 = make_inputs(b, 4, "uniform")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx = [mode.from_tensor(t) for t in (b.handle, x, ids, gates, w1, w2)]
        y, ctx = torch.ops.rdep.moe_forward(fx[0], rep, *fx[1:], True)
    assert y.shape == x.shape and ctx.shape == ()
    with pytest.raises(ValueError, match=r"^layer: 123456 is not the id of an rdep layer"):
        layer_handles.traced(123456)


def test_a_handle_address_is_never_reused_by_a_later_layer():
    """Handles are kept for the process's life, so a recorded graph of a dead layer cannot be replayed for a new one
    whose handle took the dead one's address."""
    addresses = set()
    for _ in range(5):
        layer = rt.Layer(8, 6, 6, 2, 16)
        addresses.add(layer.handle.data_ptr())
        del layer
        gc.collect()
    assert len(addresses) == 5


def test_inductors_lazy_backward_after_the_representative_closed():
    """The case the snapshots are for: an MoE compiled with inductor runs its forward, the representative (an equal
    layer made first) is closed, and only then does inductor compile the backward, running the fake
    implementations: the backward runs and gives the eager module's gradients."""
    first = rt.Layer(8, 6, 6, 2, 16)
    compiled_src = rt.MoE(8, 6, 6, 2, max_tokens=16, world_size=1, seed=0, init_std=0.3)
    eager = rt.MoE(8, 6, 6, 2, max_tokens=16, world_size=1, seed=0, init_std=0.3)
    assert compiled_src.layer.rep == first.id
    torch._dynamo.reset()
    compiled = torch.compile(compiled_src, backend="inductor", fullgraph=True)
    x = torch.randn(16, 8)
    grads = []
    for m in (compiled, eager):
        xi = x.clone().requires_grad_(True)
        out = m(xi)
        if m is compiled:
            first.close()
            del first
            gc.collect()
        (out.y.square().sum() + out.aux_loss).backward()
        grads.append(xi.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)
    for (k, pc), (_, pe) in zip(compiled_src.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-5, atol=1e-6, msg=k)
