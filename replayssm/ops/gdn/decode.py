"""ReplaySSM standard decode for Gated DeltaNet (and, through `IS_KDA`, Kimi Delta Attention).

One launch per decode step. Each program owns one `(row, value head, V-block)` tile of the
checkpoint `C` (`[BV, K]`) and does, for its row's slot `s` with cursor `h` (docs/state-layout.md,
SPEC section 3; 0-based positions, the current token at position `h`, `ld_i` the log decay at
position `i`, `G(i) = exp(ld_i + ... + ld_h)`):

    P   = a_t S_{t-1} = G(0) C + sum_{j<h} G(j+1) u_j k_j^T      (never materialised)
    u_t = beta (v - P k_t)                                        (output-only matvec 1)
    o   = P q + (k_t^T q) u_t                                     (output-only matvec 2)
    record (ld_t, u_t, k_t) -> position h
    flush (h + 1 >= window): C <- P + u_t k_t^T ; cursor <- 0 ; epoch += 1
    else:                    cursor <- h + 1

The two matvecs share one read of the `C` tile; the current token's record comes from registers.
The delta-rule `u` of a value row depends only on that row of `S`, so the V-blocks of a head are
independent programs.

KDA is the same with a channel-wise decay: `G(i)` is a `[K]` vector that scales the key columns
(`C Diag(G(0))`, `G(j+1) * k_j`), so the decays fold into weighted keys and one kernel serves
both families.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from ..utils.launch import arrive_counter, capturing, table_entry
from ..utils.cursor import hand_off
from ..utils.tiles import check_slices, tile_dot, tile_offsets
from .gluon_decode import gluon_supported, launch_gluon
from torch import Tensor

__all__ = ["replay_decode", "replay_config", "eager_max_batch"]

# ---------------------------------------------------------------------------------------------
# Triton helpers shared by the replay and conventional kernels of both families.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rne_bf16(x):
    # fp32 -> bf16 round-to-nearest-even with integer ops; the CPU interpreter's .to(bf16)
    # truncates, so interpreter runs use this to measure what the GPU's cvt.rn does.
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _for_store(x, p, EXACT_BF16: tl.constexpr):
    """`x` (fp32) converted to the element type of pointer `p`; EXACT_BF16 (the interpreter):
    bf16 by round-to-nearest-even as on the GPU."""
    y = x.to(p.dtype.element_ty)
    if EXACT_BF16:
        if p.dtype.element_ty == tl.bfloat16:
            y = _rne_bf16(x)
    return y


@triton.jit
def _load_qk(q, k, i_b, i_hk, o_k, m_k, scale, stride_q_b, stride_q_h, stride_k_b, stride_k_h,
             USE_QK_L2NORM: tl.constexpr):
    """The current token's key (L2-normalised) and query (normalised, scaled) of one key head,
    `[BK]` fp32."""
    b_q = tl.load(q + i_b * stride_q_b + i_hk * stride_q_h + o_k, mask=m_k, other=0.).to(tl.float32)
    b_k = tl.load(k + i_b * stride_k_b + i_hk * stride_k_h + o_k, mask=m_k, other=0.).to(tl.float32)
    if USE_QK_L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    return b_q * scale, b_k


@triton.jit
def _load_head(v, a, b, A_log, dt_bias, i_b, i_hv, o_v, m_v, o_k, m_k,
               stride_v_b, stride_v_h, stride_a_b, stride_a_h, stride_b_b, stride_b_h,
               K: tl.constexpr, IS_KDA: tl.constexpr):
    """The current token of one value head: value block `[BV]`, log decay (scalar, or `[BK]`
    for KDA, zero on padded channels) and beta, fp32."""
    b_v = tl.load(v + i_b * stride_v_b + i_hv * stride_v_h + o_v, mask=m_v, other=0.).to(tl.float32)
    b_beta = tl.sigmoid(tl.load(b + i_b * stride_b_b + i_hv * stride_b_h).to(tl.float32))
    b_A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    if IS_KDA:
        b_a = tl.load(a + i_b * stride_a_b + i_hv * stride_a_h + o_k, mask=m_k, other=0.).to(tl.float32)
        b_dt = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_x = b_a + b_dt
    else:
        b_a = tl.load(a + i_b * stride_a_b + i_hv * stride_a_h).to(tl.float32)
        b_x = b_a + tl.load(dt_bias + i_hv).to(tl.float32)
    # softplus(x) = max(x, 0) + log1p(exp(-|x|)), log1p written out (Goldberg) because the
    # gate inputs of long-memory heads are very negative: log(1 + tiny) would lose most digits
    b_e = tl.exp(-tl.abs(b_x))
    b_1e = 1.0 + b_e
    b_d = b_1e - 1.0
    b_l1p = tl.where(b_d == 0.0, b_e, tl.log(b_1e) * (b_e / tl.where(b_d == 0.0, 1.0, b_d)))
    b_ld = -b_A * (tl.maximum(b_x, 0.0) + b_l1p)
    if IS_KDA:
        b_ld = tl.where(m_k, b_ld, 0.)
    return b_v, b_ld, b_beta


@triton.jit
def _load_token(q, k, v, a, b, A_log, dt_bias, i_b, i_hv, i_hk, o_v, m_v, o_k, m_k, scale,
                stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
                stride_a_b, stride_a_h, stride_b_b, stride_b_h,
                K: tl.constexpr, IS_KDA: tl.constexpr, USE_QK_L2NORM: tl.constexpr):
    """`_load_qk` and `_load_head` of one (row, value head): q, k, v, log decay, beta."""
    b_q, b_k = _load_qk(q, k, i_b, i_hk, o_k, m_k, scale, stride_q_b, stride_q_h, stride_k_b,
                        stride_k_h, USE_QK_L2NORM)
    b_v, b_ld, b_beta = _load_head(v, a, b, A_log, dt_bias, i_b, i_hv, o_v, m_v, o_k, m_k,
                                   stride_v_b, stride_v_h, stride_a_b, stride_a_h, stride_b_b,
                                   stride_b_h, K, IS_KDA)
    return b_q, b_k, b_v, b_ld, b_beta


# ---------------------------------------------------------------------------------------------
# The replay decode kernel.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _flush_fma(p_Ch, buf_ld, buf_w, buf_k, i_s, i_hv, i_hk, i_v, h, b_k, b_ld, o_k, m_k,
               HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
               LBCAP: tl.constexpr, BV: tl.constexpr, IS_KDA: tl.constexpr, RC: tl.constexpr):
    """C <- gC C + sum_j w_j u_j k_j^T + u_t k_t^T for head `p_Ch`'s V-block, in row chunks of
    RC: the tile and the records are re-read (L1/L2 hits: this program just read or wrote
    them), so that the registers of this rare path, which every program is allocated, stay
    those of an [RC, BK] tile. One rank-1 update per record (exact fp32), newest first so that
    the suffix log decay accumulates along the loop."""
    o_h = i_s * LBCAP + h
    for r0 in tl.static_range(0, BV, RC):
        o_r = i_v * BV + r0 + tl.arange(0, RC)
        m_r = o_r < V
        o_Sr = o_r[:, None] * K + o_k[None, :]
        m_Sr = m_r[:, None] & m_k[None, :]
        b_ut = tl.load(buf_w + (o_h * HV + i_hv) * V + o_r, mask=m_r, other=0.).to(tl.float32)
        b_S = b_ut[:, None] * b_k[None, :]                          # [RC, BK]
        b_sr = b_ld
        for i_r in range(0, h):
            o_p = i_s * LBCAP + h - 1 - i_r
            b_kr = tl.load(buf_k + (o_p * HK + i_hk) * K + o_k, mask=m_k, other=0.).to(tl.float32)
            b_ur = tl.load(buf_w + (o_p * HV + i_hv) * V + o_r, mask=m_r, other=0.).to(tl.float32)
            if IS_KDA:
                b_S += b_ur[:, None] * (tl.exp(b_sr) * b_kr)[None, :]
                b_sr += tl.load(buf_ld + (o_p * HV + i_hv) * K + o_k, mask=m_k, other=0.)
            else:
                b_S += (tl.exp(b_sr) * b_ur)[:, None] * b_kr[None, :]
                b_sr += tl.load(buf_ld + o_p * HV + i_hv)
        b_Cr = tl.load(p_Ch + o_Sr, mask=m_Sr, other=0.)
        if IS_KDA:
            b_S += b_Cr * tl.exp(b_sr)[None, :]
        else:
            b_S += b_Cr * tl.exp(b_sr)
        tl.store(p_Ch + o_Sr, b_S, mask=m_Sr)


@triton.jit
def _flush_dot(p_Ch, buf_ld, buf_w, buf_k, i_s, i_hv, i_hk, i_v, h, b_k, b_ld, b_gC, o_k, m_k,
               HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
               LBCAP: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, IS_KDA: tl.constexpr,
               RC: tl.constexpr, LF: tl.constexpr):
    """The same fold as one product per row chunk of RC on tensor cores, `[RC, LF] x [LF, BK]`
    in three tf32 passes (near fp32): positions 0..h of the window, the current token's key
    and decay from registers (other programs write them to the buffer), its u (stored by this
    program before the barrier) from the buffer. No loop of dependent loads."""
    o_f = tl.arange(0, LF)
    m_f = o_f <= h
    m_f1 = (o_f + 1) < h
    o_pf = i_s * LBCAP + o_f
    b_Kf = tl.load(buf_k + (o_pf * HK + i_hk)[:, None] * K + o_k[None, :],
                   mask=(o_f < h)[:, None] & m_k[None, :], other=0.).to(tl.float32)
    b_Kf = tl.where((o_f < h)[:, None], b_Kf, tl.where((o_f == h)[:, None], b_k[None, :], 0.))
    # lane j: ld_{j+1} (ld_h from registers), so that the reverse scan at j is the suffix
    # ld_{j+1} + ... + ld_h, zero at j = h (the current token enters with weight 1)
    if IS_KDA:
        b_LDf = tl.load(buf_ld + ((o_pf + 1) * HV + i_hv)[:, None] * K + o_k[None, :],
                        mask=m_f1[:, None] & m_k[None, :], other=0.)
        b_LDf = tl.where(m_f1[:, None], b_LDf, tl.where((o_f + 1 == h)[:, None], b_ld[None, :], 0.))
        b_Kf = b_Kf * tl.where(m_f[:, None], tl.exp(tl.cumsum(b_LDf, axis=0, reverse=True)), 0.)
    else:
        b_LDf = tl.load(buf_ld + (o_pf + 1) * HV + i_hv, mask=m_f1, other=0.)
        b_LDf = tl.where(m_f1, b_LDf, tl.where(o_f + 1 == h, b_ld, 0.))
        b_wf = tl.where(m_f, tl.exp(tl.cumsum(b_LDf, axis=0, reverse=True)), 0.)      # [LF]
    for r0 in tl.static_range(0, BV, RC):
        o_r = i_v * BV + r0 + tl.arange(0, RC)
        m_r = o_r < V
        b_Uf = tl.load(buf_w + (o_pf[:, None] * HV + i_hv) * V + o_r[None, :],
                       mask=m_f[:, None] & m_r[None, :], other=0.).to(tl.float32)
        b_Uf = tl.where(m_f[:, None], b_Uf, 0.)                                        # [LF, RC]
        if not IS_KDA:
            b_Uf = b_Uf * b_wf[:, None]
        o_Sr = o_r[:, None] * K + o_k[None, :]
        m_Sr = m_r[:, None] & m_k[None, :]
        b_Cr = tl.load(p_Ch + o_Sr, mask=m_Sr, other=0.)
        if IS_KDA:
            b_Cr = b_Cr * b_gC[None, :]
        else:
            b_Cr = b_Cr * b_gC
        b_Cr += tl.dot(tl.trans(b_Uf), b_Kf, input_precision="tf32x3")
        tl.store(p_Ch + o_Sr, b_Cr, mask=m_Sr)


@triton.jit
def _mat_tile(c, p_C, p_K, p_k, o_v, m_v, m_j, r_k, b_gC, b_A, b_A1, b_A2, K: tl.constexpr,
              BKT: tl.constexpr, MP: tl.constexpr, EXACT_BF16: tl.constexpr, EVICT: tl.constexpr):
    """Key chunk c of the materialising kernel: `P_c = gC C_c + A K_c` (`[BV, BKT]`) and the
    token's normalised key chunk `k_c`."""
    o_kt = c * BKT + tl.arange(0, BKT)
    m_kt = o_kt < K
    b_kc = tl.load(p_k + o_kt, mask=m_kt, other=0.).to(tl.float32) * r_k
    b_C = tl.load(p_C + o_v[:, None] * K + o_kt[None, :], mask=m_v[:, None] & m_kt[None, :],
                  other=0., eviction_policy=EVICT)
    b_Kc = tl.load(p_K[:, None] + o_kt[None, :], mask=m_j[:, None] & m_kt[None, :], other=0.)
    # (the select in fp32 and back: exact, and the CPU interpreter mishandles bf16 selects)
    b_Kc = tl.where(m_j[:, None], b_Kc.to(tl.float32), 0.).to(b_Kc.dtype)               # [LR, BKT]
    return b_gC * b_C + _mat_fold(b_A, b_A1, b_A2, b_Kc, MP, EXACT_BF16), b_kc


@triton.jit
def _replay_decode_kernel(
    q, k, v, a, b, A_log, dt_bias, o,
    ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids,
    scale, window,
    stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
    stride_a_b, stride_a_h, stride_b_b, stride_b_h,
    HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
    LBCAP: tl.constexpr, LB: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    HPP: tl.constexpr, IS_KDA: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
    RECMASK: tl.constexpr, PREFETCH: tl.constexpr, EXACT_BF16: tl.constexpr, RC: tl.constexpr,
    BC: tl.constexpr, CHUNK: tl.constexpr, KS: tl.constexpr, FLUSH: tl.constexpr, LF: tl.constexpr,
):
    NV: tl.constexpr = (V + BV - 1) // BV
    G: tl.constexpr = HV // HK
    # grid (HV // HPP * NV, Bt), V-block fastest: a program owns V-block i_v of HPP value heads
    # of one key head, whose records' keys it reads once (and, for GDN, whose products with
    # the token's key and query it forms once).
    pid = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    i_v = pid % NV
    h0 = (pid // NV) * HPP
    i_hk = h0 // G

    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    p_o = o + (i_b * HV + h0) * V + o_v

    i_s = tl.load(slot_ids + i_b).to(tl.int64)
    if i_s < 0:
        for i in range(HPP):
            tl.store(p_o + i * V, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty), mask=m_v)
        return
    h = tl.load(cursor + i_s).to(tl.int64)

    # Positions j < h hold records; lane j of the shifted decays holds position j + 1 (the
    # current token is position h). RECMASK predicates the record loads on the cursor (no
    # traffic for empty positions); otherwise only on the window, so that they are issued
    # without waiting for the cursor. Either way positions at or past the cursor are removed by
    # selects after the load: stale or poisoned records never enter the arithmetic.
    o_j = tl.arange(0, LB)
    m_j = o_j < h
    m_j1 = (o_j + 1) < h
    if RECMASK:
        m_lj = m_j
        m_lj1 = m_j1
    else:
        n_pos = tl.minimum(window, LBCAP)
        m_lj = o_j < n_pos
        m_lj1 = (o_j + 1) < n_pos
    o_rec = i_s * LBCAP + o_j                                               # [LB] flat position

    # tile offsets in int32 added to a scalar 64-bit base per head: a tile of 64-bit addresses
    # would hold twice the registers for the whole head loop
    p_C = ckpt + i_s * (HV * V * K)
    o_C, m_C = tile_offsets(o_v, m_v, K, BK, KS)
    if PREFETCH:
        b_Cn = tl.load(p_C + h0 * (V * K) + o_C, mask=m_C, other=0., eviction_policy="evict_first")

    if not CHUNK:
        b_Kb = tl.load(buf_k + (o_rec * HK + i_hk)[:, None] * K + o_k[None, :],
                       mask=m_lj[:, None] & m_k[None, :], other=0.)
        b_Kb = tl.where(m_j[:, None], b_Kb.to(tl.float32), 0.)              # [LB, BK]

    b_q, b_k = _load_qk(q, k, i_b, i_hk, o_k, m_k, scale, stride_q_b, stride_q_h, stride_k_b,
                        stride_k_h, USE_QK_L2NORM)
    b_kq_t = tl.sum(b_k * b_q)
    if not IS_KDA:
        if not CHUNK:
            b_Kk0 = tl.sum(b_Kb * b_k[None, :], axis=1)                      # [LB]
            b_Kq0 = tl.sum(b_Kb * b_q[None, :], axis=1)
    flush = h + 1 >= window
    in_buf = h < LBCAP
    n_v = tl.where(in_buf, V, 0)
    n_k = tl.where(in_buf, K, 0)
    o_h = i_s * LBCAP + h

    for i in range(HPP):
        i_hv = h0 + i
        if PREFETCH:
            b_C = b_Cn
            b_Cn = tl.load(p_C + (i_hv + 1) * (V * K) + o_C, mask=m_C & (i + 1 < HPP), other=0.,
                           eviction_policy="evict_first")
        else:
            b_C = tl.load(p_C + i_hv * (V * K) + o_C, mask=m_C, other=0., eviction_policy="evict_first")
        p_U = buf_w + (i_s * LBCAP * HV + i_hv) * V
        if not CHUNK:
            b_U = tl.load(p_U + (o_j[:, None] * (HV * V) + o_v[None, :]),
                          mask=m_lj[:, None] & m_v[None, :], other=0.)
            b_U = tl.where(m_j[:, None], b_U.to(tl.float32), 0.)            # [LB, BV]

        b_v, b_ld, b_beta = _load_head(v, a, b, A_log, dt_bias, i_b, i_hv, o_v, m_v, o_k, m_k,
                                       stride_v_b, stride_v_h, stride_a_b, stride_a_h,
                                       stride_b_b, stride_b_h, K, IS_KDA)

        # Weights: record j (< h) enters a_t S_{t-1} with exp(ld_{j+1} + ... + ld_h), C with
        # exp(ld_0 + ... + ld_h). The suffix sums come from a reverse scan of the decays shifted
        # by one position, not as total minus prefix, so that a weight near 1 keeps full
        # relative precision even when the window's total log decay is large.
        if IS_KDA:
            b_LDs = tl.load(buf_ld + ((o_rec + 1) * HV + i_hv)[:, None] * K + o_k[None, :],
                            mask=m_lj1[:, None] & m_k[None, :], other=0.)
            b_LDs = tl.where(m_j1[:, None], b_LDs, 0.)
            b_LDs = tl.where((o_j + 1 == h)[:, None], b_ld[None, :], b_LDs)   # [LB, BK]
            b_ld0 = tl.load(buf_ld + (i_s * LBCAP * HV + i_hv) * K + o_k, mask=m_k, other=0.)
            b_ld0 = tl.where(h == 0, b_ld, b_ld0)
            b_suf = tl.cumsum(b_LDs, axis=0, reverse=True)                  # [LB, BK]
            b_gC = tl.exp(b_ld0 + tl.sum(b_LDs, axis=0))                    # [BK]
            b_Kw = b_Kb * tl.exp(b_suf)                                     # [LB, BK]
            b_kk = tl.sum(b_Kw * b_k[None, :], axis=1)                      # [LB]
            b_kq = tl.sum(b_Kw * b_q[None, :], axis=1)
        else:
            b_LDs = tl.load(buf_ld + (o_rec + 1) * HV + i_hv, mask=m_lj1, other=0.)
            b_LDs = tl.where(m_j1, b_LDs, tl.where(o_j + 1 == h, b_ld, 0.))  # [LB]
            b_ld0 = tl.load(buf_ld + i_s * LBCAP * HV + i_hv)
            b_ld0 = tl.where(h == 0, b_ld, b_ld0)
            b_gC = tl.exp(b_ld0 + tl.sum(b_LDs, axis=0))
            if not CHUNK:
                b_w = tl.where(m_j, tl.exp(tl.cumsum(b_LDs, axis=0, reverse=True)), 0.)   # [LB]
                b_kk = b_Kk0 * b_w
                b_kq = b_Kq0 * b_w

        # one read of C, two matvecs
        b_Ck = tile_dot(b_C, b_gC * b_k, BK, KS)                             # [BV]
        b_Cq = tile_dot(b_C, b_gC * b_q, BK, KS)
        if CHUNK:
            # GDN, records in chunks of BC up to the cursor only (the work follows h, not the
            # window): a chunk's weights are its own reverse scan plus the decays after it
            b_Pk = b_Ck
            b_or = b_Cq
            for j0 in range(0, h, BC):
                o_c = j0 + tl.arange(0, BC)
                m_c = o_c < h
                o_pc = i_s * LBCAP + o_c
                b_Kc = tl.load(buf_k + (o_pc * HK + i_hk)[:, None] * K + o_k[None, :],
                               mask=m_c[:, None] & m_k[None, :], other=0.)
                b_Kc = tl.where(m_c[:, None], b_Kc.to(tl.float32), 0.)      # [BC, BK]
                b_Uc = tl.load(p_U + (o_c[:, None] * (HV * V) + o_v[None, :]),
                               mask=m_c[:, None] & m_v[None, :], other=0.)
                b_Uc = tl.where(m_c[:, None], b_Uc.to(tl.float32), 0.)      # [BC, BV]
                m_c1 = (o_c + 1) < h
                b_LDc = tl.load(buf_ld + (o_pc + 1) * HV + i_hv, mask=m_c1, other=0.)
                b_LDc = tl.where(m_c1, b_LDc, tl.where(o_c + 1 == h, b_ld, 0.))
                b_tail = tl.sum(tl.where(o_j >= j0 + BC, b_LDs, 0.), axis=0)
                b_wc = tl.where(m_c, tl.exp(tl.cumsum(b_LDc, axis=0, reverse=True) + b_tail), 0.)
                b_kkc = tl.sum(b_Kc * b_k[None, :], axis=1) * b_wc
                b_kqc = tl.sum(b_Kc * b_q[None, :], axis=1) * b_wc
                b_Pk += tl.sum(b_Uc * b_kkc[:, None], axis=0)
                b_or += tl.sum(b_Uc * b_kqc[:, None], axis=0)
        else:
            b_Pk = b_Ck + tl.sum(b_U * b_kk[:, None], axis=0)
            b_or = b_Cq + tl.sum(b_U * b_kq[:, None], axis=0)
        b_u = b_beta * (b_v - b_Pk)
        b_o = b_or + b_kq_t * b_u
        tl.store(p_o + i * V, _for_store(b_o, p_o, EXACT_BF16), mask=m_v)

        # the record at position h: u per value head and V-block, the decay once per value
        # head, the key once per key head. h < LBCAP guards other slots against a bad cursor.
        # Written on a flush too (dead then, the cursor returns to 0): the fold below reads
        # this token's u back by row chunks.
        p_w = buf_w + (o_h * HV + i_hv) * V + o_v
        tl.store(p_w, _for_store(b_u, p_w, EXACT_BF16), mask=o_v < n_v)
        if i_v == 0:
            if IS_KDA:
                tl.store(buf_ld + (o_h * HV + i_hv) * K + o_k, b_ld, mask=o_k < n_k)
            else:
                tl.store(buf_ld + o_h * HV + i_hv, b_ld, mask=in_buf)
            if i_hv % G == 0:
                p_kh = buf_k + (o_h * HK + i_hk) * K + o_k
                tl.store(p_kh, _for_store(b_k, p_kh, EXACT_BF16), mask=o_k < n_k)

        if flush:
            tl.debug_barrier()          # this token's u, stored above, visible to all threads
            if FLUSH == 1:
                _flush_dot(p_C + i_hv * (V * K), buf_ld, buf_w, buf_k, i_s, i_hv, i_hk, i_v, h,
                           b_k, b_ld, b_gC, o_k, m_k, HV, HK, V, K, LBCAP, BV, BK, IS_KDA, RC, LF)
            else:
                _flush_fma(p_C + i_hv * (V * K), buf_ld, buf_w, buf_k, i_s, i_hv, i_hk, i_v, h,
                           b_k, b_ld, o_k, m_k, HV, HK, V, K, LBCAP, BV, IS_KDA, RC)

    hand_off(arrive, cursor, epoch, i_s, h, flush, HV // HPP * NV)


@triton.jit
def _mat_fold(b_A, b_A1, b_A2, b_Kc, MP: tl.constexpr, EXACT_BF16: tl.constexpr):
    """`A K` for the materialising kernel: MP 0, fp32 operands in three tf32 passes (K in the
    records' dtype); MP 1, bf16 keys (exact) times A split in two bf16 terms (A1 + A2); MP 2,
    the first term only. The CPU interpreter (EXACT_BF16) gets the same products as fp32 dots
    of the bf16 values: its bf16 tl.dot is broken, and bf16 x bf16 products are exact in fp32."""
    if MP == 2:
        if EXACT_BF16:
            return tl.dot(b_A1.to(tl.float32), b_Kc.to(tl.float32), input_precision="ieee")
        return tl.dot(b_A1, b_Kc, out_dtype=tl.float32)
    elif MP == 1:
        if EXACT_BF16:
            b_K32 = b_Kc.to(tl.float32)
            return (tl.dot(b_A1.to(tl.float32), b_K32, input_precision="ieee")
                    + tl.dot(b_A2.to(tl.float32), b_K32, input_precision="ieee"))
        return tl.dot(b_A1, b_Kc, out_dtype=tl.float32) + tl.dot(b_A2, b_Kc, out_dtype=tl.float32)
    else:
        return tl.dot(b_A, b_Kc.to(tl.float32), input_precision="tf32x3")


@triton.jit
def _replay_decode_mat_kernel(
    q, k, v, a, b, A_log, dt_bias, o,
    ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids,
    scale, window,
    stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
    stride_a_b, stride_a_h, stride_b_b, stride_b_h,
    HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
    LBCAP: tl.constexpr, LR: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, BKT: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, EXACT_BF16: tl.constexpr, MP: tl.constexpr,
):
    """GDN replay step that rebuilds the state tile instead of contracting records with k and q.

    Per program `(row, value head, V-block)` and per chunk of BKT key columns:
        P_c = gC C_c + (U^T Diag(w)) K_c        ([BV, LR] x [LR, BKT] on tensor cores, `_mat_fold`)
    then `P k` and `P q` from the chunk. `P = a_t S_{t-1}`, so a flush stores `P_c + u k_c^T`
    (the chunk rebuilt once more from L2). No per-record products with k and q, no
    reductions across warps over records: the record work is one small matrix product.
    """
    NV: tl.constexpr = (V + BV - 1) // BV
    G: tl.constexpr = HV // HK
    NKT: tl.constexpr = BK // BKT
    pid = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    i_v = pid % NV
    i_hv = pid // NV
    i_hk = i_hv // G

    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_o = o + (i_b * HV + i_hv) * V + o_v
    i_s = tl.load(slot_ids + i_b).to(tl.int64)
    if i_s < 0:
        tl.store(p_o, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty), mask=m_v)
        return
    h = tl.load(cursor + i_s).to(tl.int64)

    # record positions j < h; lane j of the shifted decays holds ld_{j+1} (ld_h: this token)
    o_j = tl.arange(0, LR)
    m_j = o_j < h
    m_j1 = (o_j + 1) < h
    o_rec = i_s * LBCAP + o_j
    b_v, b_ld, b_beta = _load_head(v, a, b, A_log, dt_bias, i_b, i_hv, o_v, m_v, o_v, m_v,
                                   stride_v_b, stride_v_h, stride_a_b, stride_a_h, stride_b_b,
                                   stride_b_h, K, False)
    b_LDs = tl.load(buf_ld + (o_rec + 1) * HV + i_hv, mask=m_j1, other=0.)
    b_LDs = tl.where(m_j1, b_LDs, tl.where(o_j + 1 == h, b_ld, 0.))
    b_ld0 = tl.load(buf_ld + i_s * LBCAP * HV + i_hv)
    b_ld0 = tl.where(h == 0, b_ld, b_ld0)
    b_gC = tl.exp(b_ld0 + tl.sum(b_LDs, axis=0))
    b_w = tl.where(m_j, tl.exp(tl.cumsum(b_LDs, axis=0, reverse=True)), 0.)          # [LR]
    b_U = tl.load(buf_w + (o_rec[None, :] * HV + i_hv) * V + o_v[:, None],
                  mask=m_j[None, :] & m_v[:, None], other=0.).to(tl.float32)
    b_A = tl.where(m_j[None, :], b_U * b_w[None, :], 0.)                               # [BV, LR]
    b_A1 = b_A
    b_A2 = b_A
    if MP >= 1:
        # bf16 records: the keys are exact in bf16, the weighted u split into two bf16 terms
        if EXACT_BF16:
            b_A1 = _rne_bf16(b_A)
            b_A2 = _rne_bf16(b_A - b_A1.to(tl.float32))
        else:
            b_A1 = b_A.to(tl.bfloat16)
            b_A2 = (b_A - b_A1.to(tl.float32)).to(tl.bfloat16)

    # the token's key and query: norms from the whole vectors, then chunks re-read (L1 hits)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_q, b_k = _load_qk(q, k, i_b, i_hk, o_k, m_k, 1.0, stride_q_b, stride_q_h, stride_k_b,
                        stride_k_h, False)
    if USE_QK_L2NORM:
        r_q = scale * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
        r_k = tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    else:
        r_q = scale
        r_k = 1.0
    b_kq_t = tl.sum(b_k * b_q) * r_q * r_k

    p_C = ckpt + (i_s * HV + i_hv) * (V * K)
    p_K = buf_k + (o_rec * HK + i_hk) * K
    p_q = q + i_b * stride_q_b + i_hk * stride_q_h
    p_k = k + i_b * stride_k_b + i_hk * stride_k_h
    b_Pk = tl.zeros([BV], dtype=tl.float32)
    b_Pq = tl.zeros([BV], dtype=tl.float32)
    for c in tl.static_range(NKT):
        o_kt = c * BKT + tl.arange(0, BKT)
        b_qc = tl.load(p_q + o_kt, mask=o_kt < K, other=0.).to(tl.float32) * r_q
        b_P, b_kc = _mat_tile(c, p_C, p_K, p_k, o_v, m_v, m_j, r_k, b_gC, b_A, b_A1, b_A2, K, BKT,
                              MP, EXACT_BF16, "evict_first")                             # [BV, BKT]
        b_Pk += tl.sum(b_P * b_kc[None, :], axis=1)
        b_Pq += tl.sum(b_P * b_qc[None, :], axis=1)
    b_u = b_beta * (b_v - b_Pk)
    b_o = b_Pq + b_kq_t * b_u
    tl.store(p_o, _for_store(b_o, p_o, EXACT_BF16), mask=m_v)

    # the record at position h (h < LBCAP guards other slots against a bad cursor); written on
    # a flush too (dead then: the cursor returns to 0)
    in_buf = h < LBCAP
    o_h = i_s * LBCAP + h
    p_w = buf_w + (o_h * HV + i_hv) * V + o_v
    tl.store(p_w, _for_store(b_u, p_w, EXACT_BF16), mask=o_v < tl.where(in_buf, V, 0))
    if i_v == 0:
        tl.store(buf_ld + o_h * HV + i_hv, b_ld, mask=in_buf)
        if i_hv % G == 0:
            p_kh = buf_k + (o_h * HK + i_hk) * K + o_k
            tl.store(p_kh, _for_store(b_k * r_k, p_kh, EXACT_BF16), mask=o_k < tl.where(in_buf, K, 0))

    flush = h + 1 >= window
    if flush:
        # C <- P + u k^T, chunk by chunk, P rebuilt from the re-read tile and records
        for c in tl.static_range(NKT):
            b_P, b_kc = _mat_tile(c, p_C, p_K, p_k, o_v, m_v, m_j, r_k, b_gC, b_A, b_A1, b_A2, K,
                                  BKT, MP, EXACT_BF16, "")
            o_kt = c * BKT + tl.arange(0, BKT)
            tl.store(p_C + o_v[:, None] * K + o_kt[None, :], b_P + b_u[:, None] * b_kc[None, :],
                     mask=m_v[:, None] & (o_kt < K)[None, :])

    hand_off(arrive, cursor, epoch, i_s, h, flush, HV * NV)


# ---------------------------------------------------------------------------------------------
# Launch configuration: a fixed table (no autotune: the kernel writes state in place).
# ---------------------------------------------------------------------------------------------

_CONFIG_KEYS = ("BV", "num_warps", "num_stages", "maxnreg")
# replay only: HPP value heads per program (divides the HV // Hk heads of a key head; a table
# entry larger than that is cut to it), recmask (record loads predicated on the cursor, or
# issued at once, without waiting for it), prefetch (the next head's checkpoint tile loaded
# before this head's arithmetic), BC (GDN: records read in chunks of BC up to the cursor; 0:
# one tile covering the window), KS (the checkpoint tile held as KS slices of K per thread,
# see ops/utils/tiles.py; 1: a plain [BV, K] tile), flush ("fma": one rank-1 update per record,
# exact fp32; "tf32x3": one tensor-core product per 16 rows, needs BV >= 16), mat (GDN:
# `_replay_decode_mat_kernel`, the state tile rebuilt per chunk of BKT key columns by one
# tensor-core product; HPP, recmask, prefetch, BC, KS and flush then do not apply), matprec
# (its product: "tf32x3", or for bf16 records "bf16x2": exact keys, the weighted u in two
# bf16 terms, about 16 bits, or "bf16": one term, the weighted u rounded to bf16 once more),
# gluon (GDN, GPU only: the Gluon kernel of gluon_decode.py, the record-contracting program with
# the checkpoint tile copied asynchronously into shared memory while the records are read;
# recmask and maxnreg apply, the other replay keys do not; where `gluon_supported` says no (K
# other than 128, BV other than 16 * num_warps, windows above 32) and on the CPU
# interpreter the Triton kernels run with the other keys)
_REPLAY_KEYS = ("HPP", "recmask", "prefetch", "BC", "KS", "flush", "mat", "BKT", "matprec", "gluon")
_MAT_PRECISIONS = {"tf32x3": 0, "bf16x2": 1, "bf16": 2}
_FLUSH_MODES = {"fma": 0, "tf32x3": 1}

# (family, V, K) -> config, or a list of (max_batch, config): the first entry whose max_batch
# is at least the batch applies. Small batches are latency-bound (small programs, record loads
# issued at once). At batch 256 several value heads per program (sharing the key head's
# records) measured slower than one (more registers, fewer programs). Chosen by H200 sweeps
# (benchmarks/sweep_programs.sh, benchmarks/results/variants_*.json).
_REPLAY_TABLE = {
    # GDN: one warp per program at small batch; records in chunks of 8 up to the cursor
    ("gdn", 128, 128): [(2, {"BV": 16, "num_warps": 1, "HPP": 1, "recmask": False, "prefetch": False}),
                        (8, {"BV": 16, "num_warps": 1, "HPP": 1, "recmask": False, "prefetch": False, "BC": 8,
                             "KS": 8}),
                        # from batch 9 the Gluon kernel (gluon_decode.py; the GPU only, the Triton
                        # kernel with the same keys elsewhere), record loads predicated on the
                        # cursor: fp32 records, window 16, 1.63x (Qwen3.5-4B) and 1.69x
                        # (Qwen3.5-122B) at batch 256 against 1.02x for the Triton entry (BV=32,
                        # BC=8), 1.37x and 1.52x at 64, 1.22x and 1.38x at 32, 0.93x and 1.22x at 16
                        # against 0.66-0.98x (variants_v44_gdn16_fp32rec.json, _small_fp32rec.json)
                        (1 << 30, {"gluon": True, "BV": 64, "num_warps": 4, "HPP": 1, "recmask": True,
                                   "prefetch": False, "maxnreg": 80})],
    # KDA: one program per head at large batch (its decay weights are computed per program)
    ("kda", 128, 128): [(8, {"BV": 32, "num_warps": 4, "HPP": 1, "recmask": False, "prefetch": False}),
                        (1 << 30, {"BV": 128, "num_warps": 4, "HPP": 1, "recmask": True, "prefetch": False,
                                   "KS": 8})],
}

# With bf16 records (keys exact in bf16), large batches take the materialising kernel with its
# two-term bf16 product: GDN at batch 256, window 16, 1.52x (Qwen3.5-4B) and 1.56x
# (Qwen3.5-122B) against 1.08x and 1.07x for the table above (variants_v7_mat256.json). One
# warp per 64-row program, K in two chunks, the chunk loads pipelined (num_stages 3).
_BF16_RECORDS_TABLE = {
    ("gdn", 128, 128): [(8, {}),
                        (32, {"mat": True, "matprec": "bf16x2", "BV": 64, "num_warps": 1, "BKT": 64,
                              "num_stages": 3, "gluon": False, "maxnreg": 0}),
                        # the Gluon kernel (gluon_decode.py, GPU only), registers capped at 80 (six
                        # programs per SM, as many as its shared memory allows), record loads
                        # predicated on the cursor (half the record bytes on average): window 16,
                        # batch 256 1.74x (Qwen3.5-4B) and 1.76x (Qwen3.5-122B), 512 1.80x and
                        # 1.78x, 64 1.40x and 1.59x against 1.38x and 1.44x for the materialising
                        # kernel (variants_v44_gdn16.json); unpredicated record loads measured
                        # 1.65-1.66x and 1.71-1.72x at 256 (variants_v43_base.json). At 32 and 16
                        # the materialising kernel ties or wins (variants_v44_gdn16_small.json)
                        (1 << 30, {"gluon": True, "BV": 64, "num_warps": 4, "recmask": True, "maxnreg": 80})],
}


# The eager step (window 1, see replay_decode) per (family, HV, V, K): a list of (max_batch,
# launch config); batches up to the last max_batch take it (the slot pool decodes them with
# window 1), each with the first entry's config whose max_batch >= the batch ({}: the
# conventional table's). Small batches are latency-bound: a window only lengthens each
# program's chain there (batch 8: eager 1.02-1.03x, window 0.88x; at batch 16 the window wins
# for both GDN shapes, Qwen3.5-4B 1.22x against 1.12x eager, variants_v21_small.json; an
# earlier run had Qwen3.5-4B's eager step ahead there, 1.12x against 0.94x). KDA's windowed
# kernel lost at every batch measured (0.32-0.74x: its per-program decay weights), so KDA
# takes the eager step at every batch (one-warp programs of 8 rows: 1.00x at batch 64, 0.99x
# at 256). Chosen on the H200
# (benchmarks/results/eager_sweep_v13.json, eager_sweep_v15_*.json: every candidate config
# timed for the eager step and for the conventional kernel in one run).
_EAGER_CONFIGS = {
    # Qwen3.5-4B, Qwen3-Next: batch 16 with the conventional table's config, 1.05x (bf16
    # records) and 1.04x (fp32) against 0.88x and 0.92x for the window (variants_v45_variants.json)
    ("gdn", 32, 128, 128): [(8, {"BV": 8, "num_warps": 1}), (16, {})],
    ("gdn", 64, 128, 128): [(8, {"BV": 8, "num_warps": 1})],            # Qwen3.5-122B
    ("kda", 32, 128, 128): [(1 << 30, {"BV": 8, "num_warps": 1})],      # Kimi-Linear-48B
}


def eager_config(family: str, HV: int, V: int, K: int, batch: int) -> dict:
    """The eager step's launch-config overrides at this shape and batch ({}: none)."""
    return dict(table_entry(_EAGER_CONFIGS, (family, HV, V, K), batch) or {})


def eager_max_batch(HV: int, V: int, K: int, family: str = "gdn") -> int:
    """The largest batch for which the tables prefer the eager step (window 1) at this shape
    (0: never). The slot pool decodes such batches with window 1."""
    entry = _EAGER_CONFIGS.get((family, HV, V, K))
    return entry[-1][0] if entry else 0


def _default_config(table: dict, family: str, V: int, K: int, batch: Optional[int] = None) -> dict:
    entry = table_entry(table, (family, V, K), batch)
    if entry is not None:
        return dict({"num_stages": 1, "maxnreg": 0}, **entry)
    BV = min(32, triton.next_power_of_2(V))
    return {"BV": BV, "num_warps": 4 if BV * triton.next_power_of_2(K) >= 4096 else 2,
            "num_stages": 1, "maxnreg": 0}


# The tables' Gluon entries at windows above 16 (record tiles of 32 positions): their register
# cap (80, six programs per SM with 16-position tiles) spills there; Qwen3.5-4B, batch 256,
# window 32: 1.37x capped against 1.47x uncapped (variants_v44_gdn_w.json)
_GLUON_LONG_WINDOW = {"maxnreg": 0}


def _resolve_config(table: dict, family: str, V: int, K: int, config: Optional[dict], *,
                    G: Optional[int] = None, batch: Optional[int] = None,
                    bf16_records: bool = False, window: Optional[int] = None) -> dict:
    """Launch config from the table (or defaults) and `config`; `G` (value heads per key head)
    given: a replay config, with the replay-only keys (and, for bf16 records, the overrides
    of `_BF16_RECORDS_TABLE`; for a Gluon entry at a `window` above 16, `_GLUON_LONG_WINDOW`)."""
    cfg = _default_config(table, family, V, K, batch)
    if G is not None and bf16_records:
        cfg.update(table_entry(_BF16_RECORDS_TABLE, (family, V, K), batch) or {})
    if G is not None and cfg.get("gluon") and window is not None and window > 16:
        cfg.update(_GLUON_LONG_WINDOW)
    keys = _CONFIG_KEYS
    if G is not None:
        keys = _CONFIG_KEYS + _REPLAY_KEYS
        cfg = dict({"HPP": 1, "recmask": True, "prefetch": False, "BC": 0, "KS": 1, "flush": "fma",
                    "mat": False, "BKT": 64, "matprec": "tf32x3", "gluon": False}, **cfg)
        hpp = cfg["HPP"]
        while G % hpp:          # a table entry for a larger group: the largest divisor below
            hpp -= 1
        cfg["HPP"] = hpp
    else:
        cfg = {key: val for key, val in cfg.items() if key in keys}
    if config:
        unknown = set(config) - set(keys)
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)}; allowed {list(keys)}")
        cfg.update(config)
    BV, nw, ns = cfg["BV"], cfg["num_warps"], cfg["num_stages"]
    if not isinstance(BV, int) or BV < 1 or BV & (BV - 1):
        raise ValueError(f"config BV={BV!r} must be a power of two")
    if nw not in (1, 2, 4, 8, 16):
        raise ValueError(f"config num_warps={nw!r} must be one of 1, 2, 4, 8, 16")
    if not isinstance(ns, int) or ns < 1:
        raise ValueError(f"config num_stages={ns!r} must be a positive int")
    if not isinstance(cfg["maxnreg"], int) or cfg["maxnreg"] < 0:
        raise ValueError(f"config maxnreg={cfg['maxnreg']!r} must be a non-negative int (0: no cap)")
    if G is not None:
        hpp = cfg["HPP"]
        if isinstance(hpp, bool) or not isinstance(hpp, int) or hpp < 1 or G % hpp:
            raise ValueError(f"config HPP={hpp!r} must divide the {G} value heads of a key head")
        bc = cfg["BC"]
        if isinstance(bc, bool) or not isinstance(bc, int) or bc < 0 or (bc and bc & (bc - 1)):
            raise ValueError(f"config BC={bc!r} must be 0 (one tile of the window) or a power of two")
        if bc and family == "kda":
            raise ValueError(f"config BC={bc!r}: record chunks are implemented for GDN only")
        check_slices(cfg["KS"], triton.next_power_of_2(K))
        if cfg["flush"] not in _FLUSH_MODES:
            raise ValueError(f"config flush={cfg['flush']!r} must be one of {sorted(_FLUSH_MODES)}")
        if cfg["mat"]:
            bkt, bk = cfg["BKT"], triton.next_power_of_2(K)
            if isinstance(bkt, bool) or not isinstance(bkt, int) or bkt < 16 or bkt & (bkt - 1) or bk % bkt:
                raise ValueError(f"config BKT={bkt!r} must be a power of two >= 16 dividing {bk}")
            if family != "gdn":
                raise ValueError("config mat=True: the materialising kernel is implemented for GDN only")
            if min(BV, triton.next_power_of_2(V)) < 16:
                raise ValueError(f"config mat=True needs BV >= 16 (the smallest tl.dot tile), got {BV}")
            if cfg["matprec"] not in _MAT_PRECISIONS:
                raise ValueError(f"config matprec={cfg['matprec']!r} must be one of {sorted(_MAT_PRECISIONS)}")
        if not isinstance(cfg["gluon"], bool):
            raise ValueError(f"config gluon={cfg['gluon']!r} must be a bool")
        if cfg["gluon"] and family != "gdn":
            raise ValueError("config gluon=True: the Gluon kernel is implemented for GDN only")
        if cfg["flush"] == "tf32x3" and min(BV, triton.next_power_of_2(V)) < 16:
            raise ValueError(f"config flush='tf32x3' needs BV >= 16 (the smallest tl.dot tile), got {BV}")
    return cfg


def replay_config(V: int, K: int, config: Optional[dict] = None, family: str = "gdn", *,
                  G: int = 1, batch: Optional[int] = None,
                  records: torch.dtype = torch.float32, window: Optional[int] = None) -> dict:
    """The launch config `replay_decode` uses for value dim `V`, key dim `K`, `G` value heads
    per key head, a batch of `batch` rows, records of dtype `records` and window `window`
    (None: as for windows up to 16), with overrides."""
    return _resolve_config(_REPLAY_TABLE, family, V, K, config, G=G, batch=batch,
                           bf16_records=records == torch.bfloat16, window=window)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---------------------------------------------------------------------------------------------
# Validation at the Python boundary (shared by both families and both schemes).
# ---------------------------------------------------------------------------------------------

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_RECORD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _shape(name: str, t: Tensor, shape: tuple) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def _dtype(name: str, t: Tensor, allowed: tuple) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name} has dtype {t.dtype}, expected one of {[str(d) for d in allowed]}")


def _contig(name: str, t: Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()})")


def _last_contig(name: str, t: Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (strides {t.stride()})")


def check_token_inputs(family: str, q, k, v, a, b, A_log, dt_bias, out) -> tuple:
    """Shapes, dtypes and strides of one step's inputs; returns `(Bt, Hk, K, HV, V)`."""
    if not isinstance(q, Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a [Bt, Hk, K] tensor, got shape {getattr(q, 'shape', None)}")
    Bt, Hk, K = q.shape
    _shape("k", k, (Bt, Hk, K))
    if not isinstance(v, Tensor) or v.dim() != 3 or v.shape[0] != Bt:
        raise ValueError(f"v must be a [Bt={Bt}, HV, V] tensor, got shape {getattr(v, 'shape', None)}")
    HV, V = v.shape[1], v.shape[2]
    if Hk < 1 or HV % Hk:
        raise ValueError(f"value heads HV={HV} must be a multiple of key heads Hk={Hk}")
    if family == "kda":
        _shape("a", a, (Bt, HV, K))
        _shape("dt_bias", dt_bias, (HV, K))
    else:
        _shape("a", a, (Bt, HV))
        _shape("dt_bias", dt_bias, (HV,))
    _shape("b", b, (Bt, HV))
    _shape("A_log", A_log, (HV,))
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("A_log", A_log),
                    ("dt_bias", dt_bias)):
        _dtype(name, t, _FLOATS)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _last_contig(name, t)
    if family == "kda":
        _last_contig("a", a)
    _contig("A_log", A_log)
    _contig("dt_bias", dt_bias)
    if out is not None:
        _shape("out", out, (Bt, HV, V))
        _dtype("out", out, _FLOATS)
        _contig("out", out)
    return Bt, Hk, K, HV, V


def check_slot_ids(slot_ids, Bt: int, N: int) -> None:
    _shape("slot_ids", slot_ids, (Bt,))
    _dtype("slot_ids", slot_ids, (torch.int32, torch.int64))
    _contig("slot_ids", slot_ids)


def check_slot_values(slot_ids: Tensor, N: int) -> None:
    """Slot range and uniqueness (host sync; skipped while capturing a CUDA graph or compiling)."""
    if capturing() or torch.compiler.is_compiling():
        return
    ids = slot_ids.detach().cpu()
    valid = ids[ids >= 0]
    if valid.numel() and int(valid.max()) >= N:
        raise ValueError(f"slot_ids holds {int(valid.max())}, but the pool has N={N} slots")
    if valid.numel() != torch.unique(valid).numel():
        dup = [int(x) for x in valid.unique() if int((valid == x).sum()) > 1]
        raise ValueError(f"slot_ids repeats slot(s) {dup} in one call")


def check_devices(**tensors) -> None:
    devs = {name: t.device for name, t in tensors.items() if isinstance(t, Tensor)}
    first = next(iter(devs.values()))
    for name, d in devs.items():
        if d != first:
            raise ValueError(f"{name} is on {d}, expected {first} (all tensors on one device)")


# ---------------------------------------------------------------------------------------------
# The arrive counters (one int32 per slot, zero between launches).
# ---------------------------------------------------------------------------------------------


def check_state(family: str, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive,
                HV: int, Hk: int, V: int, K: int, window) -> tuple:
    """Shapes and dtypes of the pool tensors; returns `(N, Lb)`."""
    if not isinstance(ckpt, Tensor) or ckpt.dim() != 4:
        raise ValueError(f"ckpt must be an [N, HV, V, K] tensor, got shape {getattr(ckpt, 'shape', None)}")
    N = ckpt.shape[0]
    _shape("ckpt", ckpt, (N, HV, V, K))
    _dtype("ckpt", ckpt, (torch.float32,))
    if not isinstance(buf_w, Tensor) or buf_w.dim() != 4:
        raise ValueError(f"buf_w must be an [N, Lb, HV, V] tensor, got shape {getattr(buf_w, 'shape', None)}")
    Lb = buf_w.shape[1]
    _shape("buf_w", buf_w, (N, Lb, HV, V))
    _shape("buf_ld", buf_ld, (N, Lb, HV, K) if family == "kda" else (N, Lb, HV))
    _shape("buf_k", buf_k, (N, Lb, Hk, K))
    _dtype("buf_ld", buf_ld, (torch.float32,))
    _dtype("buf_w", buf_w, _RECORD_DTYPES)
    _dtype("buf_k", buf_k, _RECORD_DTYPES)
    _shape("cursor", cursor, (N,))
    _dtype("cursor", cursor, (torch.int32,))
    _shape("epoch", epoch, (N,))
    _dtype("epoch", epoch, (torch.int64,))
    _shape("arrive", arrive, (N,))
    _dtype("arrive", arrive, (torch.int32,))
    for name, t in (("ckpt", ckpt), ("buf_ld", buf_ld), ("buf_w", buf_w), ("buf_k", buf_k),
                    ("cursor", cursor), ("epoch", epoch), ("arrive", arrive)):
        _contig(name, t)
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= Lb:
        raise ValueError(f"window={window!r} must be an int in [1, Lb={Lb}]")
    return N, Lb


def check_cursor_values(cursor: Tensor, slot_ids: Tensor, Lb: int, window: int) -> None:
    """The rows' cursors leave room for the new record and do not pass the window, which
    sizes the kernel's record tiles (host sync; skipped when capturing)."""
    if capturing() or torch.compiler.is_compiling():
        return
    ids = slot_ids.detach().cpu().long()
    ids = ids[ids >= 0]
    if ids.numel():
        h = cursor.detach().cpu()[ids]
        # window 1 (the eager step) folds whatever the buffer holds
        bad = (h < 0) | (h >= Lb) | ((h > window) & (window > 1))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            lim = f"min(window={window}, Lb-1={Lb - 1})" if window > 1 else f"Lb-1={Lb - 1}"
            raise ValueError(f"cursor[{int(ids[i])}]={int(h[i])} is outside 0..{lim}")


def _scale(scale, K: int) -> float:
    if scale is None:
        return K ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale={scale!r} must be a finite float or None")
    return float(scale)


# ---------------------------------------------------------------------------------------------
# Launcher, custom ops, public function.
# ---------------------------------------------------------------------------------------------


def launch_replay(family: str, q, k, v, a, b, A_log, dt_bias, scale: float, ckpt, buf_ld, buf_w,
                  buf_k, cursor, epoch, arrive, slot_ids, window: int, o, use_qk_l2norm: bool,
                  BV: int, num_warps: int, num_stages: int, maxnreg: int = 0, HPP: int = 1,
                  recmask: bool = True, prefetch: bool = False, BC: int = 0, KS: int = 1,
                  flush: str = "fma", mat: bool = False, BKT: int = 64,
                  matprec: str = "tf32x3", gluon: bool = False) -> None:
    Bt, Hk, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    Lb = buf_w.shape[1]
    if Bt == 0:
        return
    BK = triton.next_power_of_2(K)
    # records 0..h-1 with h <= window (the pool's cursors never exceed the window): the tiles
    # are sized by the window, not by the buffer's capacity window + T
    LB = max(2, triton.next_power_of_2(min(window, Lb)))
    BV = min(BV, triton.next_power_of_2(V))
    NV = triton.cdiv(V, BV)
    extra = {"maxnreg": maxnreg} if maxnreg and not _interpreting() else {}
    if gluon and not _interpreting() and not gluon_supported(family, HV, Hk, V, K, window, Lb, BV, num_warps):
        launch_gluon(q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k, cursor, epoch,
                     arrive, slot_ids, window, o, use_qk_l2norm, BV, num_warps, recmask, maxnreg)
        return
    if mat:
        _replay_decode_mat_kernel[(HV * NV, Bt)](
            q, k, v, a, b, A_log, dt_bias, o,
            ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids,
            scale, window,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            HV=HV, HK=Hk, V=V, K=K, LBCAP=Lb, LR=max(16, LB), BV=BV, BK=BK, BKT=min(BKT, BK),
            USE_QK_L2NORM=bool(use_qk_l2norm), EXACT_BF16=_interpreting(),
            MP=_MAT_PRECISIONS[matprec], num_warps=num_warps, num_stages=num_stages, **extra)
        return
    grid = (HV // HPP * NV, Bt)
    _replay_decode_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, o,
        ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids,
        scale, window,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        HV=HV, HK=Hk, V=V, K=K, LBCAP=Lb, LB=LB, BV=BV, BK=BK, HPP=HPP,
        IS_KDA=family == "kda", USE_QK_L2NORM=bool(use_qk_l2norm),
        RECMASK=bool(recmask), PREFETCH=bool(prefetch), EXACT_BF16=_interpreting(), RC=min(16, BV),
        BC=BC if 0 < BC < LB else LB, CHUNK=0 < BC < LB and family == "gdn",
        KS=KS, FLUSH=_FLUSH_MODES[flush], LF=max(16, LB),
        # a register cap raises occupancy (more bytes in flight) at the price of spills
        num_warps=num_warps, num_stages=num_stages, **extra,
    )


_MUTATED = ("o", "ckpt", "buf_ld", "buf_w", "buf_k", "cursor", "epoch", "arrive")


def _register_replay_op(family: str):
    """The custom op `replayssm::{family}_replay_decode` (GDN and KDA share the kernel)."""

    @torch.library.custom_op(f"replayssm::{family}_replay_decode", mutates_args=_MUTATED)
    def op(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
           dt_bias: Tensor, scale: float, ckpt: Tensor, buf_ld: Tensor, buf_w: Tensor,
           buf_k: Tensor, cursor: Tensor, epoch: Tensor, arrive: Tensor, slot_ids: Tensor,
           window: int, o: Tensor, use_qk_l2norm: bool, BV: int, num_warps: int,
           num_stages: int, maxnreg: int, HPP: int, recmask: bool, prefetch: bool, BC: int,
           KS: int, flush: str, mat: bool, BKT: int, matprec: str, gluon: bool) -> None:
        launch_replay(family, q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k,
                      cursor, epoch, arrive, slot_ids, window, o, use_qk_l2norm, BV, num_warps,
                      num_stages, maxnreg, HPP, recmask, prefetch, BC, KS, flush, mat, BKT,
                      matprec, gluon)

    @op.register_fake
    def _(q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k, cursor, epoch,
          arrive, slot_ids, window, o, use_qk_l2norm, BV, num_warps, num_stages, maxnreg, HPP,
          recmask, prefetch, BC, KS, flush, mat, BKT, matprec, gluon) -> None:
        return None

    return op


_REPLAY_OPS = {family: _register_replay_op(family) for family in ("gdn", "kda")}


def prepare_replay(family, q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k,
                   cursor, epoch, slot_ids, window, out, config, arrive, validate):
    """Validation, defaults and output allocation shared by the GDN and KDA wrappers."""
    if validate:
        Bt, Hk, K, HV, V = check_token_inputs(family, q, k, v, a, b, A_log, dt_bias, out)
        if arrive is None:
            arrive = arrive_counter(ckpt.device, ckpt.shape[0]) if isinstance(ckpt, Tensor) \
                and ckpt.dim() == 4 else None
        N, Lb = check_state(family, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive,
                            HV, Hk, V, K, window)
        check_slot_ids(slot_ids, Bt, N)
        check_devices(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ckpt=ckpt,
                      buf_ld=buf_ld, buf_w=buf_w, buf_k=buf_k, cursor=cursor, epoch=epoch,
                      arrive=arrive, slot_ids=slot_ids, out=out)
        check_slot_values(slot_ids, N)
        check_cursor_values(cursor, slot_ids, Lb, window)
    else:
        K, V = q.shape[-1], v.shape[-1]
        if arrive is None:
            arrive = arrive_counter(ckpt.device, ckpt.shape[0])
    cfg = _resolve_config(_REPLAY_TABLE, family, V, K, config, G=v.shape[1] // q.shape[1],
                          batch=q.shape[0], bf16_records=buf_k.dtype == torch.bfloat16, window=window)
    if cfg["mat"] and cfg["matprec"] != "tf32x3" and buf_k.dtype != torch.bfloat16:
        raise ValueError(f"config matprec={cfg['matprec']!r} needs bf16 key records, got {buf_k.dtype}")
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    return _scale(scale, K), out, arrive, cfg


def replay_decode(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                  dt_bias: Tensor, scale: Optional[float], ckpt: Tensor, buf_ld: Tensor,
                  buf_w: Tensor, buf_k: Tensor, cursor: Tensor, epoch: Tensor, slot_ids: Tensor,
                  window: int, out: Optional[Tensor] = None, use_qk_l2norm: bool = True,
                  config: Optional[dict] = None, *, arrive: Optional[Tensor] = None,
                  validate: bool = True) -> Tensor:
    """One ReplaySSM standard-decode step of a GDN layer, in one launch (docs/state-layout.md).

    Args:
        q, k: `[Bt, Hk, K]` raw query and key (L2-normalised in the kernel when
            `use_qk_l2norm`; `q` then scaled by `scale`, None: `K ** -0.5`).
        v: `[Bt, HV, V]`. a: `[Bt, HV]` raw decay input; b: `[Bt, HV]` raw beta input.
        A_log, dt_bias: `[HV]`; `log a = -exp(A_log) * softplus(a + dt_bias)`, `beta = sigmoid(b)`.
        ckpt: `[N, HV, V, K]` fp32 checkpoints; buf_ld: `[N, Lb, HV]` fp32 log decays;
            buf_w: `[N, Lb, HV, V]` the records' `u`; buf_k: `[N, Lb, Hk, K]` normalised keys
            (fp32 or bf16 records); cursor: `[N]` int32; epoch: `[N]` int64. Updated in place.
        slot_ids: `[Bt]` int; negative ids are padding rows (zero output, no state touched).
        window: the replay window `L` (`1 <= L <= Lb`); a row with cursor `h` flushes when
            `h + 1 >= L`. Window 1 is the eager step (the checkpoint is the state after every
            step, as in conventional decoding, and no record is written): the conventional
            kernel on the checkpoint, which first folds the records a row still holds (any
            cursor below `Lb`); `config` then sets only its `BV`, `num_warps`, `num_stages`.
            `eager_max_batch` says up to which batch the measured tables prefer it.
        out: optional `[Bt, HV, V]` output (default: new tensor of `v`'s dtype).
        config: overrides of the launch config (`BV`, `num_warps`, `num_stages`, `maxnreg`,
            `HPP`, `recmask`, `prefetch`, `BC`, `KS`, `flush`, `mat`, `BKT`; see `_REPLAY_KEYS`).
        arrive: `[N]` int32 zeroed counters (default: a cached buffer, see `arrive_counter`).
        validate: check shapes, dtypes, devices, slot ids and cursors (host syncs for the
            last two, skipped during CUDA-graph capture). False skips every check.

    Returns:
        `out`: `[Bt, HV, V]`.
    """
    return run_replay("gdn", q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k,
                      cursor, epoch, slot_ids, window, out, use_qk_l2norm, config, arrive, validate)


def run_replay(family, q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k, cursor,
               epoch, slot_ids, window, out, use_qk_l2norm, config, arrive, validate) -> Tensor:
    """Validate, resolve the config and launch the family's replay op (GDN and KDA wrappers)."""
    scale, out, arrive, cfg = prepare_replay(
        family, q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k, cursor, epoch,
        slot_ids, window, out, config, arrive, validate)
    if window == 1:
        from .conventional import run_eager     # conventional.py builds on this module
        return run_eager(family, q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k,
                         cursor, epoch, arrive, slot_ids, out, use_qk_l2norm, config)
    _REPLAY_OPS[family](
        q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive,
        slot_ids, int(window), out, bool(use_qk_l2norm), cfg["BV"], cfg["num_warps"],
        cfg["num_stages"], cfg["maxnreg"], cfg["HPP"], bool(cfg["recmask"]), bool(cfg["prefetch"]),
        cfg["BC"], cfg["KS"], cfg["flush"], bool(cfg["mat"]), cfg["BKT"], cfg["matprec"],
        bool(cfg["gluon"]))
    return out
