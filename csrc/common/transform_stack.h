// What the active torch.func transforms ask of an op.
#pragma once

#include <ATen/functorch/DynamicLayer.h>

#include <algorithm>

namespace batchrules {

// Whether the transform stack holds a jvp level or two grad levels: an op's
// derivative may then itself be differentiated (forward over reverse, reverse
// over reverse). Ops whose backward has no derivative take a decomposition
// there.
inline bool higher_order_transforms() {
  int grad_levels = 0;
  for (const auto& layer : at::functorch::getDynamicLayerStack()) {
    const auto type = layer.key();
    if (type == at::functorch::TransformType::Jvp ||
        (type == at::functorch::TransformType::Grad && ++grad_levels > 1)) {
      return true;
    }
  }
  return false;
}

// Whether a grad level is active.
inline bool inside_grad_transform() {
  const auto& stack = at::functorch::getDynamicLayerStack();
  return std::any_of(stack.begin(), stack.end(), [](const auto& layer) {
    return layer.key() == at::functorch::TransformType::Grad;
  });
}

inline bool inside_transforms() {
  return !at::functorch::getDynamicLayerStack().empty();
}

}  // namespace batchrules
