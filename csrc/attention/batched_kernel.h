// FuncTorchBatched kernels for aten's fused attention ops: the rules of
// batch_rule_*.cpp behind the shared plumbing (Note [Hand-written vmap
// plumbing]). routes.cpp registers them while routing is on.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <array>
#include <optional>
#include <tuple>

namespace batchrules {

using at::Tensor;

std::tuple<Tensor, Tensor> flash_attention_cpu_batched(const Tensor& query, const Tensor& key,
                                                       const Tensor& value, double dropout_p,
                                                       bool is_causal,
                                                       const std::optional<Tensor>& attn_mask,
                                                       std::optional<double> scale);

std::tuple<Tensor, Tensor, Tensor> flash_attention_cpu_backward_batched(
    const Tensor& grad_out, const Tensor& query, const Tensor& key, const Tensor& value,
    const Tensor& out, const Tensor& logsumexp, double dropout_p, bool is_causal,
    const std::optional<Tensor>& attn_mask, std::optional<double> scale);

std::tuple<Tensor, Tensor, Tensor> flash_attention_backward_batched(
    const Tensor& grad_out, const Tensor& query, const Tensor& key, const Tensor& value,
    const Tensor& out, const Tensor& logsumexp, const Tensor& cum_seq_q, const Tensor& cum_seq_k,
    c10::SymInt max_q, c10::SymInt max_k, double dropout_p, bool is_causal,
    const Tensor& philox_seed, const Tensor& philox_offset, std::optional<double> scale);

std::tuple<Tensor, Tensor, Tensor, Tensor> efficient_attention_batched(
    const Tensor& query, const Tensor& key, const Tensor& value,
    const std::optional<Tensor>& attn_bias, bool compute_log_sumexp, double dropout_p,
    bool is_causal, std::optional<double> scale);

std::tuple<Tensor, Tensor, Tensor, Tensor> efficient_attention_backward_batched(
    const Tensor& grad_out, const Tensor& query, const Tensor& key, const Tensor& value,
    const Tensor& attn_bias, const Tensor& out, const Tensor& logsumexp, const Tensor& philox_seed,
    const Tensor& philox_offset, double dropout_p, std::array<bool, 4> grad_input_mask,
    bool is_causal, std::optional<double> scale);

std::tuple<Tensor, Tensor, Tensor, Tensor, c10::SymInt, c10::SymInt, Tensor, Tensor, Tensor>
cudnn_attention_batched(const Tensor& query, const Tensor& key, const Tensor& value,
                        const std::optional<Tensor>& attn_bias, bool compute_log_sumexp,
                        double dropout_p, bool is_causal, bool return_debug_mask,
                        std::optional<double> scale);

std::tuple<Tensor, Tensor, Tensor> cudnn_attention_backward_batched(
    const Tensor& grad_out, const Tensor& query, const Tensor& key, const Tensor& value,
    const Tensor& out, const Tensor& logsumexp, const Tensor& philox_seed,
    const Tensor& philox_offset, const Tensor& attn_bias, const Tensor& cum_seq_q,
    const Tensor& cum_seq_k, c10::SymInt max_q, c10::SymInt max_k, double dropout_p, bool is_causal,
    std::optional<double> scale);

}  // namespace batchrules
