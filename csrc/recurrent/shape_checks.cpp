#include "recurrent/shape_checks.h"

#include <c10/util/Exception.h>

#include <vector>

namespace batchrules {

namespace {

bool given(const std::optional<Tensor>& t) {
  return t.has_value() && t->defined();
}

// `t` must have exactly `expected` sizes, with the group dim E in front when
// grouped; `layout` names the dims for the message ("T, N, G*H").
void check_sizes(const char* op, const char* name, const Tensor& t, bool grouped, int64_t groups,
                 std::vector<int64_t> expected, const char* layout) {
  if (grouped) {
    expected.insert(expected.begin(), groups);
  }
  TORCH_CHECK(t.sizes() == c10::IntArrayRef(expected), op, ": expected ", name, " of shape ",
              c10::IntArrayRef(expected), " ([", grouped ? "E, " : "", layout, "]), but got ",
              t.sizes());
}

void check_like(const char* op, const char* name, const Tensor& t, const Tensor& ref) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type() && t.device() == ref.device(), op, ": expected ",
              name, " to have the dtype and device of w_hh (", ref.scalar_type(), " on ",
              ref.device(), "), but got ", t.scalar_type(), " on ", t.device());
}

struct Weights {
  bool grouped;
  int64_t groups, hidden, state;
};

Weights check_weights(const char* op, const Tensor& h0, const std::optional<Tensor>& c0,
                      const Tensor& w_hh, const std::optional<Tensor>& b_hh,
                      const std::optional<Tensor>& w_hr, RnnMode mode) {
  TORCH_CHECK(w_hh.dim() == 2 || w_hh.dim() == 3, op,
              ": expected w_hh of shape [G*H, P] or [E, G*H, P], but got ", w_hh.sizes());
  const bool grouped = w_hh.dim() == 3;
  const int64_t groups = grouped ? w_hh.size(0) : 1;
  const int64_t gates = gate_count(mode);
  const int64_t gh = w_hh.size(-2), state = w_hh.size(-1);
  TORCH_CHECK(gh % gates == 0, op, ": expected w_hh's rows to be ", gates,
              " gates of the hidden size, but got w_hh of shape ", w_hh.sizes());
  const int64_t hidden = gh / gates;
  TORCH_CHECK(h0.dim() == 2 + grouped, op, ": expected h0 of shape [", grouped ? "E, " : "",
              "N, P], but got ", h0.sizes());
  const int64_t batch = h0.size(-2);
  check_sizes(op, "h0", h0, grouped, groups, {batch, state}, "N, P");
  check_like(op, "h0", h0, w_hh);
  if (given(b_hh)) {
    check_sizes(op, "b_hh", *b_hh, grouped, groups, {gh}, "G*H");
    check_like(op, "b_hh", *b_hh, w_hh);
  }
  const bool lstm = mode == RnnMode::Lstm;
  TORCH_CHECK(lstm || (!given(c0) && !given(w_hr)), op,
              ": c0 and w_hr are LSTM operands, but mode is not LSTM");
  if (lstm) {
    TORCH_CHECK(given(c0), op, ": LSTM expects c0");
    check_sizes(op, "c0", *c0, grouped, groups, {batch, hidden}, "N, H");
    check_like(op, "c0", *c0, w_hh);
  }
  if (given(w_hr)) {
    check_sizes(op, "w_hr", *w_hr, grouped, groups, {state, hidden}, "P, H");
    check_like(op, "w_hr", *w_hr, w_hh);
  } else {
    TORCH_CHECK(state == hidden, op, ": expected w_hh of shape [", gates * hidden, ", ", hidden,
                "] without w_hr, but got ", w_hh.sizes());
  }
  return {grouped, groups, hidden, state};
}

}  // namespace

RecurrenceShape check_recurrence_shapes(const char* op, const Tensor& input_gates, const Tensor& h0,
                                        const std::optional<Tensor>& c0, const Tensor& w_hh,
                                        const std::optional<Tensor>& b_hh,
                                        const std::optional<Tensor>& w_hr, RnnMode mode) {
  const auto w = check_weights(op, h0, c0, w_hh, b_hh, w_hr, mode);
  TORCH_CHECK(input_gates.dim() == 3 + w.grouped, op, ": expected input_gates of shape [T, ",
              w.grouped ? "E, " : "", "N, G*H], but got ", input_gates.sizes());
  const int64_t steps = input_gates.size(0);
  std::vector<int64_t> expected = {steps, h0.size(-2), w_hh.size(-2)};
  if (w.grouped) {
    expected.insert(expected.begin() + 1, w.groups);
  }
  TORCH_CHECK(input_gates.sizes() == c10::IntArrayRef(expected), op,
              ": expected input_gates of shape ", c10::IntArrayRef(expected), " ([T, ",
              w.grouped ? "E, " : "", "N, G*H] with N from h0 ", h0.sizes(), " and G*H from w_hh ",
              w_hh.sizes(), "), but got ", input_gates.sizes());
  check_like(op, "input_gates", input_gates, w_hh);
  return {w.grouped, steps, w.hidden, w.state};
}

RecurrenceShape check_recurrence_backward_shapes(
    const std::optional<Tensor>& grad_output, const std::optional<Tensor>& grad_h_n,
    const std::optional<Tensor>& grad_c_n, const Tensor& h0, const std::optional<Tensor>& c0,
    const Tensor& w_hh, const std::optional<Tensor>& w_hr, const Tensor& output,
    const Tensor& workspace, RnnMode mode) {
  constexpr const char* op = "batchrules.rnn_recurrence_backward";
  const auto w = check_weights(op, h0, c0, w_hh, std::nullopt, w_hr, mode);
  TORCH_CHECK(output.dim() == 3 + w.grouped, op, ": expected output of shape [T, ",
              w.grouped ? "E, " : "", "N, P], but got ", output.sizes());
  const int64_t steps = output.size(0), batch = h0.size(-2);
  const auto seq = [&](int64_t width) {
    std::vector<int64_t> s = {steps, batch, width};
    if (w.grouped) {
      s.insert(s.begin() + 1, w.groups);
    }
    return s;
  };
  const int64_t k = workspace_width(mode, w.hidden, given(w_hr));
  TORCH_CHECK(output.sizes() == c10::IntArrayRef(seq(w.state)) &&
                  workspace.sizes() == c10::IntArrayRef(seq(k)),
              op, ": expected output ", c10::IntArrayRef(seq(w.state)), " and workspace ",
              c10::IntArrayRef(seq(k)), ", but got ", output.sizes(), " and ", workspace.sizes());
  if (given(grad_output)) {
    TORCH_CHECK(grad_output->sizes() == output.sizes(), op, ": expected grad_output of shape ",
                output.sizes(), ", but got ", grad_output->sizes());
  }
  if (given(grad_h_n)) {
    TORCH_CHECK(grad_h_n->sizes() == h0.sizes(), op, ": expected grad_h_n of shape ", h0.sizes(),
                ", but got ", grad_h_n->sizes());
  }
  if (given(grad_c_n)) {
    TORCH_CHECK(given(c0) && grad_c_n->sizes() == c0->sizes(), op,
                ": expected grad_c_n of the shape of c0, but got ", grad_c_n->sizes());
  }
  return {w.grouped, steps, w.hidden, w.state};
}

}  // namespace batchrules
