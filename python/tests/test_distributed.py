"""torch.distributed bootstrap: the allgather callback over a process group (gloo on localhost, world
size 1), the process-group / world_size checks (a real gloo group and a stub group), and, on a machine
with a GPU, a per-process CUDA layer bootstrapped through a gloo group of one process.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.distributed as dist

import rdep._capi as capi
import rdep.torch as rt
from rdep.torch.distributed import ProcessGroupAllgather


@pytest.fixture(scope="module")
def gloo_group(tmp_path_factory):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build of PyTorch")
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class StubGroup:
    """Enough of a ProcessGroup for the size check: rank() and size()."""

    def __init__(self, size, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.no_library
def test_allgather_over_gloo(gloo_group):
    g = ProcessGroupAllgather(gloo_group)
    assert g.gather(b"rdep handles") == b"rdep handles"
    assert g.gather(b"") == b""


def test_allgather_through_the_c_function_pointer(gloo_group):
    """The callback as C sees it: a function pointer called with raw buffers."""
    g = ProcessGroupAllgather(gloo_group)
    fn = ctypes.cast(g.c_function, capi.ALLGATHER_FN)
    send = ctypes.create_string_buffer(b"\x01\x02\x03\x04", 4)
    recv = ctypes.create_string_buffer(4)
    assert fn(None, ctypes.addressof(send), 4, ctypes.addressof(recv)) == 0
    assert recv.raw == b"\x01\x02\x03\x04"


@pytest.mark.no_library
def test_allgather_failure_returns_nonzero_and_keeps_the_exception():
    g = ProcessGroupAllgather(StubGroup(2))  # not a real group: all_gather raises
    send = ctypes.create_string_buffer(b"abcd", 4)
    recv = ctypes.create_string_buffer(8)
    assert g._callback(None, ctypes.addressof(send), 4, ctypes.addressof(recv)) == 1
    assert g.error is not None


def test_group_size_mismatch_names_both(gloo_group):
    with pytest.raises(ValueError, match=r"^process_group: its size is 1 but world_size is 2"):
        rt.Layer(8, 8, 4, 2, 8, world_size=2, process_group=gloo_group)
    with pytest.raises(ValueError, match=r"^process_group: its size is 1 but world_size is 4"):
        rt.MoE(8, 8, 4, 2, max_tokens=8, world_size=4, process_group=gloo_group)


def test_stub_group_size_mismatch_names_both():
    with pytest.raises(ValueError, match=r"^process_group: its size is 3 but world_size is 2"):
        rt.Layer(8, 8, 4, 2, 8, world_size=2, process_group=StubGroup(3))


def test_process_group_with_the_host_backend_is_refused(gloo_group):
    with pytest.raises(ValueError, match=r"^process_group: a process group selects the per-process CUDA backend"):
        rt.Layer(8, 8, 4, 2, 8, backend="host", process_group=gloo_group)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_process_group_without_cuda(gloo_group):
    with pytest.raises(ValueError, match=r"^process_group: the per-process CUDA backend needs CUDA"):
        rt.Layer(8, 8, 4, 2, 8, process_group=gloo_group)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_per_process_cuda_layer_through_gloo(gloo_group):
    """One process as rank 0 of W = 1 on the current GPU, bootstrapped through the gloo group: the layer
    matches the one-process CUDA layer bit for bit (same inputs, same rank placement)."""
    if not capi.built_with_cuda():
        pytest.skip("librdep_capi.so was built without CUDA")
    torch.manual_seed(0)
    H, F, E, K, n = 64, 32, 8, 2, 48
    dev = torch.device("cuda", torch.cuda.current_device())
    per_process = rt.Layer(H, F, E, K, n, process_group=gloo_group)
    assert per_process.backend == "cuda" and per_process.device == dev and per_process.world_size == 1
    x = torch.randn(1, n, H, device=dev).bfloat16()
    ids = torch.rand(n, E, device=dev).argsort(-1)[:, :K].reshape(1, n, K).int()
    gates = torch.rand(1, n, K, device=dev)
    w1 = (torch.randn(E, H, 2 * F, device=dev) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, F, H, device=dev) / F ** 0.5).bfloat16()
    y = rt.moe(per_process, x, ids, gates, w1, w2)
    if dev.index == 0:
        one_process = rt.Layer(H, F, E, K, n, backend="cuda")
        y1 = rt.moe(one_process, x, ids, gates, w1, w2)
        assert torch.equal(y, y1)
    assert torch.isfinite(y.float()).all()


def _assert_reducer_syncs(ddp, want_ids):
    """The parameters DDP's reducer averages are exactly want_ids (read from DDP's own builder, a DDP internal where a
    torch has it; else from the parameters DDP keeps)."""
    if hasattr(ddp, "_build_params_for_reducer"):
        params, _ = ddp._build_params_for_reducer()
        assert {id(p) for p in params} == want_ids
    assert {id(p) for p in ddp._module_parameters} == want_ids


def test_ddp_ignores_the_experts_of_a_moe_that_is_the_root_module(gloo_group):
    """An MoE wrapped alone: its own parameters are named "w1" by named_parameters() and ".w1" by DDP's reducer; both
    forms are listed, so the reducer leaves w1, w2 alone."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    moe = rt.MoE(8, 6, 4, 2, max_tokens=8, world_size=1, backend="host", shared_ffn=4)
    assert rt.ddp_ignore_experts(moe) == ["w1", "w2"]
    ddp = DDP(moe, process_group=gloo_group)
    _assert_reducer_syncs(ddp, {id(p) for p in moe.dense_parameters()})


class _TwoMoEBlocks(torch.nn.Module):
    def __init__(self, H=8):
        super().__init__()
        self.inp = torch.nn.Linear(H, H)
        self.blocks = torch.nn.ModuleList(
            rt.MoE(H, 6, 4, 2, max_tokens=8, world_size=1, backend="host", shared_ffn=4, seed=i) for i in range(2))

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x).y
        return x


def test_ddp_ignores_the_experts_and_averages_the_rest(gloo_group):
    """rdep.torch.ddp_ignore_experts: the MoE modules' expert parameters go on DistributedDataParallel's ignore list (a
    list the model had is kept), so DDP's reducer syncs exactly the other parameters; the wrapped model's step gives the
    unwrapped model's gradients (one process); wrapping first is refused."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = _TwoMoEBlocks()
    model._ddp_params_and_buffers_to_ignore = ["inp.bias"]
    names = rt.ddp_ignore_experts(model)
    assert names == ["blocks.0.w1", "blocks.0.w2", "blocks.1.w1", "blocks.1.w2"]
    assert rt.expert_parameter_names(model) == names
    assert model._ddp_params_and_buffers_to_ignore == ["inp.bias"] + names
    assert rt.ddp_ignore_experts(model) == names and model._ddp_params_and_buffers_to_ignore == ["inp.bias"] + names

    plain = _TwoMoEBlocks()
    plain.load_state_dict(model.state_dict())
    ddp = DDP(model, process_group=gloo_group)
    synced = {id(p) for n, p in model.named_parameters() if n not in names and n != "inp.bias"}
    _assert_reducer_syncs(ddp, synced)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    ddp(x).square().sum().backward()
    plain(x).square().sum().backward()
    for (n, a), (_, b) in zip(model.named_parameters(), plain.named_parameters()):
        assert torch.equal(a.grad, b.grad), n
    with pytest.raises(ValueError, match="model: already wrapped in DistributedDataParallel"):
        rt.ddp_ignore_experts(ddp)
