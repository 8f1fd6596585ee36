// The batchrules._C extension module. Importing it registers the operators
// (the TORCH_LIBRARY blocks of this library); it exposes the routing switch,
// which Python wraps in batchrules.enable()/disable(), and batchrules.linear's
// eager entry point.
//
// Note [Eager entry of batchrules.linear]
// torch.ops calls box their arguments, and a Python wrapper adds a frame and
// its checks: either made batchrules.linear 5-7% slower than F.linear (a
// generated C binding) on small layers. So batchrules.linear is this C
// function. Plain tensors (torch.Tensor or nn.Parameter exactly, no
// __torch_function__ mode) go unboxed to the dispatcher; anything else (a
// subclass with __torch_function__, a mode, None, a non-tensor) takes
// torch.ops.batchrules.linear, which handles overrides and reports bad
// arguments. torch.compile traces it through a polyfill (batchrules/ops.py).
#include "ops.h"
#include "routing.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

namespace {

namespace py = pybind11;

bool plain_tensor(py::handle obj) {
  return THPVariable_CheckExact(obj.ptr());
}

py::object linear_entry(py::handle input, py::handle weight, py::handle bias) {
  if (plain_tensor(input) && plain_tensor(weight) && (bias.is_none() || plain_tensor(bias)) &&
      !at::impl::torch_function_mode_enabled()) {
    const at::Tensor& x = THPVariable_Unpack(input.ptr());
    const at::Tensor& w = THPVariable_Unpack(weight.ptr());
    std::optional<at::Tensor> b;
    if (!bias.is_none()) {
      b = THPVariable_Unpack(bias.ptr());
    }
    at::Tensor out;
    {
      py::gil_scoped_release no_gil;
      out = batchrules::dispatch_linear(x, w, b);
    }
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out)));
  }
  // Leaked on purpose: a py::object destroyed at exit could outlive the interpreter.
  static py::handle boxed = py::object(py::module_::import("torch")
                                           .attr("ops").attr("batchrules").attr("linear")
                                           .attr("default"))
                                .release();
  return boxed(input, weight, bias);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("_set_routing_enabled", &batchrules::set_routing_enabled,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Route aten::linear under torch.func transforms to batchrules::linear (process-wide).");
  m.def("_routing_enabled", &batchrules::routing_enabled,
        "Whether aten::linear is routed to batchrules::linear under torch.func transforms.");
  // See Note [Eager entry of batchrules.linear].
  m.def("linear", &linear_entry, py::arg("input"), py::arg("weight"), py::arg("bias") = py::none(),
        R"doc(``y = input @ weight.T + bias``, with the semantics of ``torch.nn.functional.linear``.

Unlike ``F.linear`` it keeps its identity under every transform: it has its
own backward (one ``batchrules::linear_backward`` call), double backward and
forward-mode AD formulas, and vmap batching rules that run batched weights
as one batched GEMM. Eager calls with plain tensors go straight to the
dispatcher; tensor subclasses, ``__torch_function__`` modes and
``torch.compile`` see ``torch.ops.batchrules.linear``.

Args:
    input (Tensor): ``(*, in_features)`` or ``(in_features,)``.
    weight (Tensor): ``(out_features, in_features)`` or ``(in_features,)``.
    bias (Tensor, optional): broadcastable to the output ``(*, out_features)``.
)doc");
}
