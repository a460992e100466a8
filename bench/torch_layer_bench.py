"""What the PyTorch binding adds to the layer: rdep.torch.moe (custom op, autograd, validation, ctypes
call, stream joins) timed like `rdep bench layer --ranks 1` at the same shape, on one GPU.

Forward: y = moe(layer, x, experts, gates, w1, w2) with x, gates, w1, w2 requiring grad (a context is
saved, as in training; it is released when y is dropped). Forward+backward: the same, then
y.backward(dy). Each iteration is timed with CUDA events on the current stream (p50 / p99 over the
measured window after warmup). Weights bf16 (as the C++ benchmark's), and so their gradients, which the
layer's GEMMs write directly (`rdep bench layer --grads bf16` binds the same).
Routing: each token's K experts drawn uniformly without replacement, gates a softmax over them (the
distribution of `rdep bench layer --routing uniform`, not the same draw), or with --routing-from the draw
`rdep bench layer --routing-out FILE` wrote (the same rows per expert: what graph1 compares).

    python3 bench/torch_layer_bench.py --expert-compute cutlass --json out.json
Compare with, in the same device call (bf16 weight gradients there too, the same work):
    build-dev/bin/rdep bench layer --ranks 1 --expert-compute cutlass --grads bf16 --json layer.json
--graph also times replays of the forward and the forward+backward captured in CUDA graphs (the capturable ops),
beside `rdep bench layer --graph` (scripts/receipts_w4.sh graph1).

Under torchrun (WORLD_SIZE > 1; one rank a process, a GPU each, NCCL): the per-process layer, each rank its own
tokens (seed + rank, or its file FILE.rank<r> from `rdep bench layer --ranks W --routing-out FILE`) and its
experts' slices of one seeded draw of all E experts' weights; per iteration the max over ranks (DESIGN.md's
max-rank protocol, as `rdep bench layer --ranks W --gpus W`), printed and written by rank 0. scripts/receipts_w4.sh
binding2 compares it with the C++ layer at W = 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def percentile(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(round(q / 100.0 * (len(s) - 1))))]


def read_routing(path: str, tokens: int, topk: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's routing as `rdep bench layer --routing-out` writes it: int64 tokens, int64 topk, int32 experts, fp32
    gates."""
    with open(path, "rb") as f:
        data = f.read()
    head = torch.frombuffer(bytearray(data[:16]), dtype=torch.int64)
    T, K = int(head[0]), int(head[1])
    if (T, K) != (tokens, topk):
        raise SystemExit(f"torch_layer_bench: --routing-from {path} holds tokens {T}, topk {K}; the flags say "
                         f"--tokens {tokens} --topk {topk}")
    if len(data) != 16 + 8 * T * K:
        raise SystemExit(f"torch_layer_bench: --routing-from {path}: {len(data)} bytes, expected {16 + 8 * T * K}")
    ids = torch.frombuffer(bytearray(data[16:16 + 4 * T * K]), dtype=torch.int32).view(T, K).clone()
    gates = torch.frombuffer(bytearray(data[16 + 4 * T * K:]), dtype=torch.float32).view(T, K).clone()
    if int(ids.min()) < 0 or int(ids.max()) >= experts:
        raise SystemExit(f"torch_layer_bench: --routing-from {path}: expert ids outside [0, {experts})")
    if not bool(torch.isfinite(gates).all()) or bool((gates < 0).any()):
        raise SystemExit(f"torch_layer_bench: --routing-from {path}: gates must be finite and >= 0")
    return ids, gates


def make_inputs(a, device, dtype, rank: int = 0, world: int = 1, local_experts: range | None = None):
    """x, experts, gates, w1, w2, dy of this process's rank: its tokens drawn from seed + rank (seed at W = 1) or read
    from --routing-from (FILE at W = 1, FILE.rank<r> above), its experts' slices of all E experts' weights. (Since the
    sixteenth session the weights come from a generator of their own and dy right after x, so W = 1's x routing and x
    are those of earlier receipts, its weights and dy not: the same distributions, for timing.)"""
    g = torch.Generator(device="cpu").manual_seed(a.seed + rank)
    T, H, F, E, K = a.tokens, a.hidden, a.ffn, a.experts, a.topk
    experts = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
    gates = torch.softmax(torch.randn(T, K, generator=g), dim=1)
    if a.routing_from:
        experts, gates = read_routing(a.routing_from if world == 1 else f"{a.routing_from}.rank{rank}", T, K, E)
    x = torch.randn(T, H, generator=g).to(dtype)
    dy = torch.randn(T, H, generator=g).to(dtype)
    gw = torch.Generator(device="cpu").manual_seed(a.seed)  # every rank the same draw of all experts
    w1 = (torch.randn(E, H, 2 * F, generator=gw) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, F, H, generator=gw) / F ** 0.5).to(dtype)
    if local_experts is not None:
        w1, w2 = w1[local_experts.start:local_experts.stop], w2[local_experts.start:local_experts.stop]
    out = [t.to(device).unsqueeze(0) if t.dim() == 2 else t.to(device) for t in (x, experts, gates, w1, w2, dy)]
    x, experts, gates, w1, w2, dy = out
    for t in (x, gates, w1, w2):
        t.requires_grad_(True)
    return x, experts, gates, w1, w2, dy


def time_loop(fn, warmup: int, iters: int, cuda: bool = True) -> tuple[list[float], list[float]]:
    """GPU time per call and host time per call, in ms. GPU: events on the current stream around each call,
    back to back; as `rdep bench layer` does, the loop synchronizes only at its end, so a layer that does
    not wait on the host lets the host run ahead and the events time the GPU's work. Host: the Python
    call's wall time, each call issued on an idle device (synchronized before it, outside the time): what
    the host spends issuing the call (and any wait of the layer: with cuBLASLt one per forward for the
    per-expert counts), not the back-pressure of a full launch queue, which would pace a back-to-back loop
    at the device's rate. Without CUDA (the host backend) both are the wall time per call."""
    for _ in range(warmup):
        fn()
    if not cuda:
        host = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
        return list(host), host
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    host = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in events], host


def eager_ab_rows(eager: dict, rounds: int, warmup: int, iters: int, cuda: bool, rows: dict, host: dict) -> None:
    """--eager-ab: each eager call timed with rdep.torch's eager C++ path (rows by its name) and with the Python path
    (name + " py"), alternated in `rounds` rounds of iters // rounds calls each, so that a drift of the host's speed falls
    on both alike."""
    from rdep.torch import eager_ext

    if eager_ext.module() is None:
        raise SystemExit("torch_layer_bench: --eager-ab needs rdep.torch's eager C++ path, which did not build here")
    per_round = max(1, iters // rounds)
    try:
        for _ in range(rounds):
            for on in (True, False):
                eager_ext.enabled = on
                for name, fn in eager.items():
                    key = name if on else f"{name} py"
                    t, h = time_loop(fn, warmup, per_round, cuda)
                    rows.setdefault(key, []).extend(t)
                    host.setdefault(key, []).extend(h)
    finally:
        eager_ext.enabled = True


def layer_calls(rt, layer, x, experts, gates, w1, w2, dy, compiled: bool) -> dict:
    """The timed calls by name: forward (a context saved, as in training, and released when y is dropped) and
    forward+backward, eagerly; with `compiled` also both through a torch.compile'd function of the op alone."""

    def make(moe):
        def forward():
            y = moe(x, experts, gates, w1, w2)
            del y

        def forward_backward():
            y = moe(x, experts, gates, w1, w2)
            y.backward(dy)
            x.grad = gates.grad = w1.grad = w2.grad = None

        return forward, forward_backward

    def eager(*args):
        return rt.moe(layer, *args)

    out = dict(zip(("forward", "forward+backward"), make(eager)))
    if compiled:
        out.update(zip(("compiled forward", "compiled f+b"), make(torch.compile(eager, fullgraph=True))))
    return out


def stack_calls(rt, make_layer, layer, x, experts, gates, w1, w2, dy, n: int) -> tuple[dict, list]:
    """--stack N: N layers configured alike on one domain (this one and N - 1 more, each with its own copy of the weights) chained as a
    model chains its MoE blocks (each layer's y is the next one's x, the same routing), then one backward through all N:
    the eager forward+backward of a model's N rdep layers, in which autograd's engine hands the backward to its device
    thread once for all N. Compare with N times the C++ layer's forward+backward. Returns (calls, the extra layers)."""
    layers = [layer]
    try:
        for _ in range(n - 1):
            layers.append(make_layer())
    except BaseException:
        for extra in layers[1:]:
            extra.close()
        raise
    weights = [(w1, w2)] + [(w1.detach().clone().requires_grad_(True), w2.detach().clone().requires_grad_(True))
                            for _ in range(n - 1)]
    leaves = [x, gates] + [w for pair in weights for w in pair]

    def forward():
        h = x
        for lay, (a1, a2) in zip(layers, weights):
            h = rt.moe(lay, h, experts, gates, a1, a2)
        return h

    def forward_backward():
        forward().backward(dy)
        for t in leaves:
            t.grad = None

    return {f"stack{n} f+b": forward_backward}, layers[1:]


def graph_calls(rt, layer, x, experts, gates, w1, w2, dy) -> dict:
    """--graph: the forward and the forward+backward (torch.autograd.grad: no .grad accumulation) each captured
    once in a CUDA graph with torch.cuda.graph, after two warm-up calls on a side stream as torch's docs say, and
    timed by replaying the graph on the same inputs: the calls' device work with no host work between them (the
    C++ counterpart: `rdep bench layer --graph`). Needs a capturable layer (rdep.torch.Layer.capturable)."""

    def forward():
        return rt.moe(layer, x, experts, gates, w1, w2)

    def forward_backward():
        return torch.autograd.grad(rt.moe(layer, x, experts, gates, w1, w2), (x, gates, w1, w2), dy)

    replays, held = {}, []
    for name, fn in (("graph forward", forward), ("graph f+b", forward_backward)):
        graph, outputs = captured(fn)
        held.append((graph, outputs))  # the graph's output tensors live as long as the graph is replayed
        replays[name] = graph.replay
    replays["graph forward (C calls)"], c_graph = c_forward_graph(layer, x, experts, gates, w1, w2)
    held.append(c_graph)
    replays["_held"] = held
    return replays


class _CGraph:
    """The C-calls graph with what its replays use (y, the rows, the context): dropped, it destroys the graph first and
    then releases the context, so no replay can follow the release (graph_calls' `held`; drop its replay functions too)."""

    def __init__(self, layer, c_id: int, keep: tuple):
        self.layer, self.c_id, self.keep = layer, c_id, keep
        self.graph = None

    def __del__(self):
        self.graph = None  # its executable graph is destroyed with it
        self.layer._native.release(self.c_id)


def c_forward_graph(layer, x, experts, gates, w1, w2):
    """--graph: the same forward as the C ABI alone issues it: rdep_layer_forward_arena on a context held here, y and
    the saved rows allocated once, no torch op and no rdep.torch code in the capture (the C++ layer's calls, made from
    this process on this layer and these tensors). Replayed beside "graph forward", the difference is what rdep.torch's
    capturable forward adds to a replay, free of the two processes' differences. Returns (replay, a keep-alive that
    releases the context: a _CGraph)."""
    import ctypes

    from rdep import _capi
    from rdep.torch import layer_calls

    lib, ptr = _capi.lib(), layer._live_ptr()
    y = torch.empty_like(x)
    rows = torch.empty(layer.row_bytes, dtype=torch.uint8, device=x.device)
    io = layer_calls._new_io(layer)
    io[0].num_tokens, io[0].x, io[0].y = x.shape[1], x.data_ptr(), y.data_ptr()
    io[0].experts, io[0].gates = experts.data_ptr(), gates.data_ptr()
    layer_calls._fill_weights(io, layer, w1.detach(), w2.detach())
    c_id, used = ctypes.c_int64(), ctypes.c_size_t()
    _capi.check(lib.rdep_context_acquire(ptr, ctypes.byref(c_id)), "rdep_context_acquire")
    held = _CGraph(layer, c_id.value, (y, rows, io))

    def forward():
        io[0].stream = torch.cuda.current_stream().cuda_stream
        with layer._native.lock:
            _capi.check(lib.rdep_layer_forward_arena(ptr, c_id.value, io, 1, rows.data_ptr(), layer.row_bytes,
                                                     ctypes.byref(used)), "rdep_layer_forward_arena")

    held.graph, _ = captured(forward)
    return held.graph.replay, held


def captured(fn):
    """fn called twice on a side stream (as torch's docs say to warm up before a capture), then captured once in a CUDA
    graph; returns (the graph, what the captured call returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def kernel_table(fn, calls: int) -> list[dict]:
    """fn called `calls` times under torch.profiler (CUDA activity; kernels inside a replayed CUDA graph are
    traced one by one): per kernel name, launches and device µs per call, largest first; `torch` marks the
    kernels of PyTorch's own operators (at::), the rest being the library's (rdep's and CUTLASS's)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    by_name: dict[str, dict] = {}
    spans = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        spans.append((ev.time_range.start, ev.time_range.end))
        row = by_name.setdefault(ev.name, {"name": ev.name, "launches": 0, "us": 0.0, "torch": "at::" in ev.name})
        row["launches"] += 1
        row["us"] += ev.time_range.elapsed_us()
    table = sorted(by_name.values(), key=lambda r: -r["us"])
    for row in table:
        row["launches"] /= calls
        row["us"] /= calls
    busy, idle = busy_and_idle(spans)
    table.append({"name": "(busy: the union of the kernels' intervals)", "launches": 0.0, "us": busy / calls,
                  "torch": None})
    table.append({"name": "(idle between the first kernel and the last, the gaps between calls included)",
                  "launches": 0.0, "us": idle / calls, "torch": None})
    return table


def busy_and_idle(spans: list) -> tuple[float, float]:
    """The union of the [start, end) intervals (µs) and the time between the first start and the last end
    that none covers."""
    if not spans:
        return 0.0, 0.0
    spans.sort()
    busy, (lo, hi) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            busy, lo = busy + (hi - lo), a
        hi = max(hi, b)
    busy += hi - lo
    return busy, (max(b for _, b in spans) - spans[0][0]) - busy


def print_kernel_table(name: str, table: list[dict], calls: int) -> None:
    lib_us = sum(r["us"] for r in table if r["torch"] is False)
    torch_us = sum(r["us"] for r in table if r["torch"])
    print(f"kernels of one {name} call (mean of {calls}; device µs; the library's {lib_us:.1f}, torch's {torch_us:.1f}):")
    for r in table:
        print(f"  {r['us']:9.1f} {r['launches']:6.2f}x  {'torch ' if r['torch'] else '      '}{r['name'][:110]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--expert-compute", default="auto", choices=["auto", "cublaslt", "cutlass"],
                   help="the layer's expert compute (cutlass: no host wait, as rdep bench layer --expert-compute cutlass)")
    p.add_argument("--gate-in-expert", action="store_true",
                   help="the gate before W2 (as rdep bench layer --gate-in-expert); off otherwise, as the C++ bench's default")
    p.add_argument("--profile", type=int, default=0,
                   help="after the timing: N forward+backward iterations under torch.profiler (CPU and CUDA), the host "
                        "time by operation and CUDA runtime call (self CPU time)")
    p.add_argument("--host-breakdown", type=int, default=0,
                   help="after the timing: N more calls of each kind with the host time split into the C library's "
                        "calls (each rdep_* function, timed around the ctypes call), torch's caching-allocator calls "
                        "made from the layer's row allocator, and the rest (Python: the custom op's dispatch, "
                        "autograd, validation); eager, and with --compile also through a torch.compile'd function")
    p.add_argument("--routing-from", default="",
                   help="time the binding on the routing `rdep bench layer --routing-out FILE` wrote (the same per-expert "
                        "rows, so the same GEMM tiles, as the C++ benchmark's) instead of its own; under torchrun each "
                        "rank reads FILE.rank<r>")
    p.add_argument("--kernels", type=int, default=0,
                   help="after the timing: N forward+backward calls under torch.profiler's CUDA activity (eager, and with "
                        "--graph the replays of each captured graph, the C calls' own too, with --stack N the stack's "
                        "call): every kernel's device time per call, the library's kernels apart from torch's (what the "
                        "binding launches beside the layer)")
    p.add_argument("--cprofile", type=int, default=0,
                   help="after the timing: N calls of each forward+backward kind under cProfile (Python's own time)")
    p.add_argument("--native-profile", type=float, default=0, metavar="SECONDS",
                   help="sample the eager forward and forward+backward natively with py-spy for SECONDS each, each call on an "
                        "idle device, and print where their host time goes (bench/native_host_profile.py; CUDA)")
    p.add_argument("--timeline", type=int, default=0, metavar="N",
                   help="N eager forward+backward calls with clock reads around rdep's backward formula, with the autograd "
                        "engine's device thread and without it (bench/backward_timeline.py; CUDA)")
    p.add_argument("--stack", type=int, default=1, metavar="N",
                   help="also time the eager forward+backward of N layers chained as a model's MoE blocks, one backward "
                        "through all (compare with N times rdep bench layer's forward+backward)")
    p.add_argument("--eager-ab", type=int, default=0, metavar="R",
                   help="time the eager calls (and --stack, --timeline) with rdep.torch's eager C++ path and with its "
                        "Python path (rows marked 'py'), alternated in R rounds (rdep/torch/eager_ext.py)")
    p.add_argument("--compile", action="store_true",
                   help="also time the calls through a torch.compile'd function (as the training example calls the op)")
    p.add_argument("--graph", action="store_true",
                   help="also capture the forward and the forward+backward in CUDA graphs and time their replays "
                        "(needs a capturable layer: --expert-compute cutlass or auto on sm_90)")
    p.add_argument("--backend", choices=["cuda", "host"], default="cuda" if torch.cuda.is_available() else "host",
                   help="cuda (the measurement: bf16) or host (fp32 CPU tensors, the host backend: the binding's "
                        "host time on this machine's CPU, wall times only) [cuda where there is a GPU]")
    p.add_argument("--json", default="")
    a = p.parse_args()
    if a.stack < 1:
        print(f"torch_layer_bench: --stack takes a number of layers >= 1, got {a.stack}", file=sys.stderr)
        return 2
    cuda = a.backend == "cuda"
    if cuda and not torch.cuda.is_available():
        print("torch_layer_bench: no CUDA device (--backend host runs the host backend)", file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        per_process = [f for f in ("kernels", "profile", "host_breakdown", "cprofile", "native_profile", "timeline")
                       if getattr(a, f)] + (["stack"] if a.stack > 1 else [])
        if not cuda or per_process:
            print(f"torch_layer_bench: under torchrun (WORLD_SIZE={world}) it times the CUDA layer's calls only "
                  f"(refused: {'--backend host' if not cuda else ', '.join('--' + f.replace('_', '-') for f in per_process)})",
                  file=sys.stderr)
            return 2
    import rdep.torch as rt

    device, group, rank = torch.device("cpu"), None, 0
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
        torch.cuda.set_device(device)
    if world > 1:
        import torch.distributed as dist

        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
        dist.init_process_group("nccl", device_id=device)
        group, rank = dist.group.WORLD, dist.get_rank()
    options = dict(expert_compute=a.expert_compute, gate_in_expert=a.gate_in_expert) if cuda else {}
    if world > 1:  # the processes' warm-ups (and --compile's compiles) may differ by more than the default 30 s
        options["barrier_timeout_s"] = 300.0
    layer = rt.Layer(a.hidden, a.ffn, a.experts, a.topk, a.tokens, world_size=world, backend=a.backend, device=device,
                     process_group=group, **options)
    x, experts, gates, w1, w2, dy = make_inputs(a, device, torch.bfloat16 if cuda else torch.float32, rank, world,
                                                layer.local_experts if world > 1 else None)

    if a.graph and not layer.capturable:
        print(f"torch_layer_bench: --graph needs a capturable layer (CUDA, expert_compute cutlass); this one is "
              f"{a.backend}, expert_compute {getattr(layer, 'expert_compute', 'n/a')}", file=sys.stderr)
        return 2
    calls = layer_calls(rt, layer, x, experts, gates, w1, w2, dy, a.compile)
    stack, stacked = {}, []
    if a.stack > 1:
        # On the first layer's domain, as a model's MoE layers are (the training example's): its regions held once.
        make = lambda: rt.Layer(a.hidden, a.ffn, a.experts, a.topk, a.tokens, domain=layer.domain, **options)  # noqa: E731
        stack, stacked = stack_calls(rt, make, layer, x, experts, gates, w1, w2, dy, a.stack)
    rows, host = {}, {}
    if a.eager_ab > 0:
        eager = {k: v for k, v in {**calls, **stack}.items() if not k.startswith("compiled")}
        eager_ab_rows(eager, a.eager_ab, a.warmup, a.iters, cuda, rows, host)
        for name, fn in calls.items():
            if name.startswith("compiled"):
                rows[name], host[name] = time_loop(fn, a.warmup, a.iters, cuda)
    else:
        for name, fn in {**calls, **stack}.items():
            rows[name], host[name] = time_loop(fn, a.warmup, a.iters, cuda)
    if a.graph:
        replays = graph_calls(rt, layer, x, experts, gates, w1, w2, dy)
        held = replays.pop("_held")
        for name, fn in replays.items():
            rows[name], host[name] = time_loop(fn, a.warmup, a.iters, cuda)
    forward_backward = calls["forward+backward"]
    kernels = {}
    for flag, on in (("--kernels", a.kernels > 0), ("--timeline", a.timeline > 0), ("--native-profile", a.native_profile > 0)):
        if on and not cuda:
            print(f"torch_layer_bench: {flag} times CUDA calls; the host backend has none (ignored)", file=sys.stderr)
    if a.kernels > 0 and cuda:
        kernels["forward+backward"] = kernel_table(forward_backward, a.kernels)
        if a.graph:
            kernels["graph forward"] = kernel_table(replays["graph forward"], a.kernels)
            kernels["graph f+b"] = kernel_table(replays["graph f+b"], a.kernels)
            kernels["graph forward (C calls)"] = kernel_table(replays["graph forward (C calls)"], a.kernels)
        for name, fn in stack.items():
            kernels[name] = kernel_table(fn, a.kernels)
        for name, table in kernels.items():
            print_kernel_table(name, table, a.kernels)
    if a.graph:
        del replays, held  # the graphs first (their replay functions hold them), then their contexts
    for extra in stacked:
        extra.close()
    if world > 1:
        rows, host = max_over_ranks(rows), max_over_ranks(host)
        experts = gather_experts(experts)
    if a.profile > 0:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            for _ in range(a.profile):
                forward_backward()
            if cuda:
                torch.cuda.synchronize()
        print(f"torch.profiler over {a.profile} forward+backward calls (self CPU time: host work by operation):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    peak = None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        forward_backward()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        if world > 1:
            peak = max(max_over_ranks({"peak": [peak]})["peak"])
    if rank != 0:
        layer.close()
        torch.distributed.destroy_process_group()
        return 0
    where = torch.cuda.get_device_name(device) if cuda else "the host backend (CPU)"
    print(f"torch_layer_bench: W={world}{' (one rank a process, max over ranks)' if world > 1 else ''} T={a.tokens} H={a.hidden} D_ff={a.ffn} E={a.experts} K={a.topk}, "
          f"{'bf16' if cuda else 'fp32'}, {where}, torch {torch.__version__}")
    print(f"  layer: {layer.describe()}")
    from rdep.torch import eager_ext

    ext = eager_ext.module() is not None
    print(f"  eager calls: rdep.torch's {'C++ path (eager_ext)' if ext else 'Python path'}"
          + (", and the Python path in the rows marked 'py' (alternated rounds)" if a.eager_ab > 0 else ""))
    counts = torch.bincount(experts.flatten().long().cpu(), minlength=a.experts).double()
    tiles = int(torch.ceil(counts / 128).sum())
    drawn = f"rdep bench layer's draw, {a.routing_from}" if a.routing_from else "this script's draw; rdep bench layer prints its own"
    print(f"  load: expert max/mean {float(counts.max() / counts.mean()):.2f} (CV {100 * float(counts.std() / counts.mean()):.1f}%), "
          f"{tiles} row tiles of 128 ({drawn})")
    print(f"  {'':23s} {'p50 ms' if cuda else 'wall p50':>9s} {'p99 ms' if cuda else 'wall p99':>9s} {'host p50 ms':>12s}")
    for name, t in rows.items():
        print(f"  {name:23s} {statistics.median(t):9.3f} {percentile(t, 99):9.3f} {statistics.median(host[name]):12.3f}")
    if a.stack > 1:
        name = f"stack{a.stack} f+b"
        print(f"  {'per layer':23s} {statistics.median(rows[name]) / a.stack:9.3f} {'':9s} "
              f"{statistics.median(host[name]) / a.stack:12.3f}   ({name} / {a.stack})")
    breakdowns = {}
    if a.host_breakdown > 0:
        from binding_host_time import breakdown, instrumented, print_breakdown

        from rdep.torch import eager_ext

        # It times rdep.torch's Python functions and their ctypes calls: the Python path's (the C++ path has neither).
        print("  host breakdown: rdep.torch's Python path (eager_ext off)")
        eager_ext.enabled = False
        try:
            with instrumented() as probe:
                for name, fn in calls.items():
                    breakdowns[name] = breakdown(fn, a.host_breakdown, probe)
                    print_breakdown(name, breakdowns[name])
        finally:
            eager_ext.enabled = True
    if a.cprofile > 0:
        from binding_host_time import print_cprofile

        for name, fn in calls.items():
            if name.endswith("f+b") or name == "forward+backward":
                print_cprofile(name, fn, a.cprofile)
    timeline = {}
    if a.timeline > 0 and cuda:
        import backward_timeline

        timeline = backward_timeline.timeline(lambda: rt.moe(layer, x, experts, gates, w1, w2), dy, (x, gates, w1, w2),
                                              a.timeline, python_path_too=a.eager_ab > 0)
        backward_timeline.print_timeline(timeline)
    native = {}
    if a.native_profile > 0 and cuda:
        import native_host_profile

        for name in ("forward", "forward+backward"):
            got = native_host_profile.record(calls[name], a.native_profile)
            if got is not None and a.json:  # py-spy's raw samples beside the receipt
                with open(f"{a.json}.{name.replace('+', '_')}.pyspy.txt", "w") as f:
                    f.write(got[0])
            if got is not None:
                native[name] = native_host_profile.summarize(*got)
                native_host_profile.print_summary(name, native[name])
    if peak is not None:
        print(f"  torch peak allocated (activations, grads; excludes the layer's own buffers): {peak:.3f} GiB")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bench": "torch_layer", "shape": vars(a), "world_size": world, "device": where,
                       "expert_compute": getattr(layer, "expert_compute", None), "expert_compute_note": getattr(layer, "expert_compute_note", ""),
                       "torch": torch.__version__, "eager_path": "C++" if ext else "Python", "eager_ab_rounds": a.eager_ab,
                       "p50_ms": {k: statistics.median(v) for k, v in rows.items()},
                       "p99_ms": {k: percentile(v, 99) for k, v in rows.items()},
                       "host_p50_ms": {k: statistics.median(v) for k, v in host.items()},
                       "host_breakdown_us": breakdowns, "kernels_per_call": kernels, "native_host_profile": native,
                       "host_timeline_us": timeline,
                       "torch_peak_allocated_gib": peak, "samples_ms": rows}, f, indent=1)
    if world > 1:
        layer.close()
        torch.distributed.destroy_process_group()
    return 0


def max_over_ranks(samples: dict) -> dict:
    """Every rank's per-iteration times (ms), gathered: per name and iteration the max over ranks (collective)."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, samples)
    return {name: [max(r[name][i] for r in every) for i in range(len(samples[name]))] for name in samples}


def gather_experts(experts: torch.Tensor) -> torch.Tensor:
    """Every rank's expert ids [1, T, K], concatenated on the CPU (the load line counts all ranks' rows; collective)."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, experts.cpu())
    return torch.cat(every, dim=1)


if __name__ == "__main__":
    sys.exit(main())
