"""How the ops name their layer (rdep/torch/layer_handles.py), on the host backend: Layer.handle finds the layer
by its address (a copy by its value), Layer.rep is the oldest live layer configured alike and moves on when it
closes, and a handle and a `layer` of differently configured layers, or a handle that is not one, are refused
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
    gc.collect()
    assert c.rep == c.id
    y, _ = _call(c)
    assert torch.isfinite(y).all()


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
