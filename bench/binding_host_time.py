"""Where the PyTorch binding's host time goes (bench/torch_layer_bench.py --host-breakdown): each call's wall
time split into the C library's calls (every rdep_* function, timed around its ctypes call), the calls into
torch's caching allocator that the layer's row allocator makes from inside those C calls, and the rest: Python
(torch's custom-op dispatch and autograd, rdep.torch's validation and bookkeeping) and the torch ops it runs.
rdep.torch's own functions on the path (PY_FUNCS) are timed too, inclusive of what they call (C calls included),
as py:module.function, and torch's allocating functions (py:torch.empty, ...; every caller's while the probe is on):
what the op kernels take against what torch's dispatch and autograd around them take.

    with instrumented() as probe:
        per_call = breakdown(fn, iters, probe)   # {"host": us, "c:rdep_layer_forward": us, ..., "python": us}
"""

from __future__ import annotations

import collections
import contextlib
import time

import torch


class _TimedLibrary:
    """Stands in for rdep._capi's library handle: every rdep_* function is timed (seconds, calls)."""

    def __init__(self, real):
        self._real = real
        self.seconds = collections.defaultdict(float)
        self.calls = collections.defaultdict(int)

    def __getattr__(self, name):
        fn = getattr(self._real, name)
        if not name.startswith("rdep_"):
            return fn

        def timed(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1

        return timed


# rdep.torch's functions on the capturable and plain ops' path, each called through its module's attribute (so a
# wrapper set there is the one called): the op kernels' parts.
PY_FUNCS = (("ops", "_backward_on"), ("ops", "_layer_weights"), ("layer_calls", "forward"),
            ("layer_calls", "backward"), ("graph_contexts", "sweep"), ("graph_contexts", "context_tensor"),
            ("graph_contexts", "entry_for_backward"), ("graph_contexts", "after_backward"), ("graph_contexts", "capturing"),
            ("graph_contexts", "StorageWeakRef"), ("graph_contexts", "Entry"), ("layer_calls", "_rank_streams"),
            ("layer_calls", "_fill_weights"), ("layer_calls", "_new_io"),
            ("validate", "check_forward"), ("validate", "check_backward"), ("validate", "check_kept_casts"),
            ("validate", "check_rows"), ("layer_handles", "resolve"))
# torch's allocating functions as rdep.torch calls them (torch.empty(...): looked up on the module at each call).
TORCH_FUNCS = ("empty", "empty_like", "full", "zeros")


class Probe:
    def __init__(self, lib: _TimedLibrary):
        self.lib = lib
        self.alloc_seconds = 0.0
        self.alloc_calls = 0
        self.py_seconds = collections.defaultdict(float)
        self.py_calls = collections.defaultdict(int)

    def reset(self) -> None:
        self.lib.seconds.clear()
        self.lib.calls.clear()
        self.alloc_seconds, self.alloc_calls = 0.0, 0
        self.py_seconds.clear()
        self.py_calls.clear()

    def timed_python(self, name: str, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.py_seconds[name] += time.perf_counter() - t0
                self.py_calls[name] += 1

        return call


@contextlib.contextmanager
def instrumented():
    """Times the C library's calls and the row allocator's calls into torch while the block runs."""
    from rdep import _capi

    real = _capi.lib()
    probe = Probe(_TimedLibrary(real))
    alloc, free = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete

    def timed(fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                probe.alloc_seconds += time.perf_counter() - t0
                probe.alloc_calls += 1

        return call

    import importlib

    originals = []
    try:  # everything wrapped is put back, also when wrapping fails partway
        for module_name, fn_name in PY_FUNCS:
            module = importlib.import_module(f"rdep.torch.{module_name}")
            fn = getattr(module, fn_name, None)  # an older rdep.torch (an A/B's base) may lack some: not timed
            if fn is not None:
                originals.append((module, fn_name, fn))
                setattr(module, fn_name, probe.timed_python(f"{module_name}.{fn_name}", fn))
        for fn_name in TORCH_FUNCS:
            fn = getattr(torch, fn_name)
            originals.append((torch, fn_name, fn))
            setattr(torch, fn_name, probe.timed_python(f"torch.{fn_name}", fn))
        _capi._lib = probe.lib
        torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete = timed(alloc), timed(free)
        yield probe
    finally:
        _capi._lib = real
        torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete = alloc, free
        for module, fn_name, fn in originals:
            setattr(module, fn_name, fn)


def breakdown(fn, iters: int, probe: Probe) -> dict:
    """Microseconds per call of fn, each call issued on an idle device (synchronized before it, outside the
    time, so that no full launch queue paces the host), as means over the calls (host_median beside): host (the
    calls' wall time), each C function's time, the allocator calls' time (inside the C calls' time), and python =
    host less the C calls. The probe's own work (a wrapper and two clock reads a C call) is in host and python,
    a few microseconds a C call. Calls per call of fn are reported as calls:NAME."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    probe.reset()
    host = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    sync()
    out = {"host": 1e6 * sum(host) / iters, "host_median": 1e6 * sorted(host)[iters // 2]}
    c_total = 0.0
    for name, s in sorted(probe.lib.seconds.items()):
        out[f"c:{name}"] = 1e6 * s / iters
        out[f"calls:{name}"] = probe.lib.calls[name] / iters
        c_total += s
    out["c_total"] = 1e6 * c_total / iters
    out["row_allocator_in_c"] = 1e6 * probe.alloc_seconds / iters
    out["calls:row_allocator"] = probe.alloc_calls / iters
    out["python"] = out["host"] - out["c_total"]
    for name, s in sorted(probe.py_seconds.items()):
        out[f"py:{name}"] = 1e6 * s / iters
        out[f"calls:py:{name}"] = probe.py_calls[name] / iters
    return out


def print_breakdown(title: str, b: dict) -> None:
    print(f"  host breakdown, {title} (us per call, means; the probe's own cost included):")
    for k, v in b.items():
        if k.startswith("calls:"):
            continue
        calls = (b.get("calls:" + k[2:]) if k.startswith("c:") else b.get("calls:" + k) if k.startswith("py:")
                 else b.get("calls:row_allocator") if k == "row_allocator_in_c" else None)
        extra = f"  ({calls:g} a call)" if calls is not None else ""
        print(f"    {k:34s} {v:9.1f}{extra}")


def print_cprofile(title: str, fn, iters: int, top: int = 40) -> None:
    """fn run `iters` times under cProfile: the functions by own time (tottime) and by cumulative time."""
    import cProfile
    import pstats

    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    print(f"  cProfile, {title}, {iters} calls (inflated by the profiler; read the shares, not the times):")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
