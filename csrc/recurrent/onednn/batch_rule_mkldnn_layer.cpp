// A rule for aten::mkldnn_rnn_layer, oneDNN's fused LSTM layer, where routing
// runs it with nothing differentiated (Note [oneDNN's LSTM layer under
// transforms]): shared weights fold the vmap dim into the rows, one fused
// call; batched weights (ensembles) one call per member.
#include "common/vmap_plumbing.h"
#include "recurrent/onednn/batch_rules.h"
#include "recurrent/onednn/batching.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>

namespace batchrules {

std::tuple<Tensor, Tensor, Tensor, Tensor> mkldnn_rnn_layer_batched(
    const Tensor& input, const Tensor& w0, const Tensor& w1, const Tensor& w2, const Tensor& w3,
    const Tensor& hx, const Tensor& cx, bool reverse, at::IntArrayRef batch_sizes, int64_t mode,
    int64_t hidden_size, int64_t num_layers, bool has_biases, bool bidirectional, bool batch_first,
    bool train) {
  const BatchedKernelScope scope("mkldnn_rnn_layer");
  const int64_t level = scope.level();
  const auto call = [&](const Tensor& x, const Tensor& a, const Tensor& b, const Tensor& c,
                        const Tensor& d, const Tensor& h, const Tensor& cc) {
    return at::mkldnn_rnn_layer(x, a, b, c, d, h, cc, reverse, batch_sizes, mode, hidden_size,
                                num_layers, has_biases, bidirectional, batch_first, train);
  };
  if (!any_batched_at(level, input, w0, w1, w2, w3, hx, cx)) {
    return call(input, w0, w1, w2, w3, hx, cx);
  }
  const std::vector<BatchedResult> ops = {
      unwrap_at(input, level), unwrap_at(w0, level), unwrap_at(w1, level), unwrap_at(w2, level),
      unwrap_at(w3, level),    unwrap_at(hx, level), unwrap_at(cx, level)};
  // The layer computes its training workspace whenever grad mode is on; where
  // no operand can be differentiated it runs as inference, as the eager loop
  // whose outputs need no graph does.
  std::optional<at::NoGradGuard> inference;
  if (std::none_of(ops.begin(), ops.end(), [](const BatchedResult& r) {
        return std::get<0>(r).defined() && std::get<0>(r).requires_grad();
      })) {
    inference.emplace();
  }
  BatchedLstmLayer r = batched_lstm_layer(ops, level, [&](const std::vector<Tensor>& a) {
    auto [o, h, c, ws] = call(a[0], a[1], a[2], a[3], a[4], a[5], a[6]);
    return LstmLayerCall{o, h, c, {ws}};
  });
  // aten's schema has one workspace: the folded call's, or the members' stacked
  const Tensor workspace = r.folded || !r.workspaces[0].defined()
                               ? r.workspaces[0]
                               : wrap_at(at::stack(r.workspaces), 0, level);
  return {r.output, r.h_n, r.c_n, workspace};
}

}  // namespace batchrules
