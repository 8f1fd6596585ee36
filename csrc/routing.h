// Opt-in routing of aten::linear to batchrules::linear under torch.func.
#pragma once

namespace batchrules {

// Process-wide and thread-safe; idempotent.
void set_routing_enabled(bool enabled);
bool routing_enabled();

}  // namespace batchrules
