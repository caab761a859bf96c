"""A pure-Python consumer of the incremental penalty updates of LogitsTransformInputs.

It keeps one table per slot (output count per token, tokens seen in the prompt) in plain dicts,
applies each call's updates exactly as the documentation says, and answers, per sample row, the
counts in the layout of "full" mode: {token: (output count, in prompt)}.
"""

from __future__ import annotations

from collections import Counter


class PenaltyTables:
    def __init__(self):
        self.output: dict[int, Counter] = {}
        self.prompt: dict[int, set] = {}
        self.num_slots = 0

    def apply(self, T):
        """Applies one call's updates (every call, in order); checks their structure."""
        U = T.num_penalty_updates
        slots = T.penalty_update_slots.tolist()
        resets = T.penalty_update_reset.tolist()
        offsets = T.penalty_update_offsets.tolist()
        toks = T.penalty_update_token_ids.tolist()
        is_out = T.penalty_update_is_output.tolist()
        assert len(slots) == len(resets) == U and len(offsets) == U + 1 and offsets[0] == 0
        assert len(toks) == len(is_out) == offsets[-1]
        assert len(set(slots)) == U, "a slot is updated at most once per call"
        assert T.num_penalty_slots >= self.num_slots, "num_penalty_slots never decreases (until a reset)"
        self.num_slots = T.num_penalty_slots
        for u, slot in enumerate(slots):
            assert 0 <= slot < T.num_penalty_slots
            assert resets[u] in (0, 1)
            if resets[u] or slot not in self.output:
                # A slot the consumer never saw must come with reset = 1.
                assert resets[u] == 1, f"slot {slot} first sent without reset"
                self.output[slot], self.prompt[slot] = Counter(), set()
            for k in range(offsets[u], offsets[u + 1]):
                assert is_out[k] in (0, 1)
                if is_out[k]:
                    self.output[slot][toks[k]] += 1
                else:
                    self.prompt[slot].add(toks[k])
        for s in T.penalty_slots.tolist():
            assert s == -1 or 0 <= s < T.num_penalty_slots

    def reset(self):
        """Forgets every table (with SamplerInputs.reset_penalty_tables())."""
        self.__init__()

    def counts(self, slot):
        """{token: (output count, in prompt)} of a slot, like one row of "full" mode."""
        out, prompt = self.output[slot], self.prompt[slot]
        return {t: (out.get(t, 0), int(t in prompt)) for t in set(out) | prompt}

    def row_counts(self, T, r):
        s = int(T.penalty_slots[r])
        return {} if s < 0 else self.counts(s)


def full_counts(T, r):
    """{token: (output count, in prompt)} of sample row r in "full" mode."""
    a, b = int(T.penalty_offsets[r]), int(T.penalty_offsets[r + 1])
    return dict(zip(T.penalty_token_ids[a:b].tolist(),
                    zip(T.penalty_output_counts[a:b].tolist(), T.penalty_in_prompt[a:b].tolist())))


def direct_counts(tokens, num_prompt):
    """The expectation straight from a sequence's token list."""
    out = Counter(tokens[num_prompt:])
    prompt = set(tokens[:num_prompt])
    return {t: (out.get(t, 0), int(t in prompt)) for t in set(tokens)}
