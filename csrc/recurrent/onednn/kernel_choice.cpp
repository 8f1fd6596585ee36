// Which kernel runs an LSTM layer under the active transforms.
//
// Note [oneDNN's LSTM layer under transforms]
// On the CPU aten runs an LSTM as oneDNN's fused layer, whose GEMMs are
// faster than the MKL calls rnn_recurrence makes from small sizes up. But
// its backward sums the weight gradients over the layer's rows, and under the
// create_graph=True of functorch's grad aten differentiates it through a
// composite of per-step ops. So the route picks, for float32 CPU operands
// without a projection or autocast, with oneDNN enabled:
//  - no grad or jvp level (vmap alone: inference, or the plain autograd of a
//    loss taken outside the transforms): aten::mkldnn_rnn_layer, whose rule
//    folds the vmap dim into the rows, or calls it once per member;
//  - one grad level where no weight gradient is needed per example of a vmap
//    inside it (grad of an ensemble's summed loss, vmap(grad) over stacked
//    members' weights): batchrules::fused_lstm_layer, oneDNN's layer with
//    oneDNN's fused backward under a node of our own, called once per member
//    (or over the folded rows, for a forward whose backward is outside the
//    vmap);
//  - batched weights need at least 8 rows a member in both, below which one
//    bmm over all members (hypernetworks: one row each) beats a loop of
//    small fused calls; on an Intel CPU (Note [MKL or oneDNN by CPU vendor])
//    an ensemble also needs at least kMinOneDnnMemberWork rows x hidden a
//    member: below it the recurrence's batched GEMMs (with Note [A step's
//    GEMM]) beat the loop of oneDNN layers, in inference and training;
//  - anything else, per-sample weight gradients above all (vmap(grad) with
//    shared weights): rnn_recurrence, whose weight gradients are one bmm per
//    sample; or its decomposition under higher-order transforms.
#include "common/autocast.h"
#include "common/batching_utils.h"
#include "common/cpu_gemm.h"
#include "common/transform_stack.h"
#include "recurrent/layers.h"

#include <ATen/Context.h>
#include <ATen/functorch/DynamicLayer.h>

#include <algorithm>

namespace batchrules {

namespace {

constexpr int64_t kMinRowsPerMember = 8;
constexpr int64_t kMinOneDnnMemberWork = 768;  // rows x hidden; see the Note above

// h0: [layers * directions, rows, hidden] of one member.
bool small_members(at::TensorList hx) {
  return hx[0].size(-2) * hx[0].size(-1) < kMinOneDnnMemberWork;
}

bool onednn_runs_it(const Tensor& input, at::TensorList hx, at::TensorList params) {
  if (!at::globalContext().userEnabledMkldnn() || autocast_enabled_for(input) ||
      physical_tensor(input).numel() == 0 || physical_tensor(hx[0]).numel() == 0 ||
      hx[0].size(-1) != hx[1].size(-1)) {
    return false;
  }
  const auto cpu_float = [](const Tensor& t) {
    return t.device().is_cpu() && t.scalar_type() == at::kFloat;
  };
  return cpu_float(input) && std::all_of(hx.begin(), hx.end(), cpu_float) &&
         std::all_of(params.begin(), params.end(), cpu_float);
}

struct WeightBatching {
  bool somewhere = false;    // some weight batched at some vmap level
  bool per_example = false;  // a grad level inside a vmap level that some weight is not
                             // batched at: that weight's gradient is asked for per example
};

WeightBatching weight_batching(at::TensorList params) {
  WeightBatching result;
  const auto& stack = at::functorch::getDynamicLayerStack();
  for (size_t v = 0; v < stack.size(); ++v) {
    if (stack[v].key() != at::functorch::TransformType::Vmap) {
      continue;
    }
    const int64_t level = stack[v].layerId();
    const auto batched = [&](const Tensor& p) {
      return batched_at_level_through_wrappers(p, level);
    };
    const bool grad_inside = std::any_of(stack.begin() + v + 1, stack.end(), [](const auto& l) {
      return l.key() == at::functorch::TransformType::Grad;
    });
    result.somewhere |= std::any_of(params.begin(), params.end(), batched);
    result.per_example |= grad_inside && !std::all_of(params.begin(), params.end(), batched);
  }
  return result;
}

}  // namespace

LstmKernel lstm_kernel(const Tensor& input, at::TensorList hx, at::TensorList params,
                       bool batch_first) {
  if (!onednn_runs_it(input, hx, params) || higher_order_transforms()) {
    return LstmKernel::Recurrence;
  }
  const WeightBatching weights = weight_batching(params);
  const bool few_rows = input.dim() != 3 || input.size(batch_first ? 0 : 1) < kMinRowsPerMember;
  const bool training = inside_grad_transform();
  const bool small = intel_cpu() && small_members(hx);
  if (weights.per_example || (weights.somewhere && (few_rows || small))) {
    return LstmKernel::Recurrence;
  }
  return training ? LstmKernel::OneDnnTraining : LstmKernel::OneDnnInference;
}

}  // namespace batchrules
