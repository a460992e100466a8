// rdep's capturable op pair shaped as C++ ops, for bench/torch_autograd_floor.py --cpp: kernels that only allocate
// what rdep's return, and a C++ autograd function, the structure a C++ implementation of rdep's hot pair would have.
#include <torch/torch.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> PairForward(
    const at::Tensor& /*handle*/, int64_t /*layer*/, const at::Tensor& x, const at::Tensor& /*experts*/,
    const at::Tensor& /*gates*/, const at::Tensor& w1, const at::Tensor& w2, int64_t row_bytes, bool /*keep_casts*/,
    bool /*save_context*/, bool /*check_routing*/) {
  return {at::empty_like(x), at::full({}, 0, x.options().dtype(at::kLong)),
          at::empty({row_bytes}, x.options().dtype(at::kByte)), at::empty({0}, w1.options()), at::empty({0}, w2.options())};
}

// handle stands in for the layer: its numel is the layer's top-K (dgates' last dimension), as in the Python pair.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> PairBackward(
    const at::Tensor& handle, int64_t /*layer*/, const at::Tensor& /*ctx*/, const at::Tensor& /*rows*/,
    const at::Tensor& /*w1c*/, const at::Tensor& /*w2c*/, const at::Tensor& dy, const at::Tensor& w1, const at::Tensor& w2) {
  return {at::empty_like(dy), at::empty({dy.size(0), dy.size(1), handle.numel()}, dy.options().dtype(at::kFloat)),
          at::empty_like(w1), at::empty_like(w2)};
}

class PairFunction : public torch::autograd::Function<PairFunction> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const at::Tensor& handle, int64_t layer, const at::Tensor& x,
      const at::Tensor& experts, const at::Tensor& gates, const at::Tensor& w1, const at::Tensor& w2, int64_t row_bytes,
      bool keep_casts, bool save_context, bool check_routing) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("rdep_floor_cpp::pair_forward", "")
                         .typed<decltype(PairForward)>();
    auto [y, context, rows, w1c, w2c] = op.call(handle, layer, x, experts, gates, w1, w2, row_bytes, keep_casts,
                                                 save_context, check_routing);
    ctx->mark_non_differentiable({context, rows, w1c, w2c});
    ctx->set_materialize_grads(false);
    ctx->saved_data["layer"] = layer;
    ctx->save_for_backward({handle, context, rows, w1c, w2c, w1, w2});
    return {y, context, rows, w1c, w2c};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("rdep_floor_cpp::pair_backward", "")
                         .typed<decltype(PairBackward)>();
    auto [dx, dgates, dw1, dw2] = op.call(saved[0], ctx->saved_data["layer"].toInt(), saved[1], saved[2], saved[3],
                                          saved[4], grads[0].contiguous(), saved[5], saved[6]);
    at::Tensor none;
    return {none, none, dx, none, dgates, dw1, dw2, none, none, none, none};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> PairForwardAutograd(
    const at::Tensor& handle, int64_t layer, const at::Tensor& x, const at::Tensor& experts, const at::Tensor& gates,
    const at::Tensor& w1, const at::Tensor& w2, int64_t row_bytes, bool keep_casts, bool save_context, bool check_routing) {
  auto out = PairFunction::apply(handle, layer, x, experts, gates, w1, w2, row_bytes, keep_casts, save_context,
                                 check_routing);
  return {out[0], out[1], out[2], out[3], out[4]};
}

}  // namespace

TORCH_LIBRARY(rdep_floor_cpp, m) {
  m.def("pair_forward(Tensor handle, int layer, Tensor x, Tensor experts, Tensor gates, Tensor w1, Tensor w2, "
        "int row_bytes, bool keep_casts, bool save_context=True, bool check_routing=True) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("pair_backward(Tensor handle, int layer, Tensor ctx, Tensor rows, Tensor w1c, Tensor w2c, Tensor dy, "
        "Tensor w1, Tensor w2) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(rdep_floor_cpp, CompositeExplicitAutograd, m) {
  m.impl("pair_forward", &PairForward);
  m.impl("pair_backward", &PairBackward);
}

TORCH_LIBRARY_IMPL(rdep_floor_cpp, Autograd, m) { m.impl("pair_forward", &PairForwardAutograd); }
