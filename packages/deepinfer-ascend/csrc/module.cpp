// deepinfer_ascend._native: submodules cuda_utils and graph_timer, and the AclError type.
#include <pybind11/pybind11.h>

#include "acl_api.h"

namespace py = pybind11;

namespace deepinfer_ascend {
void bind_cuda_utils(py::module_& m);
void bind_graph_timer(py::module_& m);
}  // namespace deepinfer_ascend

PYBIND11_MODULE(_native, m) {
  using deepinfer_ascend::AclError;
  using deepinfer_ascend::AclUnsupported;
  m.doc() = "DeepInfer's Ascend backend: cuda_utils and graph_timer on AscendCL (libascendcl.so opened at run time).";

  static py::handle acl_error = PyErr_NewExceptionWithDoc(
      "deepinfer_ascend._native.AclError",
      "An AscendCL call failed. Attributes: call (the ACL function), code (the aclError it returned).",
      PyExc_RuntimeError, nullptr);
  m.attr("AclError") = py::reinterpret_borrow<py::object>(acl_error);

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const AclError& e) {
      py::object exc = py::reinterpret_borrow<py::object>(acl_error)(e.what());
      exc.attr("call") = e.call();
      exc.attr("code") = e.code();
      PyErr_SetObject(acl_error.ptr(), exc.ptr());
    } catch (const AclUnsupported& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what());
    }
  });

  py::module_ cuda_utils = m.def_submodule("cuda_utils", "Device memory and IPC on AscendCL.");
  deepinfer_ascend::bind_cuda_utils(cuda_utils);
  cuda_utils.attr("AclError") = m.attr("AclError");
  py::module_ graph_timer = m.def_submodule("graph_timer", "Timing handles on aclmdlRI models.");
  deepinfer_ascend::bind_graph_timer(graph_timer);
  graph_timer.attr("AclError") = m.attr("AclError");
}
