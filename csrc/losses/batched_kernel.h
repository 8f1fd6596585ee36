// FuncTorchBatched kernels for aten's loss ops: the rules of batch_rule_*.cpp
// behind the shared plumbing (Note [Hand-written vmap plumbing]). They serve
// aten ops, so routes.cpp registers them while routing is on, replacing
// functorch's Python decompositions (and its element-wise loss rules).
#pragma once

#include "losses/shape_checks.h"

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>
#include <tuple>

namespace batchrules {

using at::Tensor;

// aten::nll_loss_forward (NllOp::Nll) and nll_loss2d_forward (NllOp::Nll2d).
template <NllOp op>
std::tuple<Tensor, Tensor> nll_loss_forward_batched(const Tensor& self, const Tensor& target,
                                                    const std::optional<Tensor>& weight,
                                                    int64_t reduction, c10::SymInt ignore_index);

// aten::nll_loss_backward (NllOp::Nll) and nll_loss2d_backward (NllOp::Nll2d).
template <NllOp op>
Tensor nll_loss_backward_batched(const Tensor& grad_output, const Tensor& self,
                                 const Tensor& target, const std::optional<Tensor>& weight,
                                 int64_t reduction, c10::SymInt ignore_index,
                                 const Tensor& total_weight);

Tensor mse_loss_batched(const Tensor& self, const Tensor& target, int64_t reduction);

Tensor smooth_l1_loss_batched(const Tensor& self, const Tensor& target, int64_t reduction,
                              double beta);

Tensor huber_loss_batched(const Tensor& self, const Tensor& target, int64_t reduction,
                          double delta);

Tensor mse_loss_backward_batched(const Tensor& grad_output, const Tensor& self,
                                 const Tensor& target, int64_t reduction);

Tensor smooth_l1_loss_backward_batched(const Tensor& grad_output, const Tensor& self,
                                       const Tensor& target, int64_t reduction, double beta);

Tensor huber_loss_backward_batched(const Tensor& grad_output, const Tensor& self,
                                   const Tensor& target, int64_t reduction, double delta);

}  // namespace batchrules
