// The checks of ATen's nll_loss / nll_loss2d kernels, in their words, on
// logical sizes. One deliberate difference: the backward accepts a [1] target
// with a 1-D input, as the forward does (eager's backward rejects it, stock
// vmap's Python decomposition accepts it).
#include "losses/shape_checks.h"

#include "common/batching_utils.h"

#include <ATen/core/Reduction.h>
#include <c10/util/Exception.h>

namespace batchrules {

namespace {

void check_nll_shapes(c10::SymIntArrayRef self, c10::SymIntArrayRef target) {
  TORCH_CHECK(!self.empty() && self.size() <= 2, "input tensor should be 1D or 2D");
  TORCH_CHECK(target.size() <= 1, "0D or 1D target tensor expected, multi-target not supported");
  if (self.size() == 1 && target.size() == 1) {
    TORCH_CHECK_VALUE(target[0] == 1,
                      "For 1D input, 1D target must have size 1, but got target size: ", target[0]);
    return;
  }
  const bool no_batch_dim = self.size() == 1 && target.empty();
  TORCH_CHECK(no_batch_dim || (!target.empty() && self[0] == target[0]),
              "size mismatch (got input: ", self, ", target: ", target, ")");
}

void check_nll2d_shapes(c10::SymIntArrayRef self, c10::SymIntArrayRef target) {
  TORCH_CHECK(target.size() == 3,
              "only batches of spatial targets supported (3D tensors) but got targets of "
              "dimension: ",
              target.size());
  TORCH_CHECK(self.size() == 4,
              "only batches of spatial inputs supported (4D tensors), but got input of "
              "dimension: ",
              self.size());
  TORCH_CHECK(self[0] == target[0] && self[2] == target[1] && self[3] == target[2],
              "size mismatch (got input: ", self, " , target: ", target);
}

void check_weight_numel(c10::SymIntArrayRef self, std::optional<c10::SymIntArrayRef> weight,
                        int64_t class_dim) {
  TORCH_CHECK(!weight.has_value() || numel_of(*weight) == self[class_dim],
              "weight tensor should be defined either for all or no classes");
}

}  // namespace

void check_nll_loss_forward_shapes(NllOp op, c10::SymIntArrayRef self, c10::SymIntArrayRef target,
                                   std::optional<c10::SymIntArrayRef> weight) {
  if (op == NllOp::Nll2d) {
    check_nll2d_shapes(self, target);
    check_weight_numel(self, weight, 1);
    return;
  }
  check_nll_shapes(self, target);
  const c10::SymInt& classes = self.back();
  TORCH_CHECK(!weight.has_value() || (weight->size() == 1 && (*weight)[0] == classes),
              "weight tensor should be defined either for all ", classes,
              " classes or no classes but got weight tensor of shape: ", *weight);
}

void check_nll_loss_backward_shapes(NllOp op, c10::SymIntArrayRef grad_output,
                                    c10::SymIntArrayRef self, c10::SymIntArrayRef target,
                                    std::optional<c10::SymIntArrayRef> weight, int64_t reduction,
                                    c10::SymIntArrayRef total_weight) {
  const bool spatial = op == NllOp::Nll2d;
  if (spatial) {
    check_nll2d_shapes(self, target);
  } else {
    check_nll_shapes(self, target);
  }
  check_weight_numel(self, weight, self.size() == 1 ? 0 : 1);
  TORCH_CHECK(numel_of(total_weight) == 1,
              "expected total_weight to be a single element tensor, got: ", total_weight, " (",
              numel_of(total_weight), " elements)");
  if (reduction == at::Reduction::None && spatial) {
    TORCH_CHECK(grad_output.equals(target), "grad_output must have same dimension as target (",
                target.size(), ") but got dimension: ", grad_output);
  } else if (reduction == at::Reduction::None && self.size() == 2) {
    TORCH_CHECK(grad_output.size() == 1 && grad_output[0] == self[0],
                "Expected a tensor of dimension 1 and tensor.size[0] == ", self[0],
                " but got: dimension ", grad_output.size(),
                " and tensor.size[0] = ", grad_output.empty() ? c10::SymInt(0) : grad_output[0]);
  } else {
    TORCH_CHECK(grad_output.size() <= 1 && numel_of(grad_output) == 1,
                "Expected a single element grad_output tensor, but got: ", grad_output);
  }
}

void check_nll_target_dtype(const at::Tensor& target) {
  TORCH_CHECK(target.scalar_type() == at::kLong || target.scalar_type() == at::kByte,
              "expected target dtype to be Long or Byte, but got ", target.scalar_type());
}

}  // namespace batchrules
