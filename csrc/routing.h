// Opt-in routing of aten::linear to batchrules::linear under torch.func.
#pragma once

namespace batchrules {

// Process-wide and idempotent; concurrent calls are serialized.
// See Note [Routing aten::linear only while transforms are active].
void set_routing_enabled(bool enabled);
bool routing_enabled();

}  // namespace batchrules
