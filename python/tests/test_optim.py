"""rdep.torch.MasterAdamW against torch.optim.AdamW on fp32 copies of the same parameters and gradients: fresh
random inputs, several steps with a changing learning rate, parameter groups, a gradient multiplier, skipped
parameters, state_dict round trips, and bad input named. On CUDA the kernel also matches the host reference
bitwise (the same fp32 operations in the same order). A last test trains rdep.torch.MoE's bf16 experts with it
against the same module with fp32 master weights under torch.optim.AdamW."""

from __future__ import annotations

import pytest
import torch

import rdep.torch as rt

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device")
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])

# torch's AdamW orders the same fp32 operations differently (addcdiv, the denominator's division): a few ulps
# of the operands: where a sum nearly cancels, of its terms (the update, lr <= 1e-2; the gradient, ~1e-3).
RTOL, ATOL = 2e-6, 1e-8


def _params(shapes, seed: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(device)) for s in shapes]


def _grads(shapes, seed: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * 1e-3).to(torch.bfloat16).to(device) for s in shapes]


def _pair(shapes, device, seed=0, **hyper):
    """(ours over bf16 copies adopting fp32 values, torch's AdamW over fp32 copies): the same starting values."""
    ref = _params(shapes, seed, device)
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    return mine, rt.MasterAdamW(mine, **hyper), ref, torch.optim.AdamW(ref, **hyper)


def _step_both(mine, opt, ref, ref_opt, shapes, seed: int, device) -> None:
    """One step of each optimizer on the same fresh bf16 gradients (fp32 copies of them for torch's)."""
    for p, r, g in zip(mine, ref, _grads(shapes, seed, device)):
        p.grad, r.grad = g.clone(), g.float()
    opt.step()
    ref_opt.step()


def _check_close(mine, opt, ref, ref_opt, what):
    for i, (p, r) in enumerate(zip(mine, ref)):
        st, rst = opt.state[p], ref_opt.state[r]
        torch.testing.assert_close(st["master"], r.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} master {i}: {m}")
        torch.testing.assert_close(st["exp_avg"], rst["exp_avg"], rtol=RTOL, atol=2e-10, msg=lambda m: f"{what} exp_avg {i}: {m}")
        torch.testing.assert_close(st["exp_avg_sq"], rst["exp_avg_sq"], rtol=RTOL, atol=1e-15,
                                   msg=lambda m: f"{what} exp_avg_sq {i}: {m}")
        assert p.dtype == torch.bfloat16 and st["master"].dtype == torch.float32
        assert torch.equal(p.detach(), st["master"].to(torch.bfloat16)), f"{what}: param {i} is not bf16(master)"


@pytest.mark.parametrize("device", DEVICES)
def test_matches_torch_adamw_over_steps(device):
    shapes = [(64, 33), (7,), (3, 5, 128), (1,)]  # odd sizes: the kernel's vector body and its tail
    hyper = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    mine, opt, ref, ref_opt = _pair(shapes, device, **hyper)
    for step in range(4):
        lr = 6e-4 * (step + 1) / 4  # a warmup: the group's lr read at every step
        for o in (opt, ref_opt):
            for g in o.param_groups:
                g["lr"] = lr
        _step_both(mine, opt, ref, ref_opt, shapes, 100 + step, device)
        _check_close(mine, opt, ref, ref_opt, f"step {step + 1}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.9999)])
def test_matches_torch_adamw_with_other_betas(device, betas):
    """torch's default beta2 (1 - beta2 taken in double: 0.001, not 1 - 0.999f) over 20 steps, and a beta1 below 0.5,
    where torch's lerp evaluates the moment from its other end."""
    shapes = [(300,), (17, 5)]
    mine, opt, ref, ref_opt = _pair(shapes, device, seed=4, lr=1e-3, betas=betas, weight_decay=0.01)
    for step in range(20):
        _step_both(mine, opt, ref, ref_opt, shapes, 200 + step, device)
    _check_close(mine, opt, ref, ref_opt, f"betas {betas}, 20 steps")


@pytest.mark.parametrize("device", DEVICES)
def test_groups_multiplier_and_skipped_parameters(device):
    shapes = [(40, 40), (17,), (9, 9)]
    ref = _params(shapes, 3, device)
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    groups = lambda ps: [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0, "lr": 1e-2}]  # noqa: E731
    opt = rt.MasterAdamW(groups(mine), lr=1e-3, betas=(0.8, 0.99))
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-3, betas=(0.8, 0.99))
    mult = torch.tensor(0.25, device=device)
    for step in range(3):
        grads = _grads(shapes, 7 + step, device)
        for i, (p, r, g) in enumerate(zip(mine, ref, grads)):
            skip = step == 1 and i == 1  # no gradient this step: neither moves, its step count waits
            p.grad, r.grad = (None, None) if skip else (g.clone(), g.float() * mult)
        opt.step(grad_multiplier=mult)
        ref_opt.step()
        _check_close(mine, opt, ref, ref_opt, f"step {step + 1}")
    assert opt.state[mine[1]]["step"] == 2 and opt.state[mine[0]]["step"] == 3


@pytest.mark.parametrize("device", DEVICES)
def test_adoption(device):
    p32 = _params([(5, 8)], 1, device)[0]
    values = p32.detach().clone()
    opt = rt.MasterAdamW([p32])
    assert p32.dtype == torch.bfloat16 and torch.equal(p32.detach(), values.to(torch.bfloat16))
    assert torch.equal(opt.state[p32]["master"], values), "fp32 values are the master weights, not rounded"
    p16 = torch.nn.Parameter(values.to(torch.bfloat16))
    opt16 = rt.MasterAdamW([p16])
    assert torch.equal(opt16.state[p16]["master"], p16.detach().float())
    assert "exp_avg" not in opt16.state[p16], "moments are made at the first step"


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trip(device):
    shapes = [(16, 12), (5,)]
    mine, opt, _, _ = _pair(shapes, device, lr=1e-3, weight_decay=0.05)
    for step in range(2):
        for p, g in zip(mine, _grads(shapes, 50 + step, device)):
            p.grad = g
        opt.step()
    sd = opt.state_dict()
    fresh = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16, device=device)) for s in shapes]
    opt2 = rt.MasterAdamW(fresh, lr=1e-3, weight_decay=0.05)
    opt2.load_state_dict(sd)
    for p, q in zip(mine, fresh):
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert opt2.state[q][k].dtype == torch.float32, k
            assert torch.equal(opt2.state[q][k], opt.state[p][k]), k
        assert opt2.state[q]["step"] == 2
        assert torch.equal(q.detach(), p.detach()), "the parameter is written from its master weight"
    grads = _grads(shapes, 60, device)
    for p, q, g in zip(mine, fresh, grads):
        p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    opt2.step()
    for p, q in zip(mine, fresh):
        assert torch.equal(opt2.state[q]["master"], opt.state[p]["master"])


def test_zero_size_duplicates_and_later_groups():
    """A zero-size parameter steps (nothing to move); a parameter listed twice is adopted and updated once; a group
    added after construction is adopted and stepped with its own hyperparameters."""
    ref = _params([(6, 4), (0, 3), (9,)], 21, "cpu")
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    values = mine[0].detach().clone()
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch's own warning
        opt = rt.MasterAdamW([mine[0], mine[1], mine[0]], lr=1e-3)
    assert torch.equal(opt.state[mine[0]]["master"], values), "adopted once: the master is the fp32 values"
    opt.add_param_group({"params": [mine[2]], "lr": 1e-2, "weight_decay": 0.0})
    assert mine[2].dtype == torch.bfloat16
    ref_opt = torch.optim.AdamW([ref[0], ref[1]], lr=1e-3)
    ref_opt.add_param_group({"params": [ref[2]], "lr": 1e-2, "weight_decay": 0.0})
    for step in range(2):
        _step_both(mine, opt, ref, ref_opt, [(6, 4), (0, 3), (9,)], 300 + step, "cpu")
    _check_close(mine, opt, ref, ref_opt, "zero-size, duplicate, later group")
    assert opt.state[mine[0]]["step"] == 2


def test_shared_storage_is_refused_before_anything_is_adopted():
    base = torch.zeros(8)
    ok, tied = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(base)
    view = torch.nn.Parameter(base[2:5])
    with pytest.raises(ValueError, match=r"params\[2\] of group 0: shares storage with another parameter"):
        rt.MasterAdamW([ok, tied, view])
    assert ok.dtype == torch.float32 and tied.dtype == torch.float32, "a refused group adopts nothing"


def test_a_refused_step_changes_nothing():
    a, b = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(7))
    opt = rt.MasterAdamW([a, b], lr=1e-2)
    a.grad = torch.ones(5, dtype=torch.bfloat16)
    b.grad = torch.ones(7, dtype=torch.bfloat16)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[a].items() if isinstance(v, torch.Tensor)}
    b.grad = torch.ones(7, dtype=torch.bfloat16).expand(2, 7)[0]  # fine; then a bad multiplier below
    with pytest.raises(ValueError, match=r"^grad_multiplier"):
        opt.step(grad_multiplier=torch.tensor([0.5, 0.5]))
    b.grad = torch.ones(14, dtype=torch.bfloat16)[::2]  # non-contiguous gradient on the second parameter
    with pytest.raises(ValueError, match=r"params\[1\] of group 0: the gradient must be contiguous"):
        opt.step()
    assert opt.state[a]["step"] == 1 and opt.state[b]["step"] == 1
    for k, v in before.items():
        assert torch.equal(opt.state[a][k], v), k


def test_load_state_dict_checks_shapes_and_keeps_uncovered_masters():
    a, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(6))
    opt = rt.MasterAdamW([a, b], lr=1e-3)
    a.grad = torch.ones(4, 3, dtype=torch.bfloat16)
    opt.step()  # only a has a state beyond its master... and b its master
    sd = opt.state_dict()
    bad = {"state": {0: dict(sd["state"][0], master=torch.zeros(12))}, "param_groups": sd["param_groups"]}
    with pytest.raises(ValueError, match=r"parameter 0's master has shape \[12\], the parameter \[4, 3\]"):
        opt.load_state_dict(bad)
    b_master = opt.state[b]["master"].clone()
    only_a = {"state": {0: sd["state"][0]}, "param_groups": sd["param_groups"]}
    opt.load_state_dict(only_a)
    assert torch.equal(opt.state[b]["master"], b_master), "a parameter the saved state does not cover keeps its master"
    b.grad = torch.ones(6, dtype=torch.bfloat16)
    opt.step()
    assert opt.state[b]["step"] == 1


def test_bad_input_is_named():
    with pytest.raises(TypeError, match=r"params\[0\] of group 0: .*fp32 or bf16.*torch.int64"):
        rt.MasterAdamW([torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"params\[1\] of group 0: must be contiguous"):
        rt.MasterAdamW([torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4, 6).t())])
    with pytest.raises(ValueError, match=r"^lr: must be finite and >= 0"):
        rt.MasterAdamW([torch.nn.Parameter(torch.zeros(3))], lr=-1.0)
    with pytest.raises(ValueError, match=r"^betas\[0\]: must be in \[0, 1\)"):
        rt.MasterAdamW([torch.nn.Parameter(torch.zeros(3))], betas=(1.0, 0.9))
    with pytest.raises(ValueError, match=r"^weight_decay: must be finite"):
        rt.MasterAdamW([{"params": [torch.nn.Parameter(torch.zeros(3))], "weight_decay": float("nan")}])
    p = torch.nn.Parameter(torch.zeros(3))
    opt = rt.MasterAdamW([p])
    p.grad = torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^grad_multiplier: expected a one-element fp32 tensor on cpu"):
        opt.step(grad_multiplier=torch.tensor(0.5, dtype=torch.float64))
    p.data = torch.zeros(3)  # the caller changed the adopted parameter's dtype
    p.grad = torch.ones(3)
    with pytest.raises(TypeError, match=r"params\[0\] of group 0: expected a bf16 parameter and gradient"):
        opt.step()


@needs_cuda
def test_cuda_matches_the_host_reference_bitwise():
    shapes = [(1000, 7), (4099,), (33, 129)]
    cpu = _params(shapes, 5, "cpu")
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    oc, og = rt.MasterAdamW(cpu, lr=3e-4, weight_decay=0.1), rt.MasterAdamW(gpu, lr=3e-4, weight_decay=0.1)
    mult = 0.7
    for step in range(3):
        for p, q, g in zip(cpu, gpu, _grads(shapes, 80 + step, "cpu")):
            p.grad, q.grad = g.clone(), g.cuda()
        oc.step(grad_multiplier=torch.tensor(mult))
        og.step(grad_multiplier=torch.tensor(mult, device="cuda"))
    for p, q in zip(cpu, gpu):
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(og.state[q][k].cpu(), oc.state[p][k]), k
        assert torch.equal(q.detach().cpu(), p.detach())


@needs_cuda
def test_cuda_runs_on_the_current_stream():
    p = _params([(1 << 20,)], 9, "cuda")[0]
    ref = [torch.nn.Parameter(p.detach().clone())]  # the fp32 values, before the adoption rounds the parameter
    opt = rt.MasterAdamW([p], lr=1e-3)
    side = torch.cuda.Stream()
    g = _grads([(1 << 20,)], 10, "cuda")[0]
    ref_opt = torch.optim.AdamW(ref, lr=1e-3)
    p.grad = torch.zeros_like(g)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~25 ms: a step queued anywhere but here would read the zero gradient
        p.grad.copy_(g)
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    ref[0].grad = g.float()
    ref_opt.step()
    torch.testing.assert_close(opt.state[p]["master"], ref[0].detach(), rtol=RTOL, atol=ATOL)


def _moe(dtype, device):
    return rt.MoE(64, 96, num_experts=8, topk=2, max_tokens=128, dtype=dtype, device=device, seed=3,
                  score_function="softmax", aux_loss_coeff=0.0)


@needs_cuda
@pytest.mark.parametrize("micro", [1, 2])
def test_trains_rdep_experts_like_fp32_master_weights(micro):
    """rdep.torch.MoE with bf16 experts (bf16 weight gradients from the layer) under MasterAdamW against the same
    module with fp32 experts (cast per call, fp32 gradients) under torch's AdamW: the master weights agree to the
    gradients' bf16 rounding over a few steps; the fp32 module's weights are its masters. With two micro-batches a
    step, MasterAdamW(fp32_grads=True) sums the layer's bf16 gradients in fp32, as the fp32 module's autograd does."""
    torch.manual_seed(0)
    a, b = _moe(torch.float32, "cuda"), _moe(torch.float32, "cuda")
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.AdamW(a.expert_parameters(), lr=1e-3, weight_decay=0.1)
    opt_b = rt.MasterAdamW(b.expert_parameters(), lr=1e-3, weight_decay=0.1, fp32_grads=micro > 1)  # adopts: bf16
    assert b.w1.dtype == torch.bfloat16
    for step in range(3):
        xs = [torch.randn(128, 64, device="cuda") for _ in range(micro)]
        for m, o in ((a, opt_a), (b, opt_b)):
            for k, x in enumerate(xs):
                y = m(x).y
                if step == 0 and k == 0:  # the same bf16 weights: a's casts of its fp32 values, b's adopted parameters
                    if m is a:
                        ya = y.detach()
                    else:
                        assert torch.equal(y, ya)
                (y.float() ** 2).mean().backward()
            o.step()
            o.zero_grad()
        if micro > 1:
            assert b.w1.grad is None and b.w1.main_grad.dtype == torch.float32
    for pa, pb in zip(a.expert_parameters(), b.expert_parameters()):
        master = opt_b.state[pb]["master"]
        err = (master - pa.detach()).abs().max().item() / pa.detach().abs().max().item()
        assert err < 2e-3, f"master weights drifted from the fp32 run: {err:.3g}"
        assert torch.equal(pb.detach(), master.to(torch.bfloat16))


def _backward_through(params, grads) -> None:
    """One backward pass whose gradient for each bf16 parameter is exactly the given bf16 tensor."""
    sum((p * g).float().sum() for p, g in zip(params, grads)).backward()


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_grads_accumulate_micro_batches_in_fp32(device):
    """fp32_grads: each backward's bf16 gradient lands in main_grad (copied, then added in fp32), param.grad is None
    after it, and the step matches torch's AdamW given the fp32 sums. Summed in bf16 instead, the gradients differ."""
    shapes = [(64, 33), (7,), (1,)]
    hyper = dict(lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    ref = _params(shapes, 11, device)
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt, ref_opt = rt.MasterAdamW(mine, fp32_grads=True, **hyper), torch.optim.AdamW(ref, **hyper)
    for step in range(3):
        micro = [_grads(shapes, 500 + 10 * step + j, device) for j in range(4)]
        for gs in micro:
            _backward_through(mine, gs)
            assert all(p.grad is None for p in mine), "the hook moves each gradient into main_grad"
        sums = [sum(gs[i].float() for gs in micro) for i in range(len(shapes))]  # fp32, in the hook's order
        for i, (p, s) in enumerate(zip(mine, sums)):
            assert p.main_grad.dtype == torch.float32 and torch.equal(p.main_grad, s), f"main_grad {i}"
        in_bf16 = micro[0][0]
        for gs in micro[1:]:
            in_bf16 = in_bf16 + gs[0]
        assert not torch.equal(in_bf16.float(), sums[0]), "bf16 sums round: the test would see them"
        for r, s in zip(ref, sums):
            r.grad = s
        opt.step()
        ref_opt.step()
        _check_close(mine, opt, ref, ref_opt, f"step {step + 1}")
        opt.zero_grad()
        ref_opt.zero_grad()


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_grads_zero_grad_and_direct_gradients(device):
    shapes = [(10, 3), (5,)]
    mine = _params(shapes, 12, device)
    opt = rt.MasterAdamW(mine, lr=1e-3, fp32_grads=True)
    first, second = _grads(shapes, 600, device), _grads(shapes, 601, device)
    _backward_through(mine, first)
    opt.step()
    assert all(torch.equal(p.main_grad, g.float()) for p, g in zip(mine, first)), "a step leaves the gradients"
    opt.zero_grad()  # set_to_none: the buffers are not rewritten, the next backward overwrites them
    _backward_through(mine, second)
    assert all(torch.equal(p.main_grad, g.float()) for p, g in zip(mine, second)), "overwritten, not added"
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.main_grad) == 0 for p in mine)
    mine[0].grad = first[0].clone()  # assigned directly: accumulated as a backward's would be
    opt.step()
    assert torch.equal(mine[0].main_grad, first[0].float()) and mine[0].grad is None
    assert opt.state[mine[1]]["step"] == 2, "zeroed (not emptied) gradients still step, as torch's"
    opt.zero_grad()
    opt.step()  # no gradients at all: nothing moves
    assert opt.state[mine[0]]["step"] == 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp32_grads", [False, True])
def test_clip_grad_norm_matches_torch(device, fp32_grads):
    """opt.clip_grad_norm_ returns the norm torch's clip_grad_norm_ finds on fp32 copies of the gradients the step
    reads, and the step applies the coefficient (times any grad_multiplier) as torch's clipped gradients would."""
    shapes = [(40, 40), (17,), (9, 9)]
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.05)
    ref = _params(shapes, 13, device)
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt, ref_opt = rt.MasterAdamW(mine, fp32_grads=fp32_grads, **hyper), torch.optim.AdamW(ref, **hyper)
    mult = torch.tensor(0.5, device=device)
    for step in range(2):
        micro = [_grads(shapes, 700 + 10 * step + j, device) for j in range(2 if fp32_grads else 1)]
        for gs in micro:
            if fp32_grads:
                _backward_through(mine, gs)
            else:
                for p, g in zip(mine, gs):
                    p.grad = g.clone()
        for i, r in enumerate(ref):
            r.grad = sum(gs[i].float() for gs in micro)
        total = opt.clip_grad_norm_(0.01)
        ref_total = torch.nn.utils.clip_grad_norm_(ref, 0.01)
        torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=0)
        assert ref_total.item() > 0.01, "the clip must bite for this test to mean anything"
        with_mult = step == 1
        if with_mult:
            for r in ref:
                r.grad.mul_(mult)
        opt.step(grad_multiplier=mult if with_mult else None)
        ref_opt.step()
        _check_close(mine, opt, ref, ref_opt, f"step {step + 1}")
        opt.zero_grad()
        ref_opt.zero_grad()
    with pytest.raises(ValueError, match=r"^max_norm: expected a number >= 0"):
        opt.clip_grad_norm_(-1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_grads_move_is_torchs_add_bit_for_bit(device):
    """The hook's move (rdep_grad_accumulate): main = g, or main + g in fp32, bit for bit what torch's copy_ and
    add_ give, on aligned and unaligned buffers (an fp32 view one element in), odd lengths (the kernel's eight-element
    vectors and its tail), and a non-contiguous gradient."""
    from rdep.torch.optim import _move_into

    gen = torch.Generator().manual_seed(5)
    for n, skew in ((8 * 1000 + 3, 0), (4099, 1), (5, 0), (257, 3)):
        base = (torch.randn(n + skew, generator=gen) * 1e-3).to(device)
        main = base[skew:]  # skew 1: 4-byte aligned, not 16: the one-at-a-time kernel
        g = (torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16).to(device)
        want = main.clone().add_(g)
        _move_into(main, g, add=True)
        assert torch.equal(main, want), f"add, {n} elements at offset {skew}"
        _move_into(main, g, add=False)
        assert torch.equal(main, g.float()), f"copy, {n} elements at offset {skew}"
    main = torch.randn(33 * 129, generator=gen).to(device)
    g = torch.randn(129, 33, generator=gen).to(torch.bfloat16).to(device).t()  # not contiguous
    want = main.clone().add_(g.reshape(-1))
    _move_into(main, g, add=True)
    assert torch.equal(main, want), "a non-contiguous gradient"


@needs_cuda
@pytest.mark.parametrize("fp32_grads", [False, True])
def test_cuda_matches_the_host_reference_bitwise_fp32_grads(fp32_grads):
    """The CUDA kernel over fp32 main_grads (and bf16 grads) against the host path, bit for bit, over micro-batches."""
    shapes = [(1000, 7), (4099,), (33, 129)]
    cpu = _params(shapes, 15, "cpu")
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    oc = rt.MasterAdamW(cpu, lr=3e-4, weight_decay=0.1, fp32_grads=fp32_grads)
    og = rt.MasterAdamW(gpu, lr=3e-4, weight_decay=0.1, fp32_grads=fp32_grads)
    for step in range(3):
        for j in range(3 if fp32_grads else 1):
            gs = _grads(shapes, 90 + 10 * step + j, "cpu")
            _backward_through(cpu, gs)
            _backward_through(gpu, [g.cuda() for g in gs])
        # A fixed multiplier: a clip's norm is reduced in another order on each device, its last bit may differ.
        oc.step(grad_multiplier=torch.tensor(0.7))
        og.step(grad_multiplier=torch.tensor(0.7, device="cuda"))
        oc.zero_grad()
        og.zero_grad()
    for p, q in zip(cpu, gpu):
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(og.state[q][k].cpu(), oc.state[p][k]), k
        assert torch.equal(q.detach().cpu(), p.detach())


def test_fp32_grads_hooks_frozen_parameters_and_a_second_optimizer():
    """A frozen parameter is adopted without a hook; a parameter stays with one live fp32_grads optimizer (a second is
    refused naming it, before anything is adopted); once the first is gone a new one takes its gradients."""
    a, frozen = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3), requires_grad=False)
    opt = rt.MasterAdamW([a, frozen], lr=1e-2, fp32_grads=True)
    b = torch.nn.Parameter(torch.randn(5))
    with pytest.raises(ValueError, match=r"params\[1\] of group 0: already trained by another live MasterAdamW"):
        rt.MasterAdamW([b, a], fp32_grads=True)
    assert b.dtype == torch.float32, "a refused group adopts nothing"
    g = torch.ones(4, dtype=torch.bfloat16)
    _backward_through([a], [g])
    assert torch.equal(a.main_grad, g.float()) and a.grad is None
    del opt
    import gc

    gc.collect()
    opt2 = rt.MasterAdamW([a], lr=1e-2, fp32_grads=True)  # the dead optimizer's hook does nothing now
    _backward_through([a], [g * 2])
    assert opt2.grad_of(a) is not None and torch.equal(a.main_grad, (g * 2).float())
    opt2.step()
    assert opt2.state[a]["step"] == 1


def test_fp32_grads_zero_grad_keeps_absent_gradients_absent():
    """zero_grad(set_to_none=False) zeroes the gradients there are, as torch's: a parameter that had none stays
    without one and does not step."""
    used, unused = torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(2))
    opt = rt.MasterAdamW([used, unused], lr=1e-2, fp32_grads=True)
    _backward_through([used], [torch.ones(6, dtype=torch.bfloat16)])
    opt.zero_grad(set_to_none=False)
    assert opt.grad_of(unused) is None and torch.count_nonzero(opt.grad_of(used)) == 0
    opt.step()
    assert opt.state[used]["step"] == 1 and "step" not in opt.state[unused]


@pytest.mark.parametrize("fp32_grads", [False, True])
def test_clip_coefficient_applies_to_the_next_step_only(fp32_grads):
    shapes = [(30,), (4, 4)]
    ref = _params(shapes, 17, "cpu")
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt, ref_opt = rt.MasterAdamW(mine, lr=1e-3, fp32_grads=fp32_grads), torch.optim.AdamW(ref, lr=1e-3)
    for step in range(2):
        gs = _grads(shapes, 800 + step, "cpu")
        if fp32_grads:
            _backward_through(mine, gs)
        else:
            for p, g in zip(mine, gs):
                p.grad = g.clone()
        for r, g in zip(ref, gs):
            r.grad = g.float()
        if step == 0:
            opt.clip_grad_norm_(1e-4)
            torch.nn.utils.clip_grad_norm_(ref, 1e-4)
        opt.step()
        ref_opt.step()
        _check_close(mine, opt, ref, ref_opt, f"step {step + 1} ({'clipped' if step == 0 else 'not clipped'})")
        opt.zero_grad()
        ref_opt.zero_grad()
    opt.clip_grad_norm_(1e-4)  # a clip with no gradients at all leaves no coefficient behind
    assert opt._clip_coef == {}
