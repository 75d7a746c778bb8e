"""Mamba-2 standard decode with separate state precisions (SPEC section 5), in Triton.

The replay decode of decode.py with two checkpoints: `ckpt` fp32 (high precision, carries the
recurrence) and `ckpt_lp` in a low-precision format (`ops/utils/lowp.py`: fp16, bf16, fp8-e4m3
with row scales, NVFP4). Per row with slot `s` and cursor `h`:

    non-flush (h + 1 < L): y from C_LP[s] (decoded in the kernel) and records 0..h; record h written
    flush:                 y from C_HP[s] and records 0..h; C_HP[s] <- REPLAY(C_HP[s], records);
                           C_LP[s] <- round-to-nearest(C_HP[s]) (formats.encode, bit for bit)

The flush is the standard kernel's arithmetic (same helpers, same order), so the fp32
checkpoint does not depend on the low-precision format. A program owns `BV` value rows of one
head: fp16/bf16/fp8 rows are encoded where they are computed (an fp8 scale is per row), while
NVFP4's one scale per head matrix needs the whole head: the head's last program to arrive
(a per-(slot, head) counter) reads the new fp32 rows back and encodes the matrix.
Window 1 (the eager step) is a flush of every row, folding the records it still holds.
The HP checkpoint may instead be fp16, bf16 or scaled fp8-e4m3 (`HP`, ops/utils/sround.py):
the flush decodes it, folds in fp32 and writes it back with seeded stochastic rounding, bit for
bit `formats.encode(S, hp, "stochastic", seed, stream=slot * 2**32 + epoch[slot])` of its fp32
fold; the LP copy is then the nearest encoding of that fold (not of the rounded HP), as the pool's.

The shared design (`ckpt_lp=None`, the comparison of issue 18) keeps one checkpoint in fp16,
bf16, fp8-e4m3 or NVFP4: every step reads it, a flush folds from it as above and writes it back
round-to-nearest or stochastically (`SR`). A shared NVFP4 head is written by its last program,
which folds the whole head from the old checkpoint (no fp32 copy holds it) twice: amax, then rows.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..utils.checks import check_window
from ..utils.cursor import hand_off
from ..utils.launch import arrive_counter
from ..utils.lowp import (LP_CODES, flush_item_row, flush_programs, flush_rows_chunk, head_counter,
                          last_at_head, load_lp_tile, lowp_config, nvfp4_stand_in, store_lp_rows,
                          store_nvfp4_head)
from ..utils.sround import (HP_CODES, SHARED_CODES, checkpoint_args, nvfp4_tensor_scale, shared_args,
                           store_nvfp4_rows, store_sr_rows)
from .common import (OPTIONAL_INPUTS, check_slots, check_state, check_tensor, check_token_inputs,
                     group_keys, head_weights, record_masks, token_decay)
from .gluon_lowp import launch_gluon_lp, use_gluon_lp

__all__ = ["lowp_decode", "LP_FORMATS", "HP_FORMATS", "SHARED_FORMATS"]

LP_FORMATS = tuple(LP_CODES)
HP_FORMATS = tuple(HP_CODES)
SHARED_FORMATS = tuple(SHARED_CODES)


@triton.jit
def _fold_rows(p_Sh, ckpt, hp_scale, lp_data, lp_scale, lp_tscale, i_m, o_r, m_r, o_k, m_k, p_x, p_w, p_kj,
               b_g, b_dt, b_kc, b_coef, o_l, h, HV: tl.constexpr, Hk: tl.constexpr, V: tl.constexpr,
               K: tl.constexpr, HP: tl.constexpr, LP: tl.constexpr):
    """Rows `o_r` (`[RC]`) of the head's flush, `[RC, BK]`: the checkpoint rows (fp32 at `p_Sh`,
    or decoded: the HP parts, NVFP4 through the LP arguments), decayed, plus the token and the
    records 0..h-1 one rank-1 update each (decode.py's arithmetic, in its order)."""
    if HP == 0:
        b_Sr = tl.load(p_Sh + (o_r[:, None] * K + o_k[None, :]), mask=m_r[:, None] & m_k[None, :], other=0.0)
    elif HP == 4:
        b_Sr = load_lp_tile(lp_data, lp_scale, lp_tscale, i_m, o_r, m_r, o_k, m_k, V, K, LP)
    else:
        b_Sr = load_lp_tile(ckpt, hp_scale, hp_scale, i_m, o_r, m_r, o_k, m_k, V, K, HP)
    b_xr = tl.load(p_x + o_r, mask=m_r, other=0.0)
    b_Sr = b_g * b_Sr + (b_dt * b_xr.to(tl.float32))[:, None] * b_kc[None, :]
    p_wj = p_w + o_r
    for j in range(0, h):
        c_j = tl.sum(tl.where(o_l == j, b_coef, 0.0), axis=0)
        w_j = tl.load(p_wj + j * (HV * V), mask=m_r, other=0.0).to(tl.float32)
        k_j = tl.load(p_kj + j * (Hk * K), mask=m_k, other=0.0).to(tl.float32)
        b_Sr += (c_j * w_j)[:, None] * k_j[None, :]
    return b_Sr


@triton.jit
def _shared_nvfp4_head(p_Sh, ckpt, hp_scale, lp_data, lp_scale, lp_tscale, i_m, i_h, o_k, m_k, p_x, p_w,
                       p_kj, b_g, b_dt, b_kc, b_coef, o_l, h, sr_key, st, HV: tl.constexpr, Hk: tl.constexpr,
                       V: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, RC: tl.constexpr,
                       SR: tl.constexpr):
    """The shared NVFP4 checkpoint's flush of one head, by its last program: the fold of every
    row twice (its amax gives the tensor scale, then the rows are encoded under it), from the old
    checkpoint, which no other program reads any more; the tensor scale is stored last, as the
    decoding of the old rows reads it."""
    amax = tl.zeros([RC], dtype=tl.float32)
    for r0 in range(0, V, RC):
        o_r = r0 + tl.arange(0, RC)
        b_Sr = _fold_rows(p_Sh, ckpt, hp_scale, lp_data, lp_scale, lp_tscale, i_m, o_r, o_r < V, o_k, m_k,
                          p_x, p_w, p_kj, b_g, b_dt, b_kc, b_coef, o_l, h, HV, Hk, V, K, 4, 4)
        amax = tl.maximum(amax, tl.max(tl.where(b_Sr == b_Sr, tl.abs(b_Sr), float("inf")), axis=1))
    ts = nvfp4_tensor_scale(tl.max(amax, axis=0))
    for r0 in range(0, V, RC):
        o_r = r0 + tl.arange(0, RC)
        b_Sr = _fold_rows(p_Sh, ckpt, hp_scale, lp_data, lp_scale, lp_tscale, i_m, o_r, o_r < V, o_k, m_k,
                          p_x, p_w, p_kj, b_g, b_dt, b_kc, b_coef, o_l, h, HV, Hk, V, K, 4, 4)
        tl.debug_barrier()          # every thread has read these rows before they are overwritten
        store_nvfp4_rows(b_Sr, ts, lp_data, lp_scale, i_m, i_h, o_r, o_r < V, o_k, sr_key, st, V, K, BK, RC, SR)
    tl.debug_barrier()
    tl.store(lp_tscale + i_m, ts)


@triton.jit
def _lowp_row(
    x, dt, B, C, A, dt_bias, D, z, out,
    ckpt, hp_scale, sr_key, lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, cursor, epoch, arrive, head_arrive,
    stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
    stride_z_b, stride_z_h, stride_o_b, stride_o_h,
    pid, i_b, slot, h,
    HV: tl.constexpr, Hk: tl.constexpr, V: tl.constexpr, K: tl.constexpr, LB: tl.constexpr,
    NPOS: tl.constexpr, WINDOW: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, BL: tl.constexpr,
    NVB: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, LP: tl.constexpr, RC: tl.constexpr,
    HP: tl.constexpr, HAS_LP: tl.constexpr, SR: tl.constexpr, HAND_OFF: tl.constexpr,
):
    """Row `i_b` (slot `slot` >= 0, cursor `h`) of the step, V-block `pid % NVB` of head
    `pid // NVB`: everything it reads and writes; the cursor's move only with HAND_OFF."""
    i_v = pid % NVB
    i_h = pid // NVB
    HG: tl.constexpr = HV // Hk
    i_g = i_h // HG

    o_v = i_v * BV + tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    o_l = tl.arange(0, BL)
    m_v = o_v < V
    m_k = o_k < K
    p_o = out + i_b * stride_o_b + i_h * stride_o_h + o_v
    m_j, m_j1, m_lj, m_lj1 = record_masks(o_l, h, NPOS, True)
    i_m = slot * HV + i_h                                   # this head's matrix in the pool
    p_S0 = ckpt + slot * (HV * V * K)
    b_kc, b_q, b_kq, b_kcq = group_keys(buf_k + slot * (LB * Hk * K) + i_g * K, Hk * K,
                                        B + i_b * stride_B_b + i_g * stride_B_g,
                                        C + i_b * stride_C_b + i_g * stride_C_g,
                                        o_l, o_k, m_k, m_j, m_lj)
    is_flush = h + 1 >= WINDOW
    # the flush reads the fp32 checkpoint (it carries the recurrence), other steps the LP copy
    if is_flush and HP == 0:
        b_S = tl.load(p_S0 + i_h * (V * K) + o_v[:, None] * K + o_k[None, :],
                      mask=m_v[:, None] & m_k[None, :], other=0.0)                  # [BV, BK]
    elif is_flush and HP != 4:
        b_S = load_lp_tile(ckpt, hp_scale, hp_scale, i_m, o_v, m_v, o_k, m_k, V, K, HP)
    else:
        # (without an LP copy lp_* are the HP parts and LP their code: the shared design)
        b_S = load_lp_tile(lp_data, lp_scale, lp_tscale, i_m, o_v, m_v, o_k, m_k, V, K, LP)
    p_Wh = buf_w + slot * (LB * HV * V) + i_h * V
    b_W = tl.load(p_Wh + (o_l[:, None] * (HV * V) + o_v[None, :]),
                  mask=m_lj[:, None] & m_v[None, :], other=0.0)
    b_W = tl.where(m_j[:, None], b_W.to(tl.float32), 0.0)                               # [BL, BV]

    b_dt, b_ld, b_rA = token_decay(dt, dt_bias, A, i_b * stride_dt_b, i_h)
    b_xi = tl.load(x + i_b * stride_x_b + i_h * stride_x_h + o_v, mask=m_v, other=0.0)
    b_x = b_xi.to(tl.float32)
    b_w = b_dt * b_x
    b_coef, b_g = head_weights(buf_ld + slot * (LB * HV) + i_h, HV, b_ld, b_rA, h, o_l, m_j, m_j1,
                               m_lj, m_lj1)

    b_y = b_g * tl.sum(b_S * b_q[None, :], axis=1)
    b_y += tl.sum(b_W * (b_coef * b_kq)[:, None], axis=0)
    b_y += b_kcq * b_w
    if HAS_D:
        b_y += tl.load(D + i_h).to(tl.float32) * b_x
    if HAS_Z:
        b_z = tl.load(z + i_b * stride_z_b + i_h * stride_z_h + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_y = b_y * b_z / (1.0 + tl.exp(-b_z))
    tl.store(p_o, b_y.to(p_o.dtype.element_ty), mask=m_v)

    if is_flush:
        # the standard kernel's fold (decode.py), row chunks of RC re-read from L2, then each
        # chunk's low-precision rows
        p_kj = buf_k + slot * (LB * Hk * K) + i_g * K + o_k
        # the stochastic-rounding stream of this write: slot and write count, as pool._write
        st = slot * 4294967296 + tl.load(epoch + slot)
        p_Sh = p_S0 + i_h * (V * K)
        p_xh = x + i_b * stride_x_b + i_h * stride_x_h
        p_wh0 = buf_w + slot * (LB * HV * V) + i_h * V
        if not HAS_LP:
            tl.debug_barrier()      # the one checkpoint: every thread has read its tile before it is rewritten
        if HP != 4:
            for r0 in tl.static_range(0, BV, RC):
                o_r = i_v * BV + r0 + tl.arange(0, RC)
                m_r = o_r < V
                b_Sr = _fold_rows(p_Sh, ckpt, hp_scale, lp_data, lp_scale, lp_tscale, i_m, o_r, m_r, o_k, m_k,
                                  p_xh, p_wh0, p_kj, b_g, b_dt, b_kc, b_coef, o_l, h, HV, Hk, V, K, HP, LP)
                if HP == 0:
                    tl.store(p_Sh + (o_r[:, None] * K + o_k[None, :]), b_Sr, mask=m_r[:, None] & m_k[None, :])
                elif SR:
                    store_sr_rows(b_Sr, ckpt, hp_scale, i_m, i_h, o_r, m_r, o_k, m_k, sr_key, st, V, K, HP)
                else:
                    store_lp_rows(b_Sr, ckpt, hp_scale, i_m, o_r, m_r, o_k, m_k, V, K, HP)
                if HAS_LP and LP != 4:
                    store_lp_rows(b_Sr, lp_data, lp_scale, i_m, o_r, m_r, o_k, m_k, V, K, LP)
        if HAS_LP and LP == 4:
            # release this program's rows; the head's last program encodes the whole matrix
            if last_at_head(head_arrive, i_m, NVB):
                store_nvfp4_head(p_S0 + i_h * (V * K), lp_data, lp_scale, lp_tscale, i_m, V, K, BK, RC)
        if HP == 4:
            # the shared NVFP4 checkpoint: its scale per head needs the whole fold, which the
            # head's last program recomputes from the old checkpoint
            if last_at_head(head_arrive, i_m, NVB):
                _shared_nvfp4_head(p_Sh, ckpt, hp_scale, lp_data, lp_scale, lp_tscale, i_m, i_h, o_k, m_k, p_xh,
                                   p_wh0, p_kj, b_g, b_dt, b_kc, b_coef, o_l, h, sr_key, st, HV, Hk, V, K, BK,
                                   RC, SR)
    else:
        p_wh = buf_w + slot * (LB * HV * V) + h * (HV * V) + i_h * V + o_v
        tl.store(p_wh, b_xi.to(p_wh.dtype.element_ty), mask=m_v)
        if i_v == 0:
            tl.store(buf_ld + slot * (LB * HV) + h * HV + i_h, b_ld)
            if i_h % HG == 0:
                p_kh = buf_k + slot * (LB * Hk * K) + h * (Hk * K) + i_g * K + o_k
                tl.store(p_kh, b_kc.to(p_kh.dtype.element_ty), mask=m_k)

    if HAND_OFF:
        hand_off(arrive, cursor, epoch, slot, h, is_flush, HV * NVB)


@triton.heuristics(OPTIONAL_INPUTS)
@triton.jit
def _lowp_decode_kernel(
    x, dt, B, C, A, dt_bias, D, z, out,
    ckpt, hp_scale, sr_key, lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, cursor, epoch, arrive, head_arrive,
    stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
    stride_z_b, stride_z_h, stride_o_b, stride_o_h,
    slot_ids, n_rows,
    HV: tl.constexpr, Hk: tl.constexpr, V: tl.constexpr, K: tl.constexpr, LB: tl.constexpr,
    NPOS: tl.constexpr, WINDOW: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, BL: tl.constexpr,
    NVB: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, LP: tl.constexpr, RC: tl.constexpr,
    HP: tl.constexpr, HAS_LP: tl.constexpr, SR: tl.constexpr, ROWS: tl.constexpr, BT: tl.constexpr,
):
    # ROWS 0: grid (HV * NVB, Bt), a program owns V-block i_v of head i_h of row i_b, all rows.
    # ROWS 1 (launch 1 of two, gluon_lowp.py): grid (G,); the rows that flush, without the
    # cursor's move: their (row, head, V-block) items, item t (the row's rank among the flush
    # rows, in row order, times HV * NVB, plus the program's index in ROWS 0) by program t mod G.
    # ROWS 2 (launch 2's contract in Triton, for the interpreter's tests of the split): every
    # other row in full; a flush row only moves the cursor, after every program has read it.
    if ROWS == 1:
        NP: tl.constexpr = HV * NVB
        j = tl.program_id(0)
        G = tl.num_programs(0)
        seen = 0                                            # flush rows in the chunks before
        for c0 in range(0, n_rows, BT):
            o_b, b_sl, b_h, b_fl, b_rank, n_fl = flush_rows_chunk(slot_ids, cursor, c0, n_rows, seen, WINDOW, BT)
            t_lo = seen * NP
            t0 = t_lo + ((j - t_lo) % G + G) % G            # this program's first item of the chunk
            for t in range(t0, (seen + n_fl) * NP, G):
                i_b, slot, h = flush_item_row(o_b, b_sl, b_h, b_fl, b_rank, t, NP)
                _lowp_row(x, dt, B, C, A, dt_bias, D, z, out, ckpt, hp_scale, sr_key, lp_data, lp_scale,
                          lp_tscale, buf_ld, buf_w, buf_k, cursor, epoch, arrive, head_arrive, stride_x_b,
                          stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g, stride_z_b,
                          stride_z_h, stride_o_b, stride_o_h, t % NP, i_b, slot, h, HV, Hk, V, K, LB, NPOS,
                          WINDOW, BV, BK, BL, NVB, HAS_D, HAS_Z, LP, RC, HP, HAS_LP, SR, False)
            seen += n_fl
    else:
        i_b = tl.program_id(1).to(tl.int64)
        o_v = (tl.program_id(0) % NVB) * BV + tl.arange(0, BV)
        slot = tl.load(slot_ids + i_b).to(tl.int64)
        if slot < 0:
            p_o = out + i_b * stride_o_b + (tl.program_id(0) // NVB) * stride_o_h + o_v
            tl.store(p_o, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty), mask=o_v < V)
            return
        h = tl.load(cursor + slot)
        if ROWS == 2:
            if h + 1 >= WINDOW:
                hand_off(arrive, cursor, epoch, slot, h, True, HV * NVB)
            else:
                _lowp_row(x, dt, B, C, A, dt_bias, D, z, out, ckpt, hp_scale, sr_key, lp_data, lp_scale,
                          lp_tscale, buf_ld, buf_w, buf_k, cursor, epoch, arrive, head_arrive, stride_x_b,
                          stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g, stride_z_b,
                          stride_z_h, stride_o_b, stride_o_h, tl.program_id(0), i_b, slot, h, HV, Hk, V, K,
                          LB, NPOS, WINDOW, BV, BK, BL, NVB, HAS_D, HAS_Z, LP, RC, HP, HAS_LP, SR, True)
        else:
            _lowp_row(x, dt, B, C, A, dt_bias, D, z, out, ckpt, hp_scale, sr_key, lp_data, lp_scale,
                      lp_tscale, buf_ld, buf_w, buf_k, cursor, epoch, arrive, head_arrive, stride_x_b,
                      stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g, stride_z_b,
                      stride_z_h, stride_o_b, stride_o_h, tl.program_id(0), i_b, slot, h, HV, Hk, V, K, LB,
                      NPOS, WINDOW, BV, BK, BL, NVB, HAS_D, HAS_Z, LP, RC, HP, HAS_LP, SR, True)


def lowp_decode(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, dt_bias: Tensor,
                D: Optional[Tensor], z: Optional[Tensor], ckpt, ckpt_lp: Optional[dict],
                lp_format: Optional[str],
                buf_ld: Tensor, buf_w: Tensor, buf_k: Tensor, cursor: Tensor, epoch: Tensor,
                slot_ids: Tensor, window: int, out: Optional[Tensor] = None, *,
                arrive: Optional[Tensor] = None, config: Optional[dict] = None,
                validate: bool = True, hp_format: str = "fp32", seed: int = 0,
                hp_rounding: str = "stochastic") -> Tensor:
    """One Mamba-2 standard decode step on two checkpoints (or the shared design's one), in place;
    returns `y` `[Bt, HV, V]`.

    Arguments as :func:`replayssm.ops.mamba2.replay_decode` (token inputs `x` `[Bt, HV, V]`,
    `dt` `[Bt, HV]`, `B`, `C` `[Bt, Hk, K]`, `z` or None; `A`, `dt_bias`, `D` `[HV]`; records,
    `cursor`, `epoch`, `slot_ids`, `window`, `out`, `arrive`, `validate`), plus:
    `ckpt` `[N, HV, V, K]` fp32, the high-precision checkpoint, read and written on flush steps;
    `ckpt_lp`, the low-precision checkpoint's parts (`replayssm.formats.allocate(lp_format,
    [N, HV, V, K])`), read by the other steps and rewritten round-to-nearest on a flush;
    `lp_format` one of `LP_FORMATS`. `config`: `BV` (power of two), `num_warps`.
    `hp_format` one of `HP_FORMATS`: other than fp32, `ckpt` is a dict of its parts
    (`formats.allocate`), decoded by the flush and rewritten with seeded stochastic rounding
    (`formats.encode(S, hp_format, "stochastic", seed=seed, stream=slot * 2**32 + epoch)` bit
    for bit); an nvfp4 copy needs an fp32 HP.
    The shared design: `ckpt_lp` and `lp_format` None, one checkpoint in `hp_format`, one of
    `SHARED_FORMATS` (NVFP4 too), read by every step and rewritten by a flush with
    `hp_rounding` ("stochastic", seeded as above, or "nearest"): bit for bit
    `formats.encode(S, hp_format, hp_rounding, ...)` of the flush's fp32 fold. An fp32 `ckpt`
    there is that fold unrounded (the same kernel's arithmetic, for comparisons).
    Window 1 flushes every row (the eager step), folding the records it holds (cursor < Lb).
    """
    hp = ckpt.get("data") if isinstance(ckpt, dict) else ckpt
    N, HV, V = hp.shape[:3] if isinstance(hp, Tensor) and hp.dim() == 4 else (0, 0, 0)
    K = B.shape[-1] if isinstance(B, Tensor) and B.dim() == 3 else 0
    shared = ckpt_lp is None and lp_format is None
    if validate:
        Bt, HV, V, Hk, K = check_token_inputs(x, dt, B, C, A, dt_bias, D, z)
        dev = x.device
        if shared and hp_format == "nvfp4":
            hp = nvfp4_stand_in(hp, K)
        N, Lb = check_state(hp, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids, Bt=Bt, HV=HV, V=V,
                            Hk=Hk, K=K, device=dev, ckpt_dtypes=(getattr(hp, "dtype", None),))
        if out is not None:
            check_tensor("out", out, (Bt, HV, V), (x.dtype,), dev, inner=True)
        check_window(window, Lb)
        check_slots(slot_ids, N)
    if shared:
        ck = shared_args(ckpt, hp_format, hp_rounding, seed, N, HV, V, K)
    else:
        # two checkpoints: a narrow HP is written with stochastic rounding only
        if hp_format != "fp32" and hp_rounding != "stochastic":
            raise ValueError(f"hp_rounding {hp_rounding!r}: beside a low-precision copy a {hp_format} checkpoint "
                             "is written with stochastic rounding only")
        ck = dict(checkpoint_args(ckpt, ckpt_lp, lp_format, hp_format, seed, N, HV, V, K), SR=1)
    cfg = lowp_config(V, config, split=True)
    BV = cfg["BV"]
    if out is None:
        out = torch.empty_like(x)
    if arrive is None:
        arrive = arrive_counter(x.device, N)
    Bt = x.shape[0]
    if Bt == 0:
        return out
    Hk, LB = B.shape[1], buf_ld.shape[1]
    # records cover positions below the window (window 1: whatever the buffer holds)
    npos = LB if window == 1 else min(window, LB)
    nvb = triton.cdiv(V, BV)
    args = dict(x=x, dt=dt, B=B, C=C, A=A, dt_bias=dt_bias, D=D, z=z, out=out, **ck,
                buf_ld=buf_ld, buf_w=buf_w, buf_k=buf_k,
                cursor=cursor, epoch=epoch, arrive=arrive, head_arrive=head_counter(x.device, N * HV),
                slot_ids=slot_ids, n_rows=Bt,
                stride_x_b=x.stride(0), stride_x_h=x.stride(1), stride_dt_b=dt.stride(0),
                stride_B_b=B.stride(0), stride_B_g=B.stride(1), stride_C_b=C.stride(0), stride_C_g=C.stride(1),
                stride_z_b=z.stride(0) if z is not None else 0, stride_z_h=z.stride(1) if z is not None else 0,
                stride_o_b=out.stride(0), stride_o_h=out.stride(1),
                HV=HV, Hk=Hk, V=V, K=K, LB=LB, NPOS=npos, WINDOW=int(window), BV=BV,
                BK=triton.next_power_of_2(K), BL=max(16, triton.next_power_of_2(npos)), NVB=nvb,
                RC=min(16, BV), BT=min(1024, triton.next_power_of_2(Bt)), num_warps=cfg["num_warps"], num_stages=1)
    gluon = use_gluon_lp(cfg, ck["LP"], x, V, K, int(window), LB)
    if window > 1 and (gluon or cfg["split"]):
        # launch 1: the flush rows, without the cursor's move (gluon_lowp.py says why)
        _lowp_decode_kernel[(flush_programs(cfg, HV * nvb * Bt, x.device),)](**args, ROWS=1)
        if gluon:
            launch_gluon_lp(x, dt, B, C, A, dt_bias, D, z, ck["lp_data"], ck["lp_scale"], ck["lp_tscale"],
                            ck["LP"], buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids, out, int(window),
                            cfg["gluon_BV"], cfg["gluon_maxnreg"], cfg["gluon_recmask"], cfg["gluon_kq"])
        else:
            _lowp_decode_kernel[(HV * nvb, Bt)](**args, ROWS=2)
    else:
        _lowp_decode_kernel[(HV * nvb, Bt)](**args, ROWS=0)
    return out
