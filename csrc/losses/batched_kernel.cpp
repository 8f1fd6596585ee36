// See batched_kernel.h. Each kernel falls through to the aten op when nothing
// is batched at the current level.
#include "losses/batched_kernel.h"

#include "common/autocast.h"
#include "common/vmap_plumbing.h"
#include "losses/batch_rules.h"

#include <ATen/ATen.h>

#include <array>

namespace batchrules {

namespace {

Tensor pointwise_loss_backward_plumbing(PointwiseLoss loss, const char* name,
                                        const Tensor& grad_output, const Tensor& self,
                                        const Tensor& target, int64_t reduction, double param) {
  const BatchedKernelScope scope(name);
  const int64_t level = scope.level();
  if (!any_batched_at(level, grad_output, self, target)) {
    switch (loss) {
      case PointwiseLoss::Mse: return at::mse_loss_backward(grad_output, self, target, reduction);
      case PointwiseLoss::SmoothL1:
        return at::smooth_l1_loss_backward(grad_output, self, target, reduction, param);
      case PointwiseLoss::Huber:
        return at::huber_loss_backward(grad_output, self, target, reduction, param);
    }
  }
  auto [g, g_bdim] = unwrap_at(grad_output, level);
  auto [x, x_bdim] = unwrap_at(self, level);
  auto [t, t_bdim] = unwrap_at(target, level);
  auto [gi, gi_bdim] =
      pointwise_loss_backward_batch_rule(loss, g, g_bdim, x, x_bdim, t, t_bdim, reduction, param);
  return wrap_at(gi, gi_bdim, level);
}

// See Note [Autocast under vmap]: the losses' policy is fp32.
Tensor pointwise_loss_plumbing(PointwiseLoss loss, const char* name, const Tensor& self,
                               const Tensor& target, int64_t reduction, double param) {
  static const std::array<AtenAutocasts, 3> policies = {AtenAutocasts("aten::mse_loss", ""),
                                                        AtenAutocasts("aten::smooth_l1_loss", ""),
                                                        AtenAutocasts("aten::huber_loss", "")};
  if (policies[static_cast<size_t>(loss)].applies_to(self)) {
    const Fp32Cast cast(self.device().type());
    return pointwise_loss(loss, cast(self), cast(target), reduction, param);
  }
  const BatchedKernelScope scope(name);
  const int64_t level = scope.level();
  if (!any_batched_at(level, self, target)) {
    return pointwise_loss(loss, self, target, reduction, param);
  }
  auto [x, x_bdim] = unwrap_at(self, level);
  auto [t, t_bdim] = unwrap_at(target, level);
  auto [out, out_bdim] = pointwise_loss_batch_rule(loss, x, x_bdim, t, t_bdim, reduction, param);
  return wrap_at(out, out_bdim, level);
}

}  // namespace

template <NllOp op>
std::tuple<Tensor, Tensor> nll_loss_forward_batched(const Tensor& self, const Tensor& target,
                                                    const std::optional<Tensor>& weight,
                                                    int64_t reduction, c10::SymInt ignore_index) {
  const BatchedKernelScope scope(op == NllOp::Nll2d ? "nll_loss2d_forward" : "nll_loss_forward");
  const int64_t level = scope.level();
  if (!any_batched_at(level, self, target, weight)) {
    return op == NllOp::Nll2d
               ? at::nll_loss2d_forward_symint(self, target, weight, reduction, ignore_index)
               : at::nll_loss_forward_symint(self, target, weight, reduction, ignore_index);
  }
  auto [x, x_bdim] = unwrap_at(self, level);
  auto [t, t_bdim] = unwrap_at(target, level);
  auto [w, w_bdim] = unwrap_at(weight, level);
  auto [out, out_bdim, total, total_bdim] =
      nll_loss_forward_batch_rule(op, x, x_bdim, t, t_bdim, w, w_bdim, reduction, ignore_index);
  return {wrap_at(out, out_bdim, level), wrap_at(total, total_bdim, level)};
}

template <NllOp op>
Tensor nll_loss_backward_batched(const Tensor& grad_output, const Tensor& self,
                                 const Tensor& target, const std::optional<Tensor>& weight,
                                 int64_t reduction, c10::SymInt ignore_index,
                                 const Tensor& total_weight) {
  const BatchedKernelScope scope(op == NllOp::Nll2d ? "nll_loss2d_backward" : "nll_loss_backward");
  const int64_t level = scope.level();
  if (!any_batched_at(level, grad_output, self, target, weight, total_weight)) {
    return op == NllOp::Nll2d
               ? at::nll_loss2d_backward_symint(grad_output, self, target, weight, reduction,
                                                ignore_index, total_weight)
               : at::nll_loss_backward_symint(grad_output, self, target, weight, reduction,
                                              ignore_index, total_weight);
  }
  auto [g, g_bdim] = unwrap_at(grad_output, level);
  auto [x, x_bdim] = unwrap_at(self, level);
  auto [t, t_bdim] = unwrap_at(target, level);
  auto [w, w_bdim] = unwrap_at(weight, level);
  auto [tw, tw_bdim] = unwrap_at(total_weight, level);
  auto [gi, gi_bdim] = nll_loss_backward_batch_rule(op, g, g_bdim, x, x_bdim, t, t_bdim, w, w_bdim,
                                                    reduction, ignore_index, tw, tw_bdim);
  return wrap_at(gi, gi_bdim, level);
}

template std::tuple<Tensor, Tensor> nll_loss_forward_batched<NllOp::Nll>(
    const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t, c10::SymInt);
template std::tuple<Tensor, Tensor> nll_loss_forward_batched<NllOp::Nll2d>(
    const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t, c10::SymInt);
template Tensor nll_loss_backward_batched<NllOp::Nll>(const Tensor&, const Tensor&, const Tensor&,
                                                      const std::optional<Tensor>&, int64_t,
                                                      c10::SymInt, const Tensor&);
template Tensor nll_loss_backward_batched<NllOp::Nll2d>(const Tensor&, const Tensor&, const Tensor&,
                                                        const std::optional<Tensor>&, int64_t,
                                                        c10::SymInt, const Tensor&);

Tensor mse_loss_batched(const Tensor& self, const Tensor& target, int64_t reduction) {
  return pointwise_loss_plumbing(PointwiseLoss::Mse, "mse_loss", self, target, reduction, 0.0);
}

Tensor smooth_l1_loss_batched(const Tensor& self, const Tensor& target, int64_t reduction,
                              double beta) {
  return pointwise_loss_plumbing(PointwiseLoss::SmoothL1, "smooth_l1_loss", self, target, reduction,
                                 beta);
}

Tensor huber_loss_batched(const Tensor& self, const Tensor& target, int64_t reduction,
                          double delta) {
  return pointwise_loss_plumbing(PointwiseLoss::Huber, "huber_loss", self, target, reduction,
                                 delta);
}

Tensor mse_loss_backward_batched(const Tensor& grad_output, const Tensor& self,
                                 const Tensor& target, int64_t reduction) {
  return pointwise_loss_backward_plumbing(PointwiseLoss::Mse, "mse_loss_backward", grad_output,
                                          self, target, reduction, 0.0);
}

Tensor smooth_l1_loss_backward_batched(const Tensor& grad_output, const Tensor& self,
                                       const Tensor& target, int64_t reduction, double beta) {
  return pointwise_loss_backward_plumbing(PointwiseLoss::SmoothL1, "smooth_l1_loss_backward",
                                          grad_output, self, target, reduction, beta);
}

Tensor huber_loss_backward_batched(const Tensor& grad_output, const Tensor& self,
                                   const Tensor& target, int64_t reduction, double delta) {
  return pointwise_loss_backward_plumbing(PointwiseLoss::Huber, "huber_loss_backward", grad_output,
                                          self, target, reduction, delta);
}

}  // namespace batchrules
