"""ZOS: a simulated two-step pipeline. Step N+1 is built before step N's tokens reach the host;
resolving its ids from step N's sampled tokens must give exactly the synchronous inputs."""

from __future__ import annotations

import random

import numpy as np
import pytest
from deepinfer_engine import _engine as E
from inputs_helpers import make_args, make_buffers, pool_of, random_row
from inputs_reference.layout import RefRow
from penalty_consumer import PenaltyTables, direct_counts, full_counts

FIELDS = ("positions", "slot_mapping", "logits_indices")


def step_n_rows(rng, n):
    rows = []
    for i in range(n):
        kind = rng.choice(["decode", "decode", "prefill_last", "chunk_mid"])
        if kind == "decode":
            r = random_row(rng, i, 8, kind="decode")
        else:
            P = rng.randint(4, 60)
            toks = [rng.randrange(1000) for _ in range(P)]
            start = rng.randrange(0, P - 2)
            num = P - start if kind == "prefill_last" else rng.randint(1, P - start - 1)
            r = RefRow(i, f"r{i}", toks, P, start, num, [], is_prompt=True)
        # Blocks for one more token than the step needs (the scheduler's slot for N+1).
        r.block_table = rng.sample(range(5000), -(-(len(r.tokens) + 2) // 8))
        r.sampling = dict(seed=rng.randrange(1000), presence_penalty=rng.choice([0.0, 0.5]))
        rows.append(r)
    return rows


def next_rows(rows_n, sampled_by_seq, rng):
    """Host view of step N+1 before (zos) and after (sync) step N's tokens are appended."""
    zos, sync = [], []
    for r in rows_n:
        if r.seq_id in sampled_by_seq:   # sampled at N: decodes at N+1
            zos.append(RefRow(**{**r.__dict__, "tokens": list(r.tokens), "start": len(r.tokens) - 1,
                                 "num_new": 1, "is_prompt": False, "drafts": []}))
            toks = r.tokens + [sampled_by_seq[r.seq_id]]
            sync.append(RefRow(**{**r.__dict__, "tokens": toks, "start": len(toks) - 1, "num_new": 1,
                                  "is_prompt": False, "drafts": []}))
        else:                            # mid-prefill: next chunk, host-known tokens
            start = r.end
            num = rng.randint(1, len(r.tokens) - start)
            nxt = RefRow(**{**r.__dict__, "start": start, "num_new": num, "is_prompt": True})
            zos.append(nxt)
            sync.append(nxt)
    return zos, sync


@pytest.mark.parametrize("same_args", [False, True])
@pytest.mark.parametrize("seed", range(15))
def test_zos_resolves_to_synchronous_inputs(seed, same_args):
    rng = random.Random(seed)
    rows_n = step_n_rows(rng, rng.randint(1, 10))
    bufs_n = make_buffers(max_tokens=1024, max_seqs=16, width=64, zos=True)
    args_n = make_args(bufs_n, block_size=8)
    pool_n = pool_of(rows_n)
    E.prepare_prompt_v4(args_n, pool_n)
    si_n = E.prepare_sampler_inputs(args_n, pool_n, E.SamplerInputs())
    # The device samples one token per logits row; sample rows say which ones are real.
    sampled = np.array([rng.randrange(1000) for _ in range(args_n.num_logits)], np.int32)
    sampled_by_seq = {int(s): int(sampled[lr]) for s, lr in zip(si_n.driver.seq_ids, si_n.kernel.logits_rows)}
    zos_rows, sync_rows = next_rows(rows_n, sampled_by_seq, rng)

    bufs_z = bufs_n if same_args else make_buffers(max_tokens=1024, max_seqs=16, width=64, zos=True)
    args_z = args_n if same_args else make_args(bufs_z, block_size=8)
    pool_z = pool_of(zos_rows)
    E.prepare_zos_inputs(args_z, pool_z, args_n)
    T = args_z.num_tokens
    src = bufs_z["zos_source_index"][:T]
    resolved = np.where(src >= 0, sampled[np.maximum(src, 0)], bufs_z["input_ids"][:T])
    res = {k: bufs_z[k].copy() for k in bufs_z}
    si_z = E.prepare_sampler_inputs(args_z, pool_z, E.SamplerInputs())  # incremental counts
    z_kernel = (si_z.kernel.offsets.copy(), si_z.kernel.seeds.copy(), si_z.kernel.logits_rows.copy())
    z_pending = si_z.transform.penalty_pending_source.copy()
    z_tables = PenaltyTables()
    z_tables.apply(si_z.transform)
    z_counts = [z_tables.row_counts(si_z.transform, r) for r in range(si_z.transform.num_rows)]
    si_zf = E.prepare_sampler_inputs(args_z, pool_z, E.SamplerInputs(penalty_counts="full"))
    assert si_zf.transform.penalty_pending_source.tolist() == z_pending.tolist()
    assert [full_counts(si_zf.transform, r) for r in range(si_zf.transform.num_rows)] == z_counts

    bufs_s = make_buffers(max_tokens=1024, max_seqs=16, width=64)
    args_s = make_args(bufs_s, block_size=8)
    pool_s = pool_of(sync_rows)
    E.prepare_prompt_v4(args_s, pool_s)
    si_s = E.prepare_sampler_inputs(args_s, pool_s, E.SamplerInputs())
    assert args_s.num_tokens == T and args_s.num_logits == args_z.num_logits
    np.testing.assert_array_equal(resolved, bufs_s["input_ids"][:T])
    for k in FIELDS:
        np.testing.assert_array_equal(res[k][:T], bufs_s[k][:T])
    R = args_s.num_rows
    np.testing.assert_array_equal(res["query_start_loc"][: R + 1], bufs_s["query_start_loc"][: R + 1])
    np.testing.assert_array_equal(res["seq_lens"][:R], bufs_s["seq_lens"][:R])
    np.testing.assert_array_equal(res["block_tables"][:R], bufs_s["block_tables"][:R])
    # Same RNG stream per row, and penalties: sync counts the token, ZOS points at it.
    np.testing.assert_array_equal(z_kernel[0], si_s.kernel.offsets)
    np.testing.assert_array_equal(z_kernel[1], si_s.kernel.seeds)
    np.testing.assert_array_equal(z_kernel[2], si_s.kernel.logits_rows)
    for r, sid in enumerate(si_s.driver.seq_ids.tolist()):
        row = next(x for x in sync_rows if x.seq_id == sid)
        pending = z_pending[r]
        if row.sampling.get("presence_penalty") and not row.is_prompt:
            assert sampled[pending] == row.tokens[-1]
            # The tables hold the host-known tokens only; the device adds the pending one.
            counts = dict(z_counts[r])
            c, p = counts.get(row.tokens[-1], (0, 0))
            counts[row.tokens[-1]] = (c + 1, p)
            assert counts == direct_counts(row.tokens, row.num_prompt)
        else:
            assert pending == -1


def test_zos_decode_padding_and_discard():
    rng = random.Random(9)
    rows_n = [random_row(rng, i, 8, kind="decode") for i in range(5)]
    for r in rows_n:
        r.block_table += [rng.randrange(5000)]
    bufs = make_buffers(max_tokens=256, max_seqs=8, width=64, zos=True)
    args = make_args(bufs, block_size=8, graph_batch_sizes=[4, 8])
    pool = pool_of(rows_n)
    E.prepare_decode_v4(args, pool)
    assert args.num_rows == 8
    sampled = np.arange(100, 100 + args.num_logits, dtype=np.int32)
    zos_rows, sync_rows = next_rows(rows_n, {r.seq_id: 100 + i for i, r in enumerate(rows_n)}, rng)
    E.prepare_decode_zos_inputs(args, pool_of(zos_rows), args)  # prev = the same args object
    T = args.num_tokens
    src = bufs["zos_source_index"][:T].copy()
    assert src.tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
    resolved = np.where(src >= 0, sampled[np.maximum(src, 0)], bufs["input_ids"][:T])
    sync_bufs = make_buffers(max_tokens=256, max_seqs=8, width=64)
    sargs = make_args(sync_bufs, block_size=8, graph_batch_sizes=[4, 8])
    E.prepare_decode_v4(sargs, pool_of(sync_rows))
    np.testing.assert_array_equal(resolved, sync_bufs["input_ids"][:T])
    np.testing.assert_array_equal(bufs["slot_mapping"][:T], sync_bufs["slot_mapping"][:T])
    # Sequences 1 and 3 finished at step N: their rows become placeholders.
    slots_before = bufs["slot_mapping"][:T].copy()
    batch_rows, logits_rows = args.zos_discard([1, 3])
    assert batch_rows.tolist() == [1, 3] and logits_rows.tolist() == [1, 3]
    expect = slots_before.copy()
    expect[[1, 3]] = -1
    np.testing.assert_array_equal(bufs["slot_mapping"][:T], expect)
    assert args.row_seq_ids.tolist() == [0, -1, 2, -1, 4, -1, -1, -1]


def test_zos_requires_its_buffer_and_refuses_engram():
    rows = [RefRow(1, "a", [1, 2, 3], 2, 2, 1, [0])]
    bufs = make_buffers(max_tokens=16, max_seqs=2, width=2)
    args = make_args(bufs, block_size=4)
    E.prepare_decode_v4(args, pool_of(rows))
    before = {k: v.copy() for k, v in bufs.items()}
    with pytest.raises(ValueError, match="zos_source_index"):
        E.prepare_zos_inputs(args, pool_of(rows), args)
    for k in bufs:
        np.testing.assert_array_equal(bufs[k], before[k])
