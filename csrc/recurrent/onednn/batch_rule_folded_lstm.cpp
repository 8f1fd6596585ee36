// aten::lstm over per-sample sequences under vmap alone: the vmap dim folded
// into the layer's rows, one eager call of aten's LSTM.
//
// Note [An LSTM over per-sample sequences as one eager call]
// Where vmap is the only transform and only the input and states are batched
// (shared weights: per-sample inference), the vmapped LSTM is aten's LSTM over
// the whole batch with the vmap dim folded into its rows. layers.cpp's
// composition reaches the same oneDNN layer, but through some forty view,
// stack and cat ops, each dispatched on BatchedTensors, which cost more than
// the budget of a per-sample forward (1.1x the eager call over the folded
// batch). So the route folds the operands
// and calls aten::lstm below the transforms, as the batch's own eager call
// would. It does so only where lstm_kernel picks oneDNN's inference layer, so
// every other flow keeps its kernel, and not with dropout between layers in
// training: vmap's randomness decides whether the samples share a mask, and
// layers.cpp draws it under vmap.
#include "common/vmap_plumbing.h"
#include "recurrent/layers.h"
#include "recurrent/onednn/batch_rules.h"
#include "recurrent/onednn/batching.h"

#include <ATen/ATen.h>
#include <ATen/functorch/DynamicLayer.h>
#include <c10/core/GradMode.h>

#include <algorithm>

namespace batchrules {

std::array<BatchedResult, 3> lstm_folded_batch_rule(const Tensor& input, int64_t input_bdim,
                                                    const Tensor& h0, OptBdim h0_bdim,
                                                    const Tensor& c0, OptBdim c0_bdim,
                                                    at::TensorList params, bool has_biases,
                                                    int64_t num_layers, double dropout, bool train,
                                                    bool bidirectional, bool batch_first) {
  const int64_t batch = input.size(input_bdim);
  const int64_t rows = batch_first ? 0 : 1;
  const int64_t n = logical_sizes(input, input_bdim)[rows].expect_int();  // an example's N
  // T,B,N,I -> T,B*N,I (B,N,T,I -> B*N,T,I batch_first); L*D,(B,)N,H ->
  // L*D,B*N,H, dense: oneDNN reads a state expanded over the samples (stride
  // 0) slower than a dense one.
  auto [output, h_n, c_n] =
      at::lstm(fold_rows(input, input_bdim, rows, batch),
               {fold_rows(h0, h0_bdim, 1, batch), fold_rows(c0, c0_bdim, 1, batch)}, params,
               has_biases, num_layers, dropout, train, bidirectional, batch_first);
  // T,B*N,D*H -> T,B,N,D*H; L*D,B*N,H -> L*D,B,N,H
  return {BatchedResult{unfold_rows(output, rows, batch, n), rows},
          BatchedResult{unfold_rows(h_n, 1, batch, n), 1},
          BatchedResult{unfold_rows(c_n, 1, batch, n), 1}};
}

std::optional<std::tuple<Tensor, Tensor, Tensor>> lstm_over_folded_rows(const Tensor& input,
                                                                        const Tensor& hx,
                                                                        const Tensor& cx,
                                                                        at::TensorList params,
                                                                        const RnnOptions& o) {
  const auto& stack = at::functorch::getDynamicLayerStack();
  if (stack.size() != 1 || stack[0].key() != at::functorch::TransformType::Vmap ||
      (o.train && o.dropout > 0 && o.num_layers > 1)) {
    return std::nullopt;
  }
  const int64_t level = stack[0].layerId();
  if (!batched_at(input, level) || std::any_of(params.begin(), params.end(), [&](const Tensor& p) {
        return batched_at(p, level);
      })) {
    return std::nullopt;
  }
  check_rnn_operands(input, hx, cx, params, o);  // per-sample shapes in its messages
  auto [x, x_bdim] = unwrap_at(input, level);
  auto [h0, h0_bdim] = unwrap_at(hx, level);
  auto [c0, c0_bdim] = unwrap_at(cx, level);
  std::array<BatchedResult, 3> out;
  {
    // vmap is the only transform: below it the operands are plain tensors, and
    // aten's LSTM runs as in eager mode.
    const c10::impl::ExcludeDispatchKeyGuard below_transforms(
        c10::DispatchKeySet({c10::DispatchKey::FuncTorchDynamicLayerFrontMode,
                             c10::DispatchKey::FuncTorchDynamicLayerBackMode}));
    // With grad mode on, oneDNN computes its training workspace even where
    // nothing can be differentiated; the rule of
    // aten::mkldnn_rnn_layer runs such a layer as inference too.
    const bool differentiable = x.requires_grad() || h0.requires_grad() || c0.requires_grad() ||
                                std::any_of(params.begin(), params.end(),
                                            [](const Tensor& p) { return p.requires_grad(); });
    std::optional<at::NoGradGuard> inference;
    if (!differentiable) {
      inference.emplace();
    }
    out = lstm_folded_batch_rule(x, *x_bdim, h0, h0_bdim, c0, c0_bdim, params, o.has_biases,
                                 o.num_layers, o.dropout, o.train, o.bidirectional, o.batch_first);
  }
  const auto wrap = [&](const BatchedResult& r) {
    return wrap_at(std::get<0>(r), std::get<1>(r), level);
  };
  return std::make_tuple(wrap(out[0]), wrap(out[1]), wrap(out[2]));
}

}  // namespace batchrules
