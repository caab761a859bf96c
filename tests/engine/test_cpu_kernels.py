"""deepinfer_engine._cpu_kernels: the native CPU decode kernels against independent references.

* Quantized GEMV (ggml Q4_0/Q4_1/Q8_0 blocks, activations quantized to 8 bits per 32 values)
  against the float64 product with the weight dequantized by ``gguf.quants`` (not our decoder):
  |y - x W^T| <= sum over blocks of max|x_block| / 254 * sum|W_block| (the activation rounding
  bound) plus float32 summation slack, for random shapes, 1-16 rows, every instruction set this
  CPU runs, 1 and 2 threads.
* F32 GEMV against numpy in float64, within float32 summation error.
* A whole decode step of a random model against a numpy implementation of the same layer math.
* Bad input: TypeError/ValueError naming the argument.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

ck = pytest.importorskip("deepinfer_engine._cpu_kernels", reason="engine built without _cpu_kernels")
gguf = pytest.importorskip("gguf", reason="gguf (reference dequantizer) is not installed")

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
ISAS = ck.available_isas()


def random_blocks(rng: np.random.Generator, kind: str, n: int, k: int, scale: float = 0.02) -> np.ndarray:
    """[n, k / 32 blocks] of random codes with fp16 scales below ``scale`` (and Q4_1 minimums)."""
    bb = BLOCK_BYTES[kind]
    raw = rng.integers(0, 256, (n, k // 32 * bb), dtype=np.uint8)
    blocks = raw.reshape(n, k // 32, bb)
    blocks[..., 0:2] = (rng.random((n, k // 32, 1)) * scale).astype(np.float16).view(np.uint8)
    if kind == "Q4_1":  # minimum near -7.5 d: weights centred on 0, as in real files
        d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
        m = -7.5 * d + rng.standard_normal((n, k // 32, 1)) * scale
        blocks[..., 2:4] = m.astype(np.float16).view(np.uint8)
    return raw


def dequantized(kind: str, raw: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(raw, GGMLQuantizationType[kind]).astype(np.float64)


def activation_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """[rows, n]: the error bound of 8-bit-per-32 activations (rounding <= max|x_block| / 254)."""
    rows, k = x.shape
    amax = np.abs(x).reshape(rows, k // 32, 32).max(-1)  # [rows, blocks]
    wsum = np.abs(w).reshape(w.shape[0], k // 32, 32).sum(-1)  # [n, blocks]
    slack = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).T)
    return amax @ wsum.T / 254 + slack


def assert_linear_within_bound(kind: str, raw: np.ndarray, w: np.ndarray, x: np.ndarray) -> None:
    """``ck.linear`` of the ``kind`` blocks ``raw`` (dequantized: ``w``) on ``x`` is within
    ``activation_bound`` of the float64 product, on every ISA and with 1 and 2 threads."""
    rows, n = x.shape[0], w.shape[0]
    ref = x.astype(np.float64) @ w.T
    bound = activation_bound(x, w)
    for isa in ISAS:
        for threads in (1, 2):
            y = ck.linear((kind, raw), x, num_threads=threads, isa=isa)
            assert y.shape == (rows, n) and y.dtype == np.float32
            excess = np.abs(y - ref) - bound
            assert excess.max() <= 0, f"{kind} {n}x{w.shape[1]} rows={rows} {isa}: over the bound by {excess.max()}"


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_quantized_gemv_within_the_activation_rounding_bound(kind):
    rng = np.random.default_rng(1)
    for n, k in [(96, 576), (40, 96), (33, 288), (17, 32), (130, 1536)]:
        raw = random_blocks(rng, kind, n, k)
        w = dequantized(kind, raw)
        for rows in (1, 2, 3, 4, 5, 7, 8, 16, 17):
            assert_linear_within_bound(kind, raw, w, rng.standard_normal((rows, k)).astype(np.float32))


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES) + ["F32"])
def test_a_row_is_bitwise_the_same_in_any_tile(kind):
    """Rows are computed in tiles (up to 8 on AVX2 and AVX-512): a row's output must not depend on
    how many rows share its call. Speculative verify steps (1 + k rows of one sequence) rely on it
    for greedy output equal to one-token decode steps, and deterministic=True for batch invariance.
    2..20 rows: every tile size, 16 rows (2 x 8 or 4 x 4 tiles) and tiles after full ones; rows of
    whole groups of 8 blocks and one with an odd last block."""
    rng = np.random.default_rng(11)
    for n, k in [(37, 320), (11, 288)]:
        w = rng.standard_normal((n, k)).astype(np.float32) if kind == "F32" else random_blocks(rng, kind, n, k)
        assert_rows_as_alone(kind, w, rng.standard_normal((20, k)).astype(np.float32))


def assert_rows_as_alone(kind: str, w: np.ndarray, x: np.ndarray) -> None:
    """``ck.linear`` of the first 2..len(x) rows of ``x`` together gives each row bitwise what it
    gives alone, on every ISA."""
    for isa in ISAS:
        alone = np.concatenate([ck.linear((kind, w), x[i:i + 1], isa=isa) for i in range(len(x))])
        for rows in range(2, len(x) + 1):
            np.testing.assert_array_equal(ck.linear((kind, w), x[:rows], isa=isa), alone[:rows],
                                          err_msg=f"{kind} {w.shape} {isa} rows={rows}")


def test_activation_rounding_is_what_the_bound_allows():
    """The bound is not vacuous: an activation whose values fall between 8-bit steps gives an
    error of the predicted size (one block, a weight of ones)."""
    raw = np.zeros((1, 34), dtype=np.uint8)
    raw[0, :2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    raw[0, 2:] = 1  # Q8_0 codes 1: w = 1
    x = np.full((1, 32), 0.5 / 127, dtype=np.float32)
    x[0, 0] = 1.0  # scale 1/127: every 0.5/127 rounds to 0 (even) -> y = 1 instead of 1 + 31 * 0.5/127
    for isa in ISAS:
        y = ck.linear(("Q8_0", raw), x, isa=isa)
        assert y[0, 0] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_non_finite_activations_give_nan_not_garbage(kind):
    rng = np.random.default_rng(5)
    raw = random_blocks(rng, kind, 8, 64)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    x[1, 40], x[2, 3] = np.nan, np.inf
    for isa in ISAS:
        y = ck.linear((kind, raw), x, isa=isa)
        assert np.isfinite(y[0]).all() and np.isnan(y[1]).all() and np.isnan(y[2]).all()


def test_f32_gemv_matches_numpy():
    rng = np.random.default_rng(2)
    for n, k in [(64, 576), (7, 13), (130, 1536)]:
        w = rng.standard_normal((n, k)).astype(np.float32)
        for rows in (1, 3, 4, 16):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            ref = x.astype(np.float64) @ w.T.astype(np.float64)
            tol = 1e-6 * k * (np.abs(x) @ np.abs(w).T)
            for isa in ISAS:
                for threads in (1, 2):
                    y = ck.linear(("F32", w), x, num_threads=threads, isa=isa)
                    assert np.all(np.abs(y - ref) <= tol), (n, k, rows, isa)


# ---- a whole decode step against numpy ------------------------------------------------------------
H, I, LAYERS, HEADS, KV_HEADS, D, V, EPS, BS = 64, 96, 2, 4, 2, 16, 50, 1e-5, 4


def rms(x, w):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS))


def rotate(x, cos, sin):  # x [heads, d], rotate_half layout
    half = x.shape[-1] // 2
    return x * cos + np.concatenate((-x[:, half:], x[:, :half]), -1) * sin


class RandomModel:
    def __init__(self, rng, kind: str, d: int = D, heads: int = HEADS, kv_heads: int = KV_HEADS):
        self.kind, self.d, self.heads, self.kv_heads = kind, d, heads, kv_heads

        def weight(n, k):
            if kind == "F32":
                w = (rng.standard_normal((n, k)) * 0.2).astype(np.float32)
                return ("F32", w), w.astype(np.float64)
            raw = random_blocks(rng, kind, n, k, scale=0.1 if kind == "Q8_0" else 0.05)  # weights ~0.2-0.4
            return (kind, raw), dequantized(kind, raw)

        self.embed = weight(V, H)
        self.head = weight(V, H)
        self.norm = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
        self.layers = []
        for _ in range(LAYERS):
            self.layers.append(dict(
                attn_norm=(1 + 0.1 * rng.standard_normal(H)).astype(np.float32),
                ffn_norm=(1 + 0.1 * rng.standard_normal(H)).astype(np.float32),
                q=weight(heads * self.d, H), k=weight(kv_heads * self.d, H), v=weight(kv_heads * self.d, H),
                o=weight(H, heads * self.d), gate=weight(I, H), up=weight(I, H), down=weight(H, I),
                bias=(0.1 * rng.standard_normal((heads + 2 * kv_heads) * self.d)).astype(np.float32)))
        pos = np.arange(64)[:, None]
        inv = 1.0 / (10000 ** (np.arange(0, self.d, 2) / self.d))
        ang = np.concatenate((pos * inv, pos * inv), -1)
        self.cos, self.sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    def native(self, caches, threads=1, isa="best"):
        m = ck.DecodeModel(H, I, LAYERS, self.heads, self.kv_heads, self.d, V, EPS, num_threads=threads, isa=isa)
        m.set_embedding(self.embed[0])
        m.set_output(self.norm, self.head[0])
        m.set_rotary(self.cos, self.sin)
        for i, l in enumerate(self.layers):
            m.set_layer(i, l["attn_norm"], l["q"][0], l["k"][0], l["v"][0], l["o"][0], l["ffn_norm"],
                        l["gate"][0], l["up"][0], l["down"][0], l["bias"], caches[i])
        return m

    def reference(self, ids, positions, slots, lens, tables, caches):
        """numpy float64 of the same step (writes k/v into ``caches`` like the native call)."""
        out = []
        heads, kv_heads = self.heads, self.kv_heads
        x = self.embed[1][ids]
        for i, l in enumerate(self.layers):
            h = rms(x, l["attn_norm"])
            qkv = np.concatenate([h @ l[n][1].T for n in "qkv"], -1) + l["bias"]
            attn = np.zeros((len(ids), heads * self.d))
            for b in range(len(ids)):
                q = rotate(qkv[b, :heads * self.d].reshape(heads, self.d), self.cos[positions[b]], self.sin[positions[b]])
                k = rotate(qkv[b, heads * self.d:(heads + kv_heads) * self.d].reshape(kv_heads, self.d),
                           self.cos[positions[b]], self.sin[positions[b]])
                v = qkv[b, (heads + kv_heads) * self.d:].reshape(kv_heads, self.d)
                flat = caches[i].reshape(2, -1, kv_heads, self.d)
                flat[0, slots[b]], flat[1, slots[b]] = k, v
                ctx = [tables[b, t // BS] * BS + t % BS for t in range(lens[b])]
                for hd in range(heads):
                    g = hd // (heads // kv_heads)
                    s = flat[0, ctx, g].astype(np.float64) @ q[hd] / np.sqrt(self.d)
                    p = np.exp(s - s.max())
                    attn[b, hd * self.d:(hd + 1) * self.d] = (p / p.sum()) @ flat[1, ctx, g]
            x = x + attn @ l["o"][1].T
            h = rms(x, l["ffn_norm"])
            gate, up = h @ l["gate"][1].T, h @ l["up"][1].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ l["down"][1].T
            out.append(x)
        return rms(x, self.norm) @ self.head[1].T


@pytest.mark.parametrize("kind", ["F32", "Q8_0", "Q4_1", "Q4_0"])
def test_decode_step_matches_a_numpy_reference(kind):
    rng = np.random.default_rng(3)
    model = RandomModel(rng, kind)
    blocks = 12
    lens = np.array([1, 6, 11], dtype=np.int64)  # three sequences, non-contiguous block tables
    tables = np.array([[5, 0, 0], [2, 7, 0], [9, 1, 4]], dtype=np.int64)
    positions = lens - 1
    slots = np.array([tables[b, p // BS] * BS + p % BS for b, p in enumerate(positions)], dtype=np.int64)
    ids = np.array([3, 17, 42], dtype=np.int64)
    context = (rng.standard_normal((LAYERS, 2, blocks, BS, KV_HEADS, D)) * 0.5).astype(np.float32)
    ref_caches = [c.copy() for c in context]
    ref = model.reference(ids, positions, slots, lens, tables, ref_caches)
    # quantized activations: the tolerance is relative to the logits' spread
    tol = 2e-4 if kind == "F32" else 0.05
    for isa in ISAS:
        for threads in (1, 2):
            caches = [c.copy() for c in context]
            logits = model.native(caches, threads, isa).decode(ids, positions, slots, lens, tables)
            assert logits.shape == (3, V)
            scale = np.abs(ref).max()
            assert np.abs(logits - ref).max() <= tol * scale, (kind, isa, threads, np.abs(logits - ref).max() / scale)
            for c, rc in zip(caches, ref_caches, strict=True):  # the new k/v went to their slots only
                np.testing.assert_allclose(c, rc, rtol=0, atol=(1e-5 if kind == "F32" else 0.05) * np.abs(rc).max())


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q4_0"])
def test_decode_step_with_projections_that_cut_row_groups(kind):
    """4 query heads and 1 kv head of 40: q has 160 rows, k and v 40 each. The fused qkv product is
    cut into chunks of 16 rows (2 threads), so one chunk holds k's last 8 rows (after its whole
    groups of 16) and v's first 8 (part of a group): the AVX-512 table computes such a group whole
    and keeps the wanted rows. The step must still match the numpy reference, and one row must give
    the same logits alone as in the batch."""
    rng = np.random.default_rng(13)
    d = 40
    model = RandomModel(rng, kind, d, heads=4, kv_heads=1)
    lens = np.array([3, 5], dtype=np.int64)
    tables = np.array([[4, 1], [2, 6]], dtype=np.int64)
    positions = lens - 1
    slots = np.array([tables[b, p // BS] * BS + p % BS for b, p in enumerate(positions)], dtype=np.int64)
    ids = np.array([7, 31], dtype=np.int64)
    context = (rng.standard_normal((LAYERS, 2, 8, BS, 1, d)) * 0.5).astype(np.float32)
    ref = model.reference(ids, positions, slots, lens, tables, [c.copy() for c in context])
    for isa in ISAS:
        caches = [c.copy() for c in context]
        logits = model.native(caches, 2, isa).decode(ids, positions, slots, lens, tables)
        assert np.abs(logits - ref).max() <= 0.05 * np.abs(ref).max(), (kind, isa)
        caches = [c.copy() for c in context]
        alone = model.native(caches, 2, isa).decode(ids[1:], positions[1:], slots[1:], lens[1:], tables[1:])
        np.testing.assert_array_equal(alone[0], logits[1], err_msg=f"{kind} {isa}")


@pytest.mark.parametrize("d", [16, 32, 48, 64, 128])
def test_decode_step_long_contexts(d):
    """Contexts over several 8- and 16-token chunks of the vector attentions (full and partial
    chunks), head sizes they keep in registers (16, 32, 64, 128) and one they do not (48)."""
    rng = np.random.default_rng(6)
    model = RandomModel(rng, "F32", d)
    lens = np.array([16, 33, 59], dtype=np.int64)  # the rotary table holds 64 positions
    width = -(-int(lens.max()) // BS)
    blocks = 3 * width + 4
    tables = rng.permutation(blocks)[:3 * width].reshape(3, width).astype(np.int64)
    positions = lens - 1
    slots = np.array([tables[b, p // BS] * BS + p % BS for b, p in enumerate(positions)], dtype=np.int64)
    ids = np.array([4, 9, 31], dtype=np.int64)
    context = (rng.standard_normal((LAYERS, 2, blocks, BS, KV_HEADS, d)) * 0.5).astype(np.float32)
    ref = model.reference(ids, positions, slots, lens, tables, [c.copy() for c in context])
    for isa in ISAS:
        for threads in (1, 2):
            logits = model.native([c.copy() for c in context], threads, isa).decode(ids, positions, slots, lens, tables)
            assert np.abs(logits - ref).max() <= 2e-4 * np.abs(ref).max(), (d, isa, threads)


def test_phase_timer_counts_steps_while_on_and_resets_when_read():
    rng = np.random.default_rng(7)
    model = RandomModel(rng, "Q8_0")
    m = model.native([np.zeros((2, 3, BS, KV_HEADS, D), np.float32) for _ in range(LAYERS)])
    step = dict(input_ids=np.array([1], np.int64), positions=np.array([0], np.int64),
                slot_mapping=np.array([0], np.int64), seq_lens=np.array([1], np.int64),
                block_tables=np.zeros((1, 2), np.int64))
    names = ["norm_quantize", "qkv", "rotary_kv_write", "attention", "o_proj", "gate_up_silu", "down", "lm_head"]
    assert not m.profiling
    m.decode(**step)
    assert m.phase_times() == dict.fromkeys(names, 0.0)  # off: nothing counted
    m.profiling = True
    m.decode(**step)
    m.decode(**step)
    times = m.phase_times()
    assert list(times) == names and all(t >= 0 for t in times.values()) and sum(times.values()) > 0
    assert m.phase_times() == dict.fromkeys(names, 0.0)  # read: reset


def test_contention_backoff_switch_and_solo_step_count():
    """The back-off is on by default and can be turned off; it never runs a step alone while off
    (here with a competing thread on the cores) or with a one-thread pool, and the logits do not
    depend on it (each row's sums are taken in the same order on any number of threads)."""
    rng = np.random.default_rng(8)
    model = RandomModel(rng, "Q4_1")
    caches = [np.zeros((2, 3, BS, KV_HEADS, D), np.float32) for _ in range(LAYERS)]
    step = dict(input_ids=np.array([1], np.int64), positions=np.array([0], np.int64),
                slot_mapping=np.array([0], np.int64), seq_lens=np.array([1], np.int64),
                block_tables=np.zeros((1, 2), np.int64))
    single, pooled = model.native(caches, 1), model.native(caches, 2)
    assert pooled.contention_backoff and pooled.solo_steps == 0
    pooled.contention_backoff = False
    assert not pooled.contention_backoff
    stop = threading.Event()

    def spin() -> None:  # holds a core while the steps run
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        reference = single.decode(**step)
        for _ in range(50):
            np.testing.assert_array_equal(pooled.decode(**step), reference)
            single.decode(**step)
    finally:
        stop.set()
        spinner.join()
    assert pooled.solo_steps == 0 and single.solo_steps == 0
    pooled.contention_backoff = True
    np.testing.assert_array_equal(pooled.decode(**step), reference)


# ---- bad input -----------------------------------------------------------------------------------
def test_weights_of_an_equivalent_dtype_object_are_accepted():
    """gguf's memory-mapped tensors carry a uint8 dtype object of their own, not numpy's
    canonical one (a byte has no byte order: '>' gives such an object)."""
    rng = np.random.default_rng(8)
    raw = random_blocks(rng, "Q8_0", 4, 64)
    odd = raw.view(np.dtype(np.uint8).newbyteorder(">"))
    assert odd.dtype == np.uint8 and odd.dtype is not np.dtype(np.uint8)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_array_equal(ck.linear(("Q8_0", odd), x), ck.linear(("Q8_0", raw), x))


def test_bad_weights_are_rejected():
    x = np.zeros((1, 64), np.float32)
    with pytest.raises(ValueError, match="weight type"):
        ck.linear(("Q3_K", np.zeros((2, 36), np.uint8)), x)
    with pytest.raises(TypeError, match="weight: expected dtype"):
        ck.linear(("Q8_0", np.zeros((2, 68), np.int32)), x)
    with pytest.raises(ValueError, match="whole 34-byte blocks"):
        ck.linear(("Q8_0", np.zeros((2, 67), np.uint8)), x)
    with pytest.raises(ValueError, match="C-contiguous"):
        ck.linear(("F32", np.zeros((64, 4), np.float32).T), np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError, match="x: expected 64 columns"):
        ck.linear(("Q8_0", np.zeros((2, 68), np.uint8)), np.zeros((1, 32), np.float32))
    with pytest.raises(TypeError, match="expected a \\(weight type, numpy array\\) tuple"):
        ck.linear(np.zeros((2, 68), np.uint8), x)
    with pytest.raises(ValueError, match="isa must be"):
        ck.linear(("F32", np.zeros((2, 64), np.float32)), x, isa="sse9")


def test_bad_step_inputs_are_rejected():
    rng = np.random.default_rng(4)
    model = RandomModel(rng, "Q8_0")
    caches = [np.zeros((2, 3, BS, KV_HEADS, D), np.float32) for _ in range(LAYERS)]
    m = model.native(caches)
    one = np.array([0], dtype=np.int64)
    ok = dict(input_ids=one, positions=one, slot_mapping=one, seq_lens=np.array([1]),
              block_tables=np.zeros((1, 2), np.int64))
    m.decode(**ok)
    for key, value, match in [
        ("input_ids", np.array([V]), "input_ids\\[0\\]=50 out of range"),
        ("positions", np.array([64]), "positions\\[0\\]=64 out of range"),
        ("slot_mapping", np.array([3 * BS]), "slot_mapping\\[0\\]=12 out of range"),
        ("seq_lens", np.array([0]), "seq_lens\\[0\\]=0 out of range"),
        ("seq_lens", np.array([9]), "seq_lens\\[0\\]=9 out of range"),
        ("block_tables", np.array([[3, 0]]), "block_tables\\[0, 0\\]=3 out of range"),
        ("positions", np.array([0, 0]), "positions: expected 1 entries"),
        ("block_tables", np.zeros((0, 2), np.int64), "block_tables: expected at least 1 rows"),
    ]:
        with pytest.raises(ValueError, match=match):
            m.decode(**{**ok, key: value})
    with pytest.raises(TypeError, match="input_ids: expected dtype int64"):
        m.decode(**{**ok, "input_ids": np.array([0], np.int32)})
    with pytest.raises(ValueError, match="layer 0 kv_cache: expected"):
        m.set_layer(0, *[model.layers[0][n] if isinstance(model.layers[0][n], np.ndarray) else model.layers[0][n][0]
                         for n in ("attn_norm", "q", "k", "v", "o", "ffn_norm", "gate", "up", "down", "bias")],
                    np.zeros((2, 3, BS, KV_HEADS + 1, D), np.float32))
    with pytest.raises(ValueError, match="layer 0 q_proj: expected a \\[64, 64\\] weight"):
        m.set_layer(0, model.layers[0]["attn_norm"], model.layers[0]["k"][0], *[model.layers[0][n][0] for n in "kvo"],
                    model.layers[0]["ffn_norm"], *[model.layers[0][n][0] for n in ("gate", "up", "down")], None,
                    caches[0])
    fresh = ck.DecodeModel(H, I, LAYERS, HEADS, KV_HEADS, D, V, EPS)
    with pytest.raises(ValueError, match="set_embedding was not called"):
        fresh.decode(**ok)
    with pytest.raises(ValueError, match="num_heads must be a multiple of num_kv_heads"):
        ck.DecodeModel(H, I, LAYERS, 5, 2, D, V, EPS)


def _quantize_reference(x):
    """numpy float32 of the activation quantization: per block of 32, d = max|x| / 127, codes
    round-half-even(x * (1 / d)) (0 outside [-127, 127]), and d * the codes' sum."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN / inf blocks: checked apart
        return _quantize_blocks(x)


def _quantize_blocks(x):
    rows, k = x.shape
    blocks = x.reshape(rows, k // 32, 32)
    d = (np.abs(blocks).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv[..., None])
    q = np.where(np.abs(q) <= 127, q, 0).astype(np.int8)
    return q.reshape(rows, k), d, (d * q.astype(np.int32).sum(-1).astype(np.float32)).astype(np.float32)


def test_activation_quantization_is_bitwise_the_same_on_every_instruction_set():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((5, 256)) * 3).astype(np.float32)
    x[1, :32] = 0.0                                              # an all-zero block: d 0, codes 0
    x[1, 32:64] = np.arange(32, dtype=np.float32) - 15.5         # ties after scaling: half to even
    x[1, 63] = 127.0                                             # (max 127: d 1, x * 1/d = x)
    x[2, :32] = -0.0
    x[2, 32:64] = rng.standard_normal(32).astype(np.float32) * 1e-39  # subnormal inputs
    x[3, 5] = np.nan                                             # a NaN / inf block: scale NaN
    x[3, 70] = np.inf
    ref_q, ref_d, ref_s = _quantize_reference(x)
    finite = np.isfinite(x.reshape(5, 8, 32)).all(-1)
    outs = {isa: ck.quantize_activations(x, isa=isa) for isa in ISAS}
    for isa, (q, d, s) in outs.items():
        assert np.array_equal(q.reshape(5, 8, 32)[finite], ref_q.reshape(5, 8, 32)[finite]), isa
        assert np.array_equal(d[finite], ref_d[finite]) and np.array_equal(s[finite], ref_s[finite]), isa
        assert np.isnan(d[~finite]).all() and np.isnan(s[~finite]).all(), isa
        for a, b in zip((q, d, s), outs["generic"], strict=True):  # and bitwise the generic table's
            assert np.array_equal(a, b, equal_nan=a.dtype != np.int8), isa
    assert list(ref_q[1, 32:64]) == [int(np.rint(v)) for v in x[1, 32:64]]  # the ties went to even


@pytest.mark.parametrize("bad, error", [(np.zeros((2, 33), np.float32), ValueError),
                                        (np.zeros((2, 32), np.float64), TypeError),
                                        (np.zeros(32, np.float32), ValueError),
                                        (np.zeros((32, 4), np.float32).T, ValueError)])
def test_activation_quantization_refuses_bad_input(bad, error):
    with pytest.raises(error):
        ck.quantize_activations(bad)
