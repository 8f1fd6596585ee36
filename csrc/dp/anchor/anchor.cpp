// The engine's anchor (Note [Anchored outputs] in batchrules/dp/tape.py): a
// fresh tensor computed without grad gets a node of its own, with no next
// edges, whose backward returns nothing. The gradient reaching the tensor is
// read by the node's pre-hook; nothing is computed from it. Set on the tensor
// itself, not through an op or an autograd.Function: functorch, which may be
// active around the call (the engine's per-call vmap), never sees it.
#include "dp/anchor/anchor.h"

#include "common/torch_compat.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace batchrules {
namespace {

struct AnchorBackward : public torch::autograd::Node {
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    return {};
  }
  std::string name() const override { return "batchrules::AnchorBackward"; }
};

}  // namespace

void anchor(const at::Tensor& out) {
  TORCH_INTERNAL_ASSERT(out.defined() && !out.requires_grad() && !out.is_view(),
                        "anchor: expects a fresh tensor that does not require grad");
  torch::autograd::set_history(out, make_node<AnchorBackward>());
}

}  // namespace batchrules
