// Kernels for the classification losses' composite ops, routed at
// FuncTorchDynamicLayerFrontMode: Note [Autocast policies of the losses under
// vmap] (autocast_kernel.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>

namespace batchrules {

using at::Tensor;

Tensor routed_log_softmax(const Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype);
Tensor routed_softmax(const Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype);
Tensor routed_nll_loss(const Tensor& self, const Tensor& target,
                       const std::optional<Tensor>& weight, int64_t reduction,
                       c10::SymInt ignore_index);
Tensor routed_nll_loss2d(const Tensor& self, const Tensor& target,
                         const std::optional<Tensor>& weight, int64_t reduction,
                         c10::SymInt ignore_index);
Tensor routed_nll_loss_nd(const Tensor& self, const Tensor& target,
                          const std::optional<Tensor>& weight, int64_t reduction,
                          c10::SymInt ignore_index);
Tensor routed_cross_entropy_loss(const Tensor& self, const Tensor& target,
                                 const std::optional<Tensor>& weight, int64_t reduction,
                                 c10::SymInt ignore_index, double label_smoothing);

}  // namespace batchrules
