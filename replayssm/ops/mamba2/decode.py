"""Mamba-2 standard decode on ReplaySSM state (checkpoint + ring buffer of records), in Triton.

One launch per decode step; a program owns one row, `HPP` heads of a group and a block of
`BV` value rows.
The contract is docs/state-layout.md ("Standard decode step"); the mathematics is SPEC.md
sections 2-3; the float64 oracle is `replayssm.reference.Mamba2Params.step`.

Per row with slot `s` and cursor `h = cursor[s]`, window `L`:

    record h      = (ld, w, k) = (dt*A, x, B)         dt = softplus(dt_raw + dt_bias)
    y             = g_{0:h} (C_s q) + sum_{j<=h} g_{j+1:h} (k_j . q) dt_j x_j  (+ D x, * silu(z))
    if h + 1 < L: write record h to the buffer; cursor[s] = h + 1
    else:         C_s <- g_{0:h} C_s + sum_{j<=h} g_{j+1:h} dt_j x_j k_j^T;  cursor[s] = 0; epoch[s] += 1

with `g_{i:h} = exp(sum_{i<=j<=h} ld_j)` and, for buffered records, `dt_j = ld_j / A`. The
record keeps `x` (SPEC's `w = dt x` is formed when it is read): in a buffer of the model's
dtype it is an exact copy, so bf16 records of a bf16 model add no rounding. Record `h` (the
current token) comes from registers; on a flush step it is folded straight into the
checkpoint and never written to the buffer (the buffer restarts at position 0, so it would be
dead on arrival).
"""
from __future__ import annotations

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

__all__ = ["replay_decode", "REPLAY_CONFIGS", "resolve_config", "eager_max_batch", "EAGER_CONFIGS"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_RECORD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLUSH_MODES = {"fma": 0, "tf32x3": 1}

# Launch configurations, fixed per shape `(HV, V, K, G)` and batch size (never autotuned: the
# kernels write state in place, and autotuning would replay them on the live state). An entry
# is a config or a list of `(max_batch, config)`, the first whose `max_batch` >= the batch
# applies. Keys of a config:
#   BV          value rows per program (power of two; ceil(V / BV) blocks per head)
#   num_warps, num_stages
#   HPP         replay only: heads per program (divides the HV // G heads of a group); the
#               group's keys and their products with the query are shared by them
#   recmask     replay only: predicate record loads on the cursor (no traffic for empty
#               positions; the loads wait for the cursor) or only on the window (issued at once)
#   prefetch    replay only: load the next head's checkpoint tile before this head's arithmetic
#   flush       replay only: the fold [BV, h] x [h, K] of a flush, "fma" (one rank-1 update per
#               record, exact fp32) or "tf32x3" (tl.dot on tensor cores, three tf32 passes)
#   KS          replay only: the checkpoint tile held as KS slices of K per thread (ops/utils/tiles.py;
#               1: a plain [BV, K] tile); KS > 1 needs flush="fma"
#   flushrows   replay only: rows per chunk of the FMA flush's fold (the tile re-read in chunks
#               of min(flushrows, BV) rows; 16 by default). Fewer rows cut the registers of this
#               rare path, which every program is allocated (Nano-4B's row-block table config:
#               152 registers with 16, 115 with 4, offline triton 3.6), but lengthen the fold:
#               at batch 256, Super 1.60x / 1.40x with 8 / 4 against 1.58x with 16, Nano-4B
#               1.42x / 1.38x against 1.51x (variants_v24_flushrows.json); the tables keep 16
#   warpsum     replay only: the records' sum over positions inside each warp (`_records_dot`),
#               not across warps through shared memory; for record tiles of up to 16 positions
#               (windows up to 16): at window 32 it measured slower (Super, batch 256: 1.22x
#               against 1.36x, variants_v22_L32_super.json), so wider tiles take the plain sum
#   rows        replay only: a program owns BV consecutive rows of the checkpoint seen as
#               [HV * V, K] (BV <= V, dividing a group's rows), which may span two heads,
#               instead of a BV-row block of one head (`_replay_decode_rows_kernel`)
#   ablate      replay only (per-head kernel): timing ablations that compute wrong results,
#               never for use (docs/decode-kernels.md, "What limits them"): bit 0 leaves out the
#               flush's fold of the buffered records, bit 1 the records' reads (log decays,
#               values, keys) for the outputs and the weights (loads predicated off,
#               arithmetic kept)
#   gluon       replay only, GPU only: the Gluon kernel (gluon_decode.py): the per-head program
#               with the checkpoint tile copied asynchronously into shared memory while the
#               records are read and formed. Where `gluon_decode.gluon_supported` says no (K other
#               than 128, BV other than 16 * num_warps, windows above 32), and on the CPU
#               interpreter, the Triton per-head kernel runs with the same keys
#   sync, maxnreg  see resolve_config
# chosen by H200 sweeps at batch 1, 8 and 256, window 16 (benchmarks/sweep_programs.sh;
# benchmarks/results/variants_*.json). Small batches are latency-bound: small programs (one
# warp at batch <= 2), record loads issued before the cursor is known, the flush on tensor
# cores from the record tiles already in registers (no dependent loads in a loop). Larger
# batches: one head per program for Super (looping over heads raised registers more than
# sharing the keys saved), six per program for Nano-4B (its 80-row heads fill 16-row blocks).
_TINY = (2, dict(BV=16, num_warps=1, HPP=1, recmask=False, prefetch=False, flush="fma", KS=8))
_SMALL = (8, dict(BV=16, num_warps=2, HPP=1, recmask=False, prefetch=False, flush="fma", KS=4))
# Super at batch 16: one-warp row blocks of 32 (rows=True), 1.18x against 1.02x for the
# large-batch entry (variants_v14_b8.json); at batch 64 the two tie, at 256 the per-head
# blocks of 64 win (variants_v12_rows.json), with the records summed inside each warp
# (warpsum): 1.57-1.58x against 1.50-1.51x at 256, 1.62x against 1.54-1.55x at 512, 1.40x
# against 1.35x at 64 (variants_v16_warpsum.json, variants_v17_warpsum.json).
# From batch 17 on, the Gluon kernel (gluon_decode.py; the GPU only, the interpreter runs the
# Triton per-head kernel with the same keys): Super 1.79x at batch 256 against 1.55x for the
# Triton kernel's entry (BV=64, 4 warps, recmask=True, warpsum=True), 1.59x against 1.38x at 64,
# 1.76x against 1.57x at 512 (variants_v38_super.json, variants_v40_super.json). Windows
# above 16 (record tiles of 32 positions) take LONG_WINDOW_CONFIGS's overrides.
_SUPER = [_TINY, _SMALL,
          (16, dict(BV=32, num_warps=1, HPP=1, recmask=False, prefetch=False, KS=1, rows=True)),
          (1 << 30, dict(BV=64, num_warps=4, HPP=1, recmask=False, prefetch=False, warpsum=True, gluon=True))]
REPLAY_CONFIGS = {
    (128, 64, 128, 8): _SUPER,                                                  # Nemotron-3-Super
    # Nano-4B from batch 9 on: the Gluon kernel in one-warp programs of 16 rows of one head
    # (80 = 5 x 16), 1.73x at batch 256 against 1.44x for the Triton row-block kernel
    # (one-warp programs of 32 rows of [HV * V, K], rows=True; variants_v40_nano.json)
    (96, 80, 128, 8): [_TINY, _SMALL,
                       (1 << 30, dict(BV=16, num_warps=1, HPP=1, recmask=False, prefetch=False, rows=False,
                                      gluon=True))],
    (64, 64, 128, 8): _SUPER,                                                   # Nemotron-3-Nano-30B
}


# The Gluon entries above at windows above 16 (record tiles of 32 positions, more registers):
# overrides per shape, batch 256, window 32 (variants_v45_variants.json): Super 1.73x with
# registers capped at 80 (six programs per SM) against 1.70x uncapped (96), Nano-4B 1.29x
# capped at 128 against 1.18x uncapped (181); the Triton kernels measured 1.27x and 0.76x there
# (decode_h200.json, 5750659)
LONG_WINDOW_CONFIGS = {
    (128, 64, 128, 8): dict(maxnreg=80),                                        # Super
    (96, 80, 128, 8): dict(maxnreg=128),                                        # Nano-4B
    (64, 64, 128, 8): dict(maxnreg=80),                                         # Nano-30B
}


# The eager step (window 1, see replay_decode) per shape `(HV, V, K, G)`: a list of
# `(max_batch, launch config)`; batches up to the last max_batch take it (the slot pool decodes
# them with window 1), each with the first entry's config whose max_batch >= the batch ({}:
# the conventional table's). Small batches are latency-bound: a window only lengthens each
# program's chain there. Chosen on the H200 (benchmarks/results/eager_sweep_v13.json: every
# candidate config timed for the eager step and for the conventional kernel in one run).
# Batches 5-8 with bf16 token inputs: one-warp programs of 16 rows, 15.76 us (Super) and
# 14.73 us (Nano-4B) against 16.34 and 15.41 for the earlier entries and 15.60 and 14.75 for
# the conventional kernel's best configs (eager_sweep_v17_mamba2_b8.json); with them batch 8
# measured 1.00-1.03x (Super) and 1.05x (Nano-4B), decode_h200_b8.json. Nano-4B's batches 3-4
# keep the conventional kernel's config: with the 16-row programs batch 4 measured 0.89x
# there (7.53 against 7.50 us, 1.00x, with the conventional config in the sweep).
EAGER_CONFIGS = {
    (128, 64, 128, 8): [(1, dict(BV=32, num_warps=4)), (2, dict(BV=64, num_warps=8)),     # Super
                        (4, dict(BV=32, num_warps=1)), (8, dict(BV=16, num_warps=1))],
    (96, 80, 128, 8): [(1, dict(BV=16, num_warps=2)), (2, dict(BV=32, num_warps=4)),      # Nano-4B
                       (4, {}), (8, dict(BV=16, num_warps=1))],
}


def eager_max_batch(HV: int, V: int, K: int, G: int) -> int:
    """The largest batch for which the tables prefer the eager step (window 1) at this shape
    (0: never). The slot pool decodes such batches with window 1."""
    entry = EAGER_CONFIGS.get((HV, V, K, G))
    return entry[-1][0] if entry else 0


def _default_bv(V: int) -> int:
    for bv in (32, 16):
        if V % bv == 0:
            return bv
    return min(32, max(16, triton.next_power_of_2(V)))


def resolve_config(table: dict, HV: int, V: int, K: int, G: int, config: Optional[dict],
                   *, with_flush: bool, batch: Optional[int] = None, window: Optional[int] = None) -> dict:
    """The launch config for a shape and batch: the table's entry (or a default; for a Gluon
    entry at a `window` above 16, with `LONG_WINDOW_CONFIGS`), updated by `config`; raises
    ValueError for unknown keys or values."""
    cfg = dict(BV=_default_bv(V), num_warps=4, num_stages=1)
    if not with_flush:
        cfg.update(perhead=False)
    else:
        cfg.update(flush="fma", HPP=1, recmask=True, prefetch=False, KS=1, rows=False, warpsum=False,
                   flushrows=16, ablate=0, gluon=False)
        # sync 0 acq_rel arrival counter, 1 relaxed (default), 2 none (ablation: races on
        # the cursor); maxnreg: register cap (0: none), more programs per SM, maybe spills
        cfg.update(sync=1, maxnreg=0)
    cfg.update(table_entry(table, (HV, V, K, G), batch) or {})
    if with_flush and cfg["gluon"] and window is not None and window > 16:
        cfg.update(LONG_WINDOW_CONFIGS.get((HV, V, K, G), {}))
    if config:
        unknown = set(config) - set(cfg)
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)}; expected a subset of {sorted(cfg)}")
        cfg.update(config)
    bv, nw, ns = cfg["BV"], cfg["num_warps"], cfg["num_stages"]
    if not (isinstance(bv, int) and bv >= 1 and bv & (bv - 1) == 0):
        raise ValueError(f"config: BV must be a power of two, got {bv!r}")
    if not (isinstance(nw, int) and nw >= 1 and nw & (nw - 1) == 0):
        raise ValueError(f"config: num_warps must be a power of two, got {nw!r}")
    if not (isinstance(ns, int) and ns >= 1):
        raise ValueError(f"config: num_stages must be a positive int, got {ns!r}")
    if not with_flush and not isinstance(cfg["perhead"], bool):
        raise ValueError(f"config: perhead must be a bool, got {cfg['perhead']!r}")
    if with_flush:
        if cfg["flush"] not in _FLUSH_MODES:
            raise ValueError(f"config: flush must be one of {sorted(_FLUSH_MODES)}, got {cfg['flush']!r}")
        if cfg["flush"] != "fma" and bv < 16:
            raise ValueError(f"config: BV={bv} is below 16, the smallest tl.dot tile; use flush='fma'")
        check_slices(cfg["KS"], triton.next_power_of_2(K))
        if cfg["flush"] != "fma" and cfg["KS"] != 1:
            raise ValueError("config: flush='tf32x3' folds the [BV, K] tile in registers; it needs KS=1")
        hpp = cfg["HPP"]
        if isinstance(hpp, bool) or not isinstance(hpp, int) or hpp < 1 or (HV // G) % hpp:
            raise ValueError(f"config: HPP={hpp!r} must divide the {HV // G} heads of a group")
        if cfg["rows"]:
            if not (bv <= V and (HV // G * V) % bv == 0):
                raise ValueError(f"config: rows=True needs BV={bv} <= V={V} dividing the {HV // G * V} "
                                 "state rows of a group")
            if cfg["HPP"] != 1 or cfg["KS"] != 1 or cfg["flush"] != "fma" or cfg["prefetch"] or cfg["sync"] != 1:
                raise ValueError("config: rows=True takes HPP=1, KS=1, flush='fma', prefetch=False, sync=1")
        fr = cfg["flushrows"]
        if isinstance(fr, bool) or not isinstance(fr, int) or fr < 1 or fr & (fr - 1):
            raise ValueError(f"config: flushrows must be a power of two, got {fr!r}")
        if cfg["warpsum"] and (bv % nw or cfg["KS"] != 1):
            raise ValueError(f"config: warpsum=True needs KS=1 and num_warps={nw} dividing BV={bv}")
        if not isinstance(cfg["gluon"], bool):
            raise ValueError(f"config: gluon must be a bool, got {cfg['gluon']!r}")
        if cfg["gluon"] and (cfg["HPP"] != 1 or cfg["rows"] or cfg["KS"] != 1 or cfg["flush"] != "fma"
                             or cfg["ablate"] or cfg["sync"] != 1):
            raise ValueError("config: gluon=True takes HPP=1, rows=False, KS=1, flush='fma', ablate=0, sync=1")
        ab = cfg["ablate"]
        if isinstance(ab, bool) or ab not in (0, 1, 2, 3):
            raise ValueError(f"config: ablate must be 0, 1, 2 or 3, got {ab!r}")
        if ab and cfg["rows"]:
            raise ValueError("config: ablate applies to the per-head kernel (rows=False)")
        if cfg["sync"] not in (0, 1, 2):
            raise ValueError(f"config: sync must be 0, 1 or 2, got {cfg['sync']!r}")
        if isinstance(cfg["maxnreg"], bool) or not isinstance(cfg["maxnreg"], int) or cfg["maxnreg"] < 0:
            raise ValueError(f"config: maxnreg must be a non-negative int, got {cfg['maxnreg']!r}")
    return cfg


# ----------------------------------------------------------------------------------------------
# Shared device helpers (the conventional kernel uses the same ones, so that the two kernels
# differ only in how the recurrence is organised, not in their elementwise arithmetic).

@triton.jit
def softplus(x):
    # max(x, 0) + log1p(exp(-|x|)). log1p by Goldberg's correction log(p) * e / (p - 1): plain
    # log(1 + e) loses all relative accuracy for the small dt that long-memory heads use.
    e = tl.exp(-tl.abs(x))
    p = 1.0 + e
    den = tl.where(p == 1.0, 1.0, p - 1.0)
    l1p = tl.where(p == 1.0, e, tl.log(p) * (e / den))
    return tl.maximum(x, 0.0) + l1p


@triton.jit
def _load_tile(p, mask, EVEN: tl.constexpr):
    # a checkpoint tile, streamed once (evict first); EVEN: unmasked, fully vectorised
    if EVEN:
        return tl.load(p, eviction_policy="evict_first")
    else:
        return tl.load(p, mask=mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _token_decay(dt, dt_bias, A, off_dt, i_h):
    """The current token's `dt = softplus(dt_raw + dt_bias)`, log decay `dt A` of head i_h, and
    `1 / A` (for the records' `dt_j = ld_j / A`; an approximate division, 2 ulp: the IEEE one's
    slow path costs registers)."""
    b_dt = softplus(tl.load(dt + off_dt + i_h).to(tl.float32) + tl.load(dt_bias + i_h).to(tl.float32))
    b_A = tl.load(A + i_h).to(tl.float32)
    return b_dt, b_dt * b_A, tl.fdiv(1.0, b_A)


@triton.jit
def _record_masks(o_l, h, n_pos, RECMASK: tl.constexpr):
    """Masks of the record lanes at cursor h: `m_j` position j < h holds a record, `m_j1`
    position j + 1 does (the shifted log decays; the current token sits at position h), and
    `m_lj`, `m_lj1` those the loads are predicated on: the same with RECMASK (no traffic for
    empty positions), else only the `n_pos` window positions (issued without waiting for the
    cursor: the small-batch latency path). Positions at or past the cursor are removed by
    selects on `m_j` / `m_j1` after the load either way, so stale or poisoned records never
    enter the arithmetic."""
    m_j = o_l < h
    m_j1 = o_l + 1 < h
    if RECMASK:
        return m_j, m_j1, m_j, m_j1
    else:
        return m_j, m_j1, o_l < n_pos, o_l + 1 < n_pos


@triton.jit
def _group_keys(p_K, stride_K, p_kc, p_q, o_l, o_k, m_k, m_j, m_lj):
    """A group's buffered keys (`[BL, BK]` fp32, zero where no record), the token's key and
    their products with the query: `(K_rec, k_t, q, K_rec q, k_t . q)`. `p_K` points at position 0
    of the group's keys (positions `stride_K` apart), `p_kc` and `p_q` at the token's key and
    query."""
    b_Kb = tl.load(p_K + o_l[:, None] * stride_K + o_k[None, :], mask=m_lj[:, None] & m_k[None, :], other=0.0)
    b_Kb = tl.where(m_j[:, None], b_Kb.to(tl.float32), 0.0)                             # [BL, BK]
    b_kc = tl.load(p_kc + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_q = tl.load(p_q + o_k, mask=m_k, other=0.0).to(tl.float32)
    return b_Kb, b_kc, b_q, tl.sum(b_Kb * b_q[None, :], axis=1), tl.sum(b_kc * b_q, axis=0)


@triton.jit
def _records_dot(p_W, stride_l, b_cw, b_cw_b, r_b, v0, h, n_pos, NR: tl.constexpr, BV: tl.constexpr,
                 BL: tl.constexpr, WS: tl.constexpr, RECMASK: tl.constexpr):
    """`sum_j cw_j W[j, r]` for the rows `r = v0 .. v0 + BV - 1` (`[BV]`) over the records
    j < h: `b_cw` the weights of rows below `r_b`, `b_cw_b` those of rows from `r_b` on (the
    row-block kernel's second head); `p_W` points at position 0 of row 0, positions `stride_l`
    apart, rows from `NR` on are masked. The records are read as `[BL, WS, BV // WS]`, WS the
    program's warps: Triton 3.6 lays the positions across lanes and the WS blocks of rows
    across warps, so the sum over positions stays inside each warp. A plain `[BL, BV]` tile
    puts positions across warps too, and its reduction goes through shared memory with bank
    conflicts (Nsight Compute on Nemotron-3-Super at batch 256: half of the kernel's
    shared-memory wavefronts)."""
    RW: tl.constexpr = BV // WS
    o_r = v0 + tl.arange(0, WS)[None, :, None] * RW + tl.arange(0, RW)[None, None, :]    # [1, WS, RW]
    o_l = tl.arange(0, BL)[:, None, None]                                               # [BL, 1, 1]
    m_l = o_l < h if RECMASK else o_l < n_pos
    b_W = tl.load(p_W + o_l * stride_l + o_r, mask=m_l & (o_r < NR), other=0.0)
    b_W = tl.where(o_l < h, b_W.to(tl.float32), 0.0)
    b_c = tl.where(o_r < r_b, b_cw[:, None, None], b_cw_b[:, None, None])               # [BL, WS, RW]
    return tl.reshape(tl.sum(b_W * b_c, axis=0), [BV])


@triton.jit
def _head_values(p, o_h, h_a, h_b, in_b, TWO: tl.constexpr):
    """A per-head parameter `p[head]` for each row (`o_h` its head): TWO, the block spans heads
    h_a and h_b only and `in_b` marks h_b's rows, two scalar loads selected per row; else one
    gather per row."""
    if TWO:
        return tl.where(in_b, tl.load(p + h_b).to(tl.float32), tl.load(p + h_a).to(tl.float32))
    else:
        return tl.load(p + o_h).to(tl.float32)


@triton.jit
def _head_weights(p_ld, stride_l, b_ld, b_rA, h, o_l, m_j, m_j1, m_lj, m_lj1):
    """Weights of one head at cursor h: record j (lane j < h, its value `x_j`) enters with
    g_{j+1:h} dt_j, g_{j+1:h} = exp(ld_{j+1} + ... + ld_h) and dt_j = ld_j / A (the record keeps
    the layer's input x, exact in the model's dtype, not the rounded product dt x), the
    checkpoint with g_{0:h}; `p_ld` points at the head's log decay at position 0 (positions
    `stride_l` apart), `b_ld` is the current token's (position h), `b_rA` the head's 1 / A. Each
    suffix is summed directly from same-signed terms, never as a difference of prefix sums, so
    weights near 1 keep full precision. Returns (coef [BL], g_{0:h})."""
    b_ld1 = tl.load(p_ld + (o_l + 1) * stride_l, mask=m_lj1, other=0.0)              # ld_{j+1}
    b_ldj = tl.load(p_ld + o_l * stride_l, mask=m_lj, other=0.0)                       # ld_j
    b_ld0 = tl.load(p_ld)
    b_lds = tl.where(m_j1, b_ld1, tl.where(o_l + 1 == h, b_ld, 0.0))                   # [BL]
    b_sfx = tl.sum(tl.where(o_l[None, :] >= o_l[:, None], b_lds[None, :], 0.0), axis=1)
    b_coef = tl.where(m_j, tl.exp(b_sfx) * (b_ldj * b_rA), 0.0)                         # [BL]
    b_g = tl.exp(tl.where(h > 0, b_ld0, b_ld) + tl.sum(b_lds, axis=0))                  # g_{0:h}
    return b_coef, b_g


# ----------------------------------------------------------------------------------------------
# Kernels

@triton.jit
def _replay_decode_kernel(
    x, dt, B, C, A, dt_bias, D, z, out,
    ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids,
    stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
    stride_z_b, stride_z_h, stride_o_b, stride_o_h,
    HV: tl.constexpr, G: tl.constexpr, V: tl.constexpr, K: tl.constexpr, LB: tl.constexpr,
    WINDOW: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, BL: tl.constexpr,
    HPP: tl.constexpr, NVB: tl.constexpr, FLUSH: tl.constexpr, HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr, SYNC: tl.constexpr, RECMASK: tl.constexpr,
    PREFETCH: tl.constexpr, EVEN: tl.constexpr, RC: tl.constexpr, KS: tl.constexpr,
    WS: tl.constexpr, ABLATE: tl.constexpr,
):
    # grid (HV // HPP * NVB, Bt): a program owns V-block i_v of HPP consecutive heads of one
    # group, so the group's buffered keys are read, and their products with the query formed,
    # once for HPP heads.
    pid = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    i_v = pid % NVB
    h0 = (pid // NVB) * HPP
    HG: tl.constexpr = HV // G
    i_g = h0 // HG

    o_v = i_v * BV + tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    o_l = tl.arange(0, BL)
    m_v = o_v < V
    m_k = o_k < K

    p_o = out + i_b * stride_o_b + h0 * stride_o_h + o_v
    slot = tl.load(slot_ids + i_b).to(tl.int64)
    if slot < 0:
        for i in range(HPP):
            tl.store(p_o + i * stride_o_h, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty), mask=m_v)
        return

    h = tl.load(cursor + slot)
    if ABLATE % 4 >= 2:
        hr = h * 0          # timing ablation: the outputs read no records (see REPLAY_CONFIGS)
    else:
        hr = h
    m_j, m_j1, m_lj, m_lj1 = _record_masks(o_l, hr, WINDOW if WINDOW < LB else LB, RECMASK)

    # tile offsets in int32 (a slot's checkpoint is far below 2^31 elements), added to a
    # scalar 64-bit base per head: a tile of 64-bit addresses would hold twice the registers
    # for the whole head loop
    o_S, m_S = tile_offsets(o_v, m_v, K, BK, KS)
    p_S0 = ckpt + slot * (HV * V * K)
    if PREFETCH:
        b_Sn = _load_tile(p_S0 + h0 * (V * K) + o_S, m_S, EVEN)

    # the group's keys and the token's key and query: shared by the HPP heads
    b_Kb, b_kc, b_q, b_kq, b_kcq = _group_keys(buf_k + slot * (LB * G * K) + i_g * K, G * K,
                                               B + i_b * stride_B_b + i_g * stride_B_g,
                                               C + i_b * stride_C_b + i_g * stride_C_g,
                                               o_l, o_k, m_k, m_j, m_lj)
    is_flush = h + 1 >= WINDOW

    for i in range(HPP):
        i_h = h0 + i
        if PREFETCH:
            b_S = b_Sn
            if EVEN:
                b_Sn = tl.load(p_S0 + (tl.minimum(i_h + 1, h0 + HPP - 1)) * (V * K) + o_S,
                               eviction_policy="evict_first")
            else:
                b_Sn = tl.load(p_S0 + (i_h + 1) * (V * K) + o_S, mask=m_S & (i + 1 < HPP), other=0.0,
                               eviction_policy="evict_first")
        else:
            b_S = _load_tile(p_S0 + i_h * (V * K) + o_S, m_S, EVEN)
        p_Wh = buf_w + slot * (LB * HV * V) + i_h * V
        if WS == 0 or FLUSH == 1:
            b_W = tl.load(p_Wh + (o_l[:, None] * (HV * V) + o_v[None, :]),
                          mask=m_lj[:, None] & m_v[None, :], other=0.0)
            b_W = tl.where(m_j[:, None], b_W.to(tl.float32), 0.0)                       # [BL, BV]

        # the current token's record, in registers
        b_dt, b_ld, b_rA = _token_decay(dt, dt_bias, A, i_b * stride_dt_b, i_h)
        b_xi = tl.load(x + i_b * stride_x_b + i_h * stride_x_h + o_v, mask=m_v, other=0.0)
        b_x = b_xi.to(tl.float32)
        b_w = b_dt * b_x                                                                # [BV]
        b_coef, b_g = _head_weights(buf_ld + slot * (LB * HV) + i_h, HV, b_ld, b_rA, hr, o_l, m_j, m_j1,
                                    m_lj, m_lj1)

        b_y = b_g * tile_dot(b_S, b_q, BK, KS)                                          # [BV]
        if WS == 0:
            b_y += tl.sum(b_W * (b_coef * b_kq)[:, None], axis=0)
        else:
            b_cw = b_coef * b_kq
            b_y += _records_dot(p_Wh, HV * V, b_cw, b_cw, V, i_v * BV, hr, WINDOW if WINDOW < LB else LB,
                                V, BV, BL, WS, RECMASK)
        b_y += b_kcq * b_w
        if HAS_D:
            b_y += tl.load(D + i_h).to(tl.float32) * b_x
        if HAS_Z:
            b_z = tl.load(z + i_b * stride_z_b + i_h * stride_z_h + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_y = b_y * b_z / (1.0 + tl.exp(-b_z))
        tl.store(p_o + i * stride_o_h, b_y.to(p_o.dtype.element_ty), mask=m_v)

        if is_flush:
            # REPLAY: C <- g_{0:h} C + sum_{j<h} g_{j+1:h} w_j k_j^T + w_h k_h^T. The current
            # token is folded directly, never written to the buffer.
            if FLUSH == 0:
                # Row chunks of RC, the tile re-read (this program just read it: L2 hits), one
                # rank-1 update per record: the registers of this rare path, which every
                # program is allocated, stay those of an [RC, BK] tile.
                p_kj = buf_k + slot * (LB * G * K) + i_g * K + o_k
                for r0 in tl.static_range(0, BV, RC):
                    o_r = i_v * BV + r0 + tl.arange(0, RC)
                    m_r = o_r < V
                    p_Sr = p_S0 + i_h * (V * K) + (o_r[:, None] * K + o_k[None, :])
                    m_Sr = m_r[:, None] & m_k[None, :]
                    b_Sr = tl.load(p_Sr, mask=m_Sr, other=0.0)                          # [RC, BK]
                    b_xr = tl.load(x + i_b * stride_x_b + i_h * stride_x_h + o_r, mask=m_r, other=0.0)
                    b_Sr = b_g * b_Sr + (b_dt * b_xr.to(tl.float32))[:, None] * b_kc[None, :]
                    p_wj = buf_w + slot * (LB * HV * V) + i_h * V + o_r
                    for j in range(0, h if ABLATE % 2 == 0 else 0):
                        c_j = tl.sum(tl.where(o_l == j, b_coef, 0.0), axis=0)
                        w_j = tl.load(p_wj + j * (HV * V), mask=m_r, other=0.0).to(tl.float32)
                        k_j = tl.load(p_kj + j * (G * K), mask=m_k, other=0.0).to(tl.float32)
                        b_Sr += (c_j * w_j)[:, None] * k_j[None, :]
                    tl.store(p_Sr, b_Sr, mask=m_Sr)
            else:
                # on the tile still in registers: [BV, BL] x [BL, BK] on tensor cores, three
                # tf32 passes (near fp32)
                b_S = b_g * b_S + b_w[:, None] * b_kc[None, :]
                b_S += tl.dot(tl.trans(b_W * b_coef[:, None]), b_Kb, input_precision="tf32x3")
                if EVEN:
                    tl.store(p_S0 + i_h * (V * K) + o_S, b_S)
                else:
                    tl.store(p_S0 + i_h * (V * K) + o_S, b_S, mask=m_S)
        else:
            # the record keeps x as given (exact when the buffer has x's dtype)
            p_wh = buf_w + slot * (LB * HV * V) + h * (HV * V) + i_h * V + o_v
            tl.store(p_wh, b_xi.to(p_wh.dtype.element_ty), mask=m_v)
            if i_v == 0:
                tl.store(buf_ld + slot * (LB * HV) + h * HV + i_h, b_ld)
                # the group's key: written by the program holding its first head
                if i_h % HG == 0:
                    p_kh = buf_k + slot * (LB * G * K) + h * (G * K) + i_g * K + o_k
                    tl.store(p_kh, b_kc.to(p_kh.dtype.element_ty), mask=m_k)

    # the cursor moves once all HV // HPP * NVB programs of the slot have read it
    # (ops/utils/cursor.py; SYNC 0 and 2 are ablations of the arrival counter)
    hand_off(arrive, cursor, epoch, slot, h, is_flush, HV // HPP * NVB, SYNC)


@triton.jit
def _replay_decode_rows_kernel(
    x, dt, B, C, A, dt_bias, D, z, out,
    ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids,
    stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
    stride_z_b, stride_z_h, stride_o_b, stride_o_h,
    HV: tl.constexpr, G: tl.constexpr, V: tl.constexpr, K: tl.constexpr, LB: tl.constexpr,
    WINDOW: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, BL: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, RECMASK: tl.constexpr, RC: tl.constexpr,
    WS: tl.constexpr,
):
    # grid (HV * V // BV, Bt): a program owns BV consecutive rows of the slot's checkpoint seen
    # as [HV * V, K], as the conventional kernel's programs do, within one group. With V not a
    # power of two (Nano-4B: 80) such blocks fill every lane where per-head blocks cannot;
    # BV <= V, so a block spans at most two heads, `h_a` and `h_a + 1`: their weights are
    # formed per head and selected per row.
    i_r = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    HG: tl.constexpr = HV // G
    r0 = i_r * BV
    i_g = r0 // (HG * V)
    h_a = r0 // V
    h_b = tl.minimum(h_a + 1, HV - 1)

    o_r = r0 + tl.arange(0, BV)
    o_h = o_r // V
    in_b = o_h != h_a                                                                   # [BV]
    o_k = tl.arange(0, BK)
    o_l = tl.arange(0, BL)
    m_k = o_k < K

    p_o = out + i_b * stride_o_b + o_h * stride_o_h + (o_r - o_h * V)
    slot = tl.load(slot_ids + i_b).to(tl.int64)
    if slot < 0:
        tl.store(p_o, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty))
        return

    h = tl.load(cursor + slot)
    m_j, m_j1, m_lj, m_lj1 = _record_masks(o_l, h, WINDOW if WINDOW < LB else LB, RECMASK)

    p_S = ckpt + slot * (HV * V * K) + r0 * K
    o_S = tl.arange(0, BV)[:, None] * K + o_k[None, :]
    b_S = _load_tile(p_S + o_S, m_k[None, :], BK == K)                                  # [BV, BK]

    b_Kb, b_kc, b_q, b_kq, b_kcq = _group_keys(buf_k + slot * (LB * G * K) + i_g * K, G * K,
                                               B + i_b * stride_B_b + i_g * stride_B_g,
                                               C + i_b * stride_C_b + i_g * stride_C_g,
                                               o_l, o_k, m_k, m_j, m_lj)
    p_W = buf_w + slot * (LB * HV * V) + r0
    if WS == 0:
        b_W = tl.load(p_W + (o_l[:, None] * (HV * V) + tl.arange(0, BV)[None, :]), mask=m_lj[:, None], other=0.0)
        b_W = tl.where(m_j[:, None], b_W.to(tl.float32), 0.0)                           # [BL, BV]

    # the current token: dt and log decay of the block's two heads (scalars), selected per row
    dt_a, b_ld_a, rA_a = _token_decay(dt, dt_bias, A, i_b * stride_dt_b, h_a)
    dt_b, b_ld_b, rA_b = _token_decay(dt, dt_bias, A, i_b * stride_dt_b, h_b)
    b_dt = tl.where(in_b, dt_b, dt_a)                                                   # [BV]
    b_ldr = tl.where(in_b, b_ld_b, b_ld_a)
    b_xi = tl.load(x + i_b * stride_x_b + o_h * stride_x_h + (o_r - o_h * V))
    b_x = b_xi.to(tl.float32)
    b_w = b_dt * b_x
    p_ld = buf_ld + slot * (LB * HV)
    c_a, g_a = _head_weights(p_ld + h_a, HV, b_ld_a, rA_a, h, o_l, m_j, m_j1, m_lj, m_lj1)
    c_b, g_b = _head_weights(p_ld + h_b, HV, b_ld_b, rA_b, h, o_l, m_j, m_j1, m_lj, m_lj1)

    b_g = tl.where(in_b, g_b, g_a)                                                      # [BV]
    b_y = b_g * tl.sum(b_S * b_q[None, :], axis=1)
    if WS == 0:
        b_y += tl.sum(b_W * tl.where(in_b[None, :], (c_b * b_kq)[:, None], (c_a * b_kq)[:, None]), axis=0)
    else:
        b_y += _records_dot(p_W - r0, HV * V, c_a * b_kq, c_b * b_kq, (h_a + 1) * V, r0, h,
                            WINDOW if WINDOW < LB else LB, HV * V, BV, BL, WS, RECMASK)
    b_y += b_kcq * b_w
    if HAS_D:
        b_y += _head_values(D, o_h, h_a, h_b, in_b, True) * b_x
    if HAS_Z:
        b_z = tl.load(z + i_b * stride_z_b + o_h * stride_z_h + (o_r - o_h * V)).to(tl.float32)
        b_y = b_y * b_z / (1.0 + tl.exp(-b_z))
    tl.store(p_o, b_y.to(p_o.dtype.element_ty))

    is_flush = h + 1 >= WINDOW
    if is_flush:
        # C <- g_{0:h} C + sum_{j<h} g_{j+1:h} w_j k_j^T + w_h k_h^T, in row chunks of RC re-read
        # from L2, one rank-1 update per record (exact fp32), as the per-head kernel does
        for c0 in tl.static_range(0, BV, RC):
            o_c = tl.arange(0, RC)
            o_rc = r0 + c0 + o_c
            o_hc = o_rc // V
            in_bc = o_hc != h_a
            p_Sc = p_S + (c0 + o_c)[:, None] * K + o_k[None, :]
            b_Sc = tl.load(p_Sc, mask=m_k[None, :], other=0.0)                         # [RC, BK]
            b_dtc = tl.where(in_bc, dt_b, dt_a)
            b_xc = tl.load(x + i_b * stride_x_b + o_hc * stride_x_h + (o_rc - o_hc * V)).to(tl.float32)
            b_Sc = tl.where(in_bc, g_b, g_a)[:, None] * b_Sc + (b_dtc * b_xc)[:, None] * b_kc[None, :]
            for j in range(0, h):
                c_j = tl.where(in_bc, tl.sum(tl.where(o_l == j, c_b, 0.0), axis=0),
                               tl.sum(tl.where(o_l == j, c_a, 0.0), axis=0))
                w_j = tl.load(p_W + j * (HV * V) + c0 + o_c).to(tl.float32)
                k_j = tl.load(buf_k + slot * (LB * G * K) + j * (G * K) + i_g * K + o_k, mask=m_k,
                              other=0.0).to(tl.float32)
                b_Sc += (c_j * w_j)[:, None] * k_j[None, :]
            tl.store(p_Sc, b_Sc, mask=m_k[None, :])
    else:
        # the record: x of these rows; the log decay of each head whose first row is here; the
        # group's key from the program holding the group's first row
        tl.store(p_W + h * (HV * V) + tl.arange(0, BV), b_xi.to(p_W.dtype.element_ty))
        tl.store(p_ld + h * HV + o_h, b_ldr, mask=o_r == o_h * V)
        if r0 % (HG * V) == 0:
            p_kh = buf_k + slot * (LB * G * K) + h * (G * K) + i_g * K + o_k
            tl.store(p_kh, b_kc.to(p_kh.dtype.element_ty), mask=m_k)
    hand_off(arrive, cursor, epoch, slot, h, is_flush, HV * V // BV)


# ----------------------------------------------------------------------------------------------
# Python boundary


def check_tensor(name: str, t, shape, dtypes, device, *, contiguous: bool = False,
                 inner: bool = False) -> None:
    """Raise ValueError naming `name` unless `t` is a tensor of `shape`, a dtype in `dtypes`,
    on `device`; `contiguous`: fully contiguous; `inner`: last dim contiguous."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype} not supported; expected one of {list(dtypes)}")
    if t.device != device:
        raise ValueError(f"{name}: on device {t.device}, expected {device} (the device of x)")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, got strides {t.stride()}")
    if inner and t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must be contiguous, got strides {t.stride()}")


def check_slots(slot_ids: Tensor, N: int, force: bool) -> None:
    """Range and uniqueness of slot ids. Reading them needs a device sync, so on an accelerator
    this runs only when asked (`force`), and never during CUDA-graph capture or tracing."""
    if torch.compiler.is_compiling() or capturing() or (slot_ids.device.type != "cpu" and not force):
        return
    s = slot_ids.detach().to("cpu", torch.int64)
    live = s[s >= 0]
    if live.numel() and int(live.max()) >= N:
        raise ValueError(f"slot_ids: id {int(live.max())} out of range for a pool of {N} slots")
    if live.unique().numel() != live.numel():
        u, c = live.unique(return_counts=True)
        raise ValueError(f"slot_ids: slot {int(u[c > 1][0])} appears more than once")


def check_token_inputs(x, dt, B, C, A, dt_bias, D, z):
    """Shapes of one decode step's inputs; returns (Bt, HV, V, G, K)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"x: expected [Bt, HV, V], got shape {tuple(x.shape)}")
    if not isinstance(B, torch.Tensor) or B.dim() != 3:
        raise ValueError(f"B: expected [Bt, G, K], got {getattr(B, 'shape', type(B).__name__)}")
    Bt, HV, V = x.shape
    G, K = B.shape[1], B.shape[2]
    dev = x.device
    check_tensor("x", x, (Bt, HV, V), _FLOAT_DTYPES, dev, inner=True)
    if G == 0 or HV % G:
        raise ValueError(f"B: {G} groups do not divide the {HV} heads of x")
    check_tensor("dt", dt, (Bt, HV), _FLOAT_DTYPES, dev, inner=True)
    check_tensor("B", B, (Bt, G, K), _FLOAT_DTYPES, dev, inner=True)
    check_tensor("C", C, (Bt, G, K), _FLOAT_DTYPES, dev, inner=True)
    check_tensor("A", A, (HV,), _FLOAT_DTYPES, dev, contiguous=True)
    check_tensor("dt_bias", dt_bias, (HV,), _FLOAT_DTYPES, dev, contiguous=True)
    if D is not None:
        check_tensor("D", D, (HV,), _FLOAT_DTYPES, dev, contiguous=True)
    if z is not None:
        check_tensor("z", z, (Bt, HV, V), _FLOAT_DTYPES, dev, inner=True)
    if Bt > 65535 or HV > 65535:
        raise ValueError(f"x: batch {Bt} or heads {HV} above the grid limit 65535")
    return Bt, HV, V, G, K


def _launch_replay(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, epoch,
                   arrive, slot_ids, out, window, BV, num_warps, num_stages, flush, HPP=1,
                   recmask=True, prefetch=False, sync=1, maxnreg=0, KS=1, rows=False, warpsum=False,
                   flushrows=16, ablate=0, gluon=False):
    Bt, HV, V = x.shape
    G, K = B.shape[1], B.shape[2]
    LB = buf_ld.shape[1]
    if Bt == 0:
        return
    if gluon and os.environ.get("TRITON_INTERPRET") != "1" and not gluon_supported(
            HV, V, K, G, window, LB, BV, num_warps):
        launch_gluon(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive,
                     slot_ids, out, window, BV, num_warps, maxnreg, recmask)
        return
    # record tiles cover positions 0..min(window, Lb) - 1 (cursors never pass the window)
    BL = max(16, triton.next_power_of_2(min(window, LB)))
    WS = num_warps if warpsum and BL <= 16 else 0
    extra = {"maxnreg": maxnreg} if maxnreg and os.environ.get("TRITON_INTERPRET") != "1" else {}
    if rows:
        _replay_decode_rows_kernel[(HV * V // BV, Bt)](
            x, dt, B, C, A, dt_bias, D if D is not None else A, z if z is not None else x, out,
            ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids,
            x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
            z.stride(0) if z is not None else 0, z.stride(1) if z is not None else 0,
            out.stride(0), out.stride(1),
            HV=HV, G=G, V=V, K=K, LB=LB, WINDOW=window, BV=BV, BK=triton.next_power_of_2(K), BL=BL,
            HAS_D=D is not None, HAS_Z=z is not None, RECMASK=bool(recmask), RC=min(flushrows, BV),
            WS=WS, num_warps=num_warps, num_stages=num_stages, **extra)
        return
    nvb = triton.cdiv(V, BV)
    grid = (HV // HPP * nvb, Bt)
    _replay_decode_kernel[grid](
        x, dt, B, C, A, dt_bias, D if D is not None else A, z if z is not None else x, out,
        ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        z.stride(0) if z is not None else 0, z.stride(1) if z is not None else 0,
        out.stride(0), out.stride(1),
        HV=HV, G=G, V=V, K=K, LB=LB, WINDOW=window, BV=BV, BK=triton.next_power_of_2(K),
        BL=BL, HPP=HPP, NVB=nvb, FLUSH=_FLUSH_MODES[flush], HAS_D=D is not None,
        HAS_Z=z is not None, SYNC=sync, RECMASK=bool(recmask), PREFETCH=bool(prefetch),
        EVEN=(V % BV == 0) and triton.next_power_of_2(K) == K, RC=min(flushrows, BV), KS=KS,
        WS=WS, ABLATE=ablate, num_warps=num_warps, num_stages=num_stages, **extra,
    )


@torch.library.custom_op(
    "replayssm::mamba2_replay_decode",
    mutates_args=("out", "ckpt", "buf_ld", "buf_w", "buf_k", "cursor", "epoch", "arrive"),
)
def _replay_decode_op(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, dt_bias: Tensor,
                      D: Optional[Tensor], z: Optional[Tensor], ckpt: Tensor, buf_ld: Tensor,
                      buf_w: Tensor, buf_k: Tensor, cursor: Tensor, epoch: Tensor, arrive: Tensor,
                      slot_ids: Tensor, out: Tensor, window: int, BV: int, num_warps: int,
                      num_stages: int, flush: str, HPP: int, recmask: bool, prefetch: bool,
                      sync: int, maxnreg: int, KS: int, rows: bool, warpsum: bool,
                      flushrows: int, ablate: int, gluon: bool) -> None:
    _launch_replay(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, epoch,
                   arrive, slot_ids, out, window, BV, num_warps, num_stages, flush, HPP, recmask,
                   prefetch, sync, maxnreg, KS, rows, warpsum, flushrows, ablate, gluon)


@_replay_decode_op.register_fake
def _(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive,
      slot_ids, out, window, BV, num_warps, num_stages, flush, HPP, recmask, prefetch, sync,
      maxnreg, KS, rows, warpsum, flushrows, ablate, gluon) -> None:
    return None


def replay_decode(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, dt_bias: Tensor,
                  D: Optional[Tensor], z: Optional[Tensor], ckpt: Tensor, buf_ld: Tensor,
                  buf_w: Tensor, buf_k: Tensor, cursor: Tensor, epoch: Tensor, slot_ids: Tensor,
                  window: int, out: Optional[Tensor] = None, config: Optional[dict] = None, *,
                  arrive: Optional[Tensor] = None, validate: bool = True,
                  check_slots_on_device: bool = False) -> Tensor:
    """One Mamba-2 standard decode step on ReplaySSM state, in place; returns `y`.

    Token inputs: `x` `[Bt, HV, V]`; `dt` `[Bt, HV]` (raw, before `softplus(dt + dt_bias)`);
    `B`, `C` `[Bt, G, K]`; `z` `[Bt, HV, V]` or None (gate `y * silu(z)`). Layer parameters:
    `A`, `dt_bias` `[HV]`, `D` `[HV]` or None. State (docs/state-layout.md, modified in place):
    `ckpt` `[N, HV, V, K]` fp32; `buf_ld` `[N, Lb, HV]` fp32; `buf_w` `[N, Lb, HV, V]` and
    `buf_k` `[N, Lb, G, K]` fp32, bf16 or fp16; `cursor` `[N]` int32; `epoch` `[N]` int64.
    `slot_ids` `[Bt]` int32/int64 (negative: padding row, `y[b] = 0`, nothing touched);
    `window` the replay window `L` (`1 <= L <= Lb`); every live slot must hold `cursor < L`
    (the pool's invariant in standard decode; not checked, it would need a device sync).
    Window 1 is the eager step (the checkpoint is the state after every step, as in
    conventional decoding, and no record is written): the conventional kernel on the
    checkpoint, which first folds the records a row still holds (any cursor below `Lb`);
    `config` then sets only its `BV`, `num_warps`, `num_stages` (see `conventional_config`).
    `eager_max_batch` says up to which batch the measured tables prefer it.

    `out` `[Bt, HV, V]` of x's dtype: written when given (then the call allocates nothing and is
    capturable in a CUDA graph). `config`: overrides of the launch config (see REPLAY_CONFIGS).
    `arrive` `[N]` int32, zero-initialised: per-slot arrival counters (left at zero after each
    call); by default a cached per-device tensor, allocated on first use: pass one allocated
    before graph capture. `validate=False` skips all checks. Slot ids are range- and
    duplicate-checked only when they are on the CPU or `check_slots_on_device` (a sync).
    """
    if validate:
        Bt, HV, V, G, K = check_token_inputs(x, dt, B, C, A, dt_bias, D, z)
        dev = x.device
        if not isinstance(ckpt, torch.Tensor) or ckpt.dim() != 4:
            raise ValueError(f"ckpt: expected [N, HV, V, K], got {getattr(ckpt, 'shape', type(ckpt).__name__)}")
        N = ckpt.shape[0]
        if not isinstance(buf_ld, torch.Tensor) or buf_ld.dim() != 3:
            raise ValueError(f"buf_ld: expected [N, Lb, HV], got {getattr(buf_ld, 'shape', type(buf_ld).__name__)}")
        Lb = buf_ld.shape[1]
        check_tensor("ckpt", ckpt, (N, HV, V, K), (torch.float32,), dev, contiguous=True)
        check_tensor("buf_ld", buf_ld, (N, Lb, HV), (torch.float32,), dev, contiguous=True)
        check_tensor("buf_w", buf_w, (N, Lb, HV, V), _RECORD_DTYPES, dev, contiguous=True)
        check_tensor("buf_k", buf_k, (N, Lb, G, K), _RECORD_DTYPES, dev, contiguous=True)
        check_tensor("cursor", cursor, (N,), (torch.int32,), dev, contiguous=True)
        check_tensor("epoch", epoch, (N,), (torch.int64,), dev, contiguous=True)
        check_tensor("slot_ids", slot_ids, (Bt,), (torch.int32, torch.int64), dev, contiguous=True)
        if arrive is not None:
            check_tensor("arrive", arrive, (N,), (torch.int32,), dev, contiguous=True)
        if out is not None:
            check_tensor("out", out, (Bt, HV, V), (x.dtype,), dev, inner=True)
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= Lb:
            raise ValueError(f"window: must be an int in [1, Lb={Lb}], got {window!r}")
        check_slots(slot_ids, N, check_slots_on_device)
    cfg = resolve_config(REPLAY_CONFIGS, x.shape[1], x.shape[2], B.shape[2], B.shape[1], config,
                         with_flush=True, batch=x.shape[0], window=window)
    if out is None:
        out = torch.empty_like(x)
    if arrive is None:
        arrive = arrive_counter(x.device, ckpt.shape[0])
    if window == 1:
        from .conventional import eager_decode      # conventional.py builds on this module
        return eager_decode(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor,
                            epoch, arrive, slot_ids, out, config)
    args = (x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive,
            slot_ids, out, int(window), cfg["BV"], cfg["num_warps"], cfg["num_stages"], cfg["flush"],
            cfg["HPP"], bool(cfg["recmask"]), bool(cfg["prefetch"]), cfg["sync"], cfg["maxnreg"],
            cfg["KS"], bool(cfg["rows"]), bool(cfg["warpsum"]), int(cfg["flushrows"]), int(cfg["ablate"]),
            bool(cfg["gluon"]))
    if torch.compiler.is_compiling():
        torch.ops.replayssm.mamba2_replay_decode(*args)
    else:
        _launch_replay(*args)
    return out
