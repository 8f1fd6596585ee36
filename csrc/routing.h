// Opt-in routing of aten ops to batchrules' kernels under torch.func.
#pragma once

#include <torch/library.h>

namespace batchrules {

// Process-wide and idempotent; concurrent calls are serialized.
// See Note [Routing aten ops only while transforms are active].
void set_routing_enabled(bool enabled);
bool routing_enabled();

// Where an op family puts its kernels for aten ops while routing is on.
struct RouteLibraries {
  torch::Library& front_mode;  // aten, FuncTorchDynamicLayerFrontMode
  torch::Library& batched;     // aten, FuncTorchBatched
};

// One per op family, each in <family>/routes.cpp.
void add_linear_routes(RouteLibraries& libs);
void add_attention_routes(RouteLibraries& libs);
void add_loss_routes(RouteLibraries& libs);
void add_activation_routes(RouteLibraries& libs);
void add_recurrent_routes(RouteLibraries& libs);

}  // namespace batchrules
