// Autograd-key kernels of the linear family: explicit backward and
// forward-mode formulas. See Note [Hand-written autograd nodes].
#include "linear/autograd_nodes.h"
#include "ops.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

namespace batchrules {

namespace {

using torch::autograd::SavedVariable;

// Does linear_backward's grad_bias (grad_output summed over leading dims)
// already have the bias's shape?
bool bias_matches_op_grad(const Tensor& weight, const Tensor& bias) {
  if (weight.dim() == 1) {
    return bias.dim() == 0;
  }
  return bias.dim() == 1 && bias.sym_size(0) == weight.sym_size(0);
}

Tensor linear_autograd(c10::DispatchKeySet ks, const Tensor& input, const Tensor& weight,
                       const std::optional<Tensor>& bias_opt) {
  const Tensor bias = bias_opt.has_value() ? *bias_opt : Tensor();
  const bool has_bias = bias.defined();

  NodePtr<LinearBackward0> grad_fn;
  if (torch::autograd::compute_requires_grad(input, weight, bias)) {
    grad_fn = make_node<LinearBackward0>();
    grad_fn->set_next_edges(has_bias ? torch::autograd::collect_next_edges(input, weight, bias)
                                     : torch::autograd::collect_next_edges(input, weight));
    grad_fn->input_ = SavedVariable(input, /*is_output=*/false);
    grad_fn->weight_ = SavedVariable(weight, /*is_output=*/false);
    grad_fn->has_bias_ = has_bias;
    if (has_bias && !bias_matches_op_grad(weight, bias)) {
      grad_fn->bias_sum_to_ = bias.sym_sizes().vec();
    }
  }

  Tensor result;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    result = linear_op().redispatch(ks & c10::after_autograd_keyset, input, weight,
                                    has_bias ? bias_opt : std::nullopt);
  }
  if (grad_fn) {
    torch::autograd::set_history(result, grad_fn);
  }

  // Forward AD. linear is bilinear in (input, weight), so
  //   d out = linear(dx, W) + linear(x, dW) + db
  // The bias tangent rides on the first linear call so it broadcasts exactly
  // as the primal bias does.
  const Tensor dx = tangent(input), dw = tangent(weight), db = tangent(bias);
  if (dx.defined() || dw.defined() || db.defined()) {
    const Tensor x = primal(input), w = primal(weight);
    std::optional<Tensor> db_pending = db.defined() ? std::optional<Tensor>(db) : std::nullopt;
    Tensor t;
    if (dx.defined()) {
      t = dispatch_linear(dx, w, db_pending);
      db_pending.reset();
    }
    if (dw.defined()) {
      t = add_defined(t, dispatch_linear(x, dw, db_pending));
      db_pending.reset();
    }
    if (db_pending.has_value()) {
      t = at::zeros_like(result).add(*db_pending).view_symint(result.sym_sizes());
    }
    result._set_fw_grad(t, /*level=*/0, /*is_inplace_op=*/false);
  }
  return result;
}

TensorTriple linear_backward_autograd(c10::DispatchKeySet ks, const Tensor& self,
                                      const Tensor& grad_output, const Tensor& weight,
                                      std::array<bool, 3> output_mask) {
  NodePtr<LinearBackwardBackward0> grad_fn;
  if (torch::autograd::compute_requires_grad(self, grad_output, weight)) {
    grad_fn = make_node<LinearBackwardBackward0>();
    grad_fn->set_next_edges(torch::autograd::collect_next_edges(self, grad_output, weight));
    grad_fn->self_ = SavedVariable(self, /*is_output=*/false);
    grad_fn->grad_output_ = SavedVariable(grad_output, /*is_output=*/false);
    grad_fn->weight_ = SavedVariable(weight, /*is_output=*/false);
  }

  TensorTriple result;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    result = linear_backward_op().redispatch(ks & c10::after_autograd_keyset, self, grad_output,
                                             weight, output_mask);
  }
  auto& [grad_input, grad_weight, grad_bias] = result;
  if (grad_fn) {
    torch::autograd::set_history({grad_input, grad_weight, grad_bias}, grad_fn);
  }

  // Forward AD. gi = g conj(W), gW = g^T conj(x), gb = sum(g) are bilinear:
  //   d gi = dg conj(W) + g conj(dW)      d gW = dg^T conj(x) + g^T conj(dx)
  //   d gb = sum(dg)
  // The dg terms are one linear_backward call with the primal x and W; the
  // others one call with (dx, g, dW), each output only where its tangent exists.
  const Tensor dx = tangent(self), dg = tangent(grad_output), dw = tangent(weight);
  if (dx.defined() || dg.defined() || dw.defined()) {
    const Tensor x = primal(self), g = primal(grad_output), w = primal(weight);
    TensorTriple t;
    if (dg.defined()) {
      t = dispatch_linear_backward(x, dg, w, output_mask);
    }
    const std::array<bool, 3> cross_mask = {output_mask[0] && dw.defined(),
                                            output_mask[1] && dx.defined(), false};
    if (cross_mask[0] || cross_mask[1]) {
      // Only shapes are read from the placeholder operands of unmasked outputs.
      auto [ti, tw, tb] =
          dispatch_linear_backward(dx.defined() ? dx : x, g, dw.defined() ? dw : w, cross_mask);
      std::get<0>(t) = add_defined(std::get<0>(t), ti);
      std::get<1>(t) = add_defined(std::get<1>(t), tw);
    }
    const std::array<Tensor*, 3> outs = {&grad_input, &grad_weight, &grad_bias};
    const std::array<Tensor, 3> tangents = {std::get<0>(t), std::get<1>(t), std::get<2>(t)};
    for (size_t i = 0; i < 3; ++i) {
      if (outs[i]->defined() && tangents[i].defined()) {
        outs[i]->_set_fw_grad(tangents[i], /*level=*/0, /*is_inplace_op=*/false);
      }
    }
  }
  return result;
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, Autograd, m) {
  m.impl("linear", TORCH_FN(linear_autograd));
  m.impl("linear_backward", TORCH_FN(linear_backward_autograd));
}

}  // namespace batchrules
