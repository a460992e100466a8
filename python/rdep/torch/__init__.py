"""rdep for PyTorch: the MoE module, the layer handle, the custom ops.

    rdep.torch.MoE        nn.Module: router, shared experts, rdep dispatch -> experts -> combine (moe.py)
    rdep.torch.Router     the router alone: scores, group-limited top-K, expert bias, losses (router.py)
    rdep.torch.Layer      one rdep layer over its ranks, the C ABI handle (layer.py)
    rdep.torch.Domain     the ranks and placement several layers share, with their replica slots (domain.py)
    rdep.torch.moe        functional: y = moe(layer, x, experts, gates, w1, w2) with autograd (ops.py)
    rdep.torch.plan / dispatch / combine   the caller's own experts: rdep moves the rows (rows.py)
    rdep.torch.ddp_ignore_experts         the experts kept out of DistributedDataParallel's averaging (data_parallel.py)
    rdep.torch.MasterAdamW  AdamW over bf16 parameters with fp32 master weights, one fused pass a tensor (optim.py)
    torch.ops.rdep.moe_forward / moe_backward, moe_plan / moe_dispatch / moe_combine (+ backward ops)

Importing this module registers the ops; the C library is loaded when the first Layer is made.
"""

from .data_parallel import ddp_ignore_experts, expert_parameter_names
from .domain import Domain
from .layer import Layer, get_layer
from .moe import MoE, MoEOutput, SwiGLU
from .ops import moe, moe_backward, moe_forward
from .optim import MasterAdamW
from .router import Router, RouterOutput
from .rows import RoutingPlan, combine, dispatch, plan

__all__ = ["Domain", "Layer", "get_layer", "moe", "moe_forward", "moe_backward", "Router", "RouterOutput", "MoE",
           "MoEOutput", "SwiGLU", "plan", "dispatch", "combine", "RoutingPlan", "ddp_ignore_experts",
           "expert_parameter_names", "MasterAdamW"]
