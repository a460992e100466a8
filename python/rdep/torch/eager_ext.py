"""rdep.torch's eager MoE call in C++ (csrc/eager_moe.cpp), compiled when the first Layer is made.

rdep.torch.moe takes it for a call that needs a gradient and runs eagerly: where op_library.direct_ok holds (no
torch.compile or jit trace, no torch-function or dispatch mode, no functorch transform, no profiler, plain tensors), the
current stream is not capturing a CUDA graph, and compiled autograd is off. It makes the calls the Python kernels make (ops.py, layer_calls.py:
the same allocations, C ABI calls and context bookkeeping), from C++, as one autograd node that holds the forward's
context: the Python path's per-call host time (several hundred microseconds a forward+backward on a GPU machine's
host, perf-notes "twentieth session") is what it removes. Everywhere else, and where it cannot be built, the Python
path runs; the results are the same bit for bit (python/tests/test_eager_ext.py).

RDEP_TORCH_EAGER_EXT: "auto" (the default: build when the first rdep.torch.Layer is made, keep the Python path with a
warning when the build fails), "1" (required: a failed build raises), "0" (never: the Python path). The build needs a
C++ compiler and ninja, as any torch extension; it is cached per source, torch and Python version under torch's
extension directory (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions), so it runs once (about a minute). `python -m
rdep.torch build-eager-ext` builds it ahead of time.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

from .. import _capi, _errors
from . import graph_contexts, validate

_SOURCE = Path(__file__).parent / "csrc" / "eager_moe.cpp"
_MODES = ("auto", "0", "1")

_lock = threading.Lock()
_module = None
_failed: Optional[str] = None  # why the build failed (auto mode: the Python path runs)
enabled = True  # tests switch the C++ path off to compare it with the Python path


def mode() -> str:
    m = os.environ.get("RDEP_TORCH_EAGER_EXT", "auto").strip().lower() or "auto"
    if m not in _MODES:
        raise ValueError(f"RDEP_TORCH_EAGER_EXT: expected one of {', '.join(_MODES)}, got {m!r}")
    return m


def _include_dir() -> Path:
    """include/ holding rdep/capi.h: the installed package's copy, else the source checkout's."""
    package = Path(__file__).resolve().parents[1]
    for d in (package / "include", package.parents[1] / "include"):
        if (d / "rdep" / "capi.h").is_file():
            return d
    raise FileNotFoundError(f"rdep/capi.h: not found under {package / 'include'} nor {package.parents[1] / 'include'}")


def _name(include: Path) -> str:
    h = hashlib.sha1()
    for part in (_SOURCE.read_bytes(), (include / "rdep" / "capi.h").read_bytes(), torch.__version__.encode(),
                 sys.version.encode()):
        h.update(part)
    return f"rdep_eager_moe_{h.hexdigest()[:16]}"


def build(verbose: bool = False):
    """The compiled module (built, or loaded from torch's extension cache); raises when it cannot be built."""
    from torch.utils import cpp_extension

    include = _include_dir()
    return cpp_extension.load(name=_name(include), sources=[str(_SOURCE)], extra_include_paths=[str(include)],
                              extra_cflags=["-O2"], verbose=verbose)


def _cached() -> bool:
    """Whether torch's extension cache holds this build already (else module() says it compiles)."""
    try:
        from torch.utils import cpp_extension

        name = _name(_include_dir())
        return (Path(cpp_extension._get_build_directory(name, False)) / f"{name}.so").is_file()
    except Exception:  # noqa: BLE001 - a private helper of torch's; the build itself reports real problems
        return False


def prepare() -> None:
    """Builds (or loads) the C++ path now, unless switched off: rdep.torch.Layer calls it before it creates the C layer,
    so that a first build runs before any collective call (a peer process waiting in one would time out) rather than in
    the first training step."""
    if mode() != "0":
        module()


def module():
    """The compiled module, or None (mode 0, switched off, or a failed build in auto mode). Builds on first use."""
    global _module, _failed
    if _module is not None:
        return _module if enabled else None
    if not enabled or _failed is not None:
        return None
    m = mode()
    if m == "0":
        return None
    with _lock:
        if _module is None and _failed is None:
            try:
                if not _cached():
                    print(f"rdep.torch: compiling the eager C++ path for torch {torch.__version__} (once; about a minute; "
                          "RDEP_TORCH_EAGER_EXT=0 skips it)", file=sys.stderr, flush=True)
                _module = build()
            except Exception as e:  # noqa: BLE001 - any build failure leaves the Python path
                if m == "1":
                    raise RuntimeError(f"RDEP_TORCH_EAGER_EXT=1: rdep.torch's eager C++ path did not build: {e}") from e
                _failed = f"{type(e).__name__}: {e}"
                warnings.warn(f"rdep.torch: the eager C++ path did not build ({_failed}); the Python path runs "
                              "(slower host time a call). RDEP_TORCH_EAGER_EXT=0 skips the build.", RuntimeWarning,
                              stacklevel=3)
    return _module


def _functions() -> list[int]:
    lib = _capi.lib()
    names = ("rdep_layer_forward", "rdep_layer_forward_arena", "rdep_layer_backward", "rdep_context_acquire",
             "rdep_context_release", "rdep_last_error")
    return [ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names]


def _layer_of(mod, layer):
    """The C++ view of the layer (built once a layer, and again when its keep_weight_casts, an attribute callers may set,
    changed: the view reads it when made; it holds the layer's _Native, not the Layer)."""
    e = getattr(layer, "_eager", None)
    keep = bool(layer.keep_weight_casts)
    if e is None or layer._eager_keep != keep:
        from . import ops  # noqa: PLC0415 - ops imports this module

        cuda = layer.backend == "cuda"
        e = mod.make_layer(
            layer._native, _errors.error_for_code, _errors.FailedPreconditionError, validate.check_forward,
            graph_contexts.sweep, layer.id,
            layer.num_local_ranks, layer.hidden, layer.ffn, layer.topk, layer.max_tokens,
            [tuple(p) for p in layer._rank_experts], cuda, layer.device.index if cuda else -1,
            layer._native.row_bytes, keep,
            ops._layer_writes_bf16_grads(layer), ops._layer_reads_casts_in_grads(layer),
            _functions())
        layer._eager, layer._eager_keep = e, keep
    return e


def forward(layer, x, experts, gates, w1, w2):
    """y of rdep.torch.moe through the C++ path, or None where it does not apply (the caller runs the Python path):
    for a call that saves a context (the caller checked direct_ok: plain tensors) outside a CUDA graph capture. The
    C++ path checks the tensors' metadata as validate.check_forward does and calls it where they differ, so the
    errors name the argument as the ops' do."""
    mod = module()
    if mod is None or graph_contexts.capturing(x) or _compiled_autograd():
        return None
    return mod.moe(_layer_of(mod, layer), layer, x, experts, gates, w1, w2)


def _compiled_autograd() -> bool:
    """Whether compiled autograd is on (torch._dynamo.compiled_autograd): it cannot trace the C++ node's saved state
    (its guard is an opaque capsule), so the Python path runs. Read without importing torch._dynamo."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    cfg = sys.modules.get("torch._dynamo.config")
    return bool((ca is not None and getattr(ca, "compiled_autograd_enabled", False))
                or (cfg is not None and getattr(cfg, "compiled_autograd", False)))

