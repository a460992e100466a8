"""Input checks of the custom ops, run before anything reaches C (and, on fake tensors, while tracing).

Every message names the argument: TypeError for a wrong type or dtype, ValueError for a wrong device,
shape or layout. Only metadata is read (no .item(), no device synchronization); the values of the routing
(expert ids in [0, E), no expert twice in a token, gates finite and >= 0) are checked by the C library
(on the device on the CUDA backend), which raises rdep.InvalidArgumentError naming rank, token and slot.

Element types (capi.h): host backend fp32 everywhere; CUDA backend bf16 x, y, dy, dx, fp32 gates and
dgates, int32 experts, and expert weights in bf16, or in fp32 (master weights: rdep.torch casts them to
bf16 for the layer and returns fp32 gradients).
"""

from __future__ import annotations

import torch

from .layer import Layer

ACT_DTYPE = {"host": torch.float32, "cuda": torch.bfloat16}
WEIGHT_DTYPES = {"host": (torch.float32,), "cuda": (torch.bfloat16, torch.float32)}


def _dtypes_text(dtypes) -> str:
    return " or ".join(str(d) for d in dtypes)


def check_tensor(name: str, t, layer: Layer, dtypes, shape: tuple, shape_text, device=None) -> None:
    """t must be a contiguous tensor of one of `dtypes` on `device` (default: the layer's) with `shape`
    (None = any size in that dimension). Runs on every call of every op: the checks that pass are kept cheap
    (shape_text, the expected shape in words, may be a function making it: called only for the message)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_dtypes_text(dtypes)} on the {layer.backend} backend, got {t.dtype}")
    want = layer.device if device is None else device
    got = t.device
    if got != want and (got.type != want.type or (want.index is not None and got.index != want.index)):
        raise ValueError(f"{name}: expected a tensor on {want} (the layer's {layer.backend} backend), got one on {got}")
    size = t.shape
    ok = len(size) == len(shape)
    if ok:
        for d, s in zip(size, shape):
            if s is not None and d != s:
                ok = False
                break
    if not ok:
        text = shape_text() if callable(shape_text) else shape_text
        raise ValueError(f"{name}: expected shape {text}, got {list(size)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (rdep reads row-major memory), got strides "
                         f"{list(t.stride())}; call .contiguous()")


def _rows_text(layer: Layer, last: str) -> str:
    return f"[L={layer.num_local_ranks}, n, {last}]"


def _hidden_rows(layer: Layer):
    """The expected shape of token rows in words, made only for an error message."""
    return lambda: _rows_text(layer, f"H={layer.hidden}")


def check_weights(layer: Layer, w1, w2) -> None:
    H, F, El = layer.hidden, layer.ffn, layer.num_local_experts
    wd = WEIGHT_DTYPES[layer.backend]
    check_tensor("w1", w1, layer, wd, (El, H, 2 * F), lambda: f"[E_local={El}, H={H}, 2F={2 * F}]")
    check_tensor("w2", w2, layer, wd, (El, F, H), lambda: f"[E_local={El}, F={F}, H={H}]")
    if w1.dtype != w2.dtype:
        raise TypeError(f"w2: expected the dtype of w1 ({w1.dtype}), got {w2.dtype}")


def check_forward(layer: Layer, x, experts, gates, w1, w2) -> None:
    L, H, K = layer.num_local_ranks, layer.hidden, layer.topk
    act = (ACT_DTYPE[layer.backend],)
    check_tensor("x", x, layer, act, (L, None, H), _hidden_rows(layer))
    n = x.shape[1]
    if n > layer.max_tokens:
        raise ValueError(f"x: {n} tokens per rank exceed the layer's max_tokens T={layer.max_tokens}")
    routing_text = lambda: f"[L={L}, n={n}, K={K}]"  # noqa: E731
    check_tensor("experts", experts, layer, (torch.int32,), (L, n, K), routing_text)
    check_tensor("gates", gates, layer, (torch.float32,), (L, n, K), routing_text)
    check_weights(layer, w1, w2)


def check_backward(layer: Layer, ctx, dy, w1, w2, device_ctx: bool = False) -> None:
    """device_ctx: the capturable ops' ctx, on the layer's device (graph_contexts.py); else a CPU tensor."""
    L, H = layer.num_local_ranks, layer.hidden
    if device_ctx:
        check_tensor("ctx", ctx, layer, (torch.int64,), (), "[] (the context tensor moe_forward_capturable returned)")
    else:
        check_tensor("ctx", ctx, layer, (torch.int64,), (), "[] (the context tensor moe_forward returned)",
                     device=torch.device("cpu"))
    check_tensor("dy", dy, layer, (ACT_DTYPE[layer.backend],), (L, None, H), _hidden_rows(layer))
    if dy.shape[1] > layer.max_tokens:
        raise ValueError(f"dy: {dy.shape[1]} tokens per rank exceed the layer's max_tokens T={layer.max_tokens}")
    check_weights(layer, w1, w2)


def check_rows(layer: Layer, rows) -> None:
    """The capturable ops' saved rows: the uint8 tensor moe_forward_capturable returned."""
    b = layer._native.row_bytes
    check_tensor("rows", rows, layer, (torch.uint8,), (b,), lambda: f"[{b}] (the saved rows moe_forward_capturable returned)")


def check_capturable_args(layer: Layer, row_bytes, keep_casts) -> None:
    """The capturable forward's row_bytes and keep_casts: the layer's own (they fix its outputs' shapes)."""
    if row_bytes != layer.row_bytes:
        raise ValueError(f"row_bytes: expected the layer's Layer.row_bytes ({layer.row_bytes}), got {row_bytes}")
    if keep_casts != layer.keep_weight_casts:
        raise ValueError(f"keep_casts: expected the layer's keep_weight_casts ({layer.keep_weight_casts}), got {keep_casts}")


def check_kept_casts(layer: Layer, w1c, w2c, w1, w2) -> bool:
    """The capturable ops' kept weight casts: both empty (none kept: False) or both w1's and w2's shapes in the
    layer's activation dtype (True)."""
    act = (ACT_DTYPE[layer.backend],)
    keep = isinstance(w1c, torch.Tensor) and w1c.numel() > 0
    for name, c, w in (("w1c", w1c, w1), ("w2c", w2c, w2)):
        want = tuple(w.shape) if keep else (0,)
        check_tensor(name, c, layer, act, want, lambda want=want: f"{list(want)} (the kept cast moe_forward_capturable returned)")
    return keep


# --- dispatch/combine with the caller's experts (rows.py) ----------------------------------------------

def check_plan(layer: Layer, experts, gates) -> None:
    L, K = layer.num_local_ranks, layer.topk
    check_tensor("experts", experts, layer, (torch.int32,), (L, None, K), f"[L={L}, n, K={K}]")
    n = experts.shape[1]
    if n > layer.max_tokens:
        raise ValueError(f"experts: {n} tokens per rank exceed the layer's max_tokens T={layer.max_tokens}")
    check_tensor("gates", gates, layer, (torch.float32,), (L, n, K), f"[L={L}, n={n}, K={K}]")


def check_plan_handles(layer: Layer, ctx, counts) -> None:
    cpu = torch.device("cpu")
    check_tensor("ctx", ctx, layer, (torch.int64,), (), "[] (the context tensor moe_plan returned)", device=cpu)
    El = layer.num_local_experts
    check_tensor("counts", counts, layer, (torch.int64,), (El,), f"[E_local={El}] (the counts moe_plan returned)", device=cpu)


def check_token_rows(name: str, layer: Layer, t, n=None) -> None:
    """A token-side tensor [L, n, H] in the layer's activation dtype."""
    L, H = layer.num_local_ranks, layer.hidden
    check_tensor(name, t, layer, (ACT_DTYPE[layer.backend],), (L, n, H), _rows_text(layer, f"H={H}"))


def check_received_rows(name: str, layer: Layer, t) -> None:
    """A row-side tensor [M, H] (the received rows of the local ranks) in the layer's activation dtype."""
    H = layer.hidden
    check_tensor(name, t, layer, (ACT_DTYPE[layer.backend],), (None, H), f"[M, H={H}] (one row per received row)")


def check_combine_gates(layer: Layer, gates) -> None:
    """The gates given to plan, passed to combine for autograd: fp32 [L, n, K] on the layer's device."""
    L, K = layer.num_local_ranks, layer.topk
    check_tensor("gates", gates, layer, (torch.float32,), (L, None, K), f"[L={L}, n, K={K}] (the gates given to plan)")
    if gates.shape[1] > layer.max_tokens:
        raise ValueError(f"gates: {gates.shape[1]} tokens per rank exceed the layer's max_tokens T={layer.max_tokens}")
