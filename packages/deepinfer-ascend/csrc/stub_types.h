// Python objects that the bindings take as they are (torch tensors, dtypes, devices) but whose
// type the generated stubs should name: AnyAs<"torch.Tensor"> accepts any object and appears
// as `torch.Tensor` in signatures. The functions validate the objects themselves.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/typing.h>

namespace deepinfer_ascend {

template <pybind11::typing::StringLiteral Name>
class AnyAs : public pybind11::object {
 public:
  using pybind11::object::object;
  AnyAs(const pybind11::object& o) : pybind11::object(o) {}  // NOLINT: implicit on purpose
  static bool check_(pybind11::handle h) { return h.ptr() != nullptr; }
};

using TensorObj = AnyAs<"torch.Tensor">;
using DTypeObj = AnyAs<"torch.dtype | str">;
using DeviceObj = AnyAs<"int | str | torch.device">;
using ShapeObj = AnyAs<"collections.abc.Sequence[int]">;
using HandleObj = AnyAs<"dict[str, typing.Any]">;

}  // namespace deepinfer_ascend

namespace pybind11::detail {
template <pybind11::typing::StringLiteral Name>
struct handle_type_name<deepinfer_ascend::AnyAs<Name>> {
  static constexpr auto name = const_name(sanitize_string_literal<Name>().name);
};
}  // namespace pybind11::detail
