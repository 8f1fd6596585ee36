// The attention family's kernels for aten ops while routing is on (see Note
// [Routing aten ops only while transforms are active]):
//  - FuncTorchBatched: batching rules for the fused kernels functorch runs
//    through its per-example fallback (CPU flash forward and backward, the
//    CUDA backwards), and for the CUDA efficient/cudnn forwards, whose
//    functorch rules mis-fold a batched bias (batch_rule_cuda_forward.cpp);
//  - FuncTorchDynamicLayerFrontMode: aten::scaled_dot_product_attention.
//
// Note [Fused attention under forward-mode and higher-order transforms]
// The fused kernels have a backward but no forward-mode formula, and their
// backwards have no derivative: stock jvp/jacfwd/hessian of SDPA and any
// second derivative through it raise once SDPA picks a fused kernel. Inside
// transforms whose stack holds a jvp level or two grad levels, the route runs
// SDPA's math composite instead (matmul, softmax: every order of derivative,
// batched by functorch's rules); elsewhere it runs SDPA's own composite, which
// picks the fused kernel, so first-order flows keep the fused kernels. The
// route runs before any transform layer, as functorch's own decompositions at
// this key do.
#include "attention/batched_kernel.h"
#include "common/autocast.h"
#include "common/transform_stack.h"
#include "routing.h"

#include <ATen/ops/_scaled_dot_product_attention_math.h>
#include <ATen/ops/scaled_dot_product_attention_native.h>
#include <ATen/ops/zeros_like.h>

#include <limits>

namespace batchrules {

namespace {

// SDPA's meaning of a bool mask (True takes part) as the additive mask the
// math composite takes.
std::optional<Tensor> additive_mask(const std::optional<Tensor>& mask, const Tensor& query) {
  if (!mask.has_value() || !mask->defined() || mask->scalar_type() != at::kBool) {
    return mask;
  }
  return at::zeros_like(*mask, query.options())
      .masked_fill(mask->logical_not(), -std::numeric_limits<double>::infinity());
}

Tensor routed_scaled_dot_product_attention(const Tensor& query, const Tensor& key,
                                           const Tensor& value,
                                           const std::optional<Tensor>& attn_mask, double dropout_p,
                                           bool is_causal, std::optional<double> scale,
                                           bool enable_gqa) {
  // This route replaces aten's op above its Autocast kernel, so it applies that
  // kernel's policy itself: Note [Autocast policy of batchrules' operators].
  if (autocast_enabled_for(query)) {
    const LowerPrecisionCast cast(query.device().type());
    return routed_scaled_dot_product_attention(cast(query), cast(key), cast(value), cast(attn_mask),
                                               dropout_p, is_causal, scale, enable_gqa);
  }
  if (higher_order_transforms()) {
    return std::get<0>(at::_scaled_dot_product_attention_math(
        query, key, value, additive_mask(attn_mask, query), dropout_p, is_causal,
        /*dropout_mask=*/std::nullopt, scale, enable_gqa));
  }
  return at::native::scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
                                                  is_causal, scale, enable_gqa);
}

}  // namespace

void add_attention_routes(RouteLibraries& libs) {
  libs.front_mode.impl("scaled_dot_product_attention",
                       TORCH_FN(routed_scaled_dot_product_attention));
  libs.batched.impl("_scaled_dot_product_flash_attention_for_cpu",
                    TORCH_FN(flash_attention_cpu_batched));
  libs.batched.impl("_scaled_dot_product_flash_attention_for_cpu_backward",
                    TORCH_FN(flash_attention_cpu_backward_batched));
  libs.batched.impl("_scaled_dot_product_flash_attention_backward",
                    TORCH_FN(flash_attention_backward_batched));
  libs.batched.impl("_scaled_dot_product_efficient_attention",
                    TORCH_FN(efficient_attention_batched));
  libs.batched.impl("_scaled_dot_product_efficient_attention_backward",
                    TORCH_FN(efficient_attention_backward_batched));
  libs.batched.impl("_scaled_dot_product_cudnn_attention", TORCH_FN(cudnn_attention_batched));
  libs.batched.impl("_scaled_dot_product_cudnn_attention_backward",
                    TORCH_FN(cudnn_attention_backward_batched));
}

}  // namespace batchrules
