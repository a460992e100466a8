"""One variant's training run (train.py): the optimizer, the gradient clip and the step loop of one model,
a step at a time, so that train.py can run the variants one after the other (memory per variant) or
interleaved step by step (--interleave: both see the same machine state, for the tokens/s ratio).

A step: forward under bf16 autocast, backward, dense gradients averaged over ranks, the global-norm clip,
fused AdamW, the aux-loss-free bias update. Per step the record keeps the loss, tokens/s, torch's peak
memory and the memory outside torch's allocator (see train.py's docstring for what each figure counts).

Timing (--timing):
  synced      each step timed on the host between two device synchronizations: the step's host time and
              its device time add where they do not overlap (the GPU idles while the host prepares a step).
  overlapped  as a training loop that does not wait for the GPU each step runs: step s+1 is launched
              before step s is read back, and a step's time is the GPU timeline between the CUDA events that
              end step s-1 and step s. Where the host keeps ahead of the GPU that is the step's device time;
              where it does not, the GPU's idle time counts. The step's loss, gradient norm and expert load
              come back through one non-blocking copy per step (the loss summed over the ranks on the device);
              the per-step line is printed one step late, and across ranks the times and memory are reduced once
              at the end (the per-step lines show rank 0's times). A step whose loss is not finite stops the run one
              step late: the step launched after it is recorded too.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

from model import MoonlightLM

MIB = 2.0 ** 20


def expert_and_dense(model: MoonlightLM):
    experts = {id(p) for moe in model.moe_layers() for p in moe.expert_parameters()}
    ex = [p for p in model.parameters() if id(p) in experts]
    de = [p for p in model.parameters() if id(p) not in experts]
    return ex, de


BETAS, EPS = (0.9, 0.95), 1e-8


class MasterExpertOptimizer:
    """--expert-weights bf16-master (rdep), --baseline-expert-weights bf16-master (the baseline): rdep.torch.MasterAdamW
    over the routed experts (bf16 weights and
    gradients, fp32 master weights and moments: no casts, and half the gradient bytes), torch's fused AdamW over
    the rest, the same hyperparameters. The clip's coefficient reaches the experts through MasterAdamW's step
    (grad_multiplier) instead of a pass over their gradients. With --grad-accum the experts' micro-batch gradients
    are summed in fp32 (MasterAdamW(fp32_grads=True): each expert weight's `main_grad`)."""

    def __init__(self, dense: torch.optim.Optimizer, experts: torch.optim.Optimizer):
        self.dense, self.experts = dense, experts

    @property
    def param_groups(self) -> list:
        return self.dense.param_groups + self.experts.param_groups

    def step(self, grad_multiplier: Optional[torch.Tensor] = None) -> None:
        self.dense.step()
        self.experts.step(grad_multiplier=grad_multiplier)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none=set_to_none)
        self.experts.zero_grad(set_to_none=set_to_none)


def make_optimizer(model: MoonlightLM, a, device, kind: str = ""):
    """torch's AdamW (fused on CUDA: one kernel for all parameters; the foreach AdamW took ~40% of the GPU time of
    a step), or a MasterExpertOptimizer for rdep with --expert-weights bf16-master and for a baseline with
    --baseline-expert-weights bf16-master. Called before the first forward: MasterAdamW makes the experts bf16
    (their fp32 values become its master weights)."""
    setting = getattr(a, "expert_weights", "fp32") if kind == "rdep" else getattr(a, "baseline_expert_weights", "fp32")
    masters = setting == "bf16-master"
    experts = {id(p) for p in expert_and_dense(model)[0]} if masters else set()
    rest = [p for p in model.parameters() if id(p) not in experts]
    decay = [p for p in rest if p.dim() >= 2]
    other = [p for p in rest if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": a.weight_decay}, {"params": other, "weight_decay": 0.0}]
    dense = torch.optim.AdamW(groups, lr=a.lr, betas=BETAS, eps=EPS, fused=device.type == "cuda")
    if not masters:
        return dense
    import rdep.torch as rt

    expert_params = [p for p in model.parameters() if id(p) in experts]  # all >= 2-dim: decayed
    return MasterExpertOptimizer(dense, rt.MasterAdamW(expert_params, lr=a.lr, betas=BETAS, eps=EPS,
                                                       weight_decay=a.weight_decay, fp32_grads=a.grad_accum > 1))


def lr_at(step: int, a) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    frac = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


@torch.no_grad()
def sync_gradients(experts: list, dense: list, dd, scale_experts: bool = True) -> None:
    """Dense gradients averaged over ranks (one flat all-reduce); expert gradients scaled by 1/W (unless
    scale_experts is False: the caller folds 1/W into the optimizer's multiplier)."""
    if dd.group is None:
        return
    grads = [p.grad for p in dense if p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat, group=dd.group)
        flat /= dd.world
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()
    for p in experts if scale_experts else []:
        if p.grad is not None:
            p.grad.div_(dd.world)


@torch.no_grad()
def clip_gradients(experts: list, dense: list, max_norm: float, dd, scale_experts: bool = True,
                   expert_factor: float = 1.0, expert_grad_of=None):
    """Global gradient norm: dense (replicated, the same on every rank) plus the sum over ranks of the
    sharded experts' squares, each expert gradient taken times expert_factor (1/W where the caller has not divided
    them yet). Clips to max_norm when max_norm > 0 (the experts' gradients only with scale_experts; else the caller
    applies the returned coefficient to them, expert_factor included); returns (the norm, the experts' coefficient:
    the clip's times expert_factor, None when that is 1) as 0-dim tensors (no host wait: the caller reads them
    after the step). expert_grad_of(p): an expert's gradient (MasterAdamW.grad_of: its fp32 main_grad with
    fp32_grads); default p.grad. Multi-tensor kernels, as
    torch.nn.utils.clip_grad_norm_(foreach=True) and TorchTitan's trainer use: one read of each gradient for
    the norms, no temporary the size of a gradient, one pass to scale."""
    def sq(ps, grad_of=lambda p: p.grad):
        gs = [g for g in map(grad_of, ps) if g is not None]
        if not gs:
            return torch.zeros((), dtype=torch.float32, device=dd.device)
        return torch.stack(torch._foreach_norm(gs, 2, dtype=torch.float32)).square().sum()

    e2 = sq(experts, expert_grad_of) if expert_grad_of is not None else sq(experts)
    e2 = e2 * (expert_factor * expert_factor) if expert_factor != 1.0 else e2
    if dd.group is not None:
        dist.all_reduce(e2, group=dd.group)
    norm = (sq(dense) + e2).sqrt()
    scale = None
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        grads = [p.grad for p in (experts if scale_experts else []) + dense if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, scale)
    if scale_experts or expert_factor == 1.0:
        return norm, scale
    factor = torch.tensor(expert_factor, dtype=torch.float32, device=norm.device)
    return norm, factor if scale is None else scale * factor


class VariantRun:
    """A built model (train.build_model) and its optimizer, trained one step per step() call.
    measure_memory=False (interleaved runs, where the other model is resident too) leaves the memory
    figures out (None)."""

    def __init__(self, kind: str, note: str, model: MoonlightLM, corpus, a, dd, tokens_global: int,
                 measure_memory: bool = True):
        self.kind, self.model, self.corpus, self.a, self.dd = kind, model, corpus, a, dd
        self.cuda = dd.device.type == "cuda"
        self.memory = self.cuda and measure_memory
        self.tokens_global = tokens_global
        self.label = model.moe_layers()[0].label if model.moe_layers() else kind
        self.experts, self.dense = expert_and_dense(model)
        self.opt = make_optimizer(model, a, dd.device, kind)
        if isinstance(self.opt, MasterExpertOptimizer):
            self.label += " (bf16 experts, fp32 masters in rdep.torch.MasterAdamW)"
        self.n_dense = sum(p.numel() for p in self.dense)
        self.n_expert = sum(p.numel() for p in self.experts)
        self.rec = {"kind": kind, "label": self.label, "note": note, "loss": [], "tokens_per_s": [], "step_ms": [],
                    "peak_mem_mib": [], "device_used_mib": [], "peak_whole_mib": [], "grad_norm": [], "lr": [],
                    "max_load_ratio": []}
        self.overlapped = a.timing == "overlapped"
        if self.overlapped:
            self.rec["host_launch_ms"] = []
        if not measure_memory:
            self.rec["memory_note"] = "not measured: interleaved with another model resident on the device"
        self.prof = None
        self.peak_so_far = 0.0  # torch's peak over the steps (a --memory-step resets the allocator's own)
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.cuda else torch.autocast("cpu", enabled=False)
        self.alive = True  # False once the loss is not finite
        self.pending = None  # overlapped: the launched step not yet read back (_Launched)
        self.last_end = None  # overlapped: the end of the last step read back (a CUDA event, or perf_counter's time)
        model.train()

    def describe(self) -> str:
        return f"{self.label}: {self.n_dense / 1e6:.2f}M dense + {self.n_expert / 1e6:.2f}M expert parameters per process"

    def step(self, step: int) -> bool:
        """Trains one step; False (and no more steps) when the loss is not finite (with --timing overlapped,
        the loss of the step before, read back after this one was launched)."""
        a, dd, cuda = self.a, self.dd, self.cuda
        n = a.grad_accum  # micro-batch i of step s is batch s * n + i (with n = 1, batch s)
        micro = [self.corpus.batch("train", step * n + i, a.seed, dd.rank, dd.world, a.batch, dd.device) for i in range(n)]
        lr = lr_at(step, a)
        for g in self.opt.param_groups:
            g["lr"] = lr
        if a.profile_steps > 0 and step == a.profile_at:
            self.prof = start_profiler(cuda)
        if not self.overlapped or self.last_end is None:
            dd.sync()
            self.last_end = _mark_end(cuda)  # overlapped: the first step's start
        t0 = time.perf_counter()
        phases = PhasePeaks(dd, self.memory and step == a.memory_step,
                            f"{a.memory_snapshot}.{self.kind}.r{dd.rank}.pickle" if a.memory_snapshot else "")
        try:
            # Under the profiler each step is a named range, which bench/trace_kernels.py splits the trace's kernels by.
            with torch.profiler.record_function(f"train step {step}") if self.prof is not None else contextlib.nullcontext():
                loss, gnorm, loads = self._train_step(micro, phases)
                if not self.overlapped:
                    dd.sync()
        except BaseException:
            phases.stop_recording()
            self._check_rdep()  # raises the cause when an rdep barrier failed (inside a replay only a CUDA error shows)
            raise
        dt = time.perf_counter() - t0
        if phases.on:  # this step waited for the GPU between its phases: its memory report is complete now
            self.rec["memory_phases"] = phases.report(step, self.kind)
            self._report_rdep_memory()
        launched = _Launched(step, lr, dt, _step_figures(loss, gnorm, loads, cuda and self.overlapped, dd.group), phases)
        if self.overlapped:
            launched.end = _mark_end(cuda)
            self.rec["host_launch_ms"].append(dt * 1e3)  # the host's time to launch the step (>= step_ms: host-bound)
            if self.pending is not None:
                self._read_back(self.pending)
            self.pending = launched
        else:
            self._read_back(launched)
        if self.prof is not None and step == a.profile_at + a.profile_steps - 1:
            trace = f"{a.profile_trace}.{self.kind}.r{dd.rank}.json" if a.profile_trace else ""
            self.rec["profile"] = stop_profiler(self.prof, cuda, f"{self.label}, steps [{a.profile_at}, {step + 1})", dd, trace)
            self.prof = None
        return self.alive

    def _read_back(self, s: "_Launched") -> None:
        """Records a launched step: waits for its end (overlapped) and takes its figures off the device."""
        if self.overlapped:
            dt = _seconds_between(self.last_end, s.end)
            self.last_end = s.end
        else:
            dt = s.dt
        self._check_rdep()
        loss, gnorm, load_ratio = s.figures.tolist()
        self._record(s.step, s.lr, dt, loss, gnorm, None if math.isnan(load_ratio) else load_ratio, s.phases.peak())

    def flush(self) -> None:
        """Reads back the step still in flight (overlapped); finish() calls it."""
        if self.pending is not None:
            s, self.pending = self.pending, None
            self._read_back(s)

    def _check_rdep(self) -> None:
        """Raises what rdep's device barriers recorded, if anything (Layer.check_errors: no CUDA call). Under
        reduce-overhead with several ranks rdep's calls are graph replays, which report nothing on the host; a
        barrier that fails there traps, and torch's next synchronization raises a bare CUDA error."""
        if self.kind == "rdep":
            for m in self.model.moe_layers():
                m.moe.layer.check_errors()

    def _train_step(self, micro, phases):
        """(the micro-batches' mean loss, the gradient norm on the device, each MoE layer's expert load over the step)."""
        if self.a.compile_mode == "reduce-overhead":
            # A new step: the last step's graph outputs may be reused. Once a step, not once a micro-batch: the
            # gradients a micro-batch's backward leaves in .grad (graph outputs) are still alive for the next one.
            torch.compiler.cudagraph_mark_step_begin()
        losses, scale = [], 1.0 / len(micro)
        for i, (x, y) in enumerate(micro):
            with self.autocast:
                loss, router_loss = self.model(x, y)
            phases.mark("forward" if i == 0 else f"forward.{i}")  # each micro-batch's phases kept apart
            ((loss + router_loss) * scale if scale != 1.0 else loss + router_loss).backward()
            phases.mark("backward" if i == 0 else f"backward.{i}")
            # A copy per micro-batch (a graph output's memory may be reused by the next replay); none with one.
            losses.append(loss.detach() if len(micro) == 1 else loss.detach().clone())
        loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        # With MasterAdamW the experts' 1/W and clip coefficient are its step's multiplier, not passes over them
        # (and not a bf16 rounding of the 1/W division).
        folded = isinstance(self.opt, MasterExpertOptimizer)
        sync_gradients(self.experts, self.dense, self.dd, scale_experts=not folded)
        factor = 1.0 / self.dd.world if folded and self.dd.group is not None else 1.0
        gnorm, scale = clip_gradients(self.experts, self.dense, self.a.clip, self.dd, scale_experts=not folded,
                                      expert_factor=factor, expert_grad_of=self.opt.experts.grad_of if folded else None)
        phases.mark("clip")
        if folded:
            self.opt.step(grad_multiplier=scale)
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        phases.mark("optimizer")
        loads = [moe.step_load() for moe in self.model.moe_layers()]
        for moe in self.model.moe_layers():
            moe.update_bias(self.a.bias_rate)
        return loss, gnorm, loads

    def _reduce_over_ranks(self) -> None:
        """Overlapped: the per-step times and memory, kept per rank during the run, reduced over the ranks in one go
        (the maximum, as synced timing reduces them each step; the loss was summed on the device each step)."""
        dd, rec = self.dd, self.rec
        if dd.group is None or not rec["step_ms"]:
            return
        n = len(rec["step_ms"])
        nan = float("nan")
        mem = lambda k: [nan if v is None else v for v in rec[k]]  # noqa: E731
        both = dd.reduce(rec["step_ms"] + mem("peak_mem_mib") + mem("device_used_mib") + mem("peak_whole_mib"), "max")
        rec["step_ms"] = both[:n]
        rec["tokens_per_s"] = [self.tokens_global / (ms / 1e3) for ms in rec["step_ms"]]
        if self.memory:
            rec["peak_mem_mib"], rec["device_used_mib"], rec["peak_whole_mib"] = both[n:2 * n], both[2 * n:3 * n], both[3 * n:]

    def _report_rdep_memory(self) -> None:
        """rdep's own device memory per rank (outside torch's allocator): its domains' regions."""
        import rdep.torch as rt

        domains = {id(m.layer.domain): m.layer.domain for m in self.model.modules() if isinstance(m, rt.MoE)}
        if not domains:
            return
        mem = [d.memory() for d in domains.values()]
        sym = sum(m["symmetric_bytes_per_rank"] for m in mem) / MIB
        shared = sum(m["shared_bytes_per_rank"] for m in mem) / MIB
        self.rec["rdep_domain_mib"] = {"symmetric": sym, "shared": shared}
        self.dd.print(f"[{self.kind:>10}] rdep's domain regions per rank: {sym:.1f} MiB symmetric, {shared:.1f} MiB shared "
                      f"(rdep.torch.Domain.memory(), {len(domains)} domain(s))")

    def _record(self, step: int, lr: float, dt: float, loss: float, gnorm: float, load_ratio, phase_peak: float) -> None:
        a, dd, rec = self.a, self.dd, self.rec
        # Routing balance: max over MoE layers of (busiest expert's rows / mean rows), this process's tokens.
        rec["max_load_ratio"].append(load_ratio)
        # Overlapped: no collective per step (its wait would hold the host until the step in flight ends); times and
        # memory are reduced over the ranks once, in finish(). The loss came summed over the ranks (_step_figures).
        reduce = (lambda v, op: v) if self.overlapped else dd.reduce
        peak = used = whole = float("nan")
        if self.memory:
            self.peak_so_far = max(self.peak_so_far, phase_peak, torch.cuda.max_memory_allocated(dd.device) / MIB)
            peak = self.peak_so_far
            free, total = torch.cuda.mem_get_info(dd.device)
            used = (total - free) / MIB
            # Device memory outside torch's allocator (the CUDA context, libraries' workspaces and, for rdep,
            # the layers' own buffers and pooled contexts, allocated once) added to torch's peak.
            whole = peak + max(0.0, used - torch.cuda.memory_reserved(dd.device) / MIB)
        dt_max, peak_max, used_max, whole_max = reduce([dt, peak, used, whole], "max")
        rec["loss"].append(loss / dd.world)
        rec["tokens_per_s"].append(self.tokens_global / dt_max)
        rec["step_ms"].append(dt_max * 1e3)
        rec["peak_mem_mib"].append(peak_max if self.memory else None)
        rec["device_used_mib"].append(used_max if self.memory else None)
        rec["peak_whole_mib"].append(whole_max if self.memory else None)
        rec["grad_norm"].append(gnorm)
        rec["lr"].append(lr)
        if not math.isfinite(rec["loss"][-1]):
            if self.alive:  # overlapped: the step launched after it is read back too, and may print the same
                dd.print(f"step {step}: loss is {rec['loss'][-1]}; stopping this variant")
            self.alive = False
        elif step % a.print_every == 0 or step == a.steps - 1:
            mem = f"peak {peak_max:9.1f} MiB" if self.memory else "peak mem n/a"
            lr_ = rec["max_load_ratio"][-1]
            who = " (rank 0's time)" if self.overlapped and dd.world > 1 else ""
            dd.print(f"[{self.kind:>10}] step {step:4d}{who} | loss {rec['loss'][-1]:.4f} | {self.tokens_global / dt_max:10,.0f} tok/s"
                     f" | {dt_max * 1e3:8.1f} ms | {mem} | gnorm {gnorm:.3f}"
                     + (f" | max/mean expert load {lr_:.2f}" if lr_ is not None else ""))

    def finish(self) -> dict:
        """The validation loss and the medians; closes the model's MoE layers and frees the model."""
        a, dd, rec, model = self.a, self.dd, self.rec, self.model
        self.flush()
        if self.overlapped:
            self._reduce_over_ranks()
        rec["timing"] = a.timing
        model.eval()
        val = []
        with torch.no_grad(), self.autocast:
            for i in range(a.eval_batches):
                x, y = self.corpus.batch("val", i, a.seed, dd.rank, dd.world, a.batch, dd.device)
                val.append(float(model(x, y)[0]))
        rec["val_loss"] = dd.reduce([sum(val) / max(1, len(val))])[0] / dd.world if val else None
        # Medians over the steps after the first few, profiled steps left out.
        skip = min(a.warmup_steps_timing, max(0, len(rec["tokens_per_s"]) - 1))
        profiled = set(range(a.profile_at, a.profile_at + a.profile_steps)) | ({a.memory_step} if self.memory else set())
        if self.overlapped:  # a step that waited for the GPU (profiler, memory phases) delays the next one's start
            profiled |= {t + 1 for t in profiled}
        timed = [t for t in range(skip, len(rec["step_ms"])) if t not in profiled] or list(range(len(rec["step_ms"])))
        rec["timed_steps"] = [timed[0], timed[-1] + 1] if timed else None
        rec["tokens_per_s_median"] = statistics.median(rec["tokens_per_s"][t] for t in timed) if timed else None
        rec["step_ms_median"] = statistics.median(rec["step_ms"][t] for t in timed) if timed else None
        mem = self.memory and rec["peak_mem_mib"]
        rec["peak_mem_mib_max"] = max(rec["peak_mem_mib"]) if mem else None
        rec["device_used_mib_max"] = max(rec["device_used_mib"]) if mem else None
        rec["peak_whole_mib_max"] = max(rec["peak_whole_mib"]) if mem else None
        if self.kind == "rdep" and model.moe_layers():
            try:
                rec["rdep_layer"] = model.moe_layers()[0].moe.layer.describe()
            except Exception as e:  # describe() is informational
                rec["rdep_layer"] = f"describe failed: {e}"
            layers = [m.moe.layer for m in model.moe_layers()]
            # Whether rdep's ops could be recorded in CUDA graphs, and the contexts graphs did record (pinned).
            rec["rdep_capturable"] = all(l.capturable for l in layers)
            rec["rdep_pinned_contexts"] = sum(l.pinned_contexts for l in layers)
            dd.print(f"[{self.kind:>10}] capturable ops: {rec['rdep_capturable']} | contexts CUDA graphs recorded: "
                     f"{rec['rdep_pinned_contexts']}")
        rec["parameters"] = {"dense_per_process": self.n_dense, "expert_per_process": self.n_expert}
        for moe in model.moe_layers():
            moe.close()
        del self.model, self.opt, self.experts, self.dense, model
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        return rec


class PhasePeaks:
    """--memory-step: torch's peak allocated memory within each phase of one step (the allocator's peak is
    reset at each mark, after waiting for the GPU); peak_before keeps the run's peak up to that step."""

    def __init__(self, dd, on: bool, snapshot: str = ""):
        self.dd, self.on, self.peaks, self.snapshot = dd, on, {}, snapshot if on else ""
        self.peak_before = 0.0
        if on:
            dd.sync()
            if self.snapshot:
                torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
            self.peak_before = torch.cuda.max_memory_allocated(dd.device) / MIB
            torch.cuda.reset_peak_memory_stats(dd.device)

    def mark(self, phase: str) -> None:
        if not self.on:
            return
        self.dd.sync()
        dev = self.dd.device
        self.peaks[phase] = (torch.cuda.max_memory_allocated(dev) / MIB, torch.cuda.memory_allocated(dev) / MIB)
        torch.cuda.reset_peak_memory_stats(dev)

    def peak(self) -> float:
        """The run's peak before this step and this step's phases' peaks (0 when off)."""
        return max([self.peak_before] + [pk for pk, _ in self.peaks.values()])

    def stop_recording(self) -> None:
        if self.snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)

    def report(self, step: int, kind: str) -> dict:
        if self.snapshot:
            torch.cuda.memory._dump_snapshot(self.snapshot)
            self.stop_recording()
            self.dd.print(f"wrote {self.snapshot}")
        text = ", ".join(f"{p} peak {pk:.1f} (after {now:.1f})" for p, (pk, now) in self.peaks.items())
        self.dd.print(f"[{kind:>10}] step {step} torch memory MiB by phase: {text}")
        return {p: {"peak_mib": pk, "after_mib": now} for p, (pk, now) in self.peaks.items()}


class _Launched:
    """A step launched and not yet recorded: its figures (a tensor on the host, filled by a non-blocking copy
    when overlapped) and, overlapped, the event that ends it."""

    def __init__(self, step: int, lr: float, dt: float, figures: torch.Tensor, phases: "PhasePeaks"):
        self.step, self.lr, self.dt, self.figures, self.phases = step, lr, dt, figures, phases
        self.end = None


def _step_figures(loss: torch.Tensor, gnorm: torch.Tensor, loads, non_blocking: bool, group) -> torch.Tensor:
    """[loss summed over the ranks, gradient norm, max over MoE layers of this process's busiest expert's rows /
    mean rows (nan: no load)] in float64 on the host, taken from the device in one copy; non_blocking: into pinned
    memory, valid once the step's end event has passed. Enqueued right after the step, before the next step's graph
    replays may reuse their outputs. The loss's sum is a collective enqueued like the rest (no host wait), so every
    rank sees the same loss and stops at the same step when it is not finite."""
    ratios = [ld.max().double() / ld.double().mean().clamp_min(1e-9) for ld in loads if ld is not None]
    ratio = torch.stack(ratios).max() if ratios else torch.full((), float("nan"), dtype=torch.float64, device=loss.device)
    loss_sum = loss.detach().double().reshape(()).clone()
    if group is not None:
        dist.all_reduce(loss_sum, group=group)
    dev = torch.stack([loss_sum, gnorm.double().reshape(()), ratio])
    if not non_blocking:
        return dev.cpu()
    host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
    host.copy_(dev, non_blocking=True)
    return host


def _mark_end(cuda: bool):
    """A point on the step timeline: a CUDA event recorded on the current stream, or the host's time."""
    if not cuda:
        return time.perf_counter()
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def _seconds_between(start, end) -> float:
    if isinstance(end, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def start_profiler(cuda: bool):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=acts)
    prof.__enter__()
    return prof


def stop_profiler(prof, cuda: bool, title: str, dd, trace: str = "") -> str:
    prof.__exit__(None, None, None)
    if trace:
        prof.export_chrome_trace(trace)
        dd.print(f"wrote {trace}")
    table = ""
    for key in (("self_device_time_total", "self_cuda_time_total") if cuda else ("self_cpu_time_total",)):
        try:
            table = prof.key_averages().table(sort_by=key, row_limit=30)
            break
        except Exception:  # the key's name differs between torch versions
            continue
    dd.print(f"--- profile: {title}\n{table}")
    return table


