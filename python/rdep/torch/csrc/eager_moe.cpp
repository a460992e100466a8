// rdep.torch's eager MoE call in C++: the forward and backward of rdep.torch.moe for a call that needs a gradient,
// outside any trace or capture (python/rdep/torch/eager_ext.py says when), as one autograd function whose node holds
// the forward's context. The Python path (ops.py, layer_calls.py) spends several hundred microseconds of host time a
// forward+backward in its own Python; this path does the same calls from C++: the same allocations, the same C ABI
// calls (through the addresses of the functions the ctypes binding loaded), the same bookkeeping in the layer's
// Python state (_Native: its lock, its table of live contexts), so Layer.live_contexts, context_bytes and close see
// these contexts as they see the Python path's.
//
// The context is named by the node, not by a tensor: the node's saved data holds a guard that releases the context
// when the backward ran, or when the graph is dropped without a backward, and holds the arena of the context's saved
// rows until then. One backward per forward: a second one (retain_graph=True) is refused naming the cause.
//
// Built by torch.utils.cpp_extension (eager_ext.py), against include/rdep/capi.h.

#include <torch/extension.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/functions/basic_ops.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "rdep/capi.h"

namespace py = pybind11;

namespace {

using ForwardFn = int (*)(rdep_layer*, int64_t, const rdep_rank_io*, int32_t);
using ForwardArenaFn = int (*)(rdep_layer*, int64_t, const rdep_rank_io*, int32_t, void*, size_t, size_t*);
using AcquireFn = int (*)(rdep_layer*, int64_t*);
using ReleaseFn = int (*)(rdep_layer*, int64_t);
using LastErrorFn = const char* (*)(void);

struct CFunctions {
  ForwardFn forward = nullptr;
  ForwardArenaFn forward_arena = nullptr;
  ForwardFn backward = nullptr;
  AcquireFn acquire = nullptr;
  ReleaseFn release = nullptr;
  LastErrorFn last_error = nullptr;
};

bool python_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// The layer as the eager path reads it, made once a layer (eager_ext._layer_of, at its first call through this path).
struct EagerLayer {
  py::object native;          // rdep.torch.layer._Native: lock, ptr, live, casts
  py::object lock_enter, lock_exit;  // native.lock's __enter__ and __exit__, bound once
  py::object error_for_code;  // rdep._errors.error_for_code
  py::object failed_precondition;
  py::object check_forward;   // rdep.torch.validate.check_forward: raises naming the argument
  py::object sweep;           // rdep.torch.graph_contexts.sweep
  int64_t id = 0;
  int32_t ranks = 1;
  int64_t hidden = 0, ffn = 0, topk = 0, max_tokens = 0, local_experts = 0;
  c10::Device device = c10::Device(c10::kCPU);
  std::vector<std::pair<int64_t, int64_t>> rank_experts;  // (first local expert, count) per local rank
  bool cuda = false;
  int64_t row_bytes = 0;         // the arena each forward takes from torch (CUDA with torch's rows), else 0
  bool keep_weight_casts = false;
  bool grad_bf16_ok = false;     // bf16 weights get bf16 gradients (CUDA, one segment, no balancing)
  bool casts_in_grads_ok = false;  // fp32 weights' casts go into the fp32 gradients (ops._casts_in_grads)
  CFunctions c;

  ~EagerLayer() {
    if (python_alive()) {
      py::gil_scoped_acquire gil;
      py::error_scope keep;  // a Python error pending on this thread stays as it was
      for (py::object* o : refs()) *o = py::object();
    } else {  // the interpreter is gone: leak the references rather than touch it
      for (py::object* o : refs()) o->release();
    }
  }

  at::ScalarType act() const { return cuda ? at::kBFloat16 : at::kFloat; }

 private:
  std::vector<py::object*> refs() {
    return {&native, &lock_enter, &lock_exit, &error_for_code, &failed_precondition, &check_forward, &sweep};
  }
};

using LayerPtr = std::shared_ptr<EagerLayer>;

// The Python exception for a C status code (rdep._errors), set as the current Python error (GIL held).
void set_rdep_error(const EagerLayer& l, int code, const std::string& what) {
  py::object exc = l.error_for_code(code, what);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
}

void set_precondition_error(const EagerLayer& l, const std::string& what) {
  py::object exc = l.failed_precondition(what);
  PyErr_SetObject(l.failed_precondition.ptr(), exc.ptr());
}

// Raised where autograd's engine catches it (the backward): torch's python_error keeps the exception's class.
[[noreturn]] void throw_for_engine() {
  python_error e;
  e.persist();
  throw e;
}

std::string c_message(const EagerLayer& l, const char* call) {
  const char* msg = l.c.last_error ? l.c.last_error() : nullptr;
  return std::string(call) + ": " + (msg ? msg : "");
}

// native.lock held for a scope (the _CallLock: one C call on the layer at a time; it pauses Python's collector
// where the layer's rows come from torch). The GIL must be held.
class LayerLock {
 public:
  explicit LayerLock(const EagerLayer& l) : l_(l) { l_.lock_enter(); }
  ~LayerLock() {
    py::error_scope keep;  // released while an exception unwinds: run __exit__ with no error pending, then restore it
    try {
      l_.lock_exit(py::none(), py::none(), py::none());
    } catch (...) {
      PyErr_Clear();
    }
  }
  LayerLock(const LayerLock&) = delete;
  LayerLock& operator=(const LayerLock&) = delete;

 private:
  const EagerLayer& l_;
};

// Whether the forward's tensors are what validate.check_forward accepts, read from their metadata alone: the common
// case, with no Python call. Anything else goes to validate.check_forward, which raises naming the argument.
bool arguments_ok(const EagerLayer& l, const at::Tensor& x, const at::Tensor& experts, const at::Tensor& gates,
                  const at::Tensor& w1, const at::Tensor& w2) {
  auto placed = [&](const at::Tensor& t) { return t.device() == l.device && t.is_contiguous(); };
  auto sized = [](const at::Tensor& t, std::initializer_list<int64_t> want) {
    if (t.dim() != static_cast<int64_t>(want.size())) return false;
    int64_t d = 0;
    for (int64_t w : want)
      if (t.size(d++) != w) return false;
    return true;
  };
  if (x.scalar_type() != l.act() || x.dim() != 3 || !placed(x)) return false;
  const int64_t n = x.size(1);
  const bool weights_dtype = w1.scalar_type() == l.act() || (l.cuda && w1.scalar_type() == at::kFloat);
  return sized(x, {l.ranks, n, l.hidden}) && n <= l.max_tokens && experts.scalar_type() == at::kInt &&
         placed(experts) && sized(experts, {l.ranks, n, l.topk}) && gates.scalar_type() == at::kFloat &&
         placed(gates) && sized(gates, {l.ranks, n, l.topk}) && weights_dtype && w2.scalar_type() == w1.scalar_type() &&
         placed(w1) && placed(w2) && sized(w1, {l.local_experts, l.hidden, 2 * l.ffn}) &&
         sized(w2, {l.local_experts, l.ffn, l.hidden});
}

// The C handle, or nullptr once the layer was closed (native.ptr is None). Under the lock.
rdep_layer* live_ptr(const EagerLayer& l) {
  py::object p = l.native.attr("ptr");
  if (p.is_none()) return nullptr;
  return reinterpret_cast<rdep_layer*>(p.cast<uintptr_t>());
}

// Forgets the context in native.live (as _Native.release does) and releases it in C. Under the lock.
void forget_and_release(const EagerLayer& l, rdep_layer* ptr, int64_t c_id) {
  const int64_t token = c_id >> 32;
  py::dict live = l.native.attr("live");
  py::int_ key(token);
  if (live.contains(key) && live[key].cast<int64_t>() == c_id) {
    PyDict_DelItem(live.ptr(), key.ptr());
    py::dict casts = l.native.attr("casts");
    if (casts.contains(key)) PyDict_DelItem(casts.ptr(), key.ptr());
  }
  if (ptr != nullptr) l.c.release(ptr, c_id);  // a stale id is a no-op in C
}

// Holds a forward's context until its backward ran, or releases it when the autograd graph is dropped; and the
// arena the context's saved rows are pieces of (not a saved tensor: saved-tensor hooks, such as activation
// checkpointing's or save_on_cpu's, would free or move it while the context points into it).
struct ContextGuard : torch::CustomClassHolder {
  LayerPtr layer;
  int64_t c_id;
  at::Tensor rows;
  bool consumed = false;

  ContextGuard(LayerPtr l, int64_t id, at::Tensor arena) : layer(std::move(l)), c_id(id), rows(std::move(arena)) {}
  // It may run where a Python error is pending (the node dropped while an exception unwinds, e.g. activation
  // checkpointing's early stop of a recomputation): Python is called only with that error set aside, and it is
  // restored after (calling Python with an error set can skip the lock's release).
  ~ContextGuard() override {
    if (consumed || !python_alive()) return;
    py::gil_scoped_acquire gil;
    py::error_scope keep;
    try {
      LayerLock lock(*layer);
      forget_and_release(*layer, live_ptr(*layer), c_id);
    } catch (...) {
      PyErr_Clear();
    }
  }
};

c10::Stream current_stream_of(const at::Device& device) {
  return c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(device);
}

void* current_stream(const EagerLayer& l, const at::Device& device) {
  return l.cuda ? current_stream_of(device).native_handle() : nullptr;
}

std::string closed_message(const EagerLayer& l) {
  return "layer: " + std::to_string(l.id) + " is not a live rdep layer handle (closed or garbage-collected)";
}

// The capturable ops' contexts whose ctx tensor died without a backward (a dropped graph) go back first, as the
// Python capturable forward does (graph_contexts.sweep), when there are any. Under the lock.
void sweep_dropped_graphs(const EagerLayer& l) {
  py::object by_address = l.native.attr("by_address");
  if (PyDict_Size(by_address.ptr()) > 0) l.sweep(l.native);
}

std::vector<rdep_rank_io> new_io(const EagerLayer& l) { return std::vector<rdep_rank_io>(l.ranks, rdep_rank_io{}); }

void fill_weights(const EagerLayer& l, std::vector<rdep_rank_io>& io, const at::Tensor& w1, const at::Tensor& w2,
                  const at::Tensor* dw1, const at::Tensor* dw2) {
  const int64_t per1 = l.hidden * 2 * l.ffn, per2 = l.ffn * l.hidden;
  auto* p1 = static_cast<char*>(w1.data_ptr());
  auto* p2 = static_cast<char*>(w2.data_ptr());
  for (int32_t i = 0; i < l.ranks; ++i) {
    const int64_t e = l.rank_experts[i].first;
    io[i].w1 = p1 + e * per1 * w1.element_size();
    io[i].w2 = p2 + e * per2 * w2.element_size();
    if (dw1 != nullptr) {
      io[i].dw1 = static_cast<char*>(dw1->data_ptr()) + e * per1 * dw1->element_size();
      io[i].dw2 = static_cast<char*>(dw2->data_ptr()) + e * per2 * dw2->element_size();
    }
  }
}

// The bf16 casts of fp32 w1, w2 written into the first half of each local rank's fp32 gradient bytes, pointed to by
// io (layer_calls._casts_into_grads): the layer reads each weight before it overwrites that weight's gradient.
void casts_into_grads(const EagerLayer& l, std::vector<rdep_rank_io>& io, const at::Tensor& w1, const at::Tensor& w2,
                      const at::Tensor& dw1, const at::Tensor& dw2) {
  const int64_t per1 = l.hidden * 2 * l.ffn, per2 = l.ffn * l.hidden;
  for (int32_t i = 0; i < l.ranks; ++i) {
    const auto [e, n] = l.rank_experts[i];
    if (n == 0) continue;  // a rank without experts keeps fill_weights' (unread) addresses
    auto cast_into = [&](const at::Tensor& w, const at::Tensor& g, int64_t per) {
      at::Tensor src = w.narrow(0, e, n);
      at::Tensor dst = g.narrow(0, e, n).view(at::kBFloat16).reshape({-1}).narrow(0, 0, n * per).view(src.sizes());
      dst.copy_(src);
      return dst.data_ptr();
    };
    io[i].w1 = cast_into(w1, dw1, per1);
    io[i].w2 = cast_into(w2, dw2, per2);
  }
}

at::Tensor as_act(const EagerLayer& l, const at::Tensor& w) { return w.scalar_type() == l.act() ? w : w.to(l.act()); }

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct EagerMoe : torch::autograd::Function<EagerMoe> {
  static at::Tensor forward(AutogradContext* ctx, LayerPtr layer, const at::Tensor& x, const at::Tensor& experts,
                            const at::Tensor& gates, const at::Tensor& w1, const at::Tensor& w2) {
    const EagerLayer& l = *layer;
    at::Tensor w1c = as_act(l, w1), w2c = as_act(l, w2);
    at::Tensor y = at::empty_like(x);
    at::Tensor rows = l.row_bytes > 0 ? at::empty({l.row_bytes}, x.options().dtype(at::kByte)) : at::Tensor();
    const int64_t n = x.size(1);
    const int64_t xb = n * l.hidden * x.element_size();
    void* stream = current_stream(l, x.device());
    std::vector<rdep_rank_io> io = new_io(l);
    for (int32_t i = 0; i < l.ranks; ++i) {
      io[i].num_tokens = n;
      io[i].experts = experts.data_ptr<int32_t>() + i * n * l.topk;
      io[i].gates = gates.data_ptr<float>() + i * n * l.topk;
      io[i].x = static_cast<const char*>(x.data_ptr()) + i * xb;
      io[i].y = static_cast<char*>(y.data_ptr()) + i * xb;
      io[i].stream = stream;
    }
    fill_weights(l, io, w1c, w2c, nullptr, nullptr);

    int64_t c_id = -1;
    {
      LayerLock lock(l);
      rdep_layer* ptr = live_ptr(l);
      if (ptr == nullptr) throw py::value_error(closed_message(l));
      sweep_dropped_graphs(l);
      int code = 0;
      const char* what = "rdep_context_acquire";
      {
        py::gil_scoped_release nogil;
        code = l.c.acquire(ptr, &c_id);
        if (code == 0 && rows.defined()) {
          what = "rdep_layer_forward_arena";
          code = l.c.forward_arena(ptr, c_id, io.data(), l.ranks, rows.data_ptr(), static_cast<size_t>(l.row_bytes),
                                   nullptr);
        } else if (code == 0) {
          what = "rdep_layer_forward";
          code = l.c.forward(ptr, c_id, io.data(), l.ranks);
        }
      }
      if (code != 0) {
        const std::string msg = c_message(l, what);
        if (c_id >= 0) l.c.release(ptr, c_id);
        set_rdep_error(l, code, msg);
        throw py::error_already_set();
      }
      py::dict live = l.native.attr("live");
      live[py::int_(c_id >> 32)] = py::int_(c_id);
    }
    ctx->saved_data["guard"] = c10::IValue::make_capsule(c10::make_intrusive<ContextGuard>(layer, c_id, rows));
    // The casts kept for the backward: fp32 master weights with keep_weight_casts (autograd's saved-tensor check
    // then refuses a backward after an in-place update of w1 or w2, so the casts are always these weights').
    const bool keep = l.keep_weight_casts && w1c.data_ptr() != w1.data_ptr() && !w1.is_inference() &&
                      !w2.is_inference();
    ctx->save_for_backward({w1, w2, keep ? w1c : at::Tensor(), keep ? w2c : at::Tensor()});
    ctx->saved_data["y_sizes"] = y.sizes();
    ctx->set_materialize_grads(false);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto guard = c10::static_intrusive_pointer_cast<ContextGuard>(ctx->saved_data["guard"].toCapsule());
    const EagerLayer& l = *guard->layer;
    const std::vector<int64_t> y_sizes = ctx->saved_data["y_sizes"].toIntVector();
    variable_list saved = ctx->get_saved_variables();  // refuses a second backward after the graph was freed
    at::Tensor w1 = saved[0], w2 = saved[1];
    at::Tensor dy = grads[0];
    if (!dy.defined()) {  // y reached no loss: zeros, as autograd would make
      dy = at::zeros(y_sizes, w1.options().dtype(l.act()));
    } else {
      dy = dy.contiguous();
    }
    const int64_t n = y_sizes[1];
    const bool fp32_weights = w1.scalar_type() == at::kFloat && w2.scalar_type() == at::kFloat;
    const at::ScalarType grad_dtype =
        (l.cuda && w1.scalar_type() == at::kBFloat16 && l.grad_bf16_ok) ? at::kBFloat16 : at::kFloat;
    at::Tensor dx = at::empty_like(dy);
    at::Tensor dgates = at::empty({l.ranks, n, l.topk}, dy.options().dtype(at::kFloat));
    at::Tensor dw1 = at::empty(w1.sizes(), w1.options().dtype(grad_dtype));
    at::Tensor dw2 = at::empty(w2.sizes(), w2.options().dtype(grad_dtype));
    std::vector<rdep_rank_io> io = new_io(l);
    const int64_t db = n * l.hidden * dy.element_size(), gb = n * l.topk;
    void* stream = current_stream(l, dy.device());
    for (int32_t i = 0; i < l.ranks; ++i) {
      io[i].num_tokens = n;
      io[i].dy = static_cast<const char*>(dy.data_ptr()) + i * db;
      io[i].dx = static_cast<char*>(dx.data_ptr()) + i * db;
      io[i].dgates = dgates.data_ptr<float>() + i * gb;
      io[i].stream = stream;
      io[i].grad_bf16 = grad_dtype == at::kBFloat16 ? 1 : 0;
    }
    at::Tensor w1c, w2c;  // the weights as the layer reads them, alive until the call returns
    if (saved[2].defined()) {  // the forward's kept casts
      fill_weights(l, io, saved[2], saved[3], &dw1, &dw2);
      if (l.cuda) {  // made on the forward's stream, read on this one: not reused before this backward ends
        const c10::Stream s = current_stream_of(dy.device());
        saved[2].record_stream(s);
        saved[3].record_stream(s);
      }
    } else if (l.casts_in_grads_ok && fp32_weights && grad_dtype == at::kFloat) {
      fill_weights(l, io, w1, w2, &dw1, &dw2);
      casts_into_grads(l, io, w1, w2, dw1, dw2);
    } else {
      w1c = as_act(l, w1);
      w2c = as_act(l, w2);
      fill_weights(l, io, w1c, w2c, &dw1, &dw2);
    }

    {
      py::gil_scoped_acquire gil;
      LayerLock lock(l);
      rdep_layer* ptr = live_ptr(l);
      if (guard->consumed) {
        set_precondition_error(l, "rdep.torch.moe: this forward's backward already ran (one backward per forward: "
                                  "retain_graph=True double backward through an rdep MoE layer is not supported)");
        throw_for_engine();
      }
      if (ptr == nullptr) {  // as the ops' handle lookup says it
        PyErr_SetString(PyExc_ValueError, closed_message(l).c_str());
        throw_for_engine();
      }
      int code = 0;
      {
        py::gil_scoped_release nogil;
        code = l.c.backward(ptr, guard->c_id, io.data(), l.ranks);
      }
      const std::string msg = code != 0 ? c_message(l, "rdep_layer_backward") : std::string();
      guard->consumed = true;
      forget_and_release(l, ptr, guard->c_id);
      // The arena goes back to torch now, as the Python path's rows go back at the release (not when the graph dies:
      // retain_graph=True keeps the graph). Its last reader is this call's work, on this stream.
      if (l.cuda && guard->rows.defined()) guard->rows.record_stream(current_stream_of(dy.device()));
      guard->rows = at::Tensor();
      if (code != 0) {
        set_rdep_error(l, code, msg);
        throw_for_engine();
      }
    }
    if (dw1.scalar_type() != w1.scalar_type()) dw1 = dw1.to(w1.scalar_type());
    if (dw2.scalar_type() != w2.scalar_type()) dw2 = dw2.to(w2.scalar_type());
    if (at::GradMode::is_enabled()) refuse_differentiation(dx, dgates, dw1, dw2);
    return {at::Tensor(), dx, at::Tensor(), dgates, dw1, dw2};
  }

  // create_graph=True: the gradients get a node that raises when differentiated (double backward through the layer
  // is not supported), as the Python path's registration for rdep::moe_backward does.
  static void refuse_differentiation(at::Tensor& dx, at::Tensor& dgates, at::Tensor& dw1, at::Tensor& dw2) {
    variable_list outs = {dx, dgates, dw1, dw2};
    for (auto& v : outs) {
      v = v.detach();
      v.set_requires_grad(true);
    }
    torch::autograd::DelayedError err(
        "rdep::moe_backward has no derivative: double backward (create_graph=True through an rdep MoE layer) is "
        "not supported",
        static_cast<int64_t>(outs.size()));
    outs = err.apply(std::move(outs));
    dx = outs[0];
    dgates = outs[1];
    dw1 = outs[2];
    dw2 = outs[3];
  }
};

LayerPtr make_layer(py::object native, py::object error_for_code, py::object failed_precondition,
                    py::object check_forward, py::object sweep, int64_t id, int32_t ranks, int64_t hidden, int64_t ffn, int64_t topk,
                    int64_t max_tokens, std::vector<std::pair<int64_t, int64_t>> rank_experts, bool cuda,
                    int32_t device_index, int64_t row_bytes, bool keep_weight_casts, bool grad_bf16_ok,
                    bool casts_in_grads_ok, std::vector<uintptr_t> functions) {
  if (functions.size() != 6) throw py::value_error("functions: expected 6 addresses");
  if (static_cast<int32_t>(rank_experts.size()) != ranks) throw py::value_error("rank_experts: one pair a rank");
  auto l = std::make_shared<EagerLayer>();
  l->native = std::move(native);
  py::object lock = l->native.attr("lock");
  l->lock_enter = lock.attr("__enter__");
  l->lock_exit = lock.attr("__exit__");
  l->error_for_code = std::move(error_for_code);
  l->failed_precondition = std::move(failed_precondition);
  l->check_forward = std::move(check_forward);
  l->sweep = std::move(sweep);
  l->id = id;
  l->ranks = ranks;
  l->hidden = hidden;
  l->ffn = ffn;
  l->topk = topk;
  l->max_tokens = max_tokens;
  l->rank_experts = std::move(rank_experts);
  for (const auto& [first, count] : l->rank_experts) l->local_experts += count;
  l->cuda = cuda;
  l->device = cuda ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_index)) : c10::Device(c10::kCPU);
  l->row_bytes = row_bytes;
  l->keep_weight_casts = keep_weight_casts;
  l->grad_bf16_ok = grad_bf16_ok;
  l->casts_in_grads_ok = casts_in_grads_ok;
  l->c.forward = reinterpret_cast<ForwardFn>(functions[0]);
  l->c.forward_arena = reinterpret_cast<ForwardArenaFn>(functions[1]);
  l->c.backward = reinterpret_cast<ForwardFn>(functions[2]);
  l->c.acquire = reinterpret_cast<AcquireFn>(functions[3]);
  l->c.release = reinterpret_cast<ReleaseFn>(functions[4]);
  l->c.last_error = reinterpret_cast<LastErrorFn>(functions[5]);
  return l;
}

// y for rdep.torch.moe; `owner` is the rdep.torch.Layer (passed to validate.check_forward where a tensor is not what
// the layer takes; not held).
at::Tensor moe(const LayerPtr& layer, py::handle owner, const at::Tensor& x, const at::Tensor& experts,
               const at::Tensor& gates, const at::Tensor& w1, const at::Tensor& w2) {
  if (!arguments_ok(*layer, x, experts, gates, w1, w2)) {
    layer->check_forward(owner, x, experts, gates, w1, w2);  // raises naming the argument
    throw py::value_error("rdep.torch.moe: the arguments were refused without a reason; report this");
  }
  try {
    return EagerMoe::apply(layer, x, experts, gates, w1, w2);
  } catch (python_error& e) {  // a Python exception from inside autograd (a saved-tensor hook's): raise it as itself
    e.persist();
    e.restore();
    throw py::error_already_set();
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rdep.torch's eager MoE forward and backward in C++ (eager_ext.py)";
  py::class_<EagerLayer, LayerPtr>(m, "EagerLayer");
  m.def("make_layer", &make_layer);
  m.def("moe", &moe, "y = rdep.torch.moe(...) for a call that needs a gradient, outside traces and captures");
}
