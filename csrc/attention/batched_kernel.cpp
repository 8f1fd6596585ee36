// See batched_kernel.h. Each kernel falls through to the op when nothing is
// batched at the current level; call-wide tensors (philox seed/offset,
// cum_seq_q/k) must not be batched.
#include "attention/batched_kernel.h"

#include "attention/batch_rules.h"
#include "common/vmap_plumbing.h"

#include <ATen/ops/_scaled_dot_product_cudnn_attention.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention_backward.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention_backward.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_backward.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>

namespace batchrules {

namespace {

// unwrap_at for a Tensor argument that may be undefined (an absent bias).
BatchedResult unwrap_maybe_undefined(const Tensor& t, int64_t level) {
  return t.defined() ? unwrap_at(t, level) : BatchedResult{t, std::nullopt};
}

bool batched_maybe_undefined(const Tensor& t, int64_t level) {
  return t.defined() && batched_at(t, level);
}

const Tensor& call_wide(const char* op, const char* name, const Tensor& t, int64_t level) {
  TORCH_CHECK(!batched_maybe_undefined(t, level), op, ": ", name,
              " is batched under vmap, but the kernel takes one ", name,
              " for the whole call (it comes from the forward, which never batches it)");
  return t;
}

}  // namespace

std::tuple<Tensor, Tensor> flash_attention_cpu_batched(const Tensor& query, const Tensor& key,
                                                       const Tensor& value, double dropout_p,
                                                       bool is_causal,
                                                       const std::optional<Tensor>& attn_mask,
                                                       std::optional<double> scale) {
  const BatchedKernelScope scope("aten._scaled_dot_product_flash_attention_for_cpu");
  const int64_t level = scope.level();
  if (!any_batched_at(level, query, key, value, attn_mask)) {
    return at::_scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal,
                                                           attn_mask, scale);
  }
  auto [q, q_bdim] = unwrap_at(query, level);
  auto [k, k_bdim] = unwrap_at(key, level);
  auto [v, v_bdim] = unwrap_at(value, level);
  auto [m, m_bdim] = unwrap_at(attn_mask, level);
  auto [out, out_bdim, lse, lse_bdim] = flash_attention_cpu_batch_rule(
      q, q_bdim, k, k_bdim, v, v_bdim, dropout_p, is_causal, m, m_bdim, scale);
  return {wrap_at(out, out_bdim, level), wrap_at(lse, lse_bdim, level)};
}

std::tuple<Tensor, Tensor, Tensor> flash_attention_cpu_backward_batched(
    const Tensor& grad_out, const Tensor& query, const Tensor& key, const Tensor& value,
    const Tensor& out, const Tensor& logsumexp, double dropout_p, bool is_causal,
    const std::optional<Tensor>& attn_mask, std::optional<double> scale) {
  const BatchedKernelScope scope("aten._scaled_dot_product_flash_attention_for_cpu_backward");
  const int64_t level = scope.level();
  if (!grad_out.defined()) {
    return {};  // what the kernel returns for an absent gradient
  }
  if (!any_batched_at(level, grad_out, query, key, value, out, logsumexp, attn_mask)) {
    return at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask, scale);
  }
  auto [g, g_bdim] = unwrap_at(grad_out, level);
  auto [q, q_bdim] = unwrap_at(query, level);
  auto [k, k_bdim] = unwrap_at(key, level);
  auto [v, v_bdim] = unwrap_at(value, level);
  auto [o, o_bdim] = unwrap_at(out, level);
  auto [lse, lse_bdim] = unwrap_at(logsumexp, level);
  auto [m, m_bdim] = unwrap_at(attn_mask, level);
  auto [gq, gq_bdim, gk, gk_bdim, gv, gv_bdim] = flash_attention_cpu_backward_batch_rule(
      g, g_bdim, q, q_bdim, k, k_bdim, v, v_bdim, o, o_bdim, lse, lse_bdim, dropout_p, is_causal, m,
      m_bdim, scale);
  return {wrap_at(gq, gq_bdim, level), wrap_at(gk, gk_bdim, level), wrap_at(gv, gv_bdim, level)};
}

std::tuple<Tensor, Tensor, Tensor> flash_attention_backward_batched(
    const Tensor& grad_out, const Tensor& query, const Tensor& key, const Tensor& value,
    const Tensor& out, const Tensor& logsumexp, const Tensor& cum_seq_q, const Tensor& cum_seq_k,
    c10::SymInt max_q, c10::SymInt max_k, double dropout_p, bool is_causal,
    const Tensor& philox_seed, const Tensor& philox_offset, std::optional<double> scale) {
  constexpr const char* op = "aten._scaled_dot_product_flash_attention_backward";
  const BatchedKernelScope scope(op);
  const int64_t level = scope.level();
  if (!any_batched_at(level, grad_out, query, key, value, out, logsumexp)) {
    return at::_scaled_dot_product_flash_attention_backward_symint(
        grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
        is_causal, philox_seed, philox_offset, scale);
  }
  auto [g, g_bdim] = unwrap_at(grad_out, level);
  auto [q, q_bdim] = unwrap_at(query, level);
  auto [k, k_bdim] = unwrap_at(key, level);
  auto [v, v_bdim] = unwrap_at(value, level);
  auto [o, o_bdim] = unwrap_at(out, level);
  auto [lse, lse_bdim] = unwrap_at(logsumexp, level);
  auto [gq, gq_bdim, gk, gk_bdim, gv, gv_bdim] = flash_attention_backward_batch_rule(
      g, g_bdim, q, q_bdim, k, k_bdim, v, v_bdim, o, o_bdim, lse, lse_bdim,
      call_wide(op, "cum_seq_q", cum_seq_q, level), call_wide(op, "cum_seq_k", cum_seq_k, level),
      max_q, max_k, dropout_p, is_causal, call_wide(op, "philox_seed", philox_seed, level),
      call_wide(op, "philox_offset", philox_offset, level), scale);
  return {wrap_at(gq, gq_bdim, level), wrap_at(gk, gk_bdim, level), wrap_at(gv, gv_bdim, level)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> efficient_attention_batched(
    const Tensor& query, const Tensor& key, const Tensor& value,
    const std::optional<Tensor>& attn_bias, bool compute_log_sumexp, double dropout_p,
    bool is_causal, std::optional<double> scale) {
  const BatchedKernelScope scope("aten._scaled_dot_product_efficient_attention");
  const int64_t level = scope.level();
  if (!any_batched_at(level, query, key, value, attn_bias)) {
    return at::_scaled_dot_product_efficient_attention(
        query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, scale);
  }
  auto [q, q_bdim] = unwrap_at(query, level);
  auto [k, k_bdim] = unwrap_at(key, level);
  auto [v, v_bdim] = unwrap_at(value, level);
  auto [b, b_bdim] = unwrap_at(attn_bias, level);
  auto [out, out_bdim, lse, lse_bdim, seed, seed_bdim, offset, offset_bdim] =
      efficient_attention_batch_rule(q, q_bdim, k, k_bdim, v, v_bdim, b, b_bdim, compute_log_sumexp,
                                     dropout_p, is_causal, scale);
  return {wrap_at(out, out_bdim, level), wrap_at(lse, lse_bdim, level),
          wrap_at(seed, seed_bdim, level), wrap_at(offset, offset_bdim, level)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> efficient_attention_backward_batched(
    const Tensor& grad_out, const Tensor& query, const Tensor& key, const Tensor& value,
    const Tensor& attn_bias, const Tensor& out, const Tensor& logsumexp, const Tensor& philox_seed,
    const Tensor& philox_offset, double dropout_p, std::array<bool, 4> grad_input_mask,
    bool is_causal, std::optional<double> scale) {
  constexpr const char* op = "aten._scaled_dot_product_efficient_attention_backward";
  const BatchedKernelScope scope(op);
  const int64_t level = scope.level();
  if (!any_batched_at(level, grad_out, query, key, value, out, logsumexp) &&
      !batched_maybe_undefined(attn_bias, level)) {
    return at::_scaled_dot_product_efficient_attention_backward(
        grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
        dropout_p, grad_input_mask, is_causal, scale);
  }
  auto [g, g_bdim] = unwrap_at(grad_out, level);
  auto [q, q_bdim] = unwrap_at(query, level);
  auto [k, k_bdim] = unwrap_at(key, level);
  auto [v, v_bdim] = unwrap_at(value, level);
  auto [b, b_bdim] = unwrap_maybe_undefined(attn_bias, level);
  auto [o, o_bdim] = unwrap_at(out, level);
  auto [lse, lse_bdim] = unwrap_at(logsumexp, level);
  auto [gq, gq_bdim, gk, gk_bdim, gv, gv_bdim, gb, gb_bdim] =
      efficient_attention_backward_batch_rule(g, g_bdim, q, q_bdim, k, k_bdim, v, v_bdim, b, b_bdim,
                                              o, o_bdim, lse, lse_bdim,
                                              call_wide(op, "philox_seed", philox_seed, level),
                                              call_wide(op, "philox_offset", philox_offset, level),
                                              dropout_p, grad_input_mask, is_causal, scale);
  return {wrap_at(gq, gq_bdim, level), wrap_at(gk, gk_bdim, level), wrap_at(gv, gv_bdim, level),
          wrap_at(gb, gb_bdim, level)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, c10::SymInt, c10::SymInt, Tensor, Tensor, Tensor>
cudnn_attention_batched(const Tensor& query, const Tensor& key, const Tensor& value,
                        const std::optional<Tensor>& attn_bias, bool compute_log_sumexp,
                        double dropout_p, bool is_causal, bool return_debug_mask,
                        std::optional<double> scale) {
  const BatchedKernelScope scope("aten._scaled_dot_product_cudnn_attention");
  const int64_t level = scope.level();
  if (!any_batched_at(level, query, key, value, attn_bias)) {
    return at::_scaled_dot_product_cudnn_attention(query, key, value, attn_bias, compute_log_sumexp,
                                                   dropout_p, is_causal, return_debug_mask, scale);
  }
  auto [q, q_bdim] = unwrap_at(query, level);
  auto [k, k_bdim] = unwrap_at(key, level);
  auto [v, v_bdim] = unwrap_at(value, level);
  auto [b, b_bdim] = unwrap_at(attn_bias, level);
  auto [out, out_bdim, lse, lse_bdim, cum_q, cum_q_bdim, cum_k, cum_k_bdim, max_q, max_k, seed,
        seed_bdim, offset, offset_bdim, debug, debug_bdim] =
      cudnn_attention_batch_rule(q, q_bdim, k, k_bdim, v, v_bdim, b, b_bdim, compute_log_sumexp,
                                 dropout_p, is_causal, return_debug_mask, scale);
  return {wrap_at(out, out_bdim, level),
          wrap_at(lse, lse_bdim, level),
          wrap_at(cum_q, cum_q_bdim, level),
          wrap_at(cum_k, cum_k_bdim, level),
          max_q,
          max_k,
          wrap_at(seed, seed_bdim, level),
          wrap_at(offset, offset_bdim, level),
          wrap_at(debug, debug_bdim, level)};
}

std::tuple<Tensor, Tensor, Tensor> cudnn_attention_backward_batched(
    const Tensor& grad_out, const Tensor& query, const Tensor& key, const Tensor& value,
    const Tensor& out, const Tensor& logsumexp, const Tensor& philox_seed,
    const Tensor& philox_offset, const Tensor& attn_bias, const Tensor& cum_seq_q,
    const Tensor& cum_seq_k, c10::SymInt max_q, c10::SymInt max_k, double dropout_p, bool is_causal,
    std::optional<double> scale) {
  constexpr const char* op = "aten._scaled_dot_product_cudnn_attention_backward";
  const BatchedKernelScope scope(op);
  const int64_t level = scope.level();
  if (!any_batched_at(level, grad_out, query, key, value, out, logsumexp) &&
      !batched_maybe_undefined(attn_bias, level)) {
    return at::_scaled_dot_product_cudnn_attention_backward_symint(
        grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
        cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, scale);
  }
  auto [g, g_bdim] = unwrap_at(grad_out, level);
  auto [q, q_bdim] = unwrap_at(query, level);
  auto [k, k_bdim] = unwrap_at(key, level);
  auto [v, v_bdim] = unwrap_at(value, level);
  auto [o, o_bdim] = unwrap_at(out, level);
  auto [lse, lse_bdim] = unwrap_at(logsumexp, level);
  auto [b, b_bdim] = unwrap_maybe_undefined(attn_bias, level);
  auto [gq, gq_bdim, gk, gk_bdim, gv, gv_bdim] = cudnn_attention_backward_batch_rule(
      g, g_bdim, q, q_bdim, k, k_bdim, v, v_bdim, o, o_bdim, lse, lse_bdim,
      call_wide(op, "philox_seed", philox_seed, level),
      call_wide(op, "philox_offset", philox_offset, level), b, b_bdim,
      call_wide(op, "cum_seq_q", cum_seq_q, level), call_wide(op, "cum_seq_k", cum_seq_k, level),
      max_q, max_k, dropout_p, is_causal, scale);
  return {wrap_at(gq, gq_bdim, level), wrap_at(gk, gk_bdim, level), wrap_at(gv, gv_bdim, level)};
}

}  // namespace batchrules
