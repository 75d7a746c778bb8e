"""The records' key products of a step, formed once per (row, key head) by a small Triton launch
before a low-precision Gluon step (`lowp_config`'s `gluon_kq`): `k_j . x` for the key records
`j` below the row's cursor and the token's one or two vectors `x` of that key head (Mamba-2: the
query `C`; GDN: the raw key and query, normalised after). Every program of the key head's value
heads and V-blocks would otherwise load the same key records (4 KB in bf16 at window 16) and form
the same products: at a low-precision read that was a sixth of an fp16 step's L2 traffic
(docs/kernels.md). Triton, so the CPU interpreter runs it too."""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .launch import scratch_f32

__all__ = ["key_products"]


@triton.jit
def _key_products_kernel(x1, x2, buf_k, cursor, slot_ids, kq, stride_1b, stride_1h, stride_2b, stride_2h,
                         Hk: tl.constexpr, K: tl.constexpr, LB: tl.constexpr, BL: tl.constexpr,
                         NVEC: tl.constexpr):
    # one (row, key head): kq[b, hk, i, j] = k_j . x_i for j < h, zero from h on (and for a
    # padding row), whatever the records past the cursor hold
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    slot = tl.load(slot_ids + i_b).to(tl.int64)
    o_l = tl.arange(0, BL)
    p_kq = kq + (i_b * Hk + i_h) * (NVEC * BL) + o_l
    if slot < 0:
        tl.store(p_kq, tl.zeros([BL], tl.float32))
        if NVEC == 2:
            tl.store(p_kq + BL, tl.zeros([BL], tl.float32))
        return
    h = tl.load(cursor + slot)
    o_k = tl.arange(0, K)
    m_l = (o_l < h) & (o_l < LB)
    b_K = tl.load(buf_k + ((slot * LB + o_l[:, None]) * Hk + i_h) * K + o_k[None, :], mask=m_l[:, None],
                  other=0.0).to(tl.float32)
    b_x1 = tl.load(x1 + i_b * stride_1b + i_h * stride_1h + o_k).to(tl.float32)
    tl.store(p_kq, tl.sum(b_K * b_x1[None, :], axis=1))
    if NVEC == 2:
        b_x2 = tl.load(x2 + i_b * stride_2b + i_h * stride_2h + o_k).to(tl.float32)
        tl.store(p_kq + BL, tl.sum(b_K * b_x2[None, :], axis=1))


def key_products(xs: list, buf_k: Tensor, cursor: Tensor, slot_ids: Tensor, BL: int) -> Tensor:
    """`[Bt, Hk, len(xs), BL]` fp32 (flat): for row b (slot `slot_ids[b]`) and key head hk, its key
    records (`buf_k` `[N, Lb, Hk, K]`) below its cursor dotted with each vector of `xs` (one or
    two `[Bt, Hk, K]`, last dim contiguous); zero from the cursor on and for padding rows. In a
    scratch buffer that the step's layers share (`utils.launch.scratch_f32`)."""
    Bt, Hk, K = xs[0].shape
    nvec = len(xs)
    kq = scratch_f32(xs[0].device, Bt * Hk * nvec * BL)
    x2 = xs[-1]
    _key_products_kernel[(Bt, Hk)](xs[0], x2, buf_k, cursor, slot_ids, kq, xs[0].stride(0), xs[0].stride(1),
                                   x2.stride(0), x2.stride(1), Hk=Hk, K=K, LB=buf_k.shape[1], BL=BL,
                                   NVEC=nvec, num_warps=4)
    return kq
