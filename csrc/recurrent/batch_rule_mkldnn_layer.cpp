// A rule for aten::mkldnn_rnn_layer, oneDNN's fused LSTM layer, where routing
// runs it with nothing differentiated (Note [oneDNN's LSTM layer under
// transforms]): shared weights fold the vmap dim into the rows, one fused
// call; batched weights (ensembles) one call per member.
#include "common/vmap_plumbing.h"
#include "recurrent/batch_rules.h"
#include "recurrent/fused_batching.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

namespace batchrules {

namespace {

template <class... Ts>
bool any_requires_grad(const Ts&... ts) {
  return ((ts.defined() && ts.requires_grad()) || ...);
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor> mkldnn_rnn_layer_batched(
    const Tensor& input, const Tensor& w0, const Tensor& w1, const Tensor& w2, const Tensor& w3,
    const Tensor& hx, const Tensor& cx, bool reverse, at::IntArrayRef batch_sizes, int64_t mode,
    int64_t hidden_size, int64_t num_layers, bool has_biases, bool bidirectional,
    bool batch_first, bool train) {
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
  const std::vector<BatchedResult> ops = {unwrap_at(input, level), unwrap_at(w0, level),
                                          unwrap_at(w1, level),    unwrap_at(w2, level),
                                          unwrap_at(w3, level),    unwrap_at(hx, level),
                                          unwrap_at(cx, level)};
  const auto value = [&](size_t i) { return std::get<0>(ops[i]); };
  const auto bdim = [&](size_t i) { return std::get<1>(ops[i]); };
  const int64_t batch = vmap_size_of(ops);
  // The layer computes its training workspace whenever grad mode is on; where
  // no operand can be differentiated it runs as inference, as the eager loop
  // whose outputs need no graph does.
  std::optional<at::NoGradGuard> inference;
  if (!any_requires_grad(value(0), value(1), value(2), value(3), value(4), value(5), value(6))) {
    inference.emplace();
  }
  if (!bdim(1) && !bdim(2) && !bdim(3) && !bdim(4)) {
    // T,B*N,I x 4H,I -> T,B*N,H
    auto [out, hy, cy, ws] = call(fold_rows(value(0), bdim(0), 1, batch), value(1), value(2),
                                  value(3), value(4), fold_rows(value(5), bdim(5), 0, batch),
                                  fold_rows(value(6), bdim(6), 0, batch));
    return {wrap_at(unfold_rows(out, 1, batch), 1, level),
            wrap_at(unfold_rows(hy, 0, batch), 0, level),
            wrap_at(unfold_rows(cy, 0, batch), 0, level), ws};
  }
  const auto outs = per_example(ops, batch, [&](const std::vector<Tensor>& a) {
    auto [out, hy, cy, ws] = call(a[0], a[1], a[2], a[3], a[4], a[5], a[6]);
    return std::vector<Tensor>{out, hy, cy, ws};
  });
  const auto wrap = [&](const Tensor& t) {
    return wrap_at(t, t.defined() ? std::optional<int64_t>(0) : std::nullopt, level);
  };
  return {wrap(outs[0]), wrap(outs[1]), wrap(outs[2]), wrap(outs[3])};
}

}  // namespace batchrules
