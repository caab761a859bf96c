// deepinfer_engine._cpu_kernels: the native CPU decode path (no torch dependency; numpy buffers).
// Every buffer is validated when it is registered or passed (dtype, shape, contiguity, index
// bounds): bad input is a TypeError/ValueError naming the argument, never a crash.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cpu_kernels/decode_model.h"

namespace py = pybind11;
using namespace deepinfer::cpu;

namespace {

std::string shape_str(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

template <class T>
py::array checked(const py::handle& obj, const std::string& name, int ndim, bool writable = false) {
  if (!py::isinstance<py::array>(obj))
    throw py::type_error(name + ": expected a numpy.ndarray, got " + std::string(py::str(py::type::of(obj).attr("__name__"))));
  auto a = py::reinterpret_borrow<py::array>(obj);
  // equivalence, not identity: a memory-mapped file's uint8 is another dtype object
  if (!py::detail::npy_api::get().PyArray_EquivTypes_(a.dtype().ptr(), py::dtype::of<T>().ptr()))
    throw py::type_error(name + ": expected dtype " + std::string(py::str(py::dtype::of<T>())) + ", got " +
                         std::string(py::str(a.dtype())));
  if (a.ndim() != ndim)
    throw py::value_error(name + ": expected a " + std::to_string(ndim) + "-D array, got shape " + shape_str(a));
  if (!(a.flags() & py::array::c_style)) throw py::value_error(name + ": must be C-contiguous");
  if (writable && !a.writeable()) throw py::value_error(name + ": must be writable");
  return a;
}

WeightKind parse_kind(const std::string& kind, const std::string& name) {
  if (kind == "F32") return WeightKind::F32;
  if (kind == "Q4_0") return WeightKind::Q4_0;
  if (kind == "Q4_1") return WeightKind::Q4_1;
  if (kind == "Q5_0") return WeightKind::Q5_0;
  if (kind == "Q8_0") return WeightKind::Q8_0;
  if (kind == "Q4_K") return WeightKind::Q4_K;
  if (kind == "Q5_K") return WeightKind::Q5_K;
  if (kind == "Q6_K") return WeightKind::Q6_K;
  throw py::value_error(name + ": weight type must be one of F32, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, got '" +
                        kind + "'");
}

// (kind, array): F32 -> float32 [rows, cols]; quantized -> uint8 [rows, bytes per row] of whole blocks.
Linear parse_linear(const py::handle& spec, const std::string& name, int rows, int cols, std::vector<py::object>& keep) {
  if (!py::isinstance<py::tuple>(spec) || py::len(spec) != 2)
    throw py::type_error(name + ": expected a (weight type, numpy array) tuple");
  auto t = py::reinterpret_borrow<py::tuple>(spec);
  Linear w;
  w.kind = parse_kind(py::cast<std::string>(t[0]), name);
  py::array a = w.kind == WeightKind::F32 ? checked<float>(t[1], name, 2) : checked<uint8_t>(t[1], name, 2);
  w.rows = static_cast<int>(a.shape(0));
  if (w.kind == WeightKind::F32) {
    w.cols = static_cast<int>(a.shape(1));
    w.row_bytes = sizeof(float) * static_cast<size_t>(w.cols);
  } else {
    const size_t bb = block_bytes(w.kind);
    w.row_bytes = static_cast<size_t>(a.shape(1));
    if (w.row_bytes % bb)
      throw py::value_error(name + ": rows of " + std::to_string(w.row_bytes) + " bytes are not whole " +
                            std::to_string(bb) + "-byte blocks of " + std::to_string(block_weights(w.kind)) +
                            " weights (" + py::cast<std::string>(t[0]) + ")");
    w.cols = static_cast<int>(w.row_bytes / bb * block_weights(w.kind));
  }
  if ((rows >= 0 && w.rows != rows) || (cols >= 0 && w.cols != cols))
    throw py::value_error(name + ": expected a [" + std::to_string(rows) + ", " + std::to_string(cols) +
                          "] weight, got [" + std::to_string(w.rows) + ", " + std::to_string(w.cols) + "]");
  w.data = static_cast<const uint8_t*>(a.data());
  keep.push_back(a);
  return w;
}

const float* vector_of(const py::handle& obj, const std::string& name, int size, std::vector<py::object>& keep) {
  py::array a = checked<float>(obj, name, 1);
  if (a.shape(0) != size)
    throw py::value_error(name + ": expected " + std::to_string(size) + " values, got " + std::to_string(a.shape(0)));
  keep.push_back(a);
  return static_cast<const float*>(a.data());
}

const Kernels& kernels_named(const std::string& isa) {
  if (isa == "best") return best_kernels();
  if (isa == "generic") return generic_kernels();
#if defined(DEEPINFER_HAVE_AVX2_KERNELS)
  if (isa == "avx2") {
    if (&best_kernels() == &generic_kernels()) throw py::value_error("isa='avx2': this CPU lacks AVX2/FMA/F16C");
    return avx2_kernels();
  }
  if (isa == "avx512vnni") {
    if (&best_kernels() != &avx512_kernels()) throw py::value_error("isa='avx512vnni': this CPU lacks AVX-512 VNNI");
    return avx512_kernels();
  }
#endif
  throw py::value_error("isa must be 'best', 'generic' or an instruction set this build has (see available_isas()), got '" + isa + "'");
}

class PyDecodeModel {
 public:
  PyDecodeModel(int hidden, int intermediate, int layers, int heads, int kv_heads, int head_dim, int vocab, float eps,
                int threads, const std::string& isa) {
    auto positive = [](int v, const char* name) {
      if (v <= 0) throw py::value_error(std::string(name) + " must be positive, got " + std::to_string(v));
    };
    positive(hidden, "hidden_size");
    positive(intermediate, "intermediate_size");
    positive(layers, "num_layers");
    positive(heads, "num_heads");
    positive(kv_heads, "num_kv_heads");
    positive(head_dim, "head_dim");
    positive(vocab, "vocab_size");
    positive(threads, "num_threads");
    if (heads % kv_heads) throw py::value_error("num_heads must be a multiple of num_kv_heads");
    if (head_dim % 2) throw py::value_error("head_dim must be even (rotary halves)");
    if (!(eps > 0.0f)) throw py::value_error("rms_norm_eps must be positive");
    ModelShape s{hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, eps};
    model_ = std::make_unique<DecodeModel>(s, threads, kernels_named(isa));
  }

  void set_embedding(const py::handle& spec) {
    model_->embedding = parse_linear(spec, "embedding", shape().vocab, shape().hidden, keep_);
  }

  void set_output(const py::handle& norm, const py::handle& head) {
    const Linear h = parse_linear(head, "lm_head", shape().vocab, shape().hidden, keep_);
    check_activation_blocks(h, "lm_head");
    model_->final_norm = vector_of(norm, "final_norm", shape().hidden, keep_);
    model_->head = model_->regrouped(h);
  }

  void set_rotary(const py::handle& cos, const py::handle& sin) {
    py::array c = checked<float>(cos, "rope_cos", 2), s = checked<float>(sin, "rope_sin", 2);
    if (c.shape(1) != shape().head_dim || s.shape(0) != c.shape(0) || s.shape(1) != c.shape(1))
      throw py::value_error("rope_cos/rope_sin: expected two [positions, head_dim=" + std::to_string(shape().head_dim) +
                            "] tables, got " + shape_str(c) + " and " + shape_str(s));
    keep_.push_back(c);
    keep_.push_back(s);
    model_->rope_cos = static_cast<const float*>(c.data());
    model_->rope_sin = static_cast<const float*>(s.data());
    model_->rope_positions = static_cast<int>(c.shape(0));
  }

  void set_layer(int index, const py::handle& attn_norm, const py::handle& q, const py::handle& k, const py::handle& v,
                 const py::handle& o, const py::handle& ffn_norm, const py::handle& gate, const py::handle& up,
                 const py::handle& down, const py::handle& qkv_bias, const py::handle& kv_cache) {
    const auto& s = shape();
    if (index < 0 || index >= s.layers)
      throw py::value_error("layer index " + std::to_string(index) + " out of range [0, " + std::to_string(s.layers) + ")");
    const std::string p = "layer " + std::to_string(index) + " ";
    const int qw = s.heads * s.head_dim, kvw = s.kv_heads * s.head_dim;
    LayerWeights l;
    l.attn_norm = vector_of(attn_norm, p + "attn_norm", s.hidden, keep_);
    l.ffn_norm = vector_of(ffn_norm, p + "ffn_norm", s.hidden, keep_);
    l.q = parse_linear(q, p + "q_proj", qw, s.hidden, keep_);
    l.k = parse_linear(k, p + "k_proj", kvw, s.hidden, keep_);
    l.v = parse_linear(v, p + "v_proj", kvw, s.hidden, keep_);
    l.o = parse_linear(o, p + "o_proj", s.hidden, qw, keep_);
    l.gate = parse_linear(gate, p + "gate_proj", s.intermediate, s.hidden, keep_);
    l.up = parse_linear(up, p + "up_proj", s.intermediate, s.hidden, keep_);
    l.down = parse_linear(down, p + "down_proj", s.hidden, s.intermediate, keep_);
    for (const Linear* w : {&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down}) check_activation_blocks(*w, p + "projection");
    if (!qkv_bias.is_none()) l.qkv_bias = vector_of(qkv_bias, p + "qkv_bias", qw + 2 * kvw, keep_);
    py::array c = checked<float>(kv_cache, p + "kv_cache", 5, true);
    if (c.shape(0) != 2 || c.shape(3) != s.kv_heads || c.shape(4) != s.head_dim || c.shape(1) < 1 || c.shape(2) < 1)
      throw py::value_error(p + "kv_cache: expected [2, blocks, block_size, " + std::to_string(s.kv_heads) + ", " +
                            std::to_string(s.head_dim) + "], got " + shape_str(c));
    const int nb = static_cast<int>(c.shape(1)), bs = static_cast<int>(c.shape(2));
    if (model_->block_size && (nb != model_->cache_blocks || bs != model_->block_size))
      throw py::value_error(p + "kv_cache: every layer's cache must have the same blocks and block size");
    model_->cache_blocks = nb;
    model_->block_size = bs;
    keep_.push_back(c);
    for (Linear* w : {&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down}) *w = model_->regrouped(*w);
    l.kv_cache = static_cast<float*>(c.mutable_data());
    l.set = true;
    model_->layers[static_cast<size_t>(index)] = l;
  }

  py::array_t<float> decode(const py::handle& ids_o, const py::handle& pos_o, const py::handle& slots_o,
                            const py::handle& lens_o, const py::handle& tables_o, const py::handle& table_rows_o,
                            const py::handle& logit_rows_o) {
    check_ready();
    py::array ids = checked<int64_t>(ids_o, "input_ids", 1), pos = checked<int64_t>(pos_o, "positions", 1);
    py::array slots = checked<int64_t>(slots_o, "slot_mapping", 1), lens = checked<int64_t>(lens_o, "seq_lens", 1);
    py::array tables = checked<int64_t>(tables_o, "block_tables", 2);
    const py::ssize_t rows = ids.shape(0);
    if (rows < 1) throw py::value_error("input_ids: a decode step needs at least one row");
    for (auto [a, n] : {std::pair{&pos, "positions"}, {&slots, "slot_mapping"}, {&lens, "seq_lens"}})
      if (a->shape(0) != rows)
        throw py::value_error(std::string(n) + ": expected " + std::to_string(rows) + " entries (one per row), got " +
                              std::to_string(a->shape(0)));
    py::array table_rows, logit_rows;
    if (!table_rows_o.is_none()) {
      table_rows = checked<int64_t>(table_rows_o, "table_rows", 1);
      if (table_rows.shape(0) != rows)
        throw py::value_error("table_rows: expected " + std::to_string(rows) + " entries (one per row), got " +
                              std::to_string(table_rows.shape(0)));
      const auto* tr = static_cast<const int64_t*>(table_rows.data());
      for (py::ssize_t b = 0; b < rows; ++b)
        if (tr[b] < 0 || tr[b] >= tables.shape(0))
          throw py::value_error("table_rows[" + std::to_string(b) + "]=" + std::to_string(tr[b]) + " out of range [0, " +
                                std::to_string(tables.shape(0)) + ")");
    } else if (tables.shape(0) < rows) {
      throw py::value_error("block_tables: expected at least " + std::to_string(rows) + " rows, got " + shape_str(tables));
    }
    py::ssize_t out_rows = rows;
    if (!logit_rows_o.is_none()) {
      logit_rows = checked<int64_t>(logit_rows_o, "logit_rows", 1);
      out_rows = logit_rows.shape(0);
      if (out_rows > rows)
        throw py::value_error("logit_rows: at most " + std::to_string(rows) + " entries (one per row), got " +
                              std::to_string(out_rows));
      const auto* lr = static_cast<const int64_t*>(logit_rows.data());
      for (py::ssize_t i = 0; i < out_rows; ++i)
        if (lr[i] < 0 || lr[i] >= rows)
          throw py::value_error("logit_rows[" + std::to_string(i) + "]=" + std::to_string(lr[i]) + " out of range [0, " +
                                std::to_string(rows) + ")");
    }
    StepInputs in;
    in.rows = static_cast<int>(rows);
    in.ids = static_cast<const int64_t*>(ids.data());
    in.positions = static_cast<const int64_t*>(pos.data());
    in.slots = static_cast<const int64_t*>(slots.data());
    in.seq_lens = static_cast<const int64_t*>(lens.data());
    in.block_tables = static_cast<const int64_t*>(tables.data());
    in.table_width = static_cast<int>(tables.shape(1));
    if (!table_rows_o.is_none()) in.table_rows = static_cast<const int64_t*>(table_rows.data());
    if (!logit_rows_o.is_none()) {
      in.logit_rows = static_cast<const int64_t*>(logit_rows.data());
      in.num_logit_rows = static_cast<int>(out_rows);
    }
    const auto& m = *model_;
    const int64_t bs = m.block_size, slots_total = static_cast<int64_t>(m.cache_blocks) * bs;
    for (int b = 0; b < in.rows; ++b) {
      const std::string at = "[" + std::to_string(b) + "]";
      if (in.ids[b] < 0 || in.ids[b] >= shape().vocab)
        throw py::value_error("input_ids" + at + "=" + std::to_string(in.ids[b]) + " out of range [0, " + std::to_string(shape().vocab) + ")");
      if (in.positions[b] < 0 || in.positions[b] >= m.rope_positions)
        throw py::value_error("positions" + at + "=" + std::to_string(in.positions[b]) + " out of range [0, " + std::to_string(m.rope_positions) + ")");
      if (in.slots[b] < 0 || in.slots[b] >= slots_total)
        throw py::value_error("slot_mapping" + at + "=" + std::to_string(in.slots[b]) + " out of range [0, " + std::to_string(slots_total) + ")");
      const int64_t len = in.seq_lens[b];
      if (len < 1 || len > static_cast<int64_t>(in.table_width) * bs)
        throw py::value_error("seq_lens" + at + "=" + std::to_string(len) + " out of range [1, " + std::to_string(in.table_width * bs) + "]");
      const int64_t* table = in.table_of(b);
      for (int64_t i = 0; i < (len + bs - 1) / bs; ++i) {
        const int64_t blk = table[i];
        if (blk < 0 || blk >= m.cache_blocks)
          throw py::value_error("block_tables[" + std::to_string(in.table_rows ? in.table_rows[b] : b) + ", " +
                                std::to_string(i) + "]=" + std::to_string(blk) +
                                " out of range [0, " + std::to_string(m.cache_blocks) + ")");
      }
    }
    py::array_t<float> logits({out_rows, static_cast<py::ssize_t>(shape().vocab)});
    float* out = logits.mutable_data();
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mutex_);
      model_->decode(in, out);
    }
    return logits;
  }

  // {phase: mean seconds per step} since the last call (then reset); enabling starts a fresh count
  py::dict phase_times() {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& m = *model_;
    py::dict out;
    for (int p = 0; p < kPhases; ++p)
      out[kPhaseNames[p]] = m.profiled_steps ? m.phase_seconds[static_cast<size_t>(p)] / m.profiled_steps : 0.0;
    m.phase_seconds.fill(0.0);
    m.profiled_steps = 0;
    return out;
  }
  bool profiling() const { return model_->profiling; }
  void set_profiling(bool on) {
    std::lock_guard<std::mutex> lock(mutex_);
    model_->profiling = on;
    model_->phase_seconds.fill(0.0);
    model_->profiled_steps = 0;
  }

  bool contention_backoff() const { return model_->contention_backoff; }
  void set_contention_backoff(bool on) {
    std::lock_guard<std::mutex> lock(mutex_);
    model_->contention_backoff = on;
  }
  int64_t solo_steps() {
    std::lock_guard<std::mutex> lock(mutex_);
    return model_->solo_steps;
  }
  const ModelShape& shape() const { return model_->shape(); }
  int threads() const { return model_->threads(); }
  std::string isa() const { return model_->kernels().name; }
  DecodeModel& model() { return *model_; }

 private:
  void check_activation_blocks(const Linear& w, const std::string& name) const {
    if (w.kind != WeightKind::F32 && w.cols % kBlock)
      throw py::value_error(name + ": quantized weights need a multiple of 32 inputs, got " + std::to_string(w.cols));
  }
  void check_ready() const {
    const auto& m = *model_;
    if (!m.embedding.data) throw py::value_error("DecodeModel: set_embedding was not called");
    if (!m.head.data) throw py::value_error("DecodeModel: set_output was not called");
    if (!m.rope_cos) throw py::value_error("DecodeModel: set_rotary was not called");
    for (size_t i = 0; i < m.layers.size(); ++i)
      if (!m.layers[i].set) throw py::value_error("DecodeModel: layer " + std::to_string(i) + " was not set");
  }

  std::unique_ptr<DecodeModel> model_;
  std::vector<py::object> keep_;  // the registered buffers, alive as long as the model
  std::mutex mutex_;
};

// y = x @ W^T with the decode path's kernels (x quantized per 32 first for quantized W).
py::array_t<float> linear(const py::handle& weight, const py::handle& x_o, int threads, const std::string& isa) {
  if (threads < 1) throw py::value_error("num_threads must be positive, got " + std::to_string(threads));
  std::vector<py::object> keep;
  const Linear w = parse_linear(weight, "weight", -1, -1, keep);
  py::array x = checked<float>(x_o, "x", 2);
  if (x.shape(1) != w.cols)
    throw py::value_error("x: expected " + std::to_string(w.cols) + " columns (the weight's inputs), got " + shape_str(x));
  if (w.kind != WeightKind::F32 && w.cols % kBlock)
    throw py::value_error("weight: quantized weights need a multiple of 32 inputs");
  const int rows = static_cast<int>(x.shape(0));
  py::array_t<float> y({static_cast<py::ssize_t>(rows), static_cast<py::ssize_t>(w.rows)});
  DecodeModel m(ModelShape{1, 1, 1, 1, 1, 2, 1, 1e-5f}, threads, kernels_named(isa));
  const Linear wr = m.regrouped(w);
  const float* xp = static_cast<const float*>(x.data());
  float* yp = y.mutable_data();
  {
    py::gil_scoped_release nogil;
    if (rows > 0) m.linear(wr, xp, rows, yp);
  }
  return y;
}

// The activation quantization the quantized GEMVs take (per block of 32: int8 codes, scale d, and
// d * the codes' sum) of x [rows, K], with the table `isa`'s quantize_row.
py::tuple quantize_activations(const py::handle& x_o, const std::string& isa) {
  py::array x = checked<float>(x_o, "x", 2);
  if (x.shape(1) % kBlock) throw py::value_error("x: expected a multiple of 32 columns, got " + shape_str(x));
  const Kernels& k = kernels_named(isa);
  const py::ssize_t rows = x.shape(0), cols = x.shape(1), blocks = cols / kBlock;
  py::array_t<int8_t> qs({rows, cols});
  py::array_t<float> d({rows, blocks}), sums({rows, blocks});
  const float* xp = static_cast<const float*>(x.data());
  int8_t* qp = qs.mutable_data();
  float *dp = d.mutable_data(), *sp = sums.mutable_data();
  {
    py::gil_scoped_release nogil;
    for (py::ssize_t r = 0; r < rows; ++r)
      k.quantize_row(xp + r * cols, static_cast<int>(cols), qp + r * cols, dp + r * blocks, sp + r * blocks);
  }
  return py::make_tuple(qs, d, sums);
}

// A quantized weight (type, uint8 [rows, bytes]) as float32 [rows, cols]: what the embedding
// lookup reads, with gguf.quants' float32 operations.
py::array_t<float> dequantize(const py::handle& weight) {
  std::vector<py::object> keep;
  const Linear w = parse_linear(weight, "weight", -1, -1, keep);
  py::array_t<float> out({static_cast<py::ssize_t>(w.rows), static_cast<py::ssize_t>(w.cols)});
  float* o = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    for (int r = 0; r < w.rows; ++r) {
      const uint8_t* row = w.data + static_cast<size_t>(r) * w.row_bytes;
      float* dst = o + static_cast<size_t>(r) * w.cols;
      if (w.kind == WeightKind::F32) {
        std::memcpy(dst, row, sizeof(float) * w.cols);
      } else {
        dequantize_ggml_row(w.kind, row, w.cols, dst);
      }
    }
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_cpu_kernels, m) {
  m.doc() = "DeepInfer's native CPU decode path: ggml-block (Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K) and F32 kernels, whole "
            "decode steps";
  m.def("available_isas", [] {
    std::vector<std::string> out{"generic"};
#if defined(DEEPINFER_HAVE_AVX2_KERNELS)
    if (&best_kernels() != &generic_kernels()) out.emplace_back("avx2");
    if (&best_kernels() == &avx512_kernels()) out.emplace_back("avx512vnni");
#endif
    return out;
  }, "Kernel tables this build has and this CPU runs ('generic' always).");
  m.def("best_isa", [] { return std::string(best_kernels().name); }, "The kernel table used by default.");
  m.def("weight_kernels", [](const std::string& isa) {
    const Kernels& table = kernels_named(isa);
    py::dict out;
    for (const char* kind : {"F32", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}) {
      // every table runs each type with its own kernels (the AVX-512 table's K-quant rows after a
      // weight's last group of 16 rows aside: those take the AVX2 kernels)
      out[kind] = table.name;
    }
    return out;
  }, py::arg("isa") = "best",
     "{weight type: the kernel table whose GEMV runs it} for the table `isa` (every type the kernels take).");
  m.def("linear", &linear, py::arg("weight"), py::arg("x"), py::kw_only(), py::arg("num_threads") = 1,
        py::arg("isa") = "best",
        "x [rows, K] float32 times weight^T; weight is (type, array) as DecodeModel takes. Float32 [rows, N].");
  m.def("quantize_activations", &quantize_activations, py::arg("x"), py::kw_only(), py::arg("isa") = "best",
        "x [rows, K] float32 (K a multiple of 32) as the quantized GEMVs take it: (int8 codes [rows, K], "
        "scales [rows, K / 32], scale * code sums [rows, K / 32]).");
  m.def("dequantize", &dequantize, py::arg("weight"),
        "weight (type, array) as DecodeModel takes, as float32 [rows, cols] (the embedding lookup's values).");
  py::class_<PyDecodeModel>(m, "DecodeModel",
                            "A Llama-family model's decode step over a paged KV cache, all layers in one call.")
      .def(py::init<int, int, int, int, int, int, int, float, int, const std::string&>(), py::arg("hidden_size"),
           py::arg("intermediate_size"), py::arg("num_layers"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("vocab_size"), py::arg("rms_norm_eps"), py::kw_only(),
           py::arg("num_threads") = 1, py::arg("isa") = "best")
      .def("set_embedding", &PyDecodeModel::set_embedding, py::arg("weight"))
      .def("set_output", &PyDecodeModel::set_output, py::arg("norm"), py::arg("head"))
      .def("set_rotary", &PyDecodeModel::set_rotary, py::arg("cos"), py::arg("sin"))
      .def("set_layer", &PyDecodeModel::set_layer, py::arg("index"), py::arg("attn_norm"), py::arg("q"), py::arg("k"),
           py::arg("v"), py::arg("o"), py::arg("ffn_norm"), py::arg("gate"), py::arg("up"), py::arg("down"),
           py::arg("qkv_bias"), py::arg("kv_cache"))
      .def("decode", &PyDecodeModel::decode, py::arg("input_ids"), py::arg("positions"), py::arg("slot_mapping"),
           py::arg("seq_lens"), py::arg("block_tables"), py::kw_only(), py::arg("table_rows") = py::none(),
           py::arg("logit_rows") = py::none(),
           "Float32 logits [rows, vocab] of one step of token rows; writes each row's k/v into its slot of every "
           "layer's KV cache, then row b attends over seq_lens[b] tokens of its block table (row table_rows[b] of "
           "block_tables, default b). A decode row is one new token of a sequence; a prompt chunk is one row per "
           "token (seq_lens = position + 1, table_rows naming the sequence's table). logit_rows: only those rows' "
           "logits, in that order. Each row's values are independent of the other rows of the step. Releases the GIL.")
      .def_property("profiling", &PyDecodeModel::profiling, &PyDecodeModel::set_profiling,
                    "Phase timer of decode steps (off by default; on costs a clock read per phase).")
      .def("phase_times", &PyDecodeModel::phase_times,
           "{phase: mean wall seconds per step} of the steps since profiling was turned on or the last call "
           "(which resets the count).")
      .def_property("contention_backoff", &PyDecodeModel::contention_backoff, &PyDecodeModel::set_contention_backoff,
                    "Run the next steps on one thread after a step that waited over a tenth of its time on "
                    "descheduled workers (on by default).")
      .def_property_readonly("solo_steps", &PyDecodeModel::solo_steps,
                             "Decode steps run on the calling thread alone by the contention back-off (a step "
                             "that waited over a tenth of its time on descheduled workers sends the next 4..256 "
                             "steps to one thread), since the model was created.")
      .def_property_readonly("num_threads", &PyDecodeModel::threads)
      .def_property_readonly("isa", &PyDecodeModel::isa);
}
