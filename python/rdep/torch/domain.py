"""rdep.torch.Domain: the ranks that rdep layers run on and their transport (the C ABI's rdep_domain), to be
shared by several layers.

Layers on one domain share what the domain holds for all of them; today that is the replica slots of
balancing (balance='ultraep' | 'eplb' | 'eplb-exact': each rank's redundant expert slots, weights and
fp32 gradients). A model of many balanced MoE modules on one domain holds one set of slots per slot
size instead of one per module:

    domain = rdep.torch.Domain(world_size=4)                      # host backend: 4 ranks as threads
    blocks = [rdep.torch.MoE(64, 128, 16, 2, max_tokens=256, domain=domain, balance="ultraep")
              for _ in range(27)]
    domain.memory()   # {'symmetric_bytes_per_rank': ..., 'shared_bytes_per_rank': one set of slots}
                      # (on CUDA the shared bytes also hold the owner's rows and the CUTLASS scratch, once)

A module made without `domain=` gets a domain of its own (its `layer.domain`), as before. The placement
arguments are the Layer's (backend, world_size, device, num_gpus, process_group, barrier_timeout_s); a
Layer or MoE given a domain takes them from it and refuses a different value, naming the argument.

Layers on one domain may run in any order (A forward, B forward, B backward, A backward): their C calls
are serialized by the domain, and each call writes the shared slots before it reads them. Lifetime: every
layer keeps its domain alive (the C domain is reference-counted), so a Domain, its layers and their
modules may be closed or collected in any order. With a process group (per-process CUDA), creating the
domain and each layer on it are collectives: every process makes them in the same order.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
from typing import Optional

import torch

from .. import _capi

_BACKENDS = ("host", "cuda", "auto")


def resolve_backend(backend: str, device, process_group) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if process_group is not None:
        return "cuda"
    if device is not None and torch.device(device).type == "cuda":
        return "cuda"
    return "host"


def per_process_fields(spec, process_group, world_size, device) -> tuple[int, tuple]:
    """Fills the per-process CUDA fields of spec (a DomainSpec or LayerSpec) from the group: rank = group
    rank, device = the given CUDA device or the current one, allgather through the group. Returns (W,
    objects to keep alive)."""
    from .distributed import ProcessGroupAllgather, group_rank_and_size

    rank, size = group_rank_and_size(process_group)
    if world_size is None:
        world_size = size
    if world_size != size:
        raise ValueError(f"process_group: its size is {size} but world_size is {world_size} "
                         "(one process per rank: they must agree)")
    if not torch.cuda.is_available():
        raise ValueError("process_group: the per-process CUDA backend needs CUDA, and torch.cuda.is_available() is False")
    gather = ProcessGroupAllgather(process_group)
    spec.backend = _capi.BACKEND_CUDA_PER_PROCESS
    spec.process_rank = rank
    spec.device = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    spec.allgather = gather.c_function
    return world_size, (gather,)


def placement_fields(spec, resolved: str, backend: str, world_size, num_gpus, process_group, device) -> tuple[int, tuple]:
    """Fills the placement fields of spec (a DomainSpec or LayerSpec: backend, world size, GPUs, and the
    per-process fields from a process group), checking each argument. Returns (W, objects to keep
    alive)."""
    keepalive: tuple = ()
    if process_group is not None:
        if resolved != "cuda":
            raise ValueError(
                "process_group: a process group selects the per-process CUDA backend; "
                f"backend={backend!r} runs all ranks in this process (pass no process_group)")
        world_size, keepalive = per_process_fields(spec, process_group, world_size, device)
    else:
        if world_size is None:
            world_size = 1
        spec.backend = _capi.BACKEND_HOST if resolved == "host" else _capi.BACKEND_CUDA_ONE_PROCESS
        if resolved == "cuda":
            if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 0:
                raise ValueError(f"num_gpus: expected an int >= 0, got {num_gpus!r}")
            spec.num_gpus = num_gpus
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    spec.world_size = world_size
    return world_size, keepalive


def local_device(resolved: str, devs: list, device, what: str) -> torch.device:
    """The torch device of a domain's or layer's local ranks (devs: each local rank's GPU): the CPU on the
    host backend; on CUDA the one GPU they share, checked against the device the caller asked for.
    what: "domain" or "layer", for the messages."""
    if resolved == "host":
        return torch.device("cpu")
    if len(set(devs)) != 1:
        raise ValueError(
            f"num_gpus: the local ranks sit on GPUs {devs}; the torch binding passes one tensor for all "
            "local ranks, so they must share one GPU (num_gpus=1), or run one process per GPU with a process_group")
    if device is not None and device.index is not None and device.index != devs[0]:
        raise ValueError(
            f"device: the {what}'s ranks are on cuda:{devs[0]}, not {device} (one-process CUDA places ranks on "
            "GPUs 0..num_gpus-1; use CUDA_VISIBLE_DEVICES, or a process_group for one process per GPU)")
    return torch.device("cuda", devs[0])


def raise_bootstrap_error(code: int, keepalive: tuple, what: str) -> None:
    """Re-raises a failed process-group allgather's Python exception (chained), else the C error."""
    if code != 0 and keepalive and keepalive[0].error is not None:
        err = keepalive[0].error
        raise RuntimeError(f"{what}: the process-group allgather failed: {err!r}") from err
    _capi.check(code, what)


@contextlib.contextmanager
def collector_paused(paused: bool = True):
    """Pauses Python's cyclic garbage collector while C runs a call that calls back into Python with the
    domain's lock held (the process-group allgather while a layer is made on a per-process domain): a
    collection there could free another layer of the same domain, whose destruction waits for that lock."""
    was = paused and gc.isenabled()
    if was:
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class CHandle:
    """What rdep.torch's handles to C state (Domain, Layer) share: copies and deep copies are the same
    handle (modules copied with copy.deepcopy keep sharing it; a fresh one would be a collective only
    one rank ran), pickling is refused with a hint, and `with` closes it."""

    _pickle_hint = ""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise TypeError(f"an rdep.torch.{type(self).__name__} (a handle to C state) cannot be pickled; {self._pickle_hint}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _DomainNative:
    """Owns one reference to the rdep_domain* and the Python objects its C side calls (the process-group
    allgather). Every Layer's native state holds this object, so the callback outlives every C layer on
    the domain; the C domain itself lives until its last reference (this one or a layer's) is dropped."""

    def __init__(self, ptr: int, keepalive: tuple):
        self.ptr: Optional[int] = ptr
        self.keepalive = keepalive
        self.lock = threading.Lock()

    def close(self) -> None:
        with self.lock:
            if self.ptr is not None:
                _capi.lib().rdep_domain_destroy(self.ptr)
                self.ptr = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass


class Domain(CHandle):
    """W ranks and their placement, shared by the layers made on it (see the module docstring).

    backend 'host': all W ranks are threads of this process (fp32, CPU tensors); 'cuda' without a process
    group: all W ranks driven by this process, sharing one GPU (num_gpus=1); 'cuda' with a process group:
    this process is rank group.rank() of W = group.size(), on `device` or the current CUDA device; 'auto'
    picks 'cuda' when a process group is given or the device is a CUDA device, else 'host'."""

    _pickle_hint = "build it again and pass it to the modules"

    def __init__(
        self,
        world_size: Optional[int] = None,
        *,
        backend: str = "auto",
        device=None,
        num_gpus: int = 1,
        process_group=None,
        barrier_timeout_s: float = 0.0,
    ):
        resolved = resolve_backend(backend, device, process_group)
        if device is not None:
            device = torch.device(device)
            want = "cuda" if resolved == "cuda" else "cpu"
            if device.type != want:
                raise ValueError(f"device: the {resolved} backend runs on {want} tensors, got device={device}")
        spec = _capi.DomainSpec()
        spec.struct_size = ctypes.sizeof(_capi.DomainSpec)
        world_size, keepalive = placement_fields(spec, resolved, backend, world_size, num_gpus, process_group, device)
        spec.barrier_timeout_s = float(barrier_timeout_s)
        ptr = _capi.DomainPtr()
        code = _capi.lib().rdep_domain_create(ctypes.byref(spec), ctypes.byref(ptr))
        raise_bootstrap_error(code, keepalive, "rdep_domain_create")
        self._init(_DomainNative(ptr.value, keepalive), resolved, world_size, spec, process_group, device)

    @classmethod
    def _adopt(cls, ptr: int, keepalive: tuple, backend: str, world_size: int, spec, process_group, device) -> "Domain":
        """A Domain for a reference the caller already holds (rdep_layer_domain of a layer made with a
        domain of its own); spec is that layer's LayerSpec (its domain fields)."""
        self = cls.__new__(cls)
        self._init(_DomainNative(ptr, keepalive), backend, world_size, spec, process_group, device)
        return self

    def _init(self, native: _DomainNative, backend: str, world_size: int, spec, process_group, device) -> None:
        self._native = native
        self._backend_code = int(spec.backend)  # rdep_backend_kind
        self.backend = backend
        self.world_size = world_size
        self.num_gpus = int(spec.num_gpus)
        self.barrier_timeout_s = float(spec.barrier_timeout_s)
        self.process_group = process_group
        try:
            self._query(device)
        except BaseException:
            native.close()
            raise

    def _query(self, device) -> None:
        L, p = _capi.lib(), self._native.ptr
        first, count = ctypes.c_int32(), ctypes.c_int32()
        _capi.check(L.rdep_domain_local_ranks(p, ctypes.byref(first), ctypes.byref(count)), "rdep_domain_local_ranks")
        self.local_ranks = range(first.value, first.value + count.value)
        devs = []
        d = ctypes.c_int32()
        for rank in self.local_ranks:
            _capi.check(L.rdep_domain_device(p, rank, ctypes.byref(d)), "rdep_domain_device")
            devs.append(d.value)
        self.device = local_device(self.backend, devs, device, "domain")

    # --- what the domain is and holds ----------------------------------------------------------------
    @property
    def num_local_ranks(self) -> int:
        return len(self.local_ranks)

    @property
    def closed(self) -> bool:
        """True once close() dropped this object's reference (its layers may still hold the C domain)."""
        return self._native.ptr is None

    @property
    def num_layers(self) -> int:
        """The live C layers on the domain."""
        n = ctypes.c_int32()
        _capi.check(_capi.lib().rdep_domain_num_layers(self._live_ptr(), ctypes.byref(n)), "rdep_domain_num_layers")
        return n.value

    def memory(self) -> dict:
        """Bytes per rank of the domain's symmetric regions (every layer's, the shared regions counted once)
        and of the shared regions alone (one set of replica slots per slot size, however many balanced
        layers use them; on CUDA also the owner's output rows and the CUTLASS compute's scratch, which at W = 1
        with one segment lives in the return region; one region per size: Layer.shared_row_bytes).
        To total a model, sum over its distinct domains."""
        sym, shared = ctypes.c_size_t(), ctypes.c_size_t()
        _capi.check(_capi.lib().rdep_domain_memory(self._live_ptr(), ctypes.byref(sym), ctypes.byref(shared)),
                    "rdep_domain_memory")
        return {"symmetric_bytes_per_rank": sym.value, "shared_bytes_per_rank": shared.value}

    def describe(self) -> str:
        """The C library's description: backend, ranks, placement, transport."""
        L, p = _capi.lib(), self._live_ptr()
        needed = ctypes.c_size_t()
        _capi.check(L.rdep_domain_describe(p, None, 0, ctypes.byref(needed)), "rdep_domain_describe")
        buf = ctypes.create_string_buffer(needed.value + 1)
        _capi.check(L.rdep_domain_describe(p, buf, len(buf), ctypes.byref(needed)), "rdep_domain_describe")
        return buf.value.decode("utf-8", "replace")

    def close(self) -> None:
        """Drops this object's reference to the C domain: no new layers can be made on it; its layers keep
        working and keep it alive until the last of them is freed."""
        self._native.close()

    def check_layer_arguments(self, *, world_size, backend, device, num_gpus, process_group, barrier_timeout_s) -> None:
        """A layer made on this domain takes its placement from it: an argument left at its default is the
        domain's, a different value is a ValueError naming the argument."""
        if world_size is not None and world_size != self.world_size:
            raise ValueError(f"world_size: {world_size!r} differs from the domain's world_size={self.world_size} "
                             "(leave it out on a layer made on a domain)")
        if backend not in _BACKENDS:
            raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
        if backend != "auto" and backend != self.backend:
            raise ValueError(f"backend: {backend!r} differs from the domain's backend={self.backend!r}")
        if device is not None:
            dev = torch.device(device)
            if dev.type != self.device.type or (dev.index is not None and dev.index != self.device.index):
                raise ValueError(f"device: {dev} differs from the domain's device={self.device}")
        if num_gpus != 1 and num_gpus != self.num_gpus:
            raise ValueError(f"num_gpus: {num_gpus!r} differs from the domain's num_gpus={self.num_gpus}")
        if process_group is not None and process_group is not self.process_group:
            raise ValueError("process_group: differs from the domain's (a layer on a domain uses the domain's ranks)")
        if barrier_timeout_s != 0 and float(barrier_timeout_s) != self.barrier_timeout_s:
            raise ValueError(f"barrier_timeout_s: {barrier_timeout_s!r} differs from the domain's "
                             f"barrier_timeout_s={self.barrier_timeout_s:g}")

    def __repr__(self) -> str:
        state = ", closed" if self.closed else ""
        return (f"rdep.torch.Domain(W={self.world_size}, backend={self.backend}, device={self.device}, "
                f"local_ranks={list(self.local_ranks)}{state})")

    def _live_ptr(self) -> int:
        p = self._native.ptr
        if p is None:
            raise ValueError("domain: it was closed (its layers keep working; make no new layers on it)")
        return p

