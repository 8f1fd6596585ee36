#include "recurrent/run_recurrence.h"

#include "recurrent/grouping.h"
#include "recurrent/recurrence.h"
#include "recurrent/shape_checks.h"

namespace batchrules {

RecurrenceResult run_recurrence(const Tensor& input_gates, const Tensor& h0, const OptTensor& c0,
                                const Tensor& w_hh, const OptTensor& b_hh, const OptTensor& w_hr,
                                int64_t mode, bool reverse, RecurrenceMath math) {
  const RnnMode m = rnn_mode(mode);
  const Grouping g{
      check_recurrence_shapes("batchrules.rnn_recurrence", input_gates, h0, c0, w_hh, b_hh, w_hr, m)
          .grouped};
  const auto forward =
      math == RecurrenceMath::Kernel ? recurrence_forward_kernel : recurrence_forward;
  auto out = forward(g.seq(input_gates), g.lead(h0), g.lead(c0), g.lead(w_hh), g.lead(b_hh),
                     g.lead(w_hr), m, reverse);
  return {g.unseq(out.output), g.unlead(out.h_n), g.unlead(out.c_n), g.unseq(out.workspace)};
}

RecurrenceGradsResult run_recurrence_backward(const OptTensor& grad_output,
                                              const OptTensor& grad_h_n, const OptTensor& grad_c_n,
                                              const Tensor& h0, const OptTensor& c0,
                                              const Tensor& w_hh, const OptTensor& w_hr,
                                              const Tensor& output, const Tensor& workspace,
                                              int64_t mode, bool reverse, RecurrenceMath math) {
  const RnnMode m = rnn_mode(mode);
  const Grouping g{check_recurrence_backward_shapes(grad_output, grad_h_n, grad_c_n, h0, c0, w_hh,
                                                    w_hr, output, workspace, m)
                       .grouped};
  const auto backward =
      math == RecurrenceMath::Kernel ? recurrence_backward_kernel : recurrence_backward;
  auto grads =
      backward(g.seq(grad_output), g.lead(grad_h_n), g.lead(grad_c_n), g.lead(h0), g.lead(c0),
               g.lead(w_hh), g.lead(w_hr), g.seq(output), g.seq(workspace), m, reverse);
  return {g.unseq(grads.input_gates), g.unseq(grads.hidden_gates), g.unlead(grads.h0),
          g.unlead(grads.c0), g.unseq(grads.projected)};
}

}  // namespace batchrules
