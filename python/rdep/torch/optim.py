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
become bf16 in place (param.data), so build the optimizer before wrapping the model (DistributedDataParallel,
FSDP), before torch.compile traces it and before any forward that should see bf16 weights. bf16 parameters get
an fp32 master copy of their values. Parameters must not share storage (tied weights would be updated twice
and untied); a parameter listed twice is adopted once.

step(grad_multiplier=t) multiplies every gradient by the 0-dim fp32 tensor t on the parameters' device (a
gradient-norm clip's coefficient, read on the device: no host wait, no separate pass over the gradients).
The step count, hence the bias corrections, is per parameter as in torch and lives on the host, so the step
is not for recording in a CUDA graph. state_dict() holds the fp32 masters and moments; load_state_dict()
keeps them fp32 and writes each parameter from its master weight.

Gradient accumulation: a bf16 parameter's gradient is bf16, so autograd sums several backward passes (micro-
batches) in bf16, rounding at every sum. With fp32_grads=True each parameter gets `param.main_grad`, an fp32
buffer: a hook after each backward's accumulation moves the bf16 gradient into it (copied into a fresh buffer,
added otherwise: the sum is fp32; one pass of rdep_grad_accumulate) and sets param.grad to None, and step()
reads main_grad (4 bytes an element more state; the update reads 16 bytes an element instead of 14). param.grad
is then None after backward, so torch.nn.utils.clip_grad_norm_ sees nothing: clip with
opt.clip_grad_norm_(max_norm), which takes the norm of the gradients the next step reads and folds its
coefficient into that step (no pass over the gradients).
zero_grad() empties the buffers (set_to_none=True, the default: the next backward overwrites them) or zeroes
those that hold gradients (set_to_none=False); only the optimizer's zero_grad does: model.zero_grad() or setting
param.grad to None leaves main_grad as it is. opt.grad_of(param) is the gradient the next step reads (main_grad
while it holds this step's gradients, else None). Parameters trained this way must stay out of
DistributedDataParallel's reduction (its hooks would find param.grad emptied): rdep's experts are (their gradients
are per rank; rdep.torch.ddp_ignore_experts), and replicated parameters' main_grad is the caller's to all-reduce.
Frozen parameters (requires_grad False) get no hook; a parameter's main_grad appears with its first gradient. A
parameter belongs to one live MasterAdamW(fp32_grads=True) at a time (the hook holds the optimizer weakly).

    opt = rdep.torch.MasterAdamW(params, lr=3e-4, fp32_grads=True)
    for micro_batch in batches: loss_fn(model(micro_batch)).backward()
    opt.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import ctypes
import weakref
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
                 weight_decay: float = 1e-2, fp32_grads: bool = False):
        _check_hyper(lr, betas, eps, weight_decay)
        if not isinstance(fp32_grads, bool):
            raise TypeError(f"fp32_grads: expected a bool, got {type(fp32_grads).__name__}")
        self._fp32_grads = fp32_grads
        self._filled: set = set()  # ids of parameters whose main_grad holds gradients (fp32_grads)
        self._clip_coef: dict = {}  # device -> the coefficient clip_grad_norm_ left for the next step
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def add_param_group(self, param_group: dict) -> None:
        for k in ("lr", "betas", "eps", "weight_decay"):
            if k in param_group:
                full = {**self.defaults, **param_group}
                _check_hyper(full["lr"], full["betas"], full["eps"], full["weight_decay"])
                break
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        g = len(self.param_groups)
        new = self._check_group(params, g)  # every parameter checked before any is adopted
        super().add_param_group(param_group)
        for p in new:
            self._adopt(p)

    def _check_group(self, params: list, g: int) -> list:
        """The group's parameters not adopted yet, each checked (dtype, device, layout, no storage shared with
        another parameter of this optimizer); raises naming the first bad one."""
        new, seen = [], {id(p) for p in _params_of(self)}
        spans = [(q.data_ptr(), q.data_ptr() + q.numel() * q.element_size(), q) for q in _params_of(self)]
        for i, p in enumerate(params):
            what = f"params[{i}] of group {g}"
            if not isinstance(p, Tensor):
                raise TypeError(f"{what}: expected a tensor, got {type(p).__name__}")
            if id(p) in seen:
                continue
            if p.dtype not in _DTYPES:
                raise TypeError(f"{what}: MasterAdamW takes fp32 or bf16 parameters, got {p.dtype}")
            owner = getattr(p, "_rdep_fp32_grads_owner", lambda: None)()
            if owner is not None and owner is not self:
                raise ValueError(f"{what}: already trained by another live MasterAdamW(fp32_grads=True), whose hook moves "
                                 "its gradients into main_grad; delete that optimizer first")
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{what}: on {p.device}; MasterAdamW runs on CPU and CUDA tensors")
            if not p.is_contiguous():
                raise ValueError(f"{what}: must be contiguous (shape {list(p.shape)}, strides {list(p.stride())})")
            lo, hi = p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()
            for qlo, qhi, q in spans:
                if p.numel() and q.numel() and q.device == p.device and lo < qhi and qlo < hi:
                    raise ValueError(f"{what}: shares storage with another parameter of this optimizer (shape "
                                     f"{list(q.shape)}); tied or overlapping parameters cannot have separate masters")
            spans.append((lo, hi, p))
            seen.add(id(p))
            new.append(p)
        return new

    @torch.no_grad()
    def _adopt(self, p: Tensor) -> None:
        if p.dtype == torch.float32:  # adopted: the fp32 storage is the master, the parameter becomes bf16
            master = p.data
            p.data = master.to(torch.bfloat16)
        else:
            master = p.detach().float()
        self.state[p]["master"] = master
        if self._fp32_grads and p.requires_grad:
            ref = weakref.ref(self)  # the hook keeps no optimizer alive; a dead one's hook does nothing
            p._rdep_fp32_grads_owner = ref

            def hook(param: Tensor, ref=ref) -> None:
                opt = ref()
                if opt is not None:
                    opt._accumulate(param)

            p.register_post_accumulate_grad_hook(hook)

    @torch.no_grad()
    def _accumulate(self, p: Tensor) -> None:
        """fp32_grads: moves p.grad (bf16) into p.main_grad (fp32), summing with what the buffer holds."""
        g = p.grad
        if g is None:
            return
        if g.is_sparse or g.dtype != torch.bfloat16 or g.shape != p.shape or g.device != p.device:
            raise TypeError(f"MasterAdamW(fp32_grads=True): a parameter of shape {list(p.shape)} got a {g.dtype} "
                            f"gradient of shape {list(g.shape)} on {g.device}; expected a dense bf16 one of its shape "
                            f"on {p.device} (was the parameter's dtype changed after the optimizer adopted it?)")
        main = getattr(p, "main_grad", None)
        if main is None or main.shape != p.shape or main.device != p.device:
            main = p.main_grad = torch.empty(p.shape, dtype=torch.float32, device=p.device)
            self._filled.discard(id(p))
        _move_into(main, g, add=id(p) in self._filled)
        self._filled.add(id(p))
        p.grad = None

    def grad_of(self, p: Tensor) -> Optional[Tensor]:
        """The gradient the next step reads for p (None: p is skipped): with fp32_grads its main_grad while that holds
        this step's gradients (a gradient assigned to p.grad directly is moved there first), else p.grad."""
        return self._grad_of(p)

    def _grad_of(self, p: Tensor) -> Optional[Tensor]:
        if not self._fp32_grads:
            return p.grad
        if p.grad is not None:  # a gradient assigned directly, not through backward: accumulate it as a hook would
            self._accumulate(p)
        return p.main_grad if id(p) in self._filled else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._clip_coef.clear()
        if not self._fp32_grads:
            return
        if set_to_none:
            self._filled.clear()  # the next backward overwrites each buffer: no pass to zero them
            return
        with torch.no_grad():  # as torch zeroes existing gradients only: a parameter without one stays without
            for p in _params_of(self):
                if id(p) in self._filled:
                    p.main_grad.zero_()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
        """torch.nn.utils.clip_grad_norm_ over the gradients the next step reads (main_grad with fp32_grads):
        returns their total norm as a 0-dim fp32 tensor, and the next step multiplies every gradient by
        min(1, max_norm / (norm + 1e-6)) in its own pass (the gradients are not rewritten). The norm is that of
        the gradients as they are now, before any grad_multiplier the step is given (which then also applies)."""
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
            raise ValueError(f"max_norm: expected a number >= 0, got {max_norm!r}")
        self._clip_coef = {}
        grads: dict = {}
        seen: set = set()
        for p in _params_of(self):
            g = None if id(p) in seen else self._grad_of(p)
            seen.add(id(p))
            if g is not None:
                grads.setdefault(g.device, []).append(g)
        if not grads:
            return torch.tensor(0.0)
        first = next(iter(grads))
        norms = [torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs, norm_type, dtype=torch.float32)), norm_type).to(first)
                 for gs in grads.values()]  # in fp32 also over bf16 gradients
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is {total.item()}")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).float()
        self._clip_coef = {d: coef.to(d) for d in grads}
        return total

    @torch.no_grad()
    def step(self, closure=None, grad_multiplier: Optional[Tensor] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Everything is checked before any update: a refused step leaves every master and moment as it was (directly
        # assigned gradients are moved into main_grad on the way, as the next backward's hook would).
        calls: dict = {}  # (device, step, hyperparameters) -> tensors: one C call each
        seen: set = set()  # a parameter listed twice in a group is updated once
        for gi, group in enumerate(self.param_groups):
            hyper = (float(group["lr"]), float(group["betas"][0]), float(group["betas"][1]), float(group["eps"]),
                     float(group["weight_decay"]))
            for i, p in enumerate(group["params"]):
                if id(p) in seen:
                    continue
                g = self._grad_of(p)
                if g is None:
                    continue
                seen.add(id(p))
                st = self._checked_state(p, g, f"params[{i}] of group {gi}")
                calls.setdefault((p.device, st.get("step", 0) + 1, hyper), []).append((p, g, st))
        for device in {k[0] for k in calls}:
            _check_multiplier(grad_multiplier, device)
        multipliers = {}  # device -> the clip's coefficient times grad_multiplier, either, or None
        for device in {k[0] for k in calls}:
            coef = self._clip_coef.get(device)
            multipliers[device] = grad_multiplier if coef is None else coef if grad_multiplier is None else coef * grad_multiplier
        for (device, step, hyper), tensors in calls.items():
            for _, _, st in tensors:
                if "exp_avg" not in st:
                    st["exp_avg"] = torch.zeros_like(st["master"])
                    st["exp_avg_sq"] = torch.zeros_like(st["master"])
                    st["step"] = 0
            self._run(device, step, hyper, tensors, multipliers[device])
            for _, _, st in tensors:  # counted once its update is queued
                st["step"] = step
        self._clip_coef.clear()
        return loss

    def _checked_state(self, p: Tensor, g: Tensor, what: str) -> dict:
        if g.is_sparse:
            raise ValueError(f"{what}: sparse gradients are not supported")
        want = torch.float32 if self._fp32_grads else torch.bfloat16
        if g.dtype != want or p.dtype != torch.bfloat16:
            kind = "a bf16 parameter and an fp32 main_grad" if self._fp32_grads else "a bf16 parameter and gradient"
            raise TypeError(f"{what}: expected {kind}, got {p.dtype} and {g.dtype} "
                            "(was the parameter's dtype changed after the optimizer adopted it?)")
        if g.shape != p.shape or not g.is_contiguous() or g.device != p.device:
            raise ValueError(f"{what}: the gradient must be contiguous, of the parameter's shape {list(p.shape)} and on "
                             f"{p.device}; got shape {list(g.shape)} on {g.device}")
        if not p.is_contiguous():
            raise ValueError(f"{what}: the parameter must be contiguous")
        st = self.state[p]
        if "master" not in st:
            raise KeyError(f"{what}: no master weight in the optimizer's state (a state_dict without it?)")
        for k in ("master", "exp_avg", "exp_avg_sq"):
            t = st.get(k)
            if t is None and k != "master":
                continue
            if t.dtype != torch.float32 or t.shape != p.shape or t.device != p.device or not t.is_contiguous():
                raise ValueError(f"{what}: its state's {k} must be a contiguous fp32 tensor of the parameter's shape "
                                 f"{list(p.shape)} on {p.device}; got {t.dtype} {list(t.shape)} on {t.device}")
        return st

    @staticmethod
    def _run(device: torch.device, step: int, hyper: tuple, tensors: list, grad_multiplier: Optional[Tensor]) -> None:
        from .. import _capi as capi

        arr = (capi.AdamWTensor * len(tensors))()
        for k, (p, g, st) in enumerate(tensors):
            dtype = capi.ADAMW_GRAD_FP32 if g.dtype == torch.float32 else capi.ADAMW_GRAD_BF16
            arr[k] = capi.AdamWTensor(st["master"].data_ptr(), st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr(),
                                      g.data_ptr(), p.data_ptr(), p.numel(), dtype)
        s = capi.AdamWStep()
        s.lr, s.beta1, s.beta2, s.eps, s.weight_decay = hyper
        s.step = step
        s.device = device.index if device.type == "cuda" else -1
        if grad_multiplier is not None:
            s.grad_scale = grad_multiplier.data_ptr()
        s.stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
        capi.check(capi.lib().rdep_master_adamw(arr, len(tensors), ctypes.byref(s)), "rdep_master_adamw")

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts a loaded state's floating tensors to its parameter's dtype (bf16 here); the masters and
        # moments stay fp32, and each parameter is written from its master weight. A parameter the saved state
        # does not cover keeps its master weight (and starts its moments afresh).
        self._clip_coef = {}
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for n, (i, p) in enumerate(zip(ids, params)):
            for k in ("master", "exp_avg", "exp_avg_sq"):
                t = saved.get(i, {}).get(k)
                if t is not None and (not isinstance(t, Tensor) or t.shape != p.shape):
                    raise ValueError(f"state_dict: parameter {n}'s {k} has shape "
                                     f"{list(t.shape) if isinstance(t, Tensor) else type(t).__name__}, the parameter "
                                     f"{list(p.shape)}")
        masters = {id(p): self.state[p]["master"] for p in params if "master" in self.state.get(p, {})}
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for i, p in zip(ids, params):
                st = self.state[p]
                for k in ("master", "exp_avg", "exp_avg_sq"):
                    if k in saved.get(i, {}):
                        st[k] = saved[i][k].to(device=p.device, dtype=torch.float32).contiguous().clone()
                if "master" not in st and id(p) in masters:
                    st["master"] = masters[id(p)]
                if "master" in st:
                    p.copy_(st["master"])


def _move_into(main: Tensor, g: Tensor, add: bool) -> None:
    """main (fp32) = g (bf16), or main + g in one fp32 rounding (torch's main.add_(g) bit for bit), in one pass of
    rdep_grad_accumulate (C ABI version 23) on main's device and current stream: 6 or 10 bytes an element, at the
    memory's rate where torch's mixed-dtype add_ runs slower (docs/perf-notes.md, thirty-fifth session)."""
    from .. import _capi as capi

    g = g.contiguous()
    dev = main.device
    cuda = dev.type == "cuda"
    stream = torch.cuda.current_stream(dev).cuda_stream if cuda else None
    device = dev.index if cuda else -1
    capi.check(capi.lib().rdep_grad_accumulate(main.data_ptr(), g.data_ptr(), main.numel(), int(add), device, stream),
               "rdep_grad_accumulate")


def _params_of(opt: torch.optim.Optimizer) -> list:
    """The parameters already in opt's groups."""
    return [p for g in opt.param_groups for p in g["params"]]


def _check_multiplier(m: Optional[Tensor], device: torch.device) -> None:
    if m is None:
        return
    if not isinstance(m, Tensor) or m.dtype != torch.float32 or m.numel() != 1 or m.device != device:
        raise ValueError(f"grad_multiplier: expected a one-element fp32 tensor on {device}, got {m!r}"[:300])
