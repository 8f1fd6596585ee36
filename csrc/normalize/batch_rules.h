// The vmap rule of batchrules::normalize, functorch's style:
// (x, x_bdim, ...) -> (out, out_bdim).
#pragma once

#include "common/batching_utils.h"

#include <tuple>

namespace batchrules {

std::tuple<Tensor, std::optional<int64_t>, Tensor, std::optional<int64_t>> normalize_batch_rule(
    const Tensor& x, std::optional<int64_t> x_bdim, at::IntArrayRef normalized_shape, double eps);

}  // namespace batchrules
