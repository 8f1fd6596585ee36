#include "attention/shape_checks.h"

#include "common/batching_utils.h"

#include <c10/util/Exception.h>

namespace batchrules {

c10::SymInt check_attention_operands(const char* op,
                                     std::initializer_list<AttentionOperand> operands) {
  std::optional<c10::SymInt> batch;
  const char* batch_from = nullptr;
  c10::SymDimVector batch_shape;
  for (const auto& o : operands) {
    if (!o.tensor.defined()) {
      continue;
    }
    const c10::SymDimVector shape = logical_sizes(o.tensor, o.bdim);
    TORCH_CHECK(o.rank == 0 || static_cast<int64_t>(shape.size()) == o.rank, op, ": expected ",
                o.name, " of one example to be ", o.rank, "-D (batch, heads, ...), but got shape ",
                c10::SymIntArrayRef(shape));
    TORCH_CHECK(!shape.empty(), op, ": expected ", o.name,
                " of one example to have a batch dim, but it is 0-D");
    if (!batch.has_value()) {
      batch = shape[0];
      batch_from = o.name;
      batch_shape = shape;
      continue;
    }
    TORCH_CHECK(shape[0] == *batch, op, ": ", o.name, " and ", batch_from,
                " of one example must have the same batch size (dim 0), but got ", o.name,
                " of shape ", c10::SymIntArrayRef(shape), " and ", batch_from, " of shape ",
                c10::SymIntArrayRef(batch_shape));
  }
  TORCH_INTERNAL_ASSERT(batch.has_value(), op, ": no defined operand");
  return *batch;
}

void check_attention_mask(const char* op, const char* name, const std::optional<at::Tensor>& mask,
                          std::optional<int64_t> bdim, const c10::SymInt& batch) {
  if (!mask.has_value() || !mask->defined()) {
    return;
  }
  const c10::SymDimVector shape = logical_sizes(*mask, bdim);
  TORCH_CHECK(shape.size() == 2 || shape.size() == 4, op, ": expected ", name,
              " of one example to be 2-D (L, S) or 4-D (batch, heads, L, S), but got shape ",
              c10::SymIntArrayRef(shape));
  TORCH_CHECK(shape.size() == 2 || shape[0] == 1 || shape[0] == batch, op, ": ", name,
              " of one example has shape ", c10::SymIntArrayRef(shape),
              ", whose batch size (dim 0) must be 1 or the query's ", batch);
}

}  // namespace batchrules
