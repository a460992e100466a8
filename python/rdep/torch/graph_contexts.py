"""Forward contexts named by a tensor on the layer's device: the bookkeeping of the capturable ops
(rdep::moe_forward_capturable / moe_backward_capturable, ops.py), which a CUDA graph can hold.

The plain ops name a context by a 0-dim int64 CPU tensor holding its token (layer_calls.py). A CUDA graph
(torch.cuda.graph, or torch.compile(mode="reduce-overhead"), whose CUDA graph trees skip any graph with a
CPU tensor in it) cannot hold that tensor, and its replays run no host code: each replay of a captured
forward writes the context the capture used, and each replay of the captured backward reads it. So:
  * ctx is a 0-dim int64 tensor on x's device holding the context's token (its slot index, as the plain
    ops' ctx), and the context is found by the tensor's *address* (ctx.data_ptr(): host metadata, read
    without synchronizing). Autograd hands the backward the very tensor the forward returned (also through a
    compiled graph, as a saved activation), so the address pairs a backward with its forward. A copy of ctx
    (torch.library.opcheck clones its arguments) has another address: outside a capture its value is then
    read (on CUDA a synchronization, on this rare path only) and the context found by its token;
  * an address is reused once its tensor is freed, so an entry remembers a weak reference to ctx's
    storage: an entry whose storage died (a graph dropped without backward) is released at the layer's
    next forward of this kind, or when Layer.live_contexts or context_bytes() is read (`sweep`), and is
    never matched again;
  * a context whose calls were recorded in a stream capture is *pinned*: the graph's replays write and
    read its buffers and rows, so it is never released, nor handed to another forward, while the layer
    lives (Layer.pinned_contexts counts them; Layer.release_graph_contexts, once the graphs are gone, or
    Layer.close frees them). No other path releases them: the plain ops' and rows.py's token lookups refuse
    a pinned id. A captured forward
    with no saved context (grad off) pins its context as well. A capture records each call once: every
    capture of a forward takes a context of its own.
  * a pinned context whose backward already ran (captured) and whose forward a graph replays cannot run
    an eager backward again (the library's host state says its backward ran): such a backward is refused
    naming the cause, where the library would only say that the context holds no forward. A backward *captured*
    again after such a replay (CUDA graph trees record a second backward node under a replayed forward node when
    the first one's checks fail) runs: the replay wrote the context's state, and the library is told so (`rearm`);
  * a forward captured while no released context is free takes a new one, whose buffers the library makes inside
    the capture (outside the graph: gradient accumulation under reduce-overhead records a forward node per
    micro-batch, each with a context of its own).
What a replay does not do: check the routing on the host (a bad expert id runs with zero gates, as in an
eager sync-free forward, but no error is raised: check the routing before capturing, or use the module's
own router), report a failed barrier on the host (with several ranks, one a process: the barrier traps after
writing its record, so the CUDA context stops; Layer.check_errors() names it), or a backward replayed without
its forward's replay (at any W: the backward's device check writes the record and traps), or release anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._errors import FailedPreconditionError


@dataclass
class Entry:
    """One forward's context, named by the address of its ctx tensor."""

    c_id: int
    address: int             # ctx.data_ptr(), the entry's key
    storage: StorageWeakRef  # ctx's storage: expired once the tensor is freed (its address may then be reused)
    pinned: bool = False     # recorded in a stream capture: never released (the graph's replays use it)
    backward_ran: bool = False
    rows_at: int = 0         # the address of the rows tensor (the arena) whose pieces the context's saved rows are
    rows_bytes: int = 0      # and its bytes (0: none)
    rows_storage: StorageWeakRef | None = None  # that tensor's storage (a hook's copy replaces it: follow_rows)
    held: bool = False       # saved-tensor hooks may have copied ctx: kept (not swept) until its backward or close


# torch's own calls without their Python wrappers (the wrappers where a torch lacks them).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def capturing(t: torch.Tensor) -> bool:
    """Whether the current stream of t's device is capturing a CUDA graph (False for CPU tensors). Every call of the
    capturable ops asks: torch's raw calls take 0.8 against ~10 us of host time on a GPU machine's host."""
    if not t.is_cuda:
        return False
    index = t.get_device()
    if index == _current_device():
        return _stream_capturing()
    with torch.cuda.device(index):
        return _stream_capturing()


def no_context(device: torch.device) -> torch.Tensor:
    """The ctx of a forward that saved nothing (grad off): NO_CONTEXT (-1), at an address no entry names."""
    return torch.full((), -1, dtype=torch.int64, device=device)


def sweep(native) -> None:
    """Releases the unpinned contexts whose ctx tensor was freed without a backward (call under native.lock)."""
    dead = [a for a, e in native.by_address.items() if not e.pinned and not e.held and e.storage.expired()]
    for a in dead:
        e = native.by_address.pop(a)
        native.release(e.c_id, e.c_id >> 32)


def context_tensor(native, c_id: int, device: torch.device, pinned: bool, rows: torch.Tensor | None = None,
                   held: bool = False) -> torch.Tensor:
    """A new ctx for the context c_id (call under native.lock, after `sweep`): registered by address, with
    its token in native.live (so that casts kept for its backward are found as the plain ops' are). rows: the
    arena the forward took the context's saved rows from, if any. held: see Entry."""
    ctx = torch.full((), c_id >> 32, dtype=torch.int64, device=device)
    address = ctx.data_ptr()
    old = native.by_address.pop(address, None)  # an address is reused only once its old ctx was freed
    if old is not None and (old.pinned or old.held):
        native.displaced.append(old)  # still found by its token (a replayed forward's ctx, or a hook's copy, holds it)
    elif old is not None:
        native.release(old.c_id, old.c_id >> 32)
    native.by_address[address] = Entry(
        c_id, address, StorageWeakRef(ctx.untyped_storage()), pinned, held=held,
        rows_at=rows.data_ptr() if rows is not None else 0, rows_bytes=rows.numel() if rows is not None else 0,
        rows_storage=StorageWeakRef(rows.untyped_storage()) if rows is not None else None)
    native.live[c_id >> 32] = c_id
    if pinned:
        native.pinned.add(c_id)
    return ctx


def pin(native, c_id: int) -> None:
    """Keeps a context a capture recorded without a ctx (a forward with grad off) for the layer's life."""
    native.pinned.add(c_id)
    native.live[c_id >> 32] = c_id


def entry_of(native, ctx: torch.Tensor, capturing_now: bool = False):
    """The live entry ctx names, or None (call under native.lock): by ctx's address, else (a copy of a ctx,
    outside a capture) by the token it holds."""
    e = native.by_address.get(ctx.data_ptr())
    if e is not None and (e.pinned or not e.storage.expired()):
        return e
    if capturing_now:
        return None
    token = int(ctx)  # a copy: read its value (on CUDA this synchronizes; only on this path)
    for e in native_entries(native):  # unreleased contexts: one per slot
        if e.c_id >> 32 == token:
            return e
    return None


def native_entries(native):
    """Every unreleased entry: by address and displaced (under native.lock)."""
    return list(native.by_address.values()) + native.displaced


def release_held(native) -> int:
    """Releases every held context, the capturable ops' entries and the plain ops' (Layer.release_held_contexts; under
    native.lock); returns how many."""
    entries = [e for e in native_entries(native) if e.held and not e.pinned]
    for e in entries:
        forget(native, e)
        native.release(e.c_id, e.c_id >> 32)
    plain = list(native.held.items())
    for token, c_id in plain:
        native.release(c_id, token)
    return len(entries) + len(plain)


def release_pinned(native) -> int:
    """Releases every pinned context (Layer.release_graph_contexts; call under native.lock); returns how many."""
    ids = list(native.pinned)
    native.pinned.clear()
    native.displaced = [e for e in native.displaced if e.c_id not in ids]  # held ones stay
    for a in [a for a, e in native.by_address.items() if e.c_id in ids]:
        del native.by_address[a]
    for c_id in ids:
        native.release(c_id, c_id >> 32)
    return len(ids)


def entry_for_backward(layer, ctx: torch.Tensor, capturing_now: bool) -> Entry:
    """The entry whose context a backward given ctx runs on, else an error naming ctx (under native.lock)."""
    e = entry_of(layer._native, ctx, capturing_now)
    if e is None:
        raise FailedPreconditionError(
            f"ctx: no live context of layer {layer.id} is named by this tensor (address {ctx.data_ptr():#x}): its "
            "forward ran with grad off (save_context=False), or its backward already ran (one backward per forward: "
            "retain_graph=True double backward is not supported), or it is not a ctx moe_forward_capturable returned")
    if e.pinned and e.backward_ran and not capturing_now:
        raise FailedPreconditionError(
            f"ctx: layer {layer.id}'s forward was recorded in a CUDA graph whose backward already ran; an eager "
            "backward cannot follow a replay of that forward (the library's state is the capture's). Capture the "
            "backward too (torch.compile(mode='reduce-overhead') records both), or run the forward eagerly")
    return e


def follow_rows(layer, e: Entry, rows: torch.Tensor, capturing_now: bool) -> None:
    """Where the rows tensor a backward is given is not where the forward's arena was (a saved-tensor hook moved it:
    save_on_cpu, activation offloading, also around a compiled graph, whose saved activations pass through the hooks
    when it runs), the context reads its saved rows from the copy (rdep_context_rebase_rows; under native.lock): the
    old bytes went back to torch and may hold other tensors now. A context a CUDA graph recorded cannot follow (its
    replays read the recorded addresses): refused, naming the cause."""
    if not e.rows_bytes or rows.data_ptr() == e.rows_at:
        return
    # Another forward's rows, still alive where it left them (a dead one's old address may hold this copy now).
    others = [o for o in native_entries(layer._native) if o is not e and o.rows_bytes and o.rows_at == rows.data_ptr()
              and o.rows_storage is not None and not o.rows_storage.expired()]
    if others:
        raise FailedPreconditionError(
            f"rows: this tensor holds another forward's saved rows (layer {layer.id}'s context {others[0].c_id >> 32}), "
            f"not those of ctx's (context {e.c_id >> 32}): pass each backward the rows its own forward returned")
    if e.pinned or capturing_now:
        raise FailedPreconditionError(
            f"rows: layer {layer.id}'s saved rows tensor moved (from {e.rows_at:#x} to {rows.data_ptr():#x}), so a "
            "saved-tensor hook (save_on_cpu, activation offloading) copied it, but a CUDA graph recorded this context, "
            "whose replays read the recorded addresses. Capture without such hooks, or use capturable_ops=False")
    if rows.data_ptr() % 256 != 0:
        raise FailedPreconditionError(
            f"rows: layer {layer.id}'s saved rows tensor came back from a saved-tensor hook at {rows.data_ptr():#x}, "
            "not 256-byte aligned (a view into a pooled buffer?); the context's saved rows need a 256-byte aligned copy")
    from .. import _capi  # here: graph_contexts is imported by the ops' fake kernels, which need no library

    lib = _capi.lib()
    _capi.check(lib.rdep_context_rebase_rows(layer._live_ptr(), e.c_id, e.rows_at, e.rows_bytes, rows.data_ptr()),
                "rdep_context_rebase_rows")
    e.rows_at, e.rows_storage = rows.data_ptr(), StorageWeakRef(rows.untyped_storage())


def recorded_entry(layer, e: Entry, rows: torch.Tensor | None) -> Entry:
    """The recorded forward a backward captured again follows (e: the entry ctx's address found, pinned, its backward
    run). Graph trees reuse their pool's addresses across nodes, so several recorded forwards' ctx tensors may have
    had ctx's address: e, the newest, when its rows tensor is at rows' address too, else the one other recorded forward
    whose ctx and rows were at both addresses. Raises where none or several others were (under native.lock). Where an
    older forward's outputs had both addresses as well, e is taken: the backward's device check then traps if e's
    forward did not run since its last backward (CudaDomain::TakeForward)."""
    def fits(o: Entry) -> bool:
        return rows is None or not o.rows_bytes or o.rows_at == rows.data_ptr()

    if fits(e):
        return e
    same = [o for o in native_entries(layer._native) if o is not e and o.pinned and o.address == e.address and fits(o)]
    if len(same) == 1:
        return same[0]
    if not same and not e.backward_ran:
        return e  # no other forward fits either: follow_rows names the moved rows
    at = f"a ctx at {e.address:#x} with rows at {rows.data_ptr() if rows is not None else 0:#x}"
    if not same:
        raise FailedPreconditionError(
            f"ctx: layer {layer.id}'s backward is being recorded again for {at}, and no recorded forward's outputs were "
            "at both addresses: a saved-tensor hook moved the rows (save_on_cpu, offloading: not for recorded "
            "forwards), or these are not the tensors a recorded forward returned")
    raise FailedPreconditionError(
        f"ctx: layer {layer.id}'s backward is being recorded again for {at}, which {len(same)} recorded forwards' "
        "outputs had: which forward it follows is ambiguous. Call torch.compiler.cudagraph_mark_step_begin() once a "
        "step, or use capturable_ops=False")


def rearm(layer, e: Entry) -> None:
    """A backward is being captured for a recorded forward whose backward already ran (CUDA graph trees record a
    second backward node under the replayed forward node when the first one's checks fail): the forward's replay
    wrote the context's saved state, so the library may run the backward's calls on it again (rdep_context_rearm;
    under native.lock). The new graph reads the same context, after the forward node's replay, as the first did. Where
    no forward ran since the last backward (a second backward of one forward), the backward's device check records
    it and traps (rdep_layer_check_errors names it)."""
    from .. import _capi

    _capi.check(_capi.lib().rdep_context_rearm(layer._live_ptr(), e.c_id), "rdep_context_rearm")


def after_backward(native, e: Entry, capturing_now: bool) -> None:
    """Releases the context after its backward, unless a graph holds it (under native.lock). A backward
    recorded in a capture pins its context even when its forward ran eagerly: the replays read it."""
    e.backward_ran = True
    if capturing_now and not e.pinned:
        e.pinned = True
        native.pinned.add(e.c_id)
    if e.pinned:
        return
    forget(native, e)
    native.release(e.c_id, e.c_id >> 32)


def forget(native, e: Entry) -> None:
    """Drops e from the lookups (under native.lock): its address, where a later ctx has not taken it, else displaced."""
    if native.by_address.get(e.address) is e:
        del native.by_address[e.address]
    else:
        native.displaced = [d for d in native.displaced if d is not e]


def keep_by_node(native, ctx: torch.Tensor) -> bool:
    """An eager call's held entry for ctx (the tensor the forward returned, its node about to keep it): no longer held,
    so that its graph's drop releases it again (the node keeps ctx alive until then). Whether ctx had one."""
    e = native.by_address.get(ctx.data_ptr())
    if e is None or not e.held:
        return False
    e.held = False
    return True
