"""rdep.torch.MoE: a Mixture-of-Experts nn.Module whose routed experts run through rdep.

    y = sum_k g'_tk * E_{e_tk}(x_t)  (+ shared(x_t))      E_e(x) = (silu(x W1g) * x W1u) W2
with the router of router.py, rdep's dispatch -> grouped SwiGLU experts -> combine (capacity rule and
gate renormalization as in capi.h / README), and optional shared experts (a replicated SwiGLU MLP).

Parameters:
  router.weight [E, H] fp32, replicated;  router.expert_bias [E] buffer when expert_bias=True
  w1 [E_local, H, 2F], w2 [E_local, F, H]: only the experts of this process's ranks (layer.local_experts,
      contiguous), so each process holds its shard; state_dict round-trips, any optimizer works
  shared.w1 [H, 2Fs], shared.w2 [Fs, H] when shared_ffn > 0, replicated
dtype: fp32 on the host backend; on CUDA bf16 by default, or fp32 master weights (cast to bf16 per call,
gradients in fp32). Initialization is deterministic in `seed`: expert e's weights depend only on
(seed, e), so the same seed gives the same model at any world size.

  balance='ultraep' | 'eplb' | 'eplb-exact' (balance_slots, balance_min_quota, relay_above; with ultraep
      balance_min_gain=N, the gain gate: no replicas unless each takes at least N rows off the busiest rank,
      0 = off; one replica costs about as much as ~2,900 rows of expert compute at the Moonlight shape on
      2x H200, docs/perf-notes.md): replicas of
      hot experts inside the layer; y is bitwise the same (host backend), expert gradients equal to fp32
      rounding (on CUDA: its tests, the device chunk relays' included, passed on H100s). The replica
      slots belong to the module's domain: pass one rdep.torch.Domain to every MoE of a model
      (domain=) and its balanced modules share one set of slots per slot size
  domain=rdep.torch.Domain(...): the ranks and placement the module runs on, shared with other modules
      (their layers' calls may interleave in any order); world_size, backend, device, num_gpus,
      process_group and barrier_timeout_s are then the domain's (a different value is refused, naming
      it). Without it the module gets a domain of its own (module.layer.domain)
  nodes=N, max_nodes=M: the ranks form N nodes and the layer runs the two-phase exchange; with M < N the
      router keeps each token's experts on at most M nodes (node-limited routing, seeds 004); on CUDA
      the C++ layer's exchange passed its GPU tests (NCCL between GPU groups), this module's CUDA path
      with nodes has not run on a GPU (not with expert_compute='cutlass')
  expert_compute='auto' | 'cublaslt' | 'cutlass' (CUDA): 'cutlass' computes the experts with grouped GEMMs
      that read the per-expert counts on the GPU, so the layer never waits on the host (any segment_tokens,
      no balancing; sm_90a only; the training example runs with it on H100s and H200s, BENCHMARKS.md);
      'cublaslt' takes the counts on the host (one wait per forward segment) and runs on any GPU. 'auto'
      (default) is 'cutlass' where it runs (a library built with CUTLASS, sm_90 GPUs, one node), else
      'cublaslt'; layer.expert_compute says which, layer.expert_compute_note why not 'cutlass'. The module's
      router makes valid routing, so its calls never wait for the device's routing check (the functional
      rdep.torch.moe, which takes the caller's routing, waits for it with grad off unless check_routing=False)
  owner_reduce=True: each owner sums a token's rows before they cross back (one row per (token, owner)
      instead of one per slot; dgate's dot products are taken by the owner). Tested against the per-slot
      return on the host backend and on GPUs (H100), and recorded in CUDA graphs (torch.cuda.graph and
      reduce-overhead, H200). Not with nodes > 1, nor with the caller's-experts
      API (rdep.torch.dispatch/combine)
  transport_sms=N (CUDA): the SM budget of the kernels that store into peer memory (scatter, return,
      the owner's reduce):
      N blocks, so at most N SMs, leaving the rest to other work; 0 (default) = grids sized by the work;
      not with nodes > 1
  stash_rows=N (CUDA, expert_compute='cutlass'): the paged stash. A forward's saved expert rows move into
      pages of a pool of N rows per GPU rank, shared by the model's MoE layers of one shape on a domain, and
      back at backward, so that each layer in flight holds the rows that arrived rather than the worst case
      (W*T*K rows at W ranks, dropless); the worst case is one buffer shared by those layers. Size it for
      the rows of every layer between its forward and its backward (about layers * T*K at uniform routing,
      with headroom). A forward whose rows do not fit on some rank still returns its output; its backward
      then raises on every rank, naming the ranks, their rows and the pool (that step's dx, gate and expert
      gradients are NaN). Costs a copy of the rows each way; pays
      at W > 1 where the worst case exceeds the rows that arrive. 0 (default) = off. Never inside a CUDA
      graph: under torch.compile(mode="reduce-overhead") rdep's ops run between the captured partitions
      (op_library.py; not tested with the stash)
  keep_weight_casts=True (CUDA with fp32 expert weights, e.g. dtype=torch.float32 master weights): the bf16
      copies of w1 and w2 a forward casts for the layer are kept for its backward, as autograd keeps
      TorchTitan's, instead of being cast again there: one cast per step instead of two (the second took
      0.19 ms a layer at hidden 1024, ffn 704, 64 experts on an H200). It holds their bytes (3 * H * F * 2 per
      local expert) from each forward to its backward. Per layer: the first MoE layer's backward runs last,
      where every layer's gradients are live and a step's memory usually peaks, so keeping the casts in every
      MoE layer but the first saves most of the time without raising the peak (the training example's default,
      --keep-weight-casts after-first: 0.37-0.39 ms a step of 3 layers on an H200, peak unchanged; keeping all
      raised the peak 2.9%; docs/perf-notes.md, fifteenth session).
      False (default) casts again in backward (into the gradients' own bytes where it can) and holds nothing
  overlap_segments=True (CUDA, expert_compute='cutlass', with segment_tokens below world_size * max_tokens):
      the segments run as a pipeline, the dispatch of segment s+1 and the return of s-1 beside the experts'
      compute of s on a second stream per GPU rank; the same results bit for bit. Measured on 2x H200 at the
      Moonlight shape: 8% off the forward of two segments run in sequence, yet one segment (the default) was
      faster still; it is for bounding the payload and row buffers by segment_tokens at a smaller cost. Not
      with balance, nodes > 1 or owner_reduce
  gate_in_expert (CUDA, expert_compute='cutlass'): the gate multiplied before W2 (seeds 002 section 4): the
      experts weight their rows, so the layer keeps no expert outputs for the router's gradient (T * K * H
      values a layer less) and the owners compute it from the saved pre-activations; outputs and gradients
      differ from weighting at the combine by bf16 rounding. None (default) = on where the layer allows it
      (CUDA, expert_compute='cutlass', balance='off', nodes=1; with owner_reduce too), off elsewhere; True asks
      for it (a ValueError where it cannot run); False weights at the combine
  source_windows=True (CUDA): a forward that is dropless in one segment (segment_tokens 0 or >= world_size *
      max_tokens), with balance='off' and nodes=1, gives each source rank a fixed window of every owner's token
      stream, so its routing exchanges no counts before the rows cross (no owner scan, no barriers: dispatch 80.3
      against 100.6 us at the Moonlight shape on 2x H200); the same outputs bit for bit. False plans every forward
      by the three phases (for A/B timing). The host backend always takes the three phases

forward(x) returns MoEOutput(y, aux_loss, z_loss, tokens_per_expert):
  x [..., H] when the process drives one rank (L = 1), [L, ..., H] when it drives L > 1 ranks (one
  process, host backend or ranks sharing a GPU; x[i] is rank i's tokens); y has x's shape and dtype;
  aux_loss, z_loss are scalars with their coefficients applied (add them to the training loss);
  tokens_per_expert [E] int64 counts this call's routed rows (feed it to update_expert_bias).

    moe = rdep.torch.MoE(64, 128, num_experts=8, topk=2, max_tokens=512, aux_loss_coeff=1e-2, shared_ffn=128)
    out = moe(x)
    (loss_fn(out.y) + out.aux_loss + out.z_loss).backward()
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import ops
from .domain import Domain
from .layer import Layer
from .router import Router


class MoEOutput(NamedTuple):
    y: Tensor
    aux_loss: Tensor           # load-balancing losses (aux + seq aux), coefficients applied
    z_loss: Tensor             # router z-loss, coefficient applied
    tokens_per_expert: Tensor  # int64 [E], rows routed to each expert by this call (before capacity)

    @property
    def router_loss(self) -> Tensor:
        return self.aux_loss + self.z_loss


def _seed(seed: int, stream: int, index: int) -> int:
    return ((seed * 4099 + stream) * 1_000_003 + index) & ((1 << 63) - 1)


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP with the experts' layout: w1 [H, 2F] (gate | up columns), w2 [F, H]."""

    def __init__(self, hidden: int, ffn: int, *, device=None, dtype=None):
        super().__init__()
        self.hidden, self.ffn = hidden, ffn
        self.w1 = nn.Parameter(torch.zeros(hidden, 2 * ffn, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.zeros(ffn, hidden, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        h = x @ self.w1
        return (F.silu(h[..., : self.ffn]) * h[..., self.ffn:]) @ self.w2

    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None, std: float = 0.02) -> None:
        for p in (self.w1, self.w2):
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=generator))


class MoE(nn.Module):
    """Router + rdep routed experts + optional shared experts (see the module docstring)."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        num_experts: int,
        topk: int,
        *,
        max_tokens: int,
        capacity_factor: float = 0.0,
        segment_tokens: int = 0,
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
        shared_ffn: int = 0,
        world_size: Optional[int] = None,
        backend: str = "auto",
        device=None,
        dtype: Optional[torch.dtype] = None,
        num_gpus: int = 1,
        process_group=None,
        barrier_timeout_s: float = 0.0,
        seed: int = 0,
        init_std: float = 0.02,
        balance: str = "off",
        balance_slots: int = 2,
        balance_min_quota: int = 1,
        relay_above: int = 4,
        nodes: int = 1,
        max_nodes: int = 0,
        expert_compute: str = "auto",
        owner_reduce: bool = False,
        transport_sms: int = 0,
        domain: Optional[Domain] = None,
        balance_min_gain: int = 0,
        stash_rows: int = 0,
        keep_weight_casts: bool = False,
        overlap_segments: bool = False,
        gate_in_expert: Optional[bool] = None,
        capturable_ops: bool = True,
        source_windows: bool = True,
    ):
        super().__init__()
        self._layer_args = dict(
            hidden=hidden, ffn=ffn, num_experts=num_experts, topk=topk, max_tokens=max_tokens,
            world_size=world_size, capacity_factor=capacity_factor, segment_tokens=segment_tokens,
            num_gpus=num_gpus, process_group=process_group, barrier_timeout_s=barrier_timeout_s, balance=balance,
            balance_slots=balance_slots, balance_min_quota=balance_min_quota, relay_above=relay_above, nodes=nodes,
            max_nodes=max_nodes, expert_compute=expert_compute, owner_reduce=owner_reduce, transport_sms=transport_sms,
            domain=domain, balance_min_gain=balance_min_gain, stash_rows=stash_rows,
            keep_weight_casts=keep_weight_casts, overlap_segments=overlap_segments, gate_in_expert=gate_in_expert,
            capturable_ops=capturable_ops, source_windows=source_windows)
        self._backend_arg = backend
        self.layer = Layer(backend=backend, device=device, **self._layer_args)
        device = self.layer.device
        if dtype is None:
            dtype = torch.float32 if self.layer.backend == "host" else torch.bfloat16
        self.hidden, self.ffn, self.num_experts, self.topk = hidden, ffn, num_experts, topk
        self.process_group = process_group
        self.seed, self.init_std = seed, init_std
        self.router = Router(hidden, num_experts, topk, score_function=score_function, num_groups=num_groups,
                             topk_groups=topk_groups, normalize_topk=normalize_topk, scaling_factor=scaling_factor,
                             expert_bias=expert_bias, aux_loss_coeff=aux_loss_coeff,
                             seq_aux_loss_coeff=seq_aux_loss_coeff, seq_length=seq_length, z_loss_coeff=z_loss_coeff,
                             max_nodes=max_nodes if 0 < max_nodes < nodes else 0,
                             node_of_expert=self.layer.node_of_expert() if 0 < max_nodes < nodes else None,
                             device=device)
        El = self.layer.num_local_experts
        self.w1 = nn.Parameter(torch.zeros(El, hidden, 2 * ffn, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.zeros(El, ffn, hidden, device=device, dtype=dtype))
        self.shared = SwiGLU(hidden, shared_ffn, device=device, dtype=dtype) if shared_ffn > 0 else None
        self.reset_parameters(seed)

    @property
    def local_experts(self) -> range:
        """Global ids of the experts held in w1, w2 (in order)."""
        return self.layer.local_experts

    def expert_parameters(self):
        """The sharded parameters (w1, w2): each process holds its own experts, so data-parallel
        wrappers must not average them across ranks (e.g. list them in DDP's parameters to ignore)."""
        return [self.w1, self.w2]

    def dense_parameters(self):
        """The replicated parameters (router, shared experts): average their gradients across ranks."""
        experts = {id(p) for p in self.expert_parameters()}
        return [p for p in self.parameters() if id(p) not in experts]

    @torch.no_grad()
    def reset_parameters(self, seed: Optional[int] = None) -> None:
        """Deterministic init: N(0, init_std) everywhere, expert e from its own generator (seed, e)."""
        seed = self.seed if seed is None else seed
        std = self.init_std
        self.router.reset_parameters(torch.Generator().manual_seed(_seed(seed, 1, 0)), std)
        H, F_ = self.hidden, self.ffn
        for j, e in enumerate(self.local_experts):
            g = torch.Generator().manual_seed(_seed(seed, 2, e))
            self.w1[j].copy_(torch.empty(H, 2 * F_).normal_(0.0, std, generator=g))
            self.w2[j].copy_(torch.empty(F_, H).normal_(0.0, std, generator=g))
        if self.shared is not None:
            self.shared.reset_parameters(torch.Generator().manual_seed(_seed(seed, 3, 0)), std)

    def extra_repr(self) -> str:
        return (f"H={self.hidden}, F={self.ffn}, E={self.num_experts}, K={self.topk}, local_experts="
                f"[{self.local_experts.start}, {self.local_experts.stop}), layer={self.layer!r}")

    def _ranks_view(self, x: Tensor) -> Tensor:
        """x as [L, n, H]."""
        L, H = self.layer.num_local_ranks, self.hidden
        if x.shape[-1] != H:
            raise ValueError(f"x: expected the last dimension to be H={H}, got shape {list(x.shape)}")
        if L == 1:
            return x.reshape(1, -1, H)
        if x.dim() < 2 or x.shape[0] != L:
            raise ValueError(f"x: this process drives L={L} ranks, so x must be [L={L}, ..., H={H}]; "
                             f"got shape {list(x.shape)}")
        return x.reshape(L, -1, H)

    def forward(self, x: Tensor) -> MoEOutput:
        xs = self._ranks_view(x)
        r = self.router(xs)
        act = torch.float32 if self.layer.backend == "host" else torch.bfloat16
        xe = xs.to(act).contiguous()
        # The router's routing is valid by construction (distinct top-K experts, finite gates for finite x):
        # no wait for the device's check of it with grad off.
        y = ops.moe(self.layer, xe, r.experts, r.gates, self.w1, self.w2, check_routing=False)
        if self.shared is not None:
            # The caller's x in the shared weights' dtype: fp32 x with fp32 shared weights is neither rounded to
            # bf16 nor copied (a copy the shared experts' backward would keep, T x H x 4 bytes); the routed experts'
            # cast when it already is that dtype.
            sdt = self.shared.w1.dtype
            y = y + self.shared(xe if xe.dtype == sdt else xs.to(sdt)).to(y.dtype)
        return MoEOutput(y.to(x.dtype).reshape(x.shape), r.aux_loss, r.z_loss, r.tokens_per_expert)

    def update_expert_bias(self, tokens_per_expert: Tensor, rate: float = 1e-3) -> Tensor:
        """Aux-loss-free balancing: router.expert_bias += rate * sign(mean load - load), with the loads
        summed over the process group (torchrun) so every rank keeps the same bias."""
        return self.router.update_expert_bias(tokens_per_expert, rate, self.process_group)

    def _apply(self, fn, *args, **kwargs):
        # Module.to(device) / .cuda() / .cpu(): with backend='auto', follow the parameters to the new device
        # with a layer of the same configuration there.
        out = super()._apply(fn, *args, **kwargs)
        dev = self.w1.device
        if dev.type != self.layer.device.type or (dev.type == "cuda" and dev != self.layer.device):
            if self._layer_args["domain"] is not None:
                raise ValueError(f"device: this MoE runs on an rdep.torch.Domain on {self.layer.device}; it cannot "
                                 f"move to {dev} (build the modules on a Domain there)")
            if self._backend_arg != "auto":
                raise ValueError(f"device: this MoE was built with backend={self._backend_arg!r} "
                                 f"(device {self.layer.device}); it cannot move to {dev}. Use backend='auto'.")
            self.layer = Layer(backend="auto", device=dev, **self._layer_args)
        return out
