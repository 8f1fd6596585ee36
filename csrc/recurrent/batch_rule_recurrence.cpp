// Rules for rnn_recurrence and its backward: one op call with the vmap dim
// folded into the rows or the groups. See Note [Batching the grouped
// recurrence].
#include "ops.h"
#include "recurrent/batch_rules.h"
#include "recurrent/vmap_dims.h"

namespace batchrules {

namespace {

// h0 is (E,)N,P: it gives the logical group and row counts.
BatchPlacement place(const Tensor& h0, OptBdim h0_bdim, bool weights_batched, int64_t batch) {
  const auto sizes = logical_sizes(h0, h0_bdim);
  const bool grouped = sizes.size() == 3;
  const int64_t rows = sizes[grouped ? 1 : 0].expect_int();
  const int64_t groups = grouped ? sizes[0].expect_int() : 1;
  return {weights_batched, grouped, batch, weights_batched ? groups : rows};
}

}  // namespace

std::array<BatchedResult, 4> rnn_recurrence_batch_rule(
    const Tensor& input_gates, OptBdim input_gates_bdim, const Tensor& h0, OptBdim h0_bdim,
    const Tensor& c0, OptBdim c0_bdim, const Tensor& w_hh, OptBdim w_hh_bdim, const Tensor& b_hh,
    OptBdim b_hh_bdim, const Tensor& w_hr, OptBdim w_hr_bdim, int64_t mode, bool reverse) {
  const int64_t batch = vmap_size({{&input_gates, input_gates_bdim},
                                   {&h0, h0_bdim},
                                   {&c0, c0_bdim},
                                   {&w_hh, w_hh_bdim},
                                   {&b_hh, b_hh_bdim},
                                   {&w_hr, w_hr_bdim}})
                            .expect_int();
  const bool weights_batched = w_hh_bdim || b_hh_bdim || w_hr_bdim;
  const BatchPlacement p = place(h0, h0_bdim, weights_batched, batch);
  // rows:   T,(E,)B*N,GH x (E,)GH,P -> T,(E,)B*N,P
  // groups: T,B*E,N,GH x B*E,GH,P -> T,B*E,N,P
  auto [output, h_n, c_n, workspace] =
      rnn_recurrence_op().call(p.seq(input_gates, input_gates_bdim), p.state(h0, h0_bdim),
                               maybe_defined(p.state(c0, c0_bdim)), p.weight(w_hh, w_hh_bdim),
                               maybe_defined(p.weight(b_hh, b_hh_bdim)),
                               maybe_defined(p.weight(w_hr, w_hr_bdim)), mode, reverse);
  return {p.seq_out(output), p.state_out(h_n), p.state_out(c_n), p.seq_out(workspace)};
}

std::array<BatchedResult, 5> rnn_recurrence_backward_batch_rule(
    const Tensor& grad_output, OptBdim grad_output_bdim, const Tensor& grad_h_n,
    OptBdim grad_h_n_bdim, const Tensor& grad_c_n, OptBdim grad_c_n_bdim, const Tensor& h0,
    OptBdim h0_bdim, const Tensor& c0, OptBdim c0_bdim, const Tensor& w_hh, OptBdim w_hh_bdim,
    const Tensor& w_hr, OptBdim w_hr_bdim, const Tensor& output, OptBdim output_bdim,
    const Tensor& workspace, OptBdim workspace_bdim, int64_t mode, bool reverse) {
  const int64_t batch = vmap_size({{&grad_output, grad_output_bdim},
                                   {&grad_h_n, grad_h_n_bdim},
                                   {&grad_c_n, grad_c_n_bdim},
                                   {&h0, h0_bdim},
                                   {&c0, c0_bdim},
                                   {&w_hh, w_hh_bdim},
                                   {&w_hr, w_hr_bdim},
                                   {&output, output_bdim},
                                   {&workspace, workspace_bdim}})
                            .expect_int();
  const bool weights_batched = w_hh_bdim || w_hr_bdim;
  const BatchPlacement p = place(h0, h0_bdim, weights_batched, batch);
  auto [d_input, d_hidden, d_h0, d_c0, d_projected] = rnn_recurrence_backward_op().call(
      maybe_defined(p.seq(grad_output, grad_output_bdim)),
      maybe_defined(p.state(grad_h_n, grad_h_n_bdim)),
      maybe_defined(p.state(grad_c_n, grad_c_n_bdim)), p.state(h0, h0_bdim),
      maybe_defined(p.state(c0, c0_bdim)), p.weight(w_hh, w_hh_bdim),
      maybe_defined(p.weight(w_hr, w_hr_bdim)), p.seq(output, output_bdim),
      p.seq(workspace, workspace_bdim), mode, reverse);
  return {p.seq_out(d_input), p.seq_out(d_hidden), p.state_out(d_h0), p.state_out(d_c0),
          p.seq_out(d_projected)};
}

}  // namespace batchrules
