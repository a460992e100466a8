"""ctypes binding of rdep's C ABI (include/rdep/capi.h): the library loader, mirrors of rdep_domain_spec,
rdep_layer_spec, rdep_rank_io and rdep_rank_rows, the function prototypes, and the translation of status codes into Python exceptions.

Nothing here knows PyTorch: the torch side (rdep.torch) passes raw addresses.

Library discovery, first hit wins:
  1. the environment variable RDEP_LIBRARY (a path to librdep_capi.so);
  2. librdep_capi.so next to this file (where `pip install .` puts it);
  3. build/lib/librdep_capi.so of the source checkout this package sits in (python/rdep -> ../../build/lib).

Try it:  RDEP_LIBRARY=build/lib/librdep_capi.so PYTHONPATH=python python3 -c "import rdep; print(rdep.library_info())"
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

from ._errors import error_for_code

CAPI_VERSION = 23  # RDEP_CAPI_VERSION this binding was written against
LIBRARY_NAME = "librdep_capi.so"

BACKEND_HOST = 0
BACKEND_CUDA_ONE_PROCESS = 1
BACKEND_CUDA_PER_PROCESS = 2

# typedef int (*rdep_allgather_fn)(void* user, const void* send, size_t bytes, void* recv);
ALLGATHER_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
# typedef void* (*rdep_alloc_fn)(void* user, size_t bytes, int32_t device, void* stream);
# typedef void (*rdep_free_fn)(void* user, void* ptr, size_t bytes, int32_t device);
ROW_ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_void_p)
ROW_FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32)

# C type of each field, in header order; tests/test_capi.py checks these against include/rdep/capi.h.
# Pointers are mirrored as c_void_p (same size and alignment as any object pointer) so that fields take
# plain integer addresses without a ctypes.cast per call.
_CTYPE = {
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "double": ctypes.c_double,
    "size_t": ctypes.c_size_t,
    "rdep_allgather_fn": ALLGATHER_FN,
}

DOMAIN_SPEC_FIELDS = (
    ("struct_size", "int32_t"),
    ("backend", "int32_t"),
    ("world_size", "int32_t"),
    ("num_gpus", "int32_t"),
    ("process_rank", "int32_t"),
    ("device", "int32_t"),
    ("barrier_timeout_s", "double"),
    ("allgather", "rdep_allgather_fn"),
    ("allgather_user", "void*"),
)

LAYER_SPEC_FIELDS = (
    ("struct_size", "int32_t"),
    ("backend", "int32_t"),
    ("world_size", "int32_t"),
    ("num_gpus", "int32_t"),
    ("process_rank", "int32_t"),
    ("device", "int32_t"),
    ("tokens", "int64_t"),
    ("hidden", "int64_t"),
    ("ffn", "int64_t"),
    ("experts", "int64_t"),
    ("topk", "int64_t"),
    ("capacity_factor", "double"),
    ("segment_tokens", "int64_t"),
    ("barrier_timeout_s", "double"),
    ("allgather", "rdep_allgather_fn"),
    ("allgather_user", "void*"),
    ("balance", "int32_t"),
    ("balance_slots", "int32_t"),
    ("balance_min_quota", "int64_t"),
    ("balance_relay_above", "int32_t"),
    ("nodes", "int32_t"),
    ("max_nodes", "int32_t"),
    ("expert_compute", "int32_t"),
    ("owner_reduce", "int32_t"),
    ("transport_sms", "int32_t"),
    ("reserved", "int32_t"),
    ("balance_min_gain", "int64_t"),
    ("stash_rows", "int64_t"),  # version 10
    ("overlap_segments", "int64_t"),  # version 11
    ("gate_in_expert", "int64_t"),  # version 12
    ("no_source_windows", "int64_t"),  # version 20
)

BALANCE_KINDS = {"off": 0, "ultraep": 1, "eplb": 2, "eplb-exact": 3}  # rdep_balance_kind
EXPERT_COMPUTE = {"cublaslt": 0, "cutlass": 1}  # rdep_layer_spec.expert_compute

RANK_IO_FIELDS = (
    ("num_tokens", "int64_t"),
    ("experts", "const int32_t*"),
    ("gates", "const float*"),
    ("x", "const void*"),
    ("y", "void*"),
    ("w1", "const void*"),
    ("w2", "const void*"),
    ("dy", "const void*"),
    ("dx", "void*"),
    ("dgates", "float*"),
    ("dw1", "void*"),
    ("dw2", "void*"),
    ("stream", "void*"),
    ("grad_bf16", "int32_t"),
    ("reserved", "int32_t"),
)

RANK_ROWS_FIELDS = (
    ("in", "const void*"),
    ("out", "void*"),
    ("dgates", "float*"),
    ("stream", "void*"),
    ("in_rows", "int64_t"),
    ("out_rows", "int64_t"),
    ("reserved", "int64_t"),
)

ADAMW_TENSOR_FIELDS = (  # version 22
    ("master", "float*"),
    ("exp_avg", "float*"),
    ("exp_avg_sq", "float*"),
    ("grad", "const void*"),
    ("param", "void*"),
    ("numel", "int64_t"),
    ("grad_dtype", "int32_t"),
)
ADAMW_GRAD_BF16, ADAMW_GRAD_FP32 = 0, 1  # rdep_adamw_tensor.grad_dtype

ADAMW_STEP_FIELDS = (  # version 21
    ("lr", "double"),
    ("beta1", "double"),
    ("beta2", "double"),
    ("eps", "double"),
    ("weight_decay", "double"),
    ("device", "int32_t"),
    ("step", "int64_t"),
    ("grad_scale", "const float*"),
    ("stream", "void*"),
)


def _ctype(c_type: str):
    return ctypes.c_void_p if c_type.endswith("*") else _CTYPE[c_type]


class DomainSpec(ctypes.Structure):
    """Mirror of rdep_domain_spec."""

    _fields_ = [(name, _ctype(t)) for name, t in DOMAIN_SPEC_FIELDS]


class LayerSpec(ctypes.Structure):
    """Mirror of rdep_layer_spec."""

    _fields_ = [(name, _ctype(t)) for name, t in LAYER_SPEC_FIELDS]


class RankIO(ctypes.Structure):
    """Mirror of rdep_rank_io (one local rank's arguments to a forward or backward call)."""

    _fields_ = [(name, _ctype(t)) for name, t in RANK_IO_FIELDS]


class RankRows(ctypes.Structure):
    """Mirror of rdep_rank_rows (one local rank's rows of a dispatch/combine call)."""

    _fields_ = [(name, _ctype(t)) for name, t in RANK_ROWS_FIELDS]


class AdamWTensor(ctypes.Structure):
    """Mirror of rdep_adamw_tensor (one tensor of rdep_master_adamw)."""

    _fields_ = [(name, _ctype(t)) for name, t in ADAMW_TENSOR_FIELDS]


class AdamWStep(ctypes.Structure):
    """Mirror of rdep_adamw_step (rdep_master_adamw's hyperparameters, device and stream)."""

    _fields_ = [(name, _ctype(t)) for name, t in ADAMW_STEP_FIELDS]


LayerPtr = ctypes.c_void_p  # rdep_layer* (opaque)
DomainPtr = ctypes.c_void_p  # rdep_domain* (opaque)

# name: (restype, argtypes)
_PROTOTYPES = {
    "rdep_capi_version": (ctypes.c_int32, []),
    "rdep_last_error": (ctypes.c_char_p, []),
    "rdep_built_with_cuda": (ctypes.c_int32, []),
    "rdep_cuda_device_count": (ctypes.c_int32, []),
    "rdep_cutlass_available": (ctypes.c_int32, [ctypes.c_int32]),
    "rdep_domain_create": (ctypes.c_int, [ctypes.POINTER(DomainSpec), ctypes.POINTER(DomainPtr)]),
    "rdep_domain_destroy": (None, [DomainPtr]),
    "rdep_domain_local_ranks": (
        ctypes.c_int,
        [DomainPtr, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32)],
    ),
    "rdep_domain_device": (ctypes.c_int, [DomainPtr, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)]),
    "rdep_domain_num_layers": (ctypes.c_int, [DomainPtr, ctypes.POINTER(ctypes.c_int32)]),
    "rdep_domain_memory": (
        ctypes.c_int,
        [DomainPtr, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)],
    ),
    "rdep_domain_describe": (
        ctypes.c_int,
        [DomainPtr, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)],
    ),
    "rdep_layer_create": (ctypes.c_int, [ctypes.POINTER(LayerSpec), ctypes.POINTER(LayerPtr)]),
    "rdep_layer_create_on": (ctypes.c_int, [DomainPtr, ctypes.POINTER(LayerSpec), ctypes.POINTER(LayerPtr)]),
    "rdep_layer_destroy": (None, [LayerPtr]),
    "rdep_layer_domain": (ctypes.c_int, [LayerPtr, ctypes.POINTER(DomainPtr)]),
    "rdep_layer_replica_slot_bytes": (ctypes.c_int, [LayerPtr, ctypes.POINTER(ctypes.c_size_t)]),
    "rdep_layer_shared_row_bytes": (ctypes.c_int, [LayerPtr, ctypes.POINTER(ctypes.c_size_t)]),
    "rdep_layer_row_allocator_bytes": (ctypes.c_int, [LayerPtr, ctypes.POINTER(ctypes.c_size_t)]),
    "rdep_layer_set_row_allocator": (ctypes.c_int, [LayerPtr, ROW_ALLOC_FN, ROW_FREE_FN, ctypes.c_void_p]),
    "rdep_layer_local_ranks": (
        ctypes.c_int,
        [LayerPtr, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32)],
    ),
    "rdep_layer_owned_experts": (
        ctypes.c_int,
        [LayerPtr, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)],
    ),
    "rdep_layer_device": (ctypes.c_int, [LayerPtr, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)]),
    "rdep_layer_describe": (
        ctypes.c_int,
        [LayerPtr, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)],
    ),
    "rdep_context_acquire": (ctypes.c_int, [LayerPtr, ctypes.POINTER(ctypes.c_int64)]),
    "rdep_context_release": (ctypes.c_int, [LayerPtr, ctypes.c_int64]),
    "rdep_context_check_routing": (ctypes.c_int, [LayerPtr, ctypes.c_int64]),
    "rdep_layer_check_errors": (ctypes.c_int, [LayerPtr]),
    "rdep_context_bytes": (ctypes.c_int, [LayerPtr, ctypes.c_int64, ctypes.POINTER(ctypes.c_size_t)]),
    "rdep_layer_forward": (ctypes.c_int, [LayerPtr, ctypes.c_int64, ctypes.POINTER(RankIO), ctypes.c_int32]),
    "rdep_layer_forward_arena": (ctypes.c_int, [LayerPtr, ctypes.c_int64, ctypes.POINTER(RankIO), ctypes.c_int32,
                                                ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
    "rdep_context_rebase_rows": (ctypes.c_int, [LayerPtr, ctypes.c_int64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]),
    "rdep_context_rearm": (ctypes.c_int, [LayerPtr, ctypes.c_int64]),
    "rdep_layer_backward": (ctypes.c_int, [LayerPtr, ctypes.c_int64, ctypes.POINTER(RankIO), ctypes.c_int32]),
    "rdep_layer_plan": (ctypes.c_int, [LayerPtr, ctypes.c_int64, ctypes.POINTER(RankIO), ctypes.c_int32]),
    "rdep_context_recv_counts": (
        ctypes.c_int,
        [LayerPtr, ctypes.c_int64, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64],
    ),
    "rdep_context_recv_row_ids": (
        ctypes.c_int,
        [LayerPtr, ctypes.c_int64, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64],
    ),
    "rdep_layer_dispatch": (ctypes.c_int, [LayerPtr, ctypes.c_int64, ctypes.POINTER(RankRows), ctypes.c_int32]),
    "rdep_layer_combine": (ctypes.c_int, [LayerPtr, ctypes.c_int64, ctypes.POINTER(RankRows), ctypes.c_int32]),
    "rdep_layer_combine_backward": (ctypes.c_int, [LayerPtr, ctypes.c_int64, ctypes.POINTER(RankRows), ctypes.c_int32]),
    "rdep_layer_dispatch_backward": (ctypes.c_int, [LayerPtr, ctypes.c_int64, ctypes.POINTER(RankRows), ctypes.c_int32]),
    "rdep_master_adamw": (ctypes.c_int, [ctypes.POINTER(AdamWTensor), ctypes.c_int32, ctypes.POINTER(AdamWStep)]),
    "rdep_grad_accumulate": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
                                            ctypes.c_void_p]),  # version 23
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_path: str | None = None


def candidate_paths() -> list[tuple[str, Path]]:
    """Where the library is looked for, in order, with the reason for each place."""
    out = []
    env = os.environ.get("RDEP_LIBRARY")
    if env:
        out.append(("RDEP_LIBRARY", Path(env)))
    here = Path(__file__).resolve().parent
    out.append(("next to the rdep package", here / LIBRARY_NAME))
    out.append(("build/lib of the source checkout", here.parent.parent / "build" / "lib" / LIBRARY_NAME))
    return out


def library_path() -> str:
    """The path of the librdep_capi.so that is (or would be) loaded. Raises ImportError if none is found."""
    if _lib_path is not None:
        return _lib_path
    tried = []
    for why, path in candidate_paths():
        if path.is_file():
            return str(path)
        tried.append(f"{path} ({why})")
        if why == "RDEP_LIBRARY":  # an explicit choice that does not exist is an error, not a fallback
            raise ImportError(f"rdep: RDEP_LIBRARY={os.environ['RDEP_LIBRARY']} is not a file")
    raise ImportError(
        "rdep: cannot find " + LIBRARY_NAME + "; looked at " + ", ".join(tried) +
        ". Build it (cmake --build build --target rdep_capi), `pip install .` from the repository, or set RDEP_LIBRARY."
    )


def lib() -> ctypes.CDLL:
    """The loaded C library, with prototypes set and its ABI version checked (loaded once, on first use)."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = library_path()
        try:
            handle = ctypes.CDLL(path)
        except OSError as e:
            raise ImportError(f"rdep: cannot load {path}: {e}") from e
        for name, (restype, argtypes) in _PROTOTYPES.items():
            try:
                fn = getattr(handle, name)
            except AttributeError as e:
                raise ImportError(f"rdep: {path} has no symbol {name} (a library of another rdep version?)") from e
            fn.restype = restype
            fn.argtypes = argtypes
        version = handle.rdep_capi_version()
        if version != CAPI_VERSION:
            raise ImportError(f"rdep: {path} implements C ABI version {version}; this package needs {CAPI_VERSION}")
        _lib_path = path
        _lib = handle
        return handle


def last_error() -> str:
    """The calling thread's last error message from the C library."""
    msg = lib().rdep_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def check(code: int, what: str) -> None:
    """Raises the Python exception for a non-zero rdep status code, with the library's message."""
    if code != 0:
        raise error_for_code(code, f"{what}: {last_error()}")


def built_with_cuda() -> bool:
    return bool(lib().rdep_built_with_cuda())


def cuda_device_count() -> int:
    return int(lib().rdep_cuda_device_count())


_cutlass_on: set = set()  # devices where the CUTLASS compute ran: that cannot change within the process


def cutlass_available(device: int) -> tuple[bool, str]:
    """(whether expert_compute 'cutlass' runs on CUDA device `device`, why not when it does not). The library
    makes and frees a small compute there; a yes is kept for the process, a no is asked again next time (it
    may have been a passing failure, such as memory)."""
    device = int(device)
    if device in _cutlass_on:
        return True, ""
    if lib().rdep_cutlass_available(device):
        _cutlass_on.add(device)
        return True, ""
    return False, last_error()


def library_info() -> dict:
    """Path, ABI version and CUDA support of the loaded library."""
    L = lib()
    return {
        "path": _lib_path,
        "capi_version": int(L.rdep_capi_version()),
        "built_with_cuda": bool(L.rdep_built_with_cuda()),
        "cuda_devices": int(L.rdep_cuda_device_count()),
    }
