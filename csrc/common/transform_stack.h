// What the active torch.func transforms ask of an op.
#pragma once

#include <ATen/functorch/DynamicLayer.h>

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

// Whether a grad or jvp level is active.
inline bool inside_reverse_or_forward_ad() {
  for (const auto& layer : at::functorch::getDynamicLayerStack()) {
    const auto type = layer.key();
    if (type == at::functorch::TransformType::Grad || type == at::functorch::TransformType::Jvp) {
      return true;
    }
  }
  return false;
}

inline bool inside_transforms() {
  return !at::functorch::getDynamicLayerStack().empty();
}

}  // namespace batchrules
