// rnn_recurrence and its backward as the aten ops of forward.cpp /
// backward.cpp run at the caller's level, so that autograd, forward AD and
// functorch see every op: the path for derivatives the fused ops do not have
// (Note [Recurrent layers under higher-order transforms], routes.cpp).
#pragma once

#include "ops.h"

namespace batchrules {

// Which math of Note [The recurrence kernels] runs.
enum class RecurrenceMath { Decomposition, Kernel };

RecurrenceResult rnn_recurrence_decomposed(
    const Tensor& input_gates, const Tensor& h0, const OptTensor& c0, const Tensor& w_hh,
    const OptTensor& b_hh, const OptTensor& w_hr, int64_t mode, bool reverse,
    RecurrenceMath math = RecurrenceMath::Decomposition);

RecurrenceGradsResult rnn_recurrence_backward_decomposed(
    const OptTensor& grad_output, const OptTensor& grad_h_n, const OptTensor& grad_c_n,
    const Tensor& h0, const OptTensor& c0, const Tensor& w_hh, const OptTensor& w_hr,
    const Tensor& output, const Tensor& workspace, int64_t mode, bool reverse,
    RecurrenceMath math = RecurrenceMath::Decomposition);

}  // namespace batchrules
