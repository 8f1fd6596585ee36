// Dropout inside the fused SDPA kernels under vmap.
// See Note [Dropout in a folded forward] and Note [Dropout in a folded backward].
#pragma once

namespace batchrules {

// Raises unless the current vmap level lets each example draw its own
// dropout mask (randomness="different"); no-op for dropout_p == 0.
void check_fused_dropout_randomness(const char* op, double dropout_p);

}  // namespace batchrules
