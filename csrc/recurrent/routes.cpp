// The recurrent family's kernels for aten ops while routing is on (see Note
// [Routing aten ops only while transforms are active]):
//  - FuncTorchDynamicLayerFrontMode: aten's LSTM/GRU/RNN ops and cells, run
//    as layers.cpp composes them, so that each layer and direction is a linear
//    call and one batchrules::rnn_recurrence with its own rules and autograd;
//  - FuncTorchBatched: aten's fused CPU LSTM layer (Note [oneDNN's LSTM
//    layer under transforms], onednn/kernel_choice.cpp), and the packed-sequence
//    overloads, which vmap cannot express (a PackedSequence's batch_sizes are
//    data, not a dim), with an error that says what to do instead.
#include "common/autocast.h"
#include "recurrent/layers.h"
#include "recurrent/onednn/batch_rules.h"
#include "routing.h"

namespace batchrules {

namespace {

using at::TensorList;

// The route replaces aten's op above its Autocast kernel: aten casts the LSTM
// and RNN layers' operands to lower precision (their fused CPU and CUDA
// kernels are on the list); GRU and the cells are composites whose linear
// calls autocast casts (layers.cpp). Note [Autocast policy of batchrules'
// operators].
std::vector<Tensor> cast_all(const LowerPrecisionCast& cast, TensorList ts) {
  std::vector<Tensor> out;
  for (const auto& t : ts) {
    out.push_back(cast(t));
  }
  return out;
}

// aten::lstm has no autocast kernel. On the CPU, autocast casts the fused
// oneDNN layer it calls (aten::mkldnn_rnn_layer) with oneDNN enabled and a
// non-empty input; otherwise eager runs its composite, whose linears
// autocast casts while the states stay in their dtype (layers.cpp): an empty
// batch comes out in float32. A projected LSTM always runs the composite,
// whose h is its projection's, in lower precision, and c its state's dtype:
// the route casts the layer and gives c_n that dtype.
bool onednn_layer_casts(const Tensor& input) {
  return at::globalContext().userEnabledMkldnn() && input.sym_numel() != 0;
}

std::tuple<Tensor, Tensor, Tensor> routed_lstm(const Tensor& input, TensorList hx,
                                               TensorList params, bool has_biases,
                                               int64_t num_layers, double dropout, bool train,
                                               bool bidirectional, bool batch_first) {
  TORCH_CHECK(hx.size() == 2, "lstm: expected two hidden states (h0, c0), but got ", hx.size());
  const bool projected = hx[0].sym_size(-1) != hx[1].sym_size(-1);  // as run_rnn reads it
  if (autocast_enabled_for(input) &&
      (!input.is_cpu() || projected || onednn_layer_casts(input))) {
    const LowerPrecisionCast cast(input.device().type());
    auto [out, h_n, c_n] =
        routed_lstm(cast(input), cast_all(cast, hx), cast_all(cast, params), has_biases,
                    num_layers, dropout, train, bidirectional, batch_first);
    if (projected && input.is_cpu()) {
      c_n = c_n.to(hx[1].scalar_type());
    }
    return {out, h_n, c_n};
  }
  RnnOptions options{RnnMode::Lstm, has_biases,    num_layers, dropout,
                     train,         bidirectional, batch_first};
  options.lstm_kernel = lstm_kernel(input, hx, params, batch_first);
  if (options.lstm_kernel == LstmKernel::OneDnnInference) {
    if (auto folded = lstm_over_folded_rows(input, hx[0], hx[1], params, options)) {
      return *folded;
    }
  }
  return run_rnn(input, hx[0], hx[1], params, options);
}

template <RnnMode mode>
std::tuple<Tensor, Tensor> routed_rnn(const Tensor& input, const Tensor& hx, TensorList params,
                                      bool has_biases, int64_t num_layers, double dropout,
                                      bool train, bool bidirectional, bool batch_first) {
  if (mode != RnnMode::Gru && autocast_enabled_for(input)) {
    const LowerPrecisionCast cast(input.device().type());
    return routed_rnn<mode>(cast(input), cast(hx), cast_all(cast, params), has_biases, num_layers,
                            dropout, train, bidirectional, batch_first);
  }
  auto [output, h_n, c_n] =
      run_rnn(input, hx, Tensor(), params,
              {mode, has_biases, num_layers, dropout, train, bidirectional, batch_first});
  return {output, h_n};
}

// A cell's dtypes under autocast are eager's: where aten has a policy for
// the cell on the device (lower_precision_fp, CUDA's lists) every operand is
// cast, and so is an RNN cell's everywhere, as its composite is two linears
// and a pointwise op in their dtype; GRU's and LSTM's composites without a
// policy mix the linears' dtype with the state's (layers.cpp).
template <RnnMode mode>
bool cell_in_lower_precision(const Tensor& input) {
  static const AtenAutocasts policy(mode == RnnMode::Lstm      ? "aten::lstm_cell"
                                    : mode == RnnMode::Gru     ? "aten::gru_cell"
                                    : mode == RnnMode::RnnTanh ? "aten::rnn_tanh_cell"
                                                               : "aten::rnn_relu_cell",
                                    "");
  return policy.applies_to(input) ||
         (autocast_enabled_for(input) && (mode == RnnMode::RnnTanh || mode == RnnMode::RnnRelu));
}

std::tuple<Tensor, Tensor> routed_lstm_cell(const Tensor& input, TensorList hx, const Tensor& w_ih,
                                            const Tensor& w_hh, const OptTensor& b_ih,
                                            const OptTensor& b_hh) {
  TORCH_CHECK(hx.size() == 2, "lstm_cell expects two hidden states");  // aten's message
  if (cell_in_lower_precision<RnnMode::Lstm>(input)) {
    const LowerPrecisionCast cast(input.device().type());
    return run_cell(cast(input), cast(hx[0]), cast(hx[1]), cast(w_ih), cast(w_hh), cast(b_ih),
                    cast(b_hh), RnnMode::Lstm);
  }
  return run_cell(input, hx[0], hx[1], w_ih, w_hh, b_ih, b_hh, RnnMode::Lstm);
}

template <RnnMode mode>
Tensor routed_cell(const Tensor& input, const Tensor& hx, const Tensor& w_ih, const Tensor& w_hh,
                   const OptTensor& b_ih, const OptTensor& b_hh) {
  if (cell_in_lower_precision<mode>(input)) {
    const LowerPrecisionCast cast(input.device().type());
    return std::get<0>(run_cell(cast(input), cast(hx), Tensor(), cast(w_ih), cast(w_hh), cast(b_ih),
                                cast(b_hh), mode));
  }
  return std::get<0>(run_cell(input, hx, Tensor(), w_ih, w_hh, b_ih, b_hh, mode));
}

[[noreturn]] void packed_under_vmap(const char* op) {
  TORCH_CHECK(false, "batchrules: ", op,
              " over a PackedSequence cannot be vmapped: a packed batch's layout is data "
              "(batch_sizes), not a dim. Pad the sequences (nn.utils.rnn.pad_packed_sequence "
              "or pad_sequence) and vmap over the padded tensor, masking or selecting each "
              "sample's last valid step.");
}

std::tuple<Tensor, Tensor, Tensor> packed_lstm(const Tensor&, const Tensor&, TensorList, TensorList,
                                               bool, int64_t, double, bool, bool) {
  packed_under_vmap("lstm");
}

template <RnnMode mode>
std::tuple<Tensor, Tensor> packed_rnn(const Tensor&, const Tensor&, const Tensor&, TensorList, bool,
                                      int64_t, double, bool, bool) {
  packed_under_vmap(mode == RnnMode::Gru ? "gru" : "rnn");
}

}  // namespace

void add_recurrent_routes(RouteLibraries& libs) {
  libs.front_mode.impl("lstm.input", TORCH_FN(routed_lstm));
  libs.front_mode.impl("gru.input", TORCH_FN(routed_rnn<RnnMode::Gru>));
  libs.front_mode.impl("rnn_tanh.input", TORCH_FN(routed_rnn<RnnMode::RnnTanh>));
  libs.front_mode.impl("rnn_relu.input", TORCH_FN(routed_rnn<RnnMode::RnnRelu>));
  libs.front_mode.impl("lstm_cell", TORCH_FN(routed_lstm_cell));
  libs.front_mode.impl("gru_cell", TORCH_FN(routed_cell<RnnMode::Gru>));
  libs.front_mode.impl("rnn_tanh_cell", TORCH_FN(routed_cell<RnnMode::RnnTanh>));
  libs.front_mode.impl("rnn_relu_cell", TORCH_FN(routed_cell<RnnMode::RnnRelu>));
  libs.batched.impl("mkldnn_rnn_layer", TORCH_FN(mkldnn_rnn_layer_batched));
  libs.batched.impl("lstm.data", TORCH_FN(packed_lstm));
  libs.batched.impl("gru.data", TORCH_FN(packed_rnn<RnnMode::Gru>));
  libs.batched.impl("rnn_tanh.data", TORCH_FN(packed_rnn<RnnMode::RnnTanh>));
  libs.batched.impl("rnn_relu.data", TORCH_FN(packed_rnn<RnnMode::RnnRelu>));
}

}  // namespace batchrules
