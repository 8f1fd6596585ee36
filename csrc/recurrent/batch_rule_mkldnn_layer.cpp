// A rule for aten::mkldnn_rnn_layer, the fused oneDNN LSTM layer of CPU
// inference (Note [Fused LSTM layers where nothing is differentiated]):
// shared weights fold the vmap dim into the layer's rows, one fused call;
// batched weights (ensembles) call it once per member, the loop of fused
// calls a user would write. The kernel reads its operands' memory as dense
// time-major arrays, so every operand it gets is made contiguous.
#include "common/vmap_plumbing.h"
#include "recurrent/batch_rules.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <vector>

namespace batchrules {

namespace {

using Outputs = std::tuple<Tensor, Tensor, Tensor, Tensor>;

// Dim `pos` as B*rows -> B, rows (bdim pos).
Tensor rows_to_batch(const Tensor& t, int64_t pos, int64_t batch) {
  return t.defined() ? t.unflatten(pos, {batch, t.size(pos) / batch}) : t;
}

Tensor fold_rows(const Tensor& t, std::optional<int64_t> bdim, int64_t pos, int64_t batch) {
  Tensor b = bdim.has_value() ? t.movedim(*bdim, pos)
                              : t.unsqueeze(pos).expand_symint([&] {
                                  auto s = t.sym_sizes().vec();
                                  s.insert(s.begin() + pos, batch);
                                  return s;
                                }());
  return b.flatten(pos, pos + 1).contiguous();
}

Tensor member(const Tensor& t, std::optional<int64_t> bdim, int64_t b) {
  return (bdim.has_value() ? t.select(*bdim, b) : t).contiguous();
}

template <class... Ts>
bool torch_requires_grad(const Ts&... ts) {
  return ((ts.defined() && ts.requires_grad()) || ...);
}

Tensor stack_defined(const std::vector<Tensor>& ts) {
  return ts.front().defined() ? at::stack(ts) : Tensor();
}

}  // namespace

Outputs mkldnn_rnn_layer_batched(const Tensor& input, const Tensor& w0, const Tensor& w1,
                                 const Tensor& w2, const Tensor& w3, const Tensor& hx,
                                 const Tensor& cx, bool reverse, at::IntArrayRef batch_sizes,
                                 int64_t mode, int64_t hidden_size, int64_t num_layers,
                                 bool has_biases, bool bidirectional, bool batch_first,
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
  // The fused layer computes its training workspace whenever grad mode is on;
  // where no operand can be differentiated, it runs as inference, like the
  // eager loop whose outputs need no graph.
  std::optional<at::NoGradGuard> inference;
  auto [x, x_bdim] = unwrap_at(input, level);
  auto [h, h_bdim] = unwrap_at(hx, level);
  auto [c, c_bdim] = unwrap_at(cx, level);
  std::array<BatchedResult, 4> w = {unwrap_at(w0, level), unwrap_at(w1, level),
                                    unwrap_at(w2, level), unwrap_at(w3, level)};
  const int64_t batch = vmap_size({{&x, x_bdim}, {&h, h_bdim}, {&c, c_bdim},
                                   {&std::get<0>(w[0]), std::get<1>(w[0])},
                                   {&std::get<0>(w[1]), std::get<1>(w[1])},
                                   {&std::get<0>(w[2]), std::get<1>(w[2])},
                                   {&std::get<0>(w[3]), std::get<1>(w[3])}})
                            .expect_int();
  if (!torch_requires_grad(x, h, c, std::get<0>(w[0]), std::get<0>(w[1]), std::get<0>(w[2]),
                          std::get<0>(w[3]))) {
    inference.emplace();
  }
  const bool weights_batched = std::any_of(w.begin(), w.end(), [](const BatchedResult& r) {
    return std::get<1>(r).has_value();
  });
  if (!weights_batched) {
    // T,B*N,I x 4H,I -> T,B*N,H
    auto [out, hy, cy, ws] = call(fold_rows(x, x_bdim, 1, batch), std::get<0>(w[0]),
                                  std::get<0>(w[1]), std::get<0>(w[2]), std::get<0>(w[3]),
                                  fold_rows(h, h_bdim, 0, batch), fold_rows(c, c_bdim, 0, batch));
    return {wrap_at(rows_to_batch(out, 1, batch), 1, level),
            wrap_at(rows_to_batch(hy, 0, batch), 0, level),
            wrap_at(rows_to_batch(cy, 0, batch), 0, level), ws};
  }
  std::array<std::vector<Tensor>, 4> outs;
  for (int64_t b = 0; b < batch; ++b) {
    const auto m = [&](const BatchedResult& r) {
      return member(std::get<0>(r), std::get<1>(r), b);
    };
    auto [out, hy, cy, ws] = call(member(x, x_bdim, b), m(w[0]), m(w[1]), m(w[2]), m(w[3]),
                                  member(h, h_bdim, b), member(c, c_bdim, b));
    outs[0].push_back(out);
    outs[1].push_back(hy);
    outs[2].push_back(cy);
    outs[3].push_back(ws);
  }
  const auto wrap = [&](const std::vector<Tensor>& ts) {
    const Tensor s = stack_defined(ts);
    return wrap_at(s, s.defined() ? std::optional<int64_t>(0) : std::nullopt, level);
  };
  return {wrap(outs[0]), wrap(outs[1]), wrap(outs[2]), wrap(outs[3])};
}

}  // namespace batchrules
