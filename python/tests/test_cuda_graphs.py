"""rdep's ops inside CUDA graphs (GPU): a capturable layer (Layer.capturable: CUDA, CUTLASS, one local rank) recorded
with torch.cuda.graph (forward and backward in one capture) replays new inputs bitwise like eager calls, and
torch.compile(mode="reduce-overhead") records rdep's ops inside its graphs (no partition around them) and gives
what the default mode gives. Skipped without a GPU, a CUDA build, or (unless RDEP_REQUIRE_CUTLASS=1, as on the
device, where that is a failure) the CUTLASS compute.
"""

from __future__ import annotations

import pytest
import torch

import rdep.torch as rt
from cuda_graph_helpers import assert_replay_matches_eager, capture, require_cutlass_gpu
from test_cuda import DEV, assert_reduce_overhead_matches_default, make_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


@pytest.fixture(autouse=True)
def _cutlass_gpu():
    require_cutlass_gpu()
    torch.cuda.set_device(DEV)


H, F, E, K, T = 64, 32, 8, 2, 48


def _step(layer, x, ids, gates, w1, w2, dy):
    """y and the gradients of x, gates, w1, w2 for dy (torch.autograd.grad: no .grad accumulation)."""
    y = rt.moe(layer, x, ids, gates, w1, w2)
    return (y,) + torch.autograd.grad(y, (x, gates, w1, w2), dy)


@pytest.mark.parametrize("gate_in_expert", [False, True])
def test_saved_rows_are_pieces_of_the_rows_tensor(gate_in_expert):
    """The capturable forward's saved rows come from its rows tensor (Layer.row_bytes, the C library's count of
    one forward's requests; rdep_layer_forward_arena): the forward takes exactly that many bytes (a short arena
    would fail it naming the bytes, a long one waste memory) and none from torch's allocator through the row
    allocator's callbacks, the backward runs on them, and releasing the context gives torch nothing (the pieces'
    placement in the arena: row_arena_test.cc, CApi_Cuda's arena forward)."""
    from rdep.torch import layer as layer_mod

    layer = rt.Layer(H, F, E, K, T, world_size=1, backend="cuda", expert_compute="cutlass", gate_in_expert=gate_in_expert)
    x, ids, gates, w1, w2 = make_inputs(1, T, H, F, E, K, "uniform", seed=7)
    y, ctx, rows, w1c, w2c = torch.ops.rdep.moe_forward_capturable(layer.handle, layer.rep, x, ids, gates, w1, w2, layer.row_bytes, False, True)
    assert layer.row_bytes > 0 and rows.dtype == torch.uint8 and rows.numel() == layer.row_bytes
    assert layer._native.arena_used == layer.row_bytes
    assert not layer_mod._TORCH_BLOCKS.get(layer._native.row_key)
    dx, dgates, dw1, dw2 = torch.ops.rdep.moe_backward_capturable(layer.handle, layer.rep, ctx, rows, w1c, w2c, torch.randn_like(y), w1, w2)
    torch.cuda.synchronize()
    assert torch.isfinite(dx.float()).all() and torch.isfinite(dw1.float()).all()
    assert not layer_mod._TORCH_BLOCKS.get(layer._native.row_key) and layer.live_contexts == 0


@pytest.mark.parametrize("weights", ["bf16", "fp32_master", "fp32_master_kept_casts"])
@pytest.mark.parametrize("gate_in_expert, owner_reduce", [(False, False), (True, False), (False, True), (True, True)])
def test_captured_forward_backward_replays_like_eager_calls(weights, gate_in_expert, owner_reduce):
    """One capture of forward + backward (torch.cuda.graph, after two eager warm-up steps on a side stream, as
    torch's docs prescribe); three replays, each with new x, routing, gates and dy copied into the captured
    inputs, give y, dx, dgates, dw1, dw2 bitwise equal to eager calls on the same inputs. The capture pins one
    context; the eager calls leave none. fp32_master_kept_casts: keep_weight_casts, the forward's bf16 casts
    returned as tensors autograd saves for the backward. owner_reduce: a token's rows summed by the owner before
    they return (the training example's --owner-reduce)."""
    layer = rt.Layer(H, F, E, K, T, world_size=1, backend="cuda", expert_compute="cutlass", gate_in_expert=gate_in_expert,
                     keep_weight_casts=weights.endswith("kept_casts"), owner_reduce=owner_reduce)
    assert layer.capturable
    wdt = torch.bfloat16 if weights == "bf16" else torch.float32
    x0, ids0, g0, w1, w2 = make_inputs(1, T, H, F, E, K, "uniform", seed=1)
    w1, w2 = w1.to(wdt).requires_grad_(True), w2.to(wdt).requires_grad_(True)
    x_s, ids_s, g_s = x0.clone().requires_grad_(True), ids0.clone(), g0.clone().requires_grad_(True)
    dy_s = torch.randn_like(x0)

    def no_context_left():
        assert layer.live_contexts == 0 and layer.pinned_contexts == 0

    graph, outs_s = capture(lambda: _step(layer, x_s, ids_s, g_s, w1, w2, dy_s), after_warmups=no_context_left)
    assert layer.pinned_contexts == 1 and layer.live_contexts == 0

    for seed in (2, 3, 4):
        x, ids, gates, _, _ = make_inputs(1, T, H, F, E, K, "zipf" if seed == 3 else "uniform", seed=seed)
        dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).bfloat16().to(DEV)
        assert_replay_matches_eager(
            graph, outs_s, (x_s, ids_s, g_s, dy_s), (x, ids, gates, dy),
            lambda: _step(layer, x.clone().requires_grad_(True), ids, gates.clone().requires_grad_(True), w1, w2, dy),
            f"replay {seed}")
    assert layer.live_contexts == 0 and layer.pinned_contexts == 1
    layer.check_errors()  # nothing recorded (W = 1 runs no barrier)
    del graph


def test_ranks_sharing_the_gpu_keep_the_plain_ops():
    """Layer.capturable needs one local rank: W = 4 ranks driven by this process on one GPU keep the plain ops (their
    capture would be one graph of every rank's work); W = 1 and one rank a process (test_distributed_cuda.py) capture."""
    shared = rt.Layer(H, F, E, K, T, world_size=4, num_gpus=1, backend="cuda", expert_compute="cutlass")
    assert shared.num_local_ranks == 4 and not shared.capturable
    assert rt.Layer(H, F, E, K, T, world_size=1, backend="cuda", expert_compute="cutlass").capturable


def test_grad_off_forward_is_captured():
    """A forward with grad off (no saved context) recorded in a graph pins its context and replays like eager."""
    layer = rt.Layer(H, F, E, K, T, world_size=1, backend="cuda", expert_compute="cutlass")
    x_s, ids_s, g_s, w1, w2 = make_inputs(1, T, H, F, E, K, "uniform", seed=5)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            rt.moe(layer, x_s, ids_s, g_s, w1, w2)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_s = rt.moe(layer, x_s, ids_s, g_s, w1, w2)
        assert layer.pinned_contexts == 1 and layer.live_contexts == 0
        x, ids, gates, _, _ = make_inputs(1, T, H, F, E, K, "zipf", seed=6)
        x_s.copy_(x), ids_s.copy_(ids), g_s.copy_(gates)
        graph.replay()
        assert torch.equal(y_s, rt.moe(layer, x, ids, gates, w1, w2))


@pytest.mark.parametrize("keep_weight_casts, owner_reduce", [(False, False), (True, False), (True, True)])
def test_reduce_overhead_records_rdep_ops_in_its_graphs(keep_weight_casts, owner_reduce):
    """torch.compile(mode="reduce-overhead") on a model holding rdep's MoE at W = 1 (capturable): the capturable
    ops carry no cudagraph_unsafe tag, so CUDA graph trees record them with the rest of the forward and the
    backward (contexts pinned: the proof that they were captured). Four steps with new inputs each give what the
    default mode gives (y, dx and every parameter's gradient; bf16 tolerances: inductor's kernels may differ
    between the modes); with the casts kept, and with the owner's reduce (the training example's --owner-reduce)."""
    import torch._inductor.config as inductor_config

    args = dict(max_tokens=32, world_size=1, backend="cuda", shared_ffn=16, aux_loss_coeff=1e-2, seed=5, init_std=0.1,
                expert_compute="cutlass", dtype=torch.float32, keep_weight_casts=keep_weight_casts,
                owner_reduce=owner_reduce)
    mods = [rt.MoE(64, 32, 8, 2, **args) for _ in range(2)]
    assert mods[1].layer.capturable
    torch._dynamo.reset()
    patch = {"graph_partition": True} if hasattr(inductor_config, "graph_partition") else {}
    with inductor_config.patch(**patch):
        assert_reduce_overhead_matches_default(mods, 4, (1, 32, 64))
    assert mods[0].layer.live_contexts == 0 and mods[0].layer.pinned_contexts == 0
    assert mods[1].layer.live_contexts == 0
    assert mods[1].layer.pinned_contexts >= 1, "reduce-overhead did not record rdep's ops in a CUDA graph"
    torch._dynamo.reset()


def test_reduce_overhead_with_micro_batches(monkeypatch):
    """Gradient accumulation under reduce-overhead (three micro-batches a step, one cudagraph_mark_step_begin a step,
    as the training example's --grad-accum): CUDA graph trees record a forward and a backward node per micro-batch,
    so a forward is captured while no released context is free and its context is made inside the capture (once a
    cudaMalloc there invalidated the capture: the example's first recorded step failed). Three steps give what the
    default mode gives, every recorded forward pinned a context of its own (at most one a micro-batch of each step),
    and the layer's calls recorded no device fault (a backward without its forward: CudaDomain::TakeForward). Whether
    graph trees recorded a backward again (rdep_context_rearm) depends on torch's checks: counted, and printed."""
    import torch._inductor.config as inductor_config
    from rdep.torch import graph_contexts

    rearmed = []
    real_rearm = graph_contexts.rearm
    monkeypatch.setattr(graph_contexts, "rearm", lambda layer, e: (rearmed.append(e.c_id), real_rearm(layer, e)))

    args = dict(max_tokens=32, world_size=1, backend="cuda", shared_ffn=16, aux_loss_coeff=1e-2, seed=5, init_std=0.1,
                expert_compute="cutlass", dtype=torch.float32)
    mods = [rt.MoE(64, 32, 8, 2, **args) for _ in range(2)]
    torch._dynamo.reset()
    patch = {"graph_partition": True} if hasattr(inductor_config, "graph_partition") else {}
    with inductor_config.patch(**patch):
        assert_reduce_overhead_matches_default(mods, 3, (1, 32, 64), micro=3)
    torch.cuda.synchronize()
    mods[1].layer.check_errors()
    pinned = mods[1].layer.pinned_contexts
    print(f"pinned contexts {pinned}, backwards recorded again {len(rearmed)}")
    assert 2 <= pinned <= 3 * 3, f"{pinned} pinned contexts for 3 steps of 3 micro-batches"
    torch._dynamo.reset()


def test_backward_fills_no_zero_gradients_for_saved_outputs():
    """Autograd gives the outputs that carry saved state (ctx, the rows tensor, the kept casts) no gradient: no
    zero tensor is filled for them before the backward (set_materialize_grads(False); once a 36 µs memset of
    the rows per call at the training example's shape). The profiled forward+backward of the capturable ops
    launches no fill of a uint8 tensor and at most one fill (the ctx tensor's), while its results equal the
    plain ops' bitwise."""
    from torch.profiler import ProfilerActivity, profile

    layer = rt.Layer(H, F, E, K, T, world_size=1, backend="cuda", expert_compute="cutlass")
    assert layer.capturable
    x, ids, gates, w1, w2 = make_inputs(1, T, H, F, E, K, "uniform", seed=3)
    for t in (x, gates, w1, w2):
        t.requires_grad_(True)
    dy = torch.randn(1, T, H, device=x.device, dtype=x.dtype)
    _step(layer, x, ids, gates, w1, w2, dy)  # warm: the first call's allocations are not what is checked
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = _step(layer, x, ids, gates, w1, w2, dy)
        torch.cuda.synchronize()
    fills = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "FillFunctor" in e.name]
    assert not [n for n in fills if "unsigned char" in n], fills
    assert len(fills) <= 1, fills  # the capturable forward's ctx is a device tensor written by one fill
    plain = rt.Layer(H, F, E, K, T, world_size=1, backend="cuda", expert_compute="cutlass", capturable_ops=False)
    want = _step(plain, x, ids, gates, w1, w2, dy)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


class _Block(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.moe = rt.MoE(64, 32, 8, 2, max_tokens=32, world_size=1, backend="cuda", expert_compute="cutlass",
                          seed=seed, init_std=0.1, dtype=torch.float32)

    def forward(self, x):
        out = self.moe(torch.nn.functional.layer_norm(x, x.shape[-1:]))
        return x + out.y, out.aux_loss


def test_blocks_compiled_one_at_a_time_under_reduce_overhead():
    """Four equal MoE blocks each compiled on its own (TorchTitan's per-block compile), once with
    mode="reduce-overhead" and once in the default mode (the same inductor kernels): each mode compiles one graph
    for all four (the ops take Layer.handle, a static input CUDA graph trees read in place, and Layer.rep, equal
    for the four), every reduce-overhead layer's ops are recorded in a CUDA graph (each layer pins its own
    contexts: no handle named another layer), and three steps give what the default mode gives (bf16
    tolerances, as assert_reduce_overhead_matches_default)."""
    from test_cuda import GRAD_TOL, Y_TOL, assert_bf16_close
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs, default = [_Block(seed=s) for s in range(4)], [_Block(seed=s) for s in range(4)]
    for b, d in zip(graphs, default):
        assert b.moe.layer.capturable and b.moe.layer.rep == graphs[0].moe.layer.rep
        b.compile(mode="reduce-overhead")
        d.compile()
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        x = torch.randn(32, 64, generator=g).bfloat16().to(DEV)
        outs = []
        for model in (graphs, default):
            torch.compiler.cudagraph_mark_step_begin()
            h = x.clone().requires_grad_(True)
            out, aux = h, 0.0
            for b in model:
                out, a = b(out)
                aux = aux + a
            (out.float().square().mean() + aux).backward()
            outs.append([out.detach().clone(), h.grad.clone()]
                        + [p.grad.clone() for b in model for p in b.parameters()])
            for b in model:
                b.zero_grad(set_to_none=True)
        for i, (a, want) in enumerate(zip(outs[0], outs[1])):
            assert_bf16_close(a, want, Y_TOL if i == 0 else GRAD_TOL, f"step {step}: output {i}")
    # one graph per mode (two with a grad-mode variant each); eight if each layer compiled its own
    assert counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])
    assert all(b.moe.layer.pinned_contexts > 0 for b in graphs), [b.moe.layer.pinned_contexts for b in graphs]
    assert all(d.moe.layer.pinned_contexts == 0 and d.moe.layer.live_contexts == 0 for d in default)
    torch._dynamo.reset()
    for b in graphs:
        b.moe.layer.release_graph_contexts()
