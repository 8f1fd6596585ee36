// One set of weights as a group of one: the views between the op's operands
// and the grouped math (Note [The grouped recurrence]).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace batchrules {

struct Grouping {
  bool grouped;
  // T,N,F -> T,1,N,F
  at::Tensor seq(const at::Tensor& t) const { return grouped || !t.defined() ? t : t.unsqueeze(1); }
  at::Tensor seq(const std::optional<at::Tensor>& t) const {
    return t.has_value() ? seq(*t) : at::Tensor();
  }
  // N,F -> 1,N,F and weights *w -> 1,*w
  at::Tensor lead(const at::Tensor& t) const {
    return grouped || !t.defined() ? t : t.unsqueeze(0);
  }
  at::Tensor lead(const std::optional<at::Tensor>& t) const {
    return t.has_value() ? lead(*t) : at::Tensor();
  }
  at::Tensor unseq(const at::Tensor& t) const { return grouped || !t.defined() ? t : t.squeeze(1); }
  at::Tensor unlead(const at::Tensor& t) const {
    return grouped || !t.defined() ? t : t.squeeze(0);
  }
};

}  // namespace batchrules
