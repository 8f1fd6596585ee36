#include "recurrent/fused_batching.h"

#include <ATen/ATen.h>

namespace batchrules {

int64_t vmap_size_of(const std::vector<BatchedResult>& operands) {
  for (const auto& [t, bdim] : operands) {
    if (bdim.has_value()) {
      return t.size(*bdim);
    }
  }
  TORCH_INTERNAL_ASSERT(false, "a batching rule ran with no batched operand");
}

Tensor fold_rows(const Tensor& t, std::optional<int64_t> bdim, int64_t pos, int64_t batch) {
  if (!t.defined()) {
    return t;
  }
  Tensor b;
  if (bdim.has_value()) {
    b = t.movedim(*bdim, pos);
  } else {
    std::vector<int64_t> sizes = t.sizes().vec();
    sizes.insert(sizes.begin() + pos, batch);
    b = t.unsqueeze(pos).expand(sizes);
  }
  return b.flatten(pos, pos + 1).contiguous();
}

Tensor unfold_rows(const Tensor& t, int64_t pos, int64_t batch) {
  return t.defined() ? t.unflatten(pos, {batch, t.size(pos) / batch}) : t;
}

std::vector<Tensor> per_example(
    const std::vector<BatchedResult>& operands, int64_t batch,
    const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& call) {
  TORCH_CHECK(batch > 0, "batchrules: oneDNN's LSTM layer under vmap needs at least one example, "
              "but the vmap size is 0");
  std::vector<std::vector<Tensor>> slices;
  for (int64_t b = 0; b < batch; ++b) {
    std::vector<Tensor> args;
    for (const auto& [t, bdim] : operands) {
      args.push_back(!t.defined()         ? t
                     : bdim.has_value() ? t.select(*bdim, b).contiguous()
                                        : t.contiguous());
    }
    auto outs = call(args);
    if (slices.empty()) {
      slices.resize(outs.size());
    }
    for (size_t i = 0; i < outs.size(); ++i) {
      slices[i].push_back(std::move(outs[i]));
    }
  }
  std::vector<Tensor> stacked;
  for (const auto& s : slices) {
    stacked.push_back(!s.empty() && s.front().defined() ? at::stack(s) : Tensor());
  }
  return stacked;
}

}  // namespace batchrules
