"""rdep.torch.MoE on the host backend against the plain fp64 reference (reference.py): outputs, losses,
and gradients of x, the router, the experts and the shared experts; W = 1 and W = 4 ranks in one
process, uniform and skewed routing, capacity drops, E not divisible by W, group-limited routing,
sigmoid scores, expert bias. Plus torch.compile (fullgraph, aot_eager) against eager, state_dict, an
optimizer step, the bias update and the deterministic init.

Tolerance (fp32 module vs fp64 reference fed the same parameters): max|a - b| <= 1e-5 * max|b|.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import rdep.torch as rt
import reference as ref
from conftest import assert_rel_close

TOL = 1e-5

CASES = {
    # W = 1: x [B, S, H] flattened; softmax, shared experts, both losses, dropless.
    "W1_softmax_shared_losses": dict(
        W=1, E=8, K=2, T=32, shape=(2, 16), kw=dict(shared_ffn=12, aux_loss_coeff=1e-2, z_loss_coeff=1e-3)),
    # W = 4 ranks (x [4, 2, 5, H]), E = 6 (ranks own 2, 2, 1, 1), skewed by the expert bias, capacity drops,
    # sigmoid scores, group-limited routing, unnormalized scaled gates.
    "W4_E6_sigmoid_groups_bias_drops": dict(
        W=4, E=6, K=2, T=10, shape=(4, 2, 5), capacity_factor=0.6, skew=True, expect_drops=True,
        kw=dict(score_function="sigmoid", num_groups=3, topk_groups=2, normalize_topk=False, scaling_factor=2.5,
                expert_bias=True, aux_loss_coeff=1e-2)),
    # W = 4, uniform, dropless, sequence aux loss, shared experts.
    "W4_E8_uniform_seqaux_shared": dict(
        W=4, E=8, K=3, T=8, shape=(4, 8), kw=dict(shared_ffn=8, seq_aux_loss_coeff=1e-2, seq_length=4,
                                                   z_loss_coeff=1e-3)),
    # W = 2, skewed softmax routing with drops, K = 1.
    "W2_E4_K1_skew_drops": dict(
        W=2, E=4, K=1, T=12, shape=(2, 12), capacity_factor=1.0, skew=True, expect_drops=True,
        kw=dict(expert_bias=True, normalize_topk=False)),
}


def build(case, seed=0):
    m = rt.MoE(16, 8, case["E"], case["K"], max_tokens=case["T"], world_size=case["W"],
               capacity_factor=case.get("capacity_factor", 0.0), seed=seed, init_std=0.3, **case["kw"])
    if case.get("skew"):
        with torch.no_grad():  # expert 0 (and 1) win most selections; gates still come from the scores
            m.router.expert_bias.copy_(torch.linspace(0.6, 0.0, case["E"]))
    return m


@pytest.mark.parametrize("name", list(CASES))
def test_module_matches_reference(name):
    case = CASES[name]
    moe = build(case)
    x = torch.randn(*case["shape"], 16, requires_grad=True)
    out = moe(x)
    assert out.y.shape == x.shape and out.y.dtype == x.dtype
    dy = torch.randn_like(out.y)
    ((out.y * dy).sum() + out.aux_loss + out.z_loss).backward()
    assert moe.layer.live_contexts == 0

    r = ref.ReferenceMoE(moe)
    xr = x.detach().double().requires_grad_(True)
    L = moe.layer.num_local_ranks
    y_ref, aux_ref, z_ref, counts_ref, ids_ref, acc = r(xr.reshape(L, -1, 16))
    ((y_ref.reshape(x.shape) * dy.double()).sum() + aux_ref + z_ref).backward()

    # Same selection (the router is reimplemented plainly in the reference).
    ids = moe.router(x.detach().reshape(L, -1, 16)).experts
    assert torch.equal(ids.long(), ids_ref), "router selection differs from the reference"
    if case.get("expect_drops"):
        assert (~acc).any(), "the case was meant to drop rows"
    else:
        assert acc.all()
    assert torch.equal(out.tokens_per_expert, counts_ref)
    assert_rel_close(out.y, y_ref.reshape(x.shape), TOL, "y")
    assert_rel_close(out.aux_loss, aux_ref, TOL, "aux_loss")
    assert_rel_close(out.z_loss, z_ref, TOL, "z_loss")
    assert_rel_close(x.grad, xr.grad, TOL, "x.grad")
    params = dict(moe.named_parameters())
    for key, p_ref in r.params().items():
        assert params[key].grad is not None, key
        assert_rel_close(params[key].grad, p_ref.grad, TOL, f"{key}.grad")


def test_one_rank_and_four_ranks_agree_when_dropless():
    """The same seed gives the same experts at any W; dropless, W = 4 over x [4, n, H] equals W = 1 over
    the same 4n tokens."""
    m1 = rt.MoE(16, 8, 6, 2, max_tokens=32, world_size=1, seed=7, shared_ffn=8)
    m4 = rt.MoE(16, 8, 6, 2, max_tokens=8, world_size=4, seed=7, shared_ffn=8)
    for (k, a), (_, b) in zip(m1.state_dict().items(), m4.state_dict().items()):
        assert torch.equal(a, b), k
    x = torch.randn(4, 8, 16)
    y1, y4 = m1(x.reshape(32, 16)).y, m4(x).y
    assert_rel_close(y4.reshape(32, 16), y1, 1e-6, "y (W=4 vs W=1)")


def test_compile_fullgraph_matches_eager():
    case = CASES["W4_E6_sigmoid_groups_bias_drops"]
    eager, compiled_src = build(case, seed=3), build(case, seed=3)
    compiled = torch.compile(compiled_src, fullgraph=True, backend="aot_eager")
    x = torch.randn(*case["shape"], 16)
    dy = torch.randn_like(x)
    results = []
    for m in (eager, compiled):
        xi = x.clone().requires_grad_(True)
        out = m(xi)
        ((out.y * dy).sum() + out.aux_loss).backward()
        results.append((out, xi.grad))
    (oe, gxe), (oc, gxc) = results
    torch.testing.assert_close(oc.y, oe.y, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(oc.aux_loss, oe.aux_loss, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(gxc, gxe, rtol=1e-6, atol=1e-7)
    for (k, pe), (_, pc) in zip(eager.named_parameters(), compiled_src.named_parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-6, atol=1e-7, msg=k)
    assert compiled_src.layer.live_contexts == 0
    with torch.no_grad():  # the no-grad trace releases its context inside the call
        compiled(x)
    assert compiled_src.layer.live_contexts == 0
    for n in (3, 4):  # another token count: a recompile with a dynamic n, still one graph
        x2 = torch.randn(4, 2, n, 16, requires_grad=True)
        out = compiled(x2)
        out.y.sum().backward()
        torch.testing.assert_close(out.y, eager(x2.detach()).y, rtol=1e-6, atol=1e-7)
    assert compiled_src.layer.live_contexts == 0


class _Block(torch.nn.Module):
    """A residual MoE block, as a model compiles it one block at a time."""

    def __init__(self, seed):
        super().__init__()
        self.moe = rt.MoE(16, 8, 6, 2, max_tokens=8, world_size=1, seed=seed, init_std=0.3)

    def forward(self, x):
        out = self.moe(torch.nn.functional.layer_norm(x, x.shape[-1:]))
        return x + out.y, out.aux_loss


def test_blocks_compiled_one_at_a_time_share_one_graph():
    """Twelve equal MoE layers each compiled on its own (`block.compile()`, TorchTitan's per-block compile) share
    one compiled graph: the ops take the layer as its handle tensor and the configuration's representative id
    (layer_handles.py), so no layer id is a constant a guard checks. Before, each layer recompiled and the layers
    past dynamo's recompile limit (8) ran eagerly. Forward and gradients equal the eager blocks'."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    blocks = [_Block(seed=i) for i in range(12)]
    eager = copy.deepcopy(blocks)
    for b in blocks:
        b.compile(backend="aot_eager", fullgraph=True)
    x = torch.randn(8, 16)
    results = []
    for model in (blocks, eager):
        h, aux = x.clone().requires_grad_(True), 0.0
        out = h
        for b in model:
            out, a = b(out)
            aux = aux + a
        # each op ran on its own block's layer (the handle), not on the representative all blocks share
        assert [b.moe.layer.live_contexts for b in model] == [1] * len(model)
        (out.square().sum() + aux).backward()
        results.append((out, h.grad))
    frames = counters["stats"]["unique_graphs"]
    assert frames <= 2, f"{frames} graphs compiled for 12 equal blocks (recompiles: {dict(counters['recompiles'])})"
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-6, atol=1e-6)
    for b, e in zip(blocks, eager):
        assert b.moe.layer.live_contexts == 0
        for (k, pc), (_, pe) in zip(b.named_parameters(), e.named_parameters()):
            torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-6, atol=1e-6, msg=k)
    reps = {b.moe.layer.rep for b in blocks}
    assert reps == {blocks[0].moe.layer.rep} and len({b.moe.layer.id for b in blocks}) == 12


def test_state_dict_round_trip():
    case = CASES["W4_E8_uniform_seqaux_shared"]
    a, b = build(case, seed=1), build(case, seed=2)
    x = torch.randn(*case["shape"], 16)
    assert not torch.equal(a(x).y, b(x).y)
    sd = a.state_dict()
    assert {"w1", "w2", "router.weight", "shared.w1", "shared.w2"} <= set(sd)
    assert sd["w1"].shape == (8, 16, 16) and sd["w2"].shape == (8, 8, 16)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    assert torch.equal(a(x).y, b(x).y)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_optimizer_step_changes_expert_weights(opt):
    case = CASES["W2_E4_K1_skew_drops"]
    m = build(case)
    before = copy.deepcopy(m.state_dict())
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) if opt == "sgd" else torch.optim.AdamW(m.parameters(), lr=1e-2)
    x = torch.randn(*case["shape"], 16)
    for _ in range(2):
        o.zero_grad()
        out = m(x)
        out.y.square().mean().backward()
        o.step()
    assert m.w1.grad is not None and m.w1.grad.abs().sum() > 0
    after = m.state_dict()
    for key in ("w1", "w2", "router.weight"):
        assert not torch.equal(before[key], after[key]), key
    assert torch.equal(before["router.expert_bias"], after["router.expert_bias"])  # a buffer, not trained


def test_expert_bias_update():
    m = rt.MoE(16, 8, 4, 1, max_tokens=16, expert_bias=True)
    load = torch.tensor([10, 2, 2, 2])
    delta = m.update_expert_bias(load, rate=0.01)
    torch.testing.assert_close(delta, torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    torch.testing.assert_close(m.router.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    with pytest.raises(ValueError, match="tokens_per_expert"):
        m.update_expert_bias(torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="expert_bias=False"):
        rt.MoE(16, 8, 4, 1, max_tokens=16).update_expert_bias(load)


def test_expert_bias_balances_skewed_load():
    """Bias updates move load off the favoured expert (selection only: gates still come from the scores)."""
    m = rt.MoE(16, 8, 8, 2, max_tokens=256, expert_bias=True, seed=2, init_std=0.3)
    x = torch.randn(256, 16)
    x[:, 0] = 1.0
    with torch.no_grad():
        m.router.weight[0, 0] = 3.0  # every token leans to expert 0
    first = m(x).tokens_per_expert
    for _ in range(40):
        m.update_expert_bias(m(x).tokens_per_expert, rate=0.01)
    last = m(x).tokens_per_expert
    assert first[0] > 200 and last[0] < 120, (first, last)
    assert last.max() - last.min() < (first.max() - first.min()) / 2


def test_deterministic_init():
    a = rt.MoE(16, 8, 6, 2, max_tokens=8, world_size=2, seed=11, shared_ffn=4)
    b = rt.MoE(16, 8, 6, 2, max_tokens=8, world_size=2, seed=11, shared_ffn=4)
    c = rt.MoE(16, 8, 6, 2, max_tokens=8, world_size=2, seed=12, shared_ffn=4)
    for (k, pa), (_, pb), (_, pc) in zip(a.state_dict().items(), b.state_dict().items(), c.state_dict().items()):
        assert torch.equal(pa, pb), k
        assert not torch.equal(pa, pc), k


def test_input_layout_errors():
    m = rt.MoE(16, 8, 4, 2, max_tokens=8, world_size=4)
    with pytest.raises(ValueError, match=r"^x: this process drives L=4 ranks, so x must be \[L=4, \.\.\., H=16\]"):
        m(torch.randn(3, 8, 16))
    with pytest.raises(ValueError, match=r"^x: expected the last dimension to be H=16"):
        m(torch.randn(4, 8, 15))
    with pytest.raises(ValueError, match=r"^x: 9 tokens per rank exceed the layer's max_tokens T=8"):
        m(torch.randn(4, 9, 16))
    with pytest.raises(ValueError, match="score_function"):
        rt.MoE(16, 8, 4, 2, max_tokens=8, score_function="relu")
    with pytest.raises(ValueError, match="num_groups"):
        rt.MoE(16, 8, 6, 2, max_tokens=8, num_groups=4)
    with pytest.raises(ValueError, match="topk"):
        rt.MoE(16, 8, 6, 4, max_tokens=8, num_groups=3, topk_groups=1)


def test_float64_input_runs_in_fp32_and_returns_float64():
    m = rt.MoE(16, 8, 4, 2, max_tokens=8)
    x = torch.randn(8, 16, dtype=torch.float64)
    y = m(x).y
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, m(x.float()).y.double())


def test_host_module_refuses_bf16_weights():
    m = rt.MoE(16, 8, 4, 2, max_tokens=8).to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"^w1: expected dtype torch.float32 on the host backend, got torch.bfloat16"):
        m(torch.randn(8, 16))


def test_deepcopy_shares_the_layer_and_computes_the_same():
    m = build(CASES["W4_E8_uniform_seqaux_shared"], seed=4)
    c = copy.deepcopy(m)
    assert c.layer is m.layer and c.w1 is not m.w1
    x = torch.randn(4, 8, 16)
    assert torch.equal(c(x).y, m(x).y)
    with pytest.raises(TypeError, match="cannot be pickled"):
        torch.save(m, io.BytesIO())


def test_expert_and_dense_parameters():
    m = build(CASES["W1_softmax_shared_losses"])
    assert [p.shape for p in m.expert_parameters()] == [m.w1.shape, m.w2.shape]
    dense = m.dense_parameters()
    assert {id(p) for p in dense} | {id(m.w1), id(m.w2)} == {id(p) for p in m.parameters()}
    assert len(dense) == 3  # router.weight, shared.w1, shared.w2


def test_router_stays_fp32_under_autocast():
    """Inside torch.autocast (bf16), the router's logits, scores and gates are still fp32 and equal to
    the same router's outside autocast."""
    torch.manual_seed(3)
    router = rt.Router(32, 8, 2, score_function="softmax")
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5)
    x = torch.randn(64, 32)
    plain = router(x)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        cast = router(x)
    assert cast.logits.dtype == torch.float32 and cast.gates.dtype == torch.float32
    assert torch.equal(cast.logits, plain.logits)
    assert torch.equal(cast.experts, plain.experts)
    assert torch.equal(cast.gates, plain.gates)
