// Python bindings of the Engram lookup table: set_engram_lookup_table, encode_compressed.
#include <pybind11/numpy.h>

#include "python/bindings.h"
#include "python/buffer_check.h"
#include "step/engram.h"

namespace py = pybind11;

namespace deepinfer {

namespace {
using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// Loose 1-D integer input (list or integer array) as int64; floats and strings are refused.
I64Array int_array(const py::handle& obj, const char* name) {
  if (py::isinstance<py::array>(obj)) {
    auto a = py::reinterpret_borrow<py::array>(obj);
    const char kind = a.dtype().kind();
    if (kind != 'i' && kind != 'u')
      throw py::type_error(std::string(name) + ": expected an integer array, got dtype " + std::string(py::str(a.dtype())));
  } else if (py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj)) {
    throw py::type_error(std::string(name) + ": expected a 1-D sequence of ints, got str");
  } else if (py::isinstance<py::sequence>(obj)) {
    // forcecast would truncate 0.5 to 0 silently; refuse non-integral items.
    for (auto item : obj) {
      if (!py::isinstance<py::int_>(item) && !py::hasattr(item, "__index__"))
        throw py::type_error(std::string(name) + ": expected ints, got " +
                             std::string(py::str(py::type::of(item).attr("__name__"))));
    }
  }
  I64Array a;
  try {
    a = I64Array::ensure(obj);
  } catch (py::error_already_set&) {
  }
  if (!a) {
    PyErr_Clear();
    throw py::type_error(std::string(name) + ": expected a 1-D sequence of ints");
  }
  if (a.ndim() != 1) throw py::value_error(std::string(name) + ": expected a 1-D array, got shape " + buf::shape_str(a));
  return a;
}
}  // namespace

void bind_engram(py::module_& m) {
  m.def(
      "set_engram_lookup_table",
      [](const py::object& table, int64_t vocab_size) {
        if (table.is_none()) {
          set_engram_table(nullptr);
          return;
        }
        if (vocab_size < 1) throw py::value_error("vocab_size: must be >= 1, got " + std::to_string(vocab_size));
        I64Array a = int_array(table, "table");
        if (a.shape(0) != vocab_size)
          throw py::value_error("table: length " + std::to_string(a.shape(0)) + " != vocab_size " +
                                std::to_string(vocab_size));
        auto next = std::make_shared<EngramTable>(static_cast<size_t>(vocab_size));
        const int64_t* src = a.data();
        for (int64_t i = 0; i < vocab_size; ++i) {
          if (src[i] < 0 || src[i] >= vocab_size)
            throw py::value_error("table[" + std::to_string(i) + "]: compressed id must be in [0, " +
                                  std::to_string(vocab_size) + "), got " + std::to_string(src[i]));
          (*next)[i] = static_cast<int32_t>(src[i]);
        }
        set_engram_table(std::move(next));  // the old table stays alive for calls holding it
      },
      py::arg("table"), py::arg("vocab_size"),
      R"doc(Install the Engram vocabulary lookup table (token id -> compressed id) for the process.

table: list or 1-D integer array of length ``vocab_size``, every value in ``[0, vocab_size)``;
``None`` removes the table. Validated fully before it replaces the old table atomically (a
builder running in another thread keeps the table it started with). Raises ValueError /
TypeError naming the argument and the offending index and value; on error the previous table
stays installed.)doc");

  m.def(
      "encode_compressed",
      [](const py::handle& token_ids, const py::object& out) -> py::array {
        auto table = engram_table();
        if (!table) throw py::value_error("encode_compressed: no Engram lookup table installed (call set_engram_lookup_table)");
        I64Array ids = int_array(token_ids, "token_ids");
        const size_t n = static_cast<size_t>(ids.shape(0));
        const int64_t* src = ids.data();
        const int64_t vocab = static_cast<int64_t>(table->size());
        for (size_t i = 0; i < n; ++i) {
          if (src[i] < 0 || src[i] >= vocab)
            throw py::value_error("token_ids[" + std::to_string(i) + "]: must be in [0, " + std::to_string(vocab) +
                                  "), got " + std::to_string(src[i]));
        }
        py::array result;
        int32_t* dst;
        if (out.is_none()) {
          auto r = py::array_t<int32_t>(static_cast<py::ssize_t>(n));
          dst = r.mutable_data();
          result = r;
        } else {
          auto b = buf::check_1d<int32_t>(out, "out", n);
          dst = b.data;
          result = py::reinterpret_borrow<py::array>(out);
        }
        {
          py::gil_scoped_release nogil;
          const int32_t* t = table->data();
          for (size_t i = 0; i < n; ++i) dst[i] = t[src[i]];
        }
        return result;
      },
      py::arg("token_ids"), py::arg("out") = py::none(),
      R"doc(Map token ids to Engram compressed ids through the installed lookup table.

token_ids: list or 1-D integer array. out: optional borrowed int32 C-contiguous writable
buffer with at least ``len(token_ids)`` elements (written in place and returned); without it a
new int32 array is returned. Releases the GIL while mapping. Raises ValueError when no table is
installed or an id is outside the vocabulary (naming the index and value), TypeError for
non-integer input; nothing is written on error.)doc");
}

}  // namespace deepinfer
