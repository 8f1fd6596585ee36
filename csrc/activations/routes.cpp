// aten::<act> (F.silu, nn.SiLU, F.mish, nn.Mish, ...) under transforms runs
// batchrules::<act>, whose backward is one kernel (see Note [Routing aten ops
// only while transforms are active] and Note [One backward kernel per
// activation]). The in-place aten::<act>_ (inplace=True) stay stock.
#include "activations/definitions.h"
#include "routing.h"

namespace batchrules {

namespace {

template <const Activation& act>
Tensor routed_activation(const Tensor& self) {
  return act.op().call(self);
}

}  // namespace

void add_activation_routes(RouteLibraries& libs) {
#define BATCHRULES_ROUTE_ACTIVATION(name, Name, ...) \
  libs.front_mode.impl(#name, TORCH_FN(routed_activation<k##Name>));
  BATCHRULES_ACTIVATIONS(BATCHRULES_ROUTE_ACTIVATION)
#undef BATCHRULES_ROUTE_ACTIVATION
}

}  // namespace batchrules
