"""One process per GPU under torchrun (2 or more GPUs; test_distributed_cuda.py starts it): rdep.torch's
per-process CUDA layer bootstrapped through an NCCL process group, each process driving one rank.

Checks, in every process (each prints "rank R: NAME passed" or the failure, and exits nonzero on any):
  * eager_matches_reference: y and the gradients of x, gates, w1, w2 on this rank (its tokens, its experts)
    against the plain fp64 reference of the whole W-rank layer (reference.py, every rank's inputs, which every
    process makes from one seed), uniform routing and skewed routing with capacity drops; bf16 tolerances as
    test_cuda.py's;
  * capture_replays_like_eager: Layer.capturable holds with one rank a process; one capture of forward +
    backward (torch.cuda.graph) per process, then three replays on new inputs copied into the captured ones,
    each process replaying in turn with the others (the barriers between ranks are kernels counting their
    epochs on the device), give y, dx, dgates, dw1, dw2 bitwise those of eager calls on the same inputs;
  * reduce_overhead_records_rdep_ops: torch.compile(mode="reduce-overhead") on rdep.torch.MoE records rdep's ops
    in its CUDA graphs (contexts pinned) and gives what the default mode gives over four training steps.
The first failure ends its process (nonzero), and torchrun then stops the others.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the rdep package
sys.path.insert(0, str(Path(__file__).resolve().parent))  # reference.py

import rdep.torch as rt  # noqa: E402
import reference as ref  # noqa: E402
from cuda_graph_helpers import assert_replay_matches_eager, capture  # noqa: E402
from test_cuda import assert_reduce_overhead_matches_default  # noqa: E402

Y_TOL, GRAD_TOL = 1e-2, 2e-2  # test_cuda.py's (bf16)
H, F, E, K, T = 64, 32, 8, 2, 48
TIMEOUT_S = 60.0  # a process that fails before a collective leaves the others this long at their barrier


def norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert a.shape == b.shape, f"shape {list(a.shape)} != {list(b.shape)}"
    nb = b.norm().item()
    return (a - b).norm().item() / nb if nb > 0 else (a - b).norm().item()


def assert_close(a, b, tol: float, what: str) -> None:
    assert torch.isfinite(a.detach().float()).all(), f"{what}: non-finite values"
    e = norm_rel(a, b)
    assert e <= tol, f"{what}: ||a-b||/||b|| = {e:.3g} > {tol:g}"


def all_inputs(W: int, n: int, kind: str, seed: int):
    """Every rank's x [W, n, H], ids, gates [W, n, K] and all experts' w1 [E, H, 2F], w2 [E, F, H] (CPU, one seed:
    every process makes the same; reference.draw_inputs, as test_cuda.py's), and dy [W, n, H] drawn after them."""
    g = torch.Generator().manual_seed(seed)
    x, ids, gates, w1, w2 = ref.draw_inputs(W, n, H, F, E, K, kind, g)
    return x, ids, gates, w1, w2, torch.randn(W, n, H, generator=g).bfloat16()


def mine(layer: rt.Layer, r: int, dev, x, ids, gates, w1, w2, dy):
    """This rank's slice, on its GPU: its tokens [1, n, ...] and its experts' weights."""
    e = layer.local_experts
    return [t.to(dev).contiguous() for t in (x[r:r + 1], ids[r:r + 1], gates[r:r + 1], w1[e.start:e.stop],
                                               w2[e.start:e.stop], dy[r:r + 1])]


def step(layer, x, ids, gates, w1, w2, dy):
    """y and the gradients of x, gates, w1, w2 for dy (torch.autograd.grad: nothing accumulates)."""
    y = rt.moe(layer, x, ids, gates, w1, w2)
    return (y,) + torch.autograd.grad(y, (x, gates, w1, w2), dy)


def eager_matches_reference(W: int, r: int, dev, group) -> None:
    for kind, C, n, seed in (("uniform", 0.0, 32, 1), ("zipf", 0.6, 24, 2)):
        layer = rt.Layer(H, F, E, K, T, world_size=W, backend="cuda", process_group=group, capacity_factor=C,
                         expert_compute="cutlass", barrier_timeout_s=TIMEOUT_S)
        assert layer.num_local_ranks == 1 and layer.device == dev, (layer.num_local_ranks, layer.device)
        full = all_inputs(W, n, kind, seed)
        x, ids, gates, w1, w2, dy = mine(layer, r, dev, *full)
        leaves = [t.clone().requires_grad_(True) for t in (x, gates, w1, w2)]
        got = step(layer, leaves[0], ids, leaves[1], leaves[2], leaves[3], dy)
        assert layer.live_contexts == 0
        fx, fids, fgates, fw1, fw2, fdy = full
        rl = [t.double().requires_grad_(True) for t in (fx, fgates, fw1, fw2)]
        y_ref, acc = ref.moe_layer(rl[0], fids, rl[1], rl[2], rl[3], C, T)
        y_ref.backward(fdy.double())
        assert bool((~acc).any()) == (C > 0), f"{kind}: drops expected {C > 0}"
        e = layer.local_experts
        want = [y_ref[r:r + 1], rl[0].grad[r:r + 1], rl[1].grad[r:r + 1], rl[2].grad[e.start:e.stop],
                rl[3].grad[e.start:e.stop]]
        for name, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), got, want):
            assert_close(a, b, Y_TOL if name == "y" else GRAD_TOL, f"{kind}: {name}")
        layer.close()


def capture_replays_like_eager(W: int, r: int, dev, group) -> None:
    n = 40
    layer = rt.Layer(H, F, E, K, T, world_size=W, backend="cuda", process_group=group, expert_compute="cutlass",
                     barrier_timeout_s=TIMEOUT_S)
    assert layer.capturable, "one rank a process, CUTLASS, no balancing: the capturable ops"
    x0, ids0, g0, w1, w2, dy0 = mine(layer, r, dev, *all_inputs(W, n, "uniform", 3))
    w1, w2 = w1.float().requires_grad_(True), w2.float().requires_grad_(True)  # fp32 masters, cast in the ops
    x_s, ids_s, g_s, dy_s = x0.clone().requires_grad_(True), ids0.clone(), g0.clone().requires_grad_(True), dy0.clone()

    def no_context_left():
        assert layer.live_contexts == 0 and layer.pinned_contexts == 0

    graph, outs_s = capture(lambda: step(layer, x_s, ids_s, g_s, w1, w2, dy_s), after_warmups=no_context_left)
    assert layer.pinned_contexts == 1 and layer.live_contexts == 0
    for seed in (4, 5, 6):
        x, ids, gates, _, _, dy = mine(layer, r, dev, *all_inputs(W, n, "zipf" if seed == 5 else "uniform", seed))
        assert_replay_matches_eager(
            graph, outs_s, (x_s, ids_s, g_s, dy_s), (x, ids, gates, dy),
            lambda: step(layer, x.clone().requires_grad_(True), ids, gates.clone().requires_grad_(True), w1, w2, dy),
            f"replay {seed}")
    assert layer.live_contexts == 0 and layer.pinned_contexts == 1
    layer.check_errors()  # the replays' barriers recorded no failure
    del graph
    torch.cuda.synchronize()
    layer.close()


def reduce_overhead_records_rdep_ops(W: int, r: int, dev, group) -> None:
    import torch._inductor.config as inductor_config

    args = dict(max_tokens=32, world_size=W, backend="cuda", process_group=group, shared_ffn=16, aux_loss_coeff=1e-2,
                seed=5, init_std=0.1, expert_compute="cutlass", dtype=torch.float32, barrier_timeout_s=TIMEOUT_S)
    mods = [rt.MoE(64, 32, 8, 2, **args) for _ in range(2)]
    assert mods[1].layer.capturable
    torch._dynamo.reset()
    patch = {"graph_partition": True} if hasattr(inductor_config, "graph_partition") else {}
    with inductor_config.patch(**patch):
        assert_reduce_overhead_matches_default(mods, 4, (1, 32, 64), device=dev, seed=11 + r)
    assert mods[1].layer.pinned_contexts >= 1, "reduce-overhead did not record rdep's ops in a CUDA graph"
    assert mods[0].layer.live_contexts == 0 and mods[0].layer.pinned_contexts == 0
    torch._dynamo.reset()


CHECKS = (eager_matches_reference, capture_replays_like_eager, reduce_overhead_records_rdep_ops)


def main() -> int:
    """Runs the checks in order and stops at the first failure: the exception ends this process with a nonzero code and
    torchrun then stops the others (a process that went on would meet its peers' collectives out of step)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
    local = int(os.environ["LOCAL_RANK"])
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    W, r = dist.get_world_size(), dist.get_rank()
    for check in CHECKS:
        try:
            check(W, r, dev, dist.group.WORLD)
        except BaseException:
            print(f"rank {r}: {check.__name__} FAILED\n{traceback.format_exc()}", flush=True)
            raise
        print(f"rank {r}: {check.__name__} passed", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
