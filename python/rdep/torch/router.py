"""rdep.torch.Router: the MoE router in PyTorch, with the options and semantics of rdep's C++ router
family (include/rdep/router/router.h): fp32 logits [N, E] -> scores -> (group- and node-limited)
top-K -> gates,
the aux-loss-free expert bias, and the balancing losses.

Per token t with logits l_t = x_t W^T (fp32, W [E, H]):
  s_t      = softmax(l_t) or sigmoid(l_t)                              (score_function)
  sel_t,e  = s_t,e + b_e       (expert_bias buffer b, selection only; no gradient through selection)
  groups   = num_groups contiguous groups of E/num_groups experts; keep the topk_groups groups with the
             largest sum of their top-2 sel (DeepSeek-V3 group-limited routing); the others are masked
  nodes    = node-limited routing (seeds 004): keep the max_nodes nodes (node_of_expert) with the largest
             sum of their top-2 unmasked sel; the others are masked
  I_t      = top-K of sel over the kept experts, descending (torch.topk; exact ties are broken by
             torch.topk, where the C++ reference takes the lower id)
  g_t,k    = c * s_t,I_k / sum_j s_t,I_j   (normalize_topk)  or  c * s_t,I_k   (c = scaling_factor)
Losses (already multiplied by their coefficient; zero tensors when the coefficient is zero):
  aux      = aux_loss_coeff * E * sum_e f_e P_e,  f_e = rows routed to e / (N K),  P_e = mean_t p_t,e
  seq_aux  = seq_aux_loss_coeff * mean over sequences (seq_length contiguous tokens) of the same sum
  z        = z_loss_coeff * mean_t logsumexp(l_t)^2
where p_t = softmax(l_t) (softmax scores) or sigmoid(l_t) normalized to sum 1 (sigmoid scores). N is the
number of tokens passed to this call (all local ranks' tokens in one process; under torchrun, this rank's).
Expert bias update (aux-loss-free balancing): b_e <- b_e + rate * sign(mean_e load - load_e).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SCORE_FUNCTIONS = ("softmax", "sigmoid")


class RouterOutput(NamedTuple):
    experts: Tensor            # int32 [..., K], descending selection score
    gates: Tensor              # fp32 [..., K]
    aux_loss: Tensor           # fp32 scalar: aux + seq_aux (coefficients applied)
    z_loss: Tensor             # fp32 scalar (coefficient applied)
    tokens_per_expert: Tensor  # int64 [E], rows routed to each expert (before any capacity drop)
    logits: Tensor             # fp32 [..., E]


class _RouterLinear(torch.autograd.Function):
    """logits = x W^T for fp32 x and W, with a backward that runs in fp32 as well. torch.compile traces a
    backward under the autocast state of the forward's caller, not the autocast(enabled=False) region the
    forward ran in (torch._functorch.config.backward_pass_autocast = "same_as_forward", its default through
    torch 2.15), so a plain F.linear here would take its gradients in bf16 inside a compiled model under bf16
    autocast; this backward turns autocast off itself. A graph holding an autograd.Function skips AOTAutograd's cache
    unless torch._functorch.config.autograd_cache_allow_custom_autograd_functions is on (off by default; this function
    reads no Python state outside its traced forward and backward, so it is safe to turn on): the training example does,
    and its warm compile's first step took 2.7-3.7 s on an H200 against 5.7 s with the setting off."""

    generate_vmap_rule = True  # torch.func.vmap over the router, as over the F.linear it replaces

    @staticmethod
    def forward(x: Tensor, w: Tensor) -> Tensor:
        return F.linear(x, w)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, w = ctx.saved_tensors
        with torch.autocast(device_type=g.device.type, enabled=False):
            g = g.to(x.dtype)  # the dtype the forward ran in (fp32 in the router)
            dx = g @ w if ctx.needs_input_grad[0] else None
            dw = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        return dx, dw


def router_logits(x: Tensor, w: Tensor) -> Tensor:
    """x [..., H] @ w [E, H]^T, both fp32, its gradients in fp32 (see _RouterLinear)."""
    return _RouterLinear.apply(x, w)


class Router(nn.Module):
    """Linear router H -> E in fp32 plus top-K selection; see the module docstring for the math."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        topk: int,
        *,
        score_function: str = "softmax",
        num_groups: int = 1,
        topk_groups: int = 1,
        normalize_topk: bool = True,
        scaling_factor: float = 1.0,
        expert_bias: bool = False,
        aux_loss_coeff: float = 0.0,
        seq_aux_loss_coeff: float = 0.0,
        seq_length: int = 0,
        z_loss_coeff: float = 0.0,
        max_nodes: int = 0,
        node_of_expert: Optional[list[int]] = None,
        device=None,
    ):
        super().__init__()
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"score_function: expected one of {SCORE_FUNCTIONS}, got {score_function!r}")
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk: expected 1 <= topk <= num_experts={num_experts}, got {topk}")
        if num_groups < 1 or num_experts % num_groups != 0:
            raise ValueError(f"num_groups: must be >= 1 and divide num_experts={num_experts}, got {num_groups}")
        if not 1 <= topk_groups <= num_groups:
            raise ValueError(f"topk_groups: expected 1 <= topk_groups <= num_groups={num_groups}, got {topk_groups}")
        if num_groups > 1 and topk > topk_groups * (num_experts // num_groups):
            raise ValueError(f"topk: {topk} exceeds the {topk_groups * (num_experts // num_groups)} experts of the "
                             f"topk_groups={topk_groups} kept groups")
        num_nodes = 0
        if max_nodes:
            if node_of_expert is None or len(node_of_expert) != num_experts:
                raise ValueError(f"node_of_expert: node-limited routing needs {num_experts} node ids, got {node_of_expert!r}")
            num_nodes = max(node_of_expert) + 1
            if sorted(set(node_of_expert)) != list(range(num_nodes)):
                raise ValueError("node_of_expert: node ids must be 0..N-1 without gaps")
            if not 1 <= max_nodes <= num_nodes:
                raise ValueError(f"max_nodes: expected 1 <= max_nodes <= nodes={num_nodes}, got {max_nodes}")
            smallest = sorted(node_of_expert.count(n) for n in range(num_nodes))[:max_nodes]
            if sum(smallest) < topk:
                raise ValueError(f"topk: {topk} exceeds the {sum(smallest)} experts of the max_nodes={max_nodes} "
                                 "smallest nodes")
        if seq_aux_loss_coeff != 0 and seq_length <= 0:
            raise ValueError("seq_length: must be > 0 when seq_aux_loss_coeff is set")
        self.hidden, self.num_experts, self.topk = hidden, num_experts, topk
        self.score_function = score_function
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.normalize_topk, self.scaling_factor = normalize_topk, float(scaling_factor)
        self.aux_loss_coeff, self.seq_aux_loss_coeff = float(aux_loss_coeff), float(seq_aux_loss_coeff)
        self.seq_length, self.z_loss_coeff = seq_length, float(z_loss_coeff)
        self.max_nodes, self.num_nodes = max_nodes, num_nodes
        self.register_buffer("node_of_expert",
                             torch.tensor(node_of_expert, dtype=torch.int64, device=device) if max_nodes else None,
                             persistent=False)
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden, dtype=torch.float32, device=device))
        self.register_buffer("expert_bias",
                             torch.zeros(num_experts, dtype=torch.float32, device=device) if expert_bias else None)

    def extra_repr(self) -> str:
        s = f"H={self.hidden}, E={self.num_experts}, K={self.topk}, score={self.score_function}"
        if self.num_groups > 1:
            s += f", groups={self.topk_groups}/{self.num_groups}"
        if self.max_nodes:
            s += f", nodes={self.max_nodes}/{self.num_nodes}"
        if self.expert_bias is not None:
            s += ", expert_bias"
        return s

    def scores(self, logits: Tensor) -> Tensor:
        return logits.softmax(-1) if self.score_function == "softmax" else logits.sigmoid()

    def select(self, scores: Tensor) -> Tensor:
        """Top-K expert ids [..., K] (int64) from the scores, with the bias and the group limit."""
        sel = scores.detach()
        if self.expert_bias is not None:
            sel = sel + self.expert_bias
        if self.num_groups > 1:
            G, E = self.num_groups, self.num_experts
            grouped = sel.unflatten(-1, (G, E // G))
            group_score = grouped.topk(min(2, E // G), dim=-1).values.sum(-1)  # [..., G]
            keep = group_score.topk(self.topk_groups, dim=-1).indices
            mask = torch.zeros_like(group_score, dtype=torch.bool).scatter(-1, keep, True)
            sel = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).flatten(-2)
        if self.max_nodes:
            sel = self._limit_nodes(sel)
        return sel.topk(self.topk, dim=-1).indices

    def _limit_nodes(self, sel: Tensor) -> Tensor:
        """Masks every expert outside the max_nodes nodes with the largest sum of their top-2 sel."""
        scores = []
        for n in range(self.num_nodes):
            s = sel[..., self.node_of_expert == n]
            top = s.topk(min(2, s.shape[-1]), dim=-1).values
            # The host's TopTwoSum: the second value only when it is finite; -inf for a fully masked node.
            second = top[..., 1] if top.shape[-1] > 1 else torch.full_like(top[..., 0], float("-inf"))
            scores.append(torch.where(torch.isfinite(second), top[..., 0] + second, top[..., 0]))
        node_score = torch.stack(scores, -1)  # [..., N]
        keep = node_score.topk(self.max_nodes, dim=-1).indices
        kept = torch.zeros_like(node_score, dtype=torch.bool).scatter(-1, keep, True)
        return sel.masked_fill(~kept.gather(-1, self.node_of_expert.expand(*sel.shape[:-1], -1)), float("-inf"))

    def forward(self, x: Tensor) -> RouterOutput:
        """x [..., H] (any float dtype; the router runs in fp32)."""
        if x.shape[-1] != self.hidden:
            raise ValueError(f"x: expected the last dimension to be H={self.hidden}, got shape {list(x.shape)}")
        # fp32 even after a module-wide .to(dtype) and inside torch.autocast (which would run the linear
        # in bf16/fp16): the router's scores, top-K and gates are computed in fp32.
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = router_logits(x.float(), self.weight.float())
            return self._route(x, logits)

    def _route(self, x: Tensor, logits: Tensor) -> RouterOutput:
        scores = self.scores(logits)
        idx = self.select(scores)
        gates = scores.gather(-1, idx)
        if self.normalize_topk:
            gates = gates / gates.sum(-1, keepdim=True)
        if self.scaling_factor != 1.0:
            gates = gates * self.scaling_factor
        flat_idx = idx.reshape(-1)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat_idx, torch.ones_like(flat_idx))  # no bincount: it would sync the device for its size
        aux = self._aux_losses(logits, scores, idx, counts)
        z = logits.new_zeros(())
        if self.z_loss_coeff != 0 and logits.numel() > 0:
            z = self.z_loss_coeff * logits.logsumexp(-1).square().mean()
        return RouterOutput(idx.to(torch.int32), gates, aux, z, counts, logits)

    def _aux_losses(self, logits: Tensor, scores: Tensor, idx: Tensor, counts: Tensor) -> Tensor:
        loss = logits.new_zeros(())
        E, K = self.num_experts, self.topk
        N = logits.numel() // E
        if N == 0 or (self.aux_loss_coeff == 0 and self.seq_aux_loss_coeff == 0):
            return loss
        p = scores if self.score_function == "softmax" else scores / scores.sum(-1, keepdim=True)
        p = p.reshape(N, E)
        if self.aux_loss_coeff != 0:
            loss = loss + self.aux_loss_coeff * E * (counts.to(p.dtype) * p.sum(0)).sum() / (N * N * K)
        if self.seq_aux_loss_coeff != 0:
            sl = self.seq_length
            if N % sl != 0:
                raise ValueError(f"seq_length: {sl} does not divide the {N} tokens of this call")
            m = N // sl
            onehot = torch.zeros(N, E, dtype=p.dtype, device=p.device).scatter_add_(
                1, idx.reshape(N, K), torch.ones(N, K, dtype=p.dtype, device=p.device))
            cnt = onehot.reshape(m, sl, E).sum(1)  # rows per (sequence, expert)
            pe = p.reshape(m, sl, E).sum(1)
            per_seq = E * (cnt * pe).sum(-1) / (sl * sl * K)
            loss = loss + self.seq_aux_loss_coeff * per_seq.mean()
        return loss

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: Tensor, rate: float, process_group=None) -> Tensor:
        """b_e += rate * sign(mean load - load_e), from the observed rows per expert [E] (summed over the
        process group first, when one is given, so every rank applies the same update). Returns the update."""
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias: this router was built with expert_bias=False")
        if tokens_per_expert.shape != (self.num_experts,):
            raise ValueError(f"tokens_per_expert: expected shape [E={self.num_experts}], got {list(tokens_per_expert.shape)}")
        load = tokens_per_expert.to(device=self.expert_bias.device, dtype=torch.float32).clone()
        if process_group is not None:
            import torch.distributed as dist

            dist.all_reduce(load, group=process_group)
        delta = rate * torch.sign(load.mean() - load)
        self.expert_bias.add_(delta)
        return delta

    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None, std: float = 0.02) -> None:
        w = torch.empty(self.weight.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
        self.weight.copy_(w)
        if self.expert_bias is not None:
            self.expert_bias.zero_()
