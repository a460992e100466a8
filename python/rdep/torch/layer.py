"""rdep.torch.Layer: one rdep MoE layer on a domain (the C ABI's rdep_layer handle) for PyTorch callers.

A Layer fixes the shape (hidden H, ffn F, num_experts E, topk K, max_tokens T per rank), the capacity rule
and the placement of the W ranks, which is its domain's (rdep.torch.Domain): `domain=` puts the layer on a
domain shared with other layers (their balanced layers then share one set of replica slots); without it
the layer gets a domain of its own (`layer.domain`) from these arguments:
  * backend 'host': all W ranks are threads of this process, fp32, CPU tensors;
  * backend 'cuda' without a process group: all W ranks are driven by this process, sharing GPU 0
    (num_gpus=1; the torch binding passes one tensor for all local ranks, so they must share a GPU);
  * backend 'cuda' with a torch.distributed process group (torchrun): this process is rank
    group.rank() of W = group.size(), on the current CUDA device; the layer's handles are exchanged
    through the group (rdep.torch.distributed.ProcessGroupAllgather).
'auto' picks 'cuda' when a process group is given or the device is a CUDA device, else 'host'.

On CUDA a forward context's saved rows (nearly all its bytes) come from PyTorch's caching allocator, on the
caller's stream, and go back to it when the context is released after its backward (C ABI version 8's row
allocator): between steps they are torch's to reuse, as an MoE written in torch would leave its saved
activations; `torch_rows=False` keeps them in the pooled contexts (cudaMalloc'd once) instead.

The custom ops (rdep.torch.ops, rows) take the layer as its `handle` (a one-element tensor found by its address)
and `rep` (the id of the oldest live layer configured alike), so that equal layers share a compiled graph
(layer_handles.py); the registry maps ids to live layers. The C handle is freed when the Layer is closed or collected
and no forward context of it is still alive (contexts hold the native handle).

    layer = rdep.torch.Layer(hidden=8, ffn=16, num_experts=6, topk=2, max_tokens=32, world_size=4)
    print(layer.describe(), layer.owned_experts(3), layer.local_experts)
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import math
import threading
import weakref
from typing import Optional

import torch

from .. import _capi
from . import graph_contexts, layer_handles
from .domain import (CHandle, Domain, collector_paused, local_device, placement_fields, raise_bootstrap_error,
                     resolve_backend)

_MAX_TRANSPORT_SMS = 1024  # rdep::kMaxTransportSms (include/rdep/layer/layer_config.h)

_registry: dict[int, "weakref.ref[Layer]"] = {}
_registry_lock = threading.Lock()
_next_id = itertools.count(1)


def get_layer(layer_id: int) -> "Layer":
    """The live Layer with this id; ValueError naming the id otherwise."""
    ref = _registry.get(int(layer_id))
    layer = ref() if ref is not None else None
    if layer is None or layer._native.ptr is None:
        raise ValueError(f"layer: {layer_id} is not a live rdep layer handle (closed or garbage-collected)")
    return layer


class _GcPause:
    """Python's cyclic collector paused while any thread holds a layer lock that asks for it (_CallLock.pause_gc),
    process-wide: the first holder disables it (if it was enabled) and the last one to let go enables it again, so
    that one thread's exit does not turn the collector back on while another thread's C call still runs callbacks."""

    def __init__(self):
        self._mu = threading.Lock()
        self._holders = 0
        self._was_enabled = False

    def hold(self) -> None:
        with self._mu:
            self._holders += 1
            if self._holders == 1:
                self._was_enabled = gc.isenabled()
                if self._was_enabled:
                    gc.disable()

    def release(self) -> None:
        with self._mu:
            self._holders -= 1
            if self._holders == 0 and self._was_enabled:
                self._was_enabled = False
                gc.enable()


_gc_pause = _GcPause()


class _CallLock:
    """The layer's re-entrant lock (one C call on the layer at a time). With `pause_gc` (set when the layer's
    contexts take their rows from torch's caching allocator, whose callbacks run Python code on the C call's
    threads) it also pauses Python's cyclic collector while held (_GcPause, counted across threads and layers): a
    collection inside a callback could run a context's finalizer, which would wait for this lock from a rank thread,
    or re-enter rdep_context_release while the C layer holds its context lock."""

    def __init__(self):
        self._lock = threading.RLock()
        self._depth = 0
        self._paused = False
        self.pause_gc = False

    def __enter__(self):
        self._lock.acquire()
        self._depth += 1
        if self._depth == 1 and self.pause_gc:
            _gc_pause.hold()
            self._paused = True
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0 and self._paused:
            self._paused = False
            _gc_pause.release()
        self._lock.release()
        return False


class _Native:
    """Owns the rdep_layer* and the per-layer Python state the C calls need. The Layer and every live
    forward context (through its finalizer) hold a reference, so the C handle outlives its contexts."""

    def __init__(self, ptr: int, keepalive: tuple):
        self.ptr: Optional[int] = ptr
        self.keepalive = keepalive  # the domain's native state (it keeps the allgather callback C calls alive)
        self.lock = _CallLock()  # one C call on this layer at a time; guards `live` and `casts`
        # Live forward contexts: token (the C slot index) -> C context id (layer_calls.py).
        self.live: dict[int, int] = {}
        # The bf16 casts of fp32 master weights a forward made, kept for its backward (keep_weight_casts):
        # token -> (C context id, w1, w2, what they were cast from); dropped with the context.
        self.casts: dict[int, tuple] = {}
        # The capturable ops' contexts (graph_contexts.py): ctx tensor address -> Entry, and the C ids of the
        # contexts CUDA graphs recorded (pinned: never released while the layer lives; also in `live`).
        self.by_address: dict = {}
        self.pinned: set[int] = set()
        self.displaced: list = []  # pinned or held entries whose ctx address a later ctx took (found by token)
        # The plain ops' contexts held while saved-tensor hooks that copy the ctx may have dropped the original (whose
        # death would release the context): token -> C id, until the context is released (ops._hooks_copy_saved).
        self.held: dict[int, int] = {}
        self.row_key = next(_row_keys)  # the row allocator's `user` for this layer
        self.row_bytes = 0              # rdep_layer_row_allocator_bytes: one forward's saved rows (torch_rows)
        self.arena_used = 0             # bytes the last capturable forward took from its arena

    def release(self, c_id: int, token: Optional[int] = None) -> None:
        """Releases a context (a stale id is a no-op in C) and forgets it; not one a CUDA graph recorded
        (pinned: release_graph_contexts or close frees those)."""
        with self.lock:
            if c_id in self.pinned:
                return
            if token is not None:
                if self.live.get(token) == c_id:
                    del self.live[token]
                    self.casts.pop(token, None)
                    self.held.pop(token, None)
            if self.ptr is not None:
                _capi.check(_capi.lib().rdep_context_release(self.ptr, c_id), "rdep_context_release")

    def close(self) -> None:
        with self.lock:
            if self.ptr is not None:
                ptr, self.ptr = self.ptr, None  # cleared first: a finalizer the destruction runs finds the layer gone
                self.live.clear()
                self.casts.clear()
                self.by_address.clear()
                self.pinned.clear()
                self.displaced.clear()
                self.held.clear()
                _capi.lib().rdep_layer_destroy(ptr)  # gives its rows back through the allocator, then forgotten
                _TORCH_BLOCKS.pop(self.row_key, None)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass


def _release_quietly(native: _Native, c_id: int, token: int) -> None:
    """Finalizer of a context tensor's storage (the safety net for a graph dropped without backward)."""
    try:
        native.release(c_id, token)
    except Exception:
        pass


# The row allocator's `user` is a key per layer (_Native.row_key); the blocks torch's caching allocator handed the layer
# and it still holds. The capturable forward's saved rows never come here: the C library takes them from the rows
# tensor the forward returns (rdep_layer_forward_arena, C ABI 17) and gives back only blocks this allocator handed out.
_TORCH_BLOCKS: dict[int, set] = {}
_row_keys = itertools.count(1)
_blocks_lock = threading.Lock()  # the ranks' threads call the allocator at once


def _torch_row_alloc(user, nbytes, device, stream):
    """The C layer's RowAllocator (C ABI version 8): a context's saved rows from PyTorch's caching allocator, on the
    caller's stream of the call (so its later work, the optimizer's say, reuses them once released). None (NULL) when
    there is no memory: the C call then fails naming the bytes."""
    try:
        p = torch.cuda.caching_allocator_alloc(int(nbytes), device=int(device), stream=int(stream or 0))
        with _blocks_lock:
            _TORCH_BLOCKS.setdefault(user, set()).add(p)
        return p
    except Exception:
        return None


def _torch_row_free(user, ptr, nbytes, device):
    try:
        with _blocks_lock:
            ours = ptr in _TORCH_BLOCKS.get(user, ())
            if ours:
                _TORCH_BLOCKS[user].discard(ptr)
        if ours:
            torch.cuda.caching_allocator_delete(int(ptr))
    except Exception:  # interpreter shutdown: torch may be gone; the process frees the device memory
        pass


_ROW_ALLOC = _capi.ROW_ALLOC_FN(_torch_row_alloc)  # module-lifetime C callbacks (ctypes keeps no reference)
_ROW_FREE = _capi.ROW_FREE_FN(_torch_row_free)


def _check_sync_free_options(stash_rows, overlap_segments, gate_in_expert) -> None:
    """The types and ranges of the CUDA sync-free layer's options (what each needs: _check_sync_free_needs)."""
    if isinstance(stash_rows, bool) or not isinstance(stash_rows, int):
        raise TypeError(f"stash_rows: expected an int, got {type(stash_rows).__name__}")
    if not 0 <= stash_rows < 2**63:
        raise ValueError(f"stash_rows: expected an int >= 0 (0 = no paged stash), got {stash_rows}")
    if not isinstance(overlap_segments, bool):
        raise TypeError(f"overlap_segments: expected a bool, got {type(overlap_segments).__name__}")
    if gate_in_expert is not None and not isinstance(gate_in_expert, bool):  # None: on where the layer allows it
        raise TypeError(f"gate_in_expert: expected a bool or None, got {type(gate_in_expert).__name__}")


def _check_sync_free_needs(stash_rows, overlap_segments, gate_in_expert, expert_compute, balance, nodes, owner_reduce,
                           auto_note: str = "") -> None:
    """What each option of the CUDA sync-free layer needs (the host backend ignores them), once the expert
    compute is resolved; auto_note: why expert_compute='auto' did not pick 'cutlass', appended to the messages."""
    sync_free = expert_compute == "cutlass" and balance == "off" and nodes <= 1
    got = f"expert_compute={expert_compute!r}, balance={balance!r}, nodes={nodes}{auto_note}"
    if stash_rows and not sync_free:
        raise ValueError(f"stash_rows: the paged stash needs the sync-free layer: expert_compute='cutlass', balance='off', "
                         f"nodes=1 (got {got})")
    if overlap_segments and (not sync_free or owner_reduce):
        raise ValueError(f"overlap_segments: the segment pipeline needs the sync-free layer with the per-slot return: "
                         f"expert_compute='cutlass', balance='off', nodes=1, owner_reduce=False (got {got}, owner_reduce={owner_reduce})")
    if gate_in_expert and not sync_free:
        raise ValueError(f"gate_in_expert: the gate before W2 needs the sync-free layer: expert_compute='cutlass', "
                         f"balance='off', nodes=1 (got {got})")


def _resolve_expert_compute(asked: str, backend: str, gpus: list, nodes: int) -> tuple[str, str]:
    """(the expert compute the layer runs, why 'auto' did not pick 'cutlass', or ""). 'auto' is 'cutlass' where
    it runs: the CUDA backend, a library built with CUTLASS, every GPU of this process's ranks an sm_90 one,
    one node; else 'cublaslt' (which the host backend ignores). Shapes either compute refuses (hidden or ffn
    not a multiple of 8, too many experts a rank) are refused by the library, naming them. An explicit
    choice is kept. With a process group each process decides for its GPU; the ranks' layers must agree
    (the library compares their configurations), as they do on a machine of one GPU kind."""
    if asked != "auto":
        return asked, ""
    if backend != "cuda":
        return "cublaslt", "the host backend computes on the host"
    if nodes > 1:
        return "cublaslt", f"nodes={nodes}: the CUTLASS layer has no two-phase exchange"
    for g in gpus:
        ok, why = _capi.cutlass_available(g)
        if not ok:
            return "cublaslt", f"cuda:{g}: {why}"
    return "cutlass", ""


def _layer_gpus(domain, process_group, device, num_gpus: int, world_size: int) -> list:
    """The GPUs this process's ranks of a CUDA layer run on (for the 'auto' expert compute): the domain's, this
    process's device with a process group, else GPUs 0 .. min(W, num_gpus or the GPUs present) - 1."""
    if domain is not None:
        return [domain.device.index]
    if process_group is not None:
        return [device.index if device is not None and device.index is not None else torch.cuda.current_device()]
    present = max(1, torch.cuda.device_count())
    return list(range(min(world_size, num_gpus if num_gpus > 0 else present)))


def _gate_in_expert(asked: Optional[bool], backend: str, expert_compute: str, balance: str, nodes: int) -> bool:
    """gate_in_expert as the layer runs it: the caller's choice, or with None (what rdep.torch.MoE passes by default;
    Layer's own default is False, since the caller's-experts calls of rdep.torch.rows need the rows unweighted) on
    where the layer allows it (the CUDA backend's sync-free layer: it was faster and held less in every case
    measured, docs/perf-notes.md). The host backend weights the rows at the combine either way (it ignores the
    field, as it does overlap_segments)."""
    if asked is not None:
        return asked
    return backend == "cuda" and expert_compute == "cutlass" and balance == "off" and nodes <= 1


def _check_config(hidden, ffn, num_experts, topk, max_tokens, capacity_factor, segment_tokens) -> None:
    for name, v in (("hidden", hidden), ("ffn", ffn), ("num_experts", num_experts), ("topk", topk),
                    ("max_tokens", max_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if topk > num_experts:
        raise ValueError(f"topk: {topk} exceeds num_experts={num_experts}")
    if not (isinstance(capacity_factor, (int, float)) and math.isfinite(capacity_factor) and capacity_factor >= 0):
        raise ValueError(f"capacity_factor: expected a finite number >= 0 (0 = dropless), got {capacity_factor!r}")
    if isinstance(segment_tokens, bool) or not isinstance(segment_tokens, int) or segment_tokens < 0:
        raise ValueError(f"segment_tokens: expected an int >= 0 (0 = the backend's default), got {segment_tokens!r}")


def _check_balance_and_nodes(balance, slots, min_quota, relay_above, nodes, max_nodes, min_gain=0) -> None:
    if balance not in _capi.BALANCE_KINDS:
        raise ValueError(f"balance: expected one of {tuple(_capi.BALANCE_KINDS)}, got {balance!r}")
    for name, v, lo in (("balance_slots", slots, 0), ("balance_min_quota", min_quota, 1), ("relay_above", relay_above, 0),
                        ("nodes", nodes, 1), ("max_nodes", max_nodes, 0), ("balance_min_gain", min_gain, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
    if min_gain >= 2**63:
        raise ValueError(f"balance_min_gain: expected an int below 2**63 (int64), got {min_gain!r}")
    if min_gain > 0 and balance != "ultraep":
        raise ValueError(f"balance_min_gain: UltraEP's gain gate needs balance='ultraep', got balance={balance!r}")
    if max_nodes > nodes:
        raise ValueError(f"max_nodes: expected 0 (no cap) or at most nodes={nodes}, got {max_nodes}")


def _set_fields(spec, **fields) -> None:
    """Sets each named field of a ctypes struct (an unknown name is an AttributeError, not a new attribute)."""
    for name, value in fields.items():
        if not hasattr(spec, name):
            raise AttributeError(f"{type(spec).__name__} has no field {name!r}")
        setattr(spec, name, value)


def _check_layer_options(expert_compute, owner_reduce, nodes: int, transport_sms, keep_weight_casts) -> None:
    """The expert compute's name, owner_reduce, transport_sms and keep_weight_casts: types, ranges, and what
    each excludes."""
    if expert_compute != "auto" and expert_compute not in _capi.EXPERT_COMPUTE:
        raise ValueError(f"expert_compute: expected 'auto' or one of {tuple(_capi.EXPERT_COMPUTE)}, got {expert_compute!r}")
    if not isinstance(owner_reduce, bool):
        raise TypeError(f"owner_reduce: expected a bool, got {type(owner_reduce).__name__}")
    if owner_reduce and nodes > 1:
        raise ValueError(f"owner_reduce: with nodes={nodes} the relays already reduce each node's rows; use one of them")
    if isinstance(transport_sms, bool) or not isinstance(transport_sms, int):
        raise TypeError(f"transport_sms: expected an int, got {type(transport_sms).__name__}")
    if not 0 <= transport_sms <= _MAX_TRANSPORT_SMS:
        raise ValueError(f"transport_sms: expected an int in [0, {_MAX_TRANSPORT_SMS}] (0 = every SM), got {transport_sms}")
    if transport_sms and nodes > 1:
        raise ValueError(f"transport_sms: not with nodes={nodes} yet (the two-phase exchange's kernels take no SM budget)")
    if not isinstance(keep_weight_casts, bool):
        raise TypeError(f"keep_weight_casts: expected a bool, got {type(keep_weight_casts).__name__}")


class Layer(CHandle):
    """One rdep MoE layer (shape, capacity rule, ranks and their placement). See the module docstring."""

    _pickle_hint = "save the module's state_dict() and build the module again"

    def __init__(
        self,
        hidden: int,
        ffn: int,
        num_experts: int,
        topk: int,
        max_tokens: int,
        *,
        world_size: Optional[int] = None,
        capacity_factor: float = 0.0,
        segment_tokens: int = 0,
        backend: str = "auto",
        device=None,
        num_gpus: int = 1,
        process_group=None,
        barrier_timeout_s: float = 0.0,
        balance: str = "off",
        balance_slots: int = 2,
        balance_min_quota: int = 1,
        relay_above: int = 4,
        nodes: int = 1,
        max_nodes: int = 0,
        expert_compute: str = "auto",
        owner_reduce: bool = False,
        transport_sms: int = 0,
        domain: Optional[Domain] = None,
        torch_rows: bool = True,
        balance_min_gain: int = 0,
        stash_rows: int = 0,
        keep_weight_casts: bool = False,
        overlap_segments: bool = False,
        gate_in_expert: Optional[bool] = False,
        capturable_ops: bool = True,
        source_windows: bool = True,
    ):
        if not isinstance(capturable_ops, bool):
            raise TypeError(f"capturable_ops: expected a bool, got {type(capturable_ops).__name__}")
        if not isinstance(source_windows, bool):
            raise TypeError(f"source_windows: expected a bool, got {type(source_windows).__name__}")
        _check_config(hidden, ffn, num_experts, topk, max_tokens, capacity_factor, segment_tokens)
        if not isinstance(torch_rows, bool):
            raise TypeError(f"torch_rows: expected a bool, got {type(torch_rows).__name__}")
        _check_balance_and_nodes(balance, balance_slots, balance_min_quota, relay_above, nodes, max_nodes, balance_min_gain)
        _check_layer_options(expert_compute, owner_reduce, nodes, transport_sms, keep_weight_casts)
        _check_sync_free_options(stash_rows, overlap_segments, gate_in_expert)
        if domain is not None:
            if not isinstance(domain, Domain):
                raise TypeError(f"domain: expected an rdep.torch.Domain, got {type(domain).__name__}")
            domain.check_layer_arguments(world_size=world_size, backend=backend, device=device, num_gpus=num_gpus,
                                         process_group=process_group, barrier_timeout_s=barrier_timeout_s)
            resolved, world_size, process_group = domain.backend, domain.world_size, domain.process_group
            device = domain.device
        else:
            resolved = resolve_backend(backend, device, process_group)
        if device is not None:
            device = torch.device(device)
            want = "cuda" if resolved == "cuda" else "cpu"
            if device.type != want:
                raise ValueError(f"device: the {resolved} backend runs on {want} tensors, got device={device}")

        spec = _capi.LayerSpec()
        spec.struct_size = ctypes.sizeof(_capi.LayerSpec)
        keepalive: tuple = ()
        if domain is not None:  # the domain fields: the domain's backend and W, the others left 0
            spec.backend = domain._backend_code
            spec.world_size = world_size  # the domain's, checked when it was made
        else:
            world_size, keepalive = placement_fields(spec, resolved, backend, world_size, num_gpus, process_group, device)
        gpus = _layer_gpus(domain, process_group, device, num_gpus, world_size) if resolved == "cuda" and expert_compute == "auto" else []
        expert_compute, note = _resolve_expert_compute(expert_compute, resolved, gpus, nodes)
        _check_sync_free_needs(stash_rows, overlap_segments, gate_in_expert, expert_compute, balance, nodes, owner_reduce,
                               f" (expert_compute='auto' chose {expert_compute!r}: {note})" if note else "")
        if domain is None:
            spec.barrier_timeout_s = float(barrier_timeout_s)
        gate_in_expert = _gate_in_expert(gate_in_expert, resolved, expert_compute, balance, nodes)
        _set_fields(spec, tokens=max_tokens, hidden=hidden, ffn=ffn, experts=num_experts, topk=topk,
                    capacity_factor=float(capacity_factor), segment_tokens=segment_tokens,
                    balance=_capi.BALANCE_KINDS[balance], balance_slots=balance_slots,
                    balance_min_quota=balance_min_quota, balance_min_gain=balance_min_gain,
                    balance_relay_above=relay_above, nodes=nodes, max_nodes=max_nodes,
                    expert_compute=_capi.EXPERT_COMPUTE[expert_compute], owner_reduce=int(owner_reduce),
                    transport_sms=transport_sms, stash_rows=stash_rows, overlap_segments=int(overlap_segments),
                    gate_in_expert=int(gate_in_expert), no_source_windows=int(not source_windows))

        from . import eager_ext  # noqa: PLC0415 - eager_ext imports this module

        eager_ext.prepare()  # a first build of the eager C++ path runs here, before the collective create, not mid-step
        self.domain = self._create_native(spec, domain, keepalive, resolved, world_size, process_group, device, torch_rows)

        self.hidden, self.ffn, self.num_experts, self.topk, self.max_tokens = hidden, ffn, num_experts, topk, max_tokens
        self.world_size = world_size
        self.capacity_factor = float(capacity_factor)
        self.segment_tokens = segment_tokens
        self.keep_weight_casts = keep_weight_casts
        self.balance, self.nodes, self.max_nodes = balance, nodes, max_nodes
        self.expert_compute = expert_compute
        self.expert_compute_note = note  # why expert_compute='auto' did not choose 'cutlass' ("" otherwise)
        self.owner_reduce = owner_reduce
        self.transport_sms = transport_sms
        self.overlap_segments = overlap_segments
        self.stash_rows = stash_rows
        self.capturable_ops = capturable_ops
        self.gate_in_expert = gate_in_expert
        self.source_windows = source_windows
        self.backend = resolved
        self.process_group = process_group
        with _registry_lock:
            self.id = next(_next_id)
            _registry[self.id] = weakref.ref(self)
        weakref.finalize(self, _registry.pop, self.id, None)
        layer_handles.register(self)  # self.handle, self.rep: how the ops name the layer (layer_handles.py)

    def _create_native(self, spec, domain, keepalive: tuple, resolved: str, world_size: int, process_group, device,
                       torch_rows: bool) -> Domain:
        """Makes the C layer from spec (on `domain`, or on a domain of its own, which it returns as a Domain other
        layers can be made on), reads its placement, and sets torch's caching allocator as its row allocator
        (CUDA, torch_rows). The C handle is freed again if any step fails."""
        L = _capi.lib()
        ptr = _capi.LayerPtr()
        if domain is not None:
            with domain._native.lock, collector_paused(bool(domain._native.keepalive)):
                code = L.rdep_layer_create_on(domain._live_ptr(), ctypes.byref(spec), ctypes.byref(ptr))
                raise_bootstrap_error(code, domain._native.keepalive, "rdep_layer_create_on")
            self._native = _Native(ptr.value, (domain._native,))
        else:
            code = L.rdep_layer_create(ctypes.byref(spec), ctypes.byref(ptr))
            raise_bootstrap_error(code, keepalive, "rdep_layer_create")
            self._native = _Native(ptr.value, keepalive)
        try:
            if domain is None:  # the layer's own domain, as a Domain other layers can be made on
                dptr = _capi.DomainPtr()
                _capi.check(L.rdep_layer_domain(ptr.value, ctypes.byref(dptr)), "rdep_layer_domain")
                domain = Domain._adopt(dptr.value, keepalive, resolved, world_size, spec, process_group, device)
                self._native.keepalive = (domain._native,)
            self._query(resolved, device, world_size)
            if resolved == "cuda" and torch_rows:  # contexts' saved rows from torch's caching allocator
                _capi.check(L.rdep_layer_set_row_allocator(ptr.value, _ROW_ALLOC, _ROW_FREE, ctypes.c_void_p(self._native.row_key)),
                            "rdep_layer_set_row_allocator")
                b = ctypes.c_size_t()
                _capi.check(L.rdep_layer_row_allocator_bytes(ptr.value, ctypes.byref(b)), "rdep_layer_row_allocator_bytes")
                self._native.row_bytes = b.value
                self._native.lock.pause_gc = True
                self._native.keepalive = self._native.keepalive + ((_ROW_ALLOC, _ROW_FREE),)
        except BaseException:
            self._native.close()
            raise
        return domain

    def _query(self, resolved: str, device, world_size: int) -> None:
        L, p = _capi.lib(), self._native.ptr
        first, count = ctypes.c_int32(), ctypes.c_int32()
        _capi.check(L.rdep_layer_local_ranks(p, ctypes.byref(first), ctypes.byref(count)), "rdep_layer_local_ranks")
        self.local_ranks = range(first.value, first.value + count.value)
        e0, ne = ctypes.c_int64(), ctypes.c_int64()
        owned = []
        for r in range(world_size):
            _capi.check(L.rdep_layer_owned_experts(p, r, ctypes.byref(e0), ctypes.byref(ne)), "rdep_layer_owned_experts")
            owned.append((e0.value, ne.value))
        self._owned = tuple(owned)
        devs = []
        d = ctypes.c_int32()
        for rank in self.local_ranks:
            _capi.check(L.rdep_layer_device(p, rank, ctypes.byref(d)), "rdep_layer_device")
            devs.append(d.value)
        self.device = local_device(resolved, devs, device, "layer")
        # Expert offsets of each local rank inside the local weights [E_local, ...] (ownership is contiguous).
        firsts = [self._owned[r][0] for r in self.local_ranks if self._owned[r][1] > 0]
        self.first_local_expert = firsts[0] if firsts else 0
        self._rank_experts = tuple(
            (self._owned[r][0] - self.first_local_expert, self._owned[r][1]) for r in self.local_ranks)
        self.num_local_experts = sum(n for _, n in self._rank_experts)

    # --- what the layer is ---------------------------------------------------------------------------
    @property
    def num_local_ranks(self) -> int:
        return len(self.local_ranks)

    @property
    def local_experts(self) -> range:
        """The global ids of the experts whose weights this process holds (the local ranks' experts)."""
        return range(self.first_local_expert, self.first_local_expert + self.num_local_experts)

    def owned_experts(self, rank: int) -> tuple[int, int]:
        """(first expert, count) that rank owns (contiguous ownership; the first E mod W ranks own one more)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank: {rank} outside [0, world_size={self.world_size})")
        return self._owned[rank]

    def node_of_expert(self) -> list[int]:
        """The node of each expert's owner: the ranks form `nodes` nodes of world_size/nodes consecutive ranks."""
        per_node = self.world_size // self.nodes
        node = [0] * self.num_experts
        for r, (first, count) in enumerate(self._owned):
            for e in range(first, first + count):
                node[e] = r // per_node
        return node

    def capacity(self) -> Optional[int]:
        """Rows each expert admits per call, ceil(C*W*T*K/E); None when dropless (C = 0)."""
        if self.capacity_factor == 0:
            return None
        return math.ceil(self.capacity_factor * self.world_size * self.max_tokens * self.topk / self.num_experts)

    def describe(self) -> str:
        """The C library's description: config, placement, transport."""
        L, p = _capi.lib(), self._live_ptr()
        needed = ctypes.c_size_t()
        _capi.check(L.rdep_layer_describe(p, None, 0, ctypes.byref(needed)), "rdep_layer_describe")
        buf = ctypes.create_string_buffer(needed.value + 1)
        _capi.check(L.rdep_layer_describe(p, buf, len(buf), ctypes.byref(needed)), "rdep_layer_describe")
        return buf.value.decode("utf-8", "replace")

    @property
    def live_contexts(self) -> int:
        """Forward contexts acquired and not yet released (saved state held for a backward), not counting
        those CUDA graphs hold (pinned_contexts). The capturable ops' contexts whose graph was dropped without
        backward are released first (graph_contexts.sweep; otherwise at the layer's next forward). A forward a
        compiled graph ran under saved-tensor hooks other than checkpointing's (save_on_cpu, offloading) is held until
        its backward: one whose graph is dropped without it stays counted here until release_held_contexts() or
        close()."""
        with self._native.lock:
            graph_contexts.sweep(self._native)
            return len(self._native.live) - len(self._native.pinned)

    @property
    def row_bytes(self) -> int:
        """Bytes of one forward's saved rows taken from PyTorch's allocator (rdep_layer_row_allocator_bytes; CUDA
        with torch_rows, else 0): the size of the rows tensor the capturable forward returns."""
        return self._native.row_bytes

    @property
    def pinned_contexts(self) -> int:
        """Forward contexts that CUDA graphs recorded (graph_contexts.py): kept, with their saved rows, while
        the layer lives, since the graphs' replays write and read them."""
        return len(self._native.pinned)

    def release_held_contexts(self) -> int:
        """Releases the contexts held for forwards that ran under saved-tensor hooks other than checkpointing's inside
        compiled graphs (whose hooks may drop the ctx tensor for a copy, so its death cannot say that the graph was
        dropped) and whose backward has not run, returning how many. Call it when no such graph is alive (after a
        step abandoned between forward and backward): a backward of a released forward is refused."""
        with self._native.lock:
            return graph_contexts.release_held(self._native)

    def release_graph_contexts(self) -> int:
        """Releases the contexts CUDA graphs recorded (pinned_contexts), returning how many: call it once every
        graph that recorded this layer is gone (`del graph`; for torch.compile, torch._dynamo.reset()), to reuse
        their slots. A graph replayed after this writes into released contexts: do not. close() frees them too."""
        with self._native.lock:
            return graph_contexts.release_pinned(self._native)

    @property
    def capturable(self) -> bool:
        """Whether rdep.torch.moe calls the capturable ops (ops.py), which a CUDA graph may record: capturable_ops
        (the default) and a layer whose calls never wait on the host, the CUDA backend's sync-free layer
        (expert_compute 'cutlass', balance 'off', one node, no paged stash, whose overflow is checked on the
        host), with one local rank: world_size 1, or one rank per process under torchrun (process_group), whose
        barriers are kernels counting their epochs on the device, so every process's replays go on from its last
        call. Each process then records its own rank's calls, and every process must replay its graphs in the
        same order as the others (as SPMD training does: the same model, the same steps). Several ranks driven
        by one process (ranks sharing a GPU) keep the plain ops: their capture would be one graph of every
        rank's work (the C++ CudaDomain::BeginCapture). capturable_ops=False keeps the plain ops, which
        torch.compile(mode="reduce-overhead") runs between its graphs."""
        return (self.capturable_ops and self.backend == "cuda" and self.expert_compute == "cutlass" and self.balance == "off" and self.nodes == 1
                and self.stash_rows == 0 and self.num_local_ranks == 1)

    def check_errors(self) -> None:
        """Raises the first failure the device barriers of this process's ranks recorded (rdep.RdepTimeoutError: a
        barrier no peer reached, naming the phase and the missing rank; rdep.InternalError: a phase mismatch or
        diverged epochs), or a backward that found no forward in its context (rdep.FailedPreconditionError: a CUDA
        graph's backward replayed, or recorded again, without its forward's replay; it traps in a replay), else returns. It reads mapped host memory: no CUDA call, no wait, so it is cheap enough for every
        training step, and it works after the CUDA context stopped. Every eager call of the layer checks first; calls
        that CUDA graphs replay (the capturable ops under torch.compile(mode="reduce-overhead") with several ranks)
        run no host code, and a barrier that fails in a replay writes its record and traps: torch's next
        synchronization raises a CUDA error, and this names the cause. Like NCCL's ncclCommGetAsyncError."""
        with self._native.lock:
            _capi.check(_capi.lib().rdep_layer_check_errors(self._live_ptr()), "rdep_layer_check_errors")

    def context_bytes(self) -> int:
        """Bytes of saved state held by the live contexts, summed (rdep_context_bytes)."""
        L, p = _capi.lib(), self._live_ptr()
        total, b = 0, ctypes.c_size_t()
        with self._native.lock:
            graph_contexts.sweep(self._native)
            for c_id in list(self._native.live.values()):
                _capi.check(L.rdep_context_bytes(p, c_id, ctypes.byref(b)), "rdep_context_bytes")
                total += b.value
        return total

    def replica_slot_bytes(self) -> int:
        """Bytes per rank of the replica slots this layer uses (weights and gradients; 0 with balancing off).
        They belong to its domain and are shared with the domain's other balanced layers of the same slot
        size: count them once per domain (Domain.memory()), not once per layer."""
        b = ctypes.c_size_t()
        _capi.check(_capi.lib().rdep_layer_replica_slot_bytes(self._live_ptr(), ctypes.byref(b)),
                    "rdep_layer_replica_slot_bytes")
        return b.value

    def shared_row_bytes(self) -> int:
        """Bytes per rank of the CUDA layer's shared buffers: the owner's output rows, with the CUTLASS
        compute that compute's SwiGLU scratch (none of its own at W = 1 with one segment: it uses the return
        region), and on one domain (nodes 1) the segment payload, its sideband and the return region (0 on the
        host backend). Like the replica slots they belong to the domain, one
        region per size shared by every layer of that size: count them once per domain (Domain.memory())."""
        b = ctypes.c_size_t()
        _capi.check(_capi.lib().rdep_layer_shared_row_bytes(self._live_ptr(), ctypes.byref(b)),
                    "rdep_layer_shared_row_bytes")
        return b.value

    def close(self) -> None:
        """Frees the C layer now (contexts still alive become invalid, those CUDA graphs recorded too: replay no
        graph that recorded the layer afterwards; later calls raise ValueError)."""
        self._native.close()
        _registry.pop(self.id, None)
        entry = getattr(self, "_handle_entry", None)  # absent when __init__ failed before registering
        if entry is not None:
            layer_handles.forget(*entry)

    def __repr__(self) -> str:
        cap = "dropless" if self.capacity_factor == 0 else f"capacity_factor={self.capacity_factor:g}"
        return (f"rdep.torch.Layer(id={self.id}, H={self.hidden}, F={self.ffn}, E={self.num_experts}, K={self.topk}, "
                f"T={self.max_tokens}, W={self.world_size}, {cap}, backend={self.backend}, device={self.device}, "
                + (f"expert_compute={self.expert_compute}, gate_in_expert={self.gate_in_expert}, " if self.backend == "cuda" else "")
                + f"local_ranks={list(self.local_ranks)})")

    def _live_ptr(self) -> int:
        p = self._native.ptr
        if p is None:
            raise ValueError(f"layer: {self.id} was closed")
        return p
