"""The host time of PyTorch's own machinery per call on this machine: the floor under any binding's
forward and forward+backward (bench/torch_layer_bench.py reports rdep.torch's). Each call is issued on an
idle device (synchronized before it, outside the time), as torch_layer_bench times the host.

Timed, on the CPU and (where there is one) on the GPU, with tiny tensors so the device work is nothing:
  * linear:   y = F.linear(x, w), then y.backward(dy) (an aten op and its autograd node);
  * function: a torch.autograd.Function whose forward and backward do one aten op each (a Python
              autograd node, as a binding's custom op has);
  * op:       a custom op through torch.library (a Library-defined Python kernel with register_autograd,
              as rdep.torch defines its ops), forward and backward each one aten op;
  * pair:     rdep's capturable op pair with its C library and bookkeeping taken out: the same schemas,
              registration (rdep.torch.op_library), setup_context and formula shape, four differentiable
              inputs, and kernels that only allocate what rdep's return (y, a device ctx made by torch.full,
              the rows, two empty casts; dx, dgates, dw1, dw2): what the structure of rdep's ops costs;
  * function pair: the pair's kernels and setup_context through a plain torch.autograd.Function, no dispatcher
    between; direct pair: the pair through rdep.torch.op_library.call, rdep.torch's eager path (the same kernels
    through the op's own autograd.Function, no dispatcher);
  * cpp pair (--cpp, compiles bench/torch_floor_pair.cpp with torch.utils.cpp_extension: a C++ compiler and
    ninja): the same pair as C++ ops with a C++ autograd function, what torch's part would be with rdep's hot
    pair in C++;
  * rdep stubbed (--rdep, needs the C library): rdep.torch.moe on a real layer of the pair's shape (CUTLASS
    expert compute on CUDA, bf16 weights) with the C library's forward and backward calls and its wait for the
    routing check replaced by no-ops (its context calls stay): rdep.torch's Python path (eager_ext off) on this host
    without the GPU work, against the pair;
  * the pieces a kernel of rdep's calls per call: torch.empty, torch.full on the device, the current
    stream as a Stream object and as a raw handle, the stream's capture status.

    python3 bench/torch_autograd_floor.py --json floor.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

_LIB = torch.library.Library("rdep_floor", "DEF")
_LIB.define("twice(Tensor x) -> Tensor")
_LIB.impl("twice", lambda x: x * 2, "CPU")
_LIB.impl("twice", lambda x: x * 2, "CUDA")
torch.library.register_fake("rdep_floor::twice", lambda x: torch.empty_like(x), lib=_LIB)
torch.library.register_autograd("rdep_floor::twice", lambda ctx, g: g * 2, setup_context=lambda ctx, inputs, output: None,
                                lib=_LIB)


def _pair_forward(handle, layer, x, experts, gates, w1, w2, row_bytes, keep_casts, save_context=True, check_routing=True):
    return (torch.empty_like(x), torch.full((), 0, dtype=torch.int64, device=x.device),
            torch.empty(row_bytes, dtype=torch.uint8, device=x.device), w1.new_empty((0,)), w2.new_empty((0,)))


def _pair_backward(handle, layer, ctx, rows, w1c, w2c, dy, w1, w2):
    """handle stands in for the layer: its numel is the layer's top-K (dgates' last dimension)."""
    return (torch.empty_like(dy), torch.empty(dy.shape[:2] + (handle.numel(),), dtype=torch.float32, device=dy.device),
            torch.empty_like(w1), torch.empty_like(w2))


def _pair_setup(ctx, inputs, output):
    handle, layer, _x, _experts, _gates, w1, w2, _row_bytes, _keep, save_context, _check_routing = inputs
    y, context, rows, w1c, w2c = output
    ctx.mark_non_differentiable(context, rows, w1c, w2c)
    ctx.set_materialize_grads(False)
    ctx.layer = layer
    ctx.save_for_backward(handle, context, rows, w1c, w2c, w1, w2)


def _pair_formula(ctx, dy, *_dsaved):
    """As rdep.torch's formula: the backward op's kernel called without the dispatcher where op_library.direct_ok."""
    op_library = _OP_LIBRARY
    saved = ctx.saved_tensors
    handle, context, rows, w1c, w2c, w1, w2 = saved
    args = (handle, ctx.layer, context, rows, w1c, w2c, dy.contiguous(), w1, w2)
    op = torch.ops.rdep_floor.pair_backward.default
    dx, dgates, dw1, dw2 = op_library.call(op, *args) if op_library.direct_ok(dy, *saved) else op(*args)
    return (None, None, dx, None, dgates, dw1.to(w1.dtype), dw2.to(w2.dtype)) + (None,) * 4


_OP_LIBRARY = None  # rdep.torch.op_library, once _define_pair imported it (the pair's formula reads it per call)


def _define_pair() -> None:
    """rdep_floor::pair_forward / pair_backward, registered as rdep.torch registers its capturable pair."""
    global _OP_LIBRARY
    from rdep.torch import op_library, ops

    _OP_LIBRARY = op_library
    fwd = op_library.define("pair_forward", ops.CAPTURABLE_FORWARD_SCHEMA, _pair_forward, _pair_forward, capturable=True,
                            lib=_LIB)
    op_library.define("pair_backward", ops.CAPTURABLE_BACKWARD_SCHEMA, _pair_backward, _pair_backward, capturable=True,
                      lib=_LIB)
    op_library.register_autograd(fwd, _pair_formula, _pair_setup, lib=_LIB)


class _PairFunction(torch.autograd.Function):
    """The pair's kernels through a plain autograd.Function: no dispatcher between Python and the kernels (an
    eager path that calls rdep's Python kernels directly would cost this)."""

    @staticmethod
    def forward(ctx, handle, layer, x, experts, gates, w1, w2, row_bytes, keep_casts, save_context, check_routing):
        out = _pair_forward(handle, layer, x, experts, gates, w1, w2, row_bytes, keep_casts, save_context, check_routing)
        _pair_setup(ctx, (handle, layer, x, experts, gates, w1, w2, row_bytes, keep_casts, save_context, check_routing), out)
        return out

    @staticmethod
    def backward(ctx, dy, *_dsaved):
        handle, context, rows, w1c, w2c, w1, w2 = ctx.saved_tensors
        dx, dgates, dw1, dw2 = _pair_backward(handle, ctx.layer, context, rows, w1c, w2c, dy.contiguous(), w1, w2)
        return (None, None, dx, None, dgates, dw1.to(w1.dtype), dw2.to(w2.dtype)) + (None,) * 4


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def host_us(fn, iters: int, cuda: bool) -> float:
    """Median host time of fn in microseconds, each call after a synchronize."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(20):
        fn()
    out = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    sync()
    return statistics.median(out)


def cases(device: torch.device, rdep_stubbed: bool = False) -> dict:
    x = torch.randn(8, 16, device=device, requires_grad=True)
    w = torch.randn(16, 16, device=device, requires_grad=True)
    dy = torch.randn(8, 16, device=device)

    def clear():
        x.grad = w.grad = None

    def linear_fb():
        torch.nn.functional.linear(x, w).backward(dy)
        clear()

    def function_fb():
        _Twice.apply(x).backward(dy)
        clear()

    def op_fb():
        torch.ops.rdep_floor.twice(x).backward(dy)
        clear()

    out = {"linear forward": lambda: torch.nn.functional.linear(x, w), "linear f+b": linear_fb,
           "function forward": lambda: _Twice.apply(x), "function f+b": function_fb,
           "op forward": lambda: torch.ops.rdep_floor.twice(x), "op f+b": op_fb}
    if hasattr(torch.ops.rdep_floor, "pair_forward"):
        out.update(_pair_cases(device))
    out.update(_pair_cases(device, _PairFunction.apply, "function pair"))
    if hasattr(torch.ops.rdep_floor, "pair_forward"):  # rdep.torch's eager path: op_library.call on the pair
        from rdep.torch import op_library

        pair = torch.ops.rdep_floor.pair_forward.default
        out.update(_pair_cases(device, lambda *args: op_library.call(pair, *args), "direct pair"))
    if hasattr(torch.ops, "rdep_floor_cpp") and hasattr(torch.ops.rdep_floor_cpp, "pair_forward"):
        out.update(_pair_cases(device, torch.ops.rdep_floor_cpp.pair_forward, "cpp pair"))
    out.update(_piece_cases(device))
    if rdep_stubbed:
        out.update(_stubbed_rdep_cases(device))
    return out


def _build_cpp_pair() -> None:
    """rdep_floor_cpp::pair_forward / pair_backward: bench/torch_floor_pair.cpp, compiled and loaded."""
    from pathlib import Path

    from torch.utils import cpp_extension

    cpp_extension.load(name="rdep_floor_cpp", sources=[str(Path(__file__).with_name("torch_floor_pair.cpp"))],
                       is_python_module=False, verbose=False, extra_cflags=["-O2"])


def _pair_cases(device: torch.device, fwd=None, name: str = "pair") -> dict:
    """rdep's capturable pair's structure at the example's layer shape (E_local 64, H 1024, F 704), kernels that
    only allocate (bf16 weights, 4096 tokens, top-6). fwd: the pair's forward op (default rdep_floor::pair_forward)."""
    n, H, F, E, K = 4096, 1024, 704, 64, 6
    bf16 = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(1, n, H, device=device, dtype=bf16, requires_grad=True)
    gates = torch.rand(1, n, K, device=device, requires_grad=True)
    experts = torch.zeros(1, n, K, dtype=torch.int32, device=device)
    w1 = torch.randn(E, H, 2 * F, device=device, dtype=bf16, requires_grad=True)
    w2 = torch.randn(E, F, H, device=device, dtype=bf16, requires_grad=True)
    handle, dy = torch.zeros(K, device=device), torch.randn(1, n, H, device=device, dtype=bf16)
    fwd = fwd if fwd is not None else torch.ops.rdep_floor.pair_forward

    def forward():
        return fwd(handle, 0, x, experts, gates, w1, w2, 1 << 20, False, True, True)[0]

    def forward_backward():
        forward().backward(dy)
        x.grad = gates.grad = w1.grad = w2.grad = None

    return {f"{name} forward": forward, f"{name} f+b": forward_backward}


def _stubbed_rdep_cases(device: torch.device) -> dict:
    """rdep.torch.moe at the pair's shape with rdep_layer_forward / rdep_layer_backward made no-ops (the
    results are garbage; only the host time is read). The stub stays installed for the rest of the run."""
    import rdep.torch as rt
    from rdep import _capi

    n, H, F, E, K = 4096, 1024, 704, 64, 6
    cuda = device.type == "cuda"
    layer = rt.Layer(H, F, E, K, n, world_size=1, device=device,
                     **({"expert_compute": "cutlass", "gate_in_expert": True} if cuda else {}))
    real = _capi.lib()
    real = getattr(real, "real", real)  # the stub an earlier device's cases installed: wrap the library itself

    class _NoComputeLibrary:
        """The C library with its compute calls (the forward, the backward, the wait for the routing check) as
        no-ops; every other function is the library's own, looked up once."""

        def __init__(self):
            self.real = real

        def __getattr__(self, name):
            fn = (lambda *args: 0) if name in ("rdep_layer_forward", "rdep_layer_forward_arena", "rdep_layer_backward",
                                           "rdep_context_check_routing") \
                else getattr(real, name)
            setattr(self, name, fn)
            return fn

    _capi._lib = _NoComputeLibrary()
    from rdep.torch import eager_ext

    eager_ext.enabled = False  # the stub is ctypes' (Python) functions: rdep.torch's Python path is what runs
    act = torch.bfloat16 if cuda else torch.float32
    x = torch.randn(1, n, H, device=device, dtype=act, requires_grad=True)
    gates = torch.rand(1, n, K, device=device, requires_grad=True)
    experts = torch.zeros(1, n, K, dtype=torch.int32, device=device)
    w1 = torch.randn(E, H, 2 * F, device=device, dtype=act, requires_grad=True)
    w2 = torch.randn(E, F, H, device=device, dtype=act, requires_grad=True)
    dy = torch.randn(1, n, H, device=device, dtype=act)

    def forward():
        return rt.moe(layer, x, experts, gates, w1, w2)

    def forward_backward():
        forward().backward(dy)
        x.grad = gates.grad = w1.grad = w2.grad = None

    where = "capturable ops" if layer.capturable else "plain ops"
    return {f"rdep stubbed forward ({where})": forward, f"rdep stubbed f+b ({where})": forward_backward}


def _piece_cases(device: torch.device) -> dict:
    out = {"empty": lambda: torch.empty(1 << 20, dtype=torch.uint8, device=device),
           "full": lambda: torch.full((), 7, dtype=torch.int64, device=device)}
    if device.type == "cuda":
        index = device.index
        out.update({"current_stream": lambda: torch.cuda.current_stream(device).cuda_stream,
                    "raw stream": lambda: torch._C._cuda_getCurrentRawStream(index),
                    "capturing": torch.cuda.is_current_stream_capturing})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--rdep", action="store_true",
                   help="also time rdep.torch.moe with the C library's compute calls stubbed out (needs librdep_capi.so)")
    p.add_argument("--cpp", action="store_true",
                   help="also time the pair as C++ ops (compiles bench/torch_floor_pair.cpp; needs a C++ compiler and ninja)")
    p.add_argument("--json", default="")
    a = p.parse_args()
    try:
        _define_pair()
    except Exception as e:  # rdep.torch not on the path, or not importable here: the pair is left out
        if a.rdep:
            raise
        print(f"torch_autograd_floor: no pair case ({e})")
    if a.cpp:
        _build_cpp_pair()
    devices = [torch.device("cpu")] + ([torch.device("cuda", torch.cuda.current_device())] if torch.cuda.is_available() else [])
    result = {}
    print(f"torch_autograd_floor: torch {torch.__version__}, host us per call (median of {a.iters}, each on an idle device)")
    for d in devices:
        for name, fn in cases(d, a.rdep).items():
            us = host_us(fn, a.iters, d.type == "cuda")
            result[f"{d.type} {name}"] = us
            print(f"  {d.type:5s} {name:18s} {us:9.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bench": "torch_autograd_floor", "torch": torch.__version__, "host_us": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
