// Batching rule for the backward of the elementwise regression losses:
// aten::mse_loss_backward, smooth_l1_loss_backward and huber_loss_backward.
//
// Note [Elementwise loss backward as one 'none' kernel]
// Each backward is an elementwise function of (self, target) times
// grad_output, scaled by 1/numel(self) for 'mean'. So the rule runs the op's
// own kernel once with reduction 'none' over all examples, with grad_output
// laid out to broadcast per example: a per-example scalar (sum, mean) as
// [B, 1, ..], divided for 'mean' by the example's element count first. The
// kernel broadcasts target and grad_output against self; the result has the
// broadcast shape of the three per example, as stock's decomposition does
// (eager resizes its output to it, with a deprecation warning).
#include "losses/batch_rules.h"
#include "losses/vmap_dims.h"

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/core/Reduction.h>

namespace batchrules {

namespace {

Tensor loss_backward_kernel(PointwiseLoss loss, const Tensor& grad_output, const Tensor& self,
                            const Tensor& target, double param) {
  switch (loss) {
    case PointwiseLoss::Mse:
      return at::mse_loss_backward(grad_output, self, target, at::Reduction::None);
    case PointwiseLoss::SmoothL1:
      return at::smooth_l1_loss_backward(grad_output, self, target, at::Reduction::None, param);
    case PointwiseLoss::Huber:
      return at::huber_loss_backward(grad_output, self, target, at::Reduction::None, param);
  }
  TORCH_INTERNAL_ASSERT(false, "unknown PointwiseLoss");
}

}  // namespace

BatchedResult pointwise_loss_backward_batch_rule(
    PointwiseLoss loss, const Tensor& grad_output, std::optional<int64_t> grad_output_bdim,
    const Tensor& self, std::optional<int64_t> self_bdim, const Tensor& target,
    std::optional<int64_t> target_bdim, int64_t reduction, double param) {
  const c10::SymDimVector self_sizes = logical_sizes(self, self_bdim);
  // Names the per-example shapes when they do not broadcast.
  c10::SymDimVector shape = at::infer_size_symdimvector(
      at::infer_size_symdimvector(self_sizes, logical_sizes(target, target_bdim)),
      logical_sizes(grad_output, grad_output_bdim));
  const auto rank = static_cast<int64_t>(shape.size());
  const c10::SymInt batch =
      vmap_size({{&grad_output, grad_output_bdim}, {&self, self_bdim}, {&target, target_bdim}});
  shape.insert(shape.begin(), batch);

  Tensor g = align_batch_first(grad_output, grad_output_bdim, rank);
  if (reduction == at::Reduction::Mean) {
    // a float divisor: an integer one would be converted to a tensor first
    g = g / static_cast<c10::SymFloat>(numel_of(self_sizes));
  }
  // The kernel's result takes self's shape: self expanded (not copied) to the
  // broadcast shape, batch dim included.
  const Tensor x = align_batch_first(self, self_bdim, rank).expand_symint(shape);
  return {loss_backward_kernel(loss, g, x, align_batch_first(target, target_bdim, rank), param), 0};
}

}  // namespace batchrules
