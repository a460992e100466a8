"""The C calls behind the custom ops: one rdep_rank_io per local rank built from tensor addresses, the
forward and backward collectives, and the forward contexts.

Context protocol (the C ABI pools contexts; a released id is stale, releasing it again is a no-op):
  * forward acquires a context; with save=False (grad off) it is released before returning, and the
    returned ctx holds NO_CONTEXT;
  * otherwise forward returns ctx, a 0-dim int64 CPU tensor whose value is the *token*, the context's
    slot index (C id >> 32). Tokens are deterministic (the same calls give the same tokens, which
    torch.library.opcheck compares between eager and compiled runs); the C id with its generation is
    kept beside it: ctx is a view of element 0 of a 2-element host buffer [token, C id] (an
    array.array), and the buffer's finalizer releases the context, so a graph dropped without
    backward does not leak the slot;
  * backward looks the token up in the layer's live table and, when ctx still has its buffer (not a
    copy), checks the C id: an older forward's ctx whose slot was released and reused is refused
    instead of being paired with another forward's saved state. It runs, then releases the context.
The C backward consumes its context: one backward per forward (a retain_graph=True double backward is
refused with an error; inside a CUDA graph, where the host cannot see it, the backward's device check records it and
traps: CudaDomain::TakeForward). The capturable ops (device_ctx) name contexts by a device tensor's address instead
(graph_contexts.py) and take their saved rows from a tensor the forward returns (rdep_layer_forward_arena).

Tensor layout: x, y, dy, dx [L, n, H]; experts, gates, dgates [L, n, K]; w1, dw1 [E_local, H, 2F] and
w2, dw2 [E_local, F, H], where local rank i's rows start at i*n and its experts at Layer._rank_experts[i].
"""

from __future__ import annotations

import array
import ctypes
import weakref

import torch

from .. import _capi
from .._errors import FailedPreconditionError, error_for_code
from . import graph_contexts
from .layer import Layer, _release_quietly

NO_CONTEXT = -1  # the token forward returns when it saved nothing (save=False)


# The current stream's raw handle without a torch.cuda.Stream object (~20 us less a call on a slow host); torch's
# public call where a torch lacks it.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _rank_streams(layer: Layer) -> list[int]:
    if layer.backend != "cuda":
        return [0] * layer.num_local_ranks
    if _RAW_STREAM is not None:
        s = _RAW_STREAM(layer.device.index)
    else:
        s = torch.cuda.current_stream(layer.device).cuda_stream
    return [s] * layer.num_local_ranks  # the torch binding's local ranks share one GPU


def _fill_weights(io, layer: Layer, w1: torch.Tensor, w2: torch.Tensor, dw1=None, dw2=None) -> None:
    H, F = layer.hidden, layer.ffn
    b1 = H * 2 * F * w1.element_size()  # bytes of one expert's w1
    b2 = F * H * w2.element_size()
    p1, p2 = w1.data_ptr(), w2.data_ptr()
    if dw1 is not None:
        g1, g2 = dw1.data_ptr(), dw2.data_ptr()
        gb1, gb2 = H * 2 * F * dw1.element_size(), F * H * dw2.element_size()
    for i, (e_off, _) in enumerate(layer._rank_experts):
        io[i].w1 = p1 + e_off * b1
        io[i].w2 = p2 + e_off * b2
        if dw1 is not None:
            io[i].dw1 = g1 + e_off * gb1
            io[i].dw2 = g2 + e_off * gb2


def _new_io(layer: Layer):
    return (_capi.RankIO * layer.num_local_ranks)()


def _context_tensor(layer: Layer, c_id: int, hold: bool = False) -> torch.Tensor:
    """The plain ops' ctx for c_id. hold: the layer holds the context (native.held, until its backward, close or
    Layer.release_held_contexts) instead of the ctx's finalizer releasing it when the ctx dies (a hook may drop it for
    a copy). No finalizer then: one would keep the layer's _Native alive from the finalizers' registry for as long as
    the layer itself holds the ctx's buffer."""
    native = layer._native
    token = c_id >> 32
    buf = array.array("q", [token, c_id])
    ctx = torch.frombuffer(buf, dtype=torch.int64)[0]  # a view: its storage keeps buf (and the C id) alive
    native.live[token] = c_id
    if hold:
        native.held[token] = c_id
    else:
        weakref.finalize(buf, _release_quietly, native, c_id, token)
    return ctx


def keep_by_node(layer: Layer, ctx: torch.Tensor) -> bool:
    """A held plain context (the ctx its eager forward returned, about to be kept by its autograd node): released again
    when that ctx dies, i.e. when the node does (a finalizer on the tensor, which the node keeps alive), not by the
    layer. Under native.lock. Whether it was held."""
    native = layer._native
    token, c_id = _read_context(ctx)
    if c_id is None or native.held.get(token) != c_id:
        return False
    del native.held[token]
    weakref.finalize(ctx, _release_quietly, native, c_id, token)
    return True


def forward(layer: Layer, x, experts, gates, w1, w2, save: bool, keep_casts=None, check_routing: bool = True,
            device_ctx: bool = False, hold: bool = False):
    """Runs the forward collective for the local ranks; returns (y, ctx). keep_casts (w1, w2 and what they
    were cast from, ops._CastSource) is kept with the context for its backward (kept_casts) when save is set.
    check_routing: without a saved context on CUDA, wait for the device's check of the routing (no backward
    will report a fault the sync-free forward could not read yet) before releasing the context; not inside a
    CUDA graph capture, which cannot wait. device_ctx (the capturable ops): returns (y, ctx, rows): ctx is a
    tensor on x's device named by its address, a forward recorded in a capture pins its context
    (graph_contexts.py), and the context's saved rows are pieces of `rows` (uint8 [Layer row bytes]: the C library's
    arena for the call, rdep_layer_forward_arena),
    which the caller keeps alive until the backward, as autograd keeps any saved activation. hold (saved-tensor hooks
    that may copy ctx are set, ops._hooks_copy_saved): the context is kept until its backward or the layer's close
    rather than released when the ctx tensor returned dies (the hooks may have dropped it for a copy)."""
    L, n, H, K = layer.num_local_ranks, x.shape[1], layer.hidden, layer.topk
    y = torch.empty_like(x)
    io = _new_io(layer)
    xb, eb, gb = n * H * x.element_size(), n * K * 4, n * K * 4
    xp, yp, ep, gp = x.data_ptr(), y.data_ptr(), experts.data_ptr(), gates.data_ptr()
    streams = _rank_streams(layer)
    for i in range(L):
        r = io[i]
        r.num_tokens = n
        r.experts = ep + i * eb
        r.gates = gp + i * gb
        r.x = xp + i * xb
        r.y = yp + i * xb
        r.stream = streams[i]
    _fill_weights(io, layer, w1, w2)
    capturing = device_ctx and graph_contexts.capturing(x)
    lib, native = _capi.lib(), layer._native
    rows = torch.empty(native.row_bytes, dtype=torch.uint8, device=x.device) if device_ctx else None
    with native.lock:
        ptr = layer._live_ptr()
        if device_ctx:
            graph_contexts.sweep(native)  # first, so that the slots of dropped graphs are reused in order
        c_id = ctypes.c_int64()
        _capi.check(lib.rdep_context_acquire(ptr, ctypes.byref(c_id)), "rdep_context_acquire")
        if rows is not None and native.row_bytes:
            used = ctypes.c_size_t()
            code = lib.rdep_layer_forward_arena(ptr, c_id.value, io, L, rows.data_ptr(), native.row_bytes, ctypes.byref(used))
            native.arena_used = used.value  # what the call took (tests compare row_bytes)
            what = "rdep_layer_forward_arena"
        else:
            code = lib.rdep_layer_forward(ptr, c_id.value, io, L)
            native.arena_used = 0
            what = "rdep_layer_forward"
        if code == 0 and not save and check_routing and layer.backend == "cuda" and not capturing:
            # No backward will report a routing fault the sync-free forward could not read yet: wait for the
            # device's check here (the forward that waited on the host has read it already: no wait then).
            code, what = lib.rdep_context_check_routing(ptr, c_id.value), "rdep_context_check_routing"
        if code != 0 or not save:
            msg = _capi.last_error() if code != 0 else ""
            if code == 0 and capturing:
                graph_contexts.pin(native, c_id.value)  # the graph's replays write this context
            else:
                native.release(c_id.value)
            if code != 0:
                raise error_for_code(code, f"{what}: {msg}")
            if device_ctx:
                return y, graph_contexts.no_context(x.device), rows
            return y, torch.full((), NO_CONTEXT, dtype=torch.int64)
        if device_ctx:
            ctx = graph_contexts.context_tensor(native, c_id.value, x.device, pinned=capturing,
                                                rows=rows if native.arena_used else None,
                                                held=hold and not capturing)
        else:
            ctx = _context_tensor(layer, c_id.value, hold=hold)
        if keep_casts is not None:
            native.casts[c_id.value >> 32] = (c_id.value,) + tuple(keep_casts)
        return (y, ctx, rows) if device_ctx else (y, ctx)


def kept_casts(layer: Layer, ctx):
    """The (w1, w2, source) the forward that returned ctx kept, else None: dropped with its context, and
    None for a ctx whose slot another forward holds now (backward then refuses it, or casts for it). The
    plain ops only: the capturable ones return their casts as tensors (ops.py)."""
    native = layer._native
    with native.lock:
        token, c_id_seen = _read_context(ctx)
        kept = native.casts.get(token)
        if kept is None or native.live.get(token) != kept[0] or (c_id_seen is not None and c_id_seen != kept[0]):
            return None
        return kept[1:]


def _read_context(ctx: torch.Tensor) -> tuple[int, int | None]:
    """(token, the C id when ctx still has forward's buffer, else None). ctx is a host tensor (checked),
    so reading it never synchronizes a device."""
    token = ctypes.c_int64.from_address(ctx.data_ptr()).value
    if ctx.storage_offset() == 0 and ctx.untyped_storage().nbytes() == 16:
        return token, ctypes.c_int64.from_address(ctx.data_ptr() + 8).value
    return token, None


def _casts_into_grads(layer: Layer, w1, w2, dw1, dw2):
    """The bf16 casts of fp32 w1, w2 written into the first half of each local rank's fp32 dw1, dw2 bytes
    (C ABI 13: the backward reads each weight before it overwrites that weight's gradient); returns the
    per-rank (w1, w2) addresses, None for a rank without experts. Each rank's copy is one contiguous
    [E_r][H][2F] (and [E_r][F][H]) bf16 array in the first half of its own gradients, as the C ABI requires."""
    H, F = layer.hidden, layer.ffn
    ptrs = []
    for e_off, n in layer._rank_experts:
        if n == 0:
            ptrs.append(None)
            continue
        rank_ptrs = []
        for w, g, per in ((w1, dw1, H * 2 * F), (w2, dw2, F * H)):
            dst = g[e_off:e_off + n].view(torch.bfloat16).reshape(-1)[:n * per].view(w[e_off:e_off + n].shape)
            dst.copy_(w[e_off:e_off + n])
            rank_ptrs.append(dst.data_ptr())
        ptrs.append(tuple(rank_ptrs))
    return ptrs


def live_context_id(layer: Layer, ctx, not_live: str, older: str, whose: str) -> tuple[int, int]:
    """(C id, token) of the live context a plain op's or a plan's ctx names, else FailedPreconditionError naming
    ctx (call under the layer's lock): a context a CUDA graph holds is not `whose`; not_live and older finish the
    messages for a token no live context has and for a copy of an older ctx whose slot was reused."""
    token, c_id_seen = _read_context(ctx)
    c_id = layer._native.live.get(token) if token != NO_CONTEXT else None
    if c_id is not None and c_id in layer._native.pinned:
        raise FailedPreconditionError(
            f"ctx: token {token} names a context a CUDA graph recorded (the capturable ops'), not {whose}")
    if c_id is None:
        raise FailedPreconditionError(f"ctx: token {token} is not a live context of layer {layer.id}{not_live}")
    if c_id_seen is not None and c_id_seen != c_id:
        raise FailedPreconditionError(f"ctx: token {token} belongs to an older {older}")
    return c_id, token


def backward(layer: Layer, ctx, dy, w1, w2, grad_dtype=torch.float32, casts_in_grads=False, device_ctx=False, rows=None):
    """Runs the backward collective of the forward that returned ctx, then releases its context (unless a
    CUDA graph holds it: device_ctx, graph_contexts.py); returns (dx, dgates, dw1, dw2) with dw1, dw2 in
    grad_dtype: fp32, or on CUDA bf16 (the gradients of bf16 weights, written by the layer's GEMMs directly:
    no fp32 copy, no cast). casts_in_grads (fp32 w1, w2, fp32 gradients; ops._casts_in_grads says where): the
    layer reads the weights' bf16 casts from inside the gradient buffers it then overwrites
    (_casts_into_grads), so no separate copy is alive meanwhile. rows (device_ctx): the rows tensor the forward
    returned, as the backward was given it (graph_contexts.follow_rows: where a hook moved it)."""
    L, n, H, K = layer.num_local_ranks, dy.shape[1], layer.hidden, layer.topk
    native = layer._native
    with native.lock:
        if device_ctx:
            capturing = graph_contexts.capturing(dy)
            entry = graph_contexts.entry_for_backward(layer, ctx, capturing)
            if capturing and entry.pinned:  # recorded again (rearm below), or an older recorded forward's tensors
                entry = graph_contexts.recorded_entry(layer, entry, rows)
            c_id, token = entry.c_id, entry.c_id >> 32
            if rows is not None:
                graph_contexts.follow_rows(layer, entry, rows, capturing)
        else:
            c_id, token = live_context_id(
                layer, ctx, ": its forward ran with grad off (save_context=False), or its backward already ran (one "
                "backward per forward: retain_graph=True double backward is not supported), or it was released",
                "forward whose context was released (its backward already ran: one backward per forward) and whose "
                "slot now holds another forward's state", "this op's")
        dx = torch.empty_like(dy)
        dgates = torch.empty((L, n, K), dtype=torch.float32, device=dy.device)
        grad_bf16 = grad_dtype == torch.bfloat16
        dw1 = torch.empty(w1.shape, dtype=grad_dtype, device=w1.device)
        dw2 = torch.empty(w2.shape, dtype=grad_dtype, device=w2.device)
        io = _new_io(layer)
        db, gb = n * H * dy.element_size(), n * K * 4
        dyp, dxp, dgp = dy.data_ptr(), dx.data_ptr(), dgates.data_ptr()
        streams = _rank_streams(layer)
        for i in range(L):
            r = io[i]
            r.num_tokens = n
            r.dy = dyp + i * db
            r.dx = dxp + i * db
            r.dgates = dgp + i * gb
            r.stream = streams[i]
            r.grad_bf16 = int(grad_bf16)
        _fill_weights(io, layer, w1, w2, dw1, dw2)
        if casts_in_grads:
            for i, ptrs in enumerate(_casts_into_grads(layer, w1, w2, dw1, dw2)):
                if ptrs is not None:  # a rank without experts keeps _fill_weights' (unread) addresses
                    io[i].w1, io[i].w2 = ptrs
        if device_ctx and capturing and entry.pinned and entry.backward_ran:
            graph_contexts.rearm(layer, entry)  # last before the call: nothing above may fail after it
        lib = _capi.lib()
        try:
            _capi.check(lib.rdep_layer_backward(layer._live_ptr(), c_id, io, L), "rdep_layer_backward")
        finally:
            if device_ctx:
                graph_contexts.after_backward(native, entry, capturing)
            else:
                native.release(c_id, token)
    return dx, dgates, dw1, dw2
