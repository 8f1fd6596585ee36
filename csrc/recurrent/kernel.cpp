// Backend kernels (CompositeExplicitAutograd) of the recurrent family: the
// math of forward_kernel.cpp / backward_kernel.cpp below autograd. It runs in its operands'
// dtype: the routes apply the autocast policy before the op, as aten's fused
// RNN kernels have it applied before them.
#include "recurrent/run_recurrence.h"

#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace batchrules {

namespace {

RecurrenceResult rnn_recurrence_kernel(const Tensor& input_gates, const Tensor& h0,
                                       const OptTensor& c0, const Tensor& w_hh,
                                       const OptTensor& b_hh, const OptTensor& w_hr, int64_t mode,
                                       bool reverse) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return run_recurrence(input_gates, h0, c0, w_hh, b_hh, w_hr, mode, reverse,
                        RecurrenceMath::Kernel);
}

RecurrenceGradsResult rnn_recurrence_backward_kernel(
    const OptTensor& grad_output, const OptTensor& grad_h_n, const OptTensor& grad_c_n,
    const Tensor& h0, const OptTensor& c0, const Tensor& w_hh, const OptTensor& w_hr,
    const Tensor& output, const Tensor& workspace, int64_t mode, bool reverse) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return run_recurrence_backward(grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output,
                                 workspace, mode, reverse, RecurrenceMath::Kernel);
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, CompositeExplicitAutograd, m) {
  m.impl("rnn_recurrence", TORCH_FN(rnn_recurrence_kernel));
  m.impl("rnn_recurrence_backward", TORCH_FN(rnn_recurrence_backward_kernel));
}

}  // namespace batchrules
