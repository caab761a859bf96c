"""Test-only reference driver: feeds the model runner var-len steps without the C++ engine.

Small and obviously right, not fast: each sequence owns a fixed run of blocks; every step takes
up to ``chunk`` prompt tokens per prefilling sequence and one token per decoding sequence.
Used to check the model and attention against transformers independently of the scheduler.
"""

from __future__ import annotations

import numpy as np


def greedy_generate(runner, prompts: list[list[int]], max_new_tokens: int, chunk: int = 1 << 30,
                    first_block: int = 0) -> list[list[int]]:
    bs = runner.block_size
    max_len = max(len(p) for p in prompts) + max_new_tokens
    blocks_per_seq = (max_len + bs - 1) // bs
    tables = np.array([[first_block + i * blocks_per_seq + j for j in range(blocks_per_seq)]
                       for i in range(len(prompts))], dtype=np.int32)
    assert tables.max() < runner.num_blocks
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < max_new_tokens for o in outputs):
        ids, pos, slots, qsl, lens, rows, samplers = [], [], [], [0], [], [], []
        active = [i for i in range(len(prompts)) if len(outputs[i]) < max_new_tokens]
        for i in active:
            n = min(chunk, len(tokens[i]) - computed[i])
            for p in range(computed[i], computed[i] + n):
                ids.append(tokens[i][p])
                pos.append(p)
                slots.append(int(tables[i, p // bs]) * bs + p % bs)
            computed[i] += n
            qsl.append(qsl[-1] + n)
            lens.append(computed[i])
            if computed[i] == len(tokens[i]):
                rows.append(qsl[-1] - 1)
                samplers.append(i)
        logits = runner.execute(
            input_ids=np.array(ids), positions=np.array(pos), slot_mapping=np.array(slots),
            query_start_loc=np.array(qsl), seq_lens=np.array(lens), block_tables=tables[active],
            logits_indices=np.array(rows))
        for r, i in enumerate(samplers):
            t = int(logits[r].argmax())
            outputs[i].append(t)
            tokens[i].append(t)
    return outputs
