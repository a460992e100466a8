"""The eager forward+backward's host timeline (bench/torch_layer_bench.py --timeline N): each call issued on an idle
device, with clock reads at the forward's return, at the entry and exit of rdep's autograd formula (which the autograd
engine runs on its device thread for CUDA tensors) and at backward()'s return; so the backward's host time splits into
  * handoff in:  from backward() called to the formula's first line (torch's argument checks, the engine's graph
                 task, the device thread woken);
  * formula:     rdep's backward (its checks, the C call, the outputs);
  * handoff out: from the formula's return to backward()'s (the gradients accumulated into .grad, the calling thread
                 woken).
Also whether the device had already finished the call's work when the host returned (an event recorded and queried
right after). The same loop also runs with torch.autograd.set_multithreading_enabled(False), where the engine runs the
backward on the calling thread (no thread handoff): what the device thread's handoffs cost on this host. The two
alternate in rounds.
"""

from __future__ import annotations

import statistics
import time

import torch


def _patched_formulas(stamps: list):
    """Wraps the backward of each autograd.Function rdep.torch's eager path applies (op_library._FUNCTIONS) so that it
    appends its entry and exit times to stamps; returns the restore list."""
    from rdep.torch import op_library

    originals = []
    for fn in op_library._FUNCTIONS.values():
        orig = fn.backward

        def backward(ctx, *grads, _orig=orig):
            stamps.append(time.perf_counter())
            try:
                return _orig(ctx, *grads)
            finally:
                stamps.append(time.perf_counter())

        originals.append((fn, orig))
        fn.backward = staticmethod(backward)
    return originals


PARTS = ("forward", "backward", "handoff in", "formula", "handoff out", "forward+backward")


def _loop(forward, dy, leaves, iters: int, rows: dict, python_formula: bool) -> int:
    """iters timed calls (after 5 untimed), their parts appended to rows (µs); returns how many found the device done."""
    stamps: list = []
    originals = _patched_formulas(stamps)
    done = 0
    try:
        for i in range(iters + 5):
            torch.cuda.synchronize()
            stamps.clear()
            t0 = time.perf_counter()
            y = forward()
            t1 = time.perf_counter()
            y.backward(dy)
            t2 = time.perf_counter()
            mark = torch.cuda.Event()
            mark.record()
            finished = bool(mark.query())
            for t in leaves:
                t.grad = None
            del y
            if i < 5 or len(stamps) != (2 if python_formula else 0):
                continue  # warm-up, or not the path asked for (a formula not wrapped, or run twice): not counted
            done += finished
            parts = [("forward", t1 - t0), ("backward", t2 - t1), ("forward+backward", t2 - t0)]
            if stamps:  # the Python path's formula ran (the C++ path's backward has no Python to wrap)
                f_in, f_out = stamps
                parts += [("handoff in", f_in - t1), ("formula", f_out - f_in), ("handoff out", t2 - f_out)]
            for name, v in parts:
                rows[name].append(1e6 * v)
    finally:
        for fn, orig in originals:
            fn.backward = staticmethod(orig)
    return done


def timeline(forward, dy, leaves, iters: int, rounds: int = 4, python_path_too: bool = False) -> dict:
    """{"threads": the engine as configured, "one thread": multithreading disabled}, each {part: median µs, calls,
    device_done_at_return}. The two run in alternating rounds (iters split between them), so that a drift of the host's
    speed during the run falls on both alike. rdep.torch's eager C++ path (eager_ext) has no Python formula to wrap:
    its rows hold forward, backward and the total only. python_path_too: also "threads py" and "one thread py", the
    same loops with the C++ path switched off, in the same rounds."""
    from rdep.torch import eager_ext

    cpp = eager_ext.module() is not None  # the default path: the C++ one where it is built
    modes = [("threads", True, True), ("one thread", False, True)]
    if python_path_too:
        modes += [("threads py", True, False), ("one thread py", False, False)]
    rows = {mode: {k: [] for k in PARTS} for mode, _, _ in modes}
    done = {mode: 0 for mode in rows}
    per_round = max(1, iters // rounds)
    try:
        for _ in range(rounds):
            for mode, threads, ext in modes:
                eager_ext.enabled = ext
                with torch.autograd.set_multithreading_enabled(threads):
                    done[mode] += _loop(forward, dy, leaves, per_round, rows[mode], python_formula=not (ext and cpp))
    finally:
        eager_ext.enabled = True
    out = {}
    for mode, parts in rows.items():
        out[mode] = {k: statistics.median(v) for k, v in parts.items() if v}
        out[mode]["calls"] = len(parts["forward"])
        out[mode]["device_done_at_return"] = done[mode]
    return out


def print_timeline(t: dict) -> None:
    for mode, r in t.items():
        if r["calls"] == 0:
            print(f"  host timeline, engine {mode}: no call counted; nothing timed")
            continue
        print(f"  host timeline of forward+backward, engine {mode} (median µs of {r['calls']} calls; the device had finished "
              f"the call's work at its return after {r['device_done_at_return']}):")
        for k in PARTS:
            if k in r:
                print(f"    {k:18s} {r[k]:9.1f}")
