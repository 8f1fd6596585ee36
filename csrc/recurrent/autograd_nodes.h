// Backward nodes of the recurrent family. See Note [Hand-written autograd nodes].
#pragma once

#include "common/autograd_utils.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <vector>

namespace batchrules {

// Backward of rnn_recurrence(input_gates, h0, c0, w_hh, b_hh, w_hr): one
// rnn_recurrence_backward call for the gate and state gradients; the weight
// gradients are GEMMs over time of those with the saved states, made here as
// aten ops so that vmap batches them (per-sample gradients are one bmm each).
// Where a second derivative may follow (recompute_), a backward that builds
// a graph differentiates the decomposition instead: Note [Recurrent layers
// under higher-order transforms].
struct RnnRecurrenceBackward0 : public torch::autograd::Node {
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  std::string name() const override { return "BatchrulesRnnRecurrenceBackward0"; }
  void release_variables() override;

  torch::autograd::SavedVariable h0_, c0_, w_hh_, w_hr_, output_, workspace_;
  torch::autograd::SavedVariable input_gates_, b_hh_;  // saved only with recompute_
  int64_t mode_ = 0;
  bool reverse_ = false;
  bool recompute_ = false;

 private:
  torch::autograd::variable_list differentiate_decomposition(
      const torch::autograd::variable_list& grads);
};

// Backward of fused_lstm_layer: oneDNN's fused backward, one call.
struct FusedLstmLayerBackward0 : public torch::autograd::Node {
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  std::string name() const override { return "BatchrulesFusedLstmLayerBackward0"; }
  void release_variables() override;

  torch::autograd::SavedVariable input_, w_ih_, w_hh_, b_ih_, b_hh_, h0_, c0_;
  torch::autograd::SavedVariable output_, h_n_, c_n_;
  std::vector<torch::autograd::SavedVariable> workspace_;
  bool reverse_ = false;
};

// Stands for a backward op's own derivative where a transform stack with one
// reverse level only builds the graph and never runs it (functorch's grad
// backpropagates with create_graph=True). See Note [Recurrent layers under
// higher-order transforms].
struct NotDifferentiableTwice : public torch::autograd::Node {
  explicit NotDifferentiableTwice(const char* op) : op_(op) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  std::string name() const override { return "BatchrulesNotDifferentiableTwice"; }

  const char* op_;
};

}  // namespace batchrules
