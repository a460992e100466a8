"""A small decoder-only language model with the Moonlight (DeepSeek-V3-style) architecture, its MoE slot
pluggable (moe_variants.py fills it).

    x = embed(tokens)
    for each block:  x = x + attn(rmsnorm(x))                   causal multi-head attention with RoPE (SDPA)
                     x = x + ffn(rmsnorm(x))                    dense SwiGLU for the first `dense_layers`
                                                                blocks, the MoE of the chosen variant after
    logits = lm_head(rmsnorm(x))                                byte-level vocabulary (256)

Moonlight-16B-A3B for scale: hidden 2048, 27 layers (1 dense), 16 heads, dense ffn 11264, 64 routed experts
of ffn 1408 top-6 plus 2 shared experts, sigmoid scores, normalized top-K gates times a route scale of
2.446, aux-loss-free expert bias, no group limit (n_group = 1). Moonlight's attention is MLA; this example
uses plain multi-head attention with rotary embeddings, which leaves the MoE layers (what is compared) as
they are. Every size is an argument of ModelConfig.

Precision: parameters are fp32 (master weights). On CUDA the dense parts run under bf16 autocast; the MoE
block runs outside autocast on fp32 activations, its router in fp32 and its routed experts in bf16 inside
each variant (rdep, TorchTitan and the torch reference alike); the shared experts in fp32 (TF32 matmuls). Compiled,
their backward is fp32 only when torch traces it without autocast (train.py --compiled-backward-autocast off, the default).
On the CPU everything is fp32 (TorchTitan's GroupedExperts still casts its experts to bf16 there).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, asdict

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class ModelConfig:
    vocab: int = 256
    hidden: int = 1024
    layers: int = 4
    dense_layers: int = 1
    heads: int = 16
    dense_ffn: int = 2816
    moe_ffn: int = 704
    experts: int = 64
    topk: int = 6
    shared_experts: int = 2          # shared expert ffn = shared_experts * moe_ffn, as Moonlight's 2 x 1408
    score: str = "sigmoid"           # router score function: sigmoid (Moonlight) or softmax
    groups: int = 1                  # group-limited routing: experts in `groups` groups, keep `topk_groups`
    topk_groups: int = 1
    route_scale: float = 2.446       # Moonlight's routed_scaling_factor
    seq_len: int = 512
    rope_theta: float = 50000.0
    init_std: float = 0.02

    @property
    def shared_ffn(self) -> int:
        return self.shared_experts * self.moe_ffn

    def as_dict(self) -> dict:
        return asdict(self)


def generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator for one named tensor: the same (seed, name) gives the same values in every variant,
    at every world size, whatever order the modules were built in."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62))


def normal(shape, std: float, seed: int, name: str) -> Tensor:
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator(seed, name))


def rope_tables(seq_len: int, head_dim: int, theta: float, device) -> tuple[Tensor, Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv)  # [S, hd/2]
    return ang.cos(), ang.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, S, nh, hd]; rotates the (first half, second half) pairs of each head (GPT-NeoX layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.hidden % cfg.heads != 0 or (cfg.hidden // cfg.heads) % 2 != 0:
            raise ValueError(f"heads: hidden={cfg.hidden} must split into {cfg.heads} heads of even size")
        self.heads, self.head_dim = cfg.heads, cfg.hidden // cfg.heads
        self.wqkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.wo = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, S, H = x.shape
        q, k, v = self.wqkv(x).view(B, S, 3, self.heads, self.head_dim).unbind(2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, S, H))


class DenseMLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ffn: nn.Module, is_moe: bool):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=1e-6)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.hidden, eps=1e-6)
        self.is_moe = is_moe
        if is_moe:
            self.moe = ffn
        else:
            self.mlp = ffn

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.ffn_norm(x)
        if not self.is_moe:
            return x + self.mlp(h), x.new_zeros((), dtype=torch.float32)
        # The MoE block runs outside autocast on fp32 activations: each variant keeps its router in fp32
        # and casts its routed experts to bf16 itself (on CUDA).
        with torch.autocast(device_type=x.device.type, enabled=False):
            y, router_loss = self.moe(h.float())
        return x + y.to(x.dtype), router_loss


class MoonlightLM(nn.Module):
    """The language model; make_moe(layer_index) builds the MoE of each MoE block."""

    def __init__(self, cfg: ModelConfig, make_moe):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList()
        for i in range(cfg.layers):
            if i < cfg.dense_layers:
                self.blocks.append(Block(cfg, DenseMLP(cfg.hidden, cfg.dense_ffn), is_moe=False))
            else:
                self.blocks.append(Block(cfg, make_moe(i), is_moe=True))
        self.norm = nn.RMSNorm(cfg.hidden, eps=1e-6)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        # Rotary tables for up to cfg.seq_len positions, made here (not inside forward): a compiled forward that
        # made and cached them would hand a later step a tensor its CUDA graphs (mode="reduce-overhead") reuse.
        cos, sin = rope_tables(cfg.seq_len, cfg.hidden // cfg.heads, cfg.rope_theta, "cpu")
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def moe_layers(self) -> list[nn.Module]:
        return [b.moe for b in self.blocks if b.is_moe]

    def dense_named_parameters(self):
        """Every parameter outside the MoE blocks' `moe` slot (replicated in every variant)."""
        for name, p in self.named_parameters():
            if ".moe." not in name:
                yield name, p

    @torch.no_grad()
    def init_dense(self, seed: int) -> None:
        """Deterministic init of the parameters outside the MoE slot, from (seed, parameter name): the
        names are the same in every variant, so every variant starts from the same dense weights.
        RMSNorm weights 1, embeddings and input projections N(0, std), output projections (attention wo,
        MLP w2) N(0, std / sqrt(2 * layers))."""
        std, out_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.layers)
        for name, p in self.dense_named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                s = out_std if name.endswith(("wo.weight", "w2.weight")) else std
                p.copy_(normal(p.shape, s, seed, name))

    def _rope(self, seq_len: int) -> tuple[Tensor, Tensor]:
        if seq_len > self.rope_cos.shape[0]:
            raise ValueError(f"tokens: {seq_len} positions exceed the model's seq_len {self.rope_cos.shape[0]}")
        return self.rope_cos[:seq_len], self.rope_sin[:seq_len]

    def forward(self, tokens: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """Mean next-byte cross-entropy over this process's tokens, and the sum of the MoE router losses."""
        cos, sin = self._rope(tokens.shape[1])
        x = self.embed(tokens)
        router_loss = torch.zeros((), dtype=torch.float32, device=tokens.device)
        for block in self.blocks:
            x, rl = block(x, cos, sin)
            router_loss = router_loss + rl
        logits = self.lm_head(self.norm(x)).float()
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        return loss, router_loss
