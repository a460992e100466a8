"""The MoE layers the example compares, behind one interface, all started from the same weights.

    rdep                 rdep.torch.MoE: rdep's router, rdep dispatch -> grouped SwiGLU experts -> combine
    TorchTitan MoE       torchtitan.models.common.moe.MoE (TokenChoiceTopKRouter, GroupedExperts over
                         torch._grouped_mm, LocalTokenDispatcher at W = 1, AllToAllTokenDispatcher under
                         torchrun), used when the `torchtitan` package imports
    torch reference MoE  written here in plain PyTorch: the same router math, experts through
                         torch._grouped_mm (a loop over experts where it is missing), all_to_all_single with
                         autograd under torchrun; the stand-in when torchtitan does not import

Each adapter's forward(x [B, S, H] fp32) returns (y [B, S, H] fp32, router loss scalar) and records the
rows routed to each expert; update_bias(rate) then applies the aux-loss-free balancing update
    b_e += rate * sign(mean_e load - load_e)          (load summed over the process group)
(DeepSeek-V3's rule, as rdep.torch.MoE.update_expert_bias; TorchTitan's trainer also subtracts the mean of
the update, which this example does not, so that all variants train by the same rule).

Same initial weights: canonical_moe() draws one layer's weights in a layout of its own (router [E, H];
per expert gate [H, F], up [H, F], down [F, H], each expert from its own generator (seed, layer, expert),
so a rank draws only the experts it holds and every world size gets the same model; shared gate, up
[H, Fs], down [Fs, H]) and each adapter's load_canonical() copies them into its own layout:
    rdep / reference   w1[e] = [gate | up] (H x 2F), w2[e] = down (F x H); shared w1 = [gate | up], w2 = down
    TorchTitan         w1_EFD[e] = gate^T, w3_EFD[e] = up^T (F x H), w2_EDF[e] = down^T (H x F);
                       router.gate.weight = router; shared w1/w3/w2 .weight = gate^T / up^T / down^T
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model import ModelConfig, normal

REFERENCE_LABEL = "torch reference MoE"


# --- canonical weights ------------------------------------------------------------------------------------

@dataclass
class CanonicalMoE:
    router: Tensor       # [E, H]
    gate: Tensor         # [n, H, F]  experts `experts` (a range of global ids)
    up: Tensor           # [n, H, F]
    down: Tensor         # [n, F, H]
    shared_gate: Tensor  # [H, Fs]
    shared_up: Tensor    # [H, Fs]
    shared_down: Tensor  # [Fs, H]
    experts: range


def canonical_moe(cfg: ModelConfig, layer: int, experts: range, seed: int) -> CanonicalMoE:
    H, F_, Fs = cfg.hidden, cfg.moe_ffn, cfg.shared_ffn
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.layers)
    gate, up, down = [], [], []
    for e in experts:
        g = torch.Generator().manual_seed(_expert_seed(seed, layer, e))
        gate.append(torch.empty(H, F_).normal_(0.0, std, generator=g))
        up.append(torch.empty(H, F_).normal_(0.0, std, generator=g))
        down.append(torch.empty(F_, H).normal_(0.0, out_std, generator=g))
    z = torch.empty(0, H, F_)
    return CanonicalMoE(
        router=normal((cfg.experts, H), std, seed, f"layer{layer}.router"),
        gate=torch.stack(gate) if gate else z, up=torch.stack(up) if up else z,
        down=torch.stack(down) if down else torch.empty(0, F_, H),
        shared_gate=normal((H, Fs), std, seed, f"layer{layer}.shared.gate"),
        shared_up=normal((H, Fs), std, seed, f"layer{layer}.shared.up"),
        shared_down=normal((Fs, H), out_std, seed, f"layer{layer}.shared.down"),
        experts=experts)


def _expert_seed(seed: int, layer: int, expert: int) -> int:
    return ((seed * 4099 + layer) * 1_000_003 + expert) % (1 << 62)


def contiguous_experts(num_experts: int, rank: int, world: int) -> range:
    """rdep's ownership rule: contiguous blocks, the first E mod W ranks one expert more."""
    base, extra = divmod(num_experts, world)
    first = rank * base + min(rank, extra)
    return range(first, first + base + (1 if rank < extra else 0))


def _update_bias(bias: Tensor, load: Tensor, rate: float, group) -> None:
    load = load.detach().to(torch.float32).clone()
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(load, group=group)
    bias.add_(rate * torch.sign(load.mean() - load))


# --- rdep -------------------------------------------------------------------------------------------------

class RdepMoE(nn.Module):
    """rdep.torch.MoE in the model's slot. Under torchrun it takes the process group (one rank per
    process, experts sharded); in one process it drives `ranks` ranks (host backend threads on the CPU,
    ranks sharing the GPU on CUDA), each given a contiguous 1/ranks of the process's tokens. `domain` (the
    first layer's, rdep.torch.Domain) puts every MoE layer of the model on one domain, which holds the
    owner's output rows and the CUTLASS scratch once for all of them (rdep.torch.Layer.shared_row_bytes)."""

    kind = "rdep"

    def __init__(self, cfg: ModelConfig, layer: int, *, device: torch.device, tokens: int, group=None,
                 ranks: int = 1, seed: int = 0, expert_compute: str = "auto", domain=None,
                 keep_weight_casts: bool = False, gate_in_expert: Optional[bool] = None, capturable_ops: bool = True,
                 owner_reduce: bool = False):
        super().__init__()
        import rdep.torch as rt

        self.label = "rdep"
        kw = dict(max_tokens=tokens // ranks, score_function=cfg.score, num_groups=cfg.groups,
                  topk_groups=cfg.topk_groups, normalize_topk=True, scaling_factor=cfg.route_scale,
                  expert_bias=True, shared_ffn=cfg.shared_ffn, seed=seed, dtype=torch.float32,
                  init_std=cfg.init_std, expert_compute=expert_compute, keep_weight_casts=keep_weight_casts,
                  gate_in_expert=gate_in_expert, capturable_ops=capturable_ops, owner_reduce=owner_reduce)
        if group is not None:
            kw.update(process_group=group, device=device)
        else:
            kw.update(world_size=ranks, device=device)
        if domain is not None:  # the model's MoE layers share one domain: its shared regions are held once
            kw.update(domain=domain)
        if tokens % ranks != 0:
            raise ValueError(f"--ranks-per-process: {ranks} must divide the {tokens} tokens of a process's batch")
        self.moe = rt.MoE(cfg.hidden, cfg.moe_ffn, cfg.experts, cfg.topk, **kw)
        self.ranks = self.moe.layer.num_local_ranks
        self.layer_index = layer
        self.load: Optional[Tensor] = None

    @property
    def local_experts(self) -> range:
        return self.moe.local_experts

    def expert_parameters(self) -> list[Tensor]:
        return self.moe.expert_parameters()

    @torch.no_grad()
    def load_canonical(self, c: CanonicalMoE) -> None:
        assert c.experts == self.local_experts, (c.experts, self.local_experts)
        m = self.moe
        m.router.weight.copy_(c.router)
        m.router.expert_bias.zero_()
        m.w1.copy_(torch.cat([c.gate, c.up], dim=-1))
        m.w2.copy_(c.down)
        m.shared.w1.copy_(torch.cat([c.shared_gate, c.shared_up], dim=-1))
        m.shared.w2.copy_(c.shared_down)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        B, S, H = x.shape
        xs = x.reshape(self.ranks, -1, H) if self.ranks > 1 else x  # [L, n, H]: rank i gets rows i*n..
        out = self.moe(xs)
        if torch.is_grad_enabled():
            self.load = out.tokens_per_expert if self.load is None else self.load + out.tokens_per_expert
        return out.y.reshape(B, S, H), out.router_loss

    def step_load(self) -> Optional[Tensor]:
        """Rows this process routed to each expert [E] since the last update_bias."""
        return self.load

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        if self.load is not None:
            self.moe.update_expert_bias(self.load, rate)  # all-reduces the load over the process group
        self.load = None

    def close(self) -> None:
        self.moe.layer.close()


# --- torch reference --------------------------------------------------------------------------------------

def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """out[rows of group g] = x[rows of g] @ w[g]; offs = int32 cumulative row counts. torch._grouped_mm
    where it exists and takes these operands, else a loop over the groups."""
    if hasattr(torch, "_grouped_mm") and grouped_mm.use_native:
        try:
            return torch._grouped_mm(x, w, offs=offs)
        except (RuntimeError, NotImplementedError) as e:
            grouped_mm.use_native = False
            warnings.warn(f"torch._grouped_mm failed ({e}); the torch reference MoE loops over experts")
    ends = offs.tolist()
    outs, start = [], 0
    for g, end in enumerate(ends):
        outs.append(x[start:end] @ w[g])
        start = end
    return torch.cat(outs) if outs else x.new_empty(0, w.shape[-1])


grouped_mm.use_native = True


def _all_to_all(x: Tensor, output_splits: list, input_splits: list, group) -> Tensor:
    """all_to_all_single with autograd (the backward sends the gradients back the same way)."""
    try:
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
    except ImportError:
        import torch.distributed.nn.functional as dnnf

        out = x.new_empty(sum(output_splits), *x.shape[1:])
        return dnnf.all_to_all_single(out, x, output_splits, input_splits, group=group)
    return wait_tensor(all_to_all_single_autograd(x, output_splits, input_splits, group))


class ReferenceMoE(nn.Module):
    """Plain PyTorch MoE with the Moonlight router (see the module docstring); experts w1 [El, H, 2F],
    w2 [El, F, H] as rdep's layout. On CUDA the experts run in bf16, as the other variants'."""

    kind = "reference"

    def __init__(self, cfg: ModelConfig, layer: int, *, group=None):
        super().__init__()
        self.label = REFERENCE_LABEL
        self.cfg, self.layer_index, self.group = cfg, layer, group
        if group is not None:
            import torch.distributed as dist

            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
            if cfg.experts % self.world != 0:
                raise ValueError(f"--experts: the reference MoE's EP needs experts ({cfg.experts}) divisible by "
                                 f"the world size ({self.world})")
        else:
            self.rank, self.world = 0, 1
        self._local = contiguous_experts(cfg.experts, self.rank, self.world)
        El, H, F_, Fs = len(self._local), cfg.hidden, cfg.moe_ffn, cfg.shared_ffn
        self.router_weight = nn.Parameter(torch.zeros(cfg.experts, H))
        self.register_buffer("expert_bias", torch.zeros(cfg.experts))
        self.w1 = nn.Parameter(torch.zeros(El, H, 2 * F_))
        self.w2 = nn.Parameter(torch.zeros(El, F_, H))
        self.shared_w1 = nn.Parameter(torch.zeros(H, 2 * Fs))
        self.shared_w2 = nn.Parameter(torch.zeros(Fs, H))
        self.load: Optional[Tensor] = None

    @property
    def local_experts(self) -> range:
        return self._local

    def expert_parameters(self) -> list[Tensor]:
        return [self.w1, self.w2]

    @torch.no_grad()
    def load_canonical(self, c: CanonicalMoE) -> None:
        assert c.experts == self.local_experts
        self.router_weight.copy_(c.router)
        self.expert_bias.zero_()
        self.w1.copy_(torch.cat([c.gate, c.up], dim=-1))
        self.w2.copy_(c.down)
        self.shared_w1.copy_(torch.cat([c.shared_gate, c.shared_up], dim=-1))
        self.shared_w2.copy_(c.shared_down)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(expert ids [N, K] int64, gates [N, K] fp32): scores in fp32, selection by score + bias within
        the kept groups (group score = sum of its top-2), gates = normalized top-K scores x route_scale."""
        cfg = self.cfg
        logits = x.float() @ self.router_weight.float().t()
        scores = logits.sigmoid() if cfg.score == "sigmoid" else logits.softmax(-1)
        sel = scores.detach() + self.expert_bias
        if cfg.groups > 1:
            g = sel.view(-1, cfg.groups, cfg.experts // cfg.groups)
            top = g.topk(min(2, g.shape[-1]), dim=-1).values.sum(-1)
            keep = torch.zeros_like(top, dtype=torch.bool).scatter(-1, top.topk(cfg.topk_groups, -1).indices, True)
            sel = g.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, cfg.experts)
        idx = sel.topk(cfg.topk, dim=-1).indices
        gates = scores.gather(-1, idx)
        gates = gates / gates.sum(-1, keepdim=True) * cfg.route_scale
        return idx, gates

    def _experts(self, xs: Tensor, counts: Tensor) -> Tensor:
        """SwiGLU of rows grouped by local expert (counts [El] rows each, in order)."""
        act = torch.bfloat16 if xs.is_cuda else torch.float32
        offs = counts.cumsum(0).to(torch.int32)
        h = grouped_mm(xs.to(act), self.w1.to(act), offs)
        gate, up = h.chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, self.w2.to(act), offs)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        B, S, H = x.shape
        cfg = self.cfg
        xf = x.reshape(-1, H)
        N, K, E = xf.shape[0], cfg.topk, cfg.experts
        idx, gates = self.route(xf)
        flat = idx.reshape(-1)
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        if torch.is_grad_enabled():
            self.load = counts if self.load is None else self.load + counts
        order = flat.argsort(stable=True)       # the N*K (token, slot) rows sorted by expert
        token = order // K
        xs = xf[token]
        if self.world == 1:
            out = self._experts(xs, counts)
        else:
            out = self._ep_experts(xs, counts)
        out = out.float() * gates.reshape(-1)[order].unsqueeze(-1)
        y = torch.zeros(N, H, dtype=torch.float32, device=x.device).index_add(0, token, out)
        shared = xf @ self.shared_w1
        Fs = self.shared_w2.shape[0]
        y = y + (F.silu(shared[:, :Fs]) * shared[:, Fs:]) @ self.shared_w2
        return y.view(B, S, H), torch.zeros((), device=x.device)

    def _ep_experts(self, xs: Tensor, counts: Tensor) -> Tensor:
        """Expert parallelism over the process group: rows sorted by expert are also sorted by owner rank;
        all_to_all_single (with autograd) sends them, the owner regroups rank-major rows expert-major,
        runs its experts and sends the results back in the same order."""
        import torch.distributed as dist

        W, El = self.world, len(self._local)
        send = counts.view(W, El)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        in_splits = send.sum(1).tolist()
        out_splits = recv.sum(1).tolist()
        xr = _all_to_all(xs.contiguous(), out_splits, in_splits, self.group)
        expert_of_row = torch.arange(El, device=xs.device).repeat(W).repeat_interleave(recv.flatten())
        perm = expert_of_row.argsort(stable=True)  # rank-major -> expert-major
        out = self._experts(xr[perm], recv.sum(0))
        back = out[perm.argsort()]                 # expert-major -> rank-major
        return _all_to_all(back.contiguous(), in_splits, out_splits, self.group)

    def step_load(self) -> Optional[Tensor]:
        return self.load

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        if self.load is not None:
            _update_bias(self.expert_bias, self.load, rate, self.group)
        self.load = None

    def close(self) -> None:
        pass


# --- TorchTitan -------------------------------------------------------------------------------------------

def torchtitan_status() -> tuple[bool, str]:
    """(importable, version or the import error)."""
    try:
        import torchtitan  # noqa: F401
        from torchtitan.models.common import moe as _  # noqa: F401
    except Exception as e:  # ImportError, or an incompatible torch
        return False, f"{type(e).__name__}: {e}"
    try:
        from importlib.metadata import version

        return True, version("torchtitan")
    except Exception:
        return True, "unknown version"


def _shim_non_strict_tracing() -> bool:
    """torchtitan 0.3.0's AllToAllTokenDispatcher (the path under torchrun) calls
    torch.compiler._is_non_strict_tracing(), which some torch releases lack (2.11.0 raised
    AttributeError under torchrun on a 2-GPU H100 machine; 2.15 has it). This eager training loop never
    traces, so the answer is False: define it when missing and return True so the label records it."""
    if hasattr(torch.compiler, "_is_non_strict_tracing"):
        return False
    torch.compiler._is_non_strict_tracing = lambda: False
    return True


class TitanMoE(nn.Module):
    """torchtitan.models.common.moe.MoE built from its Config classes with the Moonlight router settings
    (as torchtitan's own Moonlight config: sigmoid, route_norm, route_scale; load_balance_coeff = the bias
    update rate). W = 1: LocalTokenDispatcher. Under torchrun: AllToAllTokenDispatcher wired to a 1-D
    device mesh "ep", GroupedExperts holding this rank's E/W experts."""

    kind = "torchtitan"

    def __init__(self, cfg: ModelConfig, layer: int, *, group=None, device: torch.device, bias_rate: float):
        super().__init__()
        from torchtitan.models.common.feed_forward import FeedForward
        from torchtitan.models.common.linear import Linear
        from torchtitan.models.common.moe import (GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter)
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher

        ok, ver = torchtitan_status()
        self.label = f"TorchTitan MoE (torchtitan {ver})"
        self.cfg, self.layer_index, self.group = cfg, layer, group
        H, E, K, F_, Fs = cfg.hidden, cfg.experts, cfg.topk, cfg.moe_ffn, cfg.shared_ffn
        if group is not None:
            import torch.distributed as dist

            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
            if E % self.world != 0:
                raise ValueError(f"--experts: TorchTitan's EP needs experts ({E}) divisible by the world size ({self.world})")
            dispatcher = AllToAllTokenDispatcher.Config(num_experts=E, top_k=K)
        else:
            self.rank, self.world = 0, 1
            dispatcher = LocalTokenDispatcher.Config(num_experts=E, top_k=K)
        self._local = contiguous_experts(E, self.rank, self.world)
        config = MoE.Config(
            num_experts=E,
            load_balance_coeff=bias_rate,
            router=TokenChoiceTopKRouter.Config(
                num_experts=E, gate=Linear.Config(in_features=H, out_features=E), top_k=K, score_func=cfg.score,
                route_norm=True, route_scale=cfg.route_scale,
                num_expert_groups=cfg.groups if cfg.groups > 1 else None,
                num_limited_groups=cfg.topk_groups if cfg.groups > 1 else None),
            routed_experts=RoutedExperts.Config(
                inner_experts=GroupedExperts.Config(dim=H, hidden_dim=F_, num_experts=len(self._local)),
                token_dispatcher=dispatcher),
            shared_experts=FeedForward.Config(
                w1=Linear.Config(in_features=H, out_features=Fs), w2=Linear.Config(in_features=Fs, out_features=H),
                w3=Linear.Config(in_features=H, out_features=Fs)))
        self.moe = config.build()
        if group is not None:
            from torch.distributed.device_mesh import DeviceMesh
            from torchtitan.distributed.utils import set_spmd_backend

            set_spmd_backend("dtensor")  # plain all_to_all_single on the mesh's group, no spmd_types checking
            if _shim_non_strict_tracing():
                self.label += f" [torch {torch.__version__} lacks torch.compiler._is_non_strict_tracing: shimmed to False]"
            mesh = DeviceMesh.from_group(group, device_type=device.type, mesh_dim_names=("ep",))
            self.moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)

    @property
    def local_experts(self) -> range:
        return self._local

    def expert_parameters(self) -> list[Tensor]:
        e = self.moe.routed_experts.inner_experts
        return [e.w1_EFD, e.w2_EDF, e.w3_EFD]

    @torch.no_grad()
    def load_canonical(self, c: CanonicalMoE) -> None:
        assert c.experts == self.local_experts
        m = self.moe
        m.router.gate.weight.copy_(c.router)
        e = m.routed_experts.inner_experts
        e.w1_EFD.copy_(c.gate.transpose(1, 2))
        e.w3_EFD.copy_(c.up.transpose(1, 2))
        e.w2_EDF.copy_(c.down.transpose(1, 2))
        s = m.shared_experts
        s.w1.weight.copy_(c.shared_gate.t())
        s.w3.weight.copy_(c.shared_up.t())
        s.w2.weight.copy_(c.shared_down.t())
        m.expert_bias_E.zero_()
        m.tokens_per_expert_E.zero_()

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        with warnings.catch_warnings():
            # TorchTitan's router asks for fp32 autocast, which the CPU autocast does not know: it warns
            # and runs without autocast, which is what fp32 means here anyway.
            warnings.filterwarnings("ignore", message=".*CPU autocast.*|.*CPU Autocast.*")
            y = self.moe(x)
        return y, torch.zeros((), device=x.device)

    def step_load(self) -> Optional[Tensor]:
        return self.moe.tokens_per_expert_E.clone()  # update_bias zeroes the buffer in place

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        m = self.moe
        _update_bias(m.expert_bias_E, m.tokens_per_expert_E, rate, self.group)
        m.tokens_per_expert_E.zero_()

    def close(self) -> None:
        pass
