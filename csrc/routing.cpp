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
// Enabling registers the kernels every op family adds (<family>/routes.cpp)
// on those two keys; disabling deregisters them, which restores the previous
// ones exactly (the dispatcher keeps overridden kernels and reinstates them).
// functorch loads its Python decompositions lazily, at the first vmap call,
// and a later registration wins, so batchrules.enable() has them loaded
// first.
//
// routing_mutex serializes enable/disable; the dispatcher serializes the
// table update itself, but not against calls already running in other
// threads, hence "flip it while no other thread is inside a transform".
#include "routing.h"

#include <c10/util/Exception.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <iterator>
#include <mutex>
#include <string>
#include <vector>

namespace batchrules {

namespace {

// Swallows the dispatcher's "Overriding a previously registered kernel"
// warning: replacing functorch's kernels is the point.
struct SilentWarningHandler : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

// Note [Routing without re-checking schemas]
// clipped_grad turns routing on for its forward and back off, every step.
// Through torch::Library each registration infers the kernel's schema from
// its C++ signature, parses and compares it with the op's, and formats the
// "overriding" warning, for each of the ~30 kernels: a visible part of a
// small model's DP step. The routes are recorded once instead (kernel and
// C++ signature; the first enable passes every one through torch::Library
// once, for its schema check) and registered directly with the dispatcher,
// which still checks a call's C++ signature against the recorded one.
struct Routes {
  RouteTable front_mode{c10::DispatchKey::FuncTorchDynamicLayerFrontMode};
  RouteTable batched{c10::DispatchKey::FuncTorchBatched};

  Routes() {
    RouteLibraries libs{front_mode, batched};
    add_linear_routes(libs);
    add_attention_routes(libs);
    add_loss_routes(libs);
    add_activation_routes(libs);
    add_recurrent_routes(libs);
    front_mode.check_schemas();
    batched.check_schemas();
  }
};

std::mutex routing_mutex;
std::vector<c10::RegistrationHandleRAII> registered;
bool enabled_now = false;

}  // namespace

void RouteTable::add(const char* name, c10::KernelFunction kernel,
                     c10::impl::CppSignature signature,
                     std::function<void(torch::Library&)> check) {
  const std::string full = name;
  const auto dot = full.find('.');
  c10::OperatorName op{"aten::" + full.substr(0, dot),
                       dot == std::string::npos ? "" : full.substr(dot + 1)};
  routes_.push_back({std::move(op), std::move(kernel), signature, std::move(check)});
}

void RouteTable::check_schemas() const {
  torch::Library lib(torch::Library::IMPL, "aten", key_, __FILE__, __LINE__);
  for (const Route& r : routes_) {
    r.check(lib);
  }
}

std::vector<c10::RegistrationHandleRAII> RouteTable::register_all() const {
  std::vector<c10::RegistrationHandleRAII> handles;
  handles.reserve(routes_.size());
  for (const Route& r : routes_) {
    handles.push_back(c10::Dispatcher::singleton().registerImpl(
        r.op, key_, r.kernel, r.signature, nullptr,
        "registered by batchrules.enable() at " __FILE__));
  }
  return handles;
}

void set_routing_enabled(bool enabled) {
  std::lock_guard<std::mutex> lock(routing_mutex);
  if (enabled == enabled_now) {
    return;
  }
  if (!enabled) {
    registered.clear();
    enabled_now = false;
    return;
  }
  SilentWarningHandler silent;
  c10::WarningUtils::WarningHandlerGuard guard(&silent);
  static const Routes routes;
  for (const RouteTable* table : {&routes.front_mode, &routes.batched}) {
    auto handles = table->register_all();
    std::move(handles.begin(), handles.end(), std::back_inserter(registered));
  }
  enabled_now = true;
}

bool routing_enabled() {
  std::lock_guard<std::mutex> lock(routing_mutex);
  return enabled_now;
}

}  // namespace batchrules
