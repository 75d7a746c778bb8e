"""One decoded token's attention over a long static cache, split over the key positions.

The model-level precision study (`bench/forced.py`) steps tiny models to 131,072 tokens, a
copy per design: at batch 1 with two key heads, attention is almost all of a late step. Stock
kernels for one query split the work by batch and head only (SDPA's memory-efficient kernel:
two programs walking every key), and matmuls spend more time in their launches and reductions
than in reading the keys. Here each program takes a chunk of positions of one (row, key head)
for all the query heads that share it, keeps a running max and sum, and a second pass in torch
combines the chunks (the log-sum-exp split of flash decoding). Masked-out positions are never
loaded, so a step reads only what the sequence has written, whatever the cache's length.

Arithmetic is fp32 element-wise (no tensor-core product): the study compares rounding
effects of 1e-9 nats, and every copy, the reference included, attends through this code.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _partials(q_ptr, k_ptr, v_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr,
              n, kv, scale,
              sqb, sqh, sqg, skb, skh, skn, svb, svh, svn, smb, smn,
              G: tl.constexpr, D: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr,
              CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    c = tl.program_id(1)
    b = bh // kv
    h = bh % kv
    og = tl.arange(0, GP)
    od = tl.arange(0, DP)
    gmask = og < G
    dmask = od < D
    q = tl.load(q_ptr + b * sqb + h * sqh + og[:, None] * sqg + od[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    for start in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        inside = pos < n
        valid = inside & (tl.load(mask_ptr + b * smb + pos * smn, mask=inside, other=0) != 0)
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_ptr + b * skb + h * skh + pos[:, None] * skn + od[None, :], mask=kv_mask, other=0.0)
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale          # [GP, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)     # nothing seen yet: no NaN from -inf - -inf
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = tl.load(v_ptr + b * svb + h * svh + pos[:, None] * svn + od[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    at = (bh * tl.num_programs(1) + c) * GP + og
    tl.store(m_ptr + at, m_i)
    tl.store(l_ptr + at, l_i)
    tl.store(acc_ptr + at[:, None] * DP + od[None, :], acc)


def supports(query: torch.Tensor, mask) -> bool:
    """Whether `decode_attention` takes this call: a bool mask that is the same for every head
    (shape `[B or 1, 1, 1, n]`); a float mask or per-head masks go elsewhere."""
    return (mask is not None and mask.dtype == torch.bool and mask.dim() == 4
            and mask.shape[1] == 1 and mask.shape[2] == 1 and query.dtype in (torch.float32, torch.float16,
                                                                                 torch.bfloat16))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float, chunk: int = 256, block_n: int = 32) -> torch.Tensor:
    """`softmax(q k^T * scale, masked) v` for `q` `[B, kv, g, D]` (the g query heads of each key
    head), `k`, `v` `[B, kv, n, D]` (any strides with a unit last one: a static cache's prefix),
    `mask` bool `[B or 1, 1, 1, n]` (True attends). Returns `[B, kv, g, D]` in `q`'s dtype; a row
    with nothing to attend gives NaN, as SDPA does."""
    B, kv, g, D = q.shape
    n = k.shape[2]
    if k.shape != (B, kv, n, D) or v.shape != k.shape or mask.shape[-1] != n:
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"mask {tuple(mask.shape)} do not match")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("decode_attention: the head dimension must be contiguous")
    GP, DP = triton.next_power_of_2(g), triton.next_power_of_2(D)
    chunks = triton.cdiv(n, chunk)
    m = torch.empty(B * kv, chunks, GP, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(B * kv, chunks, GP, DP, dtype=torch.float32, device=q.device)
    mask = mask[:, 0, 0, :].view(torch.uint8)
    smb = mask.stride(0) if mask.shape[0] == B else 0          # one mask for every row
    _partials[(B * kv, chunks)](q, k, v, mask, m, l, acc, n, kv, float(scale),
                                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                                v.stride(0), v.stride(1), v.stride(2), smb, mask.stride(1),
                                G=g, D=D, GP=GP, DP=DP, CHUNK=chunk, BLOCK_N=block_n, num_warps=4)
    top = m.amax(1, keepdim=True)
    w = torch.exp(m - top.masked_fill(top == float("-inf"), 0.0))       # chunks that saw nothing weigh 0
    out = (w[..., None] * acc).sum(1) / (w * l).sum(1)[..., None]
    return out[:, :g, :D].reshape(B, kv, g, D).to(q.dtype)
