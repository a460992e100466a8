"""How rdep's ops name their layer without making torch.compile specialize on it.

Each op takes two layer arguments: `Tensor handle` (Layer.handle, an int64 tensor of one element on the layer's
device, holding its id) names the layer the call runs on, found by the tensor's address (no device read); and
`int layer`, the id of the configuration's representative (Layer.rep: the oldest live layer configured alike),
which the fake implementations read for shapes and checks. A compiled graph then holds the representative's id
as a constant and takes the handle as an input, so equal MoE layers compiled one block at a time (TorchTitan's
per-block torch.compile) share one compiled graph instead of recompiling per layer until dynamo's recompile
limit leaves the later layers eager.

The handle is marked a static input (torch._dynamo.mark_static_address, unguarded): CUDA graph trees read it in
place rather than copying it into a buffer of their own, so its address still names the layer when a graph is
recorded. A copy of a handle is still resolved, by reading its value (a device read outside CUDA-graph capture,
refused inside one).
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .layer import Layer

_lock = threading.Lock()
_by_address: dict[int, int] = {}      # handle data_ptr -> layer id
_alike: dict[tuple, list[int]] = {}   # trace key -> live layer ids, oldest first
_layers: dict[int, "weakref.ref[Layer]"] = {}


def trace_key(layer: "Layer") -> tuple:
    """What the ops' fake implementations and the checks of rdep.torch.moe read of a layer: layers with equal keys
    trace alike."""
    return (layer.hidden, layer.ffn, layer.num_experts, layer.topk, layer.max_tokens, layer.world_size,
            layer.capacity_factor, layer.segment_tokens, layer.keep_weight_casts, layer.balance, layer.nodes,
            layer.max_nodes, layer.expert_compute, layer.owner_reduce, layer.transport_sms, layer.overlap_segments,
            layer.stash_rows, layer.capturable_ops, layer.gate_in_expert, layer.backend, str(layer.device),
            tuple(layer.local_ranks), layer._owned, layer.row_bytes)


def register(layer: "Layer") -> None:
    """Makes layer.handle and sets layer.rep (at the end of Layer.__init__)."""
    handle = torch.full((1,), layer.id, dtype=torch.int64, device=layer.device)
    try:
        torch._dynamo.mark_static_address(handle, guard=False)
    except (AttributeError, TypeError):  # a torch without it: the handle is then found by its value when copied
        pass
    layer.handle = handle
    key = trace_key(layer)
    with _lock:
        _by_address[handle.data_ptr()] = layer.id
        _layers[layer.id] = weakref.ref(layer)
        ids = _alike.setdefault(key, [])
        ids.append(layer.id)
        layer.rep = ids[0]
    layer._handle_entry = (layer.id, key, handle.data_ptr())  # what forget() takes, at close or collection
    weakref.finalize(layer, forget, *layer._handle_entry)


def forget(layer_id: int, key: tuple, address: int) -> None:
    """Drops a closed or collected layer; the layers configured alike get the next oldest as representative."""
    with _lock:
        if _by_address.get(address) == layer_id:
            del _by_address[address]
        _layers.pop(layer_id, None)
        ids = _alike.get(key)
        if ids is None or layer_id not in ids:
            return
        ids.remove(layer_id)
        if not ids:
            del _alike[key]
            return
        for other in ids:
            ref = _layers.get(other)
            obj = ref() if ref is not None else None
            if obj is not None:
                obj.rep = ids[0]


def resolve(handle, rep: int) -> "Layer":
    """The live layer a handle names, for an op's real implementation; `rep` (the op's `int layer`) must be the id of
    a layer configured alike, or of one closed since (a compiled graph holds the id it traced with)."""
    from .layer import get_layer

    layer = get_layer(layer_id(handle))
    if rep != layer.rep:
        ref = _layers.get(int(rep))
        other = ref() if ref is not None else None
        if other is not None and trace_key(other) != trace_key(layer):
            raise ValueError(f"layer: the handle names layer {layer.id}, whose configuration differs from that of layer "
                             f"{rep} (the op's int layer); pass the layer's handle and its Layer.rep")
    return layer


def layer_id(handle) -> int:
    """The id of the layer a handle names (see the module docstring), with errors naming `layer`."""
    if not isinstance(handle, torch.Tensor) or handle.dtype != torch.int64 or handle.numel() != 1:
        what = f"a {handle.dtype} tensor of {handle.numel()} elements" if isinstance(handle, torch.Tensor) else type(handle).__name__
        raise TypeError(f"layer: expected a Layer.handle (an int64 tensor of one element), got {what}")
    found = _by_address.get(handle.data_ptr())
    if found is not None:
        return found
    if handle.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("layer: a copy of a Layer.handle was passed inside a CUDA graph capture, where its value "
                           "cannot be read; pass the layer's own handle (Layer.handle)")
    return int(handle.reshape(-1)[0].item())
