// Python binding of SamplingParams (core/sampling_params.h): the one form of a request's
// sampling parameters across the language boundary. The constructor and every property
// assignment convert the Python value (TypeError naming the field for a wrong type) and then
// run SamplingParams::validate (ValueError naming the field): an object that exists is valid,
// and a refused assignment leaves it unchanged.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/typing.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "python/bindings.h"
#include "python/buffer_check.h"
#include "python/loose_ints.h"
#include "python/sampling_params_arg.h"

namespace py = pybind11;

namespace deepinfer {

namespace {

std::string type_name(const py::handle& v) { return std::string(py::str(py::type::of(v).attr("__name__"))); }

// Python's bool and numpy's bool_ (True is not a count, a token id or a temperature).
bool is_bool(const py::handle& v) {
  if (PyBool_Check(v.ptr())) return true;
  // the usual values first, without attribute lookups
  if (PyLong_CheckExact(v.ptr()) || PyFloat_CheckExact(v.ptr()) || v.is_none()) return false;
  const py::handle t = py::type::of(v);
  const std::string mod = py::str(t.attr("__module__"));
  if (mod != "numpy") return false;
  const std::string name = py::str(t.attr("__name__"));
  return name == "bool" || name == "bool_";
}

int64_t as_int64(const py::handle& v, const char* name) {
  if (is_bool(v) || !(PyLong_Check(v.ptr()) || py::hasattr(v, "__index__")))
    throw py::type_error(std::string(name) + ": expected int, got " + type_name(v));
  return python_int64(v, name);
}

int32_t as_int32(const py::handle& v, const char* name) {
  const int64_t x = as_int64(v, name);
  if (x < INT32_MIN || x > INT32_MAX) buf::fail(name, std::to_string(x) + " is out of the int32 range");
  return static_cast<int32_t>(x);
}

double as_double(const py::handle& v, const char* name) {
  if (is_bool(v) || !(PyFloat_Check(v.ptr()) || PyLong_Check(v.ptr()) || py::hasattr(v, "__float__")))
    throw py::type_error(std::string(name) + ": expected float, got " + type_name(v));
  const double x = PyFloat_AsDouble(v.ptr());
  if (x == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();  // e.g. an int too large for a double
    buf::fail(name, std::string(py::repr(v)) + " is not representable as a float");
  }
  return x;
}

bool as_bool(const py::handle& v, const char* name) {
  if (!is_bool(v)) throw py::type_error(std::string(name) + ": expected bool, got " + type_name(v));
  return PyObject_IsTrue(v.ptr()) == 1;
}

// Token ids from a list, tuple or 1-D integer numpy array, in the given order. Refuses a
// scalar, a string, a dict or set and bool items (TypeError), ids outside [0, 2^31) (ValueError).
std::vector<int32_t> token_ids(const py::handle& v, const std::string& name) {
  const bool array = py::isinstance<py::array>(v);
  if (!array && (py::isinstance<py::str>(v) || py::isinstance<py::bytes>(v) || PyDict_Check(v.ptr()) ||
                 PyAnySet_Check(v.ptr()) || !PySequence_Check(v.ptr())))
    throw py::type_error(name + ": expected a list of token ids, got " + type_name(v));
  if (!array)
    for (auto item : v)
      if (is_bool(item)) throw py::type_error(name + ": expected int token ids, got bool");
  return loose_ints(v, name.c_str(), 0);
}

std::vector<int32_t> token_set(const py::handle& v, const char* name) {
  auto ids = token_ids(v, name);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

py::list int_list(const std::vector<int32_t>& v) {
  py::list l(v.size());
  for (size_t i = 0; i < v.size(); ++i) l[i] = py::int_(v[i]);
  return l;
}

// One Python-visible field: its name, how a Python value is stored, and how it is read.
struct Field {
  const char* name;
  void (*set)(SamplingParams&, const py::handle&);
  py::object (*get)(const SamplingParams&);
  const char* doc;
};

#define DI_INT_FIELD(F, DOC)                                                                   \
  Field {                                                                                      \
    #F, [](SamplingParams& p, const py::handle& v) { p.F = as_int32(v, #F); },                 \
        [](const SamplingParams& p) -> py::object { return py::int_(p.F); }, DOC                \
  }
#define DI_FLOAT_FIELD(F, DOC)                                                                 \
  Field {                                                                                      \
    #F, [](SamplingParams& p, const py::handle& v) { p.F = as_double(v, #F); },                \
        [](const SamplingParams& p) -> py::object { return py::float_(p.F); }, DOC              \
  }
#define DI_COUNT_FIELD(F, DOC)                                                                 \
  Field {                                                                                      \
    #F,                                                                                        \
        [](SamplingParams& p, const py::handle& v) {                                           \
          if (v.is_none()) { p.F = -1; return; }                                               \
          const int32_t k = as_int32(v, #F);                                                   \
          if (k < 0) buf::fail(#F, std::to_string(k) + " must be >= 0 (or None)");           \
          p.F = k;                                                                             \
        },                                                                                     \
        [](const SamplingParams& p) -> py::object {                                            \
          return p.F < 0 ? py::object(py::none()) : py::object(py::int_(p.F));                 \
        },                                                                                     \
        DOC                                                                                    \
  }

const std::vector<Field>& fields() {
  static const std::vector<Field> f = {
      DI_INT_FIELD(n, "int: samples per prompt, >= 1 (they share the prompt's KV blocks)."),
      DI_FLOAT_FIELD(temperature, "float: >= 0; 0 = greedy, else logits are divided by it."),
      DI_FLOAT_FIELD(top_p, "float in (0, 1]: keep the smallest set of tokens reaching this probability."),
      DI_INT_FIELD(top_k, "int: keep the k most likely tokens; -1 = off (0 is refused here)."),
      DI_FLOAT_FIELD(min_p, "float in [0, 1]: drop tokens less likely than min_p times the most likely."),
      DI_FLOAT_FIELD(presence_penalty, "float in [-2, 2]: subtracted once from tokens already generated."),
      DI_FLOAT_FIELD(frequency_penalty, "float in [-2, 2]: subtracted per occurrence in the output."),
      DI_FLOAT_FIELD(repetition_penalty,
                     "float > 0: logits of tokens seen in prompt or output divided (positive) or multiplied "
                     "(negative) by it; 1 = off."),
      Field{"seed",
            [](SamplingParams& p, const py::handle& v) {
              if (v.is_none()) {
                p.has_seed = false;
                p.seed = 0;
              } else {
                p.seed = as_int64(v, "seed");
                p.has_seed = true;
              }
            },
            [](const SamplingParams& p) -> py::object {
              return p.has_seed ? py::object(py::int_(p.seed)) : py::object(py::none());
            },
            "int | None: the request's RNG seed (int64); None derives one from the sampler's seed."},
      Field{"stop_token_ids",
            [](SamplingParams& p, const py::handle& v) {
              p.stop_token_ids = v.is_none() ? std::vector<int32_t>{} : token_set(v, "stop_token_ids");
            },
            [](const SamplingParams& p) -> py::object { return int_list(p.stop_token_ids); },
            "list[int]: token ids that end a completion (sorted, unique)."},
      Field{"ignore_eos", [](SamplingParams& p, const py::handle& v) { p.ignore_eos = as_bool(v, "ignore_eos"); },
            [](const SamplingParams& p) -> py::object { return py::bool_(p.ignore_eos); },
            "bool: keep generating after the end-of-sequence token."},
      DI_INT_FIELD(max_tokens, "int >= 1: most tokens to generate."),
      DI_INT_FIELD(min_tokens, "int in [0, max_tokens]: no EOS or stop token id ends a completion before."),
      DI_COUNT_FIELD(logprobs, "int | None: report the sampled token's logprob and the top-k (0..20)."),
      DI_COUNT_FIELD(prompt_logprobs, "int | None: report each prompt token's logprob and the top-k (0..20)."),
      Field{"logit_bias",
            [](SamplingParams& p, const py::handle& v) {
              std::vector<std::pair<int32_t, double>> bias;
              if (!v.is_none()) {
                if (!PyDict_Check(v.ptr()))
                  throw py::type_error("logit_bias: expected a dict {token_id: bias}, got " + type_name(v));
                for (auto [k, b] : py::reinterpret_borrow<py::dict>(v)) {
                  if (is_bool(k) || !(PyLong_Check(k.ptr()) || py::hasattr(k, "__index__")))
                    throw py::type_error("logit_bias: keys must be int token ids, got " + type_name(k) + " " +
                                         std::string(py::repr(k)));
                  const int64_t t = python_int64(k, "logit_bias");
                  if (t < INT32_MIN || t > INT32_MAX)
                    buf::fail("logit_bias", "token id " + std::to_string(t) + " is out of the int32 range");
                  const std::string where = "logit_bias[" + std::to_string(t) + "]";
                  bias.emplace_back(static_cast<int32_t>(t), as_double(b, where.c_str()));
                }
                std::sort(bias.begin(), bias.end());
              }
              p.logit_bias = std::move(bias);
            },
            [](const SamplingParams& p) -> py::object {
              py::dict d;
              for (const auto& [t, b] : p.logit_bias) d[py::int_(t)] = py::float_(b);
              return d;
            },
            "dict[int, float]: bias in [-100, 100] added to a token's logit before sampling."},
      Field{"allowed_token_ids",
            [](SamplingParams& p, const py::handle& v) {
              if (v.is_none()) {
                p.allowed_token_ids.clear();
                return;
              }
              auto ids = token_set(v, "allowed_token_ids");
              if (ids.empty()) buf::fail("allowed_token_ids", "must not be empty (None allows every token)");
              p.allowed_token_ids = std::move(ids);
            },
            [](const SamplingParams& p) -> py::object {
              return p.allowed_token_ids.empty() ? py::object(py::none()) : py::object(int_list(p.allowed_token_ids));
            },
            "list[int] | None: only these tokens may be sampled (sorted, unique); None = every token."},
      Field{"banned_token_ids",
            [](SamplingParams& p, const py::handle& v) {
              p.banned_token_ids = v.is_none() ? std::vector<int32_t>{} : token_set(v, "banned_token_ids");
            },
            [](const SamplingParams& p) -> py::object { return int_list(p.banned_token_ids); },
            "list[int]: tokens never sampled (sorted, unique)."},
      Field{"bad_words_token_ids",
            [](SamplingParams& p, const py::handle& v) {
              std::vector<std::vector<int32_t>> words;
              if (!v.is_none()) {
                if (py::isinstance<py::str>(v) || py::isinstance<py::bytes>(v) || PyDict_Check(v.ptr()) ||
                    PyAnySet_Check(v.ptr()) || !PySequence_Check(v.ptr()))
                  throw py::type_error("bad_words_token_ids: expected a list of token-id lists, got " + type_name(v));
                size_t i = 0;
                for (auto w : v) {
                  words.push_back(token_ids(w, "bad_words_token_ids[" + std::to_string(i) + "]"));
                  ++i;
                }
              }
              p.bad_words_token_ids = std::move(words);
            },
            [](const SamplingParams& p) -> py::object {
              py::list l;
              for (const auto& w : p.bad_words_token_ids) l.append(int_list(w));
              return l;
            },
            "list[list[int]]: vLLM's bad words as token sequences: the token that would complete one "
            "is never sampled (a one-token word: always; a longer word: when the output ends with its "
            "other tokens)."},
  };
  return f;
}

#undef DI_INT_FIELD
#undef DI_FLOAT_FIELD
#undef DI_COUNT_FIELD

const Field* find_field(const std::string& name) {
  for (const Field& f : fields())
    if (name == f.name) return &f;
  return nullptr;
}

// Sets the given keyword arguments on a copy of `base` and validates it (no vocabulary).
SamplingParams from_kwargs(const py::handle& kwargs, const SamplingParams& base = {}) {
  SamplingParams p = base;
  if (!kwargs.is_none())
    for (auto [k, v] : py::reinterpret_borrow<py::dict>(kwargs)) {
      const std::string key = py::str(k);
      const Field* f = find_field(key);
      if (!f) throw py::type_error("SamplingParams() got an unexpected keyword argument '" + key + "'");
      f->set(p, v);
    }
  p.validate(0);
  return p;
}

py::dict to_kwargs(const SamplingParams& p) {
  py::dict d;
  for (const Field& f : fields()) d[f.name] = f.get(p);
  return d;
}

const char* kInitSignature =
    "__init__(self, *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, "
    "min_p: float = 0.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0, "
    "repetition_penalty: float = 1.0, seed: int | None = None, stop_token_ids: typing.Any = None, "
    "ignore_eos: bool = False, max_tokens: int = 16, min_tokens: int = 0, logprobs: int | None = None, "
    "prompt_logprobs: int | None = None, logit_bias: dict[int, float] | None = None, "
    "allowed_token_ids: typing.Any = None, banned_token_ids: typing.Any = None, "
    "bad_words_token_ids: typing.Any = None) -> None\n\n";

}  // namespace

bool is_sampling_field(const std::string& name) { return find_field(name) != nullptr; }

void bind_sampling_params(py::module_& m) {
  py::class_<SamplingParams> cls(m, "SamplingParams", R"doc(
A request's sampling parameters as the engine holds them (vLLM's names and defaults), taken by
Scheduler.add_request and SequenceMetadataPool.add_sequence. Every rule lives in the C++
SamplingParams::validate: the constructor and every property assignment check the value and
raise TypeError (wrong type: bool where an int or float is expected, a string for a token
list...) or ValueError (out of bounds), the message starting with the field's name
("temperature: -0.5 must be a finite value >= 0"); a refused assignment changes nothing.
Numbers may be Python or numpy scalars; token-id lists may be lists, tuples or 1-D integer
numpy arrays. validate(vocab_size) also bounds the token ids by a vocabulary (add_request does).
deepinfer.SamplingParams (the runtime's) holds one of these for every field the engine uses.)doc");
  {
    py::options sig;
    sig.disable_function_signatures();
    cls.def(py::init([](const py::kwargs& kw) { return from_kwargs(kw); }),
            (std::string(kInitSignature) + "Keyword arguments only; see the class docstring.").c_str());
  }
  // One property per field: a typed getter (for the stubs) and the field's checked setter.
  auto setter = [](const char* name) {
    return [set = find_field(name)->set](SamplingParams& p, const py::object& v) {
      SamplingParams next = p;
      set(next, v);
      next.validate(0);
      p = std::move(next);
    };
  };
#define DI_PROPERTY(NAME, ...)                                                                   \
  cls.def_property(#NAME, [](const SamplingParams& p) { return __VA_ARGS__; }, setter(#NAME), \
                   find_field(#NAME)->doc)
  using Ids = std::vector<int32_t>;
  DI_PROPERTY(n, p.n);
  DI_PROPERTY(temperature, p.temperature);
  DI_PROPERTY(top_p, p.top_p);
  DI_PROPERTY(top_k, p.top_k);
  DI_PROPERTY(min_p, p.min_p);
  DI_PROPERTY(presence_penalty, p.presence_penalty);
  DI_PROPERTY(frequency_penalty, p.frequency_penalty);
  DI_PROPERTY(repetition_penalty, p.repetition_penalty);
  DI_PROPERTY(seed, p.has_seed ? std::optional<int64_t>(p.seed) : std::nullopt);
  DI_PROPERTY(stop_token_ids, p.stop_token_ids);
  DI_PROPERTY(ignore_eos, p.ignore_eos);
  DI_PROPERTY(max_tokens, p.max_tokens);
  DI_PROPERTY(min_tokens, p.min_tokens);
  DI_PROPERTY(logprobs, p.logprobs < 0 ? std::nullopt : std::optional<int32_t>(p.logprobs));
  DI_PROPERTY(prompt_logprobs, p.prompt_logprobs < 0 ? std::nullopt : std::optional<int32_t>(p.prompt_logprobs));
  DI_PROPERTY(logit_bias, std::map<int32_t, double>(p.logit_bias.begin(), p.logit_bias.end()));
  DI_PROPERTY(allowed_token_ids, p.allowed_token_ids.empty() ? std::nullopt : std::optional<Ids>(p.allowed_token_ids));
  DI_PROPERTY(banned_token_ids, p.banned_token_ids);
  DI_PROPERTY(bad_words_token_ids, p.bad_words_token_ids);
#undef DI_PROPERTY
  for (const Field& f : fields())  // (every field has its property)
    if (!py::hasattr(cls, f.name)) throw std::logic_error(std::string("SamplingParams: no property ") + f.name);
  cls.def(
         "validate",
         [](const SamplingParams& p, int32_t vocab_size) {
           if (vocab_size < 0) buf::fail("vocab_size", std::to_string(vocab_size) + " must be >= 0");
           p.validate(vocab_size);
         },
         py::arg("vocab_size") = 0,
         "Check every field again, token ids against [0, vocab_size) and logprob counts against "
         "vocab_size (0: no vocabulary). Raises ValueError naming the field.")
      .def(
          "replace",
          [](const SamplingParams& p, const py::kwargs& kw) { return from_kwargs(kw, p); },
          "A validated copy with the given fields changed (keyword arguments as in the constructor).")
      .def("__eq__", [](const SamplingParams& a, const SamplingParams& b) { return a == b; }, py::is_operator())
      .def("__copy__", [](const SamplingParams& p) { return SamplingParams(p); })
      .def("__deepcopy__", [](const SamplingParams& p, const py::handle&) { return SamplingParams(p); },
           py::arg("memo"))
      .def("__repr__",
           [](const SamplingParams& p) {
             std::string s = "SamplingParams(";
             for (const Field& f : fields()) {
               if (&f != &fields().front()) s.append(", ");
               s.append(f.name).append("=").append(py::repr(f.get(p)).cast<std::string>());
             }
             return s.append(")");
           })
      .def(py::pickle([](const SamplingParams& p) { return to_kwargs(p); },
                      [](const py::dict& d) { return from_kwargs(d); }));
  cls.attr("__hash__") = py::none();  // mutable, compared by value
  cls.attr("FIELDS") = [] {
    py::tuple t(fields().size());
    for (size_t i = 0; i < fields().size(); ++i) t[i] = py::str(fields()[i].name);
    return t;
  }();
}

}  // namespace deepinfer
