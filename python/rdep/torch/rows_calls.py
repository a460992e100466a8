"""The C calls behind the dispatch/combine ops (the caller's own experts, C ABI version 3): the plan,
the received rows' counts and ids, and the four row steps, one rdep_rank_rows per local rank.

Layout: x, y, dy, dx [L, n, H]; experts, gates, dgates [L, n, K]; the received rows of all local ranks
in one tensor [M, H], local rank 0's rows first, each rank's rows expert-major over its experts, so the
whole tensor is expert-major over layer.local_experts; counts [E_local] int64 on the CPU (rows per local
expert, summing to M). Contexts follow layer_calls.py's protocol (token tensor, finalizer, live table):
the plan acquires one, dispatch's backward (the last step) releases it.
"""

from __future__ import annotations

import ctypes

import torch

from .. import _capi
from .._errors import error_for_code
from .layer import Layer
from .layer_calls import _context_tensor, _rank_streams, live_context_id

DISPATCH, COMBINE, COMBINE_BACKWARD, DISPATCH_BACKWARD = "dispatch", "combine", "combine backward", "dispatch backward"
_C_STEP = {DISPATCH: "rdep_layer_dispatch", COMBINE: "rdep_layer_combine",
           COMBINE_BACKWARD: "rdep_layer_combine_backward", DISPATCH_BACKWARD: "rdep_layer_dispatch_backward"}


def plan(layer: Layer, experts: torch.Tensor, gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the plan collective for the local ranks; returns (ctx, counts [E_local] int64 CPU)."""
    L, n, K = layer.num_local_ranks, experts.shape[1], layer.topk
    io = (_capi.RankIO * L)()
    ep, gp, b = experts.data_ptr(), gates.data_ptr(), n * K * 4
    streams = _rank_streams(layer)
    for i in range(L):
        io[i].num_tokens = n
        io[i].experts = ep + i * b
        io[i].gates = gp + i * b
        io[i].stream = streams[i]
    lib, native = _capi.lib(), layer._native
    with native.lock:
        ptr = layer._live_ptr()
        c_id = ctypes.c_int64()
        _capi.check(lib.rdep_context_acquire(ptr, ctypes.byref(c_id)), "rdep_context_acquire")
        try:
            _capi.check(lib.rdep_layer_plan(ptr, c_id.value, io, L), "rdep_layer_plan")
            counts = _recv_counts(layer, c_id.value)
        except BaseException:
            native.release(c_id.value)
            raise
        return _context_tensor(layer, c_id.value), counts


def _recv_counts(layer: Layer, c_id: int) -> torch.Tensor:
    counts = torch.zeros(layer.num_local_experts, dtype=torch.int64)
    lib, ptr, base = _capi.lib(), layer._live_ptr(), counts.data_ptr()
    for rank, (offset, num) in zip(layer.local_ranks, layer._rank_experts):
        dst = ctypes.cast(base + offset * 8, ctypes.POINTER(ctypes.c_int64))
        _capi.check(lib.rdep_context_recv_counts(ptr, c_id, rank, dst, num), "rdep_context_recv_counts")
    return counts


def rank_rows(layer: Layer, counts: torch.Tensor) -> list[int]:
    """Rows each local rank receives (its experts' counts summed)."""
    c = counts.tolist()  # a CPU tensor: no device synchronization
    return [sum(c[off:off + num]) for off, num in layer._rank_experts]


def live_context(layer: Layer, ctx: torch.Tensor, step: str) -> tuple[int, int]:
    """(C id, token) of the live context ctx names (layer_calls.live_context_id), else an error naming it."""
    return live_context_id(layer, ctx, f" for {step}: its plan was released (dispatch's backward ended it, or the plan "
                           "was dropped)", "plan whose context was released", "a plan's")


def row_ids(layer: Layer, ctx: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The received rows' ids [M] int64 (CPU), in the received rows' order, after dispatch."""
    native = layer._native
    per_rank = rank_rows(layer, counts)
    ids = torch.zeros(sum(per_rank), dtype=torch.int64)
    with native.lock:
        c_id = live_context(layer, ctx, "row ids")[0]
        lib, ptr, base, first = _capi.lib(), layer._live_ptr(), ids.data_ptr(), 0
        for rank, m in zip(layer.local_ranks, per_rank):
            dst = ctypes.cast(base + first * 8, ctypes.POINTER(ctypes.c_int64))
            _capi.check(lib.rdep_context_recv_row_ids(ptr, c_id, rank, dst, m), "rdep_context_recv_row_ids")
            first += m
    return ids


def run_step(step: str, layer: Layer, ctx: torch.Tensor, counts: torch.Tensor, inp: torch.Tensor, out: torch.Tensor,
             dgates: torch.Tensor | None = None) -> None:
    """One row step for the local ranks. Token-side tensors are [L, n, ...]; row-side ones [M, H]."""
    L, H, K = layer.num_local_ranks, layer.hidden, layer.topk
    per_rank = rank_rows(layer, counts)
    token_in = step in (COMBINE_BACKWARD, DISPATCH)
    tokens, row_side = (inp, out) if token_in else (out, inp)
    if row_side.shape[0] != sum(per_rank):  # the C call reads or writes exactly this many rows
        name = {DISPATCH: "recv", COMBINE: "expert_out", COMBINE_BACKWARD: "d_out", DISPATCH_BACKWARD: "d_recv"}[step]
        raise ValueError(f"{name}: expected {sum(per_rank)} rows (the rows this process receives, the sum of the "
                         f"plan's tokens_per_expert), got {row_side.shape[0]}")
    n = tokens.shape[1]
    rows = (_capi.RankRows * L)()
    streams = _rank_streams(layer)
    esz = inp.element_size()
    first = 0
    for i in range(L):
        tok_addr = tokens.data_ptr() + i * n * H * esz
        row_addr = row_side.data_ptr() + first * H * esz
        r = rows[i]
        r.stream = streams[i]
        if token_in:
            setattr(r, "in", tok_addr)  # `in` is a Python keyword
            r.out, r.in_rows, r.out_rows = row_addr, n, per_rank[i]
        else:
            setattr(r, "in", row_addr)
            r.out, r.in_rows, r.out_rows = tok_addr, per_rank[i], n
        if dgates is not None:
            r.dgates = dgates.data_ptr() + i * n * K * 4
        first += per_rank[i]
    native = layer._native
    with native.lock:
        c_id, token = live_context(layer, ctx, step)
        try:
            code = getattr(_capi.lib(), _C_STEP[step])(layer._live_ptr(), c_id, rows, L)
            if code != 0:
                raise error_for_code(code, f"{_C_STEP[step]}: {_capi.last_error()}")
        finally:
            if step == DISPATCH_BACKWARD:  # the last step: the context's work is done
                native.release(c_id, token)
