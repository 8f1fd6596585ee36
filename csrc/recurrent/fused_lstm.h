// oneDNN's LSTM layer as routing uses it (Note [oneDNN's LSTM layer under
// transforms], layers.cpp).
#pragma once

#include <cstdint>

namespace batchrules {

// oneDNN's LSTM kind (ideep::rnn_kind::LSTM) in aten::mkldnn_rnn_layer.
constexpr int64_t kOneDnnLstm = 2;

}  // namespace batchrules
