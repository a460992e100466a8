"""How rdep's ops name their layer without making torch.compile specialize on it.

Each op takes two layer arguments: `Tensor handle` (Layer.handle, an int64 tensor of one element on the layer's
device, holding its id) names the layer the call runs on, found by the tensor's address (no device read); and
`int layer`, the id of the configuration's representative (Layer.rep: the oldest live layer configured alike),
which the fake implementations read for shapes and checks. A compiled graph then holds the representative's id
as a constant and takes the handle as an input, so equal MoE layers compiled one block at a time (TorchTitan's
per-block torch.compile) share one compiled graph instead of recompiling per layer until dynamo's recompile
limit leaves the later layers eager.

The fake implementations read a snapshot of the layer `layer` names, taken when it was made (`traced`) and kept for
the process's life (a few hundred bytes a layer): inductor compiles a backward lazily, after the representative may have been closed. For the same
reason every id's configuration key is kept, so a handle and a `layer` configured differently are always refused.

The handle is marked a static input (torch._dynamo.mark_static_address, unguarded): CUDA graph trees read it in
place rather than copying it, so its address still names the layer when a graph is recorded. Handles are kept for
the process's life (8 bytes each, one allocator block), so no later layer's handle takes a dead one's address, to
which a recorded graph of the dead layer could otherwise be replayed. A copy of a handle (a saved-tensor hook that
copies, such as torch.autograd.graph.save_on_cpu) is still resolved, by reading its value: a device read outside
CUDA-graph capture, refused inside one.

Layers collected by the garbage collector are queued by their finalizer without a lock (a collection may run
while this module holds its lock) and forgotten at the next registration, close or call.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .layer import Layer

_lock = threading.Lock()
_by_address: dict[int, int] = {}      # handle data_ptr -> layer id (never reused: handles are kept)
_alike: dict[tuple, list[int]] = {}   # trace key -> live layer ids, oldest first
_layers: dict[int, "weakref.ref[Layer]"] = {}
_keys: dict[int, tuple] = {}          # layer id -> its trace key, for every layer made
_snapshots: dict[int, "Layer"] = {}   # layer id -> what the fake implementations read of it, for every layer made
_handles: list[torch.Tensor] = []     # every handle made
_dead: collections.deque = collections.deque()  # finalized layers' entries, forgotten under the lock


def trace_key(layer: "Layer") -> tuple:
    """What the ops' fake implementations and the checks of rdep.torch.moe read of a layer: layers with equal keys
    trace alike."""
    return (layer.hidden, layer.ffn, layer.num_experts, layer.topk, layer.max_tokens, layer.world_size,
            layer.capacity_factor, layer.segment_tokens, layer.keep_weight_casts, layer.balance, layer.nodes,
            layer.max_nodes, layer.expert_compute, layer.owner_reduce, layer.transport_sms, layer.overlap_segments,
            layer.stash_rows, layer.capturable_ops, layer.gate_in_expert, layer.backend, str(layer.device),
            tuple(layer.local_ranks), layer._owned, layer.row_bytes)


class _FrozenNative:
    """A snapshot's native part: the one value validation reads (row_bytes), and no C handle."""

    ptr = None

    def __init__(self, row_bytes: int):
        self.row_bytes = row_bytes

    def close(self) -> None:
        pass


def _snapshot(layer: "Layer") -> "Layer":
    """A Layer object with the layer's configuration and none of its resources (no C handle, domain or group)."""
    snap = object.__new__(type(layer))
    snap.__dict__.update({k: v for k, v in layer.__dict__.items()
                          if k not in ("handle", "domain", "process_group", "_native", "_handle_entry")})
    snap._native = _FrozenNative(layer.row_bytes)
    return snap


def register(layer: "Layer") -> None:
    """Makes layer.handle and sets layer.rep (at the end of Layer.__init__)."""
    handle = torch.full((1,), layer.id, dtype=torch.int64, device=layer.device)
    try:
        torch._dynamo.mark_static_address(handle, guard=False)
    except (AttributeError, TypeError):  # a torch without it: the handle is then found by its value when copied
        pass
    key = trace_key(layer)
    with _lock:
        _drain()
        _handles.append(handle)
        _by_address[handle.data_ptr()] = layer.id
        _layers[layer.id] = weakref.ref(layer)
        _keys[layer.id] = key
        _snapshots[layer.id] = _snapshot(layer)
        ids = _alike.setdefault(key, [])
        ids.append(layer.id)
        layer.handle, layer.rep = handle, ids[0]
    layer._handle_entry = (layer.id, key)  # what forget() takes, at close or collection
    weakref.finalize(layer, _dead.append, layer._handle_entry)


def forget(layer_id: int, key: tuple) -> None:
    """Drops a closed layer (Layer.close); the layers configured alike get the next oldest as representative."""
    with _lock:
        _drain()
        _forget(layer_id, key)


def _drain() -> None:
    """Forgets the layers the garbage collector finalized (call under _lock)."""
    while _dead:
        _forget(*_dead.popleft())


def _forget(layer_id: int, key: tuple) -> None:
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


def traced(layer: int) -> "Layer":
    """What a fake implementation reads for `int layer`: the snapshot of that layer, which outlives it."""
    snap = _snapshots.get(int(layer))
    if snap is None:
        raise ValueError(f"layer: {layer} is not the id of an rdep layer (pass Layer.rep)")
    return snap


def check_handle(handle) -> None:
    """TypeError naming `layer` unless handle looks like a Layer.handle (also for fake tensors, while tracing)."""
    if not isinstance(handle, torch.Tensor) or handle.dtype != torch.int64 or handle.numel() != 1:
        what = f"a {handle.dtype} tensor of {handle.numel()} elements" if isinstance(handle, torch.Tensor) else type(handle).__name__
        raise TypeError(f"layer: expected a Layer.handle (an int64 tensor of one element), got {what}")


_get_layer = None  # layer.get_layer, once resolve first runs


def resolve(handle, rep: int) -> "Layer":
    """The live layer a handle names, for an op's real implementation; `rep` (the op's `int layer`) must be the id of
    a layer configured alike (a compiled graph holds the id it traced with, which may have been closed since)."""
    global _get_layer
    if _get_layer is None:  # layer.py imports this module: its function is looked up once, on the first call
        from .layer import get_layer as _get_layer
    if _dead:
        with _lock:
            _drain()
    layer = _get_layer(layer_id(handle))
    if rep != layer.rep and _keys.get(int(rep)) != _keys.get(layer.id):
        raise ValueError(f"layer: the handle names layer {layer.id}, whose configuration differs from that of layer "
                         f"{rep} (the op's int layer); pass the layer's handle and its Layer.rep")
    return layer


def layer_id(handle) -> int:
    """The id of the layer a handle names (see the module docstring), with errors naming `layer`."""
    check_handle(handle)
    found = _by_address.get(handle.data_ptr())
    if found is not None:
        return found
    if handle.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("layer: a copy of a Layer.handle was passed inside a CUDA graph capture, where its value "
                           "cannot be read; pass the layer's own handle (Layer.handle)")
    return int(handle.reshape(-1)[0].item())
