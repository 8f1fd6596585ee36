// Note [Routing aten ops only while transforms are active]
// Two dispatch keys are only in the key set while a torch.func transform is
// active, so kernels registered there change nothing for eager code:
//  - FuncTorchDynamicLayerFrontMode, where functorch decomposes some
//    CompositeImplicitAutograd ops itself (aten::linear's "linear_hack");
//    our kernel there sends the aten op to a batchrules operator, which then
//    has its own autograd formulas and batching rules;
//  - FuncTorchBatched, where our kernels are batching rules for aten ops that
//    functorch runs through its per-example fallback or a Python
//    decomposition.
// Enabling creates one torch::Library per key at run time and lets every op
// family add its kernels (<family>/routes.cpp); disabling destroys them,
// which deregisters the kernels and restores the previous ones exactly (the
// dispatcher keeps overridden kernels and reinstates them). functorch loads
// its Python decompositions lazily, at the first vmap call, and a later
// registration wins, so batchrules.enable() has them loaded first.
//
// routing_mutex serializes enable/disable; the dispatcher serializes the
// table update itself, but not against calls already running in other
// threads, hence "flip it while no other thread is inside a transform".
#include "routing.h"

#include <c10/util/Exception.h>

#include <memory>
#include <mutex>

namespace batchrules {

namespace {

// Swallows the dispatcher's "Overriding a previously registered kernel"
// warning: replacing functorch's kernels is the point.
struct SilentWarningHandler : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

struct Routes {
  torch::Library front_mode{torch::Library::IMPL, "aten",
                            c10::DispatchKey::FuncTorchDynamicLayerFrontMode, __FILE__,
                            __LINE__};
  torch::Library batched{torch::Library::IMPL, "aten", c10::DispatchKey::FuncTorchBatched,
                         __FILE__, __LINE__};
};

std::mutex routing_mutex;
std::unique_ptr<Routes> routes;

}  // namespace

void set_routing_enabled(bool enabled) {
  std::lock_guard<std::mutex> lock(routing_mutex);
  if (enabled == static_cast<bool>(routes)) {
    return;
  }
  if (!enabled) {
    routes.reset();
    return;
  }
  SilentWarningHandler silent;
  c10::WarningUtils::WarningHandlerGuard guard(&silent);
  auto fresh = std::make_unique<Routes>();
  RouteLibraries libs{fresh->front_mode, fresh->batched};
  add_linear_routes(libs);
  add_attention_routes(libs);
  add_loss_routes(libs);
  add_activation_routes(libs);
  add_recurrent_routes(libs);
  routes = std::move(fresh);
}

bool routing_enabled() {
  std::lock_guard<std::mutex> lock(routing_mutex);
  return static_cast<bool>(routes);
}

}  // namespace batchrules
