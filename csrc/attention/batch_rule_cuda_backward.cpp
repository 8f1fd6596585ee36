// Batching rules for the CUDA flash, efficient and cudnn attention
// backwards: one folded call, like their forwards (see Note [Folding the vmap
// dim into the attention batch dim]), or one call per example where a folded
// call would not replay the forward's dropout masks (see Note [Dropout in a
// folded backward]). Shapes physical, N the vmap size; philox seed/offset,
// cum_seq_q/k and max_q/max_k describe the whole call and are never batched.
#include "attention/batch_rules.h"
#include "attention/shape_checks.h"
#include "attention/vmap_dims.h"

#include <ATen/ops/_scaled_dot_product_cudnn_attention_backward.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention_backward.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_backward.h>
#include <ATen/ops/stack.h>

#include <vector>

namespace batchrules {

namespace {

Tensor example(const Tensor& t, Bdim bdim, int64_t i) {
  return t.defined() && bdim.has_value() ? t.select(*bdim, i) : t;
}

std::optional<Tensor> example(const std::optional<Tensor>& t, Bdim bdim, int64_t i) {
  return t.has_value() ? std::optional<Tensor>(example(*t, bdim, i)) : std::nullopt;
}

// Runs `call(i)` (a tuple of K gradients) for every example and stacks each
// gradient along a new dim 0; gradients not requested stay undefined.
template <size_t K, class Call>
std::array<std::tuple<Tensor, Bdim>, K> per_example(const c10::SymInt& n, Call call) {
  const int64_t count = n.guard_int(__FILE__, __LINE__);
  TORCH_INTERNAL_ASSERT(count > 0, "per_example needs at least one example");
  std::array<std::vector<Tensor>, K> parts;
  for (int64_t i = 0; i < count; ++i) {
    const auto grads = call(i);
    std::apply(
        [&](const auto&... g) {
          size_t k = 0;
          ((parts[k++].push_back(g)), ...);
        },
        grads);
  }
  std::array<std::tuple<Tensor, Bdim>, K> stacked;
  for (size_t k = 0; k < K; ++k) {
    if (parts[k].front().defined()) {
      stacked[k] = {at::stack(parts[k]), 0};
    }
  }
  return stacked;
}

// An empty batch has no mask to replay: its folded call is empty too.
bool replays_dropout_per_example(double dropout_p, Bdim logsumexp_bdim, const c10::SymInt& n) {
  return dropout_p > 0 && !logsumexp_bdim.has_value() && n != 0;
}

}  // namespace

BatchedTriple flash_attention_backward_batch_rule(
    const Tensor& grad_out, Bdim grad_out_bdim, const Tensor& query, Bdim query_bdim,
    const Tensor& key, Bdim key_bdim, const Tensor& value, Bdim value_bdim, const Tensor& out,
    Bdim out_bdim, const Tensor& logsumexp, Bdim logsumexp_bdim, const Tensor& cum_seq_q,
    const Tensor& cum_seq_k, const c10::SymInt& max_q, const c10::SymInt& max_k, double dropout_p,
    bool is_causal, const Tensor& philox_seed, const Tensor& philox_offset,
    std::optional<double> scale) {
  constexpr const char* op = "aten._scaled_dot_product_flash_attention_backward";
  const c10::SymInt batch =
      check_attention_operands(op, {{"query", query, query_bdim, 4},
                                    {"key", key, key_bdim, 4},
                                    {"value", value, value_bdim, 4},
                                    {"grad_out", grad_out, grad_out_bdim, 4},
                                    {"out", out, out_bdim, 4},
                                    {"logsumexp", logsumexp, logsumexp_bdim, 3}});
  const c10::SymInt n = vmap_size({{&grad_out, grad_out_bdim},
                                   {&query, query_bdim},
                                   {&key, key_bdim},
                                   {&value, value_bdim},
                                   {&out, out_bdim},
                                   {&logsumexp, logsumexp_bdim}});
  const auto call = [&](const Tensor& g, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& o, const Tensor& lse) {
    return at::_scaled_dot_product_flash_attention_backward_symint(
        g, q, k, v, o, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
        philox_offset, scale);
  };
  if (replays_dropout_per_example(dropout_p, logsumexp_bdim, n)) {
    const auto g = per_example<3>(n, [&](int64_t i) {
      return call(example(grad_out, grad_out_bdim, i), example(query, query_bdim, i),
                  example(key, key_bdim, i), example(value, value_bdim, i),
                  example(out, out_bdim, i), example(logsumexp, logsumexp_bdim, i));
    });
    return std::tuple_cat(g[0], g[1], g[2]);
  }
  // N*B,H,L,E (grad_out, q, out), N*B,H,S,E (k, v), N*B,H,L (logsumexp)
  auto [gq, gk, gv] = call(fold_batch(grad_out, grad_out_bdim, n), fold_batch(query, query_bdim, n),
                           fold_batch(key, key_bdim, n), fold_batch(value, value_bdim, n),
                           fold_batch(out, out_bdim, n), fold_batch(logsumexp, logsumexp_bdim, n));
  return {unfold_batch(gq, n, batch), 0, unfold_batch(gk, n, batch), 0,
          unfold_batch(gv, n, batch), 0};
}

BatchedQuad efficient_attention_backward_batch_rule(
    const Tensor& grad_out, Bdim grad_out_bdim, const Tensor& query, Bdim query_bdim,
    const Tensor& key, Bdim key_bdim, const Tensor& value, Bdim value_bdim, const Tensor& attn_bias,
    Bdim attn_bias_bdim, const Tensor& out, Bdim out_bdim, const Tensor& logsumexp,
    Bdim logsumexp_bdim, const Tensor& philox_seed, const Tensor& philox_offset, double dropout_p,
    std::array<bool, 4> grad_input_mask, bool is_causal, std::optional<double> scale) {
  constexpr const char* op = "aten._scaled_dot_product_efficient_attention_backward";
  const c10::SymInt batch =
      check_attention_operands(op, {{"query", query, query_bdim, 4},
                                    {"key", key, key_bdim, 4},
                                    {"value", value, value_bdim, 4},
                                    {"grad_out", grad_out, grad_out_bdim, 4},
                                    {"out", out, out_bdim, 4},
                                    {"logsumexp", logsumexp, logsumexp_bdim, 3}});
  const std::optional<Tensor> bias =
      attn_bias.defined() ? std::optional<Tensor>(attn_bias) : std::nullopt;
  check_attention_mask(op, "attn_bias", bias, attn_bias_bdim, batch);
  const c10::SymInt n = vmap_size({{&grad_out, grad_out_bdim},
                                   {&query, query_bdim},
                                   {&key, key_bdim},
                                   {&value, value_bdim},
                                   {&attn_bias, attn_bias_bdim},
                                   {&out, out_bdim},
                                   {&logsumexp, logsumexp_bdim}});
  const auto call = [&](const Tensor& g, const Tensor& q, const Tensor& k, const Tensor& v,
                        const std::optional<Tensor>& b, const Tensor& o, const Tensor& lse) {
    return at::_scaled_dot_product_efficient_attention_backward(
        g, q, k, v, b.value_or(Tensor()), o, lse, philox_seed, philox_offset, dropout_p,
        grad_input_mask, is_causal, scale);
  };
  if (replays_dropout_per_example(dropout_p, logsumexp_bdim, n)) {
    const auto g = per_example<4>(n, [&](int64_t i) {
      return call(example(grad_out, grad_out_bdim, i), example(query, query_bdim, i),
                  example(key, key_bdim, i), example(value, value_bdim, i),
                  example(bias, attn_bias_bdim, i), example(out, out_bdim, i),
                  example(logsumexp, logsumexp_bdim, i));
    });
    return std::tuple_cat(g[0], g[1], g[2], g[3]);
  }
  std::optional<Tensor> folded_bias = fold_mask(bias, attn_bias_bdim, n, batch, MaskBatch::kFull);
  if (folded_bias.has_value()) {
    folded_bias = align_efficient_bias(*folded_bias);
  }
  // ... + bias N*B,H,L,S -> gq, gk, gv, g_bias (N*B,H,L,S when requested)
  auto [gq, gk, gv, gb] =
      call(fold_batch(grad_out, grad_out_bdim, n), fold_batch(query, query_bdim, n),
           fold_batch(key, key_bdim, n), fold_batch(value, value_bdim, n), folded_bias,
           fold_batch(out, out_bdim, n), fold_batch(logsumexp, logsumexp_bdim, n));
  const auto unfolded = [&](const Tensor& t) -> std::tuple<Tensor, Bdim> {
    return t.defined() ? std::tuple<Tensor, Bdim>{unfold_batch(t, n, batch), 0}
                       : std::tuple<Tensor, Bdim>{t, std::nullopt};
  };
  return std::tuple_cat(unfolded(gq), unfolded(gk), unfolded(gv), unfolded(gb));
}

BatchedTriple cudnn_attention_backward_batch_rule(
    const Tensor& grad_out, Bdim grad_out_bdim, const Tensor& query, Bdim query_bdim,
    const Tensor& key, Bdim key_bdim, const Tensor& value, Bdim value_bdim, const Tensor& out,
    Bdim out_bdim, const Tensor& logsumexp, Bdim logsumexp_bdim, const Tensor& philox_seed,
    const Tensor& philox_offset, const Tensor& attn_bias, Bdim attn_bias_bdim,
    const Tensor& cum_seq_q, const Tensor& cum_seq_k, const c10::SymInt& max_q,
    const c10::SymInt& max_k, double dropout_p, bool is_causal, std::optional<double> scale) {
  constexpr const char* op = "aten._scaled_dot_product_cudnn_attention_backward";
  const c10::SymInt batch =
      check_attention_operands(op, {{"query", query, query_bdim, 4},
                                    {"key", key, key_bdim, 4},
                                    {"value", value, value_bdim, 4},
                                    {"grad_out", grad_out, grad_out_bdim, 4},
                                    {"out", out, out_bdim, 4},
                                    {"logsumexp", logsumexp, logsumexp_bdim, 0}});
  const std::optional<Tensor> bias =
      attn_bias.defined() ? std::optional<Tensor>(attn_bias) : std::nullopt;
  check_attention_mask(op, "attn_bias", bias, attn_bias_bdim, batch);
  const c10::SymInt n = vmap_size({{&grad_out, grad_out_bdim},
                                   {&query, query_bdim},
                                   {&key, key_bdim},
                                   {&value, value_bdim},
                                   {&out, out_bdim},
                                   {&logsumexp, logsumexp_bdim},
                                   {&attn_bias, attn_bias_bdim}});
  const auto call = [&](const Tensor& g, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& o, const Tensor& lse, const std::optional<Tensor>& b) {
    return at::_scaled_dot_product_cudnn_attention_backward_symint(
        g, q, k, v, o, lse, philox_seed, philox_offset, b.value_or(Tensor()), cum_seq_q, cum_seq_k,
        max_q, max_k, dropout_p, is_causal, scale);
  };
  if (replays_dropout_per_example(dropout_p, logsumexp_bdim, n)) {
    const auto g = per_example<3>(n, [&](int64_t i) {
      return call(example(grad_out, grad_out_bdim, i), example(query, query_bdim, i),
                  example(key, key_bdim, i), example(value, value_bdim, i),
                  example(out, out_bdim, i), example(logsumexp, logsumexp_bdim, i),
                  example(bias, attn_bias_bdim, i));
    });
    return std::tuple_cat(g[0], g[1], g[2]);
  }
  // N*B,H,L,E (grad_out, q, out), N*B,H,S,E (k, v), N*B,H,L,1 (logsumexp)
  auto [gq, gk, gv] = call(fold_batch(grad_out, grad_out_bdim, n), fold_batch(query, query_bdim, n),
                           fold_batch(key, key_bdim, n), fold_batch(value, value_bdim, n),
                           fold_batch(out, out_bdim, n), fold_batch(logsumexp, logsumexp_bdim, n),
                           fold_mask(bias, attn_bias_bdim, n, batch, MaskBatch::kFull));
  return {unfold_batch(gq, n, batch), 0, unfold_batch(gk, n, batch), 0,
          unfold_batch(gv, n, batch), 0};
}

}  // namespace batchrules
