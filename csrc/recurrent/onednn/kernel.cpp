// CPU kernels of batchrules::fused_lstm_layer and its backward: oneDNN's LSTM
// layer and its fused backward, as aten runs them for an eager nn.LSTM, and
// the forward call routing also makes where nothing is differentiated
// (onednn_lstm_forward). See Note [oneDNN's LSTM layer under transforms]
// (onednn/kernel_choice.cpp).
#include "ops.h"
#include "recurrent/onednn/layer.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

namespace batchrules {

namespace {

// oneDNN's LSTM kind (ideep::rnn_kind::LSTM) in aten::mkldnn_rnn_layer.
constexpr int64_t kOneDnnLstm = 2;

struct OneDnnBiases {
  Tensor ih, hh;
  bool given;
};

// oneDNN takes zeros for absent biases.
OneDnnBiases onednn_biases(const OptTensor& b_ih, const OptTensor& b_hh, const Tensor& w_hh) {
  const bool given = b_ih.has_value() && b_ih->defined();
  const auto zeros = [&] { return at::zeros({w_hh.size(0)}, w_hh.options()); };
  return {given ? *b_ih : zeros(), given ? *b_hh : zeros(), given};
}

void check_fused_operands(const Tensor& input, const Tensor& w_hh, const OptTensor& b_ih,
                          const OptTensor& b_hh) {
  TORCH_CHECK(input.dim() == 3 && input.device().is_cpu() && input.scalar_type() == at::kFloat,
              "batchrules.fused_lstm_layer: expected a float32 CPU input of shape [T, N, I], "
              "but got ",
              input.scalar_type(), " on ", input.device(), " of shape ", input.sizes());
  TORCH_CHECK((b_ih.has_value() && b_ih->defined()) == (b_hh.has_value() && b_hh->defined()),
              "batchrules.fused_lstm_layer: expected both biases or neither");
  TORCH_CHECK(w_hh.dim() == 2 && w_hh.size(0) == 4 * w_hh.size(1),
              "batchrules.fused_lstm_layer: expected w_hh of shape [4*H, H], but got ",
              w_hh.sizes());
}

FusedLstmResult fused_lstm_layer_cpu(const Tensor& input, const Tensor& w_ih, const Tensor& w_hh,
                                     const OptTensor& b_ih, const OptTensor& b_hh, const Tensor& h0,
                                     const Tensor& c0, bool reverse) {
  check_fused_operands(input, w_hh, b_ih, b_hh);
  const at::AutoGradMode training(true);  // for the workspace the backward reads
  auto [out, h_n, c_n, workspace] =
      onednn_lstm_forward(input, w_ih, w_hh, b_ih, b_hh, h0, c0, reverse, /*train=*/true);
  return {out, h_n, c_n, {workspace}};
}

FusedLstmGradsResult fused_lstm_layer_backward_cpu(
    const Tensor& input, const Tensor& w_ih, const Tensor& w_hh, const OptTensor& b_ih,
    const OptTensor& b_hh, const Tensor& h0, const Tensor& c0, const Tensor& output,
    const Tensor& h_n, const Tensor& c_n, const OptTensor& grad_output, const OptTensor& grad_h_n,
    const OptTensor& grad_c_n, at::TensorList workspace, bool reverse) {
  check_fused_operands(input, w_hh, b_ih, b_hh);
  TORCH_CHECK(workspace.size() == 1,
              "batchrules.fused_lstm_layer_backward: expected the "
              "workspace list of one fused_lstm_layer call (1 entry), but got ",
              workspace.size(), " entries");
  const OneDnnBiases b = onednn_biases(b_ih, b_hh, w_hh);
  auto [dx, dw_ih, dw_hh, db_ih, db_hh, dh0, dc0] = at::mkldnn_rnn_layer_backward(
      input.contiguous(), w_ih, w_hh, b.ih, b.hh, h0.contiguous(), c0.contiguous(), output, h_n,
      c_n, grad_output, grad_h_n, grad_c_n, reverse, kOneDnnLstm, w_hh.size(1), 1, b.given,
      /*train=*/true, /*bidirectional=*/false, {}, /*batch_first=*/false, workspace[0]);
  if (!b.given) {
    return {dx, dw_ih, dw_hh, Tensor(), Tensor(), dh0, dc0};
  }
  // oneDNN returns one tensor for both biases' (equal) gradients.
  return {dx, dw_ih, dw_hh, db_ih, db_hh.clone(), dh0, dc0};
}

}  // namespace

RecurrenceResult onednn_lstm_forward(const Tensor& x, const Tensor& w_ih, const Tensor& w_hh,
                                     const OptTensor& b_ih, const OptTensor& b_hh, const Tensor& h0,
                                     const Tensor& c0, bool reverse, bool train) {
  const OneDnnBiases b = onednn_biases(b_ih, b_hh, w_hh);
  auto [out, hy, cy, ws] = at::mkldnn_rnn_layer(
      x.contiguous(), w_ih, w_hh, b.ih, b.hh, h0.contiguous(), c0.contiguous(), reverse, {},
      kOneDnnLstm, w_hh.size(1), /*num_layers=*/1, b.given, /*bidirectional=*/false,
      /*batch_first=*/false, train);
  return {out, hy, cy, ws};
}

TORCH_LIBRARY_IMPL(batchrules, CPU, m) {
  m.impl("fused_lstm_layer", TORCH_FN(fused_lstm_layer_cpu));
  m.impl("fused_lstm_layer_backward", TORCH_FN(fused_lstm_layer_backward_cpu));
}

}  // namespace batchrules
