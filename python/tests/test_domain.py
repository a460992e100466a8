"""rdep.torch.Domain (host backend, CPU tensors): balanced MoE modules made on one shared domain, their
forwards and backwards interleaved (A fwd, B fwd, B bwd, C fwd, A bwd, C bwd), give bitwise the outputs
and every gradient of the same modules each on a domain of its own, while the shared domain holds one set
of replica slots (Domain.memory counts them once); the domain and its modules destroyed in any order;
arguments that contradict the domain refused naming the argument (here and in the C library). A CUDA
variant (ranks sharing GPU 0) skips without a GPU.
"""

from __future__ import annotations

import copy
import ctypes
import gc

import pytest
import torch

import rdep
import rdep._capi as capi
import rdep.torch as rt

W, H, FF, E, K, T = 4, 16, 8, 16, 4, 24

# Three balanced modules: different balancers, slot use and chunk relays (relay_above=1), one slot size.
MODULES = [dict(balance="ultraep", relay_above=4, seed=3), dict(balance="eplb-exact", relay_above=4, seed=4),
           dict(balance="ultraep", relay_above=1, seed=5)]


def make(domain=None, *, balance, relay_above, seed, device=None, **kw):
    return rt.MoE(H, FF, E, K, max_tokens=T, world_size=None if domain is not None else W, seed=seed, init_std=0.3,
                  expert_bias=True, balance=balance, balance_slots=2, relay_above=relay_above, domain=domain,
                  device=device, **kw)


def skew(m):
    with torch.no_grad():  # the first experts win most selections: their owners are hot, replicas are made
        m.router.expert_bias.copy_(torch.linspace(0.5, 0.0, m.num_experts, device=m.router.expert_bias.device))


def inputs(i, device=None):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(W, T, H, generator=g)
    dy = torch.randn(W, T, H, generator=g)
    return x.to(device), dy.to(device)


def forward(m, x):
    x = x.clone().requires_grad_(True)
    out = m(x)
    return x, out


def backward(m, x, out, dy):
    (out.y * dy).sum().backward()
    return (out.y.detach(), x.grad, m.w1.grad, m.w2.grad, m.router.weight.grad)


NAMES = ("y", "dx", "dw1", "dw2", "drouter")


def run_alone(m, i, device=None):
    x, dy = inputs(i, device)
    xg, out = forward(m, x.to(m.w1.dtype))
    return backward(m, xg, out, dy.to(m.w1.dtype))


def run_interleaved(mods, device=None):
    """A fwd, B fwd, B bwd, C fwd, A bwd, C bwd: B and C overwrite the shared slots between A's forward and
    backward, C's forward follows B's slot-gradient reduction, A's backward runs between C's calls."""
    data = [inputs(i, device) for i in range(len(mods))]
    fwd, res = {}, {}
    for i, is_backward in ((0, False), (1, False), (1, True), (2, False), (0, True), (2, True)):
        m, (x, dy) = mods[i], data[i]
        if is_backward:
            res[i] = backward(m, *fwd.pop(i), dy.to(m.w1.dtype))
        else:
            fwd[i] = forward(m, x.to(m.w1.dtype))
    return [res[i] for i in range(len(mods))]


def test_balanced_modules_on_one_domain_interleaved_equal_each_on_its_own_domain():
    own = [make(**kw) for kw in MODULES]
    domain = rt.Domain(W, backend="host")
    shared = [make(domain, **kw) for kw in MODULES]
    for a, b in zip(own, shared):
        b.load_state_dict(a.state_dict())
        skew(a)
        skew(b)
        assert b.layer.domain is domain and a.layer.domain is not domain
    expected = [run_alone(m, i) for i, m in enumerate(own)]
    got = run_interleaved(shared)
    for i, (e, g) in enumerate(zip(expected, got)):
        for name, u, v in zip(NAMES, e, g):
            assert torch.equal(u, v), f"module {i} ({MODULES[i]['balance']}): {name} differs on the shared domain"

    # One set of slots on the shared domain; each own domain holds a set.
    slots = shared[0].layer.replica_slot_bytes()
    assert slots > 0 and all(m.layer.replica_slot_bytes() == slots for m in own + shared)
    mem = domain.memory()
    assert mem["shared_bytes_per_rank"] == slots
    own_mem = [m.layer.domain.memory() for m in own]
    assert all(o["shared_bytes_per_rank"] == slots for o in own_mem)
    assert mem["symmetric_bytes_per_rank"] == sum(o["symmetric_bytes_per_rank"] for o in own_mem) - 2 * slots
    assert domain.num_layers == 3


def test_a_second_slot_size_and_an_unbalanced_module_on_the_domain():
    domain = rt.Domain(W)
    a = make(domain, **MODULES[0])
    b = rt.MoE(H, FF, E, K, max_tokens=T, seed=7, balance="ultraep", balance_slots=3, domain=domain)
    off = rt.MoE(H, FF, E, K, max_tokens=T, seed=8, domain=domain)
    assert off.layer.replica_slot_bytes() == 0
    assert all(m.layer.shared_row_bytes() == 0 for m in (a, b, off))  # the host backend shares no output rows
    assert b.layer.replica_slot_bytes() == a.layer.replica_slot_bytes() // 2 * 3
    assert domain.memory()["shared_bytes_per_rank"] == a.layer.replica_slot_bytes() + b.layer.replica_slot_bytes()
    # The unbalanced module on the shared domain equals itself on its own domain.
    alone = rt.MoE(H, FF, E, K, max_tokens=T, seed=8, world_size=W)
    for u, v in zip(run_alone(alone, 0), run_alone(off, 0)):
        assert torch.equal(u, v)
    del a
    gc.collect()
    assert domain.memory()["shared_bytes_per_rank"] == b.layer.replica_slot_bytes()
    del b
    gc.collect()
    assert domain.memory()["shared_bytes_per_rank"] == 0 and domain.num_layers == 1


@pytest.mark.parametrize("order", ["domain_first", "modules_first", "mixed"])
def test_domain_and_modules_destroyed_in_any_order(order):
    domain = rt.Domain(W)
    mods = [make(domain, **kw) for kw in MODULES]
    if order == "domain_first":
        domain.close()
        with pytest.raises(ValueError, match="^domain: it was closed"):
            make(domain, **MODULES[0])
        del domain
        gc.collect()
        for i, m in enumerate(mods):  # the modules keep the C domain alive and keep working
            run_alone(m, i)
        del mods
    elif order == "modules_first":
        del mods
        gc.collect()
        assert domain.num_layers == 0
        assert domain.memory()["shared_bytes_per_rank"] == 0
        del domain
    else:
        # A forward in flight while the domain object and the other modules go: its backward still runs
        # (the layer holds the domain, and the slots), and equals the module alone.
        x, dy = inputs(0)
        xg, out = forward(mods[0], x)
        del domain
        del mods[1:]
        gc.collect()
        got = backward(mods[0], xg, out, dy)
        alone = make(**MODULES[0])
        alone.load_state_dict(mods[0].state_dict())
        for name, u, v in zip(NAMES, run_alone(alone, 0), got):
            assert torch.equal(u, v), name
        # A graph that outlives its module: its context keeps the C layer (and the domain) until it goes.
        xg, out = forward(mods[0], x)
        del mods
        gc.collect()
        del out, xg
    gc.collect()


def test_a_modules_own_domain_can_be_shared():
    first = make(**MODULES[0])
    second = make(first.layer.domain, **MODULES[1])
    assert first.layer.domain.num_layers == 2
    assert first.layer.domain.memory()["shared_bytes_per_rank"] == first.layer.replica_slot_bytes()
    assert copy.deepcopy(second).layer.domain is first.layer.domain
    assert "host domain, W=4" in first.layer.domain.describe() and "W=4" in repr(first.layer.domain)


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(world_size=2), ValueError, r"^world_size: 2 differs from the domain's world_size=4"),
    (dict(backend="cuda"), ValueError, r"^backend: 'cuda' differs from the domain's backend='host'"),
    (dict(backend="tpu"), ValueError, r"^backend: expected one of"),
    (dict(device="cuda"), ValueError, r"^device: cuda differs from the domain's device=cpu"),
    (dict(num_gpus=2), ValueError, r"^num_gpus: 2 differs from the domain's num_gpus=0"),
    (dict(barrier_timeout_s=5.0), ValueError, r"^barrier_timeout_s: 5.0 differs from the domain's barrier_timeout_s=7"),
    (dict(process_group=object()), ValueError, r"^process_group: differs from the domain's"),
    (dict(domain="host"), TypeError, r"^domain: expected an rdep.torch.Domain, got str"),
])
def test_arguments_that_contradict_the_domain_name_the_argument(kwargs, exc, pattern):
    domain = rt.Domain(4, barrier_timeout_s=7.0)
    args = dict(hidden=8, ffn=8, num_experts=4, topk=2, max_tokens=8, domain=domain)
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        rt.Layer(**args)
    # The same placement given explicitly is accepted.
    rt.Layer(8, 8, 4, 2, 8, domain=domain, world_size=4, backend="host", device="cpu", barrier_timeout_s=7.0)


def test_the_c_library_refuses_a_layer_spec_that_does_not_match_its_domain():
    domain = rt.Domain(4)
    spec = capi.LayerSpec()
    spec.struct_size = ctypes.sizeof(capi.LayerSpec)
    spec.backend, spec.world_size = capi.BACKEND_HOST, 2
    spec.tokens, spec.hidden, spec.ffn, spec.experts, spec.topk = 8, 8, 8, 4, 2
    out = capi.LayerPtr()
    code = capi.lib().rdep_layer_create_on(domain._live_ptr(), ctypes.byref(spec), ctypes.byref(out))
    with pytest.raises(rdep.InvalidArgumentError, match=r"world_size 2 differs from the domain's 4"):
        capi.check(code, "rdep_layer_create_on")
    spec.world_size, spec.backend = 4, capi.BACKEND_CUDA_ONE_PROCESS
    code = capi.lib().rdep_layer_create_on(domain._live_ptr(), ctypes.byref(spec), ctypes.byref(out))
    with pytest.raises(rdep.InvalidArgumentError, match=r"backend 1 \(cuda, one process\) differs from the domain's 0 \(host\)"):
        capi.check(code, "rdep_layer_create_on")
    assert domain.num_layers == 0


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(world_size=0), ValueError, r"^world_size: expected a positive int"),
    (dict(backend="tpu"), ValueError, r"^backend: expected one of"),
    (dict(backend="host", device="cuda"), ValueError, r"^device: the host backend runs on cpu tensors"),
    (dict(barrier_timeout_s=float("nan")), rdep.InvalidArgumentError, r"domain spec: barrier_timeout_s"),
])
def test_bad_domain_arguments_name_the_argument(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        rt.Domain(**kwargs)


def test_a_domain_cannot_be_pickled():
    import pickle

    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(rt.Domain(2))


# --- CUDA: W = 4 ranks sharing GPU 0 ---------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_cuda_balanced_modules_on_one_domain_interleaved_equal_each_on_its_own_domain():
    if not capi.built_with_cuda() or capi.cuda_device_count() < 1:
        pytest.skip("librdep_capi.so was built without CUDA or sees no device")
    dev = torch.device("cuda", 0)
    kw = [dict(m, dtype=torch.float32) for m in MODULES]  # fp32 master weights: fp32 gradients (balancing)
    own = [make(device=dev, **k) for k in kw]
    domain = rt.Domain(W, backend="cuda", device=dev)
    shared = [make(domain, **k) for k in kw]
    for a, b in zip(own, shared):
        b.load_state_dict(a.state_dict())
        skew(a)
        skew(b)
    expected = [run_alone(m, i, dev) for i, m in enumerate(own)]
    got = run_interleaved(shared, dev)
    # The same kernels on the same rows: expected bitwise; stated here within bf16's tolerance, as the
    # CUDA layer's exactness tests (a replica's gradient is summed in parts, in instance order).
    for i, (e, g) in enumerate(zip(expected, got)):
        for name, u, v in zip(NAMES, e, g):
            u, v = u.double().cpu(), v.double().cpu()
            scale = u.norm().item() or 1.0
            assert (u - v).norm().item() / scale <= 2e-2, f"CUDA module {i}: {name}"
    slots, rows = shared[0].layer.replica_slot_bytes(), shared[0].layer.shared_row_bytes()
    assert all(m.layer.shared_row_bytes() == rows for m in shared)  # one shape: one region of output rows
    assert slots > 0 and rows > 0 and domain.memory()["shared_bytes_per_rank"] == slots + rows
