// The recurrent family's math: one layer, one direction, computed below every
// transform on physical tensors (Note [The grouped recurrence]).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace batchrules {

using at::Tensor;

// Note [The grouped recurrence]
// batchrules::rnn_recurrence is the part of an RNN layer that cannot be one
// GEMM: the loop over time. The input projection x W_ih^T + b_ih of all steps
// is an ordinary linear call made before it (so it gets linear's rules, and
// clipped_grad sees it as a linear use of W_ih). Its operands either have one
// set of weights or a leading group dim E, one set per group:
//   input_gates  T,N,GH   or T,E,N,GH   (x W_ih^T + b_ih for every step)
//   h0           N,P      or E,N,P      (P: proj_size, else H)
//   c0 (LSTM)    N,H      or E,N,H
//   w_hh         GH,P     or E,GH,P     (G gates of H each: 4 LSTM, 3 GRU, 1 RNN)
//   b_hh         GH       or E,GH
//   w_hr (LSTM)  P,H      or E,P,H
// Grouping is what the batching rules use: per-sample inputs with shared
// weights fold the vmap dim into N, batched weights (ensembles) fold it into
// E, and every step is then one bmm over all groups, one kernel call for the
// whole vmap. The math below always works on the grouped form, E = 1 for one
// set of weights, and is written functionally in aten ops: run below
// autograd it is the op's kernel; run above, it is its own differentiable
// decomposition (forward AD, second derivatives).
enum class RnnMode : int64_t { Lstm = 0, Gru = 1, RnnTanh = 2, RnnRelu = 3 };

RnnMode rnn_mode(int64_t mode);

// The states the forward started each step from, in time order: `initial`
// for the first step it ran, else the previous step's entry of `seq` (time
// runs backwards in a reverse layer). seq: T,...; initial: seq's step shape.
Tensor previous_states(const Tensor& initial, const Tensor& seq, bool reverse);

// Note [tanh as a sigmoid]
// tanh(x) = 2 sigmoid(2x) - 1. On the CPU aten's sigmoid is vectorized where
// its tanh is several times slower per element (AVX512 builds), and the
// recurrence kernels evaluate tanh on every step; the three cheap ops cost a
// fraction of it (an absolute error of a few ulps of 1, none near 0 relative
// to the tolerance of the gates). The kernels write it without Scalar
// operands: aten wraps a Scalar as a double tensor and converts it on every
// call (several times a step), so 2x is x + x and the 1 is `one`, a
// 0-dim tensor of t's dtype.
Tensor& tanh_in_place(Tensor& t, const Tensor& one);
Tensor tanh_of(const Tensor& t);
Tensor one_like(const Tensor& t);  // 0-dim 1 of t's dtype and device
// Note [Steps in the input's memory order]
// clipped_grad folds every sample's rows into N and hands the recurrence the
// input projection's rows [B*T, GH], laid out sample by sample, as a
// transposed view [T, B, GH]. The kernels allocate the tensors they fill
// step by step (output and workspace after the input gates, the gradients
// after the output) in that memory order, so that the input gates' gradient
// reaches the projection's rows in their own layout: autograd's view
// backwards then make no transposing copy of it (B 32, T 20, 4H 512: one
// 1.3 MB copy a step). Every step is still a [E, N, *] slice with
// contiguous rows.
// T,E,N,width, in the memory order of like (T,E,N,*): steps inside each row
// where like has them there, else time-major.
Tensor empty_steps(const Tensor& like, int64_t width);

// Note [A step's GEMM]
// The kernels' per-step GEMMs, E,N,K x E,K,M -> E,N,M. With one group (a
// layer's own weights, all samples folded into N) aten's mm is faster than
// bmm of a batch of one, more so without an input to add (baddbmm), so the
// input is left out and the fused cell adds it. W_hh^T stays a view: a
// contiguous copy would speed the mm up by less than the copy costs.
Tensor& group_mm_out(Tensor& out, const Tensor& a, const Tensor& b);
Tensor group_mm(const Tensor& a, const Tensor& b);
int64_t gate_count(RnnMode mode);
// Width of a step's saved state in the workspace (see recurrence_forward).
int64_t workspace_width(RnnMode mode, int64_t hidden, bool projected);

struct RecurrenceOutputs {
  Tensor output;     // T,E,N,P  h of every step, in input time order
  Tensor h_n;        // E,N,P
  Tensor c_n;        // E,N,H (LSTM), else undefined
  Tensor workspace;  // T,E,N,K  what the backward reads (no gradient)
};

// Grouped operands as in Note [The grouped recurrence]. The functional form
// (aten ops, differentiable: the decomposition) and the kernel's, which
// writes into preallocated outputs with out= ops (Note [The recurrence
// kernels]); both give the same values.
RecurrenceOutputs recurrence_forward_kernel(const Tensor& input_gates, const Tensor& h0,
                                            const Tensor& c0, const Tensor& w_hh,
                                            const Tensor& b_hh, const Tensor& w_hr, RnnMode mode,
                                            bool reverse);
RecurrenceOutputs recurrence_forward(const Tensor& input_gates, const Tensor& h0, const Tensor& c0,
                                     const Tensor& w_hh, const Tensor& b_hh, const Tensor& w_hr,
                                     RnnMode mode, bool reverse);

struct RecurrenceGrads {
  Tensor input_gates;   // T,E,N,GH  gradient of input_gates
  Tensor hidden_gates;  // T,E,N,GH  of h W_hh^T + b_hh; undefined where equal (LSTM, RNN)
  Tensor h0;            // E,N,P
  Tensor c0;            // E,N,H (LSTM)
  Tensor projected;     // T,E,N,P  of each step's projected h (LSTM with w_hr)
};

// Backward through time; undefined output gradients count as zeros.
RecurrenceGrads recurrence_backward_kernel(const Tensor& grad_output, const Tensor& grad_h_n,
                                           const Tensor& grad_c_n, const Tensor& h0,
                                           const Tensor& c0, const Tensor& w_hh, const Tensor& w_hr,
                                           const Tensor& output, const Tensor& workspace,
                                           RnnMode mode, bool reverse);
RecurrenceGrads recurrence_backward(const Tensor& grad_output, const Tensor& grad_h_n,
                                    const Tensor& grad_c_n, const Tensor& h0, const Tensor& c0,
                                    const Tensor& w_hh, const Tensor& w_hr, const Tensor& output,
                                    const Tensor& workspace, RnnMode mode, bool reverse);

}  // namespace batchrules
