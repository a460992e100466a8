"""rdep: expert-parallel Mixture-of-Experts layers (RDEP execution model) from Python.

`import rdep` needs neither PyTorch nor the C library; the library (librdep_capi.so, see rdep._capi for
where it is looked for) is loaded on first use. The PyTorch module and custom ops are in `rdep.torch`:

    import rdep.torch
    moe = rdep.torch.MoE(hidden=64, ffn=128, num_experts=8, topk=2, max_tokens=256)
    out = moe(x)                      # x [..., 64] fp32 on the CPU (host backend) or bf16 on CUDA
    loss = task_loss(out.y) + out.aux_loss + out.z_loss
"""

from __future__ import annotations

from ._capi import CAPI_VERSION, library_info, library_path
from ._errors import (
    CudaError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    RdepError,
    RdepTimeoutError,
    UnavailableError,
    UnknownStatusError,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "CAPI_VERSION",
    "library_info",
    "library_path",
    "RdepError",
    "InvalidArgumentError",
    "FailedPreconditionError",
    "RdepTimeoutError",
    "UnavailableError",
    "InternalError",
    "CudaError",
    "UnknownStatusError",
]
