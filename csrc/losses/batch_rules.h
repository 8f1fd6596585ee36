// vmap batching rules for the aten loss ops, in functorch's style: physical
// tensors with their optional batch dim in, (result, bdim) out. They replace
// functorch's Python decompositions (and its element-wise loss rules) while routing
// is on (batched_kernel.cpp, registered by routes.cpp).
#pragma once

#include "common/batching_utils.h"
#include "losses/shape_checks.h"

#include <c10/core/SymInt.h>

#include <optional>
#include <tuple>

namespace batchrules {

using BatchedPair = std::tuple<Tensor, std::optional<int64_t>, Tensor, std::optional<int64_t>>;

// aten::nll_loss_forward / nll_loss2d_forward -> (output, total_weight).
BatchedPair nll_loss_forward_batch_rule(NllOp op, const Tensor& self,
                                        std::optional<int64_t> self_bdim, const Tensor& target,
                                        std::optional<int64_t> target_bdim,
                                        const std::optional<Tensor>& weight,
                                        std::optional<int64_t> weight_bdim, int64_t reduction,
                                        const c10::SymInt& ignore_index);

// aten::nll_loss_backward / nll_loss2d_backward -> grad_input.
BatchedResult nll_loss_backward_batch_rule(
    NllOp op, const Tensor& grad_output, std::optional<int64_t> grad_output_bdim,
    const Tensor& self, std::optional<int64_t> self_bdim, const Tensor& target,
    std::optional<int64_t> target_bdim, const std::optional<Tensor>& weight,
    std::optional<int64_t> weight_bdim, int64_t reduction, const c10::SymInt& ignore_index,
    const Tensor& total_weight, std::optional<int64_t> total_weight_bdim);

// The elementwise regression losses.
enum class PointwiseLoss { Mse, SmoothL1, Huber };

// aten::mse_loss(self, target, reduction), smooth_l1_loss(..., beta),
// huber_loss(..., delta) on unbatched operands: `param` is beta or delta.
Tensor pointwise_loss(PointwiseLoss loss, const Tensor& self, const Tensor& target,
                      int64_t reduction, double param);

// The same ops batched.
BatchedResult pointwise_loss_batch_rule(PointwiseLoss loss, const Tensor& self,
                                        std::optional<int64_t> self_bdim, const Tensor& target,
                                        std::optional<int64_t> target_bdim, int64_t reduction,
                                        double param);

// aten::mse_loss_backward(grad_output, self, target, reduction),
// smooth_l1_loss_backward(..., beta), huber_loss_backward(..., delta): `param`
// is beta or delta (unused for mse).
BatchedResult pointwise_loss_backward_batch_rule(
    PointwiseLoss loss, const Tensor& grad_output, std::optional<int64_t> grad_output_bdim,
    const Tensor& self, std::optional<int64_t> self_bdim, const Tensor& target,
    std::optional<int64_t> target_bdim, int64_t reduction, double param);

}  // namespace batchrules
