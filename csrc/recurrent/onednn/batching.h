// Batching oneDNN's fused LSTM layer (aten::mkldnn_rnn_layer and
// batchrules::fused_lstm_layer): its kernel reads dense time-major operands,
// has no group dim, and sums weight gradients over its rows. So a rule either
// folds the vmap dim into the rows (forward with shared weights) or calls the
// kernel once per example or member, the loop of fused calls a user would
// write. See Note [oneDNN's LSTM layer under transforms] (onednn/kernel_choice.cpp).
#pragma once

#include "common/batching_utils.h"

#include <functional>
#include <vector>

namespace batchrules {

// The vmap size: the batch dim's size of the first batched operand.
int64_t vmap_size_of(const std::vector<BatchedResult>& operands);

// [.., B at bdim, ..] -> dims pos, pos+1 = B, rows folded into one, contiguous
// (an unbatched operand is expanded to B first).
Tensor fold_rows(const Tensor& t, std::optional<int64_t> bdim, int64_t pos, int64_t batch);

// The inverse for a result: dim pos B*rows -> B, rows (its bdim is pos);
// `rows` is an example's, not B*rows / B: B may be 0.
Tensor unfold_rows(const Tensor& t, int64_t pos, int64_t batch, int64_t rows);

// Calls `call` once per b in [0, batch) with each batched operand's slice b
// (unbatched ones as they are), all contiguous, and b; returns each output's
// slices stacked along a new dim 0 (an undefined output stays undefined).
// An empty batch calls it once on an example of zeros, for the results'
// per-example shapes and dtypes, and returns them with 0 examples.
std::vector<Tensor> per_example(
    const std::vector<BatchedResult>& operands, int64_t batch,
    const std::function<std::vector<Tensor>(const std::vector<Tensor>&, int64_t)>& call);

// One oneDNN layer call's results: output, h_n, c_n and its workspaces.
struct LstmLayerCall {
  Tensor output, h_n, c_n;
  std::vector<Tensor> workspaces;
};

// A oneDNN LSTM layer under vmap at `level`: operands input [T, N, I],
// w_ih, w_hh, b_ih, b_hh, h0 [N, H], c0 [N, H] (physical, with their bdims;
// an absent bias undefined); `call` runs the layer on such physical operands.
// Shared weights: one call over the folded rows; batched weights: one call
// per member. Returns the outputs batched at `level` and every call's
// workspaces, unbatched, in call order (`folded`: which of the two ran).
struct BatchedLstmLayer {
  Tensor output, h_n, c_n;
  std::vector<Tensor> workspaces;
  bool folded;
};
BatchedLstmLayer batched_lstm_layer(
    const std::vector<BatchedResult>& operands, int64_t level,
    const std::function<LstmLayerCall(const std::vector<Tensor>&)>& call);

}  // namespace batchrules
