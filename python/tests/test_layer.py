"""rdep.torch.Layer: what a layer reports (ranks, ownership, capacity, description), its arguments'
checks (Python-side and the C library's, both naming the argument), and its lifetime.
"""

from __future__ import annotations

import gc

import pytest
import torch

import rdep
import rdep.torch as rt


def test_source_windows_is_a_bool_the_layer_and_module_keep():
    """source_windows (C ABI version 20's no_source_windows, inverted): on by default, off when asked, a bool or a
    TypeError naming it; the module passes it to its layer. The host backend always takes the three phases, so
    both give the same outputs there (the CUDA layer's equality is its C++ GPU test, CudaSourceWindows)."""
    assert rt.Layer(8, 6, 7, 2, 16, world_size=2).source_windows is True
    assert rt.Layer(8, 6, 7, 2, 16, world_size=2, source_windows=False).source_windows is False
    with pytest.raises(TypeError, match="source_windows: expected a bool, got int"):
        rt.Layer(8, 6, 7, 2, 16, world_size=2, source_windows=1)
    outs = []
    for windows in (True, False):
        moe = rt.MoE(8, 6, num_experts=4, topk=2, max_tokens=16, world_size=1, seed=3, source_windows=windows)
        assert moe.layer.source_windows is windows
        outs.append(moe(torch.randn(16, 8, generator=torch.Generator().manual_seed(5))).y)
    assert torch.equal(outs[0], outs[1])


def test_host_layer_reports_its_configuration():
    layer = rt.Layer(8, 6, 7, 2, 16, world_size=3, capacity_factor=0.5)
    assert layer.backend == "host" and layer.device == torch.device("cpu")
    assert list(layer.local_ranks) == [0, 1, 2] and layer.num_local_ranks == 3
    assert [layer.owned_experts(r) for r in range(3)] == [(0, 3), (3, 2), (5, 2)]
    assert layer.local_experts == range(0, 7) and layer.num_local_experts == 7
    assert layer.capacity() == 7  # ceil(0.5 * 3 * 16 * 2 / 7) = ceil(6.86)
    assert rt.Layer(8, 6, 7, 2, 16).capacity() is None  # dropless
    text = layer.describe()
    assert "W=3" in text and "E=7" in text and "threads" in text
    assert "W=3" in repr(layer) and "backend=host" in repr(layer)
    with pytest.raises(ValueError, match=r"^rank: 3 outside \[0, world_size=3\)"):
        layer.owned_experts(3)
    assert layer.check_errors() is None  # the host backend has no device barrier records
    layer.close()
    with pytest.raises(Exception, match="closed"):
        layer.check_errors()


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(backend="tpu"), ValueError, r"^backend: expected one of"),
    (dict(backend="host", device="cuda"), ValueError, r"^device: the host backend runs on cpu tensors"),
    (dict(hidden=0), ValueError, r"^hidden: expected a positive int"),
    (dict(topk=9), ValueError, r"^topk: 9 exceeds num_experts=4"),
    (dict(capacity_factor=-1.0), ValueError, r"^capacity_factor"),
    (dict(segment_tokens=-2), ValueError, r"^segment_tokens"),
    (dict(world_size=0), ValueError, r"^world_size: expected a positive int"),
    (dict(expert_compute="cublas"), ValueError, r"^expert_compute: expected 'auto' or one of \('cublaslt', 'cutlass'\)"),
    # the sync-free options need the CUTLASS compute; 'auto' says what it chose and why
    (dict(stash_rows=64), ValueError, r"^stash_rows: the paged stash needs the sync-free layer: .*expert_compute='auto' "
                                      r"chose 'cublaslt': the host backend computes on the host"),
    # checked by the C library: InvalidArgumentError (a ValueError) naming the spec field
    (dict(barrier_timeout_s=float("nan")), rdep.InvalidArgumentError, r"barrier_timeout_s"),
])
def test_bad_arguments_name_the_argument(kwargs, exc, pattern):
    args = dict(hidden=8, ffn=8, num_experts=4, topk=2, max_tokens=8)
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        rt.Layer(**args)


def test_expert_compute_auto_resolves_and_says_why():
    """expert_compute='auto' (the default) names what the layer runs; on the host backend 'cublaslt' (the C
    field the host backend ignores) with the reason; an explicit choice is kept as given."""
    layer = rt.Layer(8, 8, 4, 2, 8)
    assert layer.expert_compute == "cublaslt" and layer.expert_compute_note == "the host backend computes on the host"
    kept = rt.Layer(8, 8, 4, 2, 8, expert_compute="cublaslt")
    assert kept.expert_compute == "cublaslt" and kept.expert_compute_note == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_backend_without_a_gpu_is_unavailable():
    with pytest.raises(rdep.RdepError) as info:
        rt.Layer(8, 8, 4, 2, 8, backend="cuda")
    assert isinstance(info.value, RuntimeError)


def test_layer_is_freed_with_its_last_reference():
    layer = rt.Layer(8, 8, 4, 2, 8)
    lid = layer.id
    assert rt.get_layer(lid) is layer
    del layer
    gc.collect()
    with pytest.raises(ValueError, match=f"^layer: {lid} is not a live rdep layer handle"):
        rt.get_layer(lid)


def test_contexts_keep_the_native_layer_alive():
    """A graph that outlives its Layer object keeps the C layer (and its saved state) alive: the native
    handle is freed only when the last context is released."""
    layer = rt.Layer(8, 6, 4, 2, 8, world_size=2)
    native = layer._native
    x = torch.randn(2, 8, 8, requires_grad=True)
    ids = torch.rand(16, 4).argsort(-1)[:, :2].reshape(2, 8, 2).int()
    y = rt.moe(layer, x, ids, torch.rand(2, 8, 2), torch.randn(4, 8, 12), torch.randn(4, 6, 8))
    del layer
    gc.collect()
    assert native.ptr is not None and len(native.live) == 1
    del y
    gc.collect()
    assert len(native.live) == 0


def test_close_and_context_manager():
    with rt.Layer(8, 8, 4, 2, 8) as layer:
        assert layer.describe()
    with pytest.raises(ValueError, match="was closed"):
        layer.describe()


def test_call_lock_pauses_the_collector_only_when_asked():
    """The layer's call lock (rdep.torch.layer._CallLock): with pause_gc (a CUDA layer whose contexts take
    their rows from torch's caching allocator, whose callbacks run Python on the C call's threads) Python's
    cyclic collector is off while the lock is held, re-entrantly, and back on after; without it the lock
    leaves the collector alone; a collector the caller had disabled stays disabled."""
    from rdep.torch.layer import _CallLock

    assert gc.isenabled()
    lock = _CallLock()
    with lock:
        assert gc.isenabled()
    lock.pause_gc = True
    with lock:
        assert not gc.isenabled()
        with lock:  # re-entrant: still paused, and not re-enabled by the inner exit
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with lock:
            assert not gc.isenabled()
        assert not gc.isenabled()  # the caller's choice is kept
    finally:
        gc.enable()
    layer = rt.Layer(8, 6, 4, 2, 8, world_size=2)  # the host backend: no row allocator, no pause
    assert layer._native.lock.pause_gc is False


def test_call_locks_of_two_threads_keep_the_collector_paused_until_both_let_go():
    """Two layers' locks held by two threads at once (a backward on autograd's device thread while another thread calls
    another layer): the collector stays off until the last of them is released, whichever lets go first, and is on
    again after."""
    import threading

    from rdep.torch.layer import _CallLock

    a, b = _CallLock(), _CallLock()
    a.pause_gc = b.pause_gc = True
    b_held, a_released, seen = threading.Event(), threading.Event(), []

    def other():
        with b:
            b_held.set()
            a_released.wait(10)
            seen.append(gc.isenabled())  # a let go first: b still holds the pause

    assert gc.isenabled()
    t = threading.Thread(target=other)
    with a:
        t.start()
        assert b_held.wait(10)
    a_released.set()
    t.join(10)
    assert seen == [False]
    assert gc.isenabled()
