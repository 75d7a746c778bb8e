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

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..utils.cursor import hand_off, slot_bases
from ..utils.launch import arrive_counter, gluon_aligned, require_contiguous_slots, slot_pads
from ..utils.tiles import tile_dot, tile_offsets
from .common import (_for_store, _interpreting, _load_head, _load_qk, _rne_bf16, _scale, check_cursor_values,
                     check_devices, check_slot_ids, check_slot_values, check_state, check_token_inputs)
from .configs import _MAT_PRECISIONS, _REPLAY_TABLE, _resolve_config
from .conventional import run_eager
from .gluon_decode import gluon_unsupported, launch_gluon

__all__ = ["replay_decode", "run_replay"]

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
    pad_ckpt, pad_ld, pad_w, pad_k, pad_cur,
    scale, window,
    stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
    stride_a_b, stride_a_h, stride_b_b, stride_b_h,
    HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
    LBCAP: tl.constexpr, LB: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    IS_KDA: tl.constexpr, USE_QK_L2NORM: tl.constexpr, RECMASK: tl.constexpr,
    EXACT_BF16: tl.constexpr, RC: tl.constexpr, BC: tl.constexpr, CHUNK: tl.constexpr,
    KS: tl.constexpr,
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
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    p_o = o + (i_b * HV + i_hv) * V + o_v

    i_s = tl.load(slot_ids + i_b).to(tl.int64)
    if i_s < 0:
        tl.store(p_o, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty), mask=m_v)
        return
    # slot-strided state (vLLM's pages): the bases moved by the slot's padding
    ckpt, buf_ld, buf_w, buf_k, cursor = slot_bases(i_s, ckpt, buf_ld, buf_w, buf_k, cursor, pad_ckpt, pad_ld,
                                                    pad_w, pad_k, pad_cur)
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

    # tile offsets in int32 added to a scalar 64-bit base: a tile of 64-bit addresses would
    # hold twice the registers
    p_C = ckpt + i_s * (HV * V * K)
    o_C, m_C = tile_offsets(o_v, m_v, K, BK, KS)

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
    tl.store(p_o, _for_store(b_o, p_o, EXACT_BF16), mask=m_v)

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
        if i_hv % HG == 0:
            p_kh = buf_k + (o_h * HK + i_hk) * K + o_k
            tl.store(p_kh, _for_store(b_k, p_kh, EXACT_BF16), mask=o_k < n_k)

    if flush:
        tl.debug_barrier()          # this token's u, stored above, visible to all threads
        _flush_fma(p_C + i_hv * (V * K), buf_ld, buf_w, buf_k, i_s, i_hv, i_hk, i_v, h,
                   b_k, b_ld, o_k, m_k, HV, HK, V, K, LBCAP, BV, IS_KDA, RC)

    hand_off(arrive, cursor, epoch, i_s, h, flush, HV * NV)


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
    pad_ckpt, pad_ld, pad_w, pad_k, pad_cur,
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
    HG: tl.constexpr = HV // HK
    NKT: tl.constexpr = BK // BKT
    pid = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    i_v = pid % NV
    i_hv = pid // NV
    i_hk = i_hv // HG

    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_o = o + (i_b * HV + i_hv) * V + o_v
    i_s = tl.load(slot_ids + i_b).to(tl.int64)
    if i_s < 0:
        tl.store(p_o, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty), mask=m_v)
        return
    # slot-strided state (vLLM's pages): the bases moved by the slot's padding
    ckpt, buf_ld, buf_w, buf_k, cursor = slot_bases(i_s, ckpt, buf_ld, buf_w, buf_k, cursor, pad_ckpt, pad_ld,
                                                    pad_w, pad_k, pad_cur)
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
        if i_hv % HG == 0:
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
# Launcher, custom ops, public function.
# ---------------------------------------------------------------------------------------------


def launch_replay(family: str, q, k, v, a, b, A_log, dt_bias, scale: float, ckpt, buf_ld, buf_w,
                  buf_k, cursor, epoch, arrive, slot_ids, window: int, o, use_qk_l2norm: bool,
                  BV: int, num_warps: int, num_stages: int, maxnreg: int = 0,
                  recmask: bool = True, BC: int = 0, KS: int = 1, mat: bool = False, BKT: int = 64,
                  matprec: str = "tf32x3", gluon: bool = False) -> None:
    """Launch the kernel that `gluon`, `mat` and the shape select (the Gluon kernel, the
    materialising kernel or `_replay_decode_kernel`); inputs already validated."""
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
    if gluon and not _interpreting() and gluon_unsupported(family, HV, Hk, V, K, window, Lb, BV, num_warps) is None \
            and gluon_aligned(ckpt, buf_ld, buf_w, buf_k):
        launch_gluon(q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k, cursor, epoch,
                     arrive, slot_ids, window, o, use_qk_l2norm, BV, num_warps, recmask, maxnreg, family,
                     fold_group=BC)
        return
    if mat:
        _replay_decode_mat_kernel[(HV * NV, Bt)](
            q, k, v, a, b, A_log, dt_bias, o,
            ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids,
            *slot_pads(ckpt, buf_ld, buf_w, buf_k, cursor).values(),
            scale, window,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            HV=HV, HK=Hk, V=V, K=K, LBCAP=Lb, LR=max(16, LB), BV=BV, BK=BK, BKT=min(BKT, BK),
            USE_QK_L2NORM=bool(use_qk_l2norm), EXACT_BF16=_interpreting(),
            MP=_MAT_PRECISIONS[matprec], num_warps=num_warps, num_stages=num_stages, **extra)
        return
    _replay_decode_kernel[(HV * NV, Bt)](
        q, k, v, a, b, A_log, dt_bias, o,
        ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids,
        *slot_pads(ckpt, buf_ld, buf_w, buf_k, cursor).values(),
        scale, window,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        HV=HV, HK=Hk, V=V, K=K, LBCAP=Lb, LB=LB, BV=BV, BK=BK,
        IS_KDA=family == "kda", USE_QK_L2NORM=bool(use_qk_l2norm),
        RECMASK=bool(recmask), EXACT_BF16=_interpreting(), RC=min(16, BV),
        BC=BC if 0 < BC < LB else LB, CHUNK=0 < BC < LB and family == "gdn", KS=KS,
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
           num_stages: int, maxnreg: int, recmask: bool, BC: int, KS: int, mat: bool, BKT: int,
           matprec: str, gluon: bool) -> None:
        launch_replay(family, q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k,
                      cursor, epoch, arrive, slot_ids, window, o, use_qk_l2norm, BV, num_warps,
                      num_stages, maxnreg, recmask, BC, KS, mat, BKT, matprec, gluon)

    @op.register_fake
    def _(q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k, cursor, epoch,
          arrive, slot_ids, window, o, use_qk_l2norm, BV, num_warps, num_stages, maxnreg, recmask,
          BC, KS, mat, BKT, matprec, gluon) -> None:
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
                            HV, Hk, V, K, window, slot_strided=window != 1)
        check_slot_ids(slot_ids, Bt)
        check_devices(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ckpt=ckpt,
                      buf_ld=buf_ld, buf_w=buf_w, buf_k=buf_k, cursor=cursor, epoch=epoch,
                      arrive=arrive, slot_ids=slot_ids, out=out)
        check_slot_values(slot_ids, N)
        check_cursor_values(cursor, slot_ids, Lb, window)
    else:
        K, V = q.shape[-1], v.shape[-1]
        if arrive is None:
            arrive = arrive_counter(ckpt.device, ckpt.shape[0])
    cfg = _resolve_config(_REPLAY_TABLE, family, V, K, config, replay=True, batch=q.shape[0],
                          bf16_records=buf_k.dtype == torch.bfloat16, window=window,
                          HV=v.shape[1], Hk=q.shape[1])
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
            `recmask`, `BC`, `KS`, `mat`, `BKT`, `matprec`, `gluon`; see `configs._REPLAY_KEYS`).
        arrive: `[N]` int32 zeroed counters (default: a cached buffer, see `arrive_counter`).
        validate: check shapes, dtypes, devices, slot ids and cursors (host syncs for the
            last two on the device, skipped only during CUDA-graph capture or torch.compile
            tracing: ops/utils/checks.py). False skips every check.

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
        require_contiguous_slots("the eager step (window 1)", ckpt, buf_ld, buf_w, buf_k, cursor)
        return run_eager(family, q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k,
                         cursor, epoch, arrive, slot_ids, out, use_qk_l2norm, config)
    _REPLAY_OPS[family](
        q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive,
        slot_ids, int(window), out, bool(use_qk_l2norm), cfg["BV"], cfg["num_warps"],
        cfg["num_stages"], cfg["maxnreg"], bool(cfg["recmask"]), cfg["BC"], cfg["KS"],
        bool(cfg["mat"]), cfg["BKT"], cfg["matprec"], bool(cfg["gluon"]))
    return out