// vmap batching rules for aten's fused scaled-dot-product-attention kernels,
// in functorch's style: physical tensors with their optional batch dim in,
// (result, bdim) pairs out. See Note [Folding the vmap dim into the attention
// batch dim].
#pragma once

#include "common/batching_utils.h"

#include <array>
#include <optional>
#include <tuple>

namespace batchrules {

using Bdim = std::optional<int64_t>;
using BatchedPair = std::tuple<Tensor, Bdim, Tensor, Bdim>;
using BatchedTriple = std::tuple<Tensor, Bdim, Tensor, Bdim, Tensor, Bdim>;
using BatchedQuad = std::tuple<Tensor, Bdim, Tensor, Bdim, Tensor, Bdim, Tensor, Bdim>;

// aten::_scaled_dot_product_flash_attention_for_cpu -> (out, logsumexp)
BatchedPair flash_attention_cpu_batch_rule(const Tensor& query, Bdim query_bdim, const Tensor& key,
                                           Bdim key_bdim, const Tensor& value, Bdim value_bdim,
                                           double dropout_p, bool is_causal,
                                           const std::optional<Tensor>& attn_mask,
                                           Bdim attn_mask_bdim, std::optional<double> scale);

// aten::_scaled_dot_product_flash_attention_for_cpu_backward -> (gq, gk, gv)
BatchedTriple flash_attention_cpu_backward_batch_rule(
    const Tensor& grad_out, Bdim grad_out_bdim, const Tensor& query, Bdim query_bdim,
    const Tensor& key, Bdim key_bdim, const Tensor& value, Bdim value_bdim, const Tensor& out,
    Bdim out_bdim, const Tensor& logsumexp, Bdim logsumexp_bdim, double dropout_p, bool is_causal,
    const std::optional<Tensor>& attn_mask, Bdim attn_mask_bdim, std::optional<double> scale);

// aten::_scaled_dot_product_flash_attention_backward (CUDA) -> (gq, gk, gv)
BatchedTriple flash_attention_backward_batch_rule(
    const Tensor& grad_out, Bdim grad_out_bdim, const Tensor& query, Bdim query_bdim,
    const Tensor& key, Bdim key_bdim, const Tensor& value, Bdim value_bdim, const Tensor& out,
    Bdim out_bdim, const Tensor& logsumexp, Bdim logsumexp_bdim, const Tensor& cum_seq_q,
    const Tensor& cum_seq_k, const c10::SymInt& max_q, const c10::SymInt& max_k, double dropout_p,
    bool is_causal, const Tensor& philox_seed, const Tensor& philox_offset,
    std::optional<double> scale);

// aten::_scaled_dot_product_efficient_attention (CUDA) -> (out, logsumexp,
// philox_seed, philox_offset); replaces functorch's rule, which folds a
// batched bias without aligning its batch to the query's
// (batch_rule_cuda_forward.cpp).
BatchedQuad efficient_attention_batch_rule(const Tensor& query, Bdim query_bdim, const Tensor& key,
                                           Bdim key_bdim, const Tensor& value, Bdim value_bdim,
                                           const std::optional<Tensor>& attn_bias,
                                           Bdim attn_bias_bdim, bool compute_log_sumexp,
                                           double dropout_p, bool is_causal,
                                           std::optional<double> scale);

// aten::_scaled_dot_product_efficient_attention_backward (CUDA) -> (gq, gk, gv, g_bias)
BatchedQuad efficient_attention_backward_batch_rule(
    const Tensor& grad_out, Bdim grad_out_bdim, const Tensor& query, Bdim query_bdim,
    const Tensor& key, Bdim key_bdim, const Tensor& value, Bdim value_bdim, const Tensor& attn_bias,
    Bdim attn_bias_bdim, const Tensor& out, Bdim out_bdim, const Tensor& logsumexp,
    Bdim logsumexp_bdim, const Tensor& philox_seed, const Tensor& philox_offset, double dropout_p,
    std::array<bool, 4> grad_input_mask, bool is_causal, std::optional<double> scale);

// aten::_scaled_dot_product_cudnn_attention (CUDA): the nine outputs, each
// tensor with its bdim; replaces functorch's rule like the efficient one.
using CudnnForwardResult =
    std::tuple<Tensor, Bdim, Tensor, Bdim, Tensor, Bdim, Tensor, Bdim, c10::SymInt, c10::SymInt,
               Tensor, Bdim, Tensor, Bdim, Tensor, Bdim>;
CudnnForwardResult cudnn_attention_batch_rule(const Tensor& query, Bdim query_bdim,
                                              const Tensor& key, Bdim key_bdim, const Tensor& value,
                                              Bdim value_bdim,
                                              const std::optional<Tensor>& attn_bias,
                                              Bdim attn_bias_bdim, bool compute_log_sumexp,
                                              double dropout_p, bool is_causal,
                                              bool return_debug_mask, std::optional<double> scale);

// aten::_scaled_dot_product_cudnn_attention_backward (CUDA) -> (gq, gk, gv)
BatchedTriple cudnn_attention_backward_batch_rule(
    const Tensor& grad_out, Bdim grad_out_bdim, const Tensor& query, Bdim query_bdim,
    const Tensor& key, Bdim key_bdim, const Tensor& value, Bdim value_bdim, const Tensor& out,
    Bdim out_bdim, const Tensor& logsumexp, Bdim logsumexp_bdim, const Tensor& philox_seed,
    const Tensor& philox_offset, const Tensor& attn_bias, Bdim attn_bias_bdim,
    const Tensor& cum_seq_q, const Tensor& cum_seq_k, const c10::SymInt& max_q,
    const c10::SymInt& max_k, double dropout_p, bool is_causal, std::optional<double> scale);

}  // namespace batchrules
