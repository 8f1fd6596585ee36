#include "recurrent/onednn/batching.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/functorch/BatchedTensorImpl.h>

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
  return t.defined() ? batch_dim_at(t, bdim, pos, batch).flatten(pos, pos + 1).contiguous() : t;
}

Tensor unfold_rows(const Tensor& t, int64_t pos, int64_t batch, int64_t rows) {
  return t.defined() ? t.unflatten(pos, {batch, rows}) : t;
}

std::vector<Tensor> per_example(
    const std::vector<BatchedResult>& operands, int64_t batch,
    const std::function<std::vector<Tensor>(const std::vector<Tensor>&, int64_t)>& call) {
  // An empty batch: one example of zeros gives the results' shapes.
  const int64_t calls = std::max<int64_t>(batch, 1);
  std::vector<std::vector<Tensor>> slices;
  for (int64_t b = 0; b < calls; ++b) {
    std::vector<Tensor> args;
    for (const auto& [t, bdim] : operands) {
      args.push_back(!t.defined()        ? t
                     : !bdim.has_value() ? t.contiguous()
                     : batch == 0        ? at::zeros_symint(logical_sizes(t, bdim), t.options())
                                         : t.select(*bdim, b).contiguous());
    }
    auto outs = call(args, b);
    if (slices.empty()) {
      slices.resize(outs.size());
    }
    for (size_t i = 0; i < outs.size(); ++i) {
      slices[i].push_back(std::move(outs[i]));
    }
  }
  std::vector<Tensor> stacked;
  for (const auto& s : slices) {
    stacked.push_back(!s.empty() && s.front().defined() ? at::stack(s).narrow(0, 0, batch)
                                                        : Tensor());
  }
  return stacked;
}

BatchedLstmLayer batched_lstm_layer(
    const std::vector<BatchedResult>& operands, int64_t level,
    const std::function<LstmLayerCall(const std::vector<Tensor>&)>& call) {
  const int64_t batch = vmap_size_of(operands);
  const auto wrap = [level](const Tensor& t, int64_t bdim) {
    return t.defined() ? at::functorch::makeBatched(t, bdim, level) : t;
  };
  const bool weights_batched = std::any_of(operands.begin() + 1, operands.begin() + 5,
                                           [](const BatchedResult& r) { return std::get<1>(r); });
  if (!weights_batched) {
    std::vector<Tensor> folded;
    for (const auto& [t, bdim] : operands) {
      folded.push_back(t);
    }
    // T,B*N,I x 4H,I -> T,B*N,H
    folded[0] = fold_rows(std::get<0>(operands[0]), std::get<1>(operands[0]), 1, batch);
    folded[5] = fold_rows(std::get<0>(operands[5]), std::get<1>(operands[5]), 0, batch);
    folded[6] = fold_rows(std::get<0>(operands[6]), std::get<1>(operands[6]), 0, batch);
    const int64_t rows =
        logical_sizes(std::get<0>(operands[0]), std::get<1>(operands[0]))[1].expect_int();
    LstmLayerCall r = call(folded);
    return {wrap(unfold_rows(r.output, 1, batch, rows), 1),
            wrap(unfold_rows(r.h_n, 0, batch, rows), 0),
            wrap(unfold_rows(r.c_n, 0, batch, rows), 0), std::move(r.workspaces),
            /*folded=*/true};
  }
  std::vector<Tensor> workspaces;
  const auto outs = per_example(operands, batch, [&](const std::vector<Tensor>& args, int64_t) {
    LstmLayerCall r = call(args);
    workspaces.insert(workspaces.end(), r.workspaces.begin(), r.workspaces.end());
    return std::vector<Tensor>{r.output, r.h_n, r.c_n};
  });
  return {wrap(outs[0], 0), wrap(outs[1], 0), wrap(outs[2], 0), std::move(workspaces),
          /*folded=*/false};
}

}  // namespace batchrules
