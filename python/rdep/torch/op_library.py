"""rdep's operator library: every rdep op (namespace "rdep") is defined here, through torch.library's
Library: the schema, one Python kernel for the CPU and CUDA dispatch keys, the fake implementation
(torch.compile traces with it) and the autograd formula.

Why not torch.library.custom_op: its kernel wrapper runs checks on every call (the defaults filled again,
the outputs' aliasing, a dynamo-disabled frame) that cost ~50 us of host time per call on a fast CPU, and
each rdep call's host time is on the training step's critical path when the GPU waits for it. The
Library kernel is called by the dispatcher directly; the schema and fake registrations are the same public
API, and the autograd kernel is the structure torch.library.register_autograd installs (register_autograd below,
without its per-call filling of the defaults), so torch.compile and torch.library.opcheck treat the ops as before.

The tag `torch.Tag.cudagraph_unsafe` (where torch has it), on every op but the capturable pair: each such op
does host work that must run on every call (it acquires and releases the layer's forward contexts, keeps
their tokens, calls the C library, which picks the context's buffers), so a CUDA graph that replayed only its
kernels would reuse one call's state for every replay. With the tag, torch.compile(mode="reduce-overhead")
runs the ops outside its CUDA graphs: with inductor's graph partitioning (torch._inductor.config.graph_partition)
the rest of the compiled graph is captured in partitions around them; without it, a graph holding an rdep op
is not captured. The capturable pair (rdep::moe_forward_capturable, moe_backward_capturable; ops.py) is
untagged: a capture records its calls once, on a context the graph then keeps (graph_contexts.py).

Eager calls without the dispatcher (`call`): where nothing between Python and the kernel needs the dispatcher (no
torch.compile or jit tracing, no torch-function or dispatch mode, no functorch transform, not below autograd, no
profiler, and plain tensors), rdep.torch's entry points call the op's Python kernel directly, through an
autograd.Function with the same setup_context and formula as the op's Autograd kernel (register_autograd), every
argument given: without entering the dispatcher from Python and redispatching below autograd (the capturable pair's
host time: bench/torch_autograd_floor.py's "direct pair" against "pair"). Everywhere else the call goes through the op,
as before, so torch.compile, FakeTensor tracing, opcheck and the profiler see rdep's ops.
"""

from __future__ import annotations

import torch

_tag = getattr(torch.Tag, "cudagraph_unsafe", None)
TAGS: tuple = (_tag,) if _tag is not None else ()

_LIB = torch.library.Library("rdep", "FRAGMENT")  # module-lifetime: the definitions live as long as the module

_KERNELS: dict = {}   # op -> its Python kernel (define)
_FUNCTIONS: dict = {}  # op -> the autograd.Function `call` applies (register_autograd: the op's setup and formula)


def define(name: str, schema: str, kernel, fake, capturable: bool = False, lib: torch.library.Library = _LIB):
    """Defines rdep::name with `schema` (its argument list and returns, "(...) -> ..."), `kernel` for CPU and
    CUDA tensors (its Python defaults must equal the schema's: the dispatcher leaves trailing defaults out)
    and `fake` for tracing; returns the op's default overload, which callers call. capturable: a CUDA graph
    may record the op (no cudagraph_unsafe tag). lib: another namespace's Library (benchmarks that time this
    registration on ops of their own)."""
    lib.define(name + schema, tags=() if capturable else TAGS)
    for key in ("CPU", "CUDA"):
        lib.impl(name, kernel, key)
    torch.library.register_fake(f"{lib.ns}::{name}", fake, lib=lib)
    op = getattr(getattr(torch.ops, lib.ns), name).default
    _KERNELS[op] = kernel
    return op


_any_requires_grad = getattr(torch._C, "_any_requires_grad", None) or (
    lambda *args: any(isinstance(a, torch.Tensor) and a.requires_grad for a in args))

_MAYBE_TENSOR = torch._C.OptionalType(torch._C.TensorType.get())


def _kwarg_only_mutable_or_list(arg) -> bool:
    """Whether a schema argument or return is one register_autograd below leaves to torch's own registration:
    keyword-only, written to (out= and in-place variants, which torch's registration then refuses), or a list of
    tensors (Tensor[], Tensor?[], Tensor[]?)."""
    alias = arg.alias_info
    t = arg.type
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    tensor_list = isinstance(t, torch._C.ListType) and t.getElementType().isSubtypeOf(_MAYBE_TENSOR)
    return arg.kwarg_only or (alias is not None and alias.is_write) or tensor_list


def register_autograd(op, backward, setup_context, lib: torch.library.Library = _LIB) -> None:
    """The autograd formula of an op `define` returned, registered as torch.library.register_autograd registers one
    (an autograd.Function whose forward redispatches below autograd and calls setup_context(ctx, inputs, output),
    installed as the op's Autograd kernel with its dispatch key set) less one per-call cost: torch's fills the
    schema's defaults into the inputs on every call (torch._library.utils.fill_defaults reads the schema's argument
    list again for each argument: ~50 us a forward of the 11-argument capturable op on a fast CPU, a fifth of the
    binding's Python time a forward+backward). Here the defaults are read from the schema once. The ops' schemas
    have no keyword-only arguments, no tensor lists and no out= variants (what torch's version also handles); a
    torch without the private pieces used here gets torch.library.register_autograd. The schema is read through
    its public fields only (torch._library.utils' helpers differ between torch releases: 2.11 lacks is_out).
    lib: the Library `define` registered op in (its namespace must be op's)."""
    namespace = op._schema.name.split("::")[0]
    if namespace != lib.ns:
        raise ValueError(f"lib: {op} is in namespace {namespace!r}, the Library given is {lib.ns!r}")
    C, schema = torch._C, op._schema
    plain = not any(_kwarg_only_mutable_or_list(a) for a in (*schema.arguments, *schema.returns))
    if not (plain and all(hasattr(C, a) for a in ("_AutoDispatchBelowAutograd", "_after_autograd_keyset"))):
        torch.library.register_autograd(op, backward, setup_context=setup_context, lib=lib)
        return
    defaults = tuple(a.default_value for a in schema.arguments)
    below = C._after_autograd_keyset

    direct = _KERNELS.get(op)

    def forward(ctx, *args_and_keyset):
        *args, keyset = args_and_keyset  # the key set last, as torch's own formula passes its metadata
        args = tuple(args)
        ctx.rdep_num_args = len(args)  # the dispatcher leaves trailing defaults out: as many gradients back
        with C._AutoDispatchBelowAutograd():
            out = op.redispatch(keyset & below, *args)
            setup_context(ctx, args + defaults[len(args):], out)
        return out

    def backward_with_keyset(ctx, *grads):
        needs = ctx.needs_input_grad
        try:
            ctx.needs_input_grad = needs[:-1]  # the formula sees one entry an input, as under torch's registration
            grads_in = backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs
        grads_in = grads_in if isinstance(grads_in, tuple) else (grads_in,)
        n = ctx.rdep_num_args
        if any(g is not None for g in grads_in[n:]):
            raise RuntimeError(f"the backward formula of {op} returned a gradient for a defaulted input the call left out")
        return tuple(grads_in[:n]) + (None,)  # none for the key set

    fn = type(f"RdepAutograd_{op._opname}", (torch.autograd.Function,),
              {"forward": staticmethod(forward), "backward": staticmethod(backward_with_keyset)})

    def kernel(keyset, *args):
        if C.is_grad_enabled() and _any_requires_grad(*args):
            return fn.apply(*args, keyset)
        with C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & below, *args)

    lib.impl(op._opname, kernel, "Autograd", with_keyset=True)
    if direct is not None:
        _FUNCTIONS[op] = _direct_function(op, direct, backward, setup_context)


def _direct_function(op, kernel, backward, setup_context):
    """The autograd.Function `call` applies: the Autograd kernel's (above) with every argument given and no key set,
    so none of its bookkeeping (the trailing defaults, the key set's entry in needs_input_grad) is needed; named as
    that one, so the grad_fn reads the same on both paths."""

    def forward(ctx, *args):
        out = kernel(*args)
        setup_context(ctx, args, out)
        return out

    return type(f"RdepAutograd_{op._opname}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_function_modes = getattr(torch._C, "_is_torch_function_mode_enabled", None)
_functorch = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
_profiler = getattr(torch.autograd, "profiler", None)
_tracing = getattr(torch._C, "_get_tracing_state", None)
_excluded = getattr(torch._C, "_dispatch_tls_is_dispatch_key_excluded", None)
_AUTOGRAD_KEY = getattr(getattr(torch._C, "DispatchKey", None), "AutogradFunctionality", None)
_DIRECT_OK = (None not in (_dispatch_modes, _function_modes, _functorch, _tracing, _excluded, _AUTOGRAD_KEY)
              and hasattr(_profiler, "_is_profiler_enabled"))


def direct_ok(*tensors) -> bool:
    """Whether an eager call may skip the dispatcher (`call`): not while torch.compile or torch.jit.trace traces, no
    torch-function or dispatch mode (FakeTensorMode, FunctionalTensorMode, FlopCounterMode, torch.set_default_device's
    mode, ...), no functorch transform, not below the dispatcher's autograd (a caller's kernel running with the
    Autograd key excluded), the profiler off (its traces then name rdep's ops), and every tensor a plain torch.Tensor or
    Parameter (no subclass: DTensor, FakeTensor, ...). A torch without one of the calls this reads always takes the
    dispatcher."""
    if not _DIRECT_OK or torch.compiler.is_compiling() or _dispatch_modes() or _function_modes():
        return False
    if _functorch() is not None or _profiler._is_profiler_enabled or _tracing() is not None or _excluded(_AUTOGRAD_KEY):
        return False
    for t in tensors:
        if type(t) not in _PLAIN:
            return False
    return True


def call(op, *args):
    """op(*args), every argument given, where the caller checked direct_ok on the call's tensors: op's kernel without the
    dispatcher, through its autograd formula (an autograd.Function with the setup_context and formula its Autograd kernel
    uses: _direct_function) where grad is enabled and an argument requires grad; where a gradient is needed and op_library registered no formula for op (torch's own
    registration, or none), or op is not one `define` made, the call goes through the dispatcher."""
    grad = torch.is_grad_enabled() and _any_requires_grad(*args)
    fn = _FUNCTIONS.get(op)
    if grad and fn is not None:
        return fn.apply(*args)
    kernel = _KERNELS.get(op)
    if grad or kernel is None:  # a gradient without a formula registered here, or not one of op_library's ops
        return op(*args)
    return kernel(*args)
