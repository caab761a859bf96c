#include "step/sampler_inputs.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/invalid_argument.h"
#include "core/mix64.h"
#include "step/metadata.h"
#include "step/prepare_args.h"

namespace deepinfer {

uint64_t derived_seed(uint64_t generator_seed, int64_t seq_id) {
  // splitmix64 of (generator_seed, seq_id): a fixed, well-mixed per-sequence stream.
  uint64_t x = generator_seed ^ (static_cast<uint64_t>(seq_id) * 0x9E3779B97F4A7C15ull);
  x += 0x9E3779B97F4A7C15ull;
  return mix64(x) & 0x7FFFFFFFFFFFFFFFull;  // non-negative int64
}

void match_bad_words(const std::vector<std::vector<int32_t>>& words, const int32_t* known, size_t n_known,
                     const int32_t* drafts, size_t n_drafts, bool complete, std::vector<int32_t>& dst) {
  const size_t n = n_known + n_drafts;
  // The k-th output token (0-based) of the concatenation known ++ drafts.
  auto at = [&](size_t k) { return k < n_known ? known[k] : drafts[k - n_known]; };
  for (const auto& w : words) {
    const size_t m = w.size();
    if (m == 0) continue;  // (validate refuses empty words)
    if (m > 1) {
      // The word's first m - 1 tokens must be the last m - 1 output tokens.
      if (!complete || m - 1 > n) continue;
      bool same = true;
      for (size_t j = 0; same && j + 1 < m; ++j) same = at(n - (m - 1) + j) == w[j];
      if (!same) continue;
    }
    dst.push_back(w[m - 1]);
  }
}

namespace {

void update_counts(PenaltyCounts& c, const Sequence& s, uint64_t step) {
  const int32_t L = s.num_tokens();
  if (c.num_counted > L || c.num_prompt != s.num_prompt_tokens) {  // truncated / first time
    c.num_counted = 0;
    c.num_prompt = s.num_prompt_tokens;
    c.token_ids.clear();
    c.output_counts.clear();
    c.in_prompt.clear();
    c.index.clear();
  }
  for (int32_t p = c.num_counted; p < L; ++p) {
    const int32_t t = s.tokens[p];
    auto [it, fresh] = c.index.try_emplace(t, static_cast<int32_t>(c.token_ids.size()));
    if (fresh) {
      c.token_ids.push_back(t);
      c.output_counts.push_back(0);
      c.in_prompt.push_back(0);
    }
    if (p < c.num_prompt) c.in_prompt[it->second] = 1;
    else ++c.output_counts[it->second];
  }
  c.num_counted = L;
  c.last_step = step;
}

// Tokens masked for a row: banned ids, the tokens that would complete a bad word, plus EOS and
// stop ids while below min_tokens. Appends them sorted and unique to `dst` (when non-null);
// returns the count. `pending`: the row's latest output token is on the device (ZOS).
size_t masked_tokens(const MetadataRow& r, int32_t num_output, bool pending, int32_t* dst,
                     std::vector<int32_t>& scratch) {
  const SequenceGroup& g = *r.group;
  const SamplingParams& p = g.params;
  const bool below_min = num_output < p.min_tokens;
  if (!below_min && p.bad_words_token_ids.empty()) {
    if (dst) std::copy(p.banned_token_ids.begin(), p.banned_token_ids.end(), dst);
    return p.banned_token_ids.size();
  }
  scratch.assign(p.banned_token_ids.begin(), p.banned_token_ids.end());
  if (below_min) {
    scratch.insert(scratch.end(), p.stop_token_ids.begin(), p.stop_token_ids.end());
    if (g.eos_token_id >= 0) scratch.push_back(g.eos_token_id);
  }
  if (!p.bad_words_token_ids.empty()) {
    // Output positions [P, P + num_output) precede the sampled token: the sequence's tokens,
    // then (a speculative row) its draft tokens.
    const Sequence& s = *r.seq;
    const int64_t P = s.num_prompt_tokens, L = static_cast<int64_t>(s.tokens.size());
    const int64_t end = P + std::max<int32_t>(num_output, 0);
    const int64_t n_known = std::clamp<int64_t>(std::min(end, L) - P, 0, L);
    const int64_t n_drafts =
        pending ? 0 : std::clamp<int64_t>(end - L, 0, static_cast<int64_t>(s.draft_tokens.size()));
    const bool complete = n_known + n_drafts == end - P;
    match_bad_words(p.bad_words_token_ids, s.tokens.data() + std::min(P, L), static_cast<size_t>(n_known),
                    s.draft_tokens.data(), static_cast<size_t>(n_drafts), complete, scratch);
  }
  std::sort(scratch.begin(), scratch.end());
  scratch.erase(std::unique(scratch.begin(), scratch.end()), scratch.end());
  if (dst) std::copy(scratch.begin(), scratch.end(), dst);
  return scratch.size();
}

using Sizes = SamplerInputSizes;

// What the sizing pass learned about a metadata row, reused by the write pass.
struct RowNote {
  int32_t num_out;  // output tokens before the one sampled (the RNG offset, min_tokens check)
  int32_t plan;     // incremental mode: index into the call's penalty plans, -1 none
};

// Incremental mode: what this step sends for one penalized sequence. Planned without touching
// the slot states (a rejected call changes nothing), committed once nothing can fail.
struct PenaltyPlan {
  const Sequence* seq;
  PenaltySlotState* state;  // null: the sequence has no slot yet
  int32_t from;             // first token to send
  bool reset;               // the consumer zeroes the slot's table first
  int32_t slot;             // set by the commit (the write pass reads it here, not in the map node)
};

void plan_penalty_update(SamplerInputs& out, const Sequence& s, std::vector<PenaltyPlan>& plans, Sizes& z) {
  auto it = out.penalty_slot_states.find(s.seq_id);
  PenaltySlotState* st = it == out.penalty_slot_states.end() ? nullptr : &it->second;
  const int32_t L = s.num_tokens();
  // New slot, or the table no longer matches a prefix of the sequence (truncated / recomputed
  // with another prompt length): send it whole.
  const bool reset = !st || st->num_sent > L || st->num_prompt != s.num_prompt_tokens;
  const int32_t from = reset ? 0 : st->num_sent;
  plans.push_back({&s, st, from, reset, -1});
  if (reset || from < L) {
    ++z.updates;
    z.update_entries += static_cast<size_t>(L - from);
  }
}

// Gives planned sequences their slots, writes the update CSR, then frees the slots of sequences
// absent from this step. Returns the number of updates written.
int32_t commit_penalty_updates(SamplerInputs& out, std::vector<PenaltyPlan>& plans) {
  LogitsTransformInputs& T = out.transform;
  int32_t u = 0;
  size_t e = 0, num_kept = 0;  // num_kept: slot states given this step's stamp
  T.penalty_update_offsets[0] = 0;
  for (PenaltyPlan& pl : plans) {
    const Sequence& s = *pl.seq;
    if (!pl.state) {
      auto [it, inserted] = out.penalty_slot_states.try_emplace(s.seq_id);
      if (inserted) {
        if (!out.free_penalty_slots.empty()) {
          it->second.slot = out.free_penalty_slots.back();
          out.free_penalty_slots.pop_back();
        } else {
          it->second.slot = out.num_penalty_slots++;
        }
      }
      pl.state = &it->second;
    }
    PenaltySlotState& st = *pl.state;
    pl.slot = st.slot;
    if (st.last_step == out.step) continue;  // the sequence's second row this call: already sent
    ++num_kept;
    const int32_t L = s.num_tokens();
    const int32_t P = s.num_prompt_tokens;
    st.num_sent = L;
    st.num_prompt = P;
    st.last_step = out.step;
    if (!pl.reset && pl.from >= L) continue;  // nothing new for this slot
    const int32_t n = L - pl.from;
    T.penalty_update_slots[u] = st.slot;
    T.penalty_update_reset[u] = pl.reset ? 1 : 0;
    if (n > 0) {
      std::memcpy(T.penalty_update_token_ids.data + e, s.tokens.data() + pl.from, sizeof(int32_t) * n);
      const int32_t prompt_end = std::clamp(P, pl.from, L);  // [from, prompt_end) are prompt tokens
      std::memset(T.penalty_update_is_output.data + e, 0, static_cast<size_t>(prompt_end - pl.from));
      std::memset(T.penalty_update_is_output.data + e + (prompt_end - pl.from), 1, static_cast<size_t>(L - prompt_end));
    }
    e += static_cast<size_t>(n);
    T.penalty_update_offsets[++u] = static_cast<int32_t>(e);
  }
  // Every slot kept (the usual step): no walk over the map.
  if (num_kept == out.penalty_slot_states.size()) return u;
  for (auto it = out.penalty_slot_states.begin(); it != out.penalty_slot_states.end();) {
    if (it->second.last_step == out.step) {
      ++it;
    } else {
      out.free_penalty_slots.push_back(it->second.slot);
      it = out.penalty_slot_states.erase(it);
    }
  }
  return u;
}

// Calls f(array, elements needed) for every output array of a call with sizes z.
template <class F>
void for_each_output(SamplerInputs& out, const Sizes& z, F&& f) {
  auto& K = out.kernel;
  auto& T = out.transform;
  auto& S = out.speculative;
  auto& PL = out.prompt_logprobs;
  for (auto* h : {&K.logits_rows, &K.top_k, &K.subsequences, &T.penalty_pending_source, &T.penalty_slots, &out.prefill.sample_rows,
                  &out.decode.sample_rows, &out.driver.batch_rows, &out.driver.num_logprobs})
    f(*h, z.rows);
  for (auto* h : {&K.temperature, &K.top_p, &K.min_p, &T.presence_penalty, &T.frequency_penalty, &T.repetition_penalty})
    f(*h, z.rows);
  for (auto* h : {&K.seeds, &K.offsets, &out.driver.seq_ids}) f(*h, z.rows);
  for (auto* h : {&T.penalty_offsets, &T.bias_offsets, &T.banned_offsets, &T.allowed_offsets}) f(*h, z.rows + 1);
  f(T.penalty_token_ids, z.penalty);
  f(T.penalty_output_counts, z.penalty);
  f(T.penalty_in_prompt, z.penalty);
  f(T.penalty_update_slots, z.updates);
  f(T.penalty_update_reset, z.updates);
  f(T.penalty_update_offsets, z.updates + 1);
  f(T.penalty_update_token_ids, z.update_entries);
  f(T.penalty_update_is_output, z.update_entries);
  f(T.bias_token_ids, z.bias);
  f(T.bias_values, z.bias);
  f(T.banned_token_ids, z.banned);
  f(T.allowed_token_ids, z.allowed);
  for (auto* h : {&S.sample_rows, &S.num_drafts, &S.bonus_logits_rows}) f(*h, z.spec_seqs);
  f(S.cu_num_drafts, z.spec_seqs + 1);
  f(S.draft_token_ids, z.drafts);
  f(S.target_logits_rows, z.drafts);
  for (auto* h : {&PL.logits_rows, &PL.target_token_ids, &PL.positions, &PL.batch_rows, &PL.num_logprobs})
    f(*h, z.prompt_lp);
  f(PL.seq_ids, z.prompt_lp);
}

// What plan_sampler_inputs hands to write_sampler_inputs, per thread (no allocation in the
// steady state): the penalty plans, a note per metadata row, and scratch for masked tokens.
struct PassScratch {
  std::vector<int32_t> masked;
  std::vector<PenaltyPlan> plans;
  std::vector<RowNote> notes;
};

PassScratch& pass_scratch() {
  thread_local PassScratch scratch;
  return scratch;
}

}  // namespace

SamplerInputs::SamplerInputs(const BufferStorageFactory& storage, uint64_t generator_seed_, PenaltyCountsMode mode)
    : generator_seed(generator_seed_), penalty_mode(mode) {
  for_each_output(*this, Sizes{}, [&](auto& h, size_t) {
    using T = std::remove_pointer_t<decltype(h.data)>;
    h.storage = storage.make<T>();
  });
}

bool sampler_inputs_fit(SamplerInputs& out, const Sizes& z) {
  bool fit = true;
  for_each_output(out, z, [&](auto& h, size_t n) { fit &= h.fits(n); });
  return fit;
}

void reserve_sampler_inputs(SamplerInputs& out, const Sizes& z) {
  for_each_output(out, z, [](auto& h, size_t n) { h.reserve(n); });
}

void prepare_sampler_inputs(SamplerInputs& out, const PrepareArgs& a, SequenceMetadataPool& pool) {
  const Sizes z = plan_sampler_inputs(out, a, pool);
  if (!sampler_inputs_fit(out, z)) reserve_sampler_inputs(out, z);
  write_sampler_inputs(out, a, pool);
}

SamplerInputSizes plan_sampler_inputs(SamplerInputs& out, const PrepareArgs& a, SequenceMetadataPool& pool) {
  const StepLayout& L = a.layout;
  if (L.pool_generation != pool.generation() || static_cast<size_t>(L.num_real_rows) != pool.size())
    throw InvalidArgument("metadata", "not the SequenceMetadataPool that args was last prepared from "
                                      "(call prepare_*(args, metadata) first, without changing metadata in between)");
  pool.resolve();
  const int32_t nreal = L.num_real_rows;
  // Raw pointers, so the row loops keep them in registers instead of reloading each vector.
  const int64_t* const row_seq_id = L.row_seq_id.data();
  const int32_t* const row_num_logits = L.row_num_logits.data();
  const int32_t* const row_logits_offset = L.row_logits_offset.data();
  const int32_t* const row_zos_src = L.row_zos_src.data();
  const LogitsRowKind* const logit_kind = L.logit_kind.data();
  const int32_t* const logit_position = L.logit_position.data();
  const bool incremental = out.penalty_mode == PenaltyCountsMode::INCREMENTAL;
  PassScratch& ps = pass_scratch();  // (one TLS lookup per call, not one per row)
  std::vector<int32_t>& scratch = ps.masked;
  std::vector<PenaltyPlan>& plans = ps.plans;
  if (ps.notes.size() < static_cast<size_t>(nreal)) ps.notes.resize(static_cast<size_t>(nreal));
  RowNote* const notes = ps.notes.data();
  Sizes z;
  {
    plans.clear();
    size_t num_counted = 0;  // full mode: penalty_cache entries stamped with this step
    ++out.step;
    for (int32_t i = 0; i < nreal; ++i) {
      const MetadataRow& r = pool[i];
      const int32_t ns = r.num_samples;
      if (ns == 0) continue;
      if (row_seq_id[i] >= 0) {  // (rows discarded by zos_discard have no sample logits any more)
        const int32_t nl = row_num_logits[i];
        if (nl == 0 || logit_kind[row_logits_offset[i] + nl - 1] != LogitsRowKind::SAMPLE)
          throw InvalidArgument("metadata[" + std::to_string(i) + "]", "samples but its prepared row has no sample logits row");
        if (r.num_drafts != 0 && static_cast<size_t>(r.num_drafts) > r.seq->draft_tokens.size())
          throw InvalidArgument("metadata[" + std::to_string(i) + "]", "its draft tokens changed since the inputs were prepared");
      }
      const SamplingParams& p = r.group->params;
      RowNote& note = notes[i];
      note.plan = -1;
      z.rows += ns;
      if (p.has_penalties()) {
        if (incremental) {
          note.plan = static_cast<int32_t>(plans.size());
          plan_penalty_update(out, *r.seq, plans, z);
        } else {
          PenaltyCounts& c = out.penalty_cache[r.seq->seq_id];
          num_counted += c.last_step != out.step;
          update_counts(c, *r.seq, out.step);
          z.penalty += c.token_ids.size() * ns;
        }
      }
      z.bias += p.logit_bias.size() * ns;
      const int32_t num_out = logit_position[row_logits_offset[i] + row_num_logits[i] - 1] + 1 - r.seq->num_prompt_tokens;
      note.num_out = num_out;
      z.banned += masked_tokens(r, num_out, row_zos_src[i] >= 0, nullptr, scratch) * ns;
      z.allowed += p.allowed_token_ids.size() * ns;
      if (!r.is_prompt && r.num_drafts > 0 && row_zos_src[i] < 0) {
        ++z.spec_seqs;
        z.drafts += r.num_drafts;
      }
    }
    z.rows += L.num_rows - nreal;  // one placeholder sample row per padding batch row
    z.prompt_lp = static_cast<size_t>(L.num_prompt_logprob_rows);
    // Forget counts of sequences not in this step (finished or preempted).
    // (Every entry counted this step, the usual case: no walk over the map.)
    if (num_counted != out.penalty_cache.size())
      for (auto it = out.penalty_cache.begin(); it != out.penalty_cache.end();)
        it = it->second.last_step == out.step ? std::next(it) : out.penalty_cache.erase(it);
  }
  return z;
}

// Not inlined into the binding: as a function of its own its row loop measured 1-2.5 % faster.
[[gnu::noinline]] void write_sampler_inputs(SamplerInputs& out, const PrepareArgs& a, const SequenceMetadataPool& pool) {
  const StepLayout& L = a.layout;
  const int32_t nreal = L.num_real_rows;
  const int64_t* const row_seq_id = L.row_seq_id.data();
  const int32_t* const row_num_logits = L.row_num_logits.data();
  const int32_t* const row_logits_offset = L.row_logits_offset.data();
  const int32_t* const row_zos_src = L.row_zos_src.data();
  const bool incremental = out.penalty_mode == PenaltyCountsMode::INCREMENTAL;
  PassScratch& ps = pass_scratch();
  std::vector<int32_t>& scratch = ps.masked;
  std::vector<PenaltyPlan>& plans = ps.plans;
  const RowNote* const notes = ps.notes.data();
  auto& K = out.kernel;
  auto& T = out.transform;
  auto& S = out.speculative;
  auto& PL = out.prompt_logprobs;
  if (incremental) {
    T.num_penalty_updates = commit_penalty_updates(out, plans);
  } else {
    T.penalty_update_offsets[0] = 0;
    T.num_penalty_updates = 0;
  }
  T.num_penalty_slots = incremental ? out.num_penalty_slots : 0;
  K.all_greedy = K.all_random = K.no_top_k = K.no_top_p = K.no_min_p = true;
  T.no_penalties = T.no_logit_bias = T.no_banned = T.no_allowed = true;
  size_t row = 0, npen = 0, nbias = 0, nban = 0, nallow = 0, nspec = 0, ndraft = 0;
  int32_t nprefill = 0, ndecode = 0, nreal_rows = 0, nlive_rows = 0, max_lp = -1;
  T.penalty_offsets[0] = T.bias_offsets[0] = T.banned_offsets[0] = T.allowed_offsets[0] = 0;
  S.cu_num_drafts[0] = 0;
  // Raw output pointers and flags kept in registers / locals by the row loop (instead of
  // reloading each OutputBuffer member and read-modify-writing the flags in memory).
  auto* const K_logits_rows = K.logits_rows.data;
  auto* const K_min_p = K.min_p.data;
  auto* const K_offsets = K.offsets.data;
  auto* const K_seeds = K.seeds.data;
  auto* const K_subsequences = K.subsequences.data;
  auto* const K_temperature = K.temperature.data;
  auto* const K_top_k = K.top_k.data;
  auto* const K_top_p = K.top_p.data;
  auto* const T_allowed_offsets = T.allowed_offsets.data;
  auto* const T_banned_offsets = T.banned_offsets.data;
  auto* const T_bias_offsets = T.bias_offsets.data;
  auto* const T_frequency_penalty = T.frequency_penalty.data;
  auto* const T_penalty_offsets = T.penalty_offsets.data;
  auto* const T_penalty_pending_source = T.penalty_pending_source.data;
  auto* const T_penalty_slots = T.penalty_slots.data;
  auto* const T_presence_penalty = T.presence_penalty.data;
  auto* const T_repetition_penalty = T.repetition_penalty.data;
  auto* const decode_sample_rows = out.decode.sample_rows.data;
  auto* const driver_batch_rows = out.driver.batch_rows.data;
  auto* const driver_num_logprobs = out.driver.num_logprobs.data;
  auto* const driver_seq_ids = out.driver.seq_ids.data;
  auto* const prefill_sample_rows = out.prefill.sample_rows.data;
  bool all_greedy = true, all_random = true, no_top_k = true, no_top_p = true, no_min_p = true, no_penalties = true;
  const uint64_t generator_seed = out.generator_seed;
  for (int32_t i = 0; i < L.num_rows; ++i) {
    const bool real = i < nreal && row_seq_id[i] >= 0;  // discarded ZOS rows behave as placeholders
    const int32_t last_logit = row_logits_offset[i] + row_num_logits[i] - 1;
    const MetadataRow* r = i < nreal ? &pool[i] : nullptr;
    const int32_t ns = i < nreal ? r->num_samples : 1;
    for (int32_t j = 0; j < ns; ++j, ++row) {
      K_logits_rows[row] = last_logit;
      driver_batch_rows[row] = i;
      T_penalty_pending_source[row] = -1;
      T_penalty_slots[row] = -1;
      if (!real) {
        // Placeholder: greedy, no transforms, output discarded.
        K_temperature[row] = 0.0f;
        K_top_p[row] = 1.0f;
        K_min_p[row] = 0.0f;
        K_top_k[row] = -1;
        K_seeds[row] = 0;
        K_offsets[row] = 0;
        K_subsequences[row] = 0;
        T_presence_penalty[row] = T_frequency_penalty[row] = 0.0f;
        T_repetition_penalty[row] = 1.0f;
        driver_seq_ids[row] = -1;
        driver_num_logprobs[row] = -1;
      } else {
        const Sequence& s = *r->seq;
        const SequenceGroup& g = *r->group;
        const SamplingParams& p = g.params;
        const int32_t num_out = notes[i].num_out;  // (pass 1 computed it: no second chase)
        K_temperature[row] = static_cast<float>(p.temperature);
        K_top_p[row] = static_cast<float>(p.top_p);
        K_min_p[row] = static_cast<float>(p.min_p);
        K_top_k[row] = p.top_k;
        K_seeds[row] = p.has_seed ? p.seed : static_cast<int64_t>(derived_seed(generator_seed, s.seq_id));
        K_offsets[row] = num_out;
        K_subsequences[row] = ns > 1 ? j : s.sample_index;
        const bool greedy = static_cast<float>(p.temperature) == 0.0f;  // as the kernel sees it
        all_greedy &= greedy;
        all_random &= !greedy;
        if (!greedy) {
          no_top_k &= p.top_k < 0;
          no_top_p &= p.top_p >= 1.0;
          no_min_p &= p.min_p <= 0.0;
        }
        T_presence_penalty[row] = static_cast<float>(p.presence_penalty);
        T_frequency_penalty[row] = static_cast<float>(p.frequency_penalty);
        T_repetition_penalty[row] = static_cast<float>(p.repetition_penalty);
        if (p.has_penalties()) {
          no_penalties = false;
          if (incremental) {
            T_penalty_slots[row] = plans[notes[i].plan].slot;
          } else {
            const PenaltyCounts& c = out.penalty_cache.find(s.seq_id)->second;
            const size_t m = c.token_ids.size();
            if (m) {
              std::memcpy(T.penalty_token_ids.data + npen, c.token_ids.data(), m * sizeof(int32_t));
              std::memcpy(T.penalty_output_counts.data + npen, c.output_counts.data(), m * sizeof(int32_t));
              std::memcpy(T.penalty_in_prompt.data + npen, c.in_prompt.data(), m);
            }
            npen += m;
          }
          T_penalty_pending_source[row] = row_zos_src[i];
        }
        for (const auto& [t, v] : p.logit_bias) {
          T.bias_token_ids[nbias] = t;
          T.bias_values[nbias++] = static_cast<float>(v);
        }
        nban += masked_tokens(*r, num_out, row_zos_src[i] >= 0, T.banned_token_ids.data + nban, scratch);
        std::copy(p.allowed_token_ids.begin(), p.allowed_token_ids.end(), T.allowed_token_ids.data + nallow);
        nallow += p.allowed_token_ids.size();
        driver_seq_ids[row] = s.seq_id;
        driver_num_logprobs[row] = p.logprobs;
        max_lp = std::max(max_lp, p.logprobs);
        ++nlive_rows;
      }
      // Sample rows of metadata rows, placeholders included (a sequence finished after
      // schedule() keeps its row): exactly the scheduler's num_sample_rows for update().
      if (i < nreal) ++nreal_rows;
      T_penalty_offsets[row + 1] = static_cast<int32_t>(npen);
      T_bias_offsets[row + 1] = static_cast<int32_t>(nbias);
      T_banned_offsets[row + 1] = static_cast<int32_t>(nban);
      T_allowed_offsets[row + 1] = static_cast<int32_t>(nallow);
      if (r && r->is_prompt) prefill_sample_rows[nprefill++] = static_cast<int32_t>(row);
      else decode_sample_rows[ndecode++] = static_cast<int32_t>(row);
      if (r && real && !r->is_prompt && r->num_drafts > 0 && row_zos_src[i] < 0 && j == 0) {
        const int32_t k = r->num_drafts;
        const int32_t first = row_logits_offset[i];
        S.sample_rows[nspec] = static_cast<int32_t>(row);
        S.num_drafts[nspec] = k;
        S.bonus_logits_rows[nspec] = first + k;
        for (int32_t d = 0; d < k; ++d) {
          S.draft_token_ids[ndraft] = r->seq->draft_tokens[d];
          S.target_logits_rows[ndraft++] = first + d;
        }
        S.cu_num_drafts[++nspec] = static_cast<int32_t>(ndraft);
      }
    }
  }
  K.all_greedy = all_greedy;
  K.all_random = all_random;
  K.no_top_k = no_top_k;
  K.no_top_p = no_top_p;
  K.no_min_p = no_min_p;
  T.no_penalties = no_penalties;
  K.num_rows = T.num_rows = static_cast<int32_t>(row);
  T.no_logit_bias = nbias == 0;
  T.no_banned = nban == 0;
  T.no_allowed = nallow == 0;
  if (nlive_rows == 0) K.all_random = false;
  out.prefill.num_rows = nprefill;
  out.decode.num_rows = ndecode;
  out.decode.num_real_rows = ndecode - (L.num_rows - nreal);
  out.driver.num_rows = static_cast<int32_t>(row);
  out.driver.num_real_rows = nreal_rows;
  out.driver.max_num_logprobs = max_lp;
  S.num_seqs = static_cast<int32_t>(nspec);
  S.num_drafts_total = static_cast<int32_t>(ndraft);
  // Prompt logprobs.
  int32_t npl = 0, max_plp = -1;
  for (int32_t k = 0; L.num_prompt_logprob_rows > 0 && k < L.num_logits; ++k) {
    if (L.logit_kind[k] != LogitsRowKind::PROMPT_LOGPROB) continue;
    const int32_t i = L.logit_row[k];
    const MetadataRow& r = pool[i];
    const int32_t pos = L.logit_position[k];
    PL.logits_rows[npl] = k;
    PL.target_token_ids[npl] = r.seq->tokens[pos + 1];
    PL.positions[npl] = pos + 1;
    PL.batch_rows[npl] = i;
    PL.seq_ids[npl] = r.seq->seq_id;
    PL.num_logprobs[npl] = r.group->params.prompt_logprobs;
    max_plp = std::max(max_plp, r.group->params.prompt_logprobs);
    ++npl;
  }
  PL.num_rows = npl;
  PL.max_num_logprobs = max_plp;
  ++out.num_calls;
}

}  // namespace deepinfer
