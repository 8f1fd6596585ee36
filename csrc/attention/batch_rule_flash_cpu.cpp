// Batching rules for the CPU flash-attention kernel and its backward: one
// folded call each. See Note [Folding the vmap dim into the attention batch
// dim]. Shapes are physical, N the vmap size, B/H/L/S/E an example's batch,
// heads (query; key and value may have fewer, GQA), query and key lengths,
// head dim. An example's attn_mask is [L, S] or [1|B, 1|H, L, S]; the kernel
// broadcasts its size-1 dims, so a mask every example shares stays as it is.
#include "attention/batch_rules.h"
#include "attention/dropout.h"
#include "attention/shape_checks.h"
#include "attention/vmap_dims.h"

#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>

namespace batchrules {

BatchedPair flash_attention_cpu_batch_rule(const Tensor& query, Bdim query_bdim, const Tensor& key,
                                           Bdim key_bdim, const Tensor& value, Bdim value_bdim,
                                           double dropout_p, bool is_causal,
                                           const std::optional<Tensor>& attn_mask,
                                           Bdim attn_mask_bdim, std::optional<double> scale) {
  constexpr const char* op = "aten._scaled_dot_product_flash_attention_for_cpu";
  const c10::SymInt batch = check_attention_operands(op, {{"query", query, query_bdim, 4},
                                                          {"key", key, key_bdim, 4},
                                                          {"value", value, value_bdim, 4}});
  check_attention_mask(op, "attn_mask", attn_mask, attn_mask_bdim, batch);
  // The CPU kernel itself rejects dropout_p > 0; the randomness mode is
  // checked first so vmap reports the same as for the CUDA kernels.
  check_fused_dropout_randomness(op, dropout_p);
  const c10::SymInt n = vmap_size({{&query, query_bdim},
                                   {&key, key_bdim},
                                   {&value, value_bdim},
                                   {attn_mask ? &*attn_mask : nullptr, attn_mask_bdim}});
  // N*B,H,L,E x N*B,Hk,S,E x N*B,Hk,S,E -> out N*B,H,L,E, logsumexp N*B,H,L
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
      fold_batch(query, query_bdim, n), fold_batch(key, key_bdim, n),
      fold_batch(value, value_bdim, n), dropout_p, is_causal,
      fold_mask(attn_mask, attn_mask_bdim, n, batch, MaskBatch::kBroadcast), scale);
  return {unfold_batch(out, n, batch), 0, unfold_batch(lse, n, batch), 0};
}

BatchedTriple flash_attention_cpu_backward_batch_rule(
    const Tensor& grad_out, Bdim grad_out_bdim, const Tensor& query, Bdim query_bdim,
    const Tensor& key, Bdim key_bdim, const Tensor& value, Bdim value_bdim, const Tensor& out,
    Bdim out_bdim, const Tensor& logsumexp, Bdim logsumexp_bdim, double dropout_p, bool is_causal,
    const std::optional<Tensor>& attn_mask, Bdim attn_mask_bdim, std::optional<double> scale) {
  constexpr const char* op = "aten._scaled_dot_product_flash_attention_for_cpu_backward";
  const c10::SymInt batch =
      check_attention_operands(op, {{"query", query, query_bdim, 4},
                                    {"key", key, key_bdim, 4},
                                    {"value", value, value_bdim, 4},
                                    {"grad_out", grad_out, grad_out_bdim, 4},
                                    {"out", out, out_bdim, 4},
                                    {"logsumexp", logsumexp, logsumexp_bdim, 3}});
  check_attention_mask(op, "attn_mask", attn_mask, attn_mask_bdim, batch);
  const c10::SymInt n = vmap_size({{&grad_out, grad_out_bdim},
                                   {&query, query_bdim},
                                   {&key, key_bdim},
                                   {&value, value_bdim},
                                   {&out, out_bdim},
                                   {&logsumexp, logsumexp_bdim},
                                   {attn_mask ? &*attn_mask : nullptr, attn_mask_bdim}});
  // Unbatched operands are repeated: under jacrev only grad_out is batched
  // (the cotangent basis) and q, k, v, out, logsumexp are copied N times,
  // which is what N calls of the per-example fallback read too.
  // N*B,H,L,E (grad_out, out), N*B,H,L (logsumexp) -> gq N*B,H,L,E, gk/gv N*B,Hk,S,E
  auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      fold_batch(grad_out, grad_out_bdim, n), fold_batch(query, query_bdim, n),
      fold_batch(key, key_bdim, n), fold_batch(value, value_bdim, n), fold_batch(out, out_bdim, n),
      fold_batch(logsumexp, logsumexp_bdim, n), dropout_p, is_causal,
      fold_mask(attn_mask, attn_mask_bdim, n, batch, MaskBatch::kBroadcast), scale);
  return {unfold_batch(gq, n, batch), 0, unfold_batch(gk, n, batch), 0,
          unfold_batch(gv, n, batch), 0};
}

}  // namespace batchrules
