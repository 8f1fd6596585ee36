// Input validation of batchrules::rnn_recurrence(_backward), with the
// operands' own (per-example, under vmap) sizes in every message.
#pragma once

#include "recurrent/recurrence.h"

#include <optional>

namespace batchrules {

struct RecurrenceShape {
  bool grouped;                  // a leading group dim E on every operand
  int64_t steps, hidden, state;  // T, H, P
};

RecurrenceShape check_recurrence_shapes(const char* op, const Tensor& input_gates, const Tensor& h0,
                                        const std::optional<Tensor>& c0, const Tensor& w_hh,
                                        const std::optional<Tensor>& b_hh,
                                        const std::optional<Tensor>& w_hr, RnnMode mode);

// The backward's operands: h0, c0, w_hh, w_hr as for the forward, output and
// workspace as the forward returned them, output gradients of their shapes.
RecurrenceShape check_recurrence_backward_shapes(
    const std::optional<Tensor>& grad_output, const std::optional<Tensor>& grad_h_n,
    const std::optional<Tensor>& grad_c_n, const Tensor& h0, const std::optional<Tensor>& c0,
    const Tensor& w_hh, const std::optional<Tensor>& w_hr, const Tensor& output,
    const Tensor& workspace, RnnMode mode);

}  // namespace batchrules
