#include "core/request_output.h"

#include <algorithm>

namespace deepinfer {

namespace {

void fill_completion(CompletionData& c, const Sequence& q, const SamplingParams& p, bool delta) {
  const int32_t start = delta ? q.num_returned_tokens : 0;
  const int32_t end = q.num_output_tokens();
  c.index = q.sample_index;
  c.token_ids.assign(q.output_tokens() + start, q.output_tokens() + end);
  c.cumulative_logprob = q.cumulative_logprob;
  if (p.logprobs >= 0) {
    const size_t per = static_cast<size_t>(p.logprobs) + 1;
    c.logprobs_per_token = static_cast<int32_t>(per);
    c.logprob_token_ids.assign(q.logprob_token_ids.begin() + per * start, q.logprob_token_ids.begin() + per * end);
    c.logprob_values.assign(q.logprob_values.begin() + per * start, q.logprob_values.begin() + per * end);
  } else {
    c.logprobs_per_token = 0;
    c.logprob_token_ids.clear();
    c.logprob_values.clear();
  }
  c.finish_reason = finish_reason_str(q.status);
  c.stop_token = q.stop_token;
  c.stop_string = q.stop_string;
  c.stop_is_string = q.stop_is_string;
  c.text.clear();
}

}  // namespace

namespace {

// A registered request's plain delta written as a row of `columns`: true when it was (nothing
// else is then built for it); its finished output unregisters it and is built as an object.
bool write_row(DeltaColumns& columns, SequenceStore& store, const SequenceGroup& g, bool finished) {
  auto it = columns.slots.find(g.request_id);
  if (it == columns.slots.end()) return false;
  if (finished) {
    columns.slots.erase(it);
    return false;
  }
  const SamplingParams& p = g.params;
  if (p.output_kind != OutputKind::DELTA || p.n != 1 || g.seqs.size() != 1 || p.logprobs >= 0 ||
      p.prompt_logprobs >= 0)
    return false;
  Sequence& q = store.seq(g.seqs[0]);
  if (q.num_returned_tokens == 0 || is_finished(q.status)) return false;  // the first output: an object
  const int32_t end = q.num_output_tokens();
  if (end < q.num_returned_tokens) return false;
  columns.row_slots.push_back(it->second);
  columns.tokens.insert(columns.tokens.end(), q.output_tokens() + q.num_returned_tokens, q.output_tokens() + end);
  columns.offsets.push_back(static_cast<int64_t>(columns.tokens.size()));
  q.num_returned_tokens = end;
  return true;
}

}  // namespace

void build_request_outputs(Scheduler& sched, const std::function<RequestOutputData&()>& acquire,
                           DeltaColumns* columns) {
  SequenceStore& store = sched.store();
  const uint64_t epoch = sched.update_epoch();
  for (SeqIndex si : sched.updated_seqs()) {
    SequenceGroup& g = store.groups[store.seq(si).group];
    if (g.updated_epoch == epoch) continue;  // this request was output by this build already
    g.updated_epoch = epoch;
    if (!g.alive || g.final_output_sent) continue;
    const SamplingParams& p = g.params;
    const bool finished = g.num_unfinished == 0;
    if (p.output_kind == OutputKind::FINAL_ONLY && !finished) continue;
    const bool delta = p.output_kind == OutputKind::DELTA;
    if (columns != nullptr && !columns->slots.empty() && write_row(*columns, store, g, finished)) continue;
    RequestOutputData* d = &acquire();
    d->request_id = g.request_id;
    if (!g.prompt_shared) {
      const Sequence& parent = store.seq(g.seqs[0]);
      g.prompt_shared = std::make_shared<const std::vector<int32_t>>(parent.tokens.begin(),
                                                                      parent.tokens.begin() + parent.num_prompt_tokens);
    }
    d->prompt_token_ids = g.prompt_shared;
    d->finished = finished;
    int32_t n = 0;
    for (SeqIndex s : g.seqs) {
      Sequence& q = store.seq(s);
      const bool seq_finished = is_finished(q.status);
      if (delta && q.num_returned_tokens == q.num_output_tokens() && (!seq_finished || q.final_output_sent)) continue;
      if (static_cast<size_t>(n) == d->completions.size()) d->completions.emplace_back();
      fill_completion(d->completions[n++], q, p, delta);
      q.num_returned_tokens = q.num_output_tokens();
      if (seq_finished) q.final_output_sent = true;
    }
    d->num_completions = n;
    // Prompt logprobs: positions 1..P-1 have entries; position 0 has none (reported as None),
    // and is covered from the first output on (a one-token prompt's logprobs are [None]).
    if (p.prompt_logprobs >= 0) {
      const size_t per = static_cast<size_t>(p.prompt_logprobs) + 1;
      const int32_t filled = g.num_prompt_logprobs;  // positions 1..filled have entries
      const int32_t end = filled + 1;                // positions [0, end) are known
      const int32_t start = delta ? g.num_prompt_positions_returned : 0;
      const int32_t first_entry = start > 0 ? start - 1 : 0;  // entry of position max(start, 1)
      d->prompt_logprobs_per_token = static_cast<int32_t>(per);
      d->prompt_logprobs_start = start;
      d->prompt_logprobs_end = end;
      d->prompt_logprob_token_ids.assign(g.prompt_logprob_token_ids.begin() + per * first_entry,
                                         g.prompt_logprob_token_ids.begin() + per * filled);
      d->prompt_logprob_values.assign(g.prompt_logprob_values.begin() + per * first_entry,
                                      g.prompt_logprob_values.begin() + per * filled);
      g.num_prompt_positions_returned = end;
    } else {
      d->prompt_logprobs_per_token = 0;
    }
    d->metrics.arrival_time = g.arrival_time;
    d->metrics.first_scheduled_time = g.first_scheduled_time;
    d->metrics.first_token_time = g.first_token_time;
    d->metrics.finished_time = finished ? g.finished_time : 0.0;
    d->metrics.num_cached_tokens = store.seq(g.seqs[0]).num_cached_tokens;
    if (finished) g.final_output_sent = true;  // its id is free from now on (Scheduler::request_id_in_use)
  }
  sched.drain_updated_seqs();
}

bool correct_output_after_stop(Scheduler& sched, SeqIndex s, int32_t old_num_output_tokens, RequestOutputData& d) {
  SequenceStore& store = sched.store();
  Sequence& q = store.seq(s);
  SequenceGroup& g = store.groups[q.group];
  CompletionData* c = nullptr;
  for (int32_t i = 0; i < d.num_completions && !c; ++i)
    if (d.completions[i].index == q.sample_index) c = &d.completions[i];
  if (!c) return false;
  // The completion held outputs [start, old end) (start > 0 for a delta): keep those below the stop.
  const int32_t len = static_cast<int32_t>(c->token_ids.size());
  const int32_t start = old_num_output_tokens - len;
  const int32_t keep = std::max(0, std::min(q.num_output_tokens(), old_num_output_tokens) - start);
  c->token_ids.resize(static_cast<size_t>(keep));
  if (c->logprobs_per_token > 0) {
    c->logprob_token_ids.resize(static_cast<size_t>(keep) * c->logprobs_per_token);
    c->logprob_values.resize(static_cast<size_t>(keep) * c->logprobs_per_token);
  }
  c->cumulative_logprob = q.cumulative_logprob;
  c->finish_reason = finish_reason_str(q.status);
  c->stop_token = q.stop_token;
  c->stop_string = q.stop_string;
  c->stop_is_string = q.stop_is_string;
  q.final_output_sent = true;
  sched.unmark_updated(s);
  if (g.num_unfinished == 0) {
    d.finished = true;
    d.metrics.finished_time = g.finished_time;
    g.final_output_sent = true;
  }
  return true;
}

}  // namespace deepinfer
