"""GDN (and, through `IS_KDA`, KDA) speculative verification with separate state precisions
(SPEC sections 4 and 5, Algorithm 3), in Triton.

The verify step of verify.py on two checkpoints: `ckpt` (high precision: fp32, or fp16, bf16,
scaled fp8-e4m3 written with seeded stochastic rounding, ops/utils/sround.py) and `ckpt_lp`
(fp16, bf16, fp8-e4m3 or NVFP4, round-to-nearest, ops/utils/lowp.py). Per row with slot `s`,
cursor `h` and `n` drafts (draft `t` at position `h' + t`):

    h + n <= L:  h' = h; the drafts' u (forward substitution) and outputs from C_LP[s]
                 (decoded in the kernel) and the buffered records 0..h-1, as verify.py
    h + n > L:   h' = 0; S <- C_HP[s] folded along the HP path over records 0..h-1, each u_j
                 recomputed from the raw v_j, beta_j (the buffered u_j came from C_LP), as
                 precision.py's flush; C_HP[s] <- S (fp32, or stochastic rounding bit for bit
                 `formats.encode(S, hp, "stochastic", seed, stream=s * 2**32 + epoch[s])`),
                 C_LP[s] <- round-to-nearest(S); the drafts' u and outputs from S itself

Drafts write `u` (and the raw `v`, `beta` for a later flush's refold) behind the cursor as
verify.py writes its records, so `commit` is unchanged. Without an LP copy (`ckpt_lp` None: a
pool whose one checkpoint is fp16, bf16 or fp8, `RECOMPUTE` off) non-flush rows read the HP
parts, the fold takes the buffered u, and a flush writes the HP parts alone (`HP_SR` False:
round-to-nearest). NVFP4's scale per head matrix: the head's last program to arrive encodes
the whole matrix from the new fp32 rows (precision.py). One NVFP4 checkpoint (the shared
design) has no fp32 rows to read back, and a head's programs overwrite the committed records
with their drafts' u as they go, so no program can fold the head again: a launch before the
kernel folds each flushing head once for its amax and tensor scale (`_nvfp4_flush_scales`),
each program then encodes its own rows under it, and the head's last program stores it (the
old rows decode with the old one until then).

The tile is a plain `[BV, BK]` (the layout the LP decoder returns: verify.py's KS = 1). On the
GPU a GDN pool's fp16 or bf16 copy beside an fp32 checkpoint takes the Gluon verify kernel
instead (gluon_verify.py, `lp_code`: the copy's tile staged on rows without a flush, the HP
refold of this contract on rows with one), where it covers the shape (`_gluon_lp_config`).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..utils.checks import check_tensor
from ..utils.cursor import verify_hand_off
from ..utils.launch import arrive_counter, gluon_aligned, slot_pads
from ..utils.lowp import (LP_CODES, head_counter, last_at_head, load_lp_tile, lowp_config, scale_scratch,
                          store_lp_rows, store_nvfp4_head)
from ..utils.sround import (HP_CODES, checkpoint_args, nvfp4_tensor_scale, shared_args, store_nvfp4_rows,
                            store_sr_rows)
from .common import (_for_store, _interpreting, _load_head, _load_qk, _scale, _write_shared, check_cursor_values,
                     check_devices, check_slot_ids, check_slot_values, check_state)
from .gluon_verify import HAVE_GLUON
from .gluon_verify_host import launch_gluon_verify
from .verify import _check_draft_counts, _fold, check_verify_inputs, verify_config

__all__ = ["lowp_verify", "verify_lp_config"]

# GDN pools with an fp16/bf16 copy verify on the Gluon kernel (gluon_verify.py, `lp_code`):
# `test_verify_lp_gluon_gdn_real_shapes_gpu` passes on the H100, where it took 0.2-0.4x the
# Triton kernel's time at Qwen3.5-4B's shape (verify_lp_gdn_h100.json)
GLUON_LP_GDN = True
# KDA pools likewise (its per-channel decays in the refold, the weights of the records the drafts
# follow) with REPLAYSSM_GLUON_LP_KDA=1: compiled, not yet run on a GPU (the same GPU test)
GLUON_LP_KDA = os.environ.get("REPLAYSSM_GLUON_LP_KDA") == "1"

# The rows of the tile a flushing program refolds at a time (gluon_verify.py, `refold_rows`): 32
# (two chains of row dots per program instead of four; the same arithmetic per row). On an H100
# it took flush-heavy T = 8 rounds from 1,297 to 1,182 us (Qwen3.5-4B, batch 256) and the GPU test
# passed at it; REPLAYSSM_GLUON_LP_REFOLD_ROWS=N times another (0: 4 rows per warp, the former)
_ROWS = os.environ.get("REPLAYSSM_GLUON_LP_REFOLD_ROWS", "32")
if not _ROWS.isdigit() or (int(_ROWS) and int(_ROWS) & (int(_ROWS) - 1)):
    raise ValueError(f"REPLAYSSM_GLUON_LP_REFOLD_ROWS={_ROWS!r}: 0 or a power of two (rows of the tile a refold takes)")
REFOLD_ROWS = int(_ROWS)
# Rows without a flush form their products from the copy's tile on the tensor cores where the
# fp32 pool's kernel does (T = 8), the copy as one (bf16) or two (fp16) bf16 pieces, both exact
# (utils.gluon_mma._tile_vector_pairs_mma's LPT): on the H100 with REFOLD_ROWS = 32, T = 8 rounds
# took 475-842 us against 622-1,297 with FMA products (verify_lp_gdn_h100.json);
# REPLAYSSM_GLUON_LP_MMA=0 keeps the FMA products
LP_MMA = os.environ.get("REPLAYSSM_GLUON_LP_MMA", "1") != "0"
# REPLAYSSM_GLUON_LP_REFOLD_MMA=1: the refold on the tensor cores (gluon_verify_drafts._refold_lp_mma:
# the tile's products with the records' keys, the keys' Gram, a forward substitution per row,
# the fold's product; fp32 rounding level with the sequential refold in a float64 comparison on
# the CPU); compiled, not yet run on a GPU
REFOLD_MMA = os.environ.get("REPLAYSSM_GLUON_LP_REFOLD_MMA") == "1"


def verify_lp_config(V: int, config: Optional[dict] = None) -> dict:
    """The launch config (`BV` value rows per program, a power of two; `num_warps`) with a
    caller's overrides: 32 rows at most and at least two programs per head, 8 warps. Chosen
    offline from sm_90a compiles under Triton 3.6 (GDN Qwen3.5-4B and KDA at 128 x 128, T = 1..8,
    every copy and HP format: 80-253 registers, no spill; 4 warps spill an fp8 HP's stochastic
    rounding and KDA's NVFP4 copy), not timed on a GPU."""
    return lowp_config(V, dict({"BV": min(32, max(1, triton.next_power_of_2(V) // 2)), "num_warps": 8},
                               **(config or {})))


def _gluon_lp_config(family: str, q: Tensor, v: Tensor, ck: dict, buf_ld, buf_w, buf_k, buf_v, cursor, pending,
                     window: int) -> Optional[dict]:
    """The Gluon verify kernel's config for this launch (verify.py's default, FMA products unless `LP_MMA`) where
    it takes it (`GLUON_LP_GDN`, `GLUON_LP_KDA`): an fp32 checkpoint with an fp16 or bf16 copy, on
    CUDA outside the interpreter, a shape and window it covers, 16-byte aligned contiguous state;
    otherwise None (the Triton kernel)."""
    wanted = GLUON_LP_GDN if family == "gdn" else GLUON_LP_KDA and family == "kda"
    if not (wanted and HAVE_GLUON and q.is_cuda and not _interpreting()
            and ck["HAS_LP"] and ck["HP"] == HP_CODES["fp32"] and ck["LP"] in (LP_CODES["fp16"], LP_CODES["bf16"])):
        return None
    T, Hk, K = q.shape[1], q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    cfg = verify_config(family, V, K, T, {} if LP_MMA else {"mma": False}, HV=HV, Hk=Hk, window=window,
                        Lb=buf_w.shape[1])
    if not cfg["gluon"] or not gluon_aligned(ck["ckpt"], buf_ld, buf_w, buf_k) or \
            ck["lp_data"].data_ptr() % 16 or buf_v.data_ptr() % 16:
        return None
    # (the kernel indexes the copy and the raw records as the checkpoint, contiguous: no padding)
    if any(slot_pads(ck["ckpt"], buf_ld, buf_w, buf_k, cursor, pending).values()):
        return None
    # (a program of fewer rows than REFOLD_ROWS refolds them all at once)
    cfg = dict(cfg, refold_rows=min(REFOLD_ROWS, cfg["BV"]) if REFOLD_ROWS else 0, refold_mma=REFOLD_MMA)
    if REFOLD_MMA and family == "gdn" and not cfg["maxnreg"]:
        # the refold is inlined into every program: uncapped at T <= 4 it took 126 -> 137 registers
        # with bf16 records (4 -> 3 programs per SM), 128 -> 176 with fp32 ones; at the cap, no
        # stack with bf16 records (Triton 3.6)
        cfg["maxnreg"] = 128
    return cfg


@triton.jit
def _hp_refold(b_C, h, i_s, i_hv, i_hk, buf_ld, buf_k, buf_v, buf_beta, o_v, m_v, o_k, m_k,
               HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
               LBCAP: tl.constexpr, IS_KDA: tl.constexpr):
    """`b_C` (`[BV, BK]`, rows `o_v`) after records `0..h-1` along the high-precision path:
    `S <- a_j S; u_j = beta_j (v_j - S k_j); S <- S + u_j k_j^T`, u recomputed from the raw
    records (precision.py's flush arithmetic)."""
    for j in range(0, h):
        o_p = i_s * LBCAP + j
        b_kj = tl.load(buf_k + (o_p * HK + i_hk) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_vj = tl.load(buf_v + (o_p * HV + i_hv) * V + o_v, mask=m_v, other=0.).to(tl.float32)
        b_bj = tl.load(buf_beta + o_p * HV + i_hv)
        if IS_KDA:
            b_C = b_C * tl.exp(tl.load(buf_ld + (o_p * HV + i_hv) * K + o_k, mask=m_k, other=0.))[None, :]
        else:
            b_C = b_C * tl.exp(tl.load(buf_ld + o_p * HV + i_hv))
        b_u = b_bj * (b_vj - tl.sum(b_C * b_kj[None, :], axis=1))
        b_C += b_u[:, None] * b_kj[None, :]
    return b_C


@triton.jit
def _write_shared_beta(b, buf_beta, i_b, i_s, n, stride_b_b, stride_b_t, stride_b_h, T: tl.constexpr,
                       HV: tl.constexpr, LBCAP: tl.constexpr, HVP: tl.constexpr):
    """On an early flush, by the slot's last program: every value head's draft beta at positions
    `0..n-1` (the refold of the slot's other programs read the committed ones there)."""
    o_hv = tl.arange(0, HVP)
    m_hv = o_hv < HV
    for t in tl.static_range(T):
        b_bt = tl.load(b + i_b * stride_b_b + t * stride_b_t + o_hv * stride_b_h, mask=m_hv, other=0.)
        tl.store(buf_beta + (i_s * LBCAP + t) * HV + o_hv, tl.sigmoid(b_bt.to(tl.float32)),
                 mask=tl.where(t < n, m_hv, False))


@triton.jit
def _row_drafts(num_drafts, i_b, T: tl.constexpr, HAS_NDRAFT: tl.constexpr):
    """Row `i_b`'s draft count; unvalidated counts are clamped to 0..T, so that no draft lands
    past the buffer."""
    if HAS_NDRAFT:
        n = tl.minimum(tl.maximum(tl.load(num_drafts + i_b).to(tl.int64), 0), T)
    else:
        n = tl.full([], T, tl.int64)
    return n


@triton.jit
def _nvfp4_flush_scales(lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, cursor, slot_ids, num_drafts, ts_new,
                        window, T: tl.constexpr, HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr,
                        K: tl.constexpr, LBCAP: tl.constexpr, BK: tl.constexpr, RC: tl.constexpr,
                        IS_KDA: tl.constexpr, HAS_NDRAFT: tl.constexpr):
    """Grid (HV, Bt): the tensor scale `ts_new[i_b, i_hv]` of a shared NVFP4 head that flushes
    early, from the amax of its fold (the kernel's fold, chunk by chunk: the same fp32 values)."""
    i_hv = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    i_s = tl.load(slot_ids + i_b).to(tl.int64)
    if i_s >= 0:
        h = tl.load(cursor + i_s).to(tl.int64)
        if h + _row_drafts(num_drafts, i_b, T, HAS_NDRAFT) > window:
            i_hk = i_hv // (HV // HK)
            i_m = i_s * HV + i_hv
            o_p0 = i_s * LBCAP
            o_k = tl.arange(0, BK)
            m_k = o_k < K
            if IS_KDA:
                p_ld = buf_ld + (o_p0 * HV + i_hv) * K + o_k
            else:
                p_ld = buf_ld + o_p0 * HV + i_hv
            amax = tl.zeros([RC], dtype=tl.float32)
            for r0 in range(0, V, RC):
                o_r = r0 + tl.arange(0, RC)
                m_r = o_r < V
                b_C = load_lp_tile(lp_data, lp_scale, lp_tscale, i_m, o_r, m_r, o_k, m_k, V, K, 4)
                b_C = _fold(b_C, h, p_ld, buf_w + (o_p0 * HV + i_hv) * V + o_r, buf_k + (o_p0 * HK + i_hk) * K + o_k,
                            HV * K if IS_KDA else HV, HV * V, HK * K, m_r, m_k, 1, IS_KDA)
                amax = tl.maximum(amax, tl.max(tl.where(b_C == b_C, tl.abs(b_C), float("inf")), axis=1))
            tl.store(ts_new + i_b * HV + i_hv, nvfp4_tensor_scale(tl.max(amax, axis=0)))


@triton.jit
def _lowp_verify_kernel(
    q, k, v, a, b, A_log, dt_bias, o,
    ckpt, hp_scale, sr_key, lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, buf_v, buf_beta,
    cursor, pending, epoch, arrive, head_arrive, slot_ids, num_drafts, ts_new,
    scale, window,
    stride_q_b, stride_q_t, stride_q_h, stride_k_b, stride_k_t, stride_k_h,
    stride_v_b, stride_v_t, stride_v_h, stride_a_b, stride_a_t, stride_a_h,
    stride_b_b, stride_b_t, stride_b_h,
    T: tl.constexpr, HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
    LBCAP: tl.constexpr, LB: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, HVP: tl.constexpr,
    HKP: tl.constexpr, RC: tl.constexpr, IS_KDA: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
    HAS_NDRAFT: tl.constexpr, EXACT_BF16: tl.constexpr, LP: tl.constexpr, HP: tl.constexpr,
    HAS_LP: tl.constexpr, HP_SR: tl.constexpr, RECOMPUTE: tl.constexpr,
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
    p_o = o + (i_b * T * HV + i_hv) * V

    i_s = tl.load(slot_ids + i_b).to(tl.int64)
    if i_s < 0:
        for t in tl.static_range(T):
            tl.store(p_o + t * (HV * V) + o_v, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty),
                     mask=m_v)
        return
    h = tl.load(cursor + i_s).to(tl.int64)
    n = _row_drafts(num_drafts, i_b, T, HAS_NDRAFT)
    flush = h + n > window
    keep = h + n <= window
    hc = tl.where(flush, 0, h)              # committed records the drafts follow (h')

    i_m = i_s * HV + i_hv                   # this head's matrix in the pool
    p_C = ckpt + i_m * (V * K)              # (fp32 HP only)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_C = o_v[:, None] * K + o_k[None, :]
    m_C = m_v[:, None] & m_k[None, :]
    # a flush folds from the HP checkpoint (it carries the recurrence), other rows read the LP copy
    if flush and HP == 0:
        b_C = tl.load(p_C + o_C, mask=m_C, other=0., eviction_policy="evict_first")       # [BV, BK]
    elif flush and HP == 4:
        # the shared NVFP4 checkpoint: its parts are the lp_* arguments (with the tensor scale)
        b_C = load_lp_tile(lp_data, lp_scale, lp_tscale, i_m, o_v, m_v, o_k, m_k, V, K, 4)
    elif flush:
        b_C = load_lp_tile(ckpt, hp_scale, hp_scale, i_m, o_v, m_v, o_k, m_k, V, K, HP)
    else:
        # (without an LP copy lp_* are the HP parts and LP their code)
        b_C = load_lp_tile(lp_data, lp_scale, lp_tscale, i_m, o_v, m_v, o_k, m_k, V, K, LP)

    # rows j of the record tiles are buffer positions, as verify.py: committed records j < h'
    # (none after a flush), then each draft r at h' + r once solved; rows at or past the cursor
    # are selected away after the load
    o_j = tl.arange(0, LB)
    m_j = o_j < hc
    m_j1 = (o_j + 1) < hc
    o_p0 = i_s * LBCAP
    b_Ka = tl.load(buf_k + (o_p0 * HK + i_hk) * K + (o_j[:, None] * (HK * K) + o_k[None, :]),
                   mask=m_j[:, None] & m_k[None, :], other=0.)
    b_Ka = tl.where(m_j[:, None], b_Ka.to(tl.float32), 0.)                  # [LB, BK]
    b_Ua = tl.load(buf_w + (o_p0 * HV + i_hv) * V + (o_j[:, None] * (HV * V) + o_v[None, :]),
                   mask=m_j[:, None] & m_v[None, :], other=0.)
    b_Ua = tl.where(m_j[:, None], b_Ua.to(tl.float32), 0.)                  # [LB, BV]
    # lane j of the shifted decays holds ld_{j+1}: a reverse scan gives each record's suffix sum
    if IS_KDA:
        p_ld = buf_ld + (o_p0 * HV + i_hv) * K
        b_LDs = tl.load(p_ld + ((o_j + 1)[:, None] * (HV * K) + o_k[None, :]),
                        mask=m_j1[:, None] & m_k[None, :], other=0.)
        b_LDs = tl.where(m_j1[:, None], b_LDs, 0.)                            # [LB, BK]
        b_ld0 = tl.load(p_ld + o_k, mask=tl.where(hc > 0, m_k, False), other=0.)
        b_ld0 = tl.where(hc > 0, b_ld0, 0.)
        # weights as products of factors <= 1, as verify.py
        b_Ka = b_Ka * tl.exp(tl.cumsum(b_LDs, axis=0, reverse=True))
        b_g = tl.exp(b_ld0 + tl.sum(b_LDs, axis=0))                          # [BK]
    else:
        p_ld = buf_ld + o_p0 * HV + i_hv
        b_LDs = tl.where(m_j1, tl.load(p_ld + (o_j + 1) * HV, mask=m_j1, other=0.), 0.)   # [LB]
        b_ld0 = tl.where(hc > 0, tl.load(p_ld, mask=hc > 0, other=0.), 0.)
        b_La = tl.cumsum(b_LDs, axis=0, reverse=True)     # record j: ld_{j+1} + ... + ld_{h'-1}
        b_Lc = b_ld0 + tl.sum(b_LDs, axis=0)              # ld_0 + ... + ld_{h'-1}

    if flush:
        if RECOMPUTE:
            b_C = _hp_refold(b_C, h, i_s, i_hv, i_hk, buf_ld, buf_k, buf_v, buf_beta, o_v, m_v, o_k, m_k,
                             HV, HK, V, K, LBCAP, IS_KDA)
        else:
            # one checkpoint: the buffered u were solved against it (verify.py's fold)
            b_C = _fold(b_C, h, p_ld + (o_k if IS_KDA else 0), buf_w + (o_p0 * HV + i_hv) * V + o_v,
                        buf_k + (o_p0 * HK + i_hk) * K + o_k, HV * K if IS_KDA else HV, HV * V, HK * K,
                        m_v, m_k, 1, IS_KDA)
        # this program's own records 0..n-1, read by all its threads above, are overwritten below
        tl.debug_barrier()

    own_hk = (i_v == 0) & (i_hv % HG == 0)
    # a loop, not unrolled (verify.py: unrolled, registers grow with T)
    for t in range(0, T):
        b_q, b_k = _load_qk(q + t * stride_q_t, k + t * stride_k_t, i_b, i_hk, o_k, m_k, scale,
                            stride_q_b, stride_q_h, stride_k_b, stride_k_h, USE_QK_L2NORM)
        b_v, b_ld, b_beta = _load_head(v + t * stride_v_t, a + t * stride_a_t, b + t * stride_b_t,
                                       A_log, dt_bias, i_b, i_hv, o_v, m_v, o_k, m_k,
                                       stride_v_b, stride_v_h, stride_a_b, stride_a_h,
                                       stride_b_b, stride_b_h, K, IS_KDA)
        m_a = o_j < hc + t                       # the rows draft t reads
        if IS_KDA:
            b_e = tl.exp(b_ld)
            b_g = b_g * b_e
            b_Ka = b_Ka * b_e[None, :]
            b_Ck = tl.sum(b_C * (b_k * b_g)[None, :], axis=1)
            b_Cq = tl.sum(b_C * (b_q * b_g)[None, :], axis=1)
            b_ck = tl.sum(b_Ka * b_k[None, :], axis=1)                         # [LB]
            b_cq = tl.sum(b_Ka * b_q[None, :], axis=1)
        else:
            b_La += b_ld
            b_Lc += b_ld
            b_gC = tl.exp(b_Lc)
            b_Ck = tl.sum(b_C * b_k[None, :], axis=1) * b_gC
            b_Cq = tl.sum(b_C * b_q[None, :], axis=1) * b_gC
            b_w = tl.where(m_a, tl.exp(b_La), 0.)
            b_ck = tl.sum(b_Ka * b_k[None, :], axis=1) * b_w
            b_cq = tl.sum(b_Ka * b_q[None, :], axis=1) * b_w
        b_kq = tl.sum(b_k * b_q)
        b_u = b_beta * (b_v - b_Ck - tl.sum(b_Ua * b_ck[:, None], axis=0))
        b_o = b_Cq + tl.sum(b_Ua * b_cq[:, None], axis=0) + b_kq * b_u
        ok = t < n
        tl.store(p_o + t * (HV * V) + o_v, _for_store(tl.where(ok, b_o, 0.), p_o, EXACT_BF16), mask=m_v)
        # u rows (and the raw v rows) by their owner, at position h' + t
        o_pt = o_p0 + hc + t
        m_own = tl.where(ok & (hc + t < LBCAP), m_v, False)
        p_w = buf_w + (o_pt * HV + i_hv) * V + o_v
        tl.store(p_w, _for_store(b_u, p_w, EXACT_BF16), mask=m_own)
        if RECOMPUTE:
            p_vr = buf_v + (o_pt * HV + i_hv) * V + o_v
            tl.store(p_vr, _for_store(b_v, p_vr, EXACT_BF16), mask=m_own)
        # without a flush, the draft's decay, beta and key too (V-block 0 of the head, of the key
        # head's first value head): no program reads positions >= h in this launch
        sole = ok & (hc + t < LBCAP) & keep & (i_v == 0)
        if IS_KDA:
            tl.store(buf_ld + (o_pt * HV + i_hv) * K + o_k, b_ld, mask=tl.where(sole, m_k, False))
        else:
            tl.store(buf_ld + o_pt * HV + i_hv, b_ld, mask=sole)
        if RECOMPUTE:
            tl.store(buf_beta + o_pt * HV + i_hv, b_beta, mask=sole)
        p_kh = buf_k + (o_pt * HK + i_hk) * K + o_k
        tl.store(p_kh, _for_store(b_k, p_kh, EXACT_BF16), mask=tl.where(sole & own_hk, m_k, False))
        if t + 1 < T:
            # the draft becomes row h' + t (decay weight 1 so far)
            l_t = o_j == hc + t
            b_Ka = tl.where(l_t[:, None], b_k[None, :], b_Ka)
            b_Ua = tl.where(l_t[:, None], b_u[None, :], b_Ua)
            if not IS_KDA:
                b_La = tl.where(l_t, 0., b_La)

    if flush:
        # the new checkpoints, once the record tiles are dead (fewer live registers)
        if HP == 0:
            tl.store(p_C + o_C, b_C, mask=m_C)
        elif HP == 4:
            # this program's rows under the head's new tensor scale (the launch before); the
            # head's last program stores the scale, which the other programs' old rows decode with
            ts = tl.load(ts_new + i_b * HV + i_hv)
            st = i_s * 4294967296 + tl.load(epoch + i_s)
            store_nvfp4_rows(b_C, ts, lp_data, lp_scale, i_m, i_hv, o_v, m_v, o_k, sr_key, st, V, K, BK, BV, HP_SR)
            if last_at_head(head_arrive, i_m, NV):
                tl.store(lp_tscale + i_m, ts)
        elif HP_SR:
            # the stochastic-rounding stream of this write: slot and write count, as pool._write
            st = i_s * 4294967296 + tl.load(epoch + i_s)
            store_sr_rows(b_C, ckpt, hp_scale, i_m, i_hv, o_v, m_v, o_k, m_k, sr_key, st, V, K, HP)
        else:
            store_lp_rows(b_C, ckpt, hp_scale, i_m, o_v, m_v, o_k, m_k, V, K, HP)
        if HAS_LP:
            if LP != 4:
                store_lp_rows(b_C, lp_data, lp_scale, i_m, o_v, m_v, o_k, m_k, V, K, LP)
            else:
                # release this program's fp32 rows; the head's last program encodes the matrix
                if last_at_head(head_arrive, i_m, NV):
                    store_nvfp4_head(p_C, lp_data, lp_scale, lp_tscale, i_m, V, K, BK, RC)

    last = verify_hand_off(arrive, cursor, pending, epoch, i_s, hc, n, flush, HV * NV)
    if last & flush:
        _write_shared(k, a, A_log, dt_bias, buf_ld, buf_k, i_b, i_s, n, o_k, m_k,
                      stride_k_b, stride_k_t, stride_k_h, stride_a_b, stride_a_t, stride_a_h,
                      T, HV, HK, K, LBCAP, HVP, HKP, IS_KDA, USE_QK_L2NORM, EXACT_BF16)
        if RECOMPUTE:
            _write_shared_beta(b, buf_beta, i_b, i_s, n, stride_b_b, stride_b_t, stride_b_h, T, HV, LBCAP, HVP)


def lowp_verify(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                dt_bias: Tensor, scale: Optional[float], ckpt, ckpt_lp: Optional[dict],
                lp_format: Optional[str], buf_ld: Tensor, buf_w: Tensor, buf_k: Tensor,
                buf_v: Optional[Tensor], buf_beta: Optional[Tensor], cursor: Tensor, pending: Tensor,
                epoch: Tensor, slot_ids: Tensor, window: int, num_drafts: Optional[Tensor] = None,
                out: Optional[Tensor] = None, use_qk_l2norm: bool = True, *, family: str = "gdn",
                arrive: Optional[Tensor] = None, config: Optional[dict] = None, validate: bool = True,
                hp_format: str = "fp32", hp_rounding: str = "stochastic", seed: int = 0) -> Tensor:
    """Output-only verification of `T` tokens per row of a GDN (`family="gdn"`) or KDA (`"kda"`)
    layer on two checkpoints, in place; returns `out` `[Bt, T, HV, V]`.

    Arguments as :func:`replayssm.ops.gdn.replay_verify` (q, k `[Bt, T, Hk, K]`; v
    `[Bt, T, HV, V]`; a `[Bt, T, HV]`, KDA `[Bt, T, HV, K]`; b `[Bt, T, HV]`; records, cursor,
    pending, epoch, slot_ids, window, num_drafts `[Bt]` int32 or None, out, arrive, validate;
    `1 <= T <= 8`), and the checkpoints of :func:`replayssm.ops.gdn.precision.lowp_decode`:
    `ckpt` `[N, HV, V, K]` fp32, or a dict of `hp_format`'s parts (fp16, bf16, fp8_e4m3);
    `ckpt_lp` the parts of the low-precision copy in `lp_format` (fp16, bf16, fp8_e4m3, nvfp4;
    an nvfp4 copy needs an fp32 HP), with `buf_v` `[N, Lb, HV, V]` (record dtype) and
    `buf_beta` `[N, Lb, HV]` fp32, the raw records a flush refolds along the HP path; or
    `ckpt_lp`, `lp_format`, `buf_v`, `buf_beta` all None with a narrow HP (its one checkpoint:
    fp16, bf16, fp8_e4m3 or nvfp4).
    A row that flushes early (`h + n > window`) folds its committed records from `ckpt` and
    writes it (`hp_rounding` "stochastic": `formats.encode(S, hp_format, "stochastic",
    seed=seed, stream=slot * 2**32 + epoch)` bit for bit; "nearest": round-to-nearest) and the
    copy (round-to-nearest); its drafts then read the fp32 fold. Other rows' drafts read the
    copy. `config`: overrides of `verify_lp_config` (`BV`, `num_warps`).
    """
    if family not in ("gdn", "kda"):
        raise ValueError(f"family must be 'gdn' or 'kda', got {family!r}")
    if hp_rounding not in ("stochastic", "nearest"):
        raise ValueError(f"hp_rounding must be 'stochastic' or 'nearest', got {hp_rounding!r}")
    if (buf_v is None) != (buf_beta is None) or (buf_v is None) != (ckpt_lp is None):
        raise ValueError("buf_v and buf_beta come with a low-precision copy (ckpt_lp), and only with one")
    hp_parts = ckpt
    shared_nvfp4 = hp_format == "nvfp4" and ckpt_lp is None and lp_format is None
    if isinstance(ckpt, dict):
        hp = ckpt.get("data")
        shape = hp.shape
        if shared_nvfp4 and hp.dim() == 4:
            shape = (*hp.shape[:3], q.shape[-1])                # (the data packs two per byte)
        # the checks below see an fp32 stand-in of the HP parts' shape (checkpoint_args checks those)
        ckpt = torch.empty(shape, dtype=torch.float32, device=hp.device) if validate else hp
    if validate:
        Bt, T, Hk, K, HV, V = check_verify_inputs(family, q, k, v, a, b, A_log, dt_bias, out, num_drafts)
        if arrive is None:
            arrive = arrive_counter(ckpt.device, ckpt.shape[0]) if isinstance(ckpt, Tensor) \
                and ckpt.dim() == 4 else None
        N, Lb = check_state(family, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive,
                            HV, Hk, V, K, window)
        check_tensor("pending", pending, (N,), (torch.int32,), contiguous=True)
        if buf_v is not None:
            check_tensor("buf_v", buf_v, (N, Lb, HV, V), (buf_w.dtype,), contiguous=True)
            check_tensor("buf_beta", buf_beta, (N, Lb, HV), (torch.float32,), contiguous=True)
        if Lb < window + T:
            raise ValueError(f"buffer capacity Lb={Lb} must be at least window + T = {window} + {T}")
        check_slot_ids(slot_ids, Bt)
        check_devices(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ckpt=ckpt,
                      buf_ld=buf_ld, buf_w=buf_w, buf_k=buf_k, buf_v=buf_v, buf_beta=buf_beta,
                      cursor=cursor, pending=pending, epoch=epoch, arrive=arrive, slot_ids=slot_ids,
                      num_drafts=num_drafts, out=out)
        check_slot_values(slot_ids, N)
        check_cursor_values(cursor, slot_ids, Lb, window)
        _check_draft_counts(num_drafts, T)
    N, HV, V, K = (*ckpt.shape[:3], q.shape[-1])
    Bt, T, Hk = q.shape[0], q.shape[1], q.shape[2]
    LBCAP = buf_w.shape[1]
    if shared_nvfp4:
        ck = shared_args(hp_parts, hp_format, hp_rounding, seed, N, HV, V, K)
    else:
        ck = checkpoint_args(hp_parts, ckpt_lp, lp_format, hp_format, seed, N, HV, V, K)
    cfg = verify_lp_config(V, config)
    BV = cfg["BV"]
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if arrive is None:
        arrive = arrive_counter(ckpt.device, N)
    if Bt == 0:
        return out
    recompute = buf_v is not None
    gcfg = None if config is not None or not recompute else \
        _gluon_lp_config(family, q, v, ck, buf_ld, buf_w, buf_k, buf_v, cursor, pending, window)
    if gcfg is not None:
        launch_gluon_verify(q, k, v, a, b, A_log, dt_bias, _scale(scale, K), ck["ckpt"], buf_ld, buf_w, buf_k, cursor,
                            pending, epoch, arrive, slot_ids, num_drafts, int(window), out, use_qk_l2norm, gcfg["BV"],
                            gcfg["num_warps"], gcfg["maxnreg"], family, gcfg["kq"], mma=gcfg["mma"],
                            ckpt_lp=ck["lp_data"], lp_code=ck["LP"], buf_v=buf_v, buf_beta=buf_beta,
                            refold_rows=gcfg["refold_rows"], refold_mma=gcfg["refold_mma"])
        return out
    ts_new = None
    if shared_nvfp4:
        ts_new = scale_scratch(q.device, Bt * HV)
        _nvfp4_flush_scales[(HV, Bt)](
            ck["lp_data"], ck["lp_scale"], ck["lp_tscale"], buf_ld, buf_w, buf_k, cursor, slot_ids,
            num_drafts if num_drafts is not None else slot_ids, ts_new, int(window), T=T, HV=HV, HK=Hk, V=V, K=K,
            LBCAP=LBCAP, BK=triton.next_power_of_2(K), RC=min(16, triton.next_power_of_2(V)),
            IS_KDA=family == "kda", HAS_NDRAFT=num_drafts is not None, num_warps=4, num_stages=1)
    _lowp_verify_kernel[(HV * triton.cdiv(V, BV), Bt)](
        q, k, v, a, b, A_log, dt_bias, out,
        ck["ckpt"], ck["hp_scale"], ck["sr_key"], ck["lp_data"], ck["lp_scale"], ck["lp_tscale"],
        buf_ld, buf_w, buf_k, buf_v if recompute else buf_w, buf_beta if recompute else buf_ld,
        cursor, pending, epoch, arrive, head_counter(ckpt.device, N * HV), slot_ids,
        num_drafts if num_drafts is not None else slot_ids, ts_new if ts_new is not None else buf_ld,
        _scale(scale, K), int(window),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        T=T, HV=HV, HK=Hk, V=V, K=K, LBCAP=LBCAP,
        # rows: committed records and earlier drafts, h' + t < max(window, T) (verify.py)
        LB=max(2, triton.next_power_of_2(max(min(window, LBCAP), T))), BV=BV, BK=triton.next_power_of_2(K),
        HVP=triton.next_power_of_2(HV), HKP=triton.next_power_of_2(Hk), RC=min(16, BV),
        IS_KDA=family == "kda", USE_QK_L2NORM=bool(use_qk_l2norm), HAS_NDRAFT=num_drafts is not None,
        EXACT_BF16=_interpreting(), LP=ck["LP"], HP=ck["HP"], HAS_LP=ck["HAS_LP"],
        HP_SR=hp_rounding == "stochastic", RECOMPUTE=recompute,
        num_warps=cfg["num_warps"], num_stages=1)
    return out
