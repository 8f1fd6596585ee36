// The kernel of batchrules::normalize: a layer norm without affine
// parameters that also returns its inverse deviations, for clipped_grad's
// LayerNorm rule (Note [Normalizing without keeping the input],
// batchrules/dp/layers/layer_norm.py). One kernel for every backend:
// aten's native_layer_norm does the work.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace batchrules {

namespace {

std::tuple<at::Tensor, at::Tensor> normalize_kernel(const at::Tensor& input,
                                                    at::IntArrayRef normalized_shape,
                                                    double eps) {
  auto [normalized, mean, rstd] =
      at::native_layer_norm(input, normalized_shape, std::nullopt, std::nullopt, eps);
  return {normalized, rstd};
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, CompositeExplicitAutograd, m) {
  m.impl("normalize", TORCH_FN(normalize_kernel));
}

}  // namespace batchrules
