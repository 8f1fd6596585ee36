// Per-example checks of the SDPA batching rules.
//
// A fold only keeps each example's meaning when the example's operands agree
// on the attention batch B (the fused kernels do not check it: a key with a
// smaller B is read past its end) and have the ranks the kernels take (a 3-D
// operand would fold its heads into the batch). The rules check both on the
// logical shapes, so the messages name the shapes of one example.
#pragma once

#include <ATen/core/Tensor.h>

#include <initializer_list>
#include <optional>

namespace batchrules {

struct AttentionOperand {
  const char* name;
  const at::Tensor& tensor;  // physical; an undefined tensor is skipped
  std::optional<int64_t> bdim;
  int64_t rank;  // expected logical rank; 0: any
};

// Every operand has its expected logical rank and the batch size (logical
// dim 0) of the first; returns that batch size.
c10::SymInt check_attention_operands(const char* op,
                                     std::initializer_list<AttentionOperand> operands);

// A mask or bias is logical [L, S] or [Bm, Hm, L, S] with Bm 1 or `batch`.
void check_attention_mask(const char* op, const char* name, const std::optional<at::Tensor>& mask,
                          std::optional<int64_t> bdim, const c10::SymInt& batch);

}  // namespace batchrules
