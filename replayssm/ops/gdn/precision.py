"""GDN (and, through `IS_KDA`, KDA) standard decode with separate state precisions (SPEC
section 5), in Triton.

The replay decode of decode.py with two checkpoints: `ckpt` fp32 (high precision, carries the
recurrence) and `ckpt_lp` in a low-precision format (`ops/utils/lowp.py`). Per row with slot
`s` and cursor `h` (0-based positions, the current token at `h`):

    non-flush (h + 1 < L): u_t and o from C_LP[s] and the buffered records, output-only, as
                           decode.py; record h written with the raw v_t, beta_t besides u_t
    flush:                 along the HP path, from C_HP[s]: for j = 0..h
                               S <- a_j S;  u_j = beta_j (v_j - S k_j);  S <- S + u_j k_j^T
                           (the buffered u_j came from C_LP: they are recomputed from the raw
                           v_j, beta_j); o = S q; C_HP[s] <- S; C_LP[s] <- round-to-nearest(S)

The delta rule's `u` of a value row depends only on that row of `S`, so the recomputation is
per V-block, in row chunks of RC, with no exchange between programs. NVFP4's scale per head
matrix: the head's last program to arrive encodes the whole matrix (mamba2/precision.py).
The flush does not depend on the low-precision format, so neither does the fp32 checkpoint.
Window 1 (the eager step) flushes every row, folding the records it still holds.
On CUDA a step may be two launches (`ROWS`, gluon_lowp.py): this kernel over the flush rows,
then the Gluon kernel of the steady rows, which moves every cursor.
The HP checkpoint may instead be fp16, bf16 or scaled fp8-e4m3 (`HP`, ops/utils/sround.py):
the flush decodes it, folds in fp32 and writes it back with seeded stochastic rounding, bit for
bit `formats.encode(S, hp, "stochastic", seed, stream=slot * 2**32 + epoch[slot])` of its fp32
fold; the LP copy is then the nearest encoding of that fold (not of the rounded HP), as the pool's.

The shared design (`SHARED`, `ckpt_lp=None`) keeps one checkpoint in fp16, bf16, fp8-e4m3 or
NVFP4: every step is the output-only step on it, and a flush folds the buffered u (they came
from this checkpoint: nothing to recompute) as decode.py does and writes it back round-to-nearest
or stochastically (`SR`); a shared NVFP4 head by its last program, which folds the whole head
twice from the old checkpoint (amax, then rows).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..utils.checks import check_tensor
from ..utils.cursor import hand_off
from ..utils.launch import arrive_counter
from ..utils.lowp import (LP_CODES, flush_item_row, flush_programs, flush_rows_chunk, head_counter,
                          last_at_head, load_lp_tile, lowp_config, store_lp_rows,
                          store_nvfp4_head)
from ..utils.sround import (SHARED_CODES, checkpoint_args, nvfp4_tensor_scale, shared_args, store_nvfp4_rows,
                           store_sr_rows)
from .common import (_for_store, _interpreting, _load_head, _load_qk, _scale, check_cursor_values,
                     check_devices, check_slot_ids, check_slot_values, check_state, check_token_inputs)
from .gluon_lowp import launch_gluon_lp, use_gluon_lp

__all__ = ["lowp_decode", "LP_FORMATS", "SHARED_FORMATS"]

LP_FORMATS = tuple(LP_CODES)
SHARED_FORMATS = tuple(SHARED_CODES)


@triton.jit
def _hp_flush(p_Ch, o, v, buf_ld, buf_k, buf_v, buf_beta, i_s, i_b, i_hv, i_hk, i_v, h, i_m,
              b_q, b_k, b_ld, b_beta, o_k, m_k, lp_data, lp_scale, stride_v_b, stride_v_h,
              ckpt, hp_scale, sr_key, st,
              HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
              LBCAP: tl.constexpr, BV: tl.constexpr, IS_KDA: tl.constexpr, RC: tl.constexpr,
              LP: tl.constexpr, HP: tl.constexpr):
    """The flush along the high-precision path for this program's rows of head `p_Ch`: the
    conventional recurrence over records 0..h-1 (u recomputed from raw v, beta) and the current
    token, in row chunks of RC; stores o, the fp32 rows and (fp16/bf16/fp8) their LP rows."""
    for r0 in tl.static_range(0, BV, RC):
        o_r = i_v * BV + r0 + tl.arange(0, RC)
        m_r = o_r < V
        o_Sr = o_r[:, None] * K + o_k[None, :]
        m_Sr = m_r[:, None] & m_k[None, :]
        if HP == 0:
            b_S = tl.load(p_Ch + o_Sr, mask=m_Sr, other=0.)                             # [RC, BK]
        else:
            b_S = load_lp_tile(ckpt, hp_scale, hp_scale, i_m, o_r, m_r, o_k, m_k, V, K, HP)
        for j in range(0, h):
            o_p = i_s * LBCAP + j
            b_kj = tl.load(buf_k + (o_p * HK + i_hk) * K + o_k, mask=m_k, other=0.).to(tl.float32)
            b_vj = tl.load(buf_v + (o_p * HV + i_hv) * V + o_r, mask=m_r, other=0.).to(tl.float32)
            b_bj = tl.load(buf_beta + o_p * HV + i_hv)
            if IS_KDA:
                b_S = b_S * tl.exp(tl.load(buf_ld + (o_p * HV + i_hv) * K + o_k, mask=m_k, other=0.))[None, :]
            else:
                b_S = b_S * tl.exp(tl.load(buf_ld + o_p * HV + i_hv))
            b_u = b_bj * (b_vj - tl.sum(b_S * b_kj[None, :], axis=1))
            b_S += b_u[:, None] * b_kj[None, :]
        # the current token, from registers
        if IS_KDA:
            b_S = b_S * tl.exp(b_ld)[None, :]
        else:
            b_S = b_S * tl.exp(b_ld)
        b_vr = tl.load(v + i_b * stride_v_b + i_hv * stride_v_h + o_r, mask=m_r, other=0.).to(tl.float32)
        b_u = b_beta * (b_vr - tl.sum(b_S * b_k[None, :], axis=1))
        b_S += b_u[:, None] * b_k[None, :]
        p_o = o + (i_b * HV + i_hv) * V + o_r
        tl.store(p_o, tl.sum(b_S * b_q[None, :], axis=1).to(p_o.dtype.element_ty), mask=m_r)
        if HP == 0:
            tl.store(p_Ch + o_Sr, b_S, mask=m_Sr)
        else:
            store_sr_rows(b_S, ckpt, hp_scale, i_m, i_hv, o_r, m_r, o_k, m_k, sr_key, st, V, K, HP)
        if LP != 4:
            store_lp_rows(b_S, lp_data, lp_scale, i_m, o_r, m_r, o_k, m_k, V, K, LP)


@triton.jit
def _output_only(lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, i_s, i_hv, i_hk, i_m, h, o_v, m_v,
                 o_k, m_k, b_q, b_k, b_v, b_ld, b_beta, HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr,
                 K: tl.constexpr, LBCAP: tl.constexpr, LB: tl.constexpr, IS_KDA: tl.constexpr,
                 LP: tl.constexpr):
    """The output-only step of decode.py on the decoded checkpoint tile (`LP` code) and the
    records at positions j < h: `(u_t, o)`, each `[BV]`."""
    o_j = tl.arange(0, LB)
    m_j = o_j < h
    m_j1 = (o_j + 1) < h
    o_rec = i_s * LBCAP + o_j
    b_C = load_lp_tile(lp_data, lp_scale, lp_tscale, i_m, o_v, m_v, o_k, m_k, V, K, LP)  # [BV, BK]
    b_Kb = tl.load(buf_k + (o_rec * HK + i_hk)[:, None] * K + o_k[None, :],
                   mask=m_j[:, None] & m_k[None, :], other=0.)
    b_Kb = tl.where(m_j[:, None], b_Kb.to(tl.float32), 0.)                          # [LB, BK]
    b_U = tl.load(buf_w + (o_rec[:, None] * HV + i_hv) * V + o_v[None, :],
                  mask=m_j[:, None] & m_v[None, :], other=0.)
    b_U = tl.where(m_j[:, None], b_U.to(tl.float32), 0.)                            # [LB, BV]
    # suffix sums of the decays shifted by one position (a reverse scan, never total minus
    # prefix: weights near 1 keep full precision), as decode.py
    if IS_KDA:
        b_LDs = tl.load(buf_ld + ((o_rec + 1) * HV + i_hv)[:, None] * K + o_k[None, :],
                        mask=m_j1[:, None] & m_k[None, :], other=0.)
        b_LDs = tl.where(m_j1[:, None], b_LDs, 0.)
        b_LDs = tl.where((o_j + 1 == h)[:, None], b_ld[None, :], b_LDs)             # [LB, BK]
        b_ld0 = tl.load(buf_ld + (i_s * LBCAP * HV + i_hv) * K + o_k, mask=m_k, other=0.)
        b_ld0 = tl.where(h == 0, b_ld, b_ld0)
        b_gC = tl.exp(b_ld0 + tl.sum(b_LDs, axis=0))                                # [BK]
        b_Kw = b_Kb * tl.exp(tl.cumsum(b_LDs, axis=0, reverse=True))                 # [LB, BK]
        b_kk = tl.sum(b_Kw * b_k[None, :], axis=1)                                  # [LB]
        b_kq = tl.sum(b_Kw * b_q[None, :], axis=1)
    else:
        b_LDs = tl.load(buf_ld + (o_rec + 1) * HV + i_hv, mask=m_j1, other=0.)
        b_LDs = tl.where(m_j1, b_LDs, tl.where(o_j + 1 == h, b_ld, 0.))             # [LB]
        b_ld0 = tl.load(buf_ld + i_s * LBCAP * HV + i_hv)
        b_ld0 = tl.where(h == 0, b_ld, b_ld0)
        b_gC = tl.exp(b_ld0 + tl.sum(b_LDs, axis=0))
        b_w = tl.where(m_j, tl.exp(tl.cumsum(b_LDs, axis=0, reverse=True)), 0.)     # [LB]
        b_kk = tl.sum(b_Kb * b_k[None, :], axis=1) * b_w
        b_kq = tl.sum(b_Kb * b_q[None, :], axis=1) * b_w
    # one read of the checkpoint tile, two matvecs
    b_Pk = tl.sum(b_C * (b_gC * b_k)[None, :], axis=1) + tl.sum(b_U * b_kk[:, None], axis=0)
    b_Pq = tl.sum(b_C * (b_gC * b_q)[None, :], axis=1) + tl.sum(b_U * b_kq[:, None], axis=0)
    b_u = b_beta * (b_v - b_Pk)
    return b_u, b_Pq + tl.sum(b_k * b_q) * b_u


@triton.jit
def _shared_fold_rows(lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, i_s, i_hv, i_hk, i_m, h, o_r, m_r,
                      o_k, m_k, b_k, b_ld, HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr,
                      K: tl.constexpr, LBCAP: tl.constexpr, IS_KDA: tl.constexpr, LP: tl.constexpr):
    """Rows `o_r` (`[RC]`) of the shared design's flush, `[RC, BK]`: decode.py's fold (the
    buffered u, this token's included, newest first) on the decoded checkpoint rows."""
    o_h = i_s * LBCAP + h
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
    b_Cr = load_lp_tile(lp_data, lp_scale, lp_tscale, i_m, o_r, m_r, o_k, m_k, V, K, LP)
    if IS_KDA:
        b_S += b_Cr * tl.exp(b_sr)[None, :]
    else:
        b_S += b_Cr * tl.exp(b_sr)
    return b_S


@triton.jit
def _shared_flush(lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, head_arrive, i_s, i_hv, i_hk, i_m, i_v,
                  h, o_k, m_k, b_k, b_ld, sr_key, st, HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr,
                  K: tl.constexpr, LBCAP: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, NV: tl.constexpr,
                  IS_KDA: tl.constexpr, RC: tl.constexpr, LP: tl.constexpr, SR: tl.constexpr):
    """The shared design's flush: this program's rows folded and rewritten in the checkpoint's
    format (fp32 as is; fp16/bf16/fp8 round-to-nearest or stochastically, per row chunk); NVFP4
    by the head's last program, which folds the whole head twice from the old checkpoint (the
    amax gives the tensor scale, stored last since the old rows' decoding reads it)."""
    if LP != 4:
        for r0 in tl.static_range(0, BV, RC):
            o_r = i_v * BV + r0 + tl.arange(0, RC)
            m_r = o_r < V
            b_S = _shared_fold_rows(lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, i_s, i_hv, i_hk, i_m, h,
                                    o_r, m_r, o_k, m_k, b_k, b_ld, HV, HK, V, K, LBCAP, IS_KDA, LP)
            if LP == 0:
                tl.store(lp_data + i_m * (V * K) + o_r[:, None] * K + o_k[None, :], b_S,
                         mask=m_r[:, None] & m_k[None, :])
            elif SR:
                store_sr_rows(b_S, lp_data, lp_scale, i_m, i_hv, o_r, m_r, o_k, m_k, sr_key, st, V, K, LP)
            else:
                store_lp_rows(b_S, lp_data, lp_scale, i_m, o_r, m_r, o_k, m_k, V, K, LP)
    else:
        if last_at_head(head_arrive, i_m, NV):
            amax = tl.zeros([RC], dtype=tl.float32)
            for r0 in range(0, V, RC):
                o_r = r0 + tl.arange(0, RC)
                b_S = _shared_fold_rows(lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, i_s, i_hv, i_hk, i_m,
                                        h, o_r, o_r < V, o_k, m_k, b_k, b_ld, HV, HK, V, K, LBCAP, IS_KDA, 4)
                amax = tl.maximum(amax, tl.max(tl.where(b_S == b_S, tl.abs(b_S), float("inf")), axis=1))
            ts = nvfp4_tensor_scale(tl.max(amax, axis=0))
            for r0 in range(0, V, RC):
                o_r = r0 + tl.arange(0, RC)
                b_S = _shared_fold_rows(lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, i_s, i_hv, i_hk, i_m,
                                        h, o_r, o_r < V, o_k, m_k, b_k, b_ld, HV, HK, V, K, LBCAP, IS_KDA, 4)
                tl.debug_barrier()      # every thread has read these rows before they are overwritten
                store_nvfp4_rows(b_S, ts, lp_data, lp_scale, i_m, i_hv, o_r, o_r < V, o_k, sr_key, st, V, K,
                                 BK, RC, SR)
            tl.debug_barrier()
            tl.store(lp_tscale + i_m, ts)


@triton.jit
def _lowp_row(
    q, k, v, a, b, A_log, dt_bias, o,
    ckpt, hp_scale, sr_key, lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, buf_v, buf_beta,
    cursor, epoch, arrive, head_arrive,
    scale,
    stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
    stride_a_b, stride_a_h, stride_b_b, stride_b_h,
    pid, i_b, i_s, h,
    HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
    LBCAP: tl.constexpr, LB: tl.constexpr, WINDOW: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    IS_KDA: tl.constexpr, USE_QK_L2NORM: tl.constexpr, EXACT_BF16: tl.constexpr, RC: tl.constexpr,
    LP: tl.constexpr, HP: tl.constexpr, SHARED: tl.constexpr, SR: tl.constexpr, HAND_OFF: tl.constexpr,
):
    """Row `i_b` (slot `i_s` >= 0, cursor `h`) of the step, V-block `pid % NV` of value head
    `pid // NV`: everything it reads and writes; the cursor's move only with HAND_OFF."""
    NV: tl.constexpr = (V + BV - 1) // BV
    HG: tl.constexpr = HV // HK
    i_v = pid % NV
    i_hv = pid // NV
    i_hk = i_hv // HG

    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    p_o = o + (i_b * HV + i_hv) * V + o_v
    h = h.to(tl.int64)
    i_m = i_s * HV + i_hv                                   # this head's matrix in the pool
    p_Ch = ckpt + i_m * (V * K)

    b_q, b_k = _load_qk(q, k, i_b, i_hk, o_k, m_k, scale, stride_q_b, stride_q_h, stride_k_b,
                        stride_k_h, USE_QK_L2NORM)
    b_v, b_ld, b_beta = _load_head(v, a, b, A_log, dt_bias, i_b, i_hv, o_v, m_v, o_k, m_k,
                                   stride_v_b, stride_v_h, stride_a_b, stride_a_h,
                                   stride_b_b, stride_b_h, K, IS_KDA)
    flush = h + 1 >= WINDOW
    if SHARED:
        # one checkpoint (the lp_* arguments are its parts): every step outputs from it as the
        # non-flush steps below do, and a flush folds the buffered u into it (no raw records)
        b_u, b_o = _output_only(lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, i_s, i_hv, i_hk, i_m, h,
                                o_v, m_v, o_k, m_k, b_q, b_k, b_v, b_ld, b_beta, HV, HK, V, K, LBCAP, LB,
                                IS_KDA, LP)
        tl.store(p_o, _for_store(b_o, p_o, EXACT_BF16), mask=m_v)
        # the record at h, on a flush too (the fold reads this token's u back by row chunks);
        # h < LBCAP guards other slots against a bad cursor
        in_buf = h < LBCAP
        n_v = tl.where(in_buf, V, 0)
        n_k = tl.where(in_buf, K, 0)
        o_h = i_s * LBCAP + h
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
            # this token's u visible to every thread, and the tile read before it is rewritten
            tl.debug_barrier()
            st = i_s * 4294967296 + tl.load(epoch + i_s)
            _shared_flush(lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, head_arrive, i_s, i_hv, i_hk, i_m,
                          i_v, h, o_k, m_k, b_k, b_ld, sr_key, st, HV, HK, V, K, LBCAP, BV, BK, NV, IS_KDA, RC,
                          LP, SR)
    elif flush:
        # the stochastic-rounding stream of this write: slot and write count, as pool._write
        st = i_s * 4294967296 + tl.load(epoch + i_s)
        _hp_flush(p_Ch, o, v, buf_ld, buf_k, buf_v, buf_beta, i_s, i_b, i_hv, i_hk, i_v, h,
                  i_m, b_q, b_k, b_ld, b_beta, o_k, m_k, lp_data, lp_scale, stride_v_b, stride_v_h,
                  ckpt, hp_scale, sr_key, st, HV, HK, V, K, LBCAP, BV, IS_KDA, RC, LP, HP)
        if LP == 4:
            # release this program's rows; the head's last program encodes the whole matrix
            if last_at_head(head_arrive, i_m, NV):
                store_nvfp4_head(p_Ch, lp_data, lp_scale, lp_tscale, i_m, V, K, BK, RC)
    else:
        # the output-only step of decode.py on the decoded LP tile
        b_u, b_o = _output_only(lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, i_s, i_hv, i_hk, i_m, h,
                                o_v, m_v, o_k, m_k, b_q, b_k, b_v, b_ld, b_beta, HV, HK, V, K, LBCAP, LB,
                                IS_KDA, LP)
        tl.store(p_o, _for_store(b_o, p_o, EXACT_BF16), mask=m_v)

        # record h: u (from C_LP, for the outputs of this window) and the raw v, beta (for the
        # HP refold at the flush); decay once per value head, key once per key head
        o_h = i_s * LBCAP + h
        p_w = buf_w + (o_h * HV + i_hv) * V + o_v
        tl.store(p_w, _for_store(b_u, p_w, EXACT_BF16), mask=m_v)
        p_vr = buf_v + (o_h * HV + i_hv) * V + o_v
        tl.store(p_vr, _for_store(b_v, p_vr, EXACT_BF16), mask=m_v)
        if i_v == 0:
            tl.store(buf_beta + o_h * HV + i_hv, b_beta)
            if IS_KDA:
                tl.store(buf_ld + (o_h * HV + i_hv) * K + o_k, b_ld, mask=m_k)
            else:
                tl.store(buf_ld + o_h * HV + i_hv, b_ld)
            if i_hv % HG == 0:
                p_kh = buf_k + (o_h * HK + i_hk) * K + o_k
                tl.store(p_kh, _for_store(b_k, p_kh, EXACT_BF16), mask=m_k)

    if HAND_OFF:
        hand_off(arrive, cursor, epoch, i_s, h, flush, HV * NV)


@triton.jit
def _lowp_decode_kernel(
    q, k, v, a, b, A_log, dt_bias, o,
    ckpt, hp_scale, sr_key, lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, buf_v, buf_beta,
    cursor, epoch, arrive, head_arrive, slot_ids,
    scale,
    stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
    stride_a_b, stride_a_h, stride_b_b, stride_b_h,
    n_rows,
    HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
    LBCAP: tl.constexpr, LB: tl.constexpr, WINDOW: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    IS_KDA: tl.constexpr, USE_QK_L2NORM: tl.constexpr, EXACT_BF16: tl.constexpr, RC: tl.constexpr,
    LP: tl.constexpr, HP: tl.constexpr, SHARED: tl.constexpr = False, SR: tl.constexpr = True,
    ROWS: tl.constexpr = 0, BT: tl.constexpr = 16,
):
    NV: tl.constexpr = (V + BV - 1) // BV
    # ROWS 0: grid (HV * NV, Bt), V-block fastest: a program owns V-block i_v of value head
    # i_hv of row i_b, every row.
    # ROWS 1 (launch 1 of two, gluon_lowp.py): grid (G,); the rows that flush, without the
    # cursor's move: their (row, head, V-block) items, item t (the row's rank among the flush
    # rows, in row order, times HV * NV, plus the program's index in ROWS 0) by program t mod G.
    # ROWS 2 (launch 2's contract in Triton, for the interpreter's tests of the split): every
    # other row in full; a flush row only moves the cursor, after every program has read it.
    if ROWS == 1:
        NP: tl.constexpr = HV * NV
        j = tl.program_id(0)
        G = tl.num_programs(0)
        seen = 0                                            # flush rows in the chunks before
        for c0 in range(0, n_rows, BT):
            o_b, b_sl, b_h, b_fl, b_rank, n_fl = flush_rows_chunk(slot_ids, cursor, c0, n_rows, seen, WINDOW, BT)
            t_lo = seen * NP
            t0 = t_lo + ((j - t_lo) % G + G) % G            # this program's first item of the chunk
            for t in range(t0, (seen + n_fl) * NP, G):
                i_b, i_s, h = flush_item_row(o_b, b_sl, b_h, b_fl, b_rank, t, NP)
                _lowp_row(q, k, v, a, b, A_log, dt_bias, o, ckpt, hp_scale, sr_key, lp_data, lp_scale, lp_tscale,
                          buf_ld, buf_w, buf_k, buf_v, buf_beta, cursor, epoch, arrive, head_arrive, scale,
                          stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h, stride_a_b,
                          stride_a_h, stride_b_b, stride_b_h, t % NP, i_b, i_s, h, HV, HK, V, K, LBCAP, LB, WINDOW,
                          BV, BK, IS_KDA, USE_QK_L2NORM, EXACT_BF16, RC, LP, HP, SHARED, SR, False)
            seen += n_fl
    else:
        i_b = tl.program_id(1).to(tl.int64)
        i_s = tl.load(slot_ids + i_b).to(tl.int64)
        if i_s < 0:
            o_v = (tl.program_id(0) % NV) * BV + tl.arange(0, BV)
            p_o = o + (i_b * HV + tl.program_id(0) // NV) * V + o_v
            tl.store(p_o, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty), mask=o_v < V)
            return
        h = tl.load(cursor + i_s).to(tl.int64)
        if ROWS == 2:
            if h + 1 >= WINDOW:
                hand_off(arrive, cursor, epoch, i_s, h, True, HV * NV)
            else:
                _lowp_row(q, k, v, a, b, A_log, dt_bias, o, ckpt, hp_scale, sr_key, lp_data, lp_scale, lp_tscale,
                          buf_ld, buf_w, buf_k, buf_v, buf_beta, cursor, epoch, arrive, head_arrive, scale,
                          stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h, stride_a_b,
                          stride_a_h, stride_b_b, stride_b_h, tl.program_id(0), i_b, i_s, h, HV, HK, V, K, LBCAP,
                          LB, WINDOW, BV, BK, IS_KDA, USE_QK_L2NORM, EXACT_BF16, RC, LP, HP, SHARED, SR, True)
        else:
            _lowp_row(q, k, v, a, b, A_log, dt_bias, o, ckpt, hp_scale, sr_key, lp_data, lp_scale, lp_tscale,
                      buf_ld, buf_w, buf_k, buf_v, buf_beta, cursor, epoch, arrive, head_arrive, scale,
                      stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h, stride_a_b,
                      stride_a_h, stride_b_b, stride_b_h, tl.program_id(0), i_b, i_s, h, HV, HK, V, K, LBCAP,
                      LB, WINDOW, BV, BK, IS_KDA, USE_QK_L2NORM, EXACT_BF16, RC, LP, HP, SHARED, SR, True)


def lowp_decode(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                dt_bias: Tensor, scale: Optional[float], ckpt, ckpt_lp: Optional[dict], lp_format: Optional[str],
                buf_ld: Tensor, buf_w: Tensor, buf_k: Tensor, buf_v: Optional[Tensor], buf_beta: Optional[Tensor],
                cursor: Tensor, epoch: Tensor, slot_ids: Tensor, window: int,
                out: Optional[Tensor] = None, use_qk_l2norm: bool = True, *, family: str = "gdn",
                arrive: Optional[Tensor] = None, config: Optional[dict] = None,
                validate: bool = True, hp_format: str = "fp32", seed: int = 0,
                hp_rounding: str = "stochastic") -> Tensor:
    """One GDN (`family="gdn"`) or KDA (`"kda"`) standard decode step on two checkpoints (or
    the shared design's one), in place; returns `out` `[Bt, HV, V]`.

    Arguments as :func:`replayssm.ops.gdn.replay_decode` (KDA: `a` `[Bt, HV, K]`, `dt_bias`
    `[HV, K]`, `buf_ld` `[N, Lb, HV, K]`), plus: `ckpt` `[N, HV, V, K]` fp32, the
    high-precision checkpoint, read and written on flush steps; `ckpt_lp`, the low-precision
    checkpoint's parts (`replayssm.formats.allocate(lp_format, [N, HV, V, K])`), read by the
    other steps and rewritten round-to-nearest on a flush; `lp_format` one of `LP_FORMATS`;
    `buf_v` `[N, Lb, HV, V]` (record dtype) and `buf_beta` `[N, Lb, HV]` fp32, the raw records
    from which a flush recomputes `u` along the HP path. `config`: `BV`, `num_warps`, and the
    split of a step (`lowp.lowp_config`, `gluon` True unless the caller says):
    on CUDA with `gluon` the flush rows on this kernel, then the steady rows on the Gluon kernel
    of gluon_lowp.py where it covers the read format and shape; `split` the same two launches
    with this kernel twice (the interpreter's test of the split).
    `hp_format` fp16, bf16 or fp8_e4m3: `ckpt` is a dict of its parts, decoded by the flush and
    rewritten with seeded stochastic rounding (`formats.encode(S, hp_format, "stochastic",
    seed=seed, stream=slot * 2**32 + epoch)` bit for bit); the LP copy must not be nvfp4.
    The shared design: `ckpt_lp`, `lp_format` (and `buf_v`, `buf_beta`) None, one checkpoint in
    `hp_format`, one of `SHARED_FORMATS` (NVFP4 too), from which every step outputs as the
    non-flush steps above do; a flush folds the buffered `u` into it (nothing to recompute: they
    came from it) and rewrites it with `hp_rounding` ("stochastic", seeded as above, or
    "nearest"), bit for bit `formats.encode(S, hp_format, hp_rounding, ...)` of the fp32 fold.
    An fp32 `ckpt` there is that fold unrounded (the same kernel's arithmetic, for comparisons).
    Window 1 flushes every row (the eager step), folding the records it holds (cursor < Lb).
    """
    if family not in ("gdn", "kda"):
        raise ValueError(f"family must be 'gdn' or 'kda', got {family!r}")
    shared = ckpt_lp is None and lp_format is None
    hp_parts = ckpt
    if isinstance(ckpt, dict):
        hp = ckpt.get("data")
        # the checks below see an fp32 stand-in of the logical shape (the *_args helpers check the parts)
        if validate and isinstance(hp, Tensor) and hp.dim() == 4:
            ckpt = torch.empty((*hp.shape[:3], k.shape[-1]), dtype=torch.float32, device=hp.device)
        else:
            ckpt = hp
    if validate:
        Bt, Hk, K, HV, V = check_token_inputs(family, q, k, v, a, b, A_log, dt_bias, out)
        if arrive is None:
            arrive = arrive_counter(ckpt.device, ckpt.shape[0]) if isinstance(ckpt, Tensor) \
                and ckpt.dim() == 4 else None
        N, Lb = check_state(family, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive,
                            HV, Hk, V, K, window)
        if not shared:
            check_tensor("buf_v", buf_v, (N, Lb, HV, V), (buf_w.dtype,), contiguous=True)
            check_tensor("buf_beta", buf_beta, (N, Lb, HV), (torch.float32,), contiguous=True)
        check_slot_ids(slot_ids, Bt)
        check_devices(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ckpt=ckpt,
                      buf_ld=buf_ld, buf_w=buf_w, buf_k=buf_k, buf_v=buf_v, buf_beta=buf_beta,
                      cursor=cursor, epoch=epoch, arrive=arrive, slot_ids=slot_ids, out=out)
        check_slot_values(slot_ids, N)
        check_cursor_values(cursor, slot_ids, Lb, window)
    N, HV, V = ckpt.shape[:3]
    Bt, Hk, K = q.shape
    LBCAP = buf_w.shape[1]
    if shared:
        ck = shared_args(hp_parts, hp_format, hp_rounding, seed, N, HV, V, K)
    else:
        if ckpt_lp is None or buf_v is None or buf_beta is None:
            raise ValueError("ckpt_lp, buf_v, buf_beta: two checkpoints need the copy and the raw records "
                             "(the shared design: ckpt_lp and lp_format None)")
        if hp_format != "fp32" and hp_rounding != "stochastic":
            raise ValueError(f"hp_rounding {hp_rounding!r}: beside a low-precision copy a {hp_format} checkpoint "
                             "is written with stochastic rounding only")
        ck = dict(checkpoint_args(hp_parts, ckpt_lp, lp_format, hp_format, seed, N, HV, V, K), SR=1)
    cfg = lowp_config(V, config, split=True)
    BV = cfg["BV"]
    scale = _scale(scale, K)
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if arrive is None:
        arrive = arrive_counter(ckpt.device, N)
    if Bt == 0:
        return out
    # record tiles cover positions below the window (window 1: whatever the buffer holds)
    npos = LBCAP if window == 1 else min(window, LBCAP)
    nv = triton.cdiv(V, BV)
    args = dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, o=out,
                ckpt=ck["ckpt"], hp_scale=ck["hp_scale"], sr_key=ck["sr_key"], lp_data=ck["lp_data"],
                lp_scale=ck["lp_scale"], lp_tscale=ck["lp_tscale"], buf_ld=buf_ld, buf_w=buf_w, buf_k=buf_k,
                buf_v=buf_v, buf_beta=buf_beta, cursor=cursor, epoch=epoch, arrive=arrive,
                head_arrive=head_counter(ckpt.device, N * HV), slot_ids=slot_ids, scale=scale,
                stride_q_b=q.stride(0), stride_q_h=q.stride(1), stride_k_b=k.stride(0), stride_k_h=k.stride(1),
                stride_v_b=v.stride(0), stride_v_h=v.stride(1), stride_a_b=a.stride(0), stride_a_h=a.stride(1),
                stride_b_b=b.stride(0), stride_b_h=b.stride(1), n_rows=Bt,
                HV=HV, HK=Hk, V=V, K=K, LBCAP=LBCAP, LB=max(2, triton.next_power_of_2(npos)), WINDOW=int(window),
                BV=BV, BK=triton.next_power_of_2(K), IS_KDA=family == "kda",
                USE_QK_L2NORM=bool(use_qk_l2norm), EXACT_BF16=_interpreting(), RC=min(16, BV), LP=ck["LP"],
                HP=ck["HP"], SHARED=shared, SR=bool(ck["SR"]), BT=min(1024, triton.next_power_of_2(Bt)),
                num_warps=cfg["num_warps"], num_stages=1)
    gluon = use_gluon_lp(cfg, family, ck["LP"], q, V, K, int(window), LBCAP)
    if window > 1 and (gluon or cfg["split"]):
        # launch 1: the flush rows, without the cursor's move (gluon_lowp.py says why)
        _lowp_decode_kernel[(flush_programs(cfg, HV * nv * Bt, q.device),)](**args, ROWS=1)
        if gluon:
            launch_gluon_lp(q, k, v, a, b, A_log, dt_bias, scale, ck["lp_data"], ck["lp_scale"], ck["lp_tscale"],
                            ck["LP"], buf_ld, buf_w, buf_k, buf_v, buf_beta, cursor, epoch, arrive, slot_ids, out,
                            int(window), cfg["gluon_BV"], use_qk_l2norm, family, cfg["gluon_maxnreg"],
                            cfg["gluon_recmask"], cfg["gluon_kq"])
        else:
            _lowp_decode_kernel[(HV * nv, Bt)](**args, ROWS=2)
    else:
        _lowp_decode_kernel[(HV * nv, Bt)](**args, ROWS=0)
    return out
