// The loss family's kernels for aten ops while routing is on (see Note
// [Routing aten ops only while transforms are active]):
//  - FuncTorchBatched (batched_kernel.h): the loss ops functorch batches
//    through its Python decompositions, and the element-wise losses, replacing
//    their rules;
//  - FuncTorchDynamicLayerFrontMode (autocast.h): the classification losses'
//    composites, for autocast's policies (Note [Autocast policies of the
//    losses under vmap]).
#include "losses/autocast.h"
#include "losses/batched_kernel.h"
#include "routing.h"

namespace batchrules {

void add_loss_routes(RouteLibraries& libs) {
  libs.batched.impl("nll_loss_forward", TORCH_FN(nll_loss_forward_batched<NllOp::Nll>));
  libs.batched.impl("nll_loss2d_forward", TORCH_FN(nll_loss_forward_batched<NllOp::Nll2d>));
  libs.batched.impl("nll_loss_backward", TORCH_FN(nll_loss_backward_batched<NllOp::Nll>));
  libs.batched.impl("nll_loss2d_backward", TORCH_FN(nll_loss_backward_batched<NllOp::Nll2d>));
  libs.batched.impl("mse_loss", TORCH_FN(mse_loss_batched));
  libs.batched.impl("smooth_l1_loss", TORCH_FN(smooth_l1_loss_batched));
  libs.batched.impl("huber_loss", TORCH_FN(huber_loss_batched));
  libs.batched.impl("mse_loss_backward", TORCH_FN(mse_loss_backward_batched));
  libs.batched.impl("smooth_l1_loss_backward", TORCH_FN(smooth_l1_loss_backward_batched));
  libs.batched.impl("huber_loss_backward", TORCH_FN(huber_loss_backward_batched));
  libs.front_mode.impl("log_softmax.int", TORCH_FN(routed_log_softmax));
  libs.front_mode.impl("softmax.int", TORCH_FN(routed_softmax));
  libs.front_mode.impl("nll_loss", TORCH_FN(routed_nll_loss));
  libs.front_mode.impl("nll_loss2d", TORCH_FN(routed_nll_loss2d));
  libs.front_mode.impl("nll_loss_nd", TORCH_FN(routed_nll_loss_nd));
  libs.front_mode.impl("cross_entropy_loss", TORCH_FN(routed_cross_entropy_loss));
}

}  // namespace batchrules
