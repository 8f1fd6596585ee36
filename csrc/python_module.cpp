// The batchrules._C extension module. Importing it registers the operators
// (the TORCH_LIBRARY blocks of this library); it exposes the routing switch,
// which Python wraps in batchrules.enable()/disable(), batchrules.linear's
// eager entry point, and the list of activations (activations/activation_list.h),
// from which batchrules.activations and batchrules.compile make their entries.
//
// Note [Eager entry of batchrules.linear]
// torch.ops calls box their arguments, and the checks a Python entry needs to
// choose between paths (compiling? __torch_function__?) cost as much again:
// either makes batchrules.linear slower than F.linear (a generated C
// binding) on small layers. So the choice is made here, and
// batchrules.linear is a one-line Python def around this function (for its
// signature, docstring, and vmap/compile, which inspect their callables).
// Plain tensors (torch.Tensor or nn.Parameter exactly, no __torch_function__
// mode) go unboxed to the dispatcher; anything else (a subclass with
// __torch_function__, a mode, None) takes torch.ops.batchrules.linear, which
// handles overrides and reports bad arguments; a non-tensor is a TypeError,
// as for F.linear. torch.compile traces this function through a polyfill
// (batchrules/compile.py).
#include "activations/definitions.h"
#include "common/cpu_gemm.h"
#include "common/packed_gemm.h"
#include "dp/anchor/anchor.h"
#include "ops.h"
#include "routing.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <pybind11/gil_safe_call_once.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

namespace py = pybind11;

bool plain_tensor(py::handle obj) {
  return THPVariable_CheckExact(obj.ptr());
}

// F.linear's message for an argument that is neither a tensor nor something
// that overrides torch functions (such as an fx Proxy).
void check_tensor_like(py::handle obj, const char* name, int position) {
  if (!obj.is_none() && !THPVariable_Check(obj.ptr()) &&
      !PyObject_HasAttrString(obj.ptr(), "__torch_function__")) {
    throw py::type_error(std::string("linear(): argument '") + name + "' (position " +
                         std::to_string(position) + ") must be Tensor, not " +
                         Py_TYPE(obj.ptr())->tp_name);
  }
}

py::object linear_entry(py::handle input, py::handle weight, py::handle bias) {
  if (plain_tensor(input) && plain_tensor(weight) && (bias.is_none() || plain_tensor(bias)) &&
      !at::impl::torch_function_mode_enabled()) {
    // Owned copies: the Python objects may be changed by other threads
    // (swap_tensors) while the GIL is released.
    const at::Tensor x = THPVariable_Unpack(input.ptr());
    const at::Tensor w = THPVariable_Unpack(weight.ptr());
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
  check_tensor_like(input, "input", 1);
  check_tensor_like(weight, "weight", 2);
  check_tensor_like(bias, "bias", 3);
  // Looked up once, safely for threads that race here holding the GIL.
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> boxed;
  const py::object& op = boxed
                             .call_once_and_store_result([] {
                               return py::module_::import("torch")
                                   .attr("ops")
                                   .attr("batchrules")
                                   .attr("linear")
                                   .attr("default");
                             })
                             .get_stored();
  return op(input, weight, bias);
}

// (name, formula, supports_complex) of each activation, in the list's order.
py::list activations() {
  py::list out;
  for (const batchrules::Activation* act : batchrules::all_activations()) {
    out.append(py::make_tuple(act->op_name, act->formula, act->supports_complex));
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("_set_routing_enabled", &batchrules::set_routing_enabled,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Route linear, the activations, attention and the losses' kernels under torch.func "
        "transforms (process-wide).");
  m.def("_routing_enabled", &batchrules::routing_enabled,
        "Whether the routes of every op family are registered (see routing.py).");
  m.def(
      "_mkl_gemm_beats_onednn", &batchrules::mkl_gemm_beats_onednn,
      "Whether aten's MKL GEMM is preferred to oneDNN's here (Note [MKL or oneDNN by CPU vendor])");
  m.def("_intel_cpu", &batchrules::intel_cpu,
        "Whether small LSTM ensembles take the recurrence (Note [MKL or oneDNN by CPU vendor])");
  m.def("_mkl_packed_gemm", &batchrules::mkl_packed_gemm,
        "Whether recurrences pack W_hh once for all steps (Note [One packed W_hh for all steps])");
  m.def("_anchor", &batchrules::anchor, py::arg("out"),
        "Gives a fresh tensor a node whose backward computes nothing (Note [Anchored outputs])");
  // See Note [Eager entry of batchrules.linear].
  m.def("linear", &linear_entry, py::arg("input"), py::arg("weight"), py::arg("bias") = py::none(),
        R"doc(The eager entry of batchrules.linear (see its docstring).)doc");
  m.def("_activations", &activations,
        "(name, formula, supports_complex) of each activation operator batchrules::<name>.");
}
