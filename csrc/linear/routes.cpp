// aten::linear under transforms runs batchrules::linear instead of
// functorch's linear_hack decomposition, and aten::addmm under vmap folds its
// batch into its rows (Note [Folding addmm's batch into its rows]); see Note
// [Routing aten ops only while transforms are active].
#include "linear/batched_kernel.h"
#include "ops.h"
#include "routing.h"

namespace batchrules {

namespace {

Tensor routed_linear(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias) {
  return linear_op().call(input, weight, bias);
}

}  // namespace

void add_linear_routes(RouteLibraries& libs) {
  libs.front_mode.impl("linear", TORCH_FN(routed_linear));
  libs.batched.impl("addmm", TORCH_FN(addmm_batched));
}

}  // namespace batchrules
