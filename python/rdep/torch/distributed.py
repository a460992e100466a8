"""Bootstrap of the per-process CUDA backend from torch.distributed: the C ABI's caller-supplied allgather
(rdep_allgather_fn) implemented with torch.distributed.all_gather on uint8 tensors of the process group.

rdep calls it while the layer is created (every rank with the same byte count: its IPC/fabric handles
and a configuration fingerprint); recv gets world_size * bytes, rank-major. A Python exception inside
the callback is kept on the object and the callback returns 1, which rdep reports as a failed
bootstrap; rdep.torch.Layer re-raises it chained to the Python cause.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from .. import _capi


def group_rank_and_size(group) -> tuple[int, int]:
    """(this process's rank in the group, the group's size). Accepts a torch.distributed ProcessGroup
    or any object with rank() and size() methods."""
    try:
        return int(group.rank()), int(group.size())
    except AttributeError:
        import torch.distributed as dist

        return dist.get_rank(group), dist.get_world_size(group)


def _group_device(group) -> torch.device:
    """Where the group's collectives want their tensors: CUDA for NCCL, else the CPU."""
    import torch.distributed as dist

    try:
        backend = str(dist.get_backend(group)).lower()
    except Exception:
        backend = ""
    if "nccl" in backend and "cpu:" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ProcessGroupAllgather:
    """rdep_allgather_fn over a torch.distributed process group. `c_function` is what goes into the
    layer spec; keep this object alive as long as the layer (rdep.torch.Layer does)."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = group_rank_and_size(group)
        self.error: Optional[BaseException] = None
        self.c_function = _capi.ALLGATHER_FN(self._callback)

    def gather_tensor(self, data: bytes) -> torch.Tensor:
        """Every rank's `data` (all the same length), concatenated in rank order, as a CPU uint8 tensor."""
        import torch.distributed as dist

        n = len(data)
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        device = _group_device(self.group)
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        outs = [torch.empty(n, dtype=torch.uint8, device=device) for _ in range(self.size)]
        dist.all_gather(outs, src, group=self.group)
        return torch.cat(outs).cpu().contiguous()

    def gather(self, data: bytes) -> bytes:
        t = self.gather_tensor(data)
        return ctypes.string_at(t.data_ptr(), t.numel()) if t.numel() else b""

    def _callback(self, user, send, nbytes, recv) -> int:
        try:
            out = self.gather_tensor(ctypes.string_at(send, nbytes) if nbytes else b"")
            if out.numel() != nbytes * self.size:
                raise RuntimeError(f"allgather returned {out.numel()} bytes, expected {nbytes} x {self.size} ranks")
            if nbytes:
                ctypes.memmove(recv, out.data_ptr(), out.numel())
            return 0
        except BaseException as e:  # never let an exception unwind through C
            self.error = e
            return 1
