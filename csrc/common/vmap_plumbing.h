// The vmap plumbing every FuncTorchBatched kernel of batchrules shares.
//
// Note [Hand-written vmap plumbing]
// functorch's VMAP_SUPPORT only serves aten ops and its codegen is not
// exported, so each kernel does by hand what that codegen would: exclude
// FuncTorchBatched for the calls it makes, find the current vmap level, fall
// through when nothing is batched at that level, unwrap the arguments to
// physical tensors and batch dims, run the rule, and wrap its outputs again.
// Every family's batched_kernel.cpp is written with it: the kernels of our
// own operators (linear/, activations/) and those for aten's ops (losses/,
// attention/, which routes.cpp registers while routing is on); see
// csrc/README.md.
#pragma once

#include "common/batching_utils.h"

#include <ATen/functorch/BatchedTensorImpl.h>
#include <ATen/functorch/DynamicLayer.h>
#include <ATen/functorch/PlumbingHelper.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <optional>
#include <tuple>

namespace batchrules {

using OptionalBatched = std::tuple<std::optional<Tensor>, std::optional<int64_t>>;

// Opened first thing in a FuncTorchBatched kernel: calls made while it lives
// go below FuncTorchBatched, and level() is the vmap level being served.
class BatchedKernelScope {
 public:
  explicit BatchedKernelScope(const char* op) : level_(current_level(op)) {}
  int64_t level() const { return level_; }

 private:
  static int64_t current_level(const char* op) {
    const auto layer = at::functorch::maybeCurrentDynamicLayer();
    TORCH_CHECK(layer.has_value(), op,
                ": a BatchedTensor escaped vmap (it was used after the vmap call that created "
                "it returned)");
    return layer->layerId();
  }

  c10::impl::ExcludeDispatchKeyGuard guard_{c10::DispatchKey::FuncTorchBatched};
  int64_t level_;
};

inline bool batched_at(const Tensor& t, int64_t level) {
  return at::functorch::isBatchedAtLevel(t, level);
}

inline bool batched_at(const std::optional<Tensor>& t, int64_t level) {
  return at::functorch::isBatchedAtLevel(t, level);
}

template <class... Ts>
bool any_batched_at(int64_t level, const Ts&... tensors) {
  return (batched_at(tensors, level) || ...);
}

// The physical tensor behind `t` at `level` and its batch dim there (none
// when `t` is not batched at that level).
inline BatchedResult unwrap_at(const Tensor& t, int64_t level) {
  return at::functorch::unwrapTensorAtLevel(t, level);
}

// An absent (or undefined) optional tensor stays absent.
inline OptionalBatched unwrap_at(const std::optional<Tensor>& t, int64_t level) {
  if (!t.has_value() || !t->defined()) {
    return {std::nullopt, std::nullopt};
  }
  auto [value, bdim] = at::functorch::unwrapTensorAtLevel(*t, level);
  return {std::move(value), bdim};
}

// An optional operand as (physical tensor, undefined when absent; batch dim).
inline BatchedResult optional_at(const std::optional<Tensor>& t, int64_t level) {
  auto [value, bdim] = unwrap_at(t, level);
  return {value.value_or(Tensor()), bdim};
}

// A rule's output as a BatchedTensor at `level`; an undefined output (one
// that was not requested) stays undefined.
inline Tensor wrap_at(const Tensor& t, std::optional<int64_t> bdim, int64_t level) {
  return t.defined() ? at::functorch::makeBatched(t, bdim, level) : t;
}

}  // namespace batchrules
