// The input builders and the sampler inputs driven from C++ alone, on a scheduler's steps:
// outputs checked against values computed by hand from the block tables, and InvalidArgument
// for bad buffers and stale metadata.
#include <string>
#include <vector>

#include "check.h"
#include "core/invalid_argument.h"
#include "core/scheduler.h"
#include "step/metadata.h"
#include "step/prepare_args.h"
#include "step/sampler_inputs.h"

using namespace deepinfer;

namespace {

constexpr int32_t kBlockSize = 4;

// Caller-owned output buffers of the input builders.
struct Buffers {
  size_t tokens, seqs, width;
  std::vector<int32_t> input_ids, positions, query_start_loc, seq_lens, logits_indices, block_tables;
  std::vector<int64_t> slot_mapping;
  Buffers(size_t t, size_t s, size_t w)
      : tokens(t), seqs(s), width(w), input_ids(t, -7), positions(t, -7), query_start_loc(s + 1, -7),
        seq_lens(s, -7), logits_indices(t, -7), block_tables(s * w, -7), slot_mapping(t, -7) {}
  PrepareBuffers view() {
    PrepareBuffers b;
    b.input_ids = {input_ids.data(), input_ids.size()};
    b.positions = {positions.data(), positions.size()};
    b.query_start_loc = {query_start_loc.data(), query_start_loc.size()};
    b.seq_lens = {seq_lens.data(), seq_lens.size()};
    b.logits_indices = {logits_indices.data(), logits_indices.size()};
    b.slot_mapping = {slot_mapping.data(), slot_mapping.size()};
    b.block_tables = {block_tables.data(), seqs, width};
    return b;
  }
};

SchedulerConfig config() {
  SchedulerConfig c;
  c.num_blocks = 32;
  c.block_size = kBlockSize;
  c.max_num_seqs = 4;
  c.max_num_batched_tokens = 64;
  c.max_model_len = 32;
  c.vocab_size = 100;
  c.watermark = 0.0;
  return c;
}

// The KV slot of position p of a sequence: its block's id * block size + offset in the block.
int64_t slot_of(const Sequence& s, int32_t p) {
  return static_cast<int64_t>(s.block_table[p / kBlockSize]) * kBlockSize + p % kBlockSize;
}

std::vector<int32_t> head(const std::vector<int32_t>& v, size_t n) { return {v.begin(), v.begin() + n}; }

void test_prompt_then_decode_step() {
  Scheduler s(config());
  SamplingParams pa;
  pa.temperature = 0.5f;
  pa.has_seed = true;
  pa.seed = 1234;
  pa.max_tokens = 4;
  SamplingParams pb;
  pb.temperature = 0.0f;
  pb.max_tokens = 4;
  const std::vector<int32_t> prompt_a = {11, 12, 13, 14, 15}, prompt_b = {21, 22, 23};
  const SeqIndex a = s.store().groups[s.add_request("a", prompt_a.data(), prompt_a.size(), pa, 0.0, -1)].seqs[0];
  const SeqIndex b = s.store().groups[s.add_request("b", prompt_b.data(), prompt_b.size(), pb, 0.0, -1)].seqs[0];

  Buffers buf(16, 4, 4);
  PrepareArgs args(kBlockSize, 32, {4}, YocoPrefillTruncationMode::NONE, EngramConfig{}, buf.view());
  // The constructor zero-fills block_tables (rows are then written incrementally).
  for (int32_t v : buf.block_tables) CHECK_EQ(v, 0);

  // ---- Step 1: both prompts, unpadded.
  s.schedule();
  SequenceMetadataPool pool;
  pool.build_from(&s.store(), s.last_outputs().scheduled);
  CHECK_EQ(prepare_inputs(args, pool, BuildMode::PROMPT, nullptr), 8);
  const Sequence& qa = s.store().seq(a);
  const Sequence& qb = s.store().seq(b);
  CHECK(head(buf.input_ids, 8) == (std::vector<int32_t>{11, 12, 13, 14, 15, 21, 22, 23}));
  CHECK(head(buf.positions, 8) == (std::vector<int32_t>{0, 1, 2, 3, 4, 0, 1, 2}));
  CHECK(head(buf.query_start_loc, 3) == (std::vector<int32_t>{0, 5, 8}));
  CHECK(head(buf.seq_lens, 2) == (std::vector<int32_t>{5, 3}));
  CHECK(head(buf.logits_indices, 2) == (std::vector<int32_t>{4, 7}));  // each prompt's last token
  for (int32_t p = 0; p < 5; ++p) CHECK_EQ(buf.slot_mapping[p], slot_of(qa, p));
  for (int32_t p = 0; p < 3; ++p) CHECK_EQ(buf.slot_mapping[5 + p], slot_of(qb, p));
  for (size_t j = 0; j < qa.block_table.size(); ++j) CHECK_EQ(buf.block_tables[j], qa.block_table[j]);
  CHECK_EQ(buf.block_tables[qa.block_table.size()], 0);
  CHECK_EQ(args.layout.num_logits, 2);

  SamplerInputs si(VectorStorageFactory(), /*generator_seed=*/7);
  prepare_sampler_inputs(si, args, pool);
  CHECK_EQ(si.kernel.num_rows, 2);
  CHECK_EQ(si.kernel.logits_rows[0], 0);
  CHECK_EQ(si.kernel.logits_rows[1], 1);
  CHECK_EQ(si.kernel.temperature[0], 0.5f);
  CHECK_EQ(si.kernel.temperature[1], 0.0f);
  CHECK_EQ(si.kernel.seeds[0], 1234);  // the request's seed
  CHECK_EQ(static_cast<uint64_t>(si.kernel.seeds[1]), derived_seed(7, qb.seq_id));
  CHECK_EQ(si.kernel.offsets[0], 0);  // first output token
  CHECK(!si.kernel.all_greedy && !si.kernel.all_random);
  CHECK_EQ(si.driver.seq_ids[0], qa.seq_id);
  CHECK_EQ(si.driver.seq_ids[1], qb.seq_id);
  CHECK_EQ(si.prefill.num_rows, 2);
  CHECK_EQ(si.num_calls, 1u);
  std::vector<int32_t> t1 = {16, 24};
  s.update(t1.data(), nullptr, nullptr, nullptr, 0);

  // ---- Step 2: two decodes padded to the graph batch size 4 with placeholder rows.
  s.schedule();
  pool.build_from(&s.store(), s.last_outputs().scheduled);
  CHECK_EQ(prepare_inputs(args, pool, BuildMode::DECODE, nullptr), 4);
  CHECK(head(buf.input_ids, 4) == (std::vector<int32_t>{16, 24, 0, 0}));
  CHECK(head(buf.positions, 4) == (std::vector<int32_t>{5, 3, 0, 0}));
  CHECK_EQ(buf.slot_mapping[0], slot_of(s.store().seq(a), 5));
  CHECK_EQ(buf.slot_mapping[1], slot_of(s.store().seq(b), 3));
  CHECK_EQ(buf.slot_mapping[2], -1);
  CHECK_EQ(buf.slot_mapping[3], -1);
  CHECK(head(buf.query_start_loc, 5) == (std::vector<int32_t>{0, 1, 2, 3, 4}));
  CHECK(head(buf.seq_lens, 4) == (std::vector<int32_t>{6, 4, 1, 1}));
  CHECK(head(buf.logits_indices, 4) == (std::vector<int32_t>{0, 1, 2, 3}));
  CHECK_EQ(args.layout.num_rows, 4);
  CHECK_EQ(args.layout.num_real_rows, 2);

  prepare_sampler_inputs(si, args, pool);
  CHECK_EQ(si.kernel.num_rows, 4);  // two sample rows + two placeholder rows
  CHECK_EQ(si.kernel.offsets[0], 1);  // second output token
  CHECK_EQ(si.driver.seq_ids[2], -1);
  CHECK_EQ(si.decode.num_real_rows, 2);
  CHECK_EQ(si.driver.num_real_rows, 2);
  std::vector<int32_t> t2 = {17, 25};
  s.update(t2.data(), nullptr, nullptr, nullptr, 0);
  CHECK(s.store().seq(a).tokens == (std::vector<int32_t>{11, 12, 13, 14, 15, 16, 17}));
}

void test_invalid_arguments() {
  Buffers buf(16, 4, 4);
  PrepareBuffers small = buf.view();
  small.positions.size = 8;  // fewer than input_ids' 16 token rows
  CHECK_INVALID_ARGUMENT(PrepareArgs(kBlockSize, 32, {}, YocoPrefillTruncationMode::NONE, EngramConfig{}, small),
                         "positions");
  CHECK_INVALID_ARGUMENT(PrepareArgs(kBlockSize, 32, {8}, YocoPrefillTruncationMode::NONE, EngramConfig{}, buf.view()),
                         "graph_batch_sizes");  // larger than the 4 block-table rows
  CHECK_INVALID_ARGUMENT(PrepareArgs(kBlockSize, 32, {}, YocoPrefillTruncationMode::LAST_TOKEN, EngramConfig{}, buf.view()),
                         "yoco_kept_rows");
  CHECK_INVALID_ARGUMENT(PrepareArgs(0, 32, {}, YocoPrefillTruncationMode::NONE, EngramConfig{}, buf.view()),
                         "block_size");

  Scheduler s(config());
  SamplingParams p;
  p.max_tokens = 2;
  const std::vector<int32_t> prompt = {1, 2, 3};
  s.add_request("a", prompt.data(), prompt.size(), p, 0.0, -1);
  s.schedule();
  PrepareArgs args(kBlockSize, 32, {}, YocoPrefillTruncationMode::NONE, EngramConfig{}, buf.view());
  SequenceMetadataPool pool;
  pool.build_from(&s.store(), s.last_outputs().scheduled);
  // A prompt chunk is refused by the decode builder, before anything is written.
  const std::vector<int32_t> before = buf.input_ids;
  CHECK_INVALID_ARGUMENT(prepare_inputs(args, pool, BuildMode::DECODE, nullptr), "metadata[0]");
  CHECK(buf.input_ids == before);
  // Sampler inputs of a pool the args were not prepared from.
  SamplerInputs si{VectorStorageFactory()};
  CHECK_INVALID_ARGUMENT(prepare_sampler_inputs(si, args, pool), "metadata");
  CHECK_EQ(si.num_calls, 0u);
  prepare_inputs(args, pool, BuildMode::PROMPT, nullptr);
  prepare_sampler_inputs(si, args, pool);
  CHECK_EQ(si.num_calls, 1u);
}

}  // namespace

int main() {
  RUN(test_prompt_then_decode_step);
  RUN(test_invalid_arguments);
  return 0;
}
