"""The online-softmax step shared by the Triton attention kernels (flash-attention style)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_block(q, k, v, visible, m_i, l_i, acc, scale, IEEE: tl.constexpr):
    """Fold one block of keys ``k`` / values ``v`` into the running max ``m_i``, sum ``l_i`` and
    unnormalised output ``acc`` of the query rows ``q``; ``visible`` masks (row, key) pairs.
    float32 inputs use IEEE dot products (no TF32). Returns the new (m_i, l_i, acc)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible, s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc
