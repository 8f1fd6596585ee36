// The batchrules._C extension module. Importing it registers the operators
// (the TORCH_LIBRARY blocks of this library); it exposes the routing switch,
// which Python wraps in batchrules.enable()/disable(), and an unboxed eager
// entry point for batchrules.linear.
#include "ops.h"
#include "routing.h"

#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("_set_routing_enabled", &batchrules::set_routing_enabled,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Route aten::linear under torch.func transforms to batchrules::linear (process-wide).");
  // torch.ops calls box their arguments; this calls the same dispatcher entry
  // unboxed, saving most of a microsecond per eager call. See batchrules/ops.py.
  m.def("_linear", &batchrules::dispatch_linear, pybind11::arg("input"), pybind11::arg("weight"),
        pybind11::arg("bias") = std::nullopt,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("_routing_enabled", &batchrules::routing_enabled,
        "Whether aten::linear is routed to batchrules::linear under torch.func transforms.");
}
