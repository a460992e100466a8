"""A plain PyTorch reference MoE for the tests: no rdep code is imported here.

Everything is written out the simple way (Python loops over tokens and experts, fp64 by default):
  * route():     logits -> softmax/sigmoid scores -> expert bias for selection -> group limit (keep the
                 topk_groups groups with the largest sum of their top-2 selection scores) -> top-K by a
                 stable descending sort per token -> gates (normalized, scaled); aux, seq-aux, z losses;
  * accepted():  the capacity rule: cap = ceil(C*W*T*K/E) rows per expert (T = the layer's max tokens per
                 rank), rows admitted in ascending row_id = (rank, token, slot) order, later rows dropped;
  * renormalize(): dropped slots get 0, the surviving gates are scaled by (sum all)/(sum surviving)
                 (all 0 when every slot of a token is dropped);
  * experts():   y_t = sum_k g'_tk * (silu(x_t W1g[e]) * x_t W1u[e]) W2[e], one expert at a time;
  * moe_module_reference(): the whole rdep.torch.MoE forward from its parameters (copied to fp64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


def capacity(capacity_factor: float, W: int, T: int, K: int, E: int) -> Optional[int]:
    return None if capacity_factor == 0 else math.ceil(capacity_factor * W * T * K / E)


def accepted(experts: torch.Tensor, num_experts: int, cap: Optional[int]) -> torch.Tensor:
    """experts [W, n, K] -> bool [W, n, K]: the rows each expert admits, in (rank, token, slot) order."""
    flat = experts.reshape(-1).tolist()
    seen = [0] * num_experts
    out = []
    for e in flat:
        seen[e] += 1
        out.append(cap is None or seen[e] <= cap)
    return torch.tensor(out, dtype=torch.bool).reshape(experts.shape)


def renormalize(gates: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Effective gates g' [..., K] from gates and the accepted mask (differentiable in gates)."""
    acc = acc.to(gates.device)
    S = gates.sum(-1, keepdim=True)
    A = (gates * acc).sum(-1, keepdim=True)
    A_safe = torch.where(A > 0, A, torch.ones_like(A))
    return torch.where(acc & (A > 0), gates * S / A_safe, torch.zeros_like(gates))


def experts(x: torch.Tensor, ids: torch.Tensor, g_eff: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x [N, H], ids [N, K], g_eff [N, K], w1 [E, H, 2F], w2 [E, F, H] -> y [N, H]."""
    E, Fd = w1.shape[0], w2.shape[1]
    y = torch.zeros_like(x)
    for e in range(E):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        h = x[rows] @ w1[e]
        out = (F.silu(h[:, :Fd]) * h[:, Fd:]) @ w2[e]
        y = y.index_add(0, rows.to(x.device), out * g_eff[rows, slots].unsqueeze(-1))
    return y


def draw_inputs(W: int, n: int, H: int, F: int, E: int, K: int, kind: str, g: torch.Generator):
    """bf16 x [W, n, H], w1 [E, H, 2F], w2 [E, F, H] (scaled by fan-in), int32 ids [W, n, K] (K distinct experts a
    token: 'uniform', or a Zipf-like skew with exponent 1.5 for any other kind) and fp32 gates in [0.1, 1), drawn
    from g in that order (CPU tensors; the CUDA tests move them)."""
    x = torch.randn(W, n, H, generator=g).bfloat16()
    w1 = (torch.randn(E, H, 2 * F, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, F, H, generator=g) / F ** 0.5).bfloat16()
    if kind == "uniform":
        ids = torch.rand(W * n, E, generator=g).argsort(-1)[:, :K]
    else:  # zipf-like skew, K distinct experts a token
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.5
        ids = torch.multinomial(p.expand(W * n, E), K, replacement=False, generator=g)
    ids = ids.reshape(W, n, K).int()
    gates = torch.rand(W, n, K, generator=g) * 0.9 + 0.1
    return x, ids, gates, w1, w2


def moe_layer(x, ids, gates, w1, w2, capacity_factor: float, T: int):
    """The rdep layer: x [W, n, H], ids [W, n, K], gates [W, n, K], w1 [E, H, 2F], w2 [E, F, H] (all experts).
    Returns (y [W, n, H], accepted [W, n, K])."""
    W, n, H = x.shape
    K, E = ids.shape[-1], w1.shape[0]
    acc = accepted(ids.cpu(), E, capacity(capacity_factor, W, T, K, E))
    g_eff = renormalize(gates, acc)
    y = experts(x.reshape(W * n, H), ids.reshape(W * n, K).long(), g_eff.reshape(W * n, K), w1, w2)
    return y.reshape(W, n, H), acc


@dataclass
class RouterConfig:
    num_experts: int
    topk: int
    score_function: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    normalize_topk: bool = True
    scaling_factor: float = 1.0
    aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0
    seq_length: int = 0
    z_loss_coeff: float = 0.0


def route(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], c: RouterConfig):
    """x [N, H], weight [E, H] -> (ids [N, K] int64, gates [N, K], aux, z, tokens_per_expert [E])."""
    logits = x @ weight.t()
    scores = logits.softmax(-1) if c.score_function == "softmax" else logits.sigmoid()
    sel = scores.detach().clone()
    if bias is not None:
        sel = sel + bias.to(sel.dtype)
    N, E = logits.shape
    K = c.topk
    ids = []
    for t in range(N):
        allowed = list(range(E))
        if c.num_groups > 1:
            gs = E // c.num_groups
            gscore = []
            for g in range(c.num_groups):
                top = sorted(sel[t, g * gs:(g + 1) * gs].tolist(), reverse=True)
                gscore.append(sum(top[:2]))
            keep = sorted(range(c.num_groups), key=lambda g: (-gscore[g], g))[: c.topk_groups]
            allowed = [e for e in range(E) if e // gs in keep]
        best = sorted(allowed, key=lambda e: (-sel[t, e].item(), e))[:K]
        ids.append(best)
    ids = torch.tensor(ids, dtype=torch.int64, device=x.device).reshape(N, K)
    gates = scores.gather(-1, ids)
    if c.normalize_topk:
        gates = gates / gates.sum(-1, keepdim=True)
    gates = gates * c.scaling_factor
    counts = torch.zeros(E, dtype=torch.int64)
    for e in ids.reshape(-1).tolist():
        counts[e] += 1
    aux = logits.new_zeros(())
    p = scores if c.score_function == "softmax" else scores / scores.sum(-1, keepdim=True)
    if c.aux_loss_coeff:
        aux = aux + c.aux_loss_coeff * E * sum(counts[e].item() / (N * K) * p[:, e].mean() for e in range(E))
    if c.seq_aux_loss_coeff:
        sl = c.seq_length
        per = []
        for s in range(N // sl):
            rows = slice(s * sl, (s + 1) * sl)
            cnt = torch.zeros(E, dtype=p.dtype)
            for e in ids[rows].reshape(-1).tolist():
                cnt[e] += 1
            per.append(E * sum(cnt[e] / (sl * K) * p[rows, e].mean() for e in range(E)))
        aux = aux + c.seq_aux_loss_coeff * torch.stack(per).mean()
    z = logits.new_zeros(())
    if c.z_loss_coeff:
        z = c.z_loss_coeff * (logits.logsumexp(-1) ** 2).mean()
    return ids, gates, aux, z, counts


def router_config_of(moe) -> RouterConfig:
    r = moe.router
    return RouterConfig(num_experts=r.num_experts, topk=r.topk, score_function=r.score_function,
                        num_groups=r.num_groups, topk_groups=r.topk_groups, normalize_topk=r.normalize_topk,
                        scaling_factor=r.scaling_factor, aux_loss_coeff=r.aux_loss_coeff,
                        seq_aux_loss_coeff=r.seq_aux_loss_coeff, seq_length=r.seq_length, z_loss_coeff=r.z_loss_coeff)


class ReferenceMoE:
    """The MoE module's math from copies of its parameters (fp64 by default), with autograd.
    The experts are all E of them: w1_full [E, H, 2F] (only the local ones when the module holds all)."""

    def __init__(self, moe, dtype=torch.float64, device="cpu"):
        def leaf(t):
            return t.detach().to(device=device, dtype=dtype).clone().requires_grad_(True)

        self.cfg = router_config_of(moe)
        self.router_weight = leaf(moe.router.weight)
        self.bias = None if moe.router.expert_bias is None else moe.router.expert_bias.detach().to(device).clone()
        self.w1, self.w2 = leaf(moe.w1), leaf(moe.w2)
        self.shared = None if moe.shared is None else (leaf(moe.shared.w1), leaf(moe.shared.w2))
        self.capacity_factor = moe.layer.capacity_factor
        self.T = moe.layer.max_tokens
        self.L = moe.layer.num_local_ranks
        self.dtype, self.device = dtype, device

    def __call__(self, x: torch.Tensor):
        """x [L, n, H] (already in rank layout) -> (y, aux, z, counts, ids, accepted)."""
        x = x.to(device=self.device, dtype=self.dtype)
        L, n, H = x.shape
        ids, gates, aux, z, counts = route(x.reshape(L * n, H), self.router_weight, self.bias, self.cfg)
        K = ids.shape[-1]
        y, acc = moe_layer(x, ids.reshape(L, n, K), gates.reshape(L, n, K), self.w1, self.w2,
                           self.capacity_factor, self.T)
        if self.shared is not None:
            s1, s2 = self.shared
            Fs = s2.shape[0]
            h = x @ s1
            y = y + (F.silu(h[..., :Fs]) * h[..., Fs:]) @ s2
        return y, aux, z, counts, ids.reshape(L, n, K), acc

    def params(self) -> dict:
        out = {"router.weight": self.router_weight, "w1": self.w1, "w2": self.w2}
        if self.shared is not None:
            out["shared.w1"], out["shared.w2"] = self.shared
        return out
