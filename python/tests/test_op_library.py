"""op_library (rdep's operator registration) on test ops of its own, CPU tensors, no C library:
the autograd kernel register_autograd installs (gradients, the schema's defaults, needs_input_grad, the error
for a gradient of a left-out default), the fallback to torch.library.register_autograd for schemas it leaves
to torch, and which schema arguments take that fallback; the eager call without the dispatcher (`call`: the same
results and gradients, the kernel reached without the dispatcher, and `direct_ok` refusing wherever the dispatcher
is needed). Exact comparisons: the ops are plain torch arithmetic.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import rdep.torch  # noqa: F401  (registers rdep's own ops first: the test ops share their library)
from rdep.torch import op_library

pytestmark = pytest.mark.no_library  # rdep.torch imports without librdep_capi.so; these ops never call it


def _scale_kernel(x, w, scale=2.0):
    # Whether the dispatcher ran this kernel below autograd (the Autograd key excluded), or `call` did directly.
    _SEEN["below_autograd"] = torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradFunctionality)
    return x * w * scale


def _scale_fake(x, w, scale=2.0):
    return torch.empty_like(x)


_SEEN = {}


def _setup(ctx, inputs, output):
    x, w, scale = inputs
    _SEEN["inputs"] = len(inputs)
    ctx.save_for_backward(x, w)
    ctx.scale = scale


def _backward(ctx, grad):
    x, w = ctx.saved_tensors
    _SEEN["needs"] = tuple(ctx.needs_input_grad)
    return grad * w * ctx.scale, grad * x * ctx.scale, None


SCALE = op_library.define("test_oplib_scale", "(Tensor x, Tensor w, float scale=2.0) -> Tensor", _scale_kernel,
                          _scale_fake)
op_library.register_autograd(SCALE, _backward, _setup)



def _setup_kw(ctx, inputs, output, keyword_only_inputs):  # torch's registration's contract for keyword-only inputs
    _setup(ctx, (*inputs, keyword_only_inputs.get("scale", 2.0)), output)


def _backward_kw(ctx, grad):
    return _backward(ctx, grad)[:2]  # gradients for the positional inputs only


# keyword-only: register_autograd leaves it to torch's registration
SCALE_KW = op_library.define("test_oplib_scale_kw", "(Tensor x, Tensor w, *, float scale=2.0) -> Tensor",
                             _scale_kernel, _scale_fake)
op_library.register_autograd(SCALE_KW, _backward_kw, _setup_kw)


def _bad_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad * w, grad * x, torch.ones(())  # a "gradient" for the defaulted `extra` the call left out


SCALE_BAD = op_library.define("test_oplib_scale_bad", "(Tensor x, Tensor w, Tensor? extra=None) -> Tensor",
                              lambda x, w, extra=None: x * w, lambda x, w, extra=None: torch.empty_like(x))
op_library.register_autograd(SCALE_BAD, _bad_backward, lambda ctx, inputs, out: ctx.save_for_backward(*inputs[:2]))


def _inputs(requires=(True, True), seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w = (torch.randn(5, 3, generator=g, dtype=torch.float64) for _ in range(2))
    return x.requires_grad_(requires[0]), w.requires_grad_(requires[1])


@pytest.mark.parametrize("op", [SCALE, SCALE_KW], ids=["plain_kernel", "torch_registration"])
@pytest.mark.parametrize("scale", [None, 0.5])
def test_gradients_match_the_formula(op, scale):
    x, w = _inputs()
    kwargs = {} if scale is None else {"scale": scale}
    y = op(x, w, **kwargs)
    s = 2.0 if scale is None else scale
    assert torch.equal(y, x.detach() * w.detach() * s)
    gy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), gy)
    assert torch.equal(gx, gy * w.detach() * s)
    assert torch.equal(gw, gy * x.detach() * s)
    if op is SCALE:
        assert _SEEN["inputs"] == 3  # setup_context sees the left-out default filled in
    kernel_name = type(y.grad_fn).__name__
    assert ("RdepAutograd_test_oplib_scale" in kernel_name) == (op is SCALE), kernel_name


def test_gradcheck_through_the_plain_kernel():
    x, w = _inputs()
    assert torch.autograd.gradcheck(lambda a, b: SCALE(a, b, 0.25), (x, w))


def test_needs_input_grad_has_one_entry_an_input():
    x, w = _inputs(requires=(False, True))
    y = SCALE(x, w)
    y.sum().backward()
    assert _SEEN["needs"] == (False, True)  # not (False, True, False): the key set's entry is trimmed
    assert x.grad is None and w.grad is not None


def test_no_graph_without_inputs_that_require_grad():
    x, w = _inputs(requires=(False, False))
    y = SCALE(x, w)
    assert not y.requires_grad and y.grad_fn is None
    x, w = _inputs()
    with torch.no_grad():
        y = SCALE(x, w)
    assert not y.requires_grad


def test_gradient_for_a_left_out_default_is_an_error():
    x, w = _inputs()
    y = SCALE_BAD(x, w)
    with pytest.raises(RuntimeError, match="defaulted input the call left out"):
        y.sum().backward()


def test_which_schemas_the_plain_kernel_takes():
    def flags(op):
        return [op_library._kwarg_only_mutable_or_list(a) for a in op._schema.arguments]

    assert flags(torch.ops.aten.mul.Tensor) == [False, False]
    assert flags(torch.ops.aten.add.out) == [False, False, True, True]  # alpha keyword-only, out written
    assert flags(torch.ops.aten.cat.default)[0]  # a tensor list
    assert flags(torch.ops.aten.add_.Tensor)[0]  # in place: self written
    assert not any(flags(SCALE)) and flags(SCALE_KW) == [False, False, True]
    assert flags(torch.ops.aten.index.Tensor)[1]  # Tensor?[] indices
    assert op_library._kwarg_only_mutable_or_list(torch.ops.aten.split.Tensor._schema.returns[0])  # -> Tensor[]
    lists = op_library.define("test_oplib_lists", "(Tensor x, Tensor[]? xs=None, int[]? sizes=None) -> Tensor",
                              lambda x, xs=None, sizes=None: x.clone(), lambda x, xs=None, sizes=None: torch.empty_like(x))
    assert flags(lists) == [False, True, False]  # an optional list of tensors; a list of ints is not one


def test_a_library_of_another_namespace_is_refused():
    with pytest.raises(ValueError, match="namespace 'rdep'"):
        op_library.register_autograd(SCALE, _backward, _setup, lib=torch.library.Library("rdep_oplib_other", "FRAGMENT"))


def test_opcheck_passes_on_both_registrations():
    for op in (SCALE, SCALE_KW):
        x, w = _inputs()
        torch.library.opcheck(op, (x, w))


@pytest.mark.parametrize("requires", [(True, True), (False, True), (False, False)])
def test_call_without_the_dispatcher_matches_the_op(requires):
    """op_library.call: the kernel reached directly (not below the dispatcher's autograd), through the same formula:
    bitwise the op's outputs and gradients, needs_input_grad as the op's, no graph without inputs needing grad."""
    x, w = _inputs(requires)
    assert op_library.direct_ok(x, w)
    y_op = SCALE(x, w, 0.5)
    assert _SEEN["below_autograd"]
    y = op_library.call(SCALE, x, w, 0.5)
    assert not _SEEN["below_autograd"]
    assert torch.equal(y, y_op) and y.requires_grad == y_op.requires_grad == any(requires)
    if not any(requires):
        assert y.grad_fn is None
        return
    gy = torch.randn_like(y)
    leaves = [t for t in (x, w) if t.requires_grad]
    want = torch.autograd.grad(y_op, leaves, gy)
    needs_op = _SEEN["needs"]
    got = torch.autograd.grad(y, leaves, gy)
    assert _SEEN["needs"] == needs_op == requires + (False,)  # scale's entry: not a tensor
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert type(y.grad_fn).__name__ == type(y_op.grad_fn).__name__


def test_call_gradcheck():
    x, w = _inputs()
    assert torch.autograd.gradcheck(lambda a, b: op_library.call(SCALE, a, b, 0.25), (x, w))


def test_call_of_an_op_without_a_formula_goes_through_the_dispatcher():
    x, w = _inputs()
    y = op_library.call(SCALE_KW, x, w)  # torch's own registration: no formula of op_library's to apply
    assert _SEEN["below_autograd"] and torch.equal(y, x.detach() * w.detach() * 2.0)


class _Subclass(torch.Tensor):
    pass


def test_direct_ok_refuses_wherever_the_dispatcher_is_needed():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    x, w = _inputs()
    assert op_library.direct_ok(x, torch.nn.Parameter(w.detach()))  # a Parameter is a plain tensor here
    assert not op_library.direct_ok(x, w.detach().as_subclass(_Subclass))
    with FakeTensorMode():
        assert not op_library.direct_ok(x, w)
    with TorchDispatchMode():
        assert not op_library.direct_ok(x, w)
    with TorchFunctionMode():
        assert not op_library.direct_ok(x, w)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not op_library.direct_ok(x, w)
    seen = []
    torch.func.grad(lambda a: (seen.append(op_library.direct_ok(a)), a.sum())[1])(x.detach())
    assert seen == [False]
    with torch._C._AutoDispatchBelowAutograd():  # a caller's kernel running below autograd
        assert not op_library.direct_ok(x, w)
    traced = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.trace's deprecation (still used by some callers)
        torch.jit.trace(lambda a: (traced.append(op_library.direct_ok(a)), a * 2)[1], (x.detach(),), check_trace=False)
    assert traced == [False]
    assert op_library.direct_ok(x, w)  # and back after each


NO_FORMULA = op_library.define("test_oplib_no_formula", "(Tensor x) -> Tensor", lambda x: (_SEEN.__setitem__(
    "below_autograd", torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradFunctionality)), x * 3)[1],
    lambda x: torch.empty_like(x))


def test_call_of_an_op_without_a_formula_runs_its_kernel_when_no_gradient_is_needed(monkeypatch):
    x, _ = _inputs(requires=(False, False))
    y = op_library.call(NO_FORMULA, x)
    assert not _SEEN["below_autograd"] and torch.equal(y, x * 3)
    x.requires_grad_(True)
    seen = []
    real = type(NO_FORMULA).__call__
    monkeypatch.setattr(type(NO_FORMULA), "__call__", lambda self, *a: (seen.append(self), real(self, *a))[1])
    y = op_library.call(NO_FORMULA, x)  # a gradient would be needed and no formula is registered: the op is called
    assert seen == [NO_FORMULA] and torch.equal(y.detach(), x.detach() * 3)
