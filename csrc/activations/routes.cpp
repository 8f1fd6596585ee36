// aten::silu and aten::mish (F.silu, nn.SiLU, F.mish, nn.Mish) under
// transforms run batchrules::silu / mish, whose backward is one kernel (see
// Note [Routing aten ops only while transforms are active] and Note [One
// backward kernel per activation]). The in-place aten::silu_ / mish_
// (inplace=True) stay stock.
#include "ops.h"
#include "routing.h"

namespace batchrules {

namespace {

Tensor routed_silu(const Tensor& self) {
  return silu_op().call(self);
}

Tensor routed_mish(const Tensor& self) {
  return mish_op().call(self);
}

}  // namespace

void add_activation_routes(RouteLibraries& libs) {
  libs.front_mode.impl("silu", TORCH_FN(routed_silu));
  libs.front_mode.impl("mish", TORCH_FN(routed_mish));
}

}  // namespace batchrules
