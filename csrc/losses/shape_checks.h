// Shape validation of the loss ops' batching rules.
//
// The rules call these with *logical* (per-example) sizes before folding the
// vmap batch into the loss's rows, so a bad example fails with eager's message
// naming that example's shapes instead of passing as a differently shaped
// batch, or failing with the folded shapes.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>
#include <c10/util/ArrayRef.h>

#include <optional>

namespace batchrules {

// Which aten op a nll rule serves: nll_loss_* takes [C] or [N, C] input,
// nll_loss2d_* [N, C, H, W].
enum class NllOp { Nll, Nll2d };

// nll_loss_forward / nll_loss2d_forward(self, target, weight).
void check_nll_loss_forward_shapes(NllOp op, c10::SymIntArrayRef self, c10::SymIntArrayRef target,
                                   std::optional<c10::SymIntArrayRef> weight);

// nll_loss_backward / nll_loss2d_backward(grad_output, self, target, weight,
// reduction, ignore_index, total_weight).
void check_nll_loss_backward_shapes(NllOp op, c10::SymIntArrayRef grad_output,
                                    c10::SymIntArrayRef self, c10::SymIntArrayRef target,
                                    std::optional<c10::SymIntArrayRef> weight, int64_t reduction,
                                    c10::SymIntArrayRef total_weight);

// Class-index targets are int64 or uint8, as in eager.
void check_nll_target_dtype(const at::Tensor& target);

}  // namespace batchrules
