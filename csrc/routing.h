// Opt-in routing of aten ops to batchrules' kernels under torch.func.
#pragma once

#include <torch/library.h>

#include <functional>
#include <vector>

namespace batchrules {

// Process-wide and idempotent; concurrent calls are serialized.
// See Note [Routing aten ops only while transforms are active].
void set_routing_enabled(bool enabled);
bool routing_enabled();

// The kernels an op family routes to for one dispatch key, each recorded
// once; enabling registers them all, disabling deregisters them (Note
// [Routing without re-checking schemas] in routing.cpp).
class RouteTable {
 public:
  explicit RouteTable(c10::DispatchKey key) : key_(key) {}

  // Like torch::Library::impl for an aten op ("lstm.input").
  template <class FuncPtr>
  RouteTable& impl(const char* name, FuncPtr fn) {
    add(name, c10::KernelFunction::makeFromUnboxedFunction(fn),
        c10::impl::CppSignature::make<typename FuncPtr::FuncType>(),
        [name, fn](torch::Library& lib) { lib.impl(name, fn); });
    return *this;
  }

  // Registers every route once through a torch::Library (its schema check)
  // and deregisters them again.
  void check_schemas() const;
  std::vector<c10::RegistrationHandleRAII> register_all() const;

 private:
  struct Route {
    c10::OperatorName op;
    c10::KernelFunction kernel;
    c10::impl::CppSignature signature;
    std::function<void(torch::Library&)> check;
  };
  void add(const char* name, c10::KernelFunction kernel, c10::impl::CppSignature signature,
           std::function<void(torch::Library&)> check);

  c10::DispatchKey key_;
  std::vector<Route> routes_;
};

// Where an op family puts its kernels for aten ops while routing is on.
struct RouteLibraries {
  RouteTable& front_mode;  // aten, FuncTorchDynamicLayerFrontMode
  RouteTable& batched;     // aten, FuncTorchBatched
};

// One per op family, each in <family>/routes.cpp.
void add_linear_routes(RouteLibraries& libs);
void add_attention_routes(RouteLibraries& libs);
void add_loss_routes(RouteLibraries& libs);
void add_activation_routes(RouteLibraries& libs);
void add_recurrent_routes(RouteLibraries& libs);

}  // namespace batchrules
