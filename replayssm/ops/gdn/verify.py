"""ReplaySSM speculative verification for Gated DeltaNet (and, through `IS_KDA`, Kimi Delta
Attention): T tokens per row in one launch, output-only (docs/state-layout.md, `verify`; SPEC
section 4).

Each program owns one `(row, value head, V-block)` tile `[BV, K]` of the checkpoint `C`, reads
it once and serves all T drafts. For the row's slot with cursor `h` and `n` drafts, the drafts
follow `h' = h`, or `h' = 0` after an early flush (`h + n > window`: the committed records are
folded into the tile first and it is written back). Draft `t` sits at position `h' + t`; with
`P_t = a_t S_{t-1}` (never materialised) and `G(i..p) = exp(ld_i + ... + ld_p)`:

    P_t k = G(0..h'+t) C k + sum_{j<h'} G(j+1..h'+t) (k_j.k) u_j + sum_{r<t} G(h'+r+1..h'+t) (k_r.k) u_r
    u_t   = beta_t (v_t - P_t k_t)                    (forward substitution over the drafts)
    o_t   = P_t q_t + (k_t.q_t) u_t

The delta rule's `u` of a value row depends on that row of `S` only, so the V-blocks of a head
are independent programs. A serial chain of matrix-vector products per draft is latency-bound,
so every product that does not need an earlier draft's `u` is a tensor-core product over all
drafts at once (`utils.dots.dot_f32`: fp32 accuracy from TF32 pieces, one piece for bf16/fp16
records and inputs): `C Kd^T`, `C Q^T` `[BV, TP]` (TP >= 16 drafts, rows past `n` zero), the
committed keys' Grams with the drafts `[Lb, TP]`, the drafts' own `[TP, TP]`, and the committed
`u` times the weighted Grams. The products over K run in chunks of BKC columns, a loop that is
not unrolled, so that one chunk's operand pieces are live at a time. The drafts' raw keys and
queries enter them; the L2 norms, summed on the way, scale the results (rows and columns).

What stays serial is a T-step forward substitution on `[BV, TP]` tiles, right-looking: step t
reads `u_t` from column t of the residual, removes its term from the later columns and adds it
to the outputs of drafts `>= t`, each through a `tl.where` on the product, so that a poisoned
(NaN) later draft never reaches an earlier output or `u`.

Decay weights are direct sums of log decays or products of factors <= 1, never differences of
prefix sums (their cancellation costs digits on fast heads) nor inverse decays (KDA: overflow
within a few drafts). KDA's committed keys are scaled per channel by their decay to `h'`, the
drafts' rows by their decay from `h'`, so that their Gram factorises; the draft-draft products
need the decay between two drafts and are one `[TP, BKC]` cumulative product per draft. An
early flush folds the committed records in closed form, one `[BV, Lb] @ [Lb, BKC]` product per
chunk (records weighted by their decay to the flush), and writes the chunk back.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..utils.checks import check_tensor, may_sync
from ..utils.cursor import verify_hand_off
from ..utils.dots import dot_f32
from ..utils.launch import arrive_counter
from .common import (_FLOATS, _for_store, _interpreting, _scale, check_cursor_values, check_devices,
                     check_slot_ids, check_slot_values, check_state)

__all__ = ["replay_verify", "run_verify", "verify_config"]

MAX_DRAFT = 8
# tl.dot's smallest tile side: the drafts, record rows and value rows are padded to it
MIN_DOT = 16

# ---------------------------------------------------------------------------------------------
# The verify kernel.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _log_decay(b_x, b_A):
    """`-A softplus(x)` with the operations of `common._load_head` (the same bits)."""
    b_e = tl.exp(-tl.abs(b_x))
    b_1e = 1.0 + b_e
    b_d = b_1e - 1.0
    b_l1p = tl.where(b_d == 0.0, b_e, tl.log(b_1e) * (b_e / tl.where(b_d == 0.0, 1.0, b_d)))
    return -b_A * (tl.maximum(b_x, 0.0) + b_l1p)


@triton.jit
def _row(b_X, sel):
    """Row `sel` (a one-hot `[R]` mask) of an `[R, C]` tile, selected: other rows' NaN stay out."""
    return tl.sum(tl.where(sel[:, None], b_X, 0.), axis=0)


@triton.jit
def _write_shared(k, a, A_log, dt_bias, buf_ld, buf_k, i_b, i_s, n, o_k, m_k,
                  stride_k_b, stride_k_t, stride_k_h, stride_a_b, stride_a_t, stride_a_h,
                  T: tl.constexpr, HV: tl.constexpr, HK: tl.constexpr, K: tl.constexpr,
                  LBCAP: tl.constexpr, HVP: tl.constexpr, HKP: tl.constexpr,
                  IS_KDA: tl.constexpr, USE_QK_L2NORM: tl.constexpr, EXACT_BF16: tl.constexpr):
    """On an early flush, the drafts' fields other programs of the slot read as committed
    records until they all arrived: every value head's log decay and every key head's key at
    positions `0..n-1`, recomputed from the inputs by the slot's last program."""
    o_hv = tl.arange(0, HVP)
    m_hv = o_hv < HV
    o_hk = tl.arange(0, HKP)
    m_hk = o_hk < HK
    b_A = tl.exp(tl.load(A_log + o_hv, mask=m_hv, other=0.).to(tl.float32))
    if IS_KDA:
        b_dt = tl.load(dt_bias + o_hv[:, None] * K + o_k[None, :], mask=m_hv[:, None] & m_k[None, :],
                       other=0.).to(tl.float32)
    else:
        b_dt = tl.load(dt_bias + o_hv, mask=m_hv, other=0.).to(tl.float32)
    for t in tl.static_range(T):
        ok = t < n
        p_kt = k + i_b * stride_k_b + t * stride_k_t
        m_kh = m_hk[:, None] & m_k[None, :]
        b_k = tl.load(p_kt + o_hk[:, None] * stride_k_h + o_k[None, :], mask=m_kh, other=0.).to(tl.float32)
        if USE_QK_L2NORM:
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
        p_kb = buf_k + ((i_s * LBCAP + t) * HK + o_hk)[:, None] * K + o_k[None, :]
        tl.store(p_kb, _for_store(b_k, p_kb, EXACT_BF16), mask=tl.where(ok, m_kh, False))
        p_at = a + i_b * stride_a_b + t * stride_a_t
        if IS_KDA:
            m_a = m_hv[:, None] & m_k[None, :]
            b_a = tl.load(p_at + o_hv[:, None] * stride_a_h + o_k[None, :], mask=m_a, other=0.).to(tl.float32)
            b_ld = tl.where(m_a, _log_decay(b_a + b_dt, b_A[:, None]), 0.)
            tl.store(buf_ld + ((i_s * LBCAP + t) * HV + o_hv)[:, None] * K + o_k[None, :], b_ld,
                     mask=tl.where(ok, m_a, False))
        else:
            b_a = tl.load(p_at + o_hv * stride_a_h, mask=m_hv, other=0.).to(tl.float32)
            tl.store(buf_ld + (i_s * LBCAP + t) * HV + o_hv, _log_decay(b_a + b_dt, b_A),
                     mask=tl.where(ok, m_hv, False))


@triton.jit
def _draft_rows(p, i_b, i_h, o_t, m_t, o_k, m_k, stride_b, stride_t, stride_h):
    """Rows `t` (valid where `m_t`, others zero) of a `[Bt, T, H, K]` input at columns `o_k`: `[TP, BKC]` fp32."""
    return tl.load(p + i_b * stride_b + i_h * stride_h + o_t[:, None] * stride_t + o_k[None, :],
                   mask=m_t[:, None] & m_k[None, :], other=0.).to(tl.float32)


@triton.jit
def _replay_verify_kernel(
    q, k, v, a, b, A_log, dt_bias, o,
    ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch, arrive, slot_ids, num_drafts,
    scale, window,
    stride_q_b, stride_q_t, stride_q_h, stride_k_b, stride_k_t, stride_k_h,
    stride_v_b, stride_v_t, stride_v_h, stride_a_b, stride_a_t, stride_a_h,
    stride_b_b, stride_b_t, stride_b_h,
    T: tl.constexpr, TP: tl.constexpr, HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr,
    K: tl.constexpr, LBCAP: tl.constexpr, LB: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    BKC: tl.constexpr, HVP: tl.constexpr, HKP: tl.constexpr, IS_KDA: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, HAS_NDRAFT: tl.constexpr, EXACT_BF16: tl.constexpr,
    W_EXACT: tl.constexpr, KA_EXACT: tl.constexpr, KD_EXACT: tl.constexpr, Q_EXACT: tl.constexpr,
):
    NV: tl.constexpr = (V + BV - 1) // BV
    HG: tl.constexpr = HV // HK
    # grid (HV * NV, Bt), V-block fastest: a program owns V-block i_v of value head i_hv
    pid = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    i_v = pid % NV
    i_hv = pid // NV
    i_hk = i_hv // HG

    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_t = tl.arange(0, TP)
    # [BV, TP] offsets of the drafts' outputs
    p_o = o + (i_b * T * HV + i_hv) * V + (o_t[None, :] * (HV * V) + o_v[:, None])
    m_o = m_v[:, None] & (o_t < T)[None, :]

    i_s = tl.load(slot_ids + i_b).to(tl.int64)
    if i_s < 0:
        tl.store(p_o, tl.zeros([BV, TP], dtype=tl.float32).to(p_o.dtype.element_ty), mask=m_o)
        return
    h = tl.load(cursor + i_s).to(tl.int64)
    if HAS_NDRAFT:
        n = tl.load(num_drafts + i_b).to(tl.int64)
    else:
        n = tl.full([], T, tl.int64)
    flush = h + n > window
    keep = h + n <= window
    hc = tl.where(flush, 0, h)              # committed records the drafts follow (h')
    m_t = o_t < n

    # the drafts' values [BV, TP], betas and (GDN) log decays [TP], rows past n zero
    b_VT = tl.load(v + i_b * stride_v_b + i_hv * stride_v_h + o_t[None, :] * stride_v_t + o_v[:, None],
                   mask=m_v[:, None] & m_t[None, :], other=0.).to(tl.float32)
    b_beta = tl.sigmoid(tl.load(b + i_b * stride_b_b + i_hv * stride_b_h + o_t * stride_b_t,
                                mask=m_t, other=0.).to(tl.float32))
    b_A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    if not IS_KDA:
        b_a = tl.load(a + i_b * stride_a_b + i_hv * stride_a_h + o_t * stride_a_t, mask=m_t,
                      other=0.).to(tl.float32)
        b_ld = tl.where(m_t, _log_decay(b_a + tl.load(dt_bias + i_hv).to(tl.float32), b_A), 0.)

    # Records 0..h-1, rows j of the record tiles: the committed records the drafts read, or
    # those an early flush folds. Rows at or past the cursor are never loaded (NaN stays out)
    o_j = tl.arange(0, LB)
    m_j = o_j < h
    m_j1 = (o_j + 1) < h
    m_a = o_j < hc                                        # the records the drafts read
    o_p0 = i_s * LBCAP
    b_UaT = tl.load(buf_w + (o_p0 * HV + i_hv) * V + (o_j[None, :] * (HV * V) + o_v[:, None]),
                    mask=m_v[:, None] & m_j[None, :], other=0.).to(tl.float32)          # [BV, LB]
    p_Ka = buf_k + (o_p0 * HK + i_hk) * K + o_j[:, None] * (HK * K)
    p_C = ckpt + (i_s * HV + i_hv) * (V * K) + o_v[:, None] * K
    # lane j of the shifted decays holds ld_{j+1}: a reverse scan gives each record's suffix sum,
    # its log weight to position h - 1
    if IS_KDA:
        p_ld = buf_ld + (o_p0 * HV + i_hv) * K
    else:
        p_ld = buf_ld + o_p0 * HV + i_hv
        b_LDs = tl.load(p_ld + (o_j + 1) * HV, mask=m_j1, other=0.)                   # [LB]
        b_ld0 = tl.load(p_ld, mask=h > 0, other=0.)
        b_La = tl.cumsum(b_LDs, axis=0, reverse=True)     # record j: ld_{j+1} + ... + ld_{h-1}
        b_Lc = b_ld0 + tl.sum(b_LDs, axis=0)              # ld_0 + ... + ld_{h-1}
        b_UwT = b_UaT * tl.exp(b_La)[None, :]             # the records as a flush folds them
        b_gf = tl.exp(b_Lc)
        b_Lc = tl.where(flush, 0., b_Lc)

    # Every product over K, K in chunks of BKC (a loop, not unrolled: the TF32 pieces of one
    # chunk's operands, not of the whole tile, are live at a time). The drafts' raw keys and
    # queries enter the products; their L2 norms, summed on the way, scale the results after.
    # Columns t: Pk = C k_t, Pq = C q_t [BV, TP]; Gk, Gq: the records' keys with k_t, q_t
    # [LB, TP]; Gd, Bd: the drafts' keys with k_t, q_t [TP, TP] (KDA: all decay-weighted)
    b_Pk = tl.zeros([BV, TP], dtype=tl.float32)
    b_Pq = tl.zeros([BV, TP], dtype=tl.float32)
    b_Gk = tl.zeros([LB, TP], dtype=tl.float32)
    b_Gq = tl.zeros([LB, TP], dtype=tl.float32)
    b_Gd = tl.zeros([TP, TP], dtype=tl.float32)
    b_Bd = tl.zeros([TP, TP], dtype=tl.float32)
    b_kk = tl.zeros([TP], dtype=tl.float32)
    b_qq = tl.zeros([TP], dtype=tl.float32)
    for i_k in range(0, BK // BKC):
        o_k = i_k * BKC + tl.arange(0, BKC)
        m_k = o_k < K
        m_C = m_v[:, None] & m_k[None, :]
        b_C = tl.load(p_C + o_k[None, :], mask=m_C, other=0., eviction_policy="evict_first")
        b_Ka = tl.load(p_Ka + o_k[None, :], mask=m_j[:, None] & m_k[None, :], other=0.).to(tl.float32)
        b_q = _draft_rows(q, i_b, i_hk, o_t, m_t, o_k, m_k, stride_q_b, stride_q_t, stride_q_h)
        b_k = _draft_rows(k, i_b, i_hk, o_t, m_t, o_k, m_k, stride_k_b, stride_k_t, stride_k_h)
        b_kk += tl.sum(b_k * b_k, axis=1)
        b_qq += tl.sum(b_q * b_q, axis=1)
        if IS_KDA:
            b_ldk = _log_decay(_draft_rows(a, i_b, i_hv, o_t, m_t, o_k, m_k, stride_a_b, stride_a_t, stride_a_h)
                               + tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.).to(tl.float32)[None, :],
                               b_A)
            b_ldk = tl.where(m_t[:, None] & m_k[None, :], b_ldk, 0.)                 # [TP, BKC]
            # without a flush, the drafts' decays (V-block 0 of the head): no program reads
            # positions >= h in this launch
            p_ldd = p_ld + ((hc + o_t)[:, None] * (HV * K) + o_k[None, :])
            tl.store(p_ldd, b_ldk, mask=tl.where(keep & (i_v == 0), m_t & (hc + o_t < LBCAP), False)[:, None]
                     & m_k[None, :])
            b_LDs = tl.load(p_ld + ((o_j[:, None] + 1) * (HV * K) + o_k[None, :]),
                            mask=m_j1[:, None] & m_k[None, :], other=0.)
            b_ld0 = tl.load(p_ld + o_k, mask=tl.where(h > 0, m_k, False), other=0.)
            # per channel, as products of factors <= 1: the records' decay to position h - 1,
            # the checkpoint's, the drafts' from h' through draft t
            b_Kaw = b_Ka * tl.exp(tl.cumsum(b_LDs, axis=0, reverse=True))
            b_gc = tl.exp(b_ld0 + tl.sum(b_LDs, axis=0))
            b_ed = tl.exp(b_ldk)
            b_D = tl.cumprod(b_ed, axis=0)
            if flush:
                b_C = dot_f32(b_UaT, b_Kaw, b_C * b_gc[None, :], W_EXACT, False)
                tl.store(p_C + o_k[None, :], b_C, mask=m_C)
            b_gD = tl.where(flush, 1., b_gc)[None, :] * b_D
            b_Pk = dot_f32(b_C, tl.trans(b_k * b_gD), b_Pk, False, False)
            b_Pq = dot_f32(b_C, tl.trans(b_q * b_gD), b_Pq, False, False)
            b_Gk = dot_f32(b_Kaw, tl.trans(b_k * b_D), b_Gk, False, False)
            b_Gq = dot_f32(b_Kaw, tl.trans(b_q * b_D), b_Gq, False, False)
            # the draft-draft products need the decay between two drafts: row r of Gd, Bd,
            # each a cumulative product from draft r + 1 on (1 up to r)
            for r in tl.static_range(T):
                sel = o_t == r
                b_X = tl.cumprod(tl.where((o_t > r)[:, None], b_ed, 1.), axis=0) * _row(b_k, sel)[None, :]
                b_Gd = tl.where(sel[:, None], b_Gd + tl.sum(b_k * b_X, axis=1)[None, :], b_Gd)
                b_Bd = tl.where(sel[:, None], b_Bd + tl.sum(b_q * b_X, axis=1)[None, :], b_Bd)
        else:
            if flush:
                b_C = dot_f32(b_UwT, b_Ka, b_C * b_gf, False, KA_EXACT)
                tl.store(p_C + o_k[None, :], b_C, mask=m_C)
            b_Pk = dot_f32(b_C, tl.trans(b_k), b_Pk, False, KD_EXACT)
            b_Pq = dot_f32(b_C, tl.trans(b_q), b_Pq, False, Q_EXACT)
            b_Gk = dot_f32(b_Ka, tl.trans(b_k), b_Gk, KA_EXACT, KD_EXACT)
            b_Gq = dot_f32(b_Ka, tl.trans(b_q), b_Gq, KA_EXACT, Q_EXACT)
            b_Gd = dot_f32(b_k, tl.trans(b_k), b_Gd, KD_EXACT, KD_EXACT)
            b_Bd = dot_f32(b_k, tl.trans(b_q), b_Bd, KD_EXACT, Q_EXACT)
    if USE_QK_L2NORM:
        b_rk = tl.rsqrt(b_kk + 1e-6)
        b_rq = tl.rsqrt(b_qq + 1e-6) * scale
    else:
        b_rk = tl.full([TP], 1., tl.float32)
        b_rq = tl.zeros([TP], dtype=tl.float32) + scale
    if IS_KDA:
        b_Gk = tl.where(m_a[:, None], b_Gk, 0.)
        b_Gq = tl.where(m_a[:, None], b_Gq, 0.)
    else:
        b_Ld = tl.cumsum(b_ld, axis=0)                    # ld of drafts 0..t
        b_gC = tl.exp(b_Lc + b_Ld)                                                # [TP]
        b_Pk = b_Pk * b_gC[None, :]
        b_Pq = b_Pq * b_gC[None, :]
        b_Wa = tl.where(m_a[:, None], tl.exp(b_La[:, None] + b_Ld[None, :]), 0.)   # [LB, TP]
        b_Gk = b_Gk * b_Wa
        b_Gq = b_Gq * b_Wa
    b_R = b_beta[None, :] * (b_VT - dot_f32(b_UaT, b_Gk * b_rk[None, :], b_Pk * b_rk[None, :], W_EXACT, False))
    b_O = dot_f32(b_UaT, b_Gq * b_rq[None, :], b_Pq * b_rq[None, :], W_EXACT, False)
    b_Gd = b_Gd * (b_rk[:, None] * b_rk[None, :])
    b_Bd = b_Bd * (b_rk[:, None] * b_rq[None, :])

    # forward substitution: after step t column t of R is u_t, and draft t's term has left the
    # later columns of R and entered the outputs of drafts >= t (a loop, not unrolled: unrolled,
    # every step's rows of the Grams are hoisted and held at once)
    for t in range(0, T):
        sel = o_t == t
        b_a = _row(b_Gd, sel)
        b_c = _row(b_Bd, sel)
        if not IS_KDA:
            b_w = tl.exp(tl.cumsum(tl.where(o_t > t, b_ld, 0.), axis=0))   # decay after draft t
            b_a = b_a * b_w
            b_c = b_c * b_w
        b_u = tl.sum(tl.where(sel[None, :], b_R, 0.), axis=1)                      # [BV]
        b_R -= tl.where((o_t > t)[None, :], b_u[:, None] * (b_beta * b_a)[None, :], 0.)
        b_O += tl.where((o_t >= t)[None, :], b_u[:, None] * b_c[None, :], 0.)

    tl.store(p_o, _for_store(tl.where(m_t[None, :], b_O, 0.), p_o, EXACT_BF16), mask=m_o)
    if flush:
        # this program's own records 0..n-1, read by all its threads above, are overwritten below
        tl.debug_barrier()
    # u by their owner, at positions h' + t (< LBCAP guards other slots against a bad cursor)
    o_pt = o_p0 + hc + o_t
    m_pt = m_t & (hc + o_t < LBCAP)
    p_w = buf_w + (o_pt[None, :] * HV + i_hv) * V + o_v[:, None]
    tl.store(p_w, _for_store(b_R, p_w, EXACT_BF16), mask=m_v[:, None] & m_pt[None, :])
    # without a flush, the drafts' decays (GDN) and keys too (V-block 0 of the head, of the
    # key head's first value head): no program reads positions >= h in this launch
    sole = tl.where(keep & (i_v == 0), m_pt, False)
    if not IS_KDA:
        tl.store(buf_ld + o_pt * HV + i_hv, b_ld, mask=sole)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_k = _draft_rows(k, i_b, i_hk, o_t, m_t, o_k, m_k, stride_k_b, stride_k_t, stride_k_h) * b_rk[:, None]
    p_kh = buf_k + (o_pt[:, None] * HK + i_hk) * K + o_k[None, :]
    own_hk = (i_v == 0) & (i_hv % HG == 0)
    tl.store(p_kh, _for_store(b_k, p_kh, EXACT_BF16), mask=tl.where(own_hk, sole, False)[:, None] & m_k[None, :])

    last = verify_hand_off(arrive, cursor, pending, epoch, i_s, hc, n, flush, HV * NV)
    if last & flush:
        _write_shared(k, a, A_log, dt_bias, buf_ld, buf_k, i_b, i_s, n, o_k, m_k,
                      stride_k_b, stride_k_t, stride_k_h, stride_a_b, stride_a_t, stride_a_h,
                      T, HV, HK, K, LBCAP, HVP, HKP, IS_KDA, USE_QK_L2NORM, EXACT_BF16)


# ---------------------------------------------------------------------------------------------
# Launcher, launch configs, custom ops, public function.
# ---------------------------------------------------------------------------------------------

_CONFIG_KEYS = ("BV", "BKC", "num_warps", "num_stages")


def verify_config(family: str, V: int, K: int, T: int, config: Optional[dict] = None, *,
                  batch: Optional[int] = None) -> dict:
    """The launch config of `replay_verify` for value dim `V`, key dim `K`, `T` tokens (with a
    caller's overrides of `BV` value rows per program, `BKC` key columns per product chunk (both
    powers of two >= 16, tl.dot's smallest tile), `num_warps`, `num_stages`).

    Chosen offline from the code compiled for sm_90a (registers, spills; benchmarks/tools/
    regcount.py `gdn-verify` / `kda-verify`), not yet timed on a GPU: BV = 64 with 4 warps makes
    the checkpoint's products wgmma (M = 64) and BKC = 16 is the chunk that compiles without
    spills for GDN and KDA, fp32 or bf16 inputs, T = 2..8."""
    BV = max(MIN_DOT, min(64, triton.next_power_of_2(V)))
    cfg = {"BV": BV, "BKC": 16, "num_warps": 4, "num_stages": 1}
    if config:
        unknown = set(config) - set(_CONFIG_KEYS)
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)}; allowed {list(_CONFIG_KEYS)}")
        cfg.update(config)
    BV, nw, ns = cfg["BV"], cfg["num_warps"], cfg["num_stages"]
    for key in ("BV", "BKC"):
        x = cfg[key]
        if isinstance(x, bool) or not isinstance(x, int) or x < MIN_DOT or x & (x - 1):
            raise ValueError(f"config {key}={x!r} must be a power of two >= {MIN_DOT}")
    if nw not in (1, 2, 4, 8, 16):
        raise ValueError(f"config num_warps={nw!r} must be one of 1, 2, 4, 8, 16")
    if isinstance(ns, bool) or not isinstance(ns, int) or ns < 1:
        raise ValueError(f"config num_stages={ns!r} must be a positive int")
    return cfg


def launch_verify(family: str, q, k, v, a, b, A_log, dt_bias, scale: float, ckpt, buf_ld, buf_w,
                  buf_k, cursor, pending, epoch, arrive, slot_ids, num_drafts, window: int, o,
                  use_qk_l2norm: bool, BV: int, num_warps: int, num_stages: int, BKC: int) -> None:
    """Launch `_replay_verify_kernel`; inputs already validated."""
    Bt, T, Hk, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    Lb = buf_w.shape[1]
    if Bt == 0:
        return
    BV = max(MIN_DOT, min(BV, triton.next_power_of_2(V)))
    NV = triton.cdiv(V, BV)
    BK = max(MIN_DOT, triton.next_power_of_2(K))
    # record rows: the committed records, h <= window (window 1, the eager step: any h < Lb)
    rows = Lb if window <= 1 else min(window, Lb)
    _replay_verify_kernel[(HV * NV, Bt)](
        q, k, v, a, b, A_log, dt_bias, o,
        ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch, arrive, slot_ids,
        num_drafts if num_drafts is not None else slot_ids,
        scale, window,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        T=T, TP=max(MIN_DOT, triton.next_power_of_2(T)), HV=HV, HK=Hk, V=V, K=K, LBCAP=Lb,
        LB=max(MIN_DOT, triton.next_power_of_2(rows)), BV=BV, BK=BK, BKC=min(BKC, BK),
        HVP=triton.next_power_of_2(HV), HKP=triton.next_power_of_2(Hk),
        IS_KDA=family == "kda", USE_QK_L2NORM=bool(use_qk_l2norm),
        HAS_NDRAFT=num_drafts is not None, EXACT_BF16=_interpreting(),
        # bf16 and fp16 records and inputs are TF32-exact: one piece in the products
        W_EXACT=buf_w.dtype != torch.float32, KA_EXACT=buf_k.dtype != torch.float32,
        KD_EXACT=k.dtype != torch.float32, Q_EXACT=q.dtype != torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )


_MUTATED = ("o", "ckpt", "buf_ld", "buf_w", "buf_k", "cursor", "pending", "epoch", "arrive")


def _register_verify_op(family: str):
    """The custom op `replayssm::{family}_replay_verify` (GDN and KDA share the kernel)."""

    @torch.library.custom_op(f"replayssm::{family}_replay_verify", mutates_args=_MUTATED)
    def op(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
           dt_bias: Tensor, scale: float, ckpt: Tensor, buf_ld: Tensor, buf_w: Tensor,
           buf_k: Tensor, cursor: Tensor, pending: Tensor, epoch: Tensor, arrive: Tensor,
           slot_ids: Tensor, num_drafts: Optional[Tensor], window: int, o: Tensor,
           use_qk_l2norm: bool, BV: int, num_warps: int, num_stages: int, BKC: int) -> None:
        launch_verify(family, q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k,
                      cursor, pending, epoch, arrive, slot_ids, num_drafts, window, o,
                      use_qk_l2norm, BV, num_warps, num_stages, BKC)

    @op.register_fake
    def _(q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch,
          arrive, slot_ids, num_drafts, window, o, use_qk_l2norm, BV, num_warps, num_stages, BKC) -> None:
        return None

    return op


_VERIFY_OPS = {family: _register_verify_op(family) for family in ("gdn", "kda")}


def check_verify_inputs(family: str, q, k, v, a, b, A_log, dt_bias, out, num_drafts) -> tuple:
    """Shapes, dtypes and strides of a verify call's inputs; returns `(Bt, T, Hk, K, HV, V)`."""
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a [Bt, T, Hk, K] tensor, got shape {getattr(q, 'shape', None)}")
    Bt, T, Hk, K = q.shape
    if not 1 <= T <= MAX_DRAFT:
        raise ValueError(f"q has T={T} tokens per row, expected 1..{MAX_DRAFT}")
    check_tensor("k", k, (Bt, T, Hk, K))
    if not isinstance(v, Tensor) or v.dim() != 4 or tuple(v.shape[:2]) != (Bt, T):
        raise ValueError(f"v must be a [Bt={Bt}, T={T}, HV, V] tensor, got shape {getattr(v, 'shape', None)}")
    HV, V = v.shape[2], v.shape[3]
    if Hk < 1 or HV % Hk:
        raise ValueError(f"value heads HV={HV} must be a multiple of key heads Hk={Hk}")
    if family == "kda":
        check_tensor("a", a, (Bt, T, HV, K))
        check_tensor("dt_bias", dt_bias, (HV, K))
    else:
        check_tensor("a", a, (Bt, T, HV))
        check_tensor("dt_bias", dt_bias, (HV,))
    check_tensor("b", b, (Bt, T, HV))
    check_tensor("A_log", A_log, (HV,))
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("A_log", A_log),
                    ("dt_bias", dt_bias)):
        check_tensor(name, t, dtypes=_FLOATS)
    for name, t in (("q", q), ("k", k), ("v", v)) + ((("a", a),) if family == "kda" else ()):
        check_tensor(name, t, inner=True)
    check_tensor("A_log", A_log, contiguous=True)
    check_tensor("dt_bias", dt_bias, contiguous=True)
    if out is not None:
        check_tensor("out", out, (Bt, T, HV, V), _FLOATS, contiguous=True)
    if num_drafts is not None:
        check_tensor("num_drafts", num_drafts, (Bt,), (torch.int32,), contiguous=True)
    return Bt, T, Hk, K, HV, V


def _check_draft_counts(num_drafts, T: int) -> None:
    """`1 <= num_drafts[b] <= T` (a host sync: skipped where `may_sync` says no)."""
    if num_drafts is None or not may_sync() or num_drafts.numel() == 0:
        return
    n = num_drafts.detach().cpu()
    bad = (n < 1) | (n > T)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"num_drafts[{i}]={int(n[i])} is outside 1..T={T}")


def run_verify(family, q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k, cursor,
               pending, epoch, slot_ids, window, num_drafts=None, out=None, use_qk_l2norm=True,
               config=None, arrive=None, validate=True) -> Tensor:
    """Validate, resolve the config and launch the family's verify op (GDN and KDA wrappers)."""
    if validate:
        Bt, T, Hk, K, HV, V = check_verify_inputs(family, q, k, v, a, b, A_log, dt_bias, out, num_drafts)
        if arrive is None:
            arrive = arrive_counter(ckpt.device, ckpt.shape[0]) if isinstance(ckpt, Tensor) \
                and ckpt.dim() == 4 else None
        N, Lb = check_state(family, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive,
                            HV, Hk, V, K, window)
        check_tensor("pending", pending, (N,), (torch.int32,), contiguous=True)
        if Lb < window + T:
            raise ValueError(f"buffer capacity Lb={Lb} must be at least window + T = {window} + {T}")
        check_slot_ids(slot_ids, Bt)
        check_devices(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ckpt=ckpt,
                      buf_ld=buf_ld, buf_w=buf_w, buf_k=buf_k, cursor=cursor, pending=pending,
                      epoch=epoch, arrive=arrive, slot_ids=slot_ids, num_drafts=num_drafts, out=out)
        check_slot_values(slot_ids, N)
        check_cursor_values(cursor, slot_ids, Lb, window)
        _check_draft_counts(num_drafts, T)
    elif arrive is None:
        arrive = arrive_counter(ckpt.device, ckpt.shape[0])
    K, V, T = q.shape[-1], v.shape[-1], q.shape[1]
    cfg = verify_config(family, V, K, T, config, batch=q.shape[0])
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    _VERIFY_OPS[family](
        q, k, v, a, b, A_log, dt_bias, _scale(scale, K), ckpt, buf_ld, buf_w, buf_k, cursor,
        pending, epoch, arrive, slot_ids, num_drafts, int(window), out, bool(use_qk_l2norm),
        cfg["BV"], cfg["num_warps"], cfg["num_stages"], cfg["BKC"])
    return out


def replay_verify(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                  dt_bias: Tensor, scale: Optional[float], ckpt: Tensor, buf_ld: Tensor,
                  buf_w: Tensor, buf_k: Tensor, cursor: Tensor, pending: Tensor, epoch: Tensor,
                  slot_ids: Tensor, window: int, num_drafts: Optional[Tensor] = None,
                  out: Optional[Tensor] = None, use_qk_l2norm: bool = True,
                  config: Optional[dict] = None, *, arrive: Optional[Tensor] = None,
                  validate: bool = True) -> Tensor:
    """Output-only verification of `T` tokens per row of a GDN layer, in one launch
    (docs/state-layout.md, `verify`; SPEC section 4).

    Args:
        q, k: `[Bt, T, Hk, K]` raw queries and keys (L2-normalised in the kernel when
            `use_qk_l2norm`; `q` then scaled by `scale`, None: `K ** -0.5`), `1 <= T <= 8`.
        v: `[Bt, T, HV, V]`. a: `[Bt, T, HV]` raw decay input; b: `[Bt, T, HV]` raw beta input.
            Inner-contiguous; any batch and draft strides.
        A_log, dt_bias: `[HV]`; `log a = -exp(A_log) * softplus(a + dt_bias)`, `beta = sigmoid(b)`.
        ckpt: `[N, HV, V, K]` fp32; buf_ld: `[N, Lb, HV]` fp32; buf_w: `[N, Lb, HV, V]` (`u`);
            buf_k: `[N, Lb, Hk, K]` (fp32, bf16 or fp16 records); cursor, pending: `[N]` int32;
            epoch: `[N]` int64; `Lb >= window + T`. Updated in place.
        slot_ids: `[Bt]` int; negative ids are padding rows (zero output, no state touched).
        window: `L`; a row with cursor `h` (`0 <= h <= L`) and `n` drafts flushes first when
            `h + n > L` (records `0..h-1` folded into `ckpt`, `epoch += 1`, drafts from 0).
        num_drafts: `[Bt]` int32, `1 <= n_b <= T` drafts per row (None: T). Drafts `t >= n_b`
            are not written and their outputs are zero.
        out: optional `[Bt, T, HV, V]` contiguous output (default: new tensor of `v`'s dtype).
        config: overrides of `BV`, `num_warps`, `num_stages` (see `verify_config`).
        arrive: `[N]` int32 zeroed counters (default: a cached buffer, see `arrive_counter`).
        validate: check shapes, dtypes, devices, slot ids, cursors and draft counts (the last
            three read device values back, skipped during CUDA-graph capture). False: no check.

    Returns:
        `out`: `[Bt, T, HV, V]`, `out[b, t] = S_{h'+t} q_t` (the conventional recurrence from
        the committed state through drafts `0..t`). Afterwards `cursor = h'`, `pending = n`.
    """
    return run_verify("gdn", q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k,
                      cursor, pending, epoch, slot_ids, window, num_drafts, out, use_qk_l2norm,
                      config, arrive, validate)
