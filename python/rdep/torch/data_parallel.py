"""rdep's MoE modules under torch's DistributedDataParallel.

Each process holds only its own experts (MoE.w1, w2: `moe.local_experts`), so their gradients must not be averaged
across ranks, while the dense parameters (attention, the router, shared experts) are replicated and must be.
DDP averages every parameter it is given; `ddp_ignore_experts(model)`, called before wrapping, names the experts to
DDP's ignore list:

    rdep.torch.ddp_ignore_experts(model)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
"""

from __future__ import annotations

from torch import nn


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The fully qualified names of the expert parameters (w1, w2) of every rdep.torch.MoE in model, in
    named_parameters() order."""
    from .moe import MoE

    experts = {id(p) for m in model.modules() if isinstance(m, MoE) for p in m.expert_parameters()}
    return [name for name, p in model.named_parameters() if id(p) in experts]


def ddp_ignore_experts(model: nn.Module) -> list[str]:
    """Adds the expert parameters of model's rdep.torch.MoE modules to DistributedDataParallel's parameters to ignore
    (kept with any the model already lists); call before wrapping model. Returns the names added. DDP then averages
    the other parameters' gradients and leaves each process's expert gradients its own."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError("model: already wrapped in DistributedDataParallel, which read its parameters to ignore "
                         "when it was made; call ddp_ignore_experts(model) before wrapping it")
    names = expert_parameter_names(model)
    # DDP's reducer names a parameter "<module>.<param>", which for the model's own parameters (an MoE as the root
    # module) is ".w1", while its broadcast and bookkeeping use named_parameters()' "w1": list both forms.
    listed = names + ["." + n for n in names if "." not in n]
    kept = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, kept + [n for n in listed if n not in kept])
    return names
