// Note [Routing aten::linear only while transforms are active]
// functorch registers a kernel for aten::linear on
// FuncTorchDynamicLayerFrontMode ("linear_hack", which decomposes it). That
// key is only in the dispatch key set while a torch.func transform is active,
// so a kernel registered there changes nothing for eager code. Enabling
// creates a torch::Library at run time whose kernel replaces linear_hack and
// calls batchrules::linear; disabling destroys the library, which
// deregisters the kernel and restores linear_hack exactly (the dispatcher
// keeps overridden kernels and reinstates the previous one).
//
// routing_mutex serializes enable/disable; the dispatcher serializes the
// table update itself, but not against calls already running in other
// threads, hence "flip it while no other thread is inside a transform".
#include "routing.h"

#include "ops.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <memory>
#include <mutex>

namespace batchrules {

namespace {

Tensor routed_linear(const Tensor& input, const Tensor& weight,
                     const std::optional<Tensor>& bias) {
  return linear_op().call(input, weight, bias);
}

// Swallows the dispatcher's "Overriding a previously registered kernel"
// warning: replacing linear_hack is the point.
struct SilentWarningHandler : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

std::mutex routing_mutex;
std::unique_ptr<torch::Library> routing_library;

}  // namespace

void set_routing_enabled(bool enabled) {
  std::lock_guard<std::mutex> lock(routing_mutex);
  if (enabled == static_cast<bool>(routing_library)) {
    return;
  }
  if (!enabled) {
    routing_library.reset();
    return;
  }
  SilentWarningHandler silent;
  c10::WarningUtils::WarningHandlerGuard guard(&silent);
  auto lib = std::make_unique<torch::Library>(
      torch::Library::IMPL, "aten",
      std::optional<c10::DispatchKey>(c10::DispatchKey::FuncTorchDynamicLayerFrontMode),
      __FILE__, __LINE__);
  lib->impl("linear", TORCH_FN(routed_linear));
  routing_library = std::move(lib);
}

bool routing_enabled() {
  std::lock_guard<std::mutex> lock(routing_mutex);
  return static_cast<bool>(routing_library);
}

}  // namespace batchrules
