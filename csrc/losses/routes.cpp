// The loss family's kernels for aten ops while routing is on (see Note
// [Routing aten ops only while transforms are active]): FuncTorchBatched
// kernels (batched_kernel.h) for the loss ops functorch batches through its
// Python decompositions, and for huber_loss, replacing its rule.
#include "losses/batched_kernel.h"
#include "routing.h"

namespace batchrules {

void add_loss_routes(RouteLibraries& libs) {
  libs.batched.impl("nll_loss_forward", TORCH_FN(nll_loss_forward_batched<NllOp::Nll>));
  libs.batched.impl("nll_loss2d_forward", TORCH_FN(nll_loss_forward_batched<NllOp::Nll2d>));
  libs.batched.impl("nll_loss_backward", TORCH_FN(nll_loss_backward_batched<NllOp::Nll>));
  libs.batched.impl("nll_loss2d_backward", TORCH_FN(nll_loss_backward_batched<NllOp::Nll2d>));
  libs.batched.impl("huber_loss", TORCH_FN(huber_loss_batched));
  libs.batched.impl("mse_loss_backward", TORCH_FN(mse_loss_backward_batched));
  libs.batched.impl("smooth_l1_loss_backward", TORCH_FN(smooth_l1_loss_backward_batched));
  libs.batched.impl("huber_loss_backward", TORCH_FN(huber_loss_backward_batched));
}

}  // namespace batchrules
