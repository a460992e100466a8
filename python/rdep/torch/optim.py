"""rdep.torch.MasterAdamW: AdamW over bf16 parameters that keeps fp32 master weights.

The model holds its weights in bf16, so the forward and backward read them with no cast (an fp32 weight
under autocast is cast to bf16 in every forward, and again in the backward unless the cast is kept), and
the gradients arrive in bf16 (rdep.torch.MoE writes its experts' bf16 weight gradients directly from its
GEMMs: half the bytes of fp32 ones). The optimizer keeps the fp32 master weight and the two moments, and
one pass per tensor (the C library's rdep_master_adamw: a CUDA kernel queued on the current stream, or the
host reference for CPU tensors) reads the bf16 gradient, updates the master weight and moments in fp32 as
torch.optim.AdamW does (decoupled weight decay; the formula is in include/rdep/optim/master_adamw.h), and
writes the parameter as the master weight rounded to bf16. Per element it moves the same bytes as torch's
fused AdamW on fp32 parameters and gradients (14 read, 14 written), and the memory per element is the same
too (bf16 parameter and gradient, fp32 master and moments: 16 bytes), with no bf16 casts alive in between.

    opt = rdep.torch.MasterAdamW(moe.expert_parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)

fp32 parameters are adopted: their fp32 values become the master weights (no copy) and the parameters
become bf16 in place (param.data), so build the optimizer before torch.compile and before any forward
that should see bf16 weights. bf16 parameters get an fp32 master copy of their values.

step(grad_multiplier=t) multiplies every gradient by the 0-dim fp32 tensor t on the parameters' device (a
gradient-norm clip's coefficient, read on the device: no host wait, no separate pass over the gradients).
Gradients are read in bf16; the step count, hence the bias corrections, is per parameter as in torch and
lives on the host, so the step is not for recording in a CUDA graph. state_dict() holds the fp32 masters
and moments; load_state_dict() keeps them fp32 and writes each parameter from its master weight.
"""

from __future__ import annotations

import ctypes
from typing import Iterable, Optional

import torch
from torch import Tensor

_DTYPES = (torch.float32, torch.bfloat16)


def _check_hyper(lr, betas, eps, weight_decay) -> None:
    for name, v in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if isinstance(v, Tensor) or not isinstance(v, (int, float)):
            raise TypeError(f"{name}: expected a float, got {type(v).__name__}")
        if not (v >= 0.0 and v < float("inf")):
            raise ValueError(f"{name}: must be finite and >= 0, got {v}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas: expected a pair (beta1, beta2), got {betas!r}")
    for name, b in zip(("betas[0]", "betas[1]"), betas):
        if not (isinstance(b, (int, float)) and 0.0 <= b < 1.0):
            raise ValueError(f"{name}: must be in [0, 1), got {b!r}")


class MasterAdamW(torch.optim.Optimizer):
    """AdamW over bf16 parameters with fp32 master weights (see the module docstring)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        _check_hyper(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def add_param_group(self, param_group: dict) -> None:
        for k in ("lr", "betas", "eps", "weight_decay"):
            if k in param_group:
                full = {**self.defaults, **param_group}
                _check_hyper(full["lr"], full["betas"], full["eps"], full["weight_decay"])
                break
        super().add_param_group(param_group)
        for i, p in enumerate(self.param_groups[-1]["params"]):
            self._adopt(p, f"params[{i}] of group {len(self.param_groups) - 1}")

    @torch.no_grad()
    def _adopt(self, p: Tensor, what: str) -> None:
        if p.dtype not in _DTYPES:
            raise TypeError(f"{what}: MasterAdamW takes fp32 or bf16 parameters, got {p.dtype}")
        if p.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{what}: on {p.device}; MasterAdamW runs on CPU and CUDA tensors")
        if not p.is_contiguous():
            raise ValueError(f"{what}: must be contiguous (shape {list(p.shape)}, strides {list(p.stride())})")
        if p.dtype == torch.float32:  # adopted: the fp32 storage is the master, the parameter becomes bf16
            master = p.data
            p.data = master.to(torch.bfloat16)
        else:
            master = p.detach().float()
        self.state[p]["master"] = master

    @torch.no_grad()
    def step(self, closure=None, grad_multiplier: Optional[Tensor] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        calls: dict = {}  # (device, step, hyperparameters) -> tensors: one C call each
        for gi, group in enumerate(self.param_groups):
            hyper = (float(group["lr"]), float(group["betas"][0]), float(group["betas"][1]), float(group["eps"]),
                     float(group["weight_decay"]))
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                st = self._state_for_step(p, f"params[{i}] of group {gi}")
                calls.setdefault((p.device, st["step"], hyper), []).append((p, st))
        for (device, step, hyper), tensors in calls.items():
            self._run(device, step, hyper, tensors, grad_multiplier)
        return loss

    def _state_for_step(self, p: Tensor, what: str) -> dict:
        g = p.grad
        if g.is_sparse:
            raise ValueError(f"{what}: sparse gradients are not supported")
        if g.dtype != torch.bfloat16 or p.dtype != torch.bfloat16:
            raise TypeError(f"{what}: expected a bf16 parameter and gradient, got {p.dtype} and {g.dtype} "
                            "(was the parameter's dtype changed after the optimizer adopted it?)")
        if g.shape != p.shape or not g.is_contiguous() or g.device != p.device:
            raise ValueError(f"{what}: the gradient must be contiguous, of the parameter's shape {list(p.shape)} and on "
                             f"{p.device}; got shape {list(g.shape)} on {g.device}")
        st = self.state[p]
        if "exp_avg" not in st:
            st["exp_avg"] = torch.zeros_like(st["master"])
            st["exp_avg_sq"] = torch.zeros_like(st["master"])
            st["step"] = 0
        st["step"] += 1
        return st

    @staticmethod
    def _run(device: torch.device, step: int, hyper: tuple, tensors: list, grad_multiplier: Optional[Tensor]) -> None:
        from .. import _capi as capi

        arr = (capi.AdamWTensor * len(tensors))()
        for k, (p, st) in enumerate(tensors):
            arr[k] = capi.AdamWTensor(st["master"].data_ptr(), st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr(),
                                      p.grad.data_ptr(), p.data_ptr(), p.numel())
        s = capi.AdamWStep()
        s.lr, s.beta1, s.beta2, s.eps, s.weight_decay = hyper
        s.step = step
        s.device = device.index if device.type == "cuda" else -1
        if device.type == "cuda" and s.device is None:
            s.device = torch.cuda.current_device()
        if grad_multiplier is not None:
            if (not isinstance(grad_multiplier, Tensor) or grad_multiplier.dtype != torch.float32
                    or grad_multiplier.numel() != 1 or grad_multiplier.device != device):
                raise ValueError(f"grad_multiplier: expected a one-element fp32 tensor on {device}, got "
                                 f"{grad_multiplier!r}"[:300])
            s.grad_scale = grad_multiplier.data_ptr()
        s.stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
        capi.check(capi.lib().rdep_master_adamw(arr, len(tensors), ctypes.byref(s)), "rdep_master_adamw")

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts a loaded state's floating tensors to its parameter's dtype (bf16 here); the masters and
        # moments stay fp32, and each parameter is written from its master weight.
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for i, p in zip(ids, params):
                if i not in saved:
                    continue
                for k in ("master", "exp_avg", "exp_avg_sq"):
                    if k in saved[i]:
                        self.state[p][k] = saved[i][k].to(device=p.device, dtype=torch.float32).clone()
                if "master" in self.state[p]:
                    p.copy_(self.state[p]["master"])
