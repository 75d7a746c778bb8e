"""The records' key products of a step, formed once per (row, key head) by a small Triton launch
before a Gluon step (`lowp_config`'s `gluon_kq`; the Mamba-2 decode's and the verify kernels'
config `kq`): `k_j . x` for the key records `j` below the row's cursor and the token's one or
two vectors `x` of that key head (Mamba-2: the query `C`; GDN: the raw key and query,
normalised after). Every program of the key head's value
heads and V-blocks would otherwise load the same key records (4 KB in bf16 at window 16) and form
the same products: at a low-precision read that was a sixth of an fp16 step's L2 traffic
(docs/precision.md). Triton, so the CPU interpreter runs it too."""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .launch import scratch_f32

__all__ = ["key_products", "verify_key_products", "gdn_verify_key_products"]


@triton.jit
def _key_products_kernel(x1, x2, buf_k, cursor, slot_ids, kq, pad_k, pad_cur, stride_1b, stride_1h, stride_2b,
                         stride_2h, Hk: tl.constexpr, K: tl.constexpr, LB: tl.constexpr, BL: tl.constexpr,
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
    h = tl.load(cursor + slot * pad_cur + slot)
    o_k = tl.arange(0, K)
    m_l = (o_l < h) & (o_l < LB)
    b_K = tl.load(buf_k + slot * pad_k + ((slot * LB + o_l[:, None]) * Hk + i_h) * K + o_k[None, :],
                  mask=m_l[:, None], other=0.0).to(tl.float32)
    b_x1 = tl.load(x1 + i_b * stride_1b + i_h * stride_1h + o_k).to(tl.float32)
    tl.store(p_kq, tl.sum(b_K * b_x1[None, :], axis=1))
    if NVEC == 2:
        b_x2 = tl.load(x2 + i_b * stride_2b + i_h * stride_2h + o_k).to(tl.float32)
        tl.store(p_kq + BL, tl.sum(b_K * b_x2[None, :], axis=1))


def key_products(xs: list, buf_k: Tensor, cursor: Tensor, slot_ids: Tensor, BL: int, pad_k: int = 0,
                 pad_cur: int = 0) -> Tensor:
    """`[Bt, Hk, len(xs), BL]` fp32 (flat): for row b (slot `slot_ids[b]`) and key head hk, its key
    records (`buf_k` `[N, Lb, Hk, K]`) below its cursor dotted with each vector of `xs` (one or
    two `[Bt, Hk, K]`, last dim contiguous); zero from the cursor on and for padding rows.
    `pad_k`, `pad_cur`: the state's slot paddings (`utils.launch.slot_pads`; vLLM's pages). In a
    scratch buffer that the step's layers share (`utils.launch.scratch_f32`)."""
    Bt, Hk, K = xs[0].shape
    nvec = len(xs)
    kq = scratch_f32(xs[0].device, Bt * Hk * nvec * BL)
    x2 = xs[-1]
    _key_products_kernel[(Bt, Hk)](xs[0], x2, buf_k, cursor, slot_ids, kq, pad_k, pad_cur, xs[0].stride(0),
                                   xs[0].stride(1), x2.stride(0), x2.stride(1), Hk=Hk, K=K, LB=buf_k.shape[1], BL=BL,
                                   NVEC=nvec, num_warps=4)
    return kq


@triton.jit
def _verify_key_products_kernel(C, B, buf_k, cursor, slot_ids, num_drafts, kq, pad_k, pad_cur,
                                stride_C_b, stride_C_t, stride_C_g, stride_B_b, stride_B_t, stride_B_g,
                                Hk: tl.constexpr, K: tl.constexpr, LB: tl.constexpr, WINDOW: tl.constexpr,
                                T: tl.constexpr, TP: tl.constexpr, BL: tl.constexpr, PD: tl.constexpr,
                                HAS_N: tl.constexpr):
    # one (row, group) of a Mamba-2 verify: rows 0..BL-1 of kq[b, g] hold k_j . q_t for the
    # committed records j < h' (h' = 0 after an early flush, decided as the verify kernel
    # decides it), rows BL..BL+PD-1 the drafts' k_r . q_t; zero elsewhere
    i_b = tl.program_id(0).to(tl.int64)
    i_g = tl.program_id(1)
    slot = tl.load(slot_ids + i_b).to(tl.int64)
    o_t = tl.arange(0, TP)
    o_j = tl.arange(0, BL)
    o_r = tl.arange(0, PD)
    p_kq = kq + (i_b * Hk + i_g) * ((BL + PD) * TP)
    if slot < 0:
        tl.store(p_kq + o_j[:, None] * TP + o_t[None, :], tl.zeros([BL, TP], tl.float32))
        tl.store(p_kq + (BL + o_r)[:, None] * TP + o_t[None, :], tl.zeros([PD, TP], tl.float32))
        return
    h = tl.load(cursor + slot * pad_cur + slot)
    if HAS_N:
        n = tl.minimum(tl.maximum(tl.load(num_drafts + i_b), 0), T)
    else:
        n = h * 0 + T
    hc = tl.where(h + n > WINDOW, 0, h)
    o_k = tl.arange(0, K)
    m_t = o_t < T
    b_Q = tl.load(C + i_b * stride_C_b + i_g * stride_C_g + o_t[:, None] * stride_C_t + o_k[None, :],
                  mask=m_t[:, None], other=0.0).to(tl.float32)                              # [TP, K]
    p_K = buf_k + slot * pad_k + ((slot * LB + o_j[:, None]) * Hk + i_g) * K + o_k[None, :]
    b_K = tl.load(p_K, mask=((o_j < hc) & (o_j < LB))[:, None], other=0.0).to(tl.float32)  # [BL, K]
    b_kq = tl.sum(b_K[:, None, :] * b_Q[None, :, :], axis=2)                               # [BL, TP]
    tl.store(p_kq + o_j[:, None] * TP + o_t[None, :], b_kq)
    b_D = tl.load(B + i_b * stride_B_b + i_g * stride_B_g + o_r[:, None] * stride_B_t + o_k[None, :],
                  mask=(o_r < T)[:, None], other=0.0).to(tl.float32)                        # [PD, K]
    b_dq = tl.sum(b_D[:, None, :] * b_Q[None, :, :], axis=2)                               # [PD, TP]
    tl.store(p_kq + (BL + o_r)[:, None] * TP + o_t[None, :], b_dq)


def verify_key_products(C: Tensor, B: Tensor, buf_k: Tensor, cursor: Tensor, slot_ids: Tensor, num_drafts,
                        window: int, BL: int, TP: int, PD: int, pad_k: int = 0, pad_cur: int = 0) -> Tensor:
    """A Mamba-2 verify's group products, `[Bt, Hk, BL + PD, TP]` fp32 (flat): for row b and
    group g, rows `j < BL` hold `k_j . q_t` for its committed records below `h'` (its cursor, or 0
    when `h + n > window`: the verify's early flush; `n` its clamped draft count), rows `BL + r`
    the drafts' `k_r . q_t` (queries `C`, keys `B`, `[Bt, T, Hk, K]`); zero elsewhere and for
    padding rows. `pad_k`, `pad_cur`: the state's slot paddings (`utils.launch.slot_pads`). In
    a scratch buffer that the step's layers share (`utils.launch.scratch_f32`)."""
    Bt, T, Hk, K = C.shape
    kq = scratch_f32(C.device, Bt * Hk * (BL + PD) * TP)
    _verify_key_products_kernel[(Bt, Hk)](
        C, B, buf_k, cursor, slot_ids, num_drafts if num_drafts is not None else slot_ids, kq, pad_k, pad_cur,
        C.stride(0), C.stride(1), C.stride(2), B.stride(0), B.stride(1), B.stride(2),
        Hk=Hk, K=K, LB=buf_k.shape[1], WINDOW=int(window), T=T, TP=TP, BL=BL, PD=PD,
        HAS_N=num_drafts is not None, num_warps=4)
    return kq


@triton.jit
def _gdn_verify_key_products_kernel(q, k, buf_k, cursor, slot_ids, kq, pad_k, pad_cur, scale,
                                    stride_q_b, stride_q_t, stride_q_h, stride_k_b, stride_k_t, stride_k_h,
                                    Hk: tl.constexpr, K: tl.constexpr, LB: tl.constexpr, T: tl.constexpr,
                                    TP: tl.constexpr, BL: tl.constexpr, USE_QK_L2NORM: tl.constexpr):
    # one (row, key head) of a GDN verify, with the drafts' keys and queries normalised (and the
    # queries scaled) as the verify kernel does: [t, r] k_t . k_r and q_t . k_r, then
    # [j, t] k_j . k_t and k_j . q_t for the key records j < h (unweighted: the decay weights are
    # the value heads'); zero past T, past the cursor and for a padding row
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    slot = tl.load(slot_ids + i_b).to(tl.int64)
    o_t = tl.arange(0, TP)
    o_r = tl.arange(0, TP)
    o_j = tl.arange(0, 4)
    p_kq = kq + (i_b * Hk + i_h) * (2 * TP * TP + 2 * BL * TP)
    p_G = p_kq + o_t[:, None] * TP + o_r[None, :]
    if slot < 0:
        tl.store(p_G, tl.zeros([TP, TP], tl.float32))
        tl.store(p_G + TP * TP, tl.zeros([TP, TP], tl.float32))
        for j0 in tl.static_range(0, BL, 4):
            p_Z = p_kq + 2 * TP * TP + (j0 + o_j)[:, None] * TP + o_t[None, :]
            tl.store(p_Z, tl.zeros([4, TP], tl.float32))
            tl.store(p_Z + BL * TP, tl.zeros([4, TP], tl.float32))
        return
    h = tl.load(cursor + slot * pad_cur + slot)
    o_k = tl.arange(0, K)
    m_t = (o_t < T)[:, None]
    b_k = tl.load(k + i_b * stride_k_b + i_h * stride_k_h + o_t[:, None] * stride_k_t + o_k[None, :], mask=m_t,
                  other=0.0).to(tl.float32)
    b_q = tl.load(q + i_b * stride_q_b + i_h * stride_q_h + o_t[:, None] * stride_q_t + o_k[None, :], mask=m_t,
                  other=0.0).to(tl.float32)
    if USE_QK_L2NORM:
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=1) + 1e-6)[:, None]
    b_q = b_q * scale
    tl.store(p_G, tl.sum(b_k[:, None, :] * b_k[None, :, :], axis=2))
    tl.store(p_G + TP * TP, tl.sum(b_q[:, None, :] * b_k[None, :, :], axis=2))
    p_Kr = buf_k + slot * pad_k + ((slot * LB) * Hk + i_h) * K
    for j0 in tl.static_range(0, BL, 4):
        o_jj = j0 + o_j
        b_R = tl.load(p_Kr + (o_jj[:, None] * Hk) * K + o_k[None, :], mask=((o_jj < h) & (o_jj < LB))[:, None],
                      other=0.0).to(tl.float32)                                            # [4, K]
        p_Z = p_kq + 2 * TP * TP + o_jj[:, None] * TP + o_t[None, :]
        tl.store(p_Z, tl.sum(b_R[:, None, :] * b_k[None, :, :], axis=2))
        tl.store(p_Z + BL * TP, tl.sum(b_R[:, None, :] * b_q[None, :, :], axis=2))


def gdn_verify_key_products(q: Tensor, k: Tensor, buf_k: Tensor, cursor: Tensor, slot_ids: Tensor, scale: float,
                            use_qk_l2norm: bool, BL: int, TP: int, pad_k: int = 0, pad_cur: int = 0) -> Tensor:
    """A GDN verify's key-head products, `[Bt, Hk, 2 TP^2 + 2 BL TP]` fp32 (flat): with the
    drafts' keys `k_t` and queries `q_t` (`[Bt, T, Hk, K]`) L2-normalised (`use_qk_l2norm`) and
    the queries times `scale`, first `[TP, TP]` `k_t . k_r`, then `q_t . k_r`, then `[BL, TP]`
    `k_j . k_t` and `k_j . q_t` for the key records below the row's cursor (unweighted); zero
    elsewhere and for padding rows. `pad_k`, `pad_cur` as `verify_key_products`'s."""
    Bt, T, Hk, K = q.shape
    kq = scratch_f32(q.device, Bt * Hk * (2 * TP * TP + 2 * BL * TP))
    _gdn_verify_key_products_kernel[(Bt, Hk)](
        q, k, buf_k, cursor, slot_ids, kq, pad_k, pad_cur, float(scale),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        Hk=Hk, K=K, LB=buf_k.shape[1], T=T, TP=TP, BL=BL, USE_QK_L2NORM=bool(use_qk_l2norm), num_warps=4)
    return kq
