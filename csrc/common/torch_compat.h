// Differences between the torch releases batchrules builds against.
//
// Every place where an internal of torch changed between supported releases
// goes through this header, so a new release is one file to read and patch.
#pragma once

#include <torch/csrc/autograd/function.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace batchrules {

// Autograd nodes are owned through c10::intrusive_ptr in torch >= 2.13 and
// through std::shared_ptr in older releases (e.g. the 2.11 CUDA builds).
constexpr bool kIntrusiveNodes =
    std::is_base_of_v<c10::intrusive_ptr_target, torch::autograd::Node>;

template <class T>
using NodePtr = std::conditional_t<kIntrusiveNodes, c10::intrusive_ptr<T>, std::shared_ptr<T>>;

template <class T, class... Args>
NodePtr<T> make_node_with(Args&&... args) {
  if constexpr (kIntrusiveNodes) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  } else {
    return std::make_shared<T>(std::forward<Args>(args)...);
  }
}

template <class T>
NodePtr<T> make_node() {
  return make_node_with<T>();
}

// The owning pointer to `node` that SavedVariable::unpack takes for a tensor
// the node saved from its own outputs.
template <class N = torch::autograd::Node>
auto owning_ptr(N* node) {
  if constexpr (kIntrusiveNodes) {
    return c10::intrusive_ptr<N>::reclaim_copy(node);
  } else {
    return node->shared_from_this();
  }
}

}  // namespace batchrules
