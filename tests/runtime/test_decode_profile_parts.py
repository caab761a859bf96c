"""``bench/decode_profile.py``'s removal variants (``-attention``, ``-rotary``, ``-quantize``): each
stand-in replaces a function the fused decode step really calls by that name, and returns what the
real one returns in shape and dtype (so the rest of the step captures unchanged). The timing itself
needs a GPU; this guards the names and contracts against drift in the runtime."""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys

import pytest
import torch

_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "decode_profile.py")


@pytest.fixture(scope="module")
def decode_profile():
    spec = importlib.util.spec_from_file_location("decode_profile_under_test", _BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:  # (the script puts bench/ and tests/runtime first on the path for itself)
        sys.path[:] = path
    return module


@pytest.mark.parametrize("part, called", [("attention", "decode_attention(q, cache"),
                                          ("rotary", "q = rotary_kv_write(qkv"),
                                          ("quantize", "= quantize_activations(x, k")])
def test_each_part_replaces_a_function_the_step_calls_by_that_name(decode_profile, part, called):
    module, attr, stand_in = decode_profile._without(part)
    original = getattr(module, attr)
    assert callable(original) and stand_in is not original
    assert called in inspect.getsource(module), f"{module.__name__} no longer calls {attr} as the bench expects"


def test_the_stand_ins_return_the_real_shapes(decode_profile):
    heads, kv_heads, dim, t = 4, 2, 8, 3
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim)
    cache = torch.zeros(2, 5, 16, kv_heads, dim)  # [2, blocks, block_size, KVH, D]
    _, _, no_rotary = decode_profile._without("rotary")
    q = no_rotary(qkv, torch.zeros(t, dtype=torch.long), None, None, torch.zeros(t, dtype=torch.long), cache,
                  heads, kv_heads)
    assert q.shape == (t, heads, dim)  # rotary_kv_write's return: the rotated q [T, H, D]
    assert torch.equal(q.reshape(t, -1), qkv[:, :heads * dim])  # the q columns ...
    assert q.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()  # ... as a view: nothing launched
    _, _, no_attention = decode_profile._without("attention")
    assert no_attention(q, cache) is q  # decode_attention returns [B, H, D] like q
    _, _, no_quantize = decode_profile._without("quantize")
    codes, stats = no_quantize(torch.randn(1, 64), 64)
    # quantize_activations' contract: codes int8 [K], stats float32 [3 * K/16]
    assert codes.shape == (64,) and codes.dtype == torch.int8
    assert stats.shape == (12,) and stats.dtype == torch.float32
    again = no_quantize(torch.randn(1, 64), 64)
    assert again[0] is codes and again[1] is stats  # made once: no allocation per call in a capture


def test_an_unknown_part_names_the_parts(decode_profile):
    with pytest.raises(SystemExit, match="no part 'norm'.*attention, rotary, quantize"):
        decode_profile._without("norm")
