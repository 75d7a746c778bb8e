"""Mamba-2 speculative verification on ReplaySSM state (output-only), in Triton.

One launch verifies `T` tokens per row (SPEC section 4, Algorithm 2; the contract is
docs/state-layout.md, `verify`). A program owns a `[BV, BK]` tile of one head's checkpoint,
loads it once and serves all T queries from registers. Per row with slot `s`, cursor
`h = cursor[s]` and `n` drafts:

    flush = h + n > L:  C_s <- g_{0:h-1} C_s + sum_{j<h} g_{j+1:h-1} dt_j x_j k_j^T  (in registers,
                        stored), epoch[s] += 1, h' = 0;           else h' = h (C_s only read)
    y_t   = g_{0:p_t} (C q_t) + sum_{j<=p_t} g_{j+1:p_t} (k_j . q_t) dt_j x_j  (+ D x_t, * silu(z_t))

for t < n at position `p_t = h' + t` (records `j < h'` committed, read from the buffer; drafts
`h'..p_t` from the inputs, never read back), `g_{i:p} = exp(ld_i + ... + ld_p)`; `y_t = 0` for
t >= n. The drafts' records go to positions `h'..h'+n-1`; `cursor[s] = h'`, `pending[s] = n`.

This kernel serves T < TC_MIN_T drafts with one matrix-vector product of the tile per draft;
from TC_MIN_T on, `verify_mma` does the same step with exact 16-bit tensor-core products
(config key `mma`). On CUDA the default is the Gluon kernel (`gluon_verify`, config key
`gluon`), the same step with the tile copied asynchronously into shared memory; the CPU
interpreter runs these Triton kernels.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..utils.checks import check_slot_values, check_window
from ..utils.cursor import slot_bases, verify_hand_off
from ..utils.key_products import verify_key_products
from ..utils.launch import arrive_counter, gluon_aligned, slot_pads
from .common import (FLOAT_DTYPES, OPTIONAL_INPUTS, check_state, check_tensor, draft_decays, given, load_tile,
                     verify_row_bounds, write_shared_drafts)
from .gluon_verify import HAVE_GLUON, gluon_verify_unsupported, launch_gluon_verify
from .verify_mma import _replay_verify_mma_kernel

__all__ = ["replay_verify", "verify_config"]

MAX_DRAFT = 8
TC_MIN_T = 5          # drafts from which the Triton path takes the tensor-core kernel (verify_mma)


# ----------------------------------------------------------------------------------------------
# Kernel

@triton.jit
def _chunked(p, o_r, m_r, stride_r, o_c, o_i, K: tl.constexpr, KI: tl.constexpr):
    # offsets and mask of rows o_r (stride_r apart) of K columns as [KC, rows, KI]: Triton lays
    # KI across 8 lanes and the rows across lanes and warps, and keeps the KC chunks in each
    # thread, so a row reduction over K is mostly in-thread (3 shuffle levels, not 5)
    o_k = o_c[:, None, None] * KI + o_i[None, None, :]
    return p + (o_r[None, :, None] * stride_r + o_k), m_r[None, :, None] & (o_k < K)


@triton.jit
def _row_dot(b_X, b_q):
    # [KC, R, KI] tile times a [KC, KI] vector: the in-thread chunks first, then the lanes
    return tl.sum(tl.sum(b_X * b_q[:, None, :], axis=0), axis=1)


@triton.heuristics(dict(OPTIONAL_INPUTS, HAS_N=given("num_drafts"),
                        EVEN=lambda args: args["V"] % args["BV"] == 0 and args["BK"] == args["K"]))
@triton.jit
def _replay_verify_kernel(
    x, dt, B, C, A, dt_bias, D, z, out,
    ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch, arrive, slot_ids, num_drafts,
    pad_ckpt, pad_ld, pad_w, pad_k, pad_cur, pad_pend,
    stride_x_b, stride_x_t, stride_x_h, stride_dt_b, stride_dt_t,
    stride_B_b, stride_B_t, stride_B_g, stride_C_b, stride_C_t, stride_C_g,
    stride_z_b, stride_z_t, stride_z_h, stride_o_b, stride_o_t, stride_o_h,
    HV: tl.constexpr, Hk: tl.constexpr, V: tl.constexpr, K: tl.constexpr, LB: tl.constexpr,
    WINDOW: tl.constexpr, T: tl.constexpr, TP: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    KI: tl.constexpr, BL: tl.constexpr, NVB: tl.constexpr, HVP: tl.constexpr, HKP: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_N: tl.constexpr, EVEN: tl.constexpr,
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
    o_c = tl.arange(0, BK // KI)
    o_i = tl.arange(0, KI)
    o_k2 = o_c[:, None] * KI + o_i[None, :]                                             # [KC, KI]
    m_k2 = o_k2 < K
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
    # slot-strided state (vLLM's pages): the bases moved by the slot's padding
    ckpt, buf_ld, buf_w, buf_k, cursor = slot_bases(slot, ckpt, buf_ld, buf_w, buf_k, cursor, pad_ckpt, pad_ld,
                                                    pad_w, pad_k, pad_cur)
    pending += slot * pad_pend

    h, n, flush, hc, m_t, m_l, m_c = verify_row_bounds(cursor, slot, num_drafts, i_b, o_t, o_l, T, WINDOW, HAS_N)

    # int32 tile offsets on a 64-bit scalar base (a slot's checkpoint is far below 2^31 elements)
    p_S0 = ckpt + slot * (HV * V * K) + i_h * (V * K)
    p_S, m_S = _chunked(p_S0, o_v, m_v, K, o_c, o_i, K, KI)
    b_S = load_tile(p_S, m_S, EVEN)                                                     # [KC, BV, KI]

    # committed records: log decays of this head, keys of its group, values of its rows
    p_ld = buf_ld + slot * (LB * HV) + i_h
    p_kb = buf_k + slot * (LB * Hk * K) + i_g * K
    p_wb = buf_w + slot * (LB * HV * V) + i_h * V
    b_ldc = tl.load(p_ld + o_l * HV, mask=m_l, other=0.0)                               # [BL]
    b_ldc = tl.where(m_l, b_ldc, 0.0)
    p_Kb, m_Kb = _chunked(p_kb, o_l, m_c, Hk * K, o_c, o_i, K, KI)
    b_Kb = tl.load(p_Kb, mask=m_Kb, other=0.0)
    b_Kb = tl.where(m_c[None, :, None], b_Kb.to(tl.float32), 0.0)                       # [KC, BL, KI]
    b_Wb = tl.load(p_wb + o_l[:, None] * (HV * V) + o_v[None, :], mask=m_c[:, None] & m_v[None, :],
                   other=0.0)
    b_Wb = tl.where(m_c[:, None], b_Wb.to(tl.float32), 0.0)                             # [BL, BV]

    # the drafts, from the inputs: keys of the group, values of these rows, dt and log decay
    p_Kd, m_Kd = _chunked(B + i_b * stride_B_b + i_g * stride_B_g, o_t, m_t, stride_B_t, o_c, o_i, K, KI)
    b_Kd = tl.load(p_Kd, mask=m_Kd, other=0.0).to(tl.float32)                          # [KC, TP, KI]
    b_Xi = tl.load(x + i_b * stride_x_b + i_h * stride_x_h + o_t[:, None] * stride_x_t + o_v[None, :],
                   mask=m_t[:, None] & m_v[None, :], other=0.0)                         # [TP, BV]
    b_Xd = b_Xi.to(tl.float32)
    b_rA, b_dtd, b_ldd = draft_decays(dt, dt_bias, A, i_b * stride_dt_b, stride_dt_t, i_h, o_t, m_t)   # [TP]

    # committed suffixes sum_{j<i<h} ld_i, each of same-signed terms (never a difference of
    # prefix sums: weights near 1 keep full precision)
    b_sfx = tl.sum(tl.where(o_l[None, :] > o_l[:, None], b_ldc[None, :], 0.0), axis=1)   # [BL]

    if flush:
        # C <- g_{0:h-1} C + sum_{j<h} g_{j+1:h-1} dt_j x_j k_j^T in registers, one exact fp32
        # rank-1 update per record (re-read from L1/L2), then stored: the drafts follow from here
        b_cf = tl.where(m_l, tl.exp(b_sfx) * (b_ldc * b_rA), 0.0)
        b_S = b_S * tl.exp(tl.sum(b_ldc, axis=0))
        for j in range(0, h):
            c_j = tl.sum(tl.where(o_l == j, b_cf, 0.0), axis=0)
            w_j = tl.load(p_wb + j * (HV * V) + o_v, mask=m_v, other=0.0).to(tl.float32)
            k_j = tl.load(p_kb + j * (Hk * K) + o_k2, mask=m_k2, other=0.0).to(tl.float32)
            b_S += (c_j * w_j)[None, :, None] * k_j[:, None, :]
        tl.store(p_S, b_S, mask=m_S)
    b_Lc = tl.sum(tl.where(m_c, b_ldc, 0.0), axis=0)                                   # log g_{0:hc-1}
    b_cc = tl.where(m_c, b_ldc * b_rA, 0.0)                                             # dt_j

    if HAS_D:
        b_D = tl.load(D + i_h).to(tl.float32)
    p_x = x + i_b * stride_x_b + i_h * stride_x_h + o_v
    for t in tl.static_range(T):
        b_q = tl.load(C + i_b * stride_C_b + t * stride_C_t + i_g * stride_C_g + o_k2, mask=m_k2,
                      other=0.0).to(tl.float32)                                         # [KC, KI]
        m_r = o_t <= t
        # the drafts' own partial sums: sum_{r<i<=t} ld_i per draft r, and the total up to t
        b_dsx = tl.sum(tl.where((o_t[None, :] > o_t[:, None]) & (o_t[None, :] <= t), b_ldd[None, :], 0.0),
                       axis=1)                                                          # [TP]
        b_Dt = tl.sum(tl.where(m_r, b_ldd, 0.0), axis=0)
        b_y = tl.exp(b_Lc + b_Dt) * _row_dot(b_S, b_q)                                  # [BV]
        b_wc = tl.where(m_c, tl.exp(b_sfx + b_Dt) * b_cc * _row_dot(b_Kb, b_q), 0.0)
        b_y += tl.sum(b_Wb * b_wc[:, None], axis=0)
        b_wd = tl.where(m_r, tl.exp(b_dsx) * b_dtd * _row_dot(b_Kd, b_q), 0.0)
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

    # the drafts' records at h'..h'+n-1. A program's own rows of x: after a barrier (its threads
    # read those positions in the fold). x as given (exact when the buffer has x's dtype).
    tl.debug_barrier()
    m_tv = m_t[:, None] & m_v[None, :]
    tl.store(p_wb + (hc + o_t)[:, None] * (HV * V) + o_v[None, :], b_Xi.to(buf_w.dtype.element_ty), mask=m_tv)
    if not flush:
        # positions >= h, which no program reads: the owners write them directly
        if i_v == 0:
            tl.store(p_ld + (hc + o_t) * HV, b_ldd, mask=m_t)
            if i_h % HG == 0:
                p_Kn, _ = _chunked(p_kb, hc + o_t, m_t, Hk * K, o_c, o_i, K, KI)
                tl.store(p_Kn, b_Kd.to(buf_k.dtype.element_ty), mask=m_Kd)

    last = verify_hand_off(arrive, cursor, pending, epoch, slot, hc, n, flush, HV * NVB)
    if flush & last:
        # positions 0..n-1 held committed records that other programs of the slot read
        write_shared_drafts(dt, B, A, dt_bias, buf_ld, buf_k, slot, n, i_b * stride_dt_b, stride_dt_t,
                            i_b * stride_B_b, stride_B_t, stride_B_g, o_k, m_k, HV, Hk, K, LB, T, HVP, HKP)


# ----------------------------------------------------------------------------------------------
# Launch configuration


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _gluon_default(HV: int, V: int, K: int, Hk: int, T: int, device, window: Optional[int], Lb: Optional[int]):
    """The Gluon kernel's default block (the largest of 64, 32, 16 rows dividing V, a warp per 16
    rows) where it runs by default: on CUDA, outside the interpreter, where it covers the shape
    (window 16 when not given); else None."""
    bv = next((b for b in (64, 32, 16) if V % b == 0), None)
    if bv is None or device is None or torch.device(device).type != "cuda" or _interpreting():
        return None
    L = 16 if window is None else window
    if gluon_verify_unsupported(HV, V, K, Hk, T, L, L + T if Lb is None else Lb, bv, bv // 16):
        return None
    return bv


# `kq` by default from this many drafts and programs per key group (H200, batch 256, window
# 16, drafts all rejected / all accepted, as multiples of a conventional step: Nano-4B, 60
# programs a group, T=4 0.97/1.14 -> 0.95/1.08, T=8 1.54/2.02 -> 1.35/1.72, but T=2
# 0.77/0.82 -> 0.81/0.85; Super, 16 programs, slower at every T, e.g. T=8 1.08/1.36 ->
# 1.11/1.40): the extra launch pays where many programs would form the same products
KQ_MIN_T, KQ_MIN_PROGRAMS = 4, 32


# the Gluon kernel's tile products on the tensor cores (`mma`) by default at this many drafts,
# for the program sizes measured (Nano-4B 16 rows, Super 64). H100, batch 256, window 16,
# drafts all rejected .. all accepted, over a conventional step, the build that stages every
# operand before the tile lands (verify_gluon_mma_h100.json): Super T=8 0.80-1.02x against the
# FMA kernel's 0.84-1.04x, Nano-4B 1.00-1.26x against 1.12-1.35x; at T=4 mma was slower (Super
# 0.75-0.84x against 0.69-0.79x) or level (Nano-4B 0.81-0.93x against 0.83-0.92x). The H200 is
# not measured. Its GPU tests: tests/test_verify_gluon_mamba2.py -k mma
GLUON_MMA_T = 8
GLUON_MMA_DEFAULT = True
GLUON_MMA_BV = (16, 64)


def gluon_mma_default(T: int, BV) -> bool:
    """Whether the Gluon verify forms the tile's products on the tensor cores by default."""
    return GLUON_MMA_DEFAULT and BV in GLUON_MMA_BV and T == GLUON_MMA_T


def kq_default(HV: int, V: int, Hk: int, T: int, BV) -> bool:
    """Whether the Gluon verify forms the key products in a launch before it by default."""
    return isinstance(BV, int) and T >= KQ_MIN_T and (HV // Hk) * -(-V // BV) >= KQ_MIN_PROGRAMS


def verify_config(HV: int, V: int, K: int, Hk: int, T: int, config: Optional[dict] = None, *, device=None,
                  window: Optional[int] = None, Lb: Optional[int] = None) -> dict:
    """The verify kernel's launch config: `BV` value rows per program (a power of two; ceil(V / BV)
    blocks per head; at least 16 for `mma`, the M side of its products), `num_warps`,
    `num_stages`, `gluon`, `kq`, `mma`. `config` overrides any of them.

    `gluon` (GPU only): the Gluon kernel (gluon_verify.py), `BV = 16 * num_warps`. The default
    on a CUDA `device` (outside the interpreter) wherever `gluon_verify_unsupported` says it
    covers the shape (K = 128, V a multiple of 16, windows up to 32), with the largest of 64,
    32, 16 rows dividing V and a warp per 16 (Super BV=64 with 4 warps, BV=32 with 2 the other
    candidate; Nano-4B BV=16 with 1). A config that names only BV or num_warps gets the other
    from `BV = 16 * num_warps`; one whose pair does not fit the Gluon kernel runs the Triton
    kernels, unless it asks for `gluon=True` (then ValueError). Where the Gluon kernel cannot
    run (the CPU interpreter, a window above 32 at launch) the Triton kernels run with the same
    BV and num_warps.

    `mma`: the Triton kernel with exact 16-bit tensor-core products (verify_mma.py), the Triton
    kernels' default from `TC_MIN_T` drafts on (below it, and with `mma=False`, the row-dot
    kernel). Not the GPU's default: on an H100 at batch 256, T = 8, it took 1.48-1.65x a
    conventional step for Super (BV=64, 4 warps, `kq`) and 1.64-1.78x for Nano-4B (BV=32, 2
    warps) where the Gluon kernel took 0.85-1.05x and 1.12-1.36x (docs/verify.md). With
    `gluon=True`: the Gluon kernel with the tile's products with the queries on the tensor
    cores, exact as above (`utils.gluon_mma._tile_vectors_mma`), `kq` on unless the config says
    otherwise; the default at T = 8 for 16- and 64-row programs (`gluon_mma_default`).

    `kq`: the group's key products with the drafts' queries, committed records' and drafts'
    keys alike, formed first by one program per (row, group)
    (`utils.key_products.verify_key_products`) instead of by every program of the group's heads
    and V-blocks, for the Gluon kernel and `mma` (a power-of-two K). On by default where it
    paid: the Gluon kernel's `kq_default` (H200), `mma` at 64-row programs (H100).

    The Triton kernels' defaults (`gluon=False`), from the shape: below TC_MIN_T blocks of at
    most 64 rows dividing V (no idle lanes; Nano-4B's 80 = 5 x 16), with warps so that a thread
    holds 128 tile elements; from it on `mma` with 64 rows in 4 warps and `kq` where 64 divides
    V, else 32 rows in 2 warps (H100, batch 256, T = 8, the figures above; Super at 32 rows
    1.92-2.03x, Nano-4B at 64 rows with `kq` 2.00-2.22x)."""
    BK = triton.next_power_of_2(K)
    if T >= TC_MIN_T:
        bv = 64 if V % 64 == 0 else 32
        cfg = dict(BV=bv, num_warps=bv // 16, num_stages=1, gluon=False, kq=bv == 64 and K == BK, mma=True)
    else:
        bv = next((b for b in (64, 32, 16) if V % b == 0), min(64, max(16, triton.next_power_of_2(V))))
        cfg = dict(BV=bv, num_warps=max(1, min(8, bv * BK // (32 * 128))), num_stages=1, gluon=False, kq=False,
                   mma=False)
    config = dict(config or {})
    unknown = set(config) - set(cfg)
    if unknown:
        raise ValueError(f"config: unknown keys {sorted(unknown)}; expected a subset of {sorted(cfg)}")
    for key in ("gluon", "kq", "mma"):
        if not isinstance(config.get(key, False), bool):
            raise ValueError(f"config: {key} must be a bool, got {config[key]!r}")
    # mma alone: the Triton tensor-core kernel; with gluon=True: the Gluon kernel's tile products
    gbv = None if config.get("mma") and not config.get("gluon") else _gluon_default(HV, V, K, Hk, T, device,
                                                                                      window, Lb)
    if config.get("gluon", gbv is not None):
        bv, nw = config.get("BV"), config.get("num_warps")
        if bv is None:
            bv = 16 * nw if isinstance(nw, int) else gbv or 16
        # the tile's products on the tensor cores take the keys' products from the launch before
        # (kq): the row loop's register-held queries would otherwise stay live beside them
        mma = config.get("mma", gbv is not None and gluon_mma_default(T, bv))
        cfg = dict(BV=bv, num_warps=max(1, bv // 16) if isinstance(bv, int) else 1, num_stages=1, gluon=True,
                   kq=bool(mma) or kq_default(HV, V, Hk, T, bv), mma=bool(mma))
    cfg.update(config)
    for key in ("BV", "num_warps"):
        val = cfg[key]
        if isinstance(val, bool) or not isinstance(val, int) or val < 1 or val & (val - 1):
            raise ValueError(f"config: {key} must be a power of two, got {val!r}")
    if cfg["gluon"]:
        L = 16 if window is None else window
        why = gluon_verify_unsupported(HV, V, K, Hk, T, L, L + T if Lb is None else Lb, cfg["BV"], cfg["num_warps"])
        if why and config.get("gluon"):
            raise ValueError(f"config: gluon=True does not cover this launch: {why}")
        if why:
            cfg["gluon"] = False          # a launch shape the Gluon kernel does not take: the Triton kernels
            cfg["mma"] = config.get("mma", T >= TC_MIN_T)
    if cfg["mma"] and cfg["kq"] and K & (K - 1):
        raise ValueError(f"config: kq with mma takes a power-of-two K (the key products' launch), got K={K}")
    if cfg["mma"] and cfg["BV"] < 16:
        raise ValueError(f"config: BV must be at least 16 for mma (the Triton kernel from T = {TC_MIN_T}: the "
                         f"tiles' products), got {cfg['BV']}")
    ns = cfg["num_stages"]
    if isinstance(ns, bool) or not isinstance(ns, int) or ns < 1:
        raise ValueError(f"config: num_stages must be a positive int, got {ns!r}")
    return cfg


# ----------------------------------------------------------------------------------------------
# Launch and the Python boundary


def _launch_verify(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch,
                   arrive, slot_ids, num_drafts, out, window, BV, num_warps, num_stages, gluon=False, kq=False,
                   mma=False):
    Bt, T, HV, V = x.shape
    Hk, K = B.shape[2], B.shape[3]
    LB = buf_ld.shape[1]
    if Bt == 0:
        return
    if (gluon and HAVE_GLUON and x.is_cuda and not _interpreting()
            and gluon_verify_unsupported(HV, V, K, Hk, T, window, LB, BV, num_warps) is None
            and gluon_aligned(ckpt, buf_ld, buf_w, buf_k)):
        launch_gluon_verify(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch,
                            arrive, slot_ids, num_drafts, out, window, BV, num_warps, kq=kq, mma=mma)
        return
    nvb = triton.cdiv(V, BV)
    if mma:
        BK, TP = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(T))
        BL = max(16, triton.next_power_of_2(min(window, LB)))
        pads = slot_pads(ckpt, buf_ld, buf_w, buf_k, cursor, pending)
        kqs = verify_key_products(C, B, buf_k, cursor, slot_ids, num_drafts, window, BL, TP, TP, pads["pad_k"],
                                  pads["pad_cur"]) if kq else slot_ids
        _replay_verify_mma_kernel[(HV * nvb, Bt)](
            x, dt, B, C, A, dt_bias, D, z, out,
            ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch, arrive, slot_ids, num_drafts, kqs,
            *pads.values(),
            *_token_strides(x, dt, B, C, z, out),
            HV=HV, Hk=Hk, V=V, K=K, LB=LB, WINDOW=window, T=T, TP=TP, BV=BV, BK=BK, BKC=min(32, BK), BL=BL,
            NVB=nvb, HVP=triton.next_power_of_2(HV), HKP=triton.next_power_of_2(Hk), KQ=bool(kq),
            WIDEN=_interpreting(),
            num_warps=num_warps, num_stages=num_stages)
        return
    BK = triton.next_power_of_2(K)
    # D, z and num_drafts absent: None (the kernel's heuristics set HAS_D, HAS_Z, HAS_N; EVEN too)
    _replay_verify_kernel[(HV * nvb, Bt)](
        x, dt, B, C, A, dt_bias, D, z, out,
        ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch, arrive, slot_ids, num_drafts,
        *slot_pads(ckpt, buf_ld, buf_w, buf_k, cursor, pending).values(),
        *_token_strides(x, dt, B, C, z, out),
        HV=HV, Hk=Hk, V=V, K=K, LB=LB, WINDOW=window, T=T, BV=BV, BK=BK,
        BL=max(16, triton.next_power_of_2(min(window, LB))), NVB=nvb,
        HVP=triton.next_power_of_2(HV), HKP=triton.next_power_of_2(Hk), TP=triton.next_power_of_2(T),
        KI=min(32, BK), num_warps=num_warps, num_stages=num_stages)


def _token_strides(x, dt, B, C, z, out):
    zs = (z.stride(0), z.stride(1), z.stride(2)) if z is not None else (0, 0, 0)
    return (x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1),
            B.stride(2), C.stride(0), C.stride(1), C.stride(2), *zs, out.stride(0), out.stride(1), out.stride(2))


@torch.library.custom_op(
    "replayssm::mamba2_replay_verify",
    mutates_args=("out", "ckpt", "buf_ld", "buf_w", "buf_k", "cursor", "pending", "epoch", "arrive"),
)
def _replay_verify_op(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, dt_bias: Tensor,
                      D: Optional[Tensor], z: Optional[Tensor], ckpt: Tensor, buf_ld: Tensor,
                      buf_w: Tensor, buf_k: Tensor, cursor: Tensor, pending: Tensor, epoch: Tensor,
                      arrive: Tensor, slot_ids: Tensor, num_drafts: Optional[Tensor], out: Tensor,
                      window: int, BV: int, num_warps: int, num_stages: int, gluon: bool = False,
                      kq: bool = False, mma: bool = False) -> None:
    _launch_verify(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch,
                   arrive, slot_ids, num_drafts, out, window, BV, num_warps, num_stages, gluon, kq, mma)


@_replay_verify_op.register_fake
def _(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch, arrive,
      slot_ids, num_drafts, out, window, BV, num_warps, num_stages, gluon=False, kq=False, mma=False) -> None:
    return None


def _check_verify_inputs(x, dt, B, C, A, dt_bias, D, z):
    """Shapes of one verify step's inputs; returns (Bt, T, HV, V, Hk, K)."""
    check_tensor("x", x)
    if x.dim() != 4:
        raise ValueError(f"x: expected [Bt, T, HV, V], got shape {tuple(x.shape)}")
    if not isinstance(B, Tensor) or B.dim() != 4:
        raise ValueError(f"B: expected [Bt, T, Hk, K], got {getattr(B, 'shape', type(B).__name__)}")
    Bt, T, HV, V = x.shape
    Hk, K = B.shape[2], B.shape[3]
    dev = x.device
    check_tensor("x", x, (Bt, T, HV, V), FLOAT_DTYPES, dev, inner=True)
    if not 1 <= T <= MAX_DRAFT:
        raise ValueError(f"x: {T} draft tokens, expected 1..{MAX_DRAFT}")
    if Hk == 0 or HV % Hk:
        raise ValueError(f"B: {Hk} groups do not divide the {HV} heads of x")
    check_tensor("dt", dt, (Bt, T, HV), FLOAT_DTYPES, dev, inner=True)
    check_tensor("B", B, (Bt, T, Hk, K), FLOAT_DTYPES, dev, inner=True)
    check_tensor("C", C, (Bt, T, Hk, K), FLOAT_DTYPES, dev, inner=True)
    check_tensor("A", A, (HV,), FLOAT_DTYPES, dev, contiguous=True)
    check_tensor("dt_bias", dt_bias, (HV,), FLOAT_DTYPES, dev, contiguous=True)
    if D is not None:
        check_tensor("D", D, (HV,), FLOAT_DTYPES, dev, contiguous=True)
    if z is not None:
        check_tensor("z", z, (Bt, T, HV, V), FLOAT_DTYPES, dev, inner=True)
    if Bt > 65535 or HV * triton.cdiv(V, 16) > 65535:
        raise ValueError(f"x: batch {Bt} or heads {HV} above the grid limit 65535")
    return Bt, T, HV, V, Hk, K


def replay_verify(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, dt_bias: Tensor,
                  D: Optional[Tensor], z: Optional[Tensor], ckpt: Tensor, buf_ld: Tensor,
                  buf_w: Tensor, buf_k: Tensor, cursor: Tensor, pending: Tensor, epoch: Tensor,
                  slot_ids: Tensor, window: int, num_drafts: Optional[Tensor] = None,
                  out: Optional[Tensor] = None, config: Optional[dict] = None, *,
                  arrive: Optional[Tensor] = None, validate: bool = True) -> Tensor:
    """Output-only verification of `T` tokens per row on ReplaySSM state, in place; returns `y`
    `[Bt, T, HV, V]` in x's dtype.

    Token inputs (a draft dim after the batch; last dim contiguous, any batch and draft
    strides): `x` `[Bt, T, HV, V]`; `dt` `[Bt, T, HV]` (raw, before `softplus(dt + dt_bias)`);
    `B`, `C` `[Bt, T, Hk, K]`; `z` `[Bt, T, HV, V]` or None. Layer parameters `A`, `dt_bias`
    `[HV]`, `D` `[HV]` or None. State as in `replay_decode` plus `pending` `[N]` int32;
    `buf_*` hold `Lb >= window + T` positions. `1 <= T <= 8`.

    Row b with slot `s = slot_ids[b] >= 0`, cursor `h = cursor[s]` (`0 <= h <= window`, not
    checked) and `n = num_drafts[b]` (`[Bt]` int32 on the device, `1..T`; None: T) gets `y[b, t]`
    for `t < n`, the output of the conventional recurrence from the state at `h` over tokens
    `0..t`, and `y[b, t] = 0` beyond. If `h + n > window` the committed records are first
    folded into `ckpt[s]` (early flush, `epoch[s] += 1`) and the drafts start at `h' = 0`, else
    `h' = h`. The drafts' records go to positions `h'..h'+n-1`; `cursor[s] = h'`,
    `pending[s] = n` (a commit then moves the cursor by the accepted count). Negative slot ids
    are padding rows: `y[b] = 0`, nothing touched.

    `out` `[Bt, T, HV, V]` of x's dtype, last dim contiguous: written when given (then, with
    `validate=False`, the call allocates nothing, syncs nothing and is capturable in a CUDA
    graph). `config`: overrides of `verify_config` (`BV`, `num_warps`, `num_stages`, `gluon`: on
    CUDA the Gluon kernel by default where it covers the shape, see `verify_config`). `arrive`
    `[N]` int32 zero-initialised (default: a cached per-device counter). `validate` checks
    shapes, dtypes and devices, the slot ids' range and uniqueness (`utils.checks`: a host read,
    skipped while capturing or compiling) and draft counts held on the CPU.
    """
    if validate:
        Bt, T, HV, V, Hk, K = _check_verify_inputs(x, dt, B, C, A, dt_bias, D, z)
        dev = x.device
        N, Lb = check_state(ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids, Bt=Bt, HV=HV, V=V,
                            Hk=Hk, K=K, device=dev, pending=pending, slot_strided=True)
        if num_drafts is not None:
            check_tensor("num_drafts", num_drafts, (Bt,), (torch.int32,), dev, contiguous=True)
            if num_drafts.device.type == "cpu" and Bt and not bool(((num_drafts >= 1) & (num_drafts <= T)).all()):
                raise ValueError(f"num_drafts must lie in 1..{T}, got {num_drafts.tolist()}")
        if out is not None:
            check_tensor("out", out, (Bt, T, HV, V), (x.dtype,), dev, inner=True)
        check_window(window, Lb)
        if Lb < window + T:
            raise ValueError(f"buf_ld: capacity Lb={Lb} below window + T = {window + T}")
        check_slot_values(slot_ids, N)
    cfg = verify_config(x.shape[2], x.shape[3], B.shape[3], B.shape[2], x.shape[1], config, device=x.device,
                        window=int(window), Lb=buf_ld.shape[1])
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if arrive is None:
        arrive = arrive_counter(x.device, ckpt.shape[0])
    args = (x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch, arrive,
            slot_ids, num_drafts, out, int(window), cfg["BV"], cfg["num_warps"], cfg["num_stages"], cfg["gluon"],
            cfg["kq"], cfg["mma"])
    if torch.compiler.is_compiling():
        torch.ops.replayssm.mamba2_replay_verify(*args)
    else:
        _launch_verify(*args)
    return out
