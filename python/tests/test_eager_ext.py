"""rdep.torch's eager C++ path (rdep/torch/eager_ext.py, csrc/eager_moe.cpp) against the Python path it stands in for:
the same outputs and gradients bit for bit (host backend here; CUDA below, skipped without a GPU), against the fp64
reference too, the contexts' lifetime (Layer.live_contexts, context_bytes, a graph dropped without backward, a closed
layer), its refusals (a second backward, double backward), which calls take it, and its mode switch.

The C++ path must build wherever these tests run: .ci/run and scripts/device.sh set RDEP_TORCH_EAGER_EXT=1, so a build
failure fails here; elsewhere (auto) the tests that need it skip, saying why.
"""

from __future__ import annotations

import gc

import pytest
import torch

import rdep
import rdep.torch as rt
import reference as ref
from conftest import assert_rel_close
from rdep.torch import eager_ext
from test_ops import make_inputs

TOL = 1e-5  # fp32 layer against the fp64 reference, as test_ops.py


@pytest.fixture
def ext():
    m = eager_ext.module()
    if m is None:
        pytest.skip(f"rdep.torch's eager C++ path is not built here: {eager_ext._failed or 'RDEP_TORCH_EAGER_EXT=0'}")
    return m


def _run(layer, inputs, dy, grad_mask=(True, True, True, True), on=True):
    """y and the leaves' gradients of rt.moe(...).backward(dy), with the C++ path on or off; checks the path taken."""
    x, ids, gates, w1, w2 = [t.clone() for t in inputs]
    leaves = [t.requires_grad_(g) for t, g in zip((x, gates, w1, w2), grad_mask)]
    eager_ext.enabled = on
    try:
        y = rt.moe(layer, leaves[0], ids, leaves[1], leaves[2], leaves[3])
    finally:
        eager_ext.enabled = True
    name = type(y.grad_fn).__name__
    assert (name == "CppFunction") == on, f"grad_fn {name}: the {'C++' if on else 'Python'} path did not run"
    assert layer.live_contexts == 1
    y.backward(dy)
    assert layer.live_contexts == 0
    return [y.detach()] + [t.grad for t in leaves]


CASES = [
    # id, W, E, K, n, T, capacity_factor, routing
    ("W1_E4_K2_uniform", 1, 4, 2, 16, 16, 0.0, "uniform"),
    ("W4_E8_K2_zipf", 4, 8, 2, 12, 12, 0.0, "zipf"),
    ("W4_E6_K3_zipf_C0.5_drops", 4, 6, 3, 10, 12, 0.5, "zipf"),
    ("W4_E3_K1_W_gt_E", 4, 3, 1, 9, 9, 0.0, "uniform"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_same_bits_as_the_python_path_and_the_reference(ext, case):
    _, W, E, K, n, T, C, kind = case
    layer = rt.Layer(8, 6, E, K, T, world_size=W, capacity_factor=C)
    inputs = make_inputs(layer, n, kind, seed=11)
    dy = torch.randn(W, n, 8, generator=torch.Generator().manual_seed(5))
    cpp, py = _run(layer, inputs, dy, on=True), _run(layer, inputs, dy, on=False)
    for name, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), cpp, py):
        assert torch.equal(a, b), f"{name}: the C++ path's bits differ from the Python path's"
    x, ids, gates, w1, w2 = inputs
    rl = [t.double().requires_grad_(True) for t in (x, gates, w1, w2)]
    y_ref, _ = ref.moe_layer(rl[0], ids, rl[1], rl[2], rl[3], C, T)
    y_ref.backward(dy.double())
    for name, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), cpp, [y_ref] + [t.grad for t in rl]):
        assert_rel_close(a, b, TOL, name)


@pytest.mark.parametrize("mask", [(False, False, True, False), (True, False, False, False), (False, True, False, True)])
def test_only_the_inputs_that_require_grad_get_one(ext, mask):
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    inputs = make_inputs(layer, 16, "zipf", seed=3)
    dy = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(2))
    cpp, py = _run(layer, inputs, dy, mask, on=True), _run(layer, inputs, dy, mask, on=False)
    for need, a, b in zip(mask, cpp[1:], py[1:]):
        assert (a is not None) == need and (b is not None) == need
        if need:
            assert torch.equal(a, b)


def test_context_lifetime(ext):
    """A context lives from the forward to its backward (context_bytes counts it), or until the graph is dropped."""
    layer = rt.Layer(8, 6, 4, 2, 16, world_size=2)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    w1.requires_grad_(True)
    y = rt.moe(layer, x, ids, gates, w1, w2)
    assert type(y.grad_fn).__name__ == "CppFunction"
    assert layer.live_contexts == 1 and layer.context_bytes() > 0
    del y
    assert layer.live_contexts == 0 and layer.context_bytes() == 0
    # Dropped inside a reference cycle: released when the collector runs.
    holder = {}
    holder["self"], holder["y"] = holder, rt.moe(layer, x, ids, gates, w1, w2)
    del holder
    gc.collect()
    assert layer.live_contexts == 0
    # Forwards alive together take a context each; backwards in any order release them.
    ys = [rt.moe(layer, x, ids, gates, w1, w2) for _ in range(3)]
    assert layer.live_contexts == 3
    for y in reversed(ys):
        y.sum().backward()
    assert layer.live_contexts == 0


def test_refusals_name_the_cause(ext):
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    w1.requires_grad_(True)
    y = rt.moe(layer, x, ids, gates, w1, w2)
    y.sum().backward(retain_graph=True)
    with pytest.raises(rdep.FailedPreconditionError, match="backward already ran"):
        y.sum().backward()
    y = rt.moe(layer, x, ids, gates, w1, w2)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="second time"):  # torch's own refusal: the saved tensors are freed
        y.sum().backward()
    (g,) = torch.autograd.grad(rt.moe(layer, x, ids, gates, w1, w2).sum(), w1, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()
    assert layer.live_contexts == 0
    # A backward after the layer was closed: the Python path's error (its ops find no layer by the handle).
    refusals = []
    for on in (True, False):
        layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
        eager_ext.enabled = on
        try:
            y = rt.moe(layer, x, ids, gates, w1, w2)
        finally:
            eager_ext.enabled = True
        layer.close()
        with pytest.raises(ValueError, match=f"layer: {layer.id} is not a live rdep layer handle") as e:
            y.sum().backward()
        refusals.append((type(e.value), str(e.value).replace(str(layer.id), "N")))
        with pytest.raises(ValueError, match=f"layer: {layer.id} is not a live rdep layer handle"):
            rt.moe(layer, x, ids, gates, w1, w2)
    assert refusals[0] == refusals[1]


def test_a_non_contiguous_gradient(ext):
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    inputs = make_inputs(layer, 16, "zipf", seed=4)
    dy = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(6)).transpose(1, 2)
    assert not dy.is_contiguous()
    cpp, py = _run(layer, inputs, dy, on=True), _run(layer, inputs, dy, on=False)
    for name, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), cpp, py):
        assert torch.equal(a, b), name


def test_bad_input_and_c_errors_raise_as_on_the_python_path(ext):
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    w1.requires_grad_(True)
    with pytest.raises(TypeError, match="x: expected dtype"):
        rt.moe(layer, x.double(), ids, gates, w1, w2)
    with pytest.raises(ValueError, match="w2: expected shape"):
        rt.moe(layer, x, ids, gates, w1, w2[:, :3])
    bad = ids.clone()
    bad[1, 3, 0] = 99  # an expert id out of range: the C library's check names rank, token and slot
    with pytest.raises(rdep.InvalidArgumentError, match="rank 1") as e_cpp:
        rt.moe(layer, x, bad, gates, w1, w2)
    assert layer.live_contexts == 0
    eager_ext.enabled = False
    try:
        with pytest.raises(rdep.InvalidArgumentError) as e_py:
            rt.moe(layer, x, bad, gates, w1, w2)
    finally:
        eager_ext.enabled = True
    assert str(e_py.value).split(": ", 1)[1] == str(e_cpp.value).split(": ", 1)[1]  # past the call's name, the same
    assert layer.live_contexts == 0


def test_which_calls_take_it(ext):
    """Calls that need a gradient, eagerly; not without grad, under no_grad, under a dispatch mode or while compiling."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    assert rt.moe(layer, x, ids, gates, w1, w2).grad_fn is None
    w2.requires_grad_(True)
    with torch.no_grad():
        assert rt.moe(layer, x, ids, gates, w1, w2).grad_fn is None
    with PassThrough():
        assert type(rt.moe(layer, x, ids, gates, w1, w2).grad_fn).__name__ != "CppFunction"
    with torch.autograd.profiler.profile():  # the profiler's trace names rdep's ops: the op path
        assert type(rt.moe(layer, x, ids, gates, w1, w2).grad_fn).__name__ != "CppFunction"
    with torch.inference_mode():
        assert rt.moe(layer, x, ids, gates, w1, w2).grad_fn is None
    assert type(rt.moe(layer, x, ids, gates, w1, w2).grad_fn).__name__ == "CppFunction"
    assert layer.live_contexts == 0


def test_compiled_autograd_takes_the_python_path(ext, monkeypatch):
    """Compiled autograd cannot trace the C++ node's saved state: with it on, the forward takes the Python path."""
    import sys
    import types

    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    w1.requires_grad_(True)
    for mod, attr in (("torch._dynamo.compiled_autograd", "compiled_autograd_enabled"),
                      ("torch._dynamo.config", "compiled_autograd")):
        with monkeypatch.context() as m:
            m.setitem(sys.modules, mod, types.SimpleNamespace(**{attr: True}))
            assert eager_ext._compiled_autograd()
            assert type(rt.moe(layer, x, ids, gates, w1, w2).grad_fn).__name__ != "CppFunction"
    assert type(rt.moe(layer, x, ids, gates, w1, w2).grad_fn).__name__ == "CppFunction"


def test_layers_build_the_path_before_their_first_call(monkeypatch):
    """rdep.torch.Layer builds (or loads) the C++ path when it is made, before its collective create, unless mode 0."""
    calls = []
    monkeypatch.setattr(eager_ext, "module", lambda: calls.append(1))
    for value, want in (("auto", 1), ("1", 1), ("0", 0)):
        calls.clear()
        monkeypatch.setenv("RDEP_TORCH_EAGER_EXT", value)
        rt.Layer(8, 6, 4, 2, 16, world_size=1).close()
        assert len(calls) == want, value


def test_mode_switch(monkeypatch):
    for value, want in (("", "auto"), ("AUTO", "auto"), ("0", "0"), (" 1 ", "1")):
        monkeypatch.setenv("RDEP_TORCH_EAGER_EXT", value)
        assert eager_ext.mode() == want
    monkeypatch.setenv("RDEP_TORCH_EAGER_EXT", "yes")
    with pytest.raises(ValueError, match="RDEP_TORCH_EAGER_EXT: expected one of auto, 0, 1, got 'yes'"):
        eager_ext.mode()


def test_keep_weight_casts_set_after_the_first_call_is_read(ext):
    """Layer.keep_weight_casts is an attribute a caller may set between calls: the C++ path's view of the layer, made at
    the first call, is made again when it changed (the Python path reads it every call)."""
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform", seed=2)
    leaves = [t.clone().requires_grad_(True) for t in (x, gates, w1, w2)]
    rt.moe(layer, leaves[0], ids, *leaves[1:]).sum().backward()
    first = layer._eager
    rt.moe(layer, leaves[0], ids, *leaves[1:]).sum().backward()
    assert layer._eager is first
    layer.keep_weight_casts = True
    rt.moe(layer, leaves[0], ids, *leaves[1:]).sum().backward()
    assert layer._eager is not first and layer._eager_keep is True


HOOKS = ["checkpoint", "checkpoint_reentrant", "save_on_cpu", "save_on_cpu_pinned"]


def _forward_under(how, f, leaves):
    """f(*leaves) under the saved-tensor hooks `how` names (or none: "plain")."""
    from torch.utils.checkpoint import checkpoint

    if how.startswith("checkpoint"):
        return checkpoint(f, *leaves, use_reentrant=how.endswith("reentrant"))
    if how.startswith("save_on_cpu"):
        with torch.autograd.graph.save_on_cpu(pin_memory=how.endswith("pinned")):
            return f(*leaves)
    return f(*leaves)


# Between the forward and the backward: the contexts alive (the saved rows with them) and the path the forward took.
# Non-reentrant checkpointing drops the forward's saved tensors, and with them (the plain ops) its context and rows;
# reentrant checkpointing runs the forward with grad off (no context). save_on_cpu keeps the context: the C++ path holds
# it in autograd's node, whose rows no hook moves (with pinned copies too, which copy CPU tensors as well).
HOOKS_EXPECT = {  # how: (live contexts after the forward, the C++ path taken)
    "plain": (1, True), "checkpoint": (0, False), "checkpoint_reentrant": (0, False), "save_on_cpu": (1, True),
    "save_on_cpu_pinned": (1, True),
}


@pytest.mark.parametrize("path", ["cpp", "python"])
@pytest.mark.parametrize("how", HOOKS)
def test_saved_tensor_hooks(how, path):
    """Activation checkpointing and save_on_cpu act on autograd's saved tensors. Non-reentrant checkpointing drops them
    after the forward (the plain ops then release the context, and its rows, at once: the memory checkpointing is for)
    and recomputes the forward inside the backward, stopping the recomputation early by raising from a saved-tensor hook;
    that exception must reach checkpointing as itself, and the layer's lock must be free after. The Python path takes
    the plain ops under save_on_cpu too; a pinned copy drops the ctx tensor the forward returned (whose buffer releases
    the context when freed), so the node keeps it and the backward finds the context by its copy. The same outputs and
    gradients as without the hooks, bit for bit; no context left."""
    import threading

    if path == "cpp" and eager_ext.module() is None:
        pytest.skip(f"rdep.torch's eager C++ path is not built here: {eager_ext._failed or 'RDEP_TORCH_EAGER_EXT=0'}")
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "zipf", seed=8)
    dy = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(9))
    out = {}
    eager_ext.enabled = path == "cpp"
    try:
        for mode in ("plain", how):
            leaves = [t.clone().requires_grad_(True) for t in (x, gates, w1, w2)]
            y = _forward_under(mode, lambda a, b, c, d: rt.moe(layer, a, ids, b, c, d), leaves)
            gc.collect()
            live, cpp = HOOKS_EXPECT[mode]
            assert layer.live_contexts == live, f"{mode}: {layer.live_contexts} contexts alive after the forward"
            if not mode.endswith("reentrant"):  # reentrant checkpointing's node is its own
                got = type(y.grad_fn).__name__ == "CppFunction"
                assert got == (cpp and path == "cpp"), f"{mode}: grad_fn {type(y.grad_fn).__name__}"
            y.backward(dy)
            out[mode] = [y.detach()] + [t.grad for t in leaves]
            del y
            gc.collect()
            assert layer.live_contexts == 0, f"{mode}: a context left after the backward"
    finally:
        eager_ext.enabled = True
    got = []  # the layer's lock, taken from another thread: free (a lock left held would hang the next call)

    def take():
        lock = layer._native.lock._lock
        got.append(lock.acquire(timeout=10))
        if got[-1]:
            lock.release()

    t = threading.Thread(target=take)
    t.start()
    t.join()
    assert got == [True]
    gc.collect()
    assert layer.live_contexts == 0
    for name, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), out["plain"], out[how]):
        assert torch.equal(a, b), f"{name}: differs under {how}"


# CUDA: the layers the training example and the benchmarks run, the C++ path against the Python path, bit for bit.
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

CUDA_CASES = {
    # id: layer options, W, weights dtype
    "W1_cutlass_bf16_capturable": (dict(expert_compute="cutlass"), 1, torch.bfloat16),
    "W1_cutlass_gate_in_expert_fp32_master": (dict(expert_compute="cutlass", gate_in_expert=True), 1, torch.float32),
    "W1_cutlass_fp32_master_keep_casts": (dict(expert_compute="cutlass", keep_weight_casts=True), 1, torch.float32),
    "W2_cublaslt_fp32_master_keep_casts": (dict(expert_compute="cublaslt", keep_weight_casts=True), 2, torch.float32),
    "W4_cutlass_bf16_zipf": (dict(expert_compute="cutlass"), 4, torch.bfloat16),
}


def _backward_after_reuse(layer, dev, dy, *ys):
    """The backwards of ys in order, after other work took the freed memory (four 0xFF buffers of the layer's row bytes):
    a context still reading a freed arena, or one a hook moved, would read these bytes."""
    junk = [torch.full((layer.row_bytes,), 0xFF, dtype=torch.uint8, device=dev) for _ in range(4)]
    for y in ys:
        y.backward(dy)
    del junk
    torch.cuda.synchronize()


@cuda
@pytest.mark.parametrize("path", ["cpp", "python"])
@pytest.mark.parametrize("how", ["checkpoint", "save_on_cpu", "save_on_cpu_pinned"])
def test_cuda_saved_tensor_hooks_keep_the_context_rows(ext, how, path):
    """Activation checkpointing (non-reentrant) and save_on_cpu act on autograd's saved tensors, on a capturable layer
    (whose Python path otherwise saves its rows as a device tensor). The context's saved rows stay where the context
    reads them, with other work reusing freed memory between the forward and the backward: the same outputs and
    gradients as without the hooks, bit for bit. Under checkpointing the forward's context and rows go back at once:
    no context alive and no more of torch's memory held after the forward than before it (but y)."""
    if not rdep._capi.built_with_cuda():
        pytest.skip("librdep_capi.so was built without CUDA")
    E, K, n, H, F = 8, 2, 64, 128, 64
    dev = torch.device("cuda", 0)
    layer = rt.Layer(H, F, E, K, n, world_size=1, backend="cuda", expert_compute="cutlass")
    assert layer.capturable and layer.row_bytes > 0  # the arena forward
    g = torch.Generator().manual_seed(13)
    x, ids, gates, w1, w2 = ref.draw_inputs(1, n, H, F, E, K, "zipf", g)
    x, ids, gates, w1, w2 = x.to(dev).bfloat16(), ids.to(dev), gates.to(dev), w1.to(dev), w2.to(dev)
    dy = torch.randn(1, n, H, generator=g).to(dev).bfloat16()
    out = {}
    eager_ext.enabled = path == "cpp"
    try:
        for mode in ("plain", how):
            leaves = [t.clone().requires_grad_(True) for t in (x, gates, w1, w2)]
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(dev)
            y = _forward_under(mode, lambda a, b, c, d: rt.moe(layer, a, ids, b, c, d), leaves)
            gc.collect()
            if mode == "checkpoint":
                held = torch.cuda.memory_allocated(dev) - before - y.untyped_storage().nbytes()
                assert layer.live_contexts == 0 and held <= 0, f"checkpointed forward kept {held} bytes"
            else:
                assert layer.live_contexts == 1
            _backward_after_reuse(layer, dev, dy, y)
            out[mode] = [y.detach()] + [t.grad for t in leaves]
            del y
            gc.collect()
            assert layer.live_contexts == 0
    finally:
        eager_ext.enabled = True
    for name, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), out["plain"], out[how]):
        assert torch.equal(a, b), f"{name}: differs under {how}"


@cuda
@pytest.mark.parametrize("pin", [False, True])
def test_cuda_compiled_capturable_ops_follow_rows_a_hook_moved(ext, monkeypatch, pin):
    """A compiled graph's saved activations pass through saved-tensor hooks when it runs, whatever the hooks were at
    compile time: under save_on_cpu the capturable ops' rows tensor (the arena the context's saved rows are pieces of)
    and ctx come back to the backward as copies at other addresses, the old bytes overwritten meanwhile. The context
    is held past its ctx's death (a second forward and a read of live_contexts between do not release it or take its
    slot) and reads the copy (graph_contexts.follow_rows, rdep_context_rebase_rows): the same outputs and gradients as
    an eager call, bit for bit, and the contexts released."""
    if not rdep._capi.built_with_cuda():
        pytest.skip("librdep_capi.so was built without CUDA")
    from rdep.torch import graph_contexts

    E, K, n, H, F = 8, 2, 64, 128, 64
    dev = torch.device("cuda", 0)
    layer = rt.Layer(H, F, E, K, n, world_size=1, backend="cuda", expert_compute="cutlass")
    assert layer.capturable and layer.row_bytes > 0
    g = torch.Generator().manual_seed(17)
    x, ids, gates, w1, w2 = ref.draw_inputs(1, n, H, F, E, K, "zipf", g)
    x, ids, gates, w1, w2 = x.to(dev).bfloat16(), ids.to(dev), gates.to(dev), w1.to(dev).bfloat16(), w2.to(dev).bfloat16()
    dy = torch.randn(1, n, H, generator=g).to(dev).bfloat16()
    moved = []
    follow = graph_contexts.follow_rows

    def spy(layer_, e, rows, capturing_now):
        moved.append(rows.data_ptr() != e.rows_at)
        return follow(layer_, e, rows, capturing_now)

    monkeypatch.setattr(graph_contexts, "follow_rows", spy)
    f = lambda a, b, c, d: rt.moe(layer, a, ids, b, c, d)  # noqa: E731
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    out = {}
    for mode in ("eager", "compiled"):
        leaves = [t.clone().requires_grad_(True) for t in (x, gates, w1, w2)]
        if mode == "eager":
            y = f(*leaves)
        else:
            with torch.autograd.graph.save_on_cpu(pin_memory=pin):
                y = compiled(*leaves)
                other = [(t * 0.5).requires_grad_(True) for t in (x, gates, w1, w2)]
                y_other = compiled(*other)  # a second forward before the first backward, on other inputs
            gc.collect()
            assert layer.live_contexts == 2  # read: a sweep, which must not release the held contexts
        _backward_after_reuse(layer, dev, dy, *([y, y_other] if mode == "compiled" else [y]))
        if mode == "compiled":
            del y_other, other
        out[mode] = [y.detach()] + [t.grad for t in leaves]
        del y
        gc.collect()
        assert layer.live_contexts == 0
    assert moved == [True, True], f"the compiled backwards' rows: moved {moved} (the test needs the hook to move them)"
    for name, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), out["eager"], out["compiled"]):
        assert torch.equal(a, b), f"{name}: differs"


@cuda
def test_cuda_keep_weight_casts_set_after_the_first_call_keeps_the_casts(ext):
    """fp32 master weights: with keep_weight_casts set after a first call, the next forward keeps its bf16 casts for the
    backward (torch's memory after the forward grows by their bytes), as the Python path does."""
    if not rdep._capi.built_with_cuda():
        pytest.skip("librdep_capi.so was built without CUDA")
    E, K, n, H, F = 8, 2, 64, 128, 64
    dev = torch.device("cuda", 0)
    layer = rt.Layer(H, F, E, K, n, world_size=1, backend="cuda", expert_compute="cutlass")
    g = torch.Generator().manual_seed(5)
    x, ids, gates, w1, w2 = ref.draw_inputs(1, n, H, F, E, K, "zipf", g)
    x, ids, gates = x.to(dev).bfloat16(), ids.to(dev), gates.to(dev)
    w1, w2 = w1.to(dev, torch.float32), w2.to(dev, torch.float32)  # master weights: cast to bf16 in every forward
    casts = (w1.numel() + w2.numel()) * 2  # their bf16 bytes
    held = {}
    for keep in (False, True, False):
        layer.keep_weight_casts = keep
        leaves = [t.clone().requires_grad_(True) for t in (x, gates, w1, w2)]
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(dev)
        y = rt.moe(layer, leaves[0], ids, *leaves[1:])
        assert type(y.grad_fn).__name__ == "CppFunction"
        held[keep] = torch.cuda.memory_allocated(dev) - before
        y.sum().backward()
        del y
    assert held[True] - held[False] >= casts, held


@cuda
@pytest.mark.parametrize("name", list(CUDA_CASES))
def test_cuda_same_bits_as_the_python_path(ext, name):
    if not rdep._capi.built_with_cuda():
        pytest.skip("librdep_capi.so was built without CUDA")
    opts, W, wdt = CUDA_CASES[name]
    E, K, n, H, F = 8, 2, 64, 128, 64
    dev = torch.device("cuda", 0)
    layer = rt.Layer(H, F, E, K, n, world_size=W, backend="cuda", num_gpus=1, **opts)
    g = torch.Generator().manual_seed(9)
    x, ids, gates, w1, w2 = ref.draw_inputs(W, n, H, F, E, K, "zipf", g)
    inputs = [x.to(dev).bfloat16(), ids.to(dev), gates.to(dev), w1.to(dev, wdt), w2.to(dev, wdt)]
    dy = torch.randn(W, n, H, generator=g).to(dev).bfloat16()
    s = torch.cuda.Stream()  # on a side stream: the C++ path reads torch's current stream, as the Python path does
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cpp, py = _run(layer, inputs, dy, on=True), _run(layer, inputs, dy, on=False)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    for what, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), cpp, py):
        assert a.dtype == b.dtype and torch.isfinite(a.float()).all(), what
        assert torch.equal(a, b), f"{what}: the C++ path's bits differ from the Python path's"
    assert cpp[3].dtype == wdt  # the weights' gradients in the weights' dtype


def test_a_failed_build_leaves_the_python_path_or_raises(monkeypatch):
    """auto: a build that fails warns once, naming the error, and the Python path runs (same results); 1: it raises."""
    def broken(verbose=False):
        raise OSError("no compiler here")

    monkeypatch.setattr(eager_ext, "build", broken)
    monkeypatch.setattr(eager_ext, "_module", None)
    monkeypatch.setattr(eager_ext, "_failed", None)
    monkeypatch.setenv("RDEP_TORCH_EAGER_EXT", "1")
    with pytest.raises(RuntimeError, match="RDEP_TORCH_EAGER_EXT=1: rdep.torch's eager C\\+\\+ path did not build: no compiler"):
        eager_ext.module()
    monkeypatch.setenv("RDEP_TORCH_EAGER_EXT", "auto")
    with pytest.warns(RuntimeWarning, match="did not build \\(OSError: no compiler here\\); the Python path runs"):
        assert eager_ext.module() is None
    assert eager_ext.module() is None  # once: no second warning, no second build
    layer = rt.Layer(8, 6, 4, 2, 16, world_size=1)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    y = rt.moe(layer, x, ids, gates, w1.requires_grad_(True), w2)
    assert type(y.grad_fn).__name__ != "CppFunction" and layer.live_contexts == 1
    y.sum().backward()
    assert layer.live_contexts == 0 and w1.grad is not None
    monkeypatch.setenv("RDEP_TORCH_EAGER_EXT", "0")
    monkeypatch.setattr(eager_ext, "_failed", None)
    assert eager_ext.module() is None  # mode 0 never builds (broken() would raise)


def test_build_command(monkeypatch, capsys):
    from rdep.torch import __main__ as cli

    assert cli.main(["nonsense"]) == 2
    assert "usage: python -m rdep.torch build-eager-ext" in capsys.readouterr().err
    import types

    monkeypatch.setattr(eager_ext, "build", lambda verbose=False: types.ModuleType("rdep_eager_moe_x"))
    assert cli.main(["build-eager-ext"]) == 0
    assert "built (rdep_eager_moe_x)" in capsys.readouterr().out


def _corruptions(layer, x, ids, gates, w1, w2):
    """Each way an argument can be wrong, as (name, the five arguments)."""
    args = dict(x=x, experts=ids, gates=gates, w1=w1, w2=w2)
    out = []
    for k, t in args.items():
        out.append((f"{k} dtype", {**args, k: t.to(torch.float64 if t.is_floating_point() else torch.int64)}))
        out.append((f"{k} rank count", {**args, k: t[:1]}))
        out.append((f"{k} last dim", {**args, k: t[..., :1]}))
        out.append((f"{k} dims", {**args, k: t[0]}))
        out.append((f"{k} non-contiguous", {**args, k: t.transpose(-1, -2).contiguous().transpose(-1, -2)}))
        out.append((f"{k} device", {**args, k: t.to("meta")}))
    out.append(("too many tokens", {**args, "x": torch.cat([x, x], 1), "experts": torch.cat([ids, ids], 1),
                                    "gates": torch.cat([gates, gates], 1)}))
    out.append(("token counts differ", {**args, "experts": ids[:, :-1]}))
    out.append(("w2 dtype of w1", {**args, "w2": w2.to(torch.float64)}))
    return out


def test_argument_checks_match_the_python_path(ext):
    """The C++ path's own check of the tensors' metadata refuses whatever validate.check_forward refuses, with its
    exception and message (it calls it): every corruption here is refused by both, alike."""
    layer = rt.Layer(8, 6, 6, 2, 16, world_size=2)
    x, ids, gates, w1, w2 = make_inputs(layer, 16, "uniform")
    w1.requires_grad_(True)
    refused = 0
    cases = _corruptions(layer, x, ids, gates, w1, w2)
    for name, a in cases:
        errors = []
        for on in (True, False):
            eager_ext.enabled = on
            try:
                y = rt.moe(layer, a["x"], a["experts"], a["gates"], a["w1"], a["w2"])
                errors.append(None)
                assert (type(y.grad_fn).__name__ == "CppFunction") == on, name
            except (TypeError, ValueError) as e:
                errors.append((type(e), str(e)))
            finally:
                eager_ext.enabled = True
        assert errors[0] == errors[1], f"{name}: C++ path {errors[0]}, Python path {errors[1]}"
        refused += errors[0] is not None
    assert refused == len(cases), f"{len(cases) - refused} corruptions accepted by both paths"
    assert layer.live_contexts == 0
