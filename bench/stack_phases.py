"""Where the device time of N chained rdep layers goes (torch_layer_bench.py --stack N times the whole): CUDA events
recorded between the layers' forwards and, through tensor hooks on each layer's input, between their backwards, in a
back-to-back loop of forward+backward passes; medians per phase beside a single layer's forward and backward.

    python3 bench/stack_phases.py --layers 3 --tokens 4096
Phases: fwd i (layer i's forward), turn+bwd N (from the last forward's end to the last layer's backward's end: the
engine's start and that backward), bwd i, tail (after layer 1's backward: the leaves' gradient accumulation), and the
pass. Also the host's time to issue each pass, and whether the host was ahead of the device (the pass's first event not
yet reached when its last was recorded).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def inputs(T, H, F, E, K, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, T, H, generator=g) * 0.5).to(device, torch.bfloat16).requires_grad_(True)
    experts = torch.rand(T, E, generator=g).argsort(-1)[:, :K].reshape(1, T, K).to(device, torch.int32).contiguous()
    gates = torch.softmax(torch.randn(1, T, K, generator=g), -1).to(device).requires_grad_(True)
    dy = torch.randn(1, T, H, generator=g).to(device, torch.bfloat16)
    return x, experts, gates, dy


def weights(H, F, E, device, seed):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, H, 2 * F, generator=g) / H ** 0.5).to(device, torch.bfloat16).requires_grad_(True)
    w2 = (torch.randn(E, F, H, generator=g) / F ** 0.5).to(device, torch.bfloat16).requires_grad_(True)
    return w1, w2


def new_marks(n):
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    return ev(), [ev() for _ in range(n)], [ev() for _ in range(n)], ev()


def one_pass(rt, layers, ws, x, experts, gates, dy, marks):
    start, fwd, bwd, end = marks
    start.record()
    h, hooks = x, []
    for i, (lay, (w1, w2)) in enumerate(zip(layers, ws)):
        # fires when layer i's input gets its gradient: layer i's backward was issued
        hooks.append(h.register_hook(lambda g, i=i: bwd[i].record() or None))
        h = rt.moe(lay, h, experts, gates, w1, w2)
        fwd[i].record()
    h.backward(dy)
    end.record()
    for hook in hooks:
        hook.remove()
    for t in [x, gates] + [w for pair in ws for w in pair]:
        t.grad = None


def phases(marks, n):
    start, fwd, bwd, end = marks
    out = {}
    prev = start
    for i in range(n):
        out[f"fwd {i + 1}"] = prev.elapsed_time(fwd[i])
        prev = fwd[i]
    out[f"turn+bwd {n}"] = fwd[-1].elapsed_time(bwd[-1])
    for i in range(n - 2, -1, -1):
        out[f"bwd {i + 1}"] = bwd[i + 1].elapsed_time(bwd[i])
    out["tail"] = bwd[0].elapsed_time(end)
    out["pass"] = start.elapsed_time(end)
    return out


def run(rt, layers, ws, x, experts, gates, dy, iters, warmup):
    """Medians of each phase over iters passes (the events made before the loop), the host's median ms a pass, and in
    how many passes the host was ahead of the device (the pass's first event not yet reached at its end)."""
    import time

    n = len(layers)
    for _ in range(warmup):
        one_pass(rt, layers, ws, x, experts, gates, dy, new_marks(n))
    kept = [new_marks(n) for _ in range(iters)]
    torch.cuda.synchronize()
    host, ahead = [], 0
    for marks in kept:
        t0 = time.perf_counter()
        one_pass(rt, layers, ws, x, experts, gates, dy, marks)
        host.append((time.perf_counter() - t0) * 1e3)
        ahead += not marks[0].query()
    torch.cuda.synchronize()
    rows = {}
    for marks in kept:
        for k, v in phases(marks, n).items():
            rows.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in rows.items()}, statistics.median(host), ahead


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--python-path", action="store_true", help="rdep.torch's Python path (eager_ext off)")
    p.add_argument("--own-domains", action="store_true", help="each layer on a domain of its own")
    p.add_argument("--json", default="")
    a = p.parse_args()
    import rdep.torch as rt
    from rdep.torch import eager_ext

    eager_ext.enabled = not a.python_path
    dev = torch.device("cuda", torch.cuda.current_device())
    opts = dict(expert_compute="cutlass", gate_in_expert=True)
    first = rt.Layer(a.hidden, a.ffn, a.experts, a.topk, a.tokens, world_size=1, device=dev, **opts)
    # On one domain, as a model's MoE layers are (--own-domains: a domain each, as the nineteenth session's stack was).
    layers = [first] + [rt.Layer(a.hidden, a.ffn, a.experts, a.topk, a.tokens, world_size=1, device=dev, **opts)
                        if a.own_domains else
                        rt.Layer(a.hidden, a.ffn, a.experts, a.topk, a.tokens, domain=first.domain, **opts)
                        for _ in range(a.layers - 1)]
    ws = [weights(a.hidden, a.ffn, a.experts, dev, 10 + i) for i in range(a.layers)]
    x, experts, gates, dy = inputs(a.tokens, a.hidden, a.ffn, a.experts, a.topk, dev)
    path = "Python" if a.python_path else ("C++" if eager_ext.module() is not None else "Python (no C++ build)")
    out = {}
    for name, ls, w in (("single", layers[:1], ws[:1]), (f"stack{a.layers}", layers, ws)):
        med, host, ahead = run(rt, ls, w, x, experts, gates, dy, a.iters, a.warmup)
        out[name] = {"device_ms": med, "host_ms": host, "host_ahead": ahead}
        print(f"{name} ({path} path{', own domains' if a.own_domains else ''}; T={a.tokens}; median ms of {a.iters} passes; host {host:.3f} ms a pass, ahead of the "
              f"device in {ahead}):")
        for k, v in med.items():
            print(f"  {k:14s} {v:8.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bench": "stack_phases", "args": vars(a), "path": path, "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(dev), **out}, f, indent=1)


if __name__ == "__main__":
    main()
