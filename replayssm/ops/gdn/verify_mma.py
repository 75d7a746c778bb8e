"""Gated DeltaNet speculative verification on ReplaySSM state with exact 16-bit tensor-core
products (config key `mma`; GDN only).

The step of `verify._replay_verify_kernel` (its docstring has the mathematics and the
contract). That kernel forms each draft's products with the tile as FMA row dots, a chain of
reductions per draft; here the tile meets every draft at once in tensor-core products at fp32
accuracy (`utils.dots.dot_bf16x`: fp32 operands as three exact bf16 pieces, 16-bit operands as
given, a fresh accumulator per K chunk of at most 32 added into fp32 registers).

A product needs N >= 16 columns and T <= 8 drafts give 2T <= 16 vectors, so the drafts' raw
keys (columns 0..TP-1) and raw queries (columns TP..2TP-1) are loaded side by side as one
operand `QK`: one product serves `C k_t` and `C q_t` of every draft. The loads are exact (a
16-bit input stays one piece); the L2 norms and the query scale are column factors applied to
the fp32 results, the norms' sums of squares taken from the same chunks. Per K chunk:

    on an early flush the fold  C_c <- g C_c + X @ Kb_c,  stored (the drafts start from it;
        X: the records' u weighted by their decay to the cursor, Kb_c: their keys as stored)
    Y  += C_c @ QK_c          [BV, NP]   the tile's products with every draft's key and query
    Gc += Kb_c @ QK_c         [BL, NP]   the committed keys' (no flush: a flush leaves none)
    Gd += QK_c^T @ QK_c       [NP, NP]   the drafts' keys' (Gram rows r < TP)

The flush branch is uniform per program and hoisted out of the chunk loop. After the loop the
committed records' terms are one product `U @ W` (`[BV, BL]` u as stored, `W` the fp32
weights `G(j+1..h'+t) (k_j . x)`), and the drafts are solved in order on FMA units, one static
iteration each: draft t reads the u of drafts before it through selects (never a zero weight
times a later draft's value: 0 * NaN), so a poisoned draft reaches only its own and later
outputs. Drafts past a row's count are masked to zero at their loads, never read.

Windows up to 32: the records are the K side of the fold's and of `U @ W`'s products, one
fresh accumulator each. KDA decays each key channel, so its weights cannot be applied after a
product: it keeps the other kernels (`mma_verify_unsupported`).
"""
from __future__ import annotations

from typing import Optional

import triton
import triton.language as tl

from ..utils.cursor import slot_bases, verify_hand_off
from ..utils.dots import dot_bf16x, pieces
from ..utils.launch import slot_pads
from .common import _for_store, _interpreting, _log_decay, _write_shared

__all__ = ["launch_verify_mma", "mma_verify_unsupported"]

# verify.MAX_DRAFT (verify.py imports this module); 2T vectors fill a product's 16 columns
_MAX_T = 8
# the records are a product's K side: one call of dot_bf16x (K at most 32) per product
MAX_WINDOW = 32


def mma_verify_unsupported(family: str, V: int, K: int, T: int, window: int, Lb: int, BV) -> Optional[str]:
    """Why the `mma` kernel does not take this family, shape and program size; None if it does."""
    if family != "gdn":
        return f"family {family!r}: GDN only (KDA's channel-wise decays cannot weight a product's result)"
    if not 1 <= T <= _MAX_T:
        return f"T={T} drafts (1..{_MAX_T})"
    if min(window, Lb) > MAX_WINDOW:
        return f"window {window} above {MAX_WINDOW} (the records are one product's K side)"
    if isinstance(BV, bool) or not isinstance(BV, int) or BV < 16 or BV & (BV - 1):
        return f"BV={BV!r}: a power of two of at least 16 (the products' M side)"
    return None


# ---------------------------------------------------------------------------------------------
# The tensor-core verify kernel.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _col(x, o_c, c):
    """Column `c` of `[R, NP]` `x` as `[R]`, by a select (other columns' NaN stay out)."""
    return tl.sum(tl.where(o_c[None, :] == c, x, 0.0), axis=1)


@triton.jit
def _lane(x, o, i):
    """Lane `i` of vector `x` (lanes `o`), by a select."""
    return tl.sum(tl.where(o == i, x, 0.0), axis=0)


@triton.jit
def _lane_vec(x, o, o_c):
    """`[TP]` vector `x` (lanes `o`) spread over the `[NP]` lanes `o_c` (zero past TP)."""
    return tl.sum(tl.where(o[None, :] == o_c[:, None], x[None, :], 0.0), axis=1)


@triton.jit
def _tile_pass(p_C, o_v, m_v, p_kb, p_xk, p_xq, stride_k_t, stride_q_t, o_l, m_l, t_c, is_k, m_x,
               b_X, g_all, FOLD: tl.constexpr, NKB: tl.constexpr, NQK: tl.constexpr, HK: tl.constexpr,
               K: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BL: tl.constexpr,
               NP: tl.constexpr, WIDEN: tl.constexpr):
    """The tile in K chunks: the fold (FOLD: stored), then the products with the drafts'
    vectors, the committed keys' (not FOLD) and the drafts' keys'; the columns' sums of squares."""
    b_Y = tl.zeros([BV, NP], dtype=tl.float32)
    b_Gc = tl.zeros([BL, NP], dtype=tl.float32)
    b_Gd = tl.zeros([NP, NP], dtype=tl.float32)
    b_ss = tl.zeros([NP], dtype=tl.float32)
    for kc in tl.static_range(0, BK, BKC):
        o_kc = kc + tl.arange(0, BKC)
        m_kc = o_kc < K
        p_Cc = p_C + (o_v[:, None] * K + o_kc[None, :])
        m_Cc = m_v[:, None] & m_kc[None, :]
        b_Cc = tl.load(p_Cc, mask=m_Cc, other=0.0, eviction_policy="evict_first")             # [BV, BKC]
        m_q = m_kc[:, None] & m_x[None, :]
        b_xk = tl.load(p_xk + t_c[None, :] * stride_k_t + o_kc[:, None], mask=m_q & is_k[None, :], other=0.0)
        b_xq = tl.load(p_xq + t_c[None, :] * stride_q_t + o_kc[:, None], mask=m_q & ~is_k[None, :], other=0.0)
        b_QK = tl.where(is_k[None, :], b_xk.to(tl.float32), b_xq.to(tl.float32))            # [BKC, NP]
        b_Kb = tl.load(p_kb + o_l[:, None] * (HK * K) + o_kc[None, :], mask=m_l[:, None] & m_kc[None, :],
                       other=0.0)                                                             # [BL, BKC]
        if FOLD:
            b_Cc = b_Cc * g_all + dot_bf16x(b_X, b_Kb, 3, NKB, WIDEN)
            tl.store(p_Cc, b_Cc, mask=m_Cc)
        else:
            b_Gc += dot_bf16x(b_Kb, b_QK, NKB, NQK, WIDEN)
        b_Y += dot_bf16x(b_Cc, b_QK, 3, NQK, WIDEN)
        b_Gd += dot_bf16x(tl.trans(b_QK), b_QK, NQK, NQK, WIDEN)
        b_ss += tl.sum(b_QK * b_QK, axis=0)
    return b_Y, b_Gc, b_Gd, b_ss


@triton.jit
def _replay_verify_mma_kernel(
    q, k, v, a, b, A_log, dt_bias, o,
    ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch, arrive, slot_ids, num_drafts,
    pad_ckpt, pad_ld, pad_w, pad_k, pad_cur, pad_pend,
    scale, window,
    stride_q_b, stride_q_t, stride_q_h, stride_k_b, stride_k_t, stride_k_h,
    stride_v_b, stride_v_t, stride_v_h, stride_a_b, stride_a_t, stride_a_h,
    stride_b_b, stride_b_t, stride_b_h,
    T: tl.constexpr, TP: tl.constexpr, NP: tl.constexpr, HV: tl.constexpr, HK: tl.constexpr,
    V: tl.constexpr, K: tl.constexpr, LBCAP: tl.constexpr, BL: tl.constexpr, BV: tl.constexpr,
    BK: tl.constexpr, BKC: tl.constexpr, HVP: tl.constexpr, HKP: tl.constexpr, NKB: tl.constexpr,
    NW: tl.constexpr, NQK: tl.constexpr, USE_QK_L2NORM: tl.constexpr, HAS_NDRAFT: tl.constexpr,
    EXACT_BF16: tl.constexpr, WIDEN: tl.constexpr,
):
    NV: tl.constexpr = (V + BV - 1) // BV
    HG: tl.constexpr = HV // HK
    # grid (HV * NV, Bt), V-block fastest (as the Triton kernel): V-block i_v of value head i_hv
    pid = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    i_v = pid % NV
    i_hv = pid // NV
    i_hk = i_hv // HG

    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_t = tl.arange(0, TP)
    o_c = tl.arange(0, NP)
    o_l = tl.arange(0, BL)
    p_o = o + (i_b * T * HV + i_hv) * V

    i_s = tl.load(slot_ids + i_b).to(tl.int64)
    if i_s < 0:
        tl.store(p_o + o_t[None, :] * (HV * V) + o_v[:, None],
                 tl.zeros([BV, TP], dtype=tl.float32).to(p_o.dtype.element_ty), mask=m_v[:, None] & (o_t < T)[None, :])
        return
    ckpt, buf_ld, buf_w, buf_k, cursor = slot_bases(i_s, ckpt, buf_ld, buf_w, buf_k, cursor, pad_ckpt, pad_ld,
                                                    pad_w, pad_k, pad_cur)
    pending += i_s * pad_pend
    h = tl.load(cursor + i_s).to(tl.int64)
    if HAS_NDRAFT:
        # unvalidated counts are clamped to 0..T, so that no draft lands past the buffer
        n = tl.minimum(tl.maximum(tl.load(num_drafts + i_b).to(tl.int64), 0), T)
    else:
        n = tl.full([], T, tl.int64)
    flush = h + n > window
    hc = tl.where(flush, 0, h)              # committed records the drafts follow (h')
    m_t = o_t < n
    m_l = o_l < h                           # records at or past the cursor: never loaded

    # columns: draft t_c's key (is_k) or query; padding columns and drafts past n load zeros
    is_k = o_c < TP
    t_c = tl.where(is_k, o_c, o_c - TP)
    m_x = (o_c < 2 * TP) & (t_c < n)

    # the committed records: log decays, u of this V-block (transposed), decay suffixes
    # sum_{j<i<h} ld_i, each a sum of same-signed terms
    o_p0 = i_s * LBCAP
    p_kb = buf_k + (o_p0 * HK + i_hk) * K
    p_wb = buf_w + (o_p0 * HV + i_hv) * V
    b_ldc = tl.load(buf_ld + (o_p0 + o_l) * HV + i_hv, mask=m_l, other=0.0)                     # [BL]
    b_U = tl.load(p_wb + o_l[None, :] * (HV * V) + o_v[:, None], mask=m_v[:, None] & m_l[None, :], other=0.0)
    b_sfx = tl.sum(tl.where(o_l[None, :] > o_l[:, None], b_ldc[None, :], 0.0), axis=1)          # [BL]
    b_Lh = tl.sum(b_ldc, axis=0)                                                               # log g_{0:h-1}

    # the drafts' values, decays and betas (drafts past n: zeros, never read)
    b_Vd = tl.load(v + i_b * stride_v_b + i_hv * stride_v_h + o_t[None, :] * stride_v_t + o_v[:, None],
                   mask=m_v[:, None] & m_t[None, :], other=0.0).to(tl.float32)                 # [BV, TP]
    b_A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    b_a = tl.load(a + i_b * stride_a_b + i_hv * stride_a_h + o_t * stride_a_t, mask=m_t, other=0.0)
    b_ldd = tl.where(m_t, _log_decay(b_a.to(tl.float32) + tl.load(dt_bias + i_hv).to(tl.float32), b_A), 0.0)
    b_bb = tl.load(b + i_b * stride_b_b + i_hv * stride_b_h + o_t * stride_b_t, mask=m_t, other=0.0)
    b_beta = tl.where(m_t, tl.sigmoid(b_bb.to(tl.float32)), 0.0)

    p_C = ckpt + (i_s * HV + i_hv) * (V * K)
    p_xk = k + i_b * stride_k_b + i_hk * stride_k_h
    p_xq = q + i_b * stride_q_b + i_hk * stride_q_h
    if flush:
        # C <- g_{0:h-1} C + sum_{j<h} g_{j+1:h-1} u_j k_j^T, chunk by chunk, stored
        b_X = b_U.to(tl.float32) * tl.where(m_l, tl.exp(b_sfx), 0.0)[None, :]
        b_Y, b_Gc, b_Gd, b_ss = _tile_pass(p_C, o_v, m_v, p_kb, p_xk, p_xq, stride_k_t, stride_q_t, o_l, m_l,
                                           t_c, is_k, m_x, b_X, tl.exp(b_Lh), True, NKB, NQK, HK, K, BV, BK,
                                           BKC, BL, NP, WIDEN)
    else:
        b_Y, b_Gc, b_Gd, b_ss = _tile_pass(p_C, o_v, m_v, p_kb, p_xk, p_xq, stride_k_t, stride_q_t, o_l, m_l,
                                           t_c, is_k, m_x, b_U, 1.0, False, NKB, NQK, HK, K, BV, BK, BKC, BL,
                                           NP, WIDEN)

    # column factors: the key's L2 norm, the query's norm and scale (`common._load_qk`)
    if USE_QK_L2NORM:
        b_f = tl.rsqrt(b_ss + 1e-6)
    else:
        b_f = tl.full([NP], 1.0, tl.float32)
    b_f = tl.where(is_k, b_f, b_f * scale)
    # column c's decay from the committed state to its draft: D_t = ld_0 + ... + ld_t
    b_D = tl.sum(tl.where(o_t[:, None] <= t_c[None, :], b_ldd[:, None], 0.0), axis=0)           # [NP]
    b_Lc = tl.where(flush, 0.0, b_Lh)                                                          # log g_{0:h'-1}

    # the committed part of P_t x for every column: G(0..h'+t) C x + sum_{j<h'} G(j+1..h'+t) (k_j.x) u_j
    b_P = b_Y * (tl.exp(b_Lc + b_D) * b_f)[None, :]
    b_W = tl.where((o_l < hc)[:, None] & m_x[None, :],
                   tl.exp(b_sfx[:, None] + b_D[None, :]) * b_f[None, :] * b_Gc, 0.0)           # [BL, NP]
    b_P += dot_bf16x(b_U, b_W, NW, 3, WIDEN)
    b_Gn = b_Gd * b_f[:, None] * b_f[None, :]           # k_r . x_c, normalised, rows r < TP

    # the drafts in order (forward substitution); b_Ud holds the u of the drafts solved so far
    b_Ud = tl.zeros([BV, NP], dtype=tl.float32)
    b_O = tl.zeros([BV, TP], dtype=tl.float32)
    for t in tl.static_range(T):
        # weights G(h'+r+1..h'+t) of earlier drafts r < t (the rows), zero elsewhere
        b_dsx = tl.sum(tl.where((o_t[None, :] > o_c[:, None]) & (o_t[None, :] <= t), b_ldd[None, :], 0.0), axis=1)
        m_r = o_c < t
        b_wk = tl.where(m_r, tl.exp(b_dsx) * _col(b_Gn, o_c, t), 0.0)
        b_wq = tl.where(m_r, tl.exp(b_dsx) * _col(b_Gn, o_c, TP + t), 0.0)
        b_Pk = _col(b_P, o_c, t) + tl.sum(b_Ud * b_wk[None, :], axis=1)
        b_u = _lane(b_beta, o_t, t) * (_col(b_Vd, o_t, t) - b_Pk)
        b_kq = _lane(_col(b_Gn, o_c, TP + t), o_c, t)
        b_o = _col(b_P, o_c, TP + t) + tl.sum(b_Ud * b_wq[None, :], axis=1) + b_kq * b_u
        b_Ud = tl.where(o_c[None, :] == t, b_u[:, None], b_Ud)
        b_O = tl.where(o_t[None, :] == t, b_o[:, None], b_O)
    b_O = tl.where(m_t[None, :], b_O, 0.0)
    p_ot = p_o + o_t[None, :] * (HV * V) + o_v[:, None]
    tl.store(p_ot, _for_store(b_O, p_ot, EXACT_BF16), mask=m_v[:, None] & (o_t < T)[None, :])

    # the drafts' records at h'..h'+n-1 (< LBCAP guards other slots against a bad cursor). On a
    # flush this program's threads read positions 0..h-1 above: a barrier first
    tl.debug_barrier()
    m_w = (o_c < n) & (hc + o_c < LBCAP)
    p_w = p_wb + (hc + o_c)[None, :] * (HV * V) + o_v[:, None]
    tl.store(p_w, _for_store(b_Ud, p_w, EXACT_BF16), mask=m_v[:, None] & m_w[None, :])
    if not flush:
        # positions >= h, which no program reads in this launch: the decay by V-block 0 of the
        # head, the normalised key by that of the key head's first value head
        if i_v == 0:
            tl.store(buf_ld + (o_p0 + hc + o_c) * HV + i_hv, _lane_vec(b_ldd, o_t, o_c), mask=m_w)
            if i_hv % HG == 0:
                o_k = tl.arange(0, BK)
                m_kd = m_w[:, None] & (o_k < K)[None, :]
                b_Kd = tl.load(p_xk + o_c[:, None] * stride_k_t + o_k[None, :], mask=m_kd, other=0.0)
                b_Kd = b_Kd.to(tl.float32) * tl.where(is_k, b_f, 1.0)[:, None]
                p_kd = p_kb + (hc + o_c)[:, None] * (HK * K) + o_k[None, :]
                tl.store(p_kd, _for_store(b_Kd, p_kd, EXACT_BF16), mask=m_kd)

    last = verify_hand_off(arrive, cursor, pending, epoch, i_s, hc, n, flush, HV * NV)
    if last & flush:
        # positions 0..n-1 held committed records that other programs of the slot read
        o_k = tl.arange(0, BK)
        _write_shared(k, a, A_log, dt_bias, buf_ld, buf_k, i_b, i_s, n, o_k, o_k < K,
                      stride_k_b, stride_k_t, stride_k_h, stride_a_b, stride_a_t, stride_a_h,
                      T, HV, HK, K, LBCAP, HVP, HKP, False, USE_QK_L2NORM, EXACT_BF16)


def launch_verify_mma(q, k, v, a, b, A_log, dt_bias, scale: float, ckpt, buf_ld, buf_w, buf_k, cursor,
                      pending, epoch, arrive, slot_ids, num_drafts, window: int, o, use_qk_l2norm: bool,
                      BV: int, num_warps: int, num_stages: int, family: str = "gdn") -> None:
    """Launch `_replay_verify_mma_kernel`; inputs validated, `mma_verify_unsupported` None."""
    Bt, T, Hk, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    Lb = buf_w.shape[1]
    why = mma_verify_unsupported(family, V, K, T, window, Lb, BV)
    if why is not None:
        raise ValueError(f"config mma=True: {why}")
    if Bt == 0:
        return
    BV = max(16, min(BV, triton.next_power_of_2(V)))
    NV = triton.cdiv(V, BV)
    TP = max(2, triton.next_power_of_2(T))
    BK = max(16, triton.next_power_of_2(K))
    _replay_verify_mma_kernel[(HV * NV, Bt)](
        q, k, v, a, b, A_log, dt_bias, o,
        ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch, arrive, slot_ids,
        num_drafts if num_drafts is not None else slot_ids,
        *slot_pads(ckpt, buf_ld, buf_w, buf_k, cursor, pending).values(),
        scale, window,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        T=T, TP=TP, NP=max(16, 2 * TP), HV=HV, HK=Hk, V=V, K=K, LBCAP=Lb,
        BL=max(16, triton.next_power_of_2(min(window, Lb))), BV=BV, BK=BK, BKC=min(32, BK),
        HVP=triton.next_power_of_2(HV), HKP=triton.next_power_of_2(Hk),
        NKB=pieces(buf_k.dtype), NW=pieces(buf_w.dtype), NQK=max(pieces(q.dtype), pieces(k.dtype)),
        USE_QK_L2NORM=bool(use_qk_l2norm), HAS_NDRAFT=num_drafts is not None, EXACT_BF16=_interpreting(),
        WIDEN=_interpreting(), num_warps=num_warps, num_stages=num_stages)
