// The module-level structure aten's RNN ops have (layers, directions, dropout
// between layers, batch_first), around one recurrence per layer and direction.
#include "recurrent/layers.h"

#include "common/autocast.h"
#include "common/transform_stack.h"
#include "recurrent/onednn/layer.h"
#include "recurrent/run_recurrence.h"

#include <ATen/ATen.h>

#include <vector>

namespace batchrules {

namespace {

const char* mode_name(RnnMode mode) {
  switch (mode) {
    case RnnMode::Lstm: return "lstm";
    case RnnMode::Gru: return "gru";
    case RnnMode::RnnTanh: return "rnn_tanh";
    default: return "rnn_relu";
  }
}

// See Note [Recurrent layers under higher-order transforms].
RecurrenceResult recurrence(const Tensor& gates, const Tensor& h0, const Tensor& c0,
                            const Tensor& w_hh, const OptTensor& b_hh, const OptTensor& w_hr,
                            RnnMode mode, bool reverse) {
  const auto m = static_cast<int64_t>(mode);
  if (higher_order_transforms()) {
    return run_recurrence(gates, h0, maybe_defined(c0), w_hh, b_hh, w_hr, m, reverse,
                          RecurrenceMath::Decomposition);
  }
  return rnn_recurrence_op().call(gates, h0, maybe_defined(c0), w_hh, b_hh, w_hr, m, reverse);
}

// x: T,N,I x GH,I -> T,N,GH, then the loop over T. Under autocast the
// projection is linear's lower precision; GRU and the cells then run their
// state in its own dtype, as aten's composite GRU and cells do (their state
// arithmetic promotes to it).
RecurrenceResult layer_direction(const Tensor& x, const Tensor& h0, const Tensor& c0,
                                 const Tensor& w_ih, const Tensor& w_hh, const OptTensor& b_ih,
                                 const OptTensor& b_hh, const OptTensor& w_hr, RnnMode mode,
                                 bool reverse) {
  Tensor gates = at::linear(x, w_ih, b_ih);
  if (gates.scalar_type() != h0.scalar_type() && autocast_enabled_for(x)) {
    gates = gates.to(h0.scalar_type());
  }
  return recurrence(gates, h0, c0, w_hh, b_hh, w_hr, mode, reverse);
}

// T,N,I -> T,N,H through oneDNN's fused layer: aten's where nothing is
// differentiated, ours (oneDNN's backward under our node) under a grad level.
RecurrenceResult onednn_lstm_layer(const Tensor& x, const Tensor& h0, const Tensor& c0,
                                   const Tensor& w_ih, const Tensor& w_hh, const OptTensor& b_ih,
                                   const OptTensor& b_hh, bool reverse, const RnnOptions& o) {
  if (o.lstm_kernel == LstmKernel::OneDnnTraining) {
    auto [out, h_n, c_n, workspace] =
        fused_lstm_layer_op().call(x, w_ih, w_hh, b_ih, b_hh, h0, c0, reverse);
    return {out, h_n, c_n, Tensor()};  // its workspace lives on in the autograd node only
  }
  return onednn_lstm_forward(x, w_ih, w_hh, b_ih, b_hh, h0, c0, reverse, o.train);
}

}  // namespace

void check_rnn_operands(const Tensor& input, const Tensor& hx, const Tensor& cx,
                        at::TensorList params, const RnnOptions& o) {
  // aten's own messages where aten checks the same (RNN.cpp), so that routing
  // does not change what a user searches for; ours where aten checks nothing.
  const char* name = mode_name(o.mode);
  TORCH_CHECK_INDEX(input.dim() >= 3, "Dimension out of range (expected to be in range of [",
                    -input.dim(), ", ", input.dim() - 1, "], but got 2)");
  TORCH_CHECK(input.dim() == 3, name, ": expected input of shape [T, N, I] ([N, T, I] with ",
              "batch_first), but got ", input.sizes());
  TORCH_CHECK(input.size(o.batch_first ? 1 : 0) > 0,
              "Expected sequence length to be larger than 0 in RNN");
  const bool lstm = o.mode == RnnMode::Lstm;
  const int64_t directions = o.bidirectional ? 2 : 1;
  const int64_t plain = 2 + 2 * o.has_biases;
  const int64_t layers = o.num_layers * directions;
  TORCH_CHECK(static_cast<int64_t>(params.size()) == layers * plain ||
                  (lstm && static_cast<int64_t>(params.size()) == layers * (plain + 1)),
              "got an incorrect number of RNN parameters (expected ", layers * plain, " for ",
              o.num_layers, " layers and ", directions, " directions, but got ", params.size(),
              ")");
  const bool projected = lstm && hx.size(-1) != cx.size(-1);
  const int64_t per_layer = plain + projected;
  TORCH_CHECK(static_cast<int64_t>(params.size()) == layers * per_layer, name, ": expected ",
              layers * per_layer, " parameters for ", o.num_layers, " layers and ", directions,
              " directions", projected ? " with projections" : "", ", but got ", params.size());
  const int64_t batch = input.size(o.batch_first ? 0 : 1), state = params[1].size(1);
  TORCH_CHECK(input.size(2) == params[0].size(1), name, ": expected input with ", params[0].size(1),
              " features, but got input of shape ", input.sizes());
  TORCH_CHECK(hx.sizes() == at::IntArrayRef({layers, batch, state}), name,
              ": expected hidden state of shape [", layers, ", ", batch, ", ", state, "], but got ",
              hx.sizes());
  if (lstm) {
    const int64_t hidden = params[1].size(0) / 4;
    TORCH_CHECK(cx.sizes() == at::IntArrayRef({layers, batch, hidden}), name,
                ": expected cell state of shape [", layers, ", ", batch, ", ", hidden,
                "], but got ", cx.sizes());
  }
}

std::tuple<Tensor, Tensor, Tensor> run_rnn(const Tensor& input, const Tensor& hx, const Tensor& cx,
                                           at::TensorList params, const RnnOptions& o) {
  check_rnn_operands(input, hx, cx, params, o);
  const bool lstm = o.mode == RnnMode::Lstm;
  const bool projected = lstm && hx.size(-1) != cx.size(-1);
  const int64_t directions = o.bidirectional ? 2 : 1;
  const int64_t per_layer = 2 + 2 * o.has_biases + projected;
  Tensor x = o.batch_first ? input.transpose(0, 1) : input;

  std::vector<Tensor> h_n, c_n;
  for (int64_t layer = 0; layer < o.num_layers; ++layer) {
    std::vector<Tensor> outputs;
    for (int64_t d = 0; d < directions; ++d) {
      const int64_t index = layer * directions + d;
      const Tensor* p = params.data() + index * per_layer;
      const OptTensor b_ih = o.has_biases ? maybe_defined(p[2]) : std::nullopt;
      const OptTensor b_hh = o.has_biases ? maybe_defined(p[3]) : std::nullopt;
      const OptTensor w_hr = projected ? maybe_defined(p[per_layer - 1]) : std::nullopt;
      const Tensor h0 = hx.select(0, index), c0 = lstm ? cx.select(0, index) : Tensor();
      auto [out, hn, cn, ws] =
          o.lstm_kernel != LstmKernel::Recurrence
              ? onednn_lstm_layer(x, h0, c0, p[0], p[1], b_ih, b_hh, d == 1, o)
              : layer_direction(x, h0, c0, p[0], p[1], b_ih, b_hh, w_hr, o.mode, d == 1);
      outputs.push_back(out);
      h_n.push_back(hn);
      c_n.push_back(cn);
    }
    x = directions == 2 ? at::cat(outputs, -1) : outputs[0];
    if (o.dropout > 0 && o.train && layer + 1 < o.num_layers) {
      x = at::dropout(x, o.dropout, o.train);
    }
  }
  return {o.batch_first ? x.transpose(0, 1) : x, at::stack(h_n), lstm ? at::stack(c_n) : Tensor()};
}

std::tuple<Tensor, Tensor> run_cell(const Tensor& input, const Tensor& hx, const Tensor& cx,
                                    const Tensor& w_ih, const Tensor& w_hh, const OptTensor& b_ih,
                                    const OptTensor& b_hh, RnnMode mode) {
  // aten's checks and messages (RNN.cpp's check_rnn_cell_forward_*).
  TORCH_CHECK(input.dim() == 2, mode_name(mode), "_cell: expected input of shape [N, ",
              w_ih.size(1), "], but got ", input.sizes());
  TORCH_CHECK(input.size(1) == w_ih.size(1), "input has inconsistent input_size: got ",
              input.size(1), " expected ", w_ih.size(1));
  const auto check_hidden = [&](const Tensor& h, int64_t label) {
    TORCH_CHECK(h.dim() == 2, mode_name(mode), "_cell: expected hidden", label, " of shape [N, ",
                w_hh.size(1), "], but got ", h.sizes());
    TORCH_CHECK(input.size(0) == h.size(0), "Input batch size ", input.size(0),
                " doesn't match hidden", label, " batch size ", h.size(0));
    TORCH_CHECK(h.size(1) == w_hh.size(1), "hidden", label, " has inconsistent hidden_size: got ",
                h.size(1), ", expected ", w_hh.size(1));
  };
  check_hidden(hx, 0);
  if (cx.defined()) {
    check_hidden(cx, 1);
  }
  if (!autocast_enabled_for(input)) {
    // What aten's first GEMM of each (input x w_ih, h x w_hh) says.
    for (const auto& [a, w] : {std::pair<const Tensor&, const Tensor&>{input, w_ih}, {hx, w_hh}}) {
      TORCH_CHECK(a.scalar_type() == w.scalar_type(),
                  "mat1 and mat2 must have the same dtype, but got ", a.scalar_type(), " and ",
                  w.scalar_type());
    }
  }
  // N,I -> 1,N,I: one step
  auto [out, hn, cn, ws] = layer_direction(input.unsqueeze(0), hx, cx, w_ih, w_hh, b_ih, b_hh,
                                           std::nullopt, mode, false);
  return {hn, cn};
}

}  // namespace batchrules
