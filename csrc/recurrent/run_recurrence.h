// rnn_recurrence and its backward on the op's own (ungrouped or grouped)
// operands: checks, then one of the two maths of Note [The recurrence
// kernels]. The kernels run the out= loops below autograd; everything else
// runs the decomposition, the aten ops of forward.cpp / backward.cpp at the
// caller's level, which autograd, forward AD and functorch see op by op: the
// path for derivatives the op itself does not have (Note [Recurrent layers
// under higher-order transforms]).
#pragma once

#include "ops.h"

namespace batchrules {

// Which math of Note [The recurrence kernels] runs.
enum class RecurrenceMath { Decomposition, Kernel };

RecurrenceResult run_recurrence(const Tensor& input_gates, const Tensor& h0, const OptTensor& c0,
                                const Tensor& w_hh, const OptTensor& b_hh, const OptTensor& w_hr,
                                int64_t mode, bool reverse, RecurrenceMath math);

RecurrenceGradsResult run_recurrence_backward(const OptTensor& grad_output,
                                              const OptTensor& grad_h_n, const OptTensor& grad_c_n,
                                              const Tensor& h0, const OptTensor& c0,
                                              const Tensor& w_hh, const OptTensor& w_hr,
                                              const Tensor& output, const Tensor& workspace,
                                              int64_t mode, bool reverse, RecurrenceMath math);

}  // namespace batchrules
