"""Helpers the CUDA-graph tests share (test_cuda_graphs.py, test_distributed_cuda.py and its torchrun worker): the
CUTLASS compute's skip (a failure under RDEP_REQUIRE_CUTLASS=1, as on the device), a capture of one call after
warm-ups on a side stream, as torch's docs prescribe, and a replay compared with an eager call. No test lives here."""

from __future__ import annotations

import os

import pytest
import torch

import rdep._capi as capi


def require_cutlass_gpu() -> None:
    """Skips unless librdep_capi.so has CUDA, sees a device and can run the CUTLASS compute there; with
    RDEP_REQUIRE_CUTLASS=1 a missing CUTLASS compute fails instead."""
    if not capi.built_with_cuda() or capi.cuda_device_count() < 1:
        pytest.skip("librdep_capi.so was built without CUDA or sees no CUDA device")
    ok, why = capi.cutlass_available(0)
    if not ok:
        if os.environ.get("RDEP_REQUIRE_CUTLASS") == "1":
            pytest.fail(f"RDEP_REQUIRE_CUTLASS=1 but the CUTLASS compute is not available: {why}")
        pytest.skip(f"the CUTLASS compute is not available here: {why}")


def capture(fn, warmups: int = 2, after_warmups=None):
    """(graph, outputs): fn() called `warmups` times on a side stream, after_warmups() (a check, if given), then fn()
    once inside torch.cuda.graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if after_warmups is not None:
        after_warmups()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


STEP_OUTPUTS = ("y", "dx", "dgates", "dw1", "dw2")


def assert_replay_matches_eager(graph, outputs, captured_inputs, inputs, eager, what: str) -> None:
    """Copies `inputs` into the tensors the capture read (`captured_inputs`, in the same order), replays the graph and
    checks that each of its outputs (y, dx, dgates, dw1, dw2) is bitwise the one eager() returns on the same inputs."""
    with torch.no_grad():
        for dst, src in zip(captured_inputs, inputs):
            dst.copy_(src)
    graph.replay()
    got = [t.clone() for t in outputs]
    want = eager()
    torch.cuda.synchronize()
    assert len(got) == len(want) == len(STEP_OUTPUTS), (len(got), len(want))
    for name, a, b in zip(STEP_OUTPUTS, got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: {name} differs from the eager call"
