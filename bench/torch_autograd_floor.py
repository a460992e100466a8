"""The host time of PyTorch's own machinery per call on this machine: the floor under any binding's
forward and forward+backward (bench/torch_layer_bench.py reports rdep.torch's). Each call is issued on an
idle device (synchronized before it, outside the time), as torch_layer_bench times the host.

Timed, on the CPU and (where there is one) on the GPU, with tiny tensors so the device work is nothing:
  * linear:   y = F.linear(x, w), then y.backward(dy) (an aten op and its autograd node);
  * function: a torch.autograd.Function whose forward and backward do one aten op each (a Python
              autograd node, as a binding's custom op has);
  * op:       a custom op through torch.library (a Library-defined Python kernel with register_autograd,
              as rdep.torch defines its ops), forward and backward each one aten op.

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


def cases(device: torch.device) -> dict:
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

    return {"linear forward": lambda: torch.nn.functional.linear(x, w), "linear f+b": linear_fb,
            "function forward": lambda: _Twice.apply(x), "function f+b": function_fb,
            "op forward": lambda: torch.ops.rdep_floor.twice(x), "op f+b": op_fb}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--json", default="")
    a = p.parse_args()
    devices = [torch.device("cpu")] + ([torch.device("cuda", torch.cuda.current_device())] if torch.cuda.is_available() else [])
    result = {}
    print(f"torch_autograd_floor: torch {torch.__version__}, host us per call (median of {a.iters}, each on an idle device)")
    for d in devices:
        for name, fn in cases(d).items():
            us = host_us(fn, a.iters, d.type == "cuda")
            result[f"{d.type} {name}"] = us
            print(f"  {d.type:5s} {name:18s} {us:9.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bench": "torch_autograd_floor", "torch": torch.__version__, "host_us": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
