"""rdep.torch.MoE with balancing and nodes (host backend): the same module with balance='ultraep' gives
bitwise the same y as without (rows computed on replicas are the same rows) and gradients within fp32
rounding; nodes=N (two-phase exchange) agrees with the one-domain module; with max_nodes=M the router
keeps every token on at most M nodes, matching a plain PyTorch node-limited top-K written here, and the
module still matches the module without nodes on the same routing; bad options name the argument.
"""

from __future__ import annotations

import re

import pytest
import torch

import rdep
import rdep.torch as rt
from conftest import assert_rel_close


def make(W=4, E=16, K=4, T=24, **kw):
    return rt.MoE(16, 8, E, K, max_tokens=T, world_size=W, seed=3, init_std=0.3, expert_bias=True, **kw)


def skew(m):
    with torch.no_grad():  # the first experts win most selections: their owners are hot
        m.router.expert_bias.copy_(torch.linspace(0.5, 0.0, m.num_experts))


def run(m, x):
    x = x.clone().requires_grad_(True)
    out = m(x)
    (out.y.square().sum() + out.aux_loss).backward()
    return out.y.detach(), x.grad, m.w1.grad, m.w2.grad, m.router.weight.grad


@pytest.mark.parametrize("balance,relay_above", [("ultraep", 4), ("ultraep", 1), ("eplb-exact", 4), ("eplb", 4)])
def test_balanced_module_equals_unbalanced(balance, relay_above):
    torch.manual_seed(0)
    x = torch.randn(4, 24, 16)
    plain, bal = make(), make(balance=balance, balance_slots=2, relay_above=relay_above)
    bal.load_state_dict(plain.state_dict())
    skew(plain)
    skew(bal)
    a, b = run(plain, x), run(bal, x)
    assert torch.equal(a[0], b[0]), "y must be bitwise equal with balancing"
    for name, u, v in zip(("dx", "dw1", "dw2", "drouter"), a[1:], b[1:]):
        assert_rel_close(v, u, 1e-5, name)


def test_gain_gate_module_runs_and_equals_unbalanced():
    # balance_min_gain travels through the C API (version 9): a gate no plan meets leaves every row on its
    # owner, so even the expert gradients equal the unbalanced module's bit for bit.
    torch.manual_seed(0)
    x = torch.randn(4, 24, 16)
    plain, gated = make(), make(balance="ultraep", balance_slots=2, balance_min_gain=10**9)
    gated.load_state_dict(plain.state_dict())
    skew(plain)
    skew(gated)
    assert "min_gain=1000000000" in gated.layer.describe()  # the field reached the C++ layer
    a, b = run(plain, x), run(gated, x)
    for name, u, v in zip(("y", "dx", "dw1", "dw2", "drouter"), a, b):
        assert torch.equal(u, v), name


def node_limited_topk(sel, node_of_expert, max_nodes, K):
    """Plain node-limited top-K: per token, the max_nodes nodes with the largest top-2 sum of sel."""
    N = max(node_of_expert) + 1
    node = torch.tensor(node_of_expert)
    out = []
    for row in sel.reshape(-1, sel.shape[-1]):
        score = torch.stack([row[node == n].topk(min(2, int((node == n).sum()))).values.sum() for n in range(N)])
        kept = score.topk(max_nodes).indices
        masked = torch.where(torch.isin(node, kept), row, torch.tensor(float("-inf")))
        out.append(masked.topk(K).indices)
    return torch.stack(out).reshape(*sel.shape[:-1], K)


@pytest.mark.parametrize("nodes,max_nodes", [(2, 0), (2, 1), (4, 2), (4, 1)])
def test_nodes_agree_with_one_domain(nodes, max_nodes):
    torch.manual_seed(1)
    x = torch.randn(4, 24, 16)
    two = make(nodes=nodes, max_nodes=max_nodes)
    skew(two)
    r = two.router(x)
    node_of_expert = two.layer.node_of_expert()
    if max_nodes:
        per_token = [len({node_of_expert[e] for e in row.tolist()}) for row in r.experts.reshape(-1, 4)]
        assert max(per_token) <= max_nodes
        sel = r.logits.softmax(-1) + two.router.expert_bias
        assert torch.equal(r.experts.long(), node_limited_topk(sel, node_of_expert, max_nodes, 4))
    # The one-domain module with the same router (node-limited too) and weights.
    one = make()
    one.router = two.router
    one.load_state_dict(two.state_dict())
    a, b = run(one, x), run(two, x)
    for name, u, v in zip(("y", "dx", "dw1", "dw2", "drouter"), a, b):
        assert_rel_close(v, u, 1e-5, name)


def test_bad_options_name_the_argument():
    with pytest.raises(ValueError, match="balance: expected one of"):
        make(balance="greedy")
    with pytest.raises(ValueError, match="balance_slots: expected an int >= 0"):
        make(balance="ultraep", balance_slots=-1)
    with pytest.raises(ValueError, match="balance_min_gain: expected an int >= 0"):
        make(balance="ultraep", balance_min_gain=-1)
    with pytest.raises(ValueError, match="balance_min_gain: UltraEP's gain gate needs balance='ultraep'"):
        make(balance="eplb", balance_min_gain=16)
    with pytest.raises(ValueError, match="balance_min_gain: expected an int below 2\\*\\*63"):
        make(balance="ultraep", balance_min_gain=2**63)
    with pytest.raises(ValueError, match="max_nodes: expected 0 \\(no cap\\) or at most nodes=2"):
        make(nodes=2, max_nodes=3)
    with pytest.raises(rdep.InvalidArgumentError, match="N=3 must be >= 1 and divide W=4"):
        make(nodes=3)
    with pytest.raises(rdep.InvalidArgumentError, match="N_slot"):
        make(balance="ultraep", balance_slots=17)
    with pytest.raises(ValueError, match="topk: 4 exceeds the 2 experts of the max_nodes=1 smallest nodes"):
        make(E=4, K=4, nodes=2, max_nodes=1)


@pytest.mark.parametrize("kw", [dict(), dict(capacity_factor=0.75), dict(balance="ultraep", balance_slots=2),
                                dict(segment_tokens=10)])
def test_owner_reduce_module_equals_the_per_slot_return(kw):
    """owner_reduce=True: each owner sums a token's rows before they cross back. Against the module
    without it (same weights, routing, inputs), with capacity drops, balancing or several segments: y,
    dx and every gradient within fp32 reassociation (the loss's dy depends on y, so the gradients inherit
    y's last-bit differences; the layer-level bitwise properties are checked in host_owner_reduce_test.cc)."""
    torch.manual_seed(5)
    x = torch.randn(4, 24, 16)
    plain, red = make(**kw), make(owner_reduce=True, **kw)
    red.load_state_dict(plain.state_dict())
    skew(plain)
    skew(red)
    assert red.layer.owner_reduce and not plain.layer.owner_reduce
    a, b = run(plain, x), run(red, x)
    for name, u, v in zip(("y", "dx", "dw1", "dw2", "drouter"), a, b):
        assert_rel_close(v, u, 1e-5, name)
    assert not torch.equal(a[0], b[0]), "y reassociated per owner: some element should differ in its last bits"


def test_transport_sms_is_validated_and_kept():
    """transport_sms (the CUDA SM budget of the peer-storing kernels): range-checked with the argument
    named; the host backend accepts and ignores it (same results as without)."""
    for bad in (-1, 1025):
        with pytest.raises(ValueError, match=r"^transport_sms: expected an int in \[0, 1024\]"):
            make(transport_sms=bad)
    for bad in (2.0, True):
        with pytest.raises(TypeError, match=r"^transport_sms: expected an int, got"):
            make(transport_sms=bad)
    with pytest.raises(ValueError, match=r"transport_sms: not with nodes"):
        make(transport_sms=2, nodes=2)
    torch.manual_seed(3)
    x = torch.randn(4, 24, 16)
    plain, budget = make(), make(transport_sms=4)
    budget.load_state_dict(plain.state_dict())
    assert budget.layer.transport_sms == 4 and plain.layer.transport_sms == 0
    for name, u, v in zip(("y", "dx", "dw1", "dw2", "drouter"), run(plain, x), run(budget, x)):
        assert torch.equal(u, v), name


def test_owner_reduce_bad_arguments_are_named():
    with pytest.raises(TypeError, match="^owner_reduce: expected a bool"):
        make(owner_reduce=1)
    with pytest.raises(ValueError, match=r"^owner_reduce: with nodes=2"):
        make(owner_reduce=True, nodes=2)


def test_stash_rows_bad_arguments_are_named():
    with pytest.raises(TypeError, match="^stash_rows: expected an int"):
        make(stash_rows=1.5)
    with pytest.raises(ValueError, match=r"^stash_rows: expected an int >= 0"):
        make(stash_rows=-1, expert_compute="cutlass")
    with pytest.raises(ValueError, match=r"^stash_rows: the paged stash needs the sync-free layer: expert_compute='cutlass'"):
        make(stash_rows=4096)  # the host backend: 'auto' is cublaslt there
    with pytest.raises(ValueError, match=r"^stash_rows: .*balance='ultraep'"):
        make(stash_rows=4096, expert_compute="cutlass", balance="ultraep", balance_slots=1)


@pytest.mark.parametrize("option", ["overlap_segments", "gate_in_expert"])
def test_sync_free_options_bad_arguments_are_named(option):
    with pytest.raises(TypeError, match=f"^{option}: expected a bool"):
        make(**{option: 1})
    bad_settings = [(dict(), "expert_compute='cublaslt'"),
                    (dict(expert_compute="cutlass", balance="ultraep", balance_slots=1), "balance='ultraep'"),
                    (dict(expert_compute="cutlass", nodes=2), "nodes=2")]
    if option == "overlap_segments":  # the pipeline needs the per-slot return; the gate runs with owner_reduce too
        bad_settings.append((dict(expert_compute="cutlass", owner_reduce=True), "owner_reduce=True"))
    else:
        assert make(expert_compute="cutlass", owner_reduce=True, gate_in_expert=True).layer.gate_in_expert is True
    for bad, named in bad_settings:
        with pytest.raises(ValueError, match=f"^{option}: the .* needs the sync-free layer.*" + re.escape(named)):
            make(**{option: True}, **bad)
    assert getattr(make(expert_compute="cutlass", **{option: True}).layer, option) is True


def test_gate_in_expert_defaults_to_off_on_the_host_backend():
    """gate_in_expert=None (the default) is on only where the CUDA layer can run it; the host backend weights at
    the combine, so it resolves to False there; an explicit choice is kept as given."""
    assert make(expert_compute="cutlass").layer.gate_in_expert is False
    assert make(expert_compute="cutlass", gate_in_expert=False).layer.gate_in_expert is False
    assert make(expert_compute="cutlass", gate_in_expert=True).layer.gate_in_expert is True


@pytest.mark.parametrize("option", ["overlap_segments", "gate_in_expert"])
def test_sync_free_options_are_ignored_by_the_host_backend(option):
    """The host backend runs its segments in sequence and weights the rows at the combine; overlap_segments
    (CUDA's pipeline) and gate_in_expert (CUDA's gate before W2) change nothing there."""
    plain = make(expert_compute="cutlass", segment_tokens=24)
    piped = make(expert_compute="cutlass", segment_tokens=24, **{option: True})
    piped.load_state_dict(plain.state_dict())
    x = torch.randn(4, 24, 16, generator=torch.Generator().manual_seed(2))
    outs = [run(m, x) for m in (plain, piped)]
    for a, b in zip(outs[1], outs[0]):
        assert torch.equal(a, b)


def test_keep_weight_casts_is_a_bool_off_by_default():
    with pytest.raises(TypeError, match="^keep_weight_casts: expected a bool"):
        make(keep_weight_casts=1)
    assert make().layer.keep_weight_casts is False
    assert make(keep_weight_casts=True).layer.keep_weight_casts is True


def test_stash_rows_is_ignored_by_the_host_backend():
    """The host backend keeps its rows on the host; stash_rows (CUDA's paged stash) changes nothing there."""
    plain, stashed = make(expert_compute="cutlass"), make(expert_compute="cutlass", stash_rows=4096)
    stashed.load_state_dict(plain.state_dict())
    x = torch.randn(4, 24, 16, generator=torch.Generator().manual_seed(1))
    for m in (plain, stashed):
        m.zero_grad()
    ys = [m(x).y for m in (plain, stashed)]
    assert torch.equal(ys[0], ys[1])
