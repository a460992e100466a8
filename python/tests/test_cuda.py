"""The CUDA backend through the torch binding: bf16 activations and expert weights, fp32 gates and weight
gradients, W = 1 and W = 4 ranks sharing GPU 0 (one process), against the same plain fp64 reference fed
the bf16 values. Skipped, with the reason, without a GPU or without a CUDA build of librdep_capi.so.

Tolerance (bf16, as `rdep check` on CUDA): ||out - ref||_F / ||ref||_F <= 1e-2 for y and 2e-2 for the
gradients (bf16's unit roundoff is 2^-8 ~ 3.9e-3; y is rounded once on output, the gradients also pass
through bf16 intermediates of the expert MLP and dx through a bf16 output).
"""

from __future__ import annotations

import pytest
import torch

import rdep
import rdep._capi as capi
import rdep.torch as rt
import reference as ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

Y_TOL, GRAD_TOL = 1e-2, 2e-2
DEV = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def _rdep_cuda():
    if not capi.built_with_cuda():
        pytest.skip("librdep_capi.so was built without CUDA")
    if capi.cuda_device_count() < 1:
        pytest.skip("librdep_capi.so sees no CUDA device")
    torch.cuda.set_device(DEV)


def norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert a.shape == b.shape, f"shape {list(a.shape)} != {list(b.shape)}"
    nb = b.norm().item()
    return (a - b).norm().item() / nb if nb > 0 else (a - b).norm().item()


def assert_bf16_close(a, b, tol, what):
    assert torch.isfinite(a.detach().float()).all(), f"{what}: non-finite values"
    e = norm_rel(a, b)
    assert e <= tol, f"{what}: ||a-b||/||b|| = {e:.3g} > {tol:g}"


def make_inputs(W, n, H, F, E, K, kind, seed=0):
    x, ids, gates, w1, w2 = ref.draw_inputs(W, n, H, F, E, K, kind, torch.Generator().manual_seed(seed))
    return [t.to(DEV).contiguous() for t in (x, ids, gates, w1, w2)]


OP_CASES = [
    # id, W, E, K, n, T, capacity_factor, routing, expect drops
    ("W1_E8_K2_uniform", 1, 8, 2, 64, 64, 0.0, "uniform", False),
    ("W4_shared_gpu_E8_K2_uniform", 4, 8, 2, 32, 32, 0.0, "uniform", False),
    ("W4_shared_gpu_E6_K3_zipf_C0.6", 4, 6, 3, 24, 32, 0.6, "zipf", True),
]


@pytest.mark.parametrize("compute", ["cublaslt", "auto"])
@pytest.mark.parametrize("case", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_op_matches_reference_bf16(case, compute):
    _, W, E, K, n, T, C, kind, drops = case
    H, F = 64, 32
    layer = rt.Layer(H, F, E, K, T, world_size=W, backend="cuda", num_gpus=1, capacity_factor=C, expert_compute=compute)
    assert layer.backend == "cuda" and layer.device == DEV and layer.num_local_ranks == W
    x, ids, gates, w1, w2 = make_inputs(W, n, H, F, E, K, kind)
    leaves = [t.clone().requires_grad_(True) for t in (x, gates, w1, w2)]
    y = rt.moe(layer, leaves[0], ids, leaves[1], leaves[2], leaves[3])
    assert y.dtype == torch.bfloat16 and y.device == DEV
    dy = torch.randn_like(y)
    y.backward(dy)
    assert layer.live_contexts == 0
    assert leaves[0].grad.dtype == torch.bfloat16 and leaves[1].grad.dtype == torch.float32
    assert leaves[2].grad.dtype == torch.bfloat16  # rdep's fp32 dW cast to the parameter's dtype

    rl = [t.detach().double().cpu().requires_grad_(True) for t in (x, gates, w1, w2)]
    y_ref, acc = ref.moe_layer(rl[0], ids.cpu(), rl[1], rl[2], rl[3], C, T)
    y_ref.backward(dy.double().cpu())
    assert bool((~acc).any()) == drops
    assert_bf16_close(y, y_ref, Y_TOL, "y")
    for name, got, want in zip(("dx", "dgates", "dw1", "dw2"), leaves, rl):
        assert_bf16_close(got.grad, want.grad, GRAD_TOL, name)


def test_fp32_master_weights():
    """fp32 expert weights on CUDA: cast to bf16 for the layer, gradients returned in fp32."""
    W, E, K, n, H, F = 2, 4, 2, 32, 64, 32
    layer = rt.Layer(H, F, E, K, n, world_size=W, backend="cuda", num_gpus=1)
    x, ids, gates, w1, w2 = make_inputs(W, n, H, F, E, K, "uniform", seed=3)
    w1m, w2m = (w1.float() + 1e-3 * torch.randn_like(w1.float())).requires_grad_(True), w2.float().requires_grad_(True)
    y = rt.moe(layer, x, ids, gates, w1m, w2m)
    y.backward(torch.ones_like(y))
    assert w1m.grad.dtype == torch.float32 and w2m.grad.dtype == torch.float32
    w1r, w2r = [t.detach().bfloat16().double().cpu().requires_grad_(True) for t in (w1m, w2m)]
    y_ref, _ = ref.moe_layer(x.double().cpu(), ids.cpu(), gates.double().cpu(), w1r, w2r, 0.0, n)
    y_ref.backward(torch.ones_like(y_ref))
    assert_bf16_close(y, y_ref, Y_TOL, "y")
    assert_bf16_close(w1m.grad, w1r.grad, GRAD_TOL, "dw1")
    assert_bf16_close(w2m.grad, w2r.grad, GRAD_TOL, "dw2")


def test_fp32_master_weights_keep_the_forward_casts_for_backward(monkeypatch, python_path):
    """keep_weight_casts=True: the forward's bf16 casts of fp32 weights are held with its context and
    used by its backward (which casts nothing), dropped with the context; the gradients are bitwise those
    of a layer that casts again (keep_weight_casts=False, the default). A backward given weights changed in
    place since the forward casts again (the version counter differs) instead of using stale casts."""
    import rdep.torch.ops as ops

    casts = []
    cast = ops._layer_weights
    monkeypatch.setattr(ops, "_layer_weights", lambda *a: casts.append(1) or cast(*a))
    W, E, K, n, H, F = 2, 4, 2, 32, 64, 32
    x, ids, gates, w1, w2 = make_inputs(W, n, H, F, E, K, "uniform", seed=5)
    grads = {}
    lt = dict(expert_compute="cublaslt")  # the CUTLASS backward casts into its gradients instead (casts_in_grads)
    for keep in (True, False):
        layer = rt.Layer(H, F, E, K, n, world_size=W, backend="cuda", num_gpus=1, keep_weight_casts=keep, **lt)
        assert layer.keep_weight_casts is keep
        w1m, w2m = w1.float().requires_grad_(True), w2.float().requires_grad_(True)
        casts.clear()
        y = rt.moe(layer, x, ids, gates, w1m, w2m)
        assert len(casts) == 1 and len(layer._native.casts) == (1 if keep else 0)
        if keep:
            _, kw1, kw2, _ = next(iter(layer._native.casts.values()))
            assert kw1.dtype == torch.bfloat16 and torch.equal(kw1, w1) and torch.equal(kw2, w2)
        y.backward(torch.ones_like(y))
        assert len(casts) == (1 if keep else 2)  # kept: backward cast nothing
        assert len(layer._native.casts) == 0 and layer.live_contexts == 0
        grads[keep] = (y.detach(), w1m.grad, w2m.grad)
    for a, b in zip(grads[True], grads[False]):
        assert torch.equal(a, b)
    # The ops called directly, w1 updated in place between forward and backward: the kept layer casts again
    # from the updated weights, as a layer that never keeps them does (dx goes through w1).
    dx = {}
    for keep, scale in ((True, 2.0), (False, 2.0), (True, 1.0)):
        layer = rt.Layer(H, F, E, K, n, world_size=W, backend="cuda", num_gpus=1, keep_weight_casts=keep, **lt)
        w1m, w2m = w1.float(), w2.float()
        y, ctx = torch.ops.rdep.moe_forward(layer.handle, layer.rep, x, ids, gates, w1m, w2m)
        w1m.mul_(scale)
        dx[keep, scale] = torch.ops.rdep.moe_backward(layer.handle, layer.rep, ctx, torch.ones_like(y), w1m, w2m)[0]
    assert torch.equal(dx[True, 2.0], dx[False, 2.0])
    assert not torch.equal(dx[True, 2.0], dx[True, 1.0])  # the update reaches dx: the check above can fail
    # Weights made under inference mode have no version counter: nothing is kept, and nothing fails.
    layer = rt.Layer(H, F, E, K, n, world_size=W, backend="cuda", num_gpus=1, keep_weight_casts=True, **lt)
    with torch.inference_mode():
        w1i, w2i = w1.float(), w2.float()
    y, ctx = torch.ops.rdep.moe_forward(layer.handle, layer.rep, x, ids, gates, w1i, w2i)
    assert len(layer._native.casts) == 0
    torch.ops.rdep.moe_backward(layer.handle, layer.rep, ctx, torch.ones_like(y), w1i, w2i)


@pytest.mark.parametrize("W,E", [(1, 8), (2, 8), (4, 2)])
def test_fp32_master_weights_cast_into_the_gradients_for_backward(monkeypatch, W, E, python_path):
    """The CUTLASS layer's backward with fp32 master weights reads their bf16 casts from inside the fp32
    gradient buffers it then overwrites (C ABI 13): the same bits as with the casts apart, and torch holds
    the casts' bytes less during the backward. E = 2 at W = 4: ranks without experts (nothing cast there)."""
    import rdep.torch.layer_calls as layer_calls
    import rdep.torch.ops as ops

    K, n, H, F = 2, 64, 256, 128
    x, ids, gates, w1, w2 = make_inputs(W, n, H, F, E, K, "zipf", seed=7)
    staged = []
    into = layer_calls._casts_into_grads
    monkeypatch.setattr(layer_calls, "_casts_into_grads", lambda *a: staged.append(1) or into(*a))
    out = {}
    for inside in (True, False):
        if not inside:
            monkeypatch.setattr(ops, "_casts_in_grads", lambda *a: False)
        layer = rt.Layer(H, F, E, K, n, world_size=W, backend="cuda", num_gpus=1, expert_compute="cutlass")
        w1m, w2m = w1.float().requires_grad_(True), w2.float().requires_grad_(True)
        xg, gg = x.clone().requires_grad_(True), gates.clone().requires_grad_(True)
        y = rt.moe(layer, xg, ids, gg, w1m, w2m)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y.backward(torch.ones_like(y))
        torch.cuda.synchronize()
        out[inside] = (xg.grad, gg.grad, w1m.grad, w2m.grad, torch.cuda.max_memory_allocated() - before)
    assert len(staged) == 1, "the first backward staged its casts in the gradients, the second did not"
    for name, a, b in zip(("dx", "dgates", "dw1", "dw2"), out[True][:4], out[False][:4]):
        assert torch.isfinite(b.float()).all(), name
        assert torch.equal(a, b), f"{name}: not the bits of the backward with the casts apart"
    cast_bytes = (w1.numel() + w2.numel()) * 2
    assert out[True][4] <= out[False][4] - 0.9 * cast_bytes, (out[True][4], out[False][4], cast_bytes)


MODULE_CASES = {
    "W1_shared_losses": dict(W=1, E=8, K=2, T=64, shape=(2, 32), capacity_factor=0.0,
                             kw=dict(shared_ffn=32, aux_loss_coeff=1e-2, z_loss_coeff=1e-3)),
    "W4_shared_gpu_sigmoid_groups_drops": dict(
        W=4, E=8, K=2, T=16, shape=(4, 16), capacity_factor=0.5,
        kw=dict(score_function="sigmoid", num_groups=4, topk_groups=2, expert_bias=True, shared_ffn=16,
                aux_loss_coeff=1e-2)),
}


@pytest.mark.parametrize("name", list(MODULE_CASES))
def test_module_matches_reference_bf16(name):
    c = MODULE_CASES[name]
    H = 64
    moe = rt.MoE(H, 32, c["E"], c["K"], max_tokens=c["T"], world_size=c["W"], backend="cuda",
                 capacity_factor=c["capacity_factor"], seed=5, init_std=0.1, **c["kw"])
    assert moe.w1.dtype == torch.bfloat16 and moe.router.weight.dtype == torch.float32
    x = torch.randn(*c["shape"], H, device=DEV).bfloat16().requires_grad_(True)
    out = moe(x)
    assert out.y.dtype == torch.bfloat16 and out.y.shape == x.shape
    dy = torch.randn_like(out.y)
    ((out.y.float() * dy.float()).sum() + out.aux_loss + out.z_loss).backward()

    r = ref.ReferenceMoE(moe)
    L = moe.layer.num_local_ranks
    xr = x.detach().double().cpu().requires_grad_(True)
    y_ref, aux_ref, z_ref, counts_ref, ids_ref, acc = r(xr.reshape(L, -1, H))
    ((y_ref.reshape(x.shape) * dy.double().cpu()).sum() + aux_ref + z_ref).backward()
    ids = moe.router(x.detach().reshape(L, -1, H)).experts
    assert torch.equal(ids.long().cpu(), ids_ref), "router selection differs from the reference"
    if c["capacity_factor"]:
        assert (~acc).any()
    assert torch.equal(out.tokens_per_expert.cpu(), counts_ref)
    assert_bf16_close(out.y, y_ref.reshape(x.shape), Y_TOL, "y")
    assert_bf16_close(out.aux_loss, aux_ref, 1e-4, "aux_loss")
    assert_bf16_close(out.z_loss, z_ref, 1e-4, "z_loss")
    assert_bf16_close(x.grad, xr.grad, GRAD_TOL, "x.grad")
    params = dict(moe.named_parameters())
    for key, p_ref in r.params().items():
        assert_bf16_close(params[key].grad, p_ref.grad, GRAD_TOL, f"{key}.grad")


def test_no_host_sync_in_the_python_path():
    """torch's sync debug mode raises on any synchronizing torch call (.item(), .tolist(), nonzero, a
    blocking copy to the host): the router, the op wrappers and autograd must make none."""
    moe = rt.MoE(64, 32, 8, 2, max_tokens=32, world_size=2, backend="cuda", shared_ffn=16, aux_loss_coeff=1e-2,
                 z_loss_coeff=1e-3, expert_bias=True, capacity_factor=1.0)
    x = torch.randn(2, 32, 64, device=DEV).bfloat16().requires_grad_(True)
    moe(x)  # warm up (first-call allocations)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moe(x)
        (out.y.float().sum() + out.router_loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert moe.layer.live_contexts == 0


def test_runs_on_the_current_stream():
    moe = rt.MoE(64, 32, 8, 2, max_tokens=32, world_size=4, backend="cuda", seed=2)
    x = torch.randn(4, 32, 64, device=DEV).bfloat16()
    y0 = moe(x).y
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y1 = moe(x).y
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert torch.equal(y0, y1)


def test_compile_fullgraph_matches_eager_cuda():
    args = dict(max_tokens=32, world_size=2, backend="cuda", shared_ffn=16, aux_loss_coeff=1e-2, seed=4)
    eager, src = rt.MoE(64, 32, 8, 2, **args), rt.MoE(64, 32, 8, 2, **args)
    compiled = torch.compile(src, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 32, 64, device=DEV).bfloat16()
    outs = []
    for m in (eager, compiled):
        xi = x.clone().requires_grad_(True)
        o = m(xi)
        (o.y.float().square().mean() + o.aux_loss).backward()
        outs.append((o.y, xi.grad))
    torch.testing.assert_close(outs[1][0], outs[0][0])
    torch.testing.assert_close(outs[1][1], outs[0][1])
    for (k, pe), (_, pc) in zip(eager.named_parameters(), src.named_parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, msg=k)


def assert_reduce_overhead_matches_default(mods, steps: int, x_shape: tuple, device=DEV, seed: int = 11,
                                           micro: int = 1) -> None:
    """mods[0] compiled in the default mode, mods[1] (the same weights) with mode="reduce-overhead": `steps` training
    steps with a new x each (drawn from `seed`, on `device`) give the same y, dx and parameter gradients (bf16
    tolerances: inductor's kernels may differ between the modes). micro > 1: gradient accumulation, `micro` forwards
    and backwards a step (each its own x) with one cudagraph_mark_step_begin a step, as training with micro-batches
    runs (CUDA graph trees then record a forward node per micro-batch, each with a context of its own); the gradients
    are compared once a step, after the last micro-batch."""
    runs = [torch.compile(mods[0]), torch.compile(mods[1], mode="reduce-overhead")]
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        xs = [torch.randn(*x_shape, generator=g).bfloat16().to(device) for _ in range(micro)]
        outs = []
        for run, mod in zip(runs, mods):
            torch.compiler.cudagraph_mark_step_begin()
            got = []
            for x in xs:
                xi = x.clone().requires_grad_(True)
                o = run(xi)
                (o.y.float().square().mean() + o.aux_loss).backward()
                got += [o.y.detach().clone(), xi.grad.clone()]
            outs.append(got + [p.grad.clone() for p in mod.parameters()])
            mod.zero_grad(set_to_none=True)
        names = [f"{n}[{i}]" for i in range(micro) for n in ("y", "dx")] + [k for k, _ in mods[0].named_parameters()]
        assert len(names) == len(outs[0]) == len(outs[1]), (len(names), len(outs[0]), len(outs[1]))
        for name, a, b in zip(names, outs[1], outs[0]):
            assert_bf16_close(a, b, Y_TOL if name.startswith("y") else GRAD_TOL, f"step {step}: {name}")


@pytest.mark.parametrize("compute", ["cublaslt", "cutlass"])
def test_compile_reduce_overhead_matches_default_mode(compute):
    """torch.compile(mode="reduce-overhead") (CUDA graphs) on a model holding rdep's MoE: rdep's ops are tagged
    cudagraph_unsafe (op_library.py), so with inductor's graph partitioning they run between captured partitions
    and their host work (contexts, the C call) runs on every step. Three steps with new inputs each give what
    the default mode gives (y, dx and every parameter's gradient, bf16 tolerances: the same inductor kernels,
    the partitions apart), and no forward context is left."""
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "graph_partition"):
        pytest.skip(f"torch {torch.__version__} has no inductor graph partitioning")
    assert torch.Tag.cudagraph_unsafe in torch.ops.rdep.moe_forward.default.tags
    args = dict(max_tokens=32, world_size=2, backend="cuda", shared_ffn=16, aux_loss_coeff=1e-2, seed=5, init_std=0.1,
                expert_compute=compute, dtype=torch.float32)
    try:
        mods = [rt.MoE(64, 32, 8, 2, **args) for _ in range(2)]
    except Exception as e:  # the CUTLASS compute needs sm_90 and a CUTLASS build
        if compute == "cutlass" and "cutlass" in str(e).lower():
            pytest.skip(f"the CUTLASS compute is not available here: {e}")
        raise
    torch._dynamo.reset()
    with inductor_config.patch(graph_partition=True):
        assert_reduce_overhead_matches_default(mods, 3, (2, 32, 64))
    for m in mods:
        assert m.layer.live_contexts == 0
    torch._dynamo.reset()


def test_expert_compute_auto_picks_cutlass_where_it_runs():
    """expert_compute='auto' (the default): 'cutlass' where the library says it runs on this GPU
    (rdep_cutlass_available), else 'cublaslt' with the library's reason; an explicit choice kept. The chosen
    compute runs: a forward and backward against the plain reference."""
    ok, why = capi.cutlass_available(0)
    layer = rt.Layer(64, 32, 8, 2, 32, world_size=2, backend="cuda", num_gpus=1)
    assert layer.expert_compute == ("cutlass" if ok else "cublaslt"), why
    assert layer.expert_compute_note == ("" if ok else f"cuda:0: {why}")
    assert rt.Layer(64, 32, 8, 2, 32, world_size=2, backend="cuda", num_gpus=1, expert_compute="cublaslt").expert_compute == "cublaslt"
    x, ids, gates, w1, w2 = make_inputs(2, 32, 64, 32, 8, 2, "uniform")
    leaves = [t.clone().requires_grad_(True) for t in (x, gates, w1, w2)]
    y = rt.moe(layer, leaves[0], ids, leaves[1], leaves[2], leaves[3])
    dy = torch.randn_like(y)
    y.backward(dy)
    rl = [t.detach().double().cpu().requires_grad_(True) for t in (x, gates, w1, w2)]
    y_ref, _ = ref.moe_layer(rl[0], ids.cpu(), rl[1], rl[2], rl[3], 0.0, 32)
    y_ref.backward(dy.double().cpu())
    assert_bf16_close(y, y_ref, Y_TOL, "y")
    for name, got, want in zip(("dx", "dgates", "dw1", "dw2"), leaves, rl):
        assert_bf16_close(got.grad, want.grad, GRAD_TOL, name)
    assert layer.live_contexts == 0


def test_module_moves_from_host_to_cuda():
    """backend='auto': .to('cuda') rebuilds the layer on the GPU; fp32 parameters become master weights."""
    m = rt.MoE(64, 32, 8, 2, max_tokens=16, world_size=2, seed=6, init_std=0.1)
    assert m.layer.backend == "host"
    x = torch.randn(2, 16, 64)
    y_host = m(x).y
    m.to(DEV)
    assert m.layer.backend == "cuda" and m.layer.device == DEV and m.w1.dtype == torch.float32
    y_cuda = m(x.to(DEV).bfloat16()).y
    assert_bf16_close(y_cuda, y_host, 2e-2, "y (cuda vs host)")


@pytest.mark.parametrize("compute", ["cublaslt", "auto"])
def test_cuda_bad_input_names_the_argument(compute):
    """Wrong dtypes and devices name the argument; a bad expert id raises at the forward on either compute:
    with grad off (no backward to report it) the binding waits for the device's routing check
    (rdep_context_check_routing) before releasing the context, so the sync-free CUTLASS forward reports it too."""
    layer = rt.Layer(64, 32, 8, 2, 32, world_size=2, backend="cuda", num_gpus=1, expert_compute=compute)
    x, ids, gates, w1, w2 = make_inputs(2, 32, 64, 32, 8, 2, "uniform")
    with pytest.raises(TypeError, match=r"^x: expected dtype torch.bfloat16 on the cuda backend, got torch.float32"):
        rt.moe(layer, x.float(), ids, gates, w1, w2)
    with pytest.raises(ValueError, match=r"^x: expected a tensor on cuda:0"):
        rt.moe(layer, x.cpu(), ids, gates, w1, w2)
    with pytest.raises(ValueError, match=r"^experts: expected a tensor on cuda:0"):
        rt.moe(layer, x, ids.cpu(), gates, w1, w2)
    with pytest.raises(TypeError, match=r"^w1: expected dtype torch.bfloat16 or torch.float32"):
        rt.moe(layer, x, ids, gates, w1.half(), w2)
    bad = ids.clone()
    bad[1, 5, 0] = 8
    with pytest.raises(rdep.InvalidArgumentError, match=r"on rank 1: routing token 5 slot 0: expert 8 outside \[0, E=8\)"):
        rt.moe(layer, x, bad, gates, w1, w2)
    assert layer.live_contexts == 0
    if layer.expert_compute == "cutlass":  # the forward returns before its device check: the binding's wait reports it
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the layer on the current stream
        with pytest.raises(rdep.InvalidArgumentError, match=r"^rdep_context_check_routing: .*token 5 slot 0: expert 8"):
            rt.moe(layer, x, bad, gates, w1, w2)
        assert layer.live_contexts == 0


ROWS_CASES = [
    # id, W, E, K, n, T, capacity_factor, routing
    ("W1_E8_K2_uniform", 1, 8, 2, 64, 64, 0.0, "uniform"),
    ("W4_shared_gpu_E6_K3_zipf_C0.6", 4, 6, 3, 24, 32, 0.6, "zipf"),
]


@pytest.mark.parametrize("case", ROWS_CASES, ids=[c[0] for c in ROWS_CASES])
def test_dispatch_combine_bf16(case):
    """rdep.torch.plan / dispatch / combine on CUDA with the caller's SwiGLU experts computed by torch in
    bf16, against the fp64 reference (the tolerances above); the received rows are the accepted ones."""
    _, W, E, K, n, T, C, kind = case
    H, F = 64, 32
    layer = rt.Layer(H, F, E, K, T, world_size=W, backend="cuda", num_gpus=1, capacity_factor=C)
    x, ids, gates, w1, w2 = make_inputs(W, n, H, F, E, K, kind, seed=7)
    leaves = [t.clone().requires_grad_(True) for t in (x, gates, w1, w2)]
    p = rt.plan(layer, ids, leaves[1])
    recv = rt.dispatch(p, leaves[0])
    assert recv.dtype == torch.bfloat16 and recv.device == DEV and recv.shape == (p.num_recv, H)
    outs, start = [], 0
    for e, c in enumerate(p.tokens_per_expert.tolist()):
        h = recv[start:start + c] @ leaves[2][e]
        outs.append((torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ leaves[3][e])
        start += c
    y = rt.combine(p, torch.cat(outs))
    dy = torch.randn_like(y)
    y.backward(dy)
    assert layer.live_contexts == 0

    rl = [t.detach().double().cpu().requires_grad_(True) for t in (x, gates, w1, w2)]
    y_ref, acc = ref.moe_layer(rl[0], ids.cpu(), rl[1], rl[2], rl[3], C, T)
    y_ref.backward(dy.double().cpu())
    assert p.num_recv == int(acc.sum())
    assert_bf16_close(y, y_ref, Y_TOL, "y")
    for name, got, want in zip(("dx", "dgates", "dw1", "dw2"), leaves, rl):
        assert_bf16_close(got.grad, want.grad, GRAD_TOL, name)


def test_dispatch_combine_need_one_segment_on_cuda():
    layer = rt.Layer(64, 32, 8, 2, 32, world_size=2, backend="cuda", num_gpus=1, segment_tokens=16)
    _, ids, gates, _, _ = make_inputs(2, 32, 64, 32, 8, 2, "uniform")
    with pytest.raises(rdep.FailedPreconditionError, match="need one segment per forward"):
        rt.plan(layer, ids, gates)
    assert layer.live_contexts == 0


def outputs_and_grads(m, x):
    """One forward and backward of module m on a copy of x (a fixed linear loss over y): y, dx, dW1, dW2 and
    the router's weight gradient."""
    xi = x.clone().requires_grad_(True)
    o = m(xi)
    (o.y.float() * torch.linspace(-1, 1, x.shape[-1], device=DEV)).sum().backward()
    return o.y, xi.grad, m.w1.grad, m.w2.grad, m.router.weight.grad


def assert_same_bits_but_torch_grads(got, want, case: str) -> None:
    """outputs_and_grads of two modules: y, dW1 and dW2 bitwise equal; dx and the router's gradient, which
    also pass through PyTorch's own backward kernels, within the bf16 tolerance."""
    for name, a, b in zip(("y", "dx", "dw1", "dw2", "drouter"), got, want):
        what = f"{name} ({case})"
        if name in ("dx", "drouter"):
            assert_bf16_close(a, b, GRAD_TOL, what)
        else:
            assert torch.equal(a, b), what


def test_owner_reduce_on_cuda_matches_the_per_slot_return():
    """The CUDA layer with owner_reduce (one row per (token, owner) back, dgate at the owner) against the
    same module without it, with and without balancing: y and every gradient within the bf16 tolerances."""
    for extra in (dict(), dict(balance="ultraep", balance_slots=2)):
        args = dict(max_tokens=32, world_size=4, backend="cuda", seed=9, init_std=0.1, **extra)
        off = rt.MoE(64, 32, 8, 2, **args)
        on = rt.MoE(64, 32, 8, 2, owner_reduce=True, **args)
        on.load_state_dict(off.state_dict())
        x = torch.randn(4, 32, 64, device=DEV).bfloat16()
        x[:, :, :8] += 3
        outs = [outputs_and_grads(m, x) for m in (off, on)]
        for name, a, b in zip(("y", "dx", "dw1", "dw2", "drouter"), outs[1], outs[0]):
            assert_bf16_close(a, b, Y_TOL if name == "y" else GRAD_TOL, f"{name} ({extra or 'no balancing'})")
        assert on.layer.live_contexts == 0


def two_steps_same_bits(got, want, W):
    """Two steps of `got` and `want` (modules with the same weights) on the same fresh bf16 inputs, W ranks
    sharing GPU 0: assert_same_bits_but_torch_grads after each."""
    for step in range(2):
        x = torch.randn(W, 32, 64, device=DEV).bfloat16() if W > 1 else torch.randn(32, 64, device=DEV).bfloat16()
        for m in (want, got):
            m.zero_grad()
        outs = [outputs_and_grads(m, x) for m in (want, got)]
        assert_same_bits_but_torch_grads(outs[1], outs[0], f"W={W}, step {step}")


def test_stash_rows_on_cuda_gives_the_same_bits():
    """The paged stash (stash_rows, CUTLASS compute): the saved expert rows go to pool pages at forward and
    back at backward, copies only, so y and the expert weight gradients are bitwise the module without it,
    dx and the router's gradient within the bf16 tolerance (they also pass through PyTorch's kernels), at
    W = 1 and W = 4 ranks sharing GPU 0, two steps (the pages come back at each backward)."""
    for W in (1, 4):
        args = dict(max_tokens=32, world_size=W, backend="cuda", seed=9, init_std=0.1, expert_compute="cutlass")
        plain = rt.MoE(64, 32, 8, 2, **args)
        stashed = rt.MoE(64, 32, 8, 2, stash_rows=W * 32 * 2, **args)
        stashed.load_state_dict(plain.state_dict())
        two_steps_same_bits(stashed, plain, W)
        assert stashed.layer.live_contexts == 0


def test_overlap_segments_on_cuda_gives_the_same_bits():
    """overlap_segments (the segment pipeline on a second stream per rank, CUTLASS compute) against the same
    module in sequence, several segments (segment_tokens 24 of W * 32 tokens), two steps: y and the expert
    weight gradients bitwise, dx and the router's gradient within the bf16 tolerance (they also pass through
    PyTorch's kernels), at W = 1 and W = 4 ranks sharing GPU 0."""
    for W in (1, 4):
        args = dict(max_tokens=32, world_size=W, backend="cuda", seed=9, init_std=0.1, expert_compute="cutlass",
                    segment_tokens=24)
        seq = rt.MoE(64, 32, 8, 2, **args)
        piped = rt.MoE(64, 32, 8, 2, overlap_segments=True, **args)
        piped.load_state_dict(seq.state_dict())
        assert piped.layer.overlap_segments is True
        two_steps_same_bits(piped, seq, W)


def test_gate_in_expert_on_cuda_matches_weighting_at_the_combine():
    """gate_in_expert (the experts weight their rows before W2; the owners take dgate; the default with the CUTLASS
    compute) against the same module with gate_in_expert=False, W = 1 and W = 4 ranks sharing GPU 0, one segment
    and several: y and every gradient (dx, the router's, the expert weights') within the bf16 tolerances; nothing
    left live; with owner_reduce too. The default is off where the layer cannot run it (cuBLASLt, balancing)."""
    for W, seg, reduce in ((1, 0, False), (4, 0, False), (4, 24, False), (4, 0, True)):
        args = dict(max_tokens=32, world_size=W, backend="cuda", seed=9, init_std=0.1, expert_compute="cutlass",
                    segment_tokens=seg, owner_reduce=reduce)
        plain = rt.MoE(64, 32, 8, 2, gate_in_expert=False, **args)
        gated = rt.MoE(64, 32, 8, 2, **args)
        gated.load_state_dict(plain.state_dict())
        assert gated.layer.gate_in_expert is True and plain.layer.gate_in_expert is False
        x = torch.randn(W, 32, 64, device=DEV).bfloat16() if W > 1 else torch.randn(32, 64, device=DEV).bfloat16()
        outs = [outputs_and_grads(m, x) for m in (plain, gated)]
        for name, a, b in zip(("y", "dx", "dw1", "dw2", "drouter"), outs[1], outs[0]):
            assert_bf16_close(a, b, Y_TOL if name == "y" else GRAD_TOL, f"W={W} segment={seg} owner_reduce={reduce}: {name}")
        assert gated.layer.live_contexts == 0
    for extra in (dict(expert_compute="cublaslt"), dict(expert_compute="cutlass", balance="ultraep", balance_slots=2)):
        assert rt.MoE(64, 32, 8, 2, max_tokens=32, world_size=4, backend="cuda", **extra).layer.gate_in_expert is False, extra


def test_transport_sms_on_cuda_gives_the_same_bits():
    """transport_sms=3 (the peer-storing kernels on 3 blocks, at most 3 SMs) against the default grids, with
    owner_reduce too: y and the expert weight gradients bitwise equal (each row is one warp's work whatever
    the grid); dx and the router's gradient, which also pass through PyTorch's own backward kernels, within
    the bf16 tolerance (the layer's dx is compared bitwise in cuda_owner_reduce_test.cc)."""
    for extra in (dict(), dict(owner_reduce=True)):
        args = dict(max_tokens=32, world_size=4, backend="cuda", seed=9, init_std=0.1, **extra)
        wide = rt.MoE(64, 32, 8, 2, **args)
        narrow = rt.MoE(64, 32, 8, 2, transport_sms=3, **args)
        narrow.load_state_dict(wide.state_dict())
        assert narrow.layer.transport_sms == 3
        x = torch.randn(4, 32, 64, device=DEV).bfloat16()
        outs = [outputs_and_grads(m, x) for m in (wide, narrow)]
        assert_same_bits_but_torch_grads(outs[1], outs[0], str(extra or "per-slot return"))


def test_balancing_on_cuda_matches_balancing_off():
    """The CUDA layer with replicas of hot experts (ultraep, 2 slots) against the same module without:
    y and every gradient within the bf16 tolerances; bf16 expert weights get their gradients through
    fp32 (replica gradients are reduced in fp32)."""
    args = dict(max_tokens=32, world_size=4, backend="cuda", seed=9, init_std=0.1)
    off = rt.MoE(64, 32, 8, 2, **args)
    on = rt.MoE(64, 32, 8, 2, balance="ultraep", balance_slots=2, **args)
    on.load_state_dict(off.state_dict())
    x = torch.randn(4, 32, 64, device=DEV).bfloat16()
    x[:, :, :8] += 3  # skew the router toward a few experts, so that replicas are made
    outs = [outputs_and_grads(m, x) for m in (off, on)]
    for name, a, b in zip(("y", "dx", "dw1", "dw2"), outs[1], outs[0]):
        assert_bf16_close(a, b, Y_TOL if name == "y" else GRAD_TOL, name)
    assert on.layer.live_contexts == 0


@pytest.mark.parametrize("compute", ["cublaslt", "cutlass"])
def test_context_rows_come_from_torch_and_go_back(compute):
    """C ABI version 8's row allocator as the binding sets it: a context's saved rows come from torch's caching
    allocator during the forward (torch's allocated bytes grow by at least the front-end's kept rows, T*K*H
    bf16 per rank, over a layer keeping them in its pooled contexts) and go back when backward releases the
    context (the same bytes allocated after backward as with torch_rows=False); y and every gradient bitwise
    the torch_rows=False layer's (the same kernels)."""
    W, n, H, F, E, K = 4, 32, 64, 32, 8, 2
    try:
        layers = [rt.Layer(H, F, E, K, n, world_size=W, backend="cuda", num_gpus=1, expert_compute=compute, torch_rows=t)
                  for t in (True, False)]
    except Exception as e:  # the CUTLASS compute needs sm_90 and a CUTLASS build
        if compute == "cutlass" and "cutlass" in str(e).lower():
            pytest.skip(f"the CUTLASS compute is not available here: {e}")
        raise
    x, ids, gates, w1, w2 = make_inputs(W, n, H, F, E, K, "zipf")
    results, grew, after = [], [], []
    for layer in layers:
        for step in range(2):  # the second step reuses the released (pooled) context
            leaves = [t.clone().requires_grad_(True) for t in (x, gates, w1, w2)]
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(DEV)
            y = rt.moe(layer, leaves[0], ids, leaves[1], leaves[2], leaves[3])
            torch.cuda.synchronize()
            if step == 1:
                grew.append(torch.cuda.memory_allocated(DEV) - before)
            y.float().square().sum().backward()
            torch.cuda.synchronize()
            assert layer.live_contexts == 0
            if step == 1:
                after.append(torch.cuda.memory_allocated(DEV) - before)
                results.append([y] + [t.grad for t in leaves])
            del y, leaves
    kept_rows = W * n * K * H * 2
    assert grew[0] - grew[1] >= kept_rows, f"torch_rows: the forward took {grew[0]} bytes from torch, own rows {grew[1]}"
    assert after[0] == after[1], f"after backward: {after[0]} bytes (torch rows) != {after[1]} (own rows)"
    for name, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), results[0], results[1]):
        assert torch.equal(a, b), f"{name} ({compute})"
