"""Mamba-2 speculative verification with separate state precisions (SPEC sections 4 and 5,
Algorithm 3), in Triton.

The verify step of verify.py on two checkpoints: `ckpt` (high precision: fp32, or fp16, bf16,
scaled fp8-e4m3 written with seeded stochastic rounding, ops/utils/sround.py) and `ckpt_lp`
(fp16, bf16, fp8-e4m3 or NVFP4, round-to-nearest, ops/utils/lowp.py). Per row with slot `s`,
cursor `h` and `n` drafts:

    h + n <= L:  the drafts' outputs from C_LP[s] (decoded in the kernel) and records 0..h-1
    h + n > L:   S <- REPLAY(C_HP[s], records 0..h-1) in fp32 (verify.py's fold, the same
                 arithmetic); C_HP[s] <- S (fp32, or stochastic rounding bit for bit
                 `formats.encode(S, hp, "stochastic", seed, stream=s * 2**32 + epoch[s])`),
                 C_LP[s] <- round-to-nearest(S); the drafts' outputs from S itself

The drafts' records go behind the cursor as verify.py writes them, so `commit` is unchanged.
Without an LP copy (`ckpt_lp` None: a pool whose one checkpoint is fp16, bf16, fp8 or NVFP4,
the shared design) the drafts of a non-flush row read the HP parts, and a flush writes those
alone (`HP_SR` False: round-to-nearest instead of stochastic rounding). NVFP4's scale per head
matrix needs the whole head: as in precision.py, the head's last program to arrive (a
per-(slot, head) counter) reads the new fp32 rows back and encodes the matrix; a shared NVFP4
checkpoint has no fp32 rows to read back, so that program folds the head's rows again from the
old checkpoint (twice: their amax gives the tensor scale, then they are encoded under it) and
writes the head's draft values behind them, which the other programs leave to it, as those
positions still hold the records of the refold.

A program owns `BV` value rows of one head as a plain `[BV, BK]` tile (the layout the LP
decoder returns) and serves the T drafts with one matrix-vector product each, as verify.py's
row-dot kernel; no tensor-core variant. On the GPU an fp16 or bf16 copy beside an fp32
checkpoint takes the Gluon verify kernel instead (gluon_verify.py, `lp_code`: the copy's tile
staged in place of the fp32 one on rows without a flush). H100, Nemotron-3-Super's shape, batch
256, window 16, every row's cursor pinned, over a conventional step: rows without a flush 0.44x
(T = 4) and 0.59x (T = 8) against 0.63x and 0.75x for the fp32 pool's verify, rows that flush
1.35x and 1.41x against 1.12x and 1.20x (the copy written besides); this Triton kernel took
4.8-9.3x and 9.2-12.4x there. Nano-4B's shape, staggered rows (verify_lp_nano_h100.json): 0.78-1.37x
a conventional step against the fp32 pool's 0.83-1.27x, this kernel 5.5-12x.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..utils.checks import check_window
from ..utils.cursor import verify_hand_off
from ..utils.launch import arrive_counter, gluon_aligned, slot_pads
from ..utils.lowp import (LP_CODES, head_counter, last_at_head, load_lp_tile, lowp_config, nvfp4_stand_in,
                          store_lp_rows, store_nvfp4_head)
from ..utils.sround import (HP_CODES, checkpoint_args, nvfp4_tensor_scale, shared_args, store_nvfp4_rows,
                            store_sr_rows)
from .common import (OPTIONAL_INPUTS, check_slots, check_state, check_tensor, draft_decays, given,
                     verify_row_bounds, write_shared_drafts)
from .gluon_verify import HAVE_GLUON, launch_gluon_verify
from .verify import _check_verify_inputs, _interpreting, verify_config

__all__ = ["lowp_verify", "verify_lp_config"]

# the Gluon kernel's program sizes whose copy reads have run against the reference on a GPU
# (`test_verify_lp_gluon_real_shapes_gpu`: Super's 64-row programs, Nano-4B's 16-row ones with
# `kq`, on the H100)
GLUON_LP_BV = (16, 64)


def verify_lp_config(V: int, config: Optional[dict] = None) -> dict:
    """The launch config (`BV` value rows per program, a power of two; `num_warps`) with a
    caller's overrides: 16 rows at most and at least two programs per head, 8 warps. Chosen
    offline from sm_90a compiles under Triton 3.6 (Super and Nano-4B, T = 1..8, every copy and
    HP format: 94-128 registers, no spill; 4 warps take up to 255 and spill an fp8 HP's
    stochastic rounding at Nano-4B's 80 rows), not timed on a GPU."""
    return lowp_config(V, dict({"BV": min(16, max(1, triton.next_power_of_2(V) // 2)), "num_warps": 8},
                               **(config or {})))


@triton.jit
def _fold_weights(b_ldc, b_sfx, b_rA, m_l):
    """The early flush's weight of each committed record (its suffix's decay times its dt) and
    the checkpoint's decay over them all."""
    return tl.where(m_l, tl.exp(b_sfx) * (b_ldc * b_rA), 0.0), tl.exp(tl.sum(b_ldc, axis=0))


@triton.jit
def _fold_records(b_S, b_cf, b_gL, p_wb, p_kb, o_r, m_r, o_k, m_k, o_l, h,
                  HV: tl.constexpr, Hk: tl.constexpr, V: tl.constexpr, K: tl.constexpr):
    """Rows `o_r` of a checkpoint (`b_S`) after the committed records `0..h-1`, verify.py's fold:
    one exact fp32 rank-1 update per record, so that an fp32 HP checkpoint does not depend on the
    LP format, and a shared NVFP4 head's refold gives each row the values its program folded."""
    b_S = b_S * b_gL
    for j in range(0, h):
        c_j = tl.sum(tl.where(o_l == j, b_cf, 0.0), axis=0)
        w_j = tl.load(p_wb + j * (HV * V) + o_r, mask=m_r, other=0.0).to(tl.float32)
        k_j = tl.load(p_kb + j * (Hk * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_S += (c_j * w_j)[:, None] * k_j[None, :]
    return b_S


@triton.jit
def _shared_nvfp4_flush_head(lp_data, lp_scale, lp_tscale, i_m, i_h, o_k, m_k, p_wb, p_kb, b_ldc, b_sfx, b_rA, m_l,
                             o_l, h, p_xd, stride_x_t, o_t, m_t, sr_key, st, HV: tl.constexpr, Hk: tl.constexpr,
                             V: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, RC: tl.constexpr,
                             SR: tl.constexpr):
    """The early flush of one head of a shared NVFP4 checkpoint, by the head's last program:
    the refold's amax gives the tensor scale, the rows are refolded and encoded under it (each
    chunk read before it is overwritten), the tensor scale is stored last (the old rows decode
    with the old one), and then the head's draft values go to positions 0..n-1."""
    b_cf, b_gL = _fold_weights(b_ldc, b_sfx, b_rA, m_l)
    amax = tl.zeros([RC], dtype=tl.float32)
    for r0 in range(0, V, RC):
        o_r = r0 + tl.arange(0, RC)
        b_S = load_lp_tile(lp_data, lp_scale, lp_tscale, i_m, o_r, o_r < V, o_k, m_k, V, K, 4)
        b_S = _fold_records(b_S, b_cf, b_gL, p_wb, p_kb, o_r, o_r < V, o_k, m_k, o_l, h, HV, Hk, V, K)
        amax = tl.maximum(amax, tl.max(tl.where(b_S == b_S, tl.abs(b_S), float("inf")), axis=1))
    ts = nvfp4_tensor_scale(tl.max(amax, axis=0))
    for r0 in range(0, V, RC):
        o_r = r0 + tl.arange(0, RC)
        b_S = load_lp_tile(lp_data, lp_scale, lp_tscale, i_m, o_r, o_r < V, o_k, m_k, V, K, 4)
        b_S = _fold_records(b_S, b_cf, b_gL, p_wb, p_kb, o_r, o_r < V, o_k, m_k, o_l, h, HV, Hk, V, K)
        tl.debug_barrier()          # every thread has read these rows before they are overwritten
        store_nvfp4_rows(b_S, ts, lp_data, lp_scale, i_m, i_h, o_r, o_r < V, o_k, sr_key, st, V, K, BK, RC, SR)
    tl.debug_barrier()
    tl.store(lp_tscale + i_m, ts)
    for r0 in range(0, V, RC):
        o_r = r0 + tl.arange(0, RC)
        m_tr = m_t[:, None] & (o_r < V)[None, :]
        b_X = tl.load(p_xd + o_t[:, None] * stride_x_t + o_r[None, :], mask=m_tr, other=0.0)
        tl.store(p_wb + o_t[:, None] * (HV * V) + o_r[None, :], b_X.to(p_wb.dtype.element_ty), mask=m_tr)


@triton.heuristics(dict(OPTIONAL_INPUTS, HAS_N=given("num_drafts")))
@triton.jit
def _lowp_verify_kernel(
    x, dt, B, C, A, dt_bias, D, z, out,
    ckpt, hp_scale, sr_key, lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, cursor, pending,
    epoch, arrive, head_arrive, slot_ids, num_drafts,
    stride_x_b, stride_x_t, stride_x_h, stride_dt_b, stride_dt_t,
    stride_B_b, stride_B_t, stride_B_g, stride_C_b, stride_C_t, stride_C_g,
    stride_z_b, stride_z_t, stride_z_h, stride_o_b, stride_o_t, stride_o_h,
    HV: tl.constexpr, Hk: tl.constexpr, V: tl.constexpr, K: tl.constexpr, LB: tl.constexpr,
    WINDOW: tl.constexpr, T: tl.constexpr, TP: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    BL: tl.constexpr, NVB: tl.constexpr, HVP: tl.constexpr, HKP: tl.constexpr, RC: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_N: tl.constexpr, LP: tl.constexpr,
    HP: tl.constexpr, HAS_LP: tl.constexpr, HP_SR: tl.constexpr,
):
    # grid (HV * NVB, Bt): a program owns V-block i_v of head i_h
    pid = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    i_v = pid % NVB
    i_h = pid // NVB
    HG: tl.constexpr = HV // Hk
    i_g = i_h // HG

    o_v = i_v * BV + tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    o_l = tl.arange(0, BL)
    o_t = tl.arange(0, TP)
    m_v = o_v < V
    m_k = o_k < K

    p_o = out + i_b * stride_o_b + i_h * stride_o_h
    slot = tl.load(slot_ids + i_b).to(tl.int64)
    if slot < 0:
        b_0 = tl.zeros([TP, BV], dtype=tl.float32).to(p_o.dtype.element_ty)
        tl.store(p_o + o_t[:, None] * stride_o_t + o_v[None, :], b_0,
                 mask=(o_t < T)[:, None] & m_v[None, :])
        return

    h, n, flush, hc, m_t, m_l, m_c = verify_row_bounds(cursor, slot, num_drafts, i_b, o_t, o_l, T, WINDOW, HAS_N)

    i_m = slot * HV + i_h                           # this head's matrix in the pool
    p_S0 = ckpt + i_m * (V * K)                     # (fp32 HP only)
    o_S = o_v[:, None] * K + o_k[None, :]
    m_S = m_v[:, None] & m_k[None, :]
    # a flush folds from the HP checkpoint (it carries the recurrence), other rows read the LP copy
    if flush and HP == 0:
        b_S = tl.load(p_S0 + o_S, mask=m_S, other=0.0, eviction_policy="evict_first")       # [BV, BK]
    elif flush and HP == 4:
        # the shared NVFP4 checkpoint: its parts are the lp_* arguments (with the tensor scale)
        b_S = load_lp_tile(lp_data, lp_scale, lp_tscale, i_m, o_v, m_v, o_k, m_k, V, K, 4)
    elif flush:
        b_S = load_lp_tile(ckpt, hp_scale, hp_scale, i_m, o_v, m_v, o_k, m_k, V, K, HP)
    else:
        # (without an LP copy lp_* are the HP parts and LP their code)
        b_S = load_lp_tile(lp_data, lp_scale, lp_tscale, i_m, o_v, m_v, o_k, m_k, V, K, LP)

    # committed records: log decays of this head, keys of its group, values of its rows
    p_ld = buf_ld + slot * (LB * HV) + i_h
    p_kb = buf_k + slot * (LB * Hk * K) + i_g * K
    p_wb = buf_w + slot * (LB * HV * V) + i_h * V
    b_ldc = tl.load(p_ld + o_l * HV, mask=m_l, other=0.0)                               # [BL]
    b_ldc = tl.where(m_l, b_ldc, 0.0)
    b_Kb = tl.load(p_kb + o_l[:, None] * (Hk * K) + o_k[None, :], mask=m_c[:, None] & m_k[None, :],
                   other=0.0)
    b_Kb = tl.where(m_c[:, None], b_Kb.to(tl.float32), 0.0)                             # [BL, BK]
    b_Wb = tl.load(p_wb + o_l[:, None] * (HV * V) + o_v[None, :], mask=m_c[:, None] & m_v[None, :],
                   other=0.0)
    b_Wb = tl.where(m_c[:, None], b_Wb.to(tl.float32), 0.0)                             # [BL, BV]

    # the drafts, from the inputs: keys of the group, values of these rows, dt and log decay
    m_tk = m_t[:, None] & m_k[None, :]
    b_Kd = tl.load(B + i_b * stride_B_b + i_g * stride_B_g + o_t[:, None] * stride_B_t + o_k[None, :],
                   mask=m_tk, other=0.0).to(tl.float32)                                 # [TP, BK]
    b_Xi = tl.load(x + i_b * stride_x_b + i_h * stride_x_h + o_t[:, None] * stride_x_t + o_v[None, :],
                   mask=m_t[:, None] & m_v[None, :], other=0.0)                         # [TP, BV]
    b_Xd = b_Xi.to(tl.float32)
    b_rA, b_dtd, b_ldd = draft_decays(dt, dt_bias, A, i_b * stride_dt_b, stride_dt_t, i_h, o_t, m_t)   # [TP]

    # committed suffixes sum_{j<i<h} ld_i, each of same-signed terms (verify.py's)
    b_sfx = tl.sum(tl.where(o_l[None, :] > o_l[:, None], b_ldc[None, :], 0.0), axis=1)   # [BL]

    if flush:
        b_cf, b_gL = _fold_weights(b_ldc, b_sfx, b_rA, m_l)
        b_S = _fold_records(b_S, b_cf, b_gL, p_wb, p_kb, o_v, m_v, o_k, m_k, o_l, h, HV, Hk, V, K)
    b_Lc = tl.sum(tl.where(m_c, b_ldc, 0.0), axis=0)                                   # log g_{0:hc-1}
    b_cc = tl.where(m_c, b_ldc * b_rA, 0.0)                                             # dt_j

    if HAS_D:
        b_D = tl.load(D + i_h).to(tl.float32)
    p_x = x + i_b * stride_x_b + i_h * stride_x_h + o_v
    for t in tl.static_range(T):
        b_q = tl.load(C + i_b * stride_C_b + t * stride_C_t + i_g * stride_C_g + o_k, mask=m_k,
                      other=0.0).to(tl.float32)                                         # [BK]
        m_r = o_t <= t
        # the drafts' own partial sums: sum_{r<i<=t} ld_i per draft r, and the total up to t
        b_dsx = tl.sum(tl.where((o_t[None, :] > o_t[:, None]) & (o_t[None, :] <= t), b_ldd[None, :], 0.0),
                       axis=1)                                                          # [TP]
        b_Dt = tl.sum(tl.where(m_r, b_ldd, 0.0), axis=0)
        b_y = tl.exp(b_Lc + b_Dt) * tl.sum(b_S * b_q[None, :], axis=1)                 # [BV]
        b_wc = tl.where(m_c, tl.exp(b_sfx + b_Dt) * b_cc * tl.sum(b_Kb * b_q[None, :], axis=1), 0.0)
        b_y += tl.sum(b_Wb * b_wc[:, None], axis=0)
        b_wd = tl.where(m_r, tl.exp(b_dsx) * b_dtd * tl.sum(b_Kd * b_q[None, :], axis=1), 0.0)
        # drafts after t are selected away, not multiplied by zero (a poisoned later draft
        # must leave no trace in an earlier output)
        b_y += tl.sum(tl.where(m_r[:, None], b_Xd * b_wd[:, None], 0.0), axis=0)
        if HAS_D:
            b_y += b_D * tl.load(p_x + t * stride_x_t, mask=m_v, other=0.0).to(tl.float32)
        if HAS_Z:
            b_z = tl.load(z + i_b * stride_z_b + i_h * stride_z_h + t * stride_z_t + o_v, mask=m_v,
                          other=0.0).to(tl.float32)
            b_y = b_y * b_z / (1.0 + tl.exp(-b_z))
        b_y = tl.where(t < n, b_y, 0.0)
        tl.store(p_o + t * stride_o_t + o_v, b_y.to(p_o.dtype.element_ty), mask=m_v)

    # every thread has read its tile and records (the fold) before they are overwritten
    tl.debug_barrier()
    if flush:
        # the new checkpoints, once the drafts' tiles are dead (fewer live registers)
        if HP == 0:
            tl.store(p_S0 + o_S, b_S, mask=m_S)
        elif HP == 4:
            # release this program's reads; the head's last program refolds and encodes the head
            if last_at_head(head_arrive, i_m, NVB):
                _shared_nvfp4_flush_head(lp_data, lp_scale, lp_tscale, i_m, i_h, o_k, m_k, p_wb, p_kb, b_ldc, b_sfx,
                                         b_rA, m_l, o_l, h, x + i_b * stride_x_b + i_h * stride_x_h,
                                         stride_x_t, o_t, m_t, sr_key, slot * 4294967296 + tl.load(epoch + slot),
                                         HV, Hk, V, K, BK, RC, HP_SR)
        elif HP_SR:
            # the stochastic-rounding stream of this write: slot and write count, as pool._write
            st = slot * 4294967296 + tl.load(epoch + slot)
            store_sr_rows(b_S, ckpt, hp_scale, i_m, i_h, o_v, m_v, o_k, m_k, sr_key, st, V, K, HP)
        else:
            store_lp_rows(b_S, ckpt, hp_scale, i_m, o_v, m_v, o_k, m_k, V, K, HP)
        if HAS_LP:
            if LP != 4:
                store_lp_rows(b_S, lp_data, lp_scale, i_m, o_v, m_v, o_k, m_k, V, K, LP)
            else:
                # release this program's fp32 rows; the head's last program encodes the matrix
                if last_at_head(head_arrive, i_m, NVB):
                    store_nvfp4_head(p_S0, lp_data, lp_scale, lp_tscale, i_m, V, K, BK, RC)

    # the drafts' records at h'..h'+n-1, as verify.py: a program's own rows of x (after the barrier)
    # (a shared NVFP4 flush: the head's last program writes them, after its refold)
    m_tv = m_t[:, None] & m_v[None, :]
    if HP == 4:
        m_tv = m_tv & ((o_t * 0 + h + n) <= WINDOW)[:, None]         # (a vector: the interpreter's masks)
    tl.store(p_wb + (hc + o_t)[:, None] * (HV * V) + o_v[None, :], b_Xi.to(buf_w.dtype.element_ty), mask=m_tv)
    if not flush:
        # positions >= h, which no program reads: the owners write them directly
        if i_v == 0:
            tl.store(p_ld + (hc + o_t) * HV, b_ldd, mask=m_t)
            if i_h % HG == 0:
                p_Kn = p_kb + (hc + o_t)[:, None] * (Hk * K) + o_k[None, :]
                tl.store(p_Kn, b_Kd.to(buf_k.dtype.element_ty), mask=m_tk)

    last = verify_hand_off(arrive, cursor, pending, epoch, slot, hc, n, flush, HV * NVB)
    if flush & last:
        # positions 0..n-1 held committed records that other programs of the slot read
        write_shared_drafts(dt, B, A, dt_bias, buf_ld, buf_k, slot, n, i_b * stride_dt_b, stride_dt_t,
                            i_b * stride_B_b, stride_B_t, stride_B_g, o_k, m_k, HV, Hk, K, LB, T, HVP, HKP)


def _gluon_lp_config(x, B, ck, buf_ld, buf_w, buf_k, cursor, pending, window) -> Optional[dict]:
    """The Gluon verify kernel's config for this launch (verify.py's default, FMA dots) where it
    takes it: an fp32 checkpoint with an fp16 or bf16 copy (no stochastic rounding, no scales),
    on CUDA outside the interpreter, a shape and window it covers, 16-byte aligned state;
    otherwise None (the Triton kernel)."""
    if not (HAVE_GLUON and x.is_cuda and not _interpreting() and ck["HAS_LP"]
            and ck["HP"] == HP_CODES["fp32"] and ck["LP"] in (LP_CODES["fp16"], LP_CODES["bf16"])):
        return None
    Bt, T, HV, V = x.shape
    Hk, K, LB = B.shape[2], B.shape[3], buf_ld.shape[1]
    cfg = verify_config(HV, V, K, Hk, T, {"mma": False}, device=x.device, window=window, Lb=LB)
    if not cfg["gluon"] or cfg["BV"] not in GLUON_LP_BV or not gluon_aligned(ck["ckpt"], buf_ld, buf_w, buf_k):
        return None
    # (the kernel indexes the copy as the checkpoint, contiguous: no slot padding)
    return None if any(slot_pads(ck["ckpt"], buf_ld, buf_w, buf_k, cursor, pending).values()) else cfg


def lowp_verify(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, dt_bias: Tensor,
                D: Optional[Tensor], z: Optional[Tensor], ckpt, ckpt_lp: Optional[dict],
                lp_format: Optional[str], buf_ld: Tensor, buf_w: Tensor, buf_k: Tensor, cursor: Tensor,
                pending: Tensor, epoch: Tensor, slot_ids: Tensor, window: int,
                num_drafts: Optional[Tensor] = None, out: Optional[Tensor] = None, *,
                arrive: Optional[Tensor] = None, config: Optional[dict] = None, validate: bool = True,
                hp_format: str = "fp32", hp_rounding: str = "stochastic", seed: int = 0) -> Tensor:
    """Output-only verification of `T` tokens per row on two checkpoints, in place; returns `y`
    `[Bt, T, HV, V]` in x's dtype.

    Arguments as :func:`replayssm.ops.mamba2.replay_verify` (token inputs `x` `[Bt, T, HV, V]`,
    `dt` `[Bt, T, HV]`, `B`, `C` `[Bt, T, Hk, K]`, `z` or None; `A`, `dt_bias`, `D` `[HV]`;
    records, `cursor`, `pending`, `epoch`, `slot_ids`, `window`, `num_drafts` `[Bt]` int32 or
    None, `out`, `arrive`, `validate`; `1 <= T <= 8`), and the checkpoints of
    :func:`replayssm.ops.mamba2.precision.lowp_decode`: `ckpt` `[N, HV, V, K]` fp32, or a dict
    of `hp_format`'s parts (fp16, bf16, fp8_e4m3); `ckpt_lp` the parts of the low-precision
    copy in `lp_format` (fp16, bf16, fp8_e4m3, nvfp4; an nvfp4 copy needs an fp32 HP), or both
    None with a narrow HP (its one checkpoint: fp16, bf16, fp8_e4m3 or nvfp4). A row that flushes
    early (`h + n > window`) folds its committed records from `ckpt` in fp32 and writes it (`hp_rounding` "stochastic":
    `formats.encode(S, hp_format, "stochastic", seed=seed, stream=slot * 2**32 + epoch)` bit for
    bit; "nearest": round-to-nearest) and the copy (round-to-nearest); the drafts then read the
    fp32 fold. Other rows' drafts read the copy. `config`: overrides of `verify_lp_config`.
    """
    hp = ckpt.get("data") if isinstance(ckpt, dict) else ckpt
    N, HV, V, K = hp.shape if isinstance(hp, Tensor) and hp.dim() == 4 else (0, 0, 0, 0)
    shared_nvfp4 = hp_format == "nvfp4" and ckpt_lp is None and lp_format is None
    if shared_nvfp4:
        K = C.shape[-1] if isinstance(C, Tensor) and C.dim() == 4 else 0       # (the data packs two per byte)
    if hp_rounding not in ("stochastic", "nearest"):
        raise ValueError(f"hp_rounding must be 'stochastic' or 'nearest', got {hp_rounding!r}")
    if validate:
        Bt, T, HV, V, Hk, K = _check_verify_inputs(x, dt, B, C, A, dt_bias, D, z)
        dev = x.device
        if shared_nvfp4:
            hp = nvfp4_stand_in(hp, K)
        N, Lb = check_state(hp, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids, Bt=Bt, HV=HV, V=V,
                            Hk=Hk, K=K, device=dev, ckpt_dtypes=(getattr(hp, "dtype", None),),
                            pending=pending)
        if num_drafts is not None:
            check_tensor("num_drafts", num_drafts, (Bt,), (torch.int32,), dev, contiguous=True)
            if num_drafts.device.type == "cpu" and Bt and not bool(((num_drafts >= 1) & (num_drafts <= T)).all()):
                raise ValueError(f"num_drafts must lie in 1..{T}, got {num_drafts.tolist()}")
        if out is not None:
            check_tensor("out", out, (Bt, T, HV, V), (x.dtype,), dev, inner=True)
        check_window(window, Lb)
        if Lb < window + T:
            raise ValueError(f"buf_ld: capacity Lb={Lb} below window + T = {window + T}")
        check_slots(slot_ids, N)
    if shared_nvfp4:
        ck = shared_args(ckpt, hp_format, hp_rounding, seed, N, HV, V, K)
    else:
        ck = checkpoint_args(ckpt, ckpt_lp, lp_format, hp_format, seed, N, HV, V, K)
    cfg = verify_lp_config(V, config)
    BV = cfg["BV"]
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if arrive is None:
        arrive = arrive_counter(x.device, N)
    Bt, T = x.shape[0], x.shape[1]
    if Bt == 0:
        return out
    gcfg = None if config is not None else _gluon_lp_config(x, B, ck, buf_ld, buf_w, buf_k, cursor, pending, window)
    if gcfg is not None:
        launch_gluon_verify(x, dt, B, C, A, dt_bias, D, z, ck["ckpt"], buf_ld, buf_w, buf_k, cursor, pending, epoch,
                            arrive, slot_ids, num_drafts, out, window, gcfg["BV"], gcfg["num_warps"],
                            kq=gcfg["kq"], ckpt_lp=ck["lp_data"], lp_code=ck["LP"])
        return out
    Hk, LB = B.shape[2], buf_ld.shape[1]
    nvb = triton.cdiv(V, BV)
    _lowp_verify_kernel[(HV * nvb, Bt)](
        x, dt, B, C, A, dt_bias, D, z, out,
        ck["ckpt"], ck["hp_scale"], ck["sr_key"], ck["lp_data"], ck["lp_scale"], ck["lp_tscale"],
        buf_ld, buf_w, buf_k, cursor, pending, epoch, arrive, head_counter(x.device, N * HV), slot_ids,
        num_drafts,
        x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1),
        B.stride(0), B.stride(1), B.stride(2), C.stride(0), C.stride(1), C.stride(2),
        z.stride(0) if z is not None else 0, z.stride(1) if z is not None else 0,
        z.stride(2) if z is not None else 0, out.stride(0), out.stride(1), out.stride(2),
        HV=HV, Hk=Hk, V=V, K=K, LB=LB, WINDOW=int(window), T=T, TP=triton.next_power_of_2(T), BV=BV,
        BK=triton.next_power_of_2(K), BL=max(16, triton.next_power_of_2(min(window, LB))), NVB=nvb,
        HVP=triton.next_power_of_2(HV), HKP=triton.next_power_of_2(Hk), RC=min(16, BV),
        LP=ck["LP"], HP=ck["HP"], HAS_LP=ck["HAS_LP"], HP_SR=hp_rounding == "stochastic",
        num_warps=cfg["num_warps"], num_stages=1)
    return out
