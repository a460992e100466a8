"""One process per GPU under torchrun (dist_capture_worker.py, on every visible GPU up to 4): the per-process CUDA
layer against the fp64 reference, its capturable ops in a CUDA graph and under torch.compile(mode="reduce-overhead")
with the ranks' barriers between processes. Skipped with fewer than two GPUs (per-process ranks need a GPU each) or
without a CUDA build of librdep_capi.so; on the device, a missing CUTLASS compute is a failure
(RDEP_REQUIRE_CUTLASS=1) as in test_cuda_graphs.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rdep._capi as capi
from cuda_graph_helpers import require_cutlass_gpu

WORKER = Path(__file__).resolve().parent / "dist_capture_worker.py"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA GPUs (one rank a process, a GPU each)")
def test_per_process_ranks_under_torchrun():
    require_cutlass_gpu()
    nproc = min(torch.cuda.device_count(), 4)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               PYTHONUNBUFFERED="1", RDEP_LIBRARY=str(capi.library_path()))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(WORKER)]
    # A session of its own: on a timeout the whole group (torchrun and its workers) is killed, not torchrun alone.
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past 600 s:\n{out[-6000:]}")
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}:\n{out[-6000:]}"
    for r in range(nproc):
        for check in ("eager_matches_reference", "capture_replays_like_eager", "reduce_overhead_records_rdep_ops"):
            assert f"rank {r}: {check} passed" in out, f"rank {r} did not pass {check}:\n{out[-6000:]}"
