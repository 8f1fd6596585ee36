// Where a recurrent rule puts the vmap dim. See Note [Batching the grouped
// recurrence].
#pragma once

#include "common/batching_utils.h"

#include <optional>

namespace batchrules {

// Note [Batching the grouped recurrence]
// With B the vmap size, every rule makes one call of the op on physical
// operands (Note [The grouped recurrence] for their logical layouts):
//  - weights shared at this level: B joins the rows, N -> B*N:
//      input_gates T,(E,)N,GH -> T,(E,)B*N,GH    h0 (E,)N,P -> (E,)B*N,P
//    so per-sample sequences are one batch of the fused recurrence and each
//    step one GEMM for all samples;
//  - some weight batched (ensembles, hypernetworks): B joins the groups,
//    E -> B*E (B alone when ungrouped):
//      w_hh (E,)GH,P -> B*E,GH,P    input_gates T,(E,)N,GH -> T,B*E,N,GH
//    so each step is one bmm over all members.
// Unbatched operands are expanded to B (a copy only where the fold needs one).
// The outputs are views back: B in front of N (bdim 1+E or E) or of E.
struct BatchPlacement {
  bool into_groups;  // else into the rows
  bool grouped;      // logical operands carry a group dim E
  int64_t batch;     // B
  int64_t inner;     // what B is folded with: N (rows) or E (groups, 1 if none)

  Tensor seq(const Tensor& t, std::optional<int64_t> bdim) const;     // T,(E,)N,F
  Tensor state(const Tensor& t, std::optional<int64_t> bdim) const;   // (E,)N,F
  Tensor weight(const Tensor& t, std::optional<int64_t> bdim) const;  // (E,)*w
  BatchedResult seq_out(const Tensor& t) const;
  BatchedResult state_out(const Tensor& t) const;
};

}  // namespace batchrules
