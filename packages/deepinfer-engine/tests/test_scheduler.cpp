// The scheduler driven from C++ alone: add / schedule / update loops, preemption, prefix-cache
// hits, and InvalidArgument for bad configurations and requests.
#include <cmath>
#include <string>
#include <vector>

#include "check.h"
#include "core/invalid_argument.h"
#include "core/scheduler.h"

using namespace deepinfer;

namespace {

SchedulerConfig config(int32_t num_blocks, int32_t block_size, int32_t max_num_batched_tokens, int32_t max_model_len) {
  SchedulerConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.max_num_seqs = 8;
  c.max_num_batched_tokens = max_num_batched_tokens;
  c.max_model_len = max_model_len;
  c.vocab_size = 100;
  c.watermark = 0.0;
  return c;
}

SamplingParams greedy(int32_t max_tokens) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

SeqIndex add(Scheduler& s, const std::string& id, const std::vector<int32_t>& prompt, const SamplingParams& p) {
  const GroupIndex g = s.add_request(id, prompt.data(), prompt.size(), p, 0.0, -1);
  return s.store().groups[g].seqs[0];
}

void update_all(Scheduler& s, int32_t token) {
  std::vector<int32_t> tokens(static_cast<size_t>(s.last_outputs().num_sample_rows), token);
  s.update(tokens.data(), nullptr, nullptr, nullptr, 0);
  CHECK_EQ(s.check_invariants(), std::string());
}

void test_add_schedule_update() {
  Scheduler s(config(16, 4, 64, 64));
  const SeqIndex a = add(s, "a", {1, 2, 3, 4, 5}, greedy(3));
  const SeqIndex b = add(s, "b", {1, 2, 3}, greedy(2));
  const int64_t a_id = s.store().seq(a).seq_id, b_id = s.store().seq(b).seq_id;

  const SchedulerOutputs& o1 = s.schedule();  // both prompts, in arrival order
  CHECK_EQ(o1.scheduled.size(), 2u);
  CHECK_EQ(o1.num_decodes, 0);
  CHECK_EQ(o1.num_batched_tokens, 8);
  CHECK_EQ(o1.num_sample_rows, 2);
  CHECK(o1.scheduled[0].seq == a && o1.scheduled[0].is_prefill && o1.scheduled[0].num_tokens == 5);
  CHECK(o1.scheduled[1].seq == b && o1.scheduled[1].num_tokens == 3);
  CHECK_EQ(s.store().seq(a).block_table.size(), 2u);  // 5 tokens in blocks of 4
  std::vector<int32_t> t1 = {7, 9};
  s.update(t1.data(), nullptr, nullptr, nullptr, 0);
  CHECK_EQ(s.store().seq(a).num_computed_tokens, 5);
  CHECK(s.store().seq(a).tokens == (std::vector<int32_t>{1, 2, 3, 4, 5, 7}));
  CHECK(s.store().seq(b).tokens == (std::vector<int32_t>{1, 2, 3, 9}));

  const SchedulerOutputs& o2 = s.schedule();  // two decodes
  CHECK_EQ(o2.num_decodes, 2);
  CHECK_EQ(o2.num_batched_tokens, 2);
  CHECK_EQ(o2.scheduled[0].num_computed_before, 5);
  CHECK_EQ(o2.scheduled[1].num_computed_before, 3);
  std::vector<int32_t> t2 = {8, 10};
  s.update(t2.data(), nullptr, nullptr, nullptr, 0);
  // b reached max_tokens = 2.
  CHECK_EQ(s.finished().size(), 1u);
  CHECK_EQ(s.finished()[0].seq_id, b_id);
  CHECK(s.store().seq(b).status == SequenceStatus::FINISHED_LENGTH);

  const SchedulerOutputs& o3 = s.schedule();
  CHECK_EQ(o3.scheduled.size(), 1u);
  CHECK_EQ(s.store().seq(o3.scheduled[0].seq).seq_id, a_id);
  update_all(s, 11);
  CHECK(s.store().seq(a).tokens == (std::vector<int32_t>{1, 2, 3, 4, 5, 7, 8, 11}));
  CHECK(s.store().seq(a).status == SequenceStatus::FINISHED_LENGTH);
  CHECK_EQ(s.num_unfinished(), 0);
  CHECK_EQ(s.block_manager().num_free_blocks(), 16);
}

void test_preemption_by_recompute() {
  // Two sequences of 4 + 8 tokens need 3 blocks each; 4 blocks hold only one of them.
  Scheduler s(config(4, 4, 64, 16));
  add(s, "a", {1, 2, 3, 4}, greedy(8));
  add(s, "b", {5, 6, 7, 8}, greedy(8));
  int preempted = 0, finished = 0;
  for (int step = 0; step < 100 && s.num_unfinished() > 0; ++step) {
    const SchedulerOutputs& o = s.schedule();
    preempted += static_cast<int>(o.preempted_seq_ids.size());
    update_all(s, 42);
    for (const FinishedSeq& f : s.finished()) {
      const Sequence& q = s.store().seq(f.seq);
      CHECK(q.status == SequenceStatus::FINISHED_LENGTH);
      CHECK_EQ(q.num_output_tokens(), 8);
      for (int32_t i = 0; i < q.num_output_tokens(); ++i) CHECK_EQ(q.output_tokens()[i], 42);
      ++finished;
    }
  }
  CHECK_EQ(finished, 2);
  CHECK(preempted > 0);
  CHECK_EQ(s.block_manager().num_free_blocks(), 4);
}

void test_prefix_cache_hit() {
  Scheduler s(config(16, 16, 128, 128));
  std::vector<int32_t> prompt(40);
  for (int32_t i = 0; i < 40; ++i) prompt[i] = i;
  add(s, "a", prompt, greedy(1));
  s.schedule();
  update_all(s, 3);
  CHECK_EQ(s.num_unfinished(), 0);
  // "b" finds a's two full blocks (32 tokens) in the cache and computes the other 8.
  const SeqIndex b = add(s, "b", prompt, greedy(1));
  const SchedulerOutputs& o = s.schedule();
  CHECK_EQ(o.scheduled.size(), 1u);
  CHECK_EQ(o.scheduled[0].num_computed_before, 32);
  CHECK_EQ(o.scheduled[0].num_tokens, 8);
  CHECK_EQ(s.store().seq(b).num_cached_tokens, 32);
  CHECK(s.block_manager().stats().prefix_hits > 0);
  update_all(s, 3);
}

void test_invalid_arguments() {
  SchedulerConfig c = config(16, 4, 64, 64);
  c.block_size = 0;
  CHECK_INVALID_ARGUMENT(Scheduler bad(c), "block_size");
  c = config(2, 4, 64, 64);  // 2 blocks of 4 cannot hold one sequence of 64 tokens
  CHECK_INVALID_ARGUMENT(Scheduler bad(c), "num_blocks");
  c = config(16, 4, 64, 64);
  c.policy = SchedulingPolicy::FCFS;
  c.watermark = 1.0;
  CHECK_INVALID_ARGUMENT(Scheduler bad(c), "watermark");

  Scheduler s(config(16, 4, 64, 64));
  add(s, "a", {1, 2}, greedy(2));
  CHECK_INVALID_ARGUMENT(add(s, "a", {1}, greedy(2)), "request_id");
  CHECK_INVALID_ARGUMENT(add(s, "x", {1, 100}, greedy(2)), "prompt_token_ids");
  CHECK_INVALID_ARGUMENT(add(s, "x", {}, greedy(2)), "prompt_token_ids");
  SamplingParams p = greedy(2);
  p.temperature = -1.0f;
  CHECK_INVALID_ARGUMENT(add(s, "x", {1}, p), "temperature");
  p = greedy(2);
  p.min_tokens = 3;
  CHECK_INVALID_ARGUMENT(add(s, "x", {1}, p), "min_tokens");
  p = greedy(2);
  p.n = 9;  // max_num_seqs is 8
  CHECK_INVALID_ARGUMENT(add(s, "x", {1}, p), "n");
  p = greedy(2);
  p.logit_bias = {{5, 1.0f}, {100, 2.0f}};
  CHECK_INVALID_ARGUMENT(add(s, "x", {1}, p), "logit_bias");
  const std::vector<int32_t> one = {1};
  CHECK_INVALID_ARGUMENT(s.add_request("x", one.data(), one.size(), greedy(2), std::nan(""), -1), "arrival_time");
  CHECK_INVALID_ARGUMENT(s.add_request("x", one.data(), one.size(), greedy(2), 0.0, 100), "eos_token_id");
  // Nothing was queued by the rejected calls; the id is still free.
  CHECK_EQ(s.num_unfinished(), 1);
  add(s, "x", {1}, greedy(2));
  CHECK_EQ(s.num_unfinished(), 2);
}

}  // namespace

// Overlap (ZOS): step 3 is scheduled ahead of step 2, then both are applied in order.
void test_schedule_ahead() {
  Scheduler s(config(16, 4, 64, 64));
  const SeqIndex a = add(s, "a", {1, 2, 3}, greedy(6));
  const SeqIndex b = add(s, "b", {1, 2, 3}, greedy(2));
  s.schedule();
  CHECK(s.schedule_ahead() == nullptr);  // a prefill is in flight: synchronous
  CHECK(!s.step_ahead());
  update_all(s, 7);
  const SchedulerOutputs& o2 = s.schedule();  // two decodes of position 3
  CHECK_EQ(o2.num_decodes, 2);
  const SchedulerOutputs* o3 = s.schedule_ahead();
  CHECK(o3 != nullptr && s.step_ahead() && s.step_in_flight());
  CHECK_EQ(o3->step, 3u);
  CHECK_EQ(o3->scheduled.size(), 1u);  // b's step 2 token is its last (max_tokens 2): left out
  CHECK(o3->scheduled[0].seq == a && o3->scheduled[0].num_computed_before == 4);
  CHECK_EQ(s.store().seq(a).block_table.size(), 2u);  // the slot of position 4
  CHECK_EQ(s.update_target().step, 2u);
  CHECK_EQ(s.check_invariants(), std::string());
  std::vector<int32_t> t2 = {5, 6};
  s.update(t2.data(), nullptr, nullptr, nullptr, 0);  // applies step 2
  CHECK(!s.step_ahead() && s.step_in_flight() && s.outputs_ready());
  CHECK(s.store().seq(a).tokens == (std::vector<int32_t>{1, 2, 3, 7, 5}));
  CHECK(s.store().seq(b).status == SequenceStatus::FINISHED_LENGTH);
  CHECK_EQ(s.check_invariants(), std::string());
  update_all(s, 9);  // applies step 3
  CHECK(!s.step_in_flight());
  CHECK(s.store().seq(a).tokens == (std::vector<int32_t>{1, 2, 3, 7, 5, 9}));
  CHECK_EQ(s.store().seq(a).num_computed_tokens, 5);

  // A failure with a step ahead abandons both steps.
  s.schedule();
  CHECK(s.schedule_ahead() != nullptr);
  std::vector<GroupIndex> groups;
  s.abandon_step(true, groups);
  CHECK_EQ(groups.size(), 1u);
  CHECK(!s.step_in_flight() && !s.step_ahead());
  CHECK(s.store().seq(a).status == SequenceStatus::FINISHED_ERROR);
  CHECK_EQ(s.block_manager().num_free_blocks(), 16);
  CHECK_EQ(s.check_invariants(), std::string());
}

int main() {
  RUN(test_add_schedule_update);
  RUN(test_preemption_by_recompute);
  RUN(test_prefix_cache_hit);
  RUN(test_invalid_arguments);
  RUN(test_schedule_ahead);
  return 0;
}
