// Batching rules for the CUDA efficient and cudnn attention forwards, which
// take an attention bias. functorch has rules for both, but folds a batched
// bias by merging its batch dim into the bias's dim 0 whatever that dim is: an
// example's [1, H, L, S] or [L, S] bias then meets the wrong queries (or
// none). These rules fold the bias like every operand (see Note [Folding the
// vmap dim into the attention batch dim]); the flash forward, which takes no
// bias, keeps functorch's rule. Shapes physical, N the vmap size.
#include "attention/batch_rules.h"
#include "attention/dropout.h"
#include "attention/shape_checks.h"
#include "attention/vmap_dims.h"

#include <ATen/ops/_scaled_dot_product_cudnn_attention.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention.h>

namespace batchrules {

namespace {

// The CUDA kernels take the logsumexp (and debug mask) of an empty batch as
// an empty tensor; a result with a batch dim unfolds, others stay shared.
std::tuple<Tensor, Bdim> unfold_if_batched(const Tensor& t, bool has_batch, const c10::SymInt& n,
                                           const c10::SymInt& batch) {
  if (!t.defined() || !has_batch || t.dim() == 0) {
    return {t, std::nullopt};
  }
  return {unfold_batch(t, n, batch), 0};
}

}  // namespace

BatchedQuad efficient_attention_batch_rule(const Tensor& query, Bdim query_bdim, const Tensor& key,
                                           Bdim key_bdim, const Tensor& value, Bdim value_bdim,
                                           const std::optional<Tensor>& attn_bias,
                                           Bdim attn_bias_bdim, bool compute_log_sumexp,
                                           double dropout_p, bool is_causal,
                                           std::optional<double> scale) {
  constexpr const char* op = "aten._scaled_dot_product_efficient_attention";
  const c10::SymInt batch = check_attention_operands(op, {{"query", query, query_bdim, 4},
                                                          {"key", key, key_bdim, 4},
                                                          {"value", value, value_bdim, 4}});
  check_attention_mask(op, "attn_bias", attn_bias, attn_bias_bdim, batch);
  check_fused_dropout_randomness(op, dropout_p);
  const c10::SymInt n = vmap_size({{&query, query_bdim},
                                   {&key, key_bdim},
                                   {&value, value_bdim},
                                   {attn_bias ? &*attn_bias : nullptr, attn_bias_bdim}});
  std::optional<Tensor> bias = fold_mask(attn_bias, attn_bias_bdim, n, batch, MaskBatch::kFull);
  if (bias.has_value()) {
    bias = align_efficient_bias(*bias);
  }
  // N*B,H,L,E x N*B,H,S,E (+ bias N*B,H,L,S) -> out N*B,H,L,E, logsumexp N*B,H,L'
  auto [out, lse, seed, offset] = at::_scaled_dot_product_efficient_attention(
      fold_batch(query, query_bdim, n), fold_batch(key, key_bdim, n),
      fold_batch(value, value_bdim, n), bias, compute_log_sumexp, dropout_p, is_causal, scale);
  // philox seed and offset are one pair for the whole folded call.
  return {unfold_batch(out, n, batch),
          0,
          unfold_batch(lse, n, batch),
          0,
          seed,
          std::nullopt,
          offset,
          std::nullopt};
}

CudnnForwardResult cudnn_attention_batch_rule(const Tensor& query, Bdim query_bdim,
                                              const Tensor& key, Bdim key_bdim, const Tensor& value,
                                              Bdim value_bdim,
                                              const std::optional<Tensor>& attn_bias,
                                              Bdim attn_bias_bdim, bool compute_log_sumexp,
                                              double dropout_p, bool is_causal,
                                              bool return_debug_mask, std::optional<double> scale) {
  constexpr const char* op = "aten._scaled_dot_product_cudnn_attention";
  const c10::SymInt batch = check_attention_operands(op, {{"query", query, query_bdim, 4},
                                                          {"key", key, key_bdim, 4},
                                                          {"value", value, value_bdim, 4}});
  check_attention_mask(op, "attn_bias", attn_bias, attn_bias_bdim, batch);
  check_fused_dropout_randomness(op, dropout_p);
  const c10::SymInt n = vmap_size({{&query, query_bdim},
                                   {&key, key_bdim},
                                   {&value, value_bdim},
                                   {attn_bias ? &*attn_bias : nullptr, attn_bias_bdim}});
  // N*B,H,L,E x N*B,H,S,E (+ bias N*B,1|H,L,S) -> out N*B,H,L,E, logsumexp N*B,H,L,1
  auto [out, lse, cum_q, cum_k, max_q, max_k, seed, offset, debug] =
      at::_scaled_dot_product_cudnn_attention(
          fold_batch(query, query_bdim, n), fold_batch(key, key_bdim, n),
          fold_batch(value, value_bdim, n),
          fold_mask(attn_bias, attn_bias_bdim, n, batch, MaskBatch::kFull), compute_log_sumexp,
          dropout_p, is_causal, return_debug_mask, scale);
  auto [lse_out, lse_bdim] = unfold_if_batched(lse, compute_log_sumexp, n, batch);
  auto [debug_out, debug_bdim] = unfold_if_batched(debug, return_debug_mask, n, batch);
  // cum_seq_q/k are empty for dense inputs; max_q/max_k are an example's.
  return {unfold_batch(out, n, batch),
          0,
          lse_out,
          lse_bdim,
          cum_q,
          std::nullopt,
          cum_k,
          std::nullopt,
          max_q,
          max_k,
          seed,
          std::nullopt,
          offset,
          std::nullopt,
          debug_out,
          debug_bdim};
}

}  // namespace batchrules
