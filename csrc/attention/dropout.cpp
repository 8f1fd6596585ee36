// Note [Dropout in a folded forward]
// A fused kernel draws one dropout mask per entry of its attention batch, so
// a folded call gives every example of the vmap its own masks: that is
// vmap(randomness="different"). "error" raises as functorch does for every
// random op; "same" (one mask shared by all examples) cannot be had from a
// folded call and raises too, naming the way out.
//
// Note [Dropout in a folded backward]
// The flash/efficient/cudnn backwards draw the forward's masks again from
// its philox seed and offset and each entry's position in the attention
// batch. A backward folded like its forward (same level order, n*B + b) sees
// the same positions; the forward was folded at this level exactly when its
// logsumexp is batched here. Otherwise (jacrev: only the cotangent is
// batched; the forward ran outside this vmap) a folded call would give
// example n > 0 the masks of positions n*B + b, so the rules run one call per
// example instead, each at the forward's own positions.
#include "attention/dropout.h"

#include <ATen/functorch/DynamicLayer.h>
#include <c10/util/Exception.h>

namespace batchrules {

void check_fused_dropout_randomness(const char* op, double dropout_p) {
  if (dropout_p <= 0) {
    return;
  }
  const auto layer = at::functorch::maybeCurrentDynamicLayer();
  TORCH_INTERNAL_ASSERT(layer.has_value());
  using at::functorch::RandomnessType;
  const RandomnessType randomness = layer->randomness();
  TORCH_CHECK(randomness != RandomnessType::Error,
              "vmap: called random operation while in randomness error mode. Please either use "
              "the 'same' or 'different' randomness flags on vmap or perform the randomness "
              "operation out of vmap (",
              op, " with dropout_p=", dropout_p, ")");
  TORCH_CHECK(randomness != RandomnessType::Same, op, ": dropout_p=", dropout_p,
              " under vmap(randomness='same') is not supported: the fused attention kernel "
              "draws a dropout mask per example of the vmap, as randomness='different' asks; "
              "use randomness='different', or dropout_p=0");
}

}  // namespace batchrules
