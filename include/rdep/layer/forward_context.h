// What one layer forward saves for its backward on one rank, owned by the caller.
//
// A layer (HostMoELayer, CudaMoELayer) fills a context in Forward and reads it in Backward, so
// several forwards can be in flight before their backwards (micro-batches, activation recompute,
// pipeline schedules) and a framework can keep the context in its autograd graph:
//
//   ForwardContext a, b;                         // empty; a layer binds each to itself and a rank
//   layer->Forward(rank, a, ...);                // micro-batch 1
//   layer->Forward(rank, b, ...);                // micro-batch 2, before either backward
//   layer->Backward(rank, b, ...);               // backwards in any order, collective like forwards
//   layer->Backward(rank, a, ...);
//
// A forward is two steps, which a layer also offers apart (Plan, then Run, both collective): the
// plan (phases 1-2 of dispatch: the routing validated, counts exchanged, the owners' capacity
// decision, the accepted set and effective gates) and the run (phase 3, expert compute, return,
// combine). The context holds the routing plan (accepted set, effective gates, token placement and
// the control words backward's scatter needs) and the activations backward needs (returned expert rows,
// the owner's grouped inputs and pre-activations). Its memory is its own: bytes() reports it, and
// it is freed with the context (or by Release), also after its layer is destroyed. A context belongs
// to one layer and one rank from its first forward on; handing it to another layer or rank, a
// backward without a completed forward, or a second backward of the same forward, is an error
// naming what is wrong (RearmBackward, below, re-arms a captured forward's context after its replay).
// Forward into a context that holds an earlier forward replaces it, reusing its memory. Not
// thread-safe: one rank's thread uses a context at a time.
//
// With the caller's own experts (the layers' dispatch/combine steps) a forward is Plan, Dispatch,
// Combine and its backward CombineBackward, then DispatchBackward; the context tracks those steps too
// (rows_forward()), and refuses a step out of order, naming it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace rdep {

class ForwardContext {
 public:
  ForwardContext();
  ~ForwardContext();
  ForwardContext(ForwardContext&&) noexcept;
  ForwardContext& operator=(ForwardContext&&) noexcept;
  ForwardContext(const ForwardContext&) = delete;
  ForwardContext& operator=(const ForwardContext&) = delete;

  // A plan whose run step has not happened yet.
  bool planned() const { return planned_; }
  // A completed forward whose backward has not run yet.
  bool ready_for_backward() const { return ready_ && !consumed_; }
  // The forward runs (or ran) through the dispatch/combine steps: its rows went to the caller's experts.
  bool rows_forward() const { return dispatched_; }
  int32_t rank() const { return rank_; }  // -1 until the first forward
  // Host or device bytes the context holds (its saved plan and activations).
  size_t bytes() const;
  // Frees what the context holds; it stays bound to its layer and rank.
  void Release();
  // Marks a forward whose backward ran as ready for a backward again: for a context whose forward a CUDA graph
  // recorded, the graph's replays rewrite its saved state, so a backward captured anew after a replay (CUDA graph
  // trees record a second backward node under a replayed forward node) reads that replay's forward. The caller
  // vouches that the saved state is a forward's; the CUDA layer's backward also checks it on the device (each
  // forward sets a word of the context that each backward takes: CudaDomain::TakeForward). False, changing nothing,
  // without a completed forward of the layer's own experts (none ran, or a dispatch/combine forward).
  bool RearmBackward();
  // Whether RearmBackward would re-arm it (a completed forward of the layer's own experts).
  bool rearmable() const { return ready_ && state_ && !dispatched_; }

  // A layer's saved state; each layer defines its own (internal).
  struct State {
    virtual ~State() = default;
    virtual size_t bytes() const = 0;
  };

 private:
  friend class ContextAccess;
  uint64_t layer_id_ = 0;  // 0 = not bound
  int32_t rank_ = -1;
  bool planned_ = false;   // a plan step completed into it (its run step may follow)
  bool ready_ = false;     // a forward (plan + run) completed into it
  bool consumed_ = false;  // its backward ran
  bool dispatched_ = false;     // dispatch/combine API: the rows went to the caller (Dispatch ran)
  bool combine_grad_ = false;   // dispatch/combine API: CombineBackward ran
  std::unique_ptr<State> state_;
};

}  // namespace rdep
