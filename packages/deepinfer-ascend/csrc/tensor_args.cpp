#include "tensor_args.h"

#include <limits>

#include "acl_api.h"

namespace py = pybind11;

namespace deepinfer_ascend {

namespace {

const std::vector<DType>& dtype_table() {
  static const std::vector<DType> table = {
      {"float32", {kDLFloat, 32, 1}, 4},  {"float16", {kDLFloat, 16, 1}, 2}, {"bfloat16", {kDLBfloat, 16, 1}, 2},
      {"float64", {kDLFloat, 64, 1}, 8},  {"int8", {kDLInt, 8, 1}, 1},       {"int16", {kDLInt, 16, 1}, 2},
      {"int32", {kDLInt, 32, 1}, 4},      {"int64", {kDLInt, 64, 1}, 8},     {"uint8", {kDLUInt, 8, 1}, 1},
      {"bool", {kDLBool, 8, 1}, 1},
  };
  return table;
}

std::string supported_dtypes() {
  std::string out;
  for (const DType& d : dtype_table()) out += (out.empty() ? "" : ", ") + d.name;
  return out;
}

}  // namespace

std::string py_repr(py::handle obj) { return py::repr(obj).cast<std::string>(); }

DType parse_dtype(py::handle dtype, const char* arg) {
  std::string name;
  if (py::isinstance<py::str>(dtype)) {
    name = dtype.cast<std::string>();
  } else if (py::type::handle_of(dtype).attr("__module__").cast<std::string>() == "torch" &&
             py::type::handle_of(dtype).attr("__name__").cast<std::string>() == "dtype") {
    name = py::str(dtype).cast<std::string>();
  } else {
    throw py::type_error(std::string(arg) + " must be a torch.dtype or its name, got " + py_repr(dtype));
  }
  if (name.rfind("torch.", 0) == 0) name = name.substr(6);
  static const std::pair<const char*, const char*> aliases[] = {
      {"float", "float32"}, {"half", "float16"}, {"double", "float64"},
      {"short", "int16"},   {"int", "int32"},    {"long", "int64"}};
  for (const auto& [alias, canonical] : aliases)
    if (name == alias) name = canonical;
  for (const DType& d : dtype_table())
    if (d.name == name) return d;
  throw py::type_error(std::string(arg) + "=" + py_repr(dtype) + " is not supported (supported: " +
                       supported_dtypes() + ")");
}

std::vector<int64_t> parse_shape(py::handle shape, const char* arg) {
  if (py::isinstance<py::str>(shape) || !py::isinstance<py::sequence>(shape)) {
    throw py::type_error(std::string(arg) + " must be a sequence of ints, got " + py_repr(shape));
  }
  std::vector<int64_t> dims;
  std::size_t i = 0;
  for (py::handle item : shape) {
    if (py::isinstance<py::bool_>(item) || !(py::isinstance<py::int_>(item) || py::hasattr(item, "__index__"))) {
      throw py::type_error(std::string(arg) + "[" + std::to_string(i) + "] must be an int, got " + py_repr(item));
    }
    int64_t v = 0;
    try {
      v = py::reinterpret_steal<py::int_>(PyNumber_Index(item.ptr())).cast<int64_t>();
    } catch (const std::exception&) {
      throw py::value_error(std::string(arg) + "[" + std::to_string(i) + "]=" + py_repr(item) + " is out of range");
    }
    if (v < 0) {
      throw py::value_error(std::string(arg) + "[" + std::to_string(i) + "]=" + std::to_string(v) +
                            " is negative");
    }
    dims.push_back(v);
    ++i;
  }
  return dims;
}

int parse_device(py::handle device, const char* arg) {
  long index = -1;
  std::string type = "npu";
  if (py::isinstance<py::bool_>(device)) {
    throw py::type_error(std::string(arg) + " must be an int, 'npu:N' or a torch.device, got " + py_repr(device));
  } else if (py::isinstance<py::int_>(device)) {
    index = device.cast<long>();
  } else if (py::isinstance<py::str>(device)) {
    const std::string s = device.cast<std::string>();
    const auto colon = s.find(':');
    type = s.substr(0, colon);
    if (colon == std::string::npos) {
      index = 0;
    } else {
      try {
        std::size_t used = 0;
        index = std::stol(s.substr(colon + 1), &used);
        if (used != s.size() - colon - 1) index = -2;
      } catch (const std::exception&) {
        index = -2;
      }
      if (index == -2) throw py::value_error(std::string(arg) + "=" + py_repr(device) + " has no valid device index");
    }
  } else if (py::hasattr(device, "type") && py::hasattr(device, "index")) {  // torch.device
    type = py::str(device.attr("type")).cast<std::string>();
    py::object idx = device.attr("index");
    index = idx.is_none() ? 0 : idx.cast<long>();
  } else {
    throw py::type_error(std::string(arg) + " must be an int, 'npu:N' or a torch.device, got " + py_repr(device));
  }
  if (type != "npu") {
    throw py::value_error(std::string(arg) + "=" + py_repr(device) +
                          ": deepinfer-ascend places memory on 'npu' devices only");
  }
  const int count = device_count();
  if (index < 0 || index >= count) {
    throw py::value_error(std::string(arg) + "=" + py_repr(device) + " is out of range: " + std::to_string(count) +
                          " NPU(s) visible");
  }
  return static_cast<int>(index);
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (std::size_t i = shape.size(); i-- > 1;) strides[i - 1] = strides[i] * std::max<int64_t>(shape[i], 1);
  return strides;
}

std::size_t checked_numel(const std::vector<int64_t>& shape, std::size_t itemsize, const char* arg) {
  std::size_t numel = 1;
  for (int64_t d : shape) {
    if (d != 0 && numel > std::numeric_limits<std::size_t>::max() / static_cast<std::size_t>(d)) {
      throw py::value_error(std::string(arg) + " is too large: the element count overflows");
    }
    numel *= static_cast<std::size_t>(d);
  }
  if (numel > std::numeric_limits<std::size_t>::max() / itemsize / 2) {
    throw py::value_error(std::string(arg) + " is too large: the byte size overflows");
  }
  return numel;
}

}  // namespace deepinfer_ascend
