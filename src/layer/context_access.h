// Internal: how a layer binds a caller's ForwardContext to itself and reads its saved state. Both
// layers (host, CUDA) go through these checks, so misuse gets the same messages on every backend.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "rdep/layer/forward_context.h"
#include "rdep/status.h"

namespace rdep {

class ContextAccess {
 public:
  // A process-unique id for a new layer (contexts remember the layer that filled them).
  static uint64_t NewLayerId() {
    static std::atomic<uint64_t> next{1};
    return next.fetch_add(1);
  }

  // Plan (the first step of a forward): binds ctx to (layer, rank) on first use, checks it on later
  // ones, marks it not ready, and returns its state, made by make() (a StatusOr<std::unique_ptr<S>>)
  // when it has none. FinishPlan marks it runnable.
  template <typename S, typename Make>
  static StatusOr<S*> BeginForward(ForwardContext& ctx, uint64_t layer_id, int32_t rank, Make make) {
    RDEP_RETURN_IF_ERROR(CheckOwner(ctx, layer_id, rank, "plan"));
    ctx.layer_id_ = layer_id;
    ctx.rank_ = rank;
    ctx.planned_ = false;
    ctx.ready_ = false;
    ctx.consumed_ = false;
    ctx.dispatched_ = false;
    ctx.combine_grad_ = false;
    if (!ctx.state_) {
      RDEP_ASSIGN_OR_RETURN(std::unique_ptr<S> made, make());
      ctx.state_ = std::move(made);
    }
    return static_cast<S*>(ctx.state_.get());
  }
  static void FinishPlan(ForwardContext& ctx) { ctx.planned_ = true; }

  // Run (the second step): the context must hold a plan of this layer and rank whose run has not
  // happened. FinishForward marks the forward complete (backward may follow).
  template <typename S>
  static StatusOr<S*> BeginRun(ForwardContext& ctx, uint64_t layer_id, int32_t rank) {
    RDEP_RETURN_IF_ERROR(CheckOwner(ctx, layer_id, rank, "run"));
    if (!ctx.planned_ || !ctx.state_)
      return FailedPrecondition("run on rank " + std::to_string(rank) + ": the context holds no plan (call Plan first)");
    ctx.planned_ = false;
    return static_cast<S*>(ctx.state_.get());
  }
  static void FinishForward(ForwardContext& ctx) { ctx.ready_ = true; }

  // Backward: the context must hold a completed forward of this layer and rank, not yet consumed.
  template <typename S>
  static StatusOr<S*> BeginBackward(ForwardContext& ctx, uint64_t layer_id, int32_t rank) {
    RDEP_RETURN_IF_ERROR(CheckOwner(ctx, layer_id, rank, "backward"));
    const std::string who = "backward on rank " + std::to_string(rank) + ": ";
    if (!ctx.ready_ || !ctx.state_) return FailedPrecondition(who + "without a completed forward in this context");
    if (ctx.consumed_) return FailedPrecondition(who + "the context's forward was already used by a backward (run forward again)");
    if (ctx.dispatched_)
      return FailedPrecondition(who + "the context's forward ran through dispatch/combine with the caller's experts; its "
                                      "backward is CombineBackward, then DispatchBackward");
    ctx.consumed_ = true;
    return static_cast<S*>(ctx.state_.get());
  }

  // The dispatch/combine steps (the caller's experts): Plan -> Dispatch -> Combine forward,
  // CombineBackward -> DispatchBackward backward. Each checks that the step before it ran.
  template <typename S>
  static StatusOr<S*> BeginDispatch(ForwardContext& ctx, uint64_t layer_id, int32_t rank) {
    RDEP_RETURN_IF_ERROR(CheckOwner(ctx, layer_id, rank, "dispatch"));
    if (!ctx.planned_ || !ctx.state_)
      return FailedPrecondition("dispatch on rank " + std::to_string(rank) + ": the context holds no plan (call Plan first)");
    ctx.planned_ = false;
    ctx.dispatched_ = true;
    return static_cast<S*>(ctx.state_.get());
  }
  template <typename S>
  static StatusOr<S*> BeginCombine(ForwardContext& ctx, uint64_t layer_id, int32_t rank) {
    RDEP_RETURN_IF_ERROR(CheckOwner(ctx, layer_id, rank, "combine"));
    const std::string who = "combine on rank " + std::to_string(rank) + ": ";
    if (!ctx.dispatched_ || !ctx.state_) return FailedPrecondition(who + "the context holds no dispatched rows (call Plan, then Dispatch)");
    if (ctx.ready_ || ctx.consumed_ || ctx.combine_grad_) return FailedPrecondition(who + "the context's rows were already combined");
    return static_cast<S*>(ctx.state_.get());
  }
  template <typename S>
  static StatusOr<S*> BeginCombineBackward(ForwardContext& ctx, uint64_t layer_id, int32_t rank) {
    RDEP_RETURN_IF_ERROR(CheckOwner(ctx, layer_id, rank, "combine backward"));
    const std::string who = "combine backward on rank " + std::to_string(rank) + ": ";
    if (!ctx.dispatched_ || !ctx.ready_ || !ctx.state_)
      return FailedPrecondition(who + "the context holds no combined dispatch/combine forward (Plan, Dispatch, Combine)");
    if (ctx.combine_grad_ || ctx.consumed_) return FailedPrecondition(who + "it already ran for this forward (run forward again)");
    ctx.combine_grad_ = true;
    return static_cast<S*>(ctx.state_.get());
  }
  // Dispatch's backward needs only the dispatch (the rows may have been used without a Combine).
  template <typename S>
  static StatusOr<S*> BeginDispatchBackward(ForwardContext& ctx, uint64_t layer_id, int32_t rank) {
    RDEP_RETURN_IF_ERROR(CheckOwner(ctx, layer_id, rank, "dispatch backward"));
    const std::string who = "dispatch backward on rank " + std::to_string(rank) + ": ";
    if (!ctx.dispatched_ || !ctx.state_) return FailedPrecondition(who + "the context holds no dispatched rows (Plan, Dispatch)");
    if (ctx.consumed_) return FailedPrecondition(who + "it already ran for this forward (run forward again)");
    ctx.consumed_ = true;
    return static_cast<S*>(ctx.state_.get());
  }
  static void FinishCombine(ForwardContext& ctx) { ctx.ready_ = true; }

  // A step that failed after it began may have left the context's state half-written: it then takes
  // no further step (each refuses, naming the missing one) until a new Plan.
  static void Abandon(ForwardContext& ctx) {
    ctx.planned_ = ctx.ready_ = ctx.dispatched_ = ctx.combine_grad_ = false;
  }
  // Abandons ctx when destroyed, unless Done() was called: for a step's error paths.
  class StepGuard {
   public:
    explicit StepGuard(ForwardContext& ctx) : ctx_(ctx) {}
    ~StepGuard() {
      if (!done_) Abandon(ctx_);
    }
    StepGuard(const StepGuard&) = delete;
    StepGuard& operator=(const StepGuard&) = delete;
    Status Done(Status s) {
      done_ = s.ok();
      return s;
    }

   private:
    ForwardContext& ctx_;
    bool done_ = false;
  };

  // Read access for checks and telemetry: a plan or a completed forward this layer made on this
  // rank, else null.
  template <typename S>
  static const S* Peek(const ForwardContext& ctx, uint64_t layer_id, int32_t rank) {
    if (ctx.layer_id_ != layer_id || ctx.rank_ != rank || !(ctx.ready_ || ctx.planned_ || ctx.dispatched_)) return nullptr;
    return static_cast<const S*>(ctx.state_.get());
  }
  // The same, for a layer that caches derived values in its saved state (e.g. host copies).
  template <typename S>
  static S* PeekMutable(ForwardContext& ctx, uint64_t layer_id, int32_t rank) {
    return const_cast<S*>(Peek<S>(ctx, layer_id, rank));
  }
  // The saved state this layer made on this rank in whatever step ctx is (a failed or abandoned one
  // included), else null: for managing its memory, not for reading a forward.
  template <typename S>
  static S* StateOf(ForwardContext& ctx, uint64_t layer_id, int32_t rank) {
    if (ctx.layer_id_ != layer_id || ctx.rank_ != rank) return nullptr;
    return static_cast<S*>(ctx.state_.get());
  }

 private:
  static Status CheckOwner(const ForwardContext& ctx, uint64_t layer_id, int32_t rank, const char* call) {
    const std::string who = std::string(call) + " on rank " + std::to_string(rank) + ": ";
    if (ctx.layer_id_ != 0 && ctx.layer_id_ != layer_id)
      return InvalidArgument(who + "the context belongs to another layer (layer #" + std::to_string(ctx.layer_id_) +
                             ", this is layer #" + std::to_string(layer_id) + ")");
    if (ctx.rank_ >= 0 && ctx.rank_ != rank)
      return InvalidArgument(who + "the context belongs to rank " + std::to_string(ctx.rank_));
    return Status::Ok();
  }
};

}  // namespace rdep
