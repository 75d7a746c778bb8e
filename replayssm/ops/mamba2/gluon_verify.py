"""Mamba-2 speculative verification on ReplaySSM state in Gluon, for the GPU only: the step of
`verify._replay_verify_kernel` (its docstring has the mathematics; docs/state-layout.md,
`verify`, the contract) organised as `gluon_decode`'s program, so that the checkpoint tile is
in flight while everything else is loaded and formed.

A program (one row, one value head, `BV = 16 * num_warps` value rows, K = 128):
  1. starts the `cp.async` copy of its checkpoint tile into shared memory, then of the
     committed records (the group's keys, its own rows of the values), no registers held;
  2. loads the cursor, the draft count and the drafts' inputs (queries, keys, x, dt, z),
     staging the drafts' keys and x in shared memory;
  3. forms the weights: `E[j, t] = g_{j+1:p_t} dt_j` of committed record j for draft t,
     `Ed[r, t] = g_{r+1:p_t} dt_r` of draft r, each a sum of same-signed log decays, never a
     difference of prefix sums; and on a flush the fold's coefficients;
  4. waits for the copies; on an early flush folds the committed records into the tile still
     in shared memory (exact fp32 rank-1 updates, gluon_decode's fold) and stores it: the
     drafts start from the folded state;
  5. reads the tile back in row chunks and forms all T row dots per chunk: the T queries sit
     across lanes (a thread holds one query's 32 columns), so each chunk is read from shared
     memory once for all T and a row's sum takes two shuffle levels; the committed and the
     drafts' keys go through the same loop (their products with the queries);
  6. sums the records' and drafts' terms (`sum_j x_j (E * K^T Q)[j, t]`; a later draft is
     selected away, never multiplied by zero) and writes the T outputs, the drafts' records
     and the hand-off (`utils.gluon._verify_arrive`; on a flush its last program writes the
     drafts' shared fields, `_write_shared_drafts`).
The CPU interpreter cannot run Gluon: `verify.replay_verify` runs the Triton kernels there.
"""
from __future__ import annotations

import os
from typing import Optional

from ..utils.dots import pieces
from ..utils.gluon import HAVE_GLUON, gluon_record_tile, gluon_shape_supported
from ..utils.key_products import verify_key_products
from ..utils.launch import slot_pads
from .common import OPTIONAL_INPUTS, given

if HAVE_GLUON:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from ..utils.gluon import (_add, _async_load, _barrier, _draft_count, _lp_decode, _lp_encode, _lp_tile_view,
                                _slot_bases, _softplus, _tile_offsets, _tile_to_shared, _verify_arrive)
    from .gluon_verify_drafts import _write_shared_drafts
    from ..utils.gluon_mma import _fold_mma_records, _tile_vectors_mma

__all__ = ["HAVE_GLUON", "gluon_verify_unsupported", "launch_gluon_verify"]

MAX_DRAFT = 8

# REPLAYSSM_GLUON_VERIFY_KEYS_GLOBAL=1 (experimental, off: not yet run on a GPU): with `mma` and
# `kq` the committed keys are read only by a flush's fold, so they need not be staged in shared
# memory by every program; the fold loads them from global memory (L2: a group's heads share
# them) into the MMA's operand registers. Less shared memory a program (Triton 3.6, T = 8:
# Nano-4B's 16-row programs 16.7 -> 13.1 KB, 13 -> 16 programs per SM; Super's 64-row 43.6 ->
# 41.5 KB, 5 either way), so more tile bytes in flight per SM. Read at each launch (its GPU
# tests set it)
KEYS_GLOBAL = os.environ.get("REPLAYSSM_GLUON_VERIFY_KEYS_GLOBAL") == "1"


def gluon_verify_unsupported(HV: int, V: int, K: int, Hk: int, T: int, window: int, Lb: int, BV: int,
                             num_warps: int) -> Optional[str]:
    """Why the Gluon verify kernel does not cover this shape and launch config, or None when it
    does (K = 128, `BV = 16 * num_warps` dividing V, at most 8 warps, windows up to 32,
    1 <= T <= min(8, window))."""
    why = gluon_shape_supported(V, K, window, Lb, BV, num_warps)
    if why:
        return why
    if num_warps > 8:
        return f"num_warps={num_warps} (at most 8)"
    if not 1 <= T <= MAX_DRAFT:
        return f"T={T} drafts (1..{MAX_DRAFT})"
    if T > window:
        # the H200's round test at window 3 with T = 8 fails (verify error 0.1, also with the
        # record copies over T positions, NPOS): the pool never launches it (max_draft <= window,
        # docs/state-layout.md); the Triton kernel covers it for direct callers
        return f"T={T} drafts above the window {window} (the Triton kernel)"
    if HV % Hk:
        return f"Hk={Hk} does not divide HV={HV}"
    return None


def _tiles(T: int, window: int, Lb: int, num_warps: int) -> dict:
    """The kernel's tile constexprs for T drafts: TP the drafts padded to a power of two; the
    row loop's lanes LRW (rows) x TP (queries) x LKW (columns; 8 for one query, so that a
    quarter warp reads one row: no bank conflict), rows per chunk RC = LRW * num_warps (at most
    the keys' BL, the drafts' PD rows); PD >= the contraction's lanes over positions (8 / TP).
    NPOS: the positions a committed record can occupy, which the copies cover without waiting
    for the cursor: the window's, or T's when T exceeds it (a commit after an early flush
    leaves the cursor at up to T)."""
    TP = 1 << (T - 1).bit_length()
    lkw = 8 if TP == 1 else 4
    lrw = 32 // (TP * lkw)
    PD = max(TP, 8 // TP)
    BL = gluon_record_tile(window, Lb)
    rc = lrw * num_warps
    return dict(TP=TP, PD=PD, BL=BL, LKW=lkw, LRW=lrw, RC=rc, RCK=min(rc, BL), RCD=min(rc, PD),
                NPOS=min(max(window, T), Lb, BL))


if HAVE_GLUON:

    @gluon.jit
    def _rows_q(s_rows, b_Q3, L3: gl.constexpr):
        """Rows `[R, K]` in shared memory (any float dtype) times the T queries `b_Q3`
        (`[1, TP, K]` in L3): `[R, TP]` fp32 in `SliceLayout(2, L3)`."""
        b_r = s_rows.load(gl.SliceLayout(1, L3)).to(gl.float32)
        return gl.sum(gl.expand_dims(b_r, 1) * b_Q3, axis=2)

    @gluon.jit
    def _rows_q_lp(s_rows, b_Q3, L3: gl.constexpr, LPT: gl.constexpr):
        """`_rows_q` for rows of a 16-bit copy held as int16 bits (LPT 1 fp16, 2 bf16): each
        element decoded exactly to fp32."""
        b_f = _lp_decode(s_rows.load(gl.SliceLayout(1, L3)), LPT)
        return gl.sum(gl.expand_dims(b_f, 1) * b_Q3, axis=2)

    @gluon.jit
    def _pick(b_w, o_w, i: gl.constexpr):
        # element i of a vector every thread holds whole: an in-thread select the compiler folds
        return gl.sum(gl.where(o_w == i, b_w, 0.0), axis=0)

    @gluon.jit
    def _draft_prefix(o_t, b_lddW, o_w, TP: gl.constexpr):
        """`sum_{i <= t} ld_i` of the drafts for each lane's t (`o_t`, any layout), from the log
        decays held whole by every thread (`b_lddW`, positions `o_w`)."""
        acc = o_t.to(gl.float32) * 0.0
        for i in gl.static_range(TP):
            acc += gl.where(o_t >= i, _pick(b_lddW, o_w, i), 0.0)
        return acc

    @triton.heuristics(dict(OPTIONAL_INPUTS, HAS_N=given("num_drafts")))
    @gluon.jit
    def _gluon_verify_kernel(
        x, dt, B, C, A, dt_bias, D, z, out,
        ckpt, ckpt_lp, buf_ld, buf_w, buf_k, cursor, pending, epoch, arrive, slot_ids, num_drafts, kq,
        pad_ckpt, pad_ld, pad_w, pad_k, pad_cur, pad_pend,
        stride_x_b, stride_x_t, stride_x_h, stride_dt_b, stride_dt_t,
        stride_B_b, stride_B_t, stride_B_g, stride_C_b, stride_C_t, stride_C_g,
        stride_z_b, stride_z_t, stride_z_h, stride_o_b, stride_o_t, stride_o_h,
        HV: gl.constexpr, Hk: gl.constexpr, V: gl.constexpr, K: gl.constexpr, LB: gl.constexpr,
        WINDOW: gl.constexpr, T: gl.constexpr, TP: gl.constexpr, PD: gl.constexpr, BV: gl.constexpr,
        BL: gl.constexpr, NW: gl.constexpr, LKW: gl.constexpr, LRW: gl.constexpr, RC: gl.constexpr,
        RCK: gl.constexpr, RCD: gl.constexpr, VK: gl.constexpr, VW: gl.constexpr, HVP: gl.constexpr,
        HKP: gl.constexpr, HAS_D: gl.constexpr, HAS_Z: gl.constexpr, HAS_N: gl.constexpr,
        NPOS: gl.constexpr, RECMASK: gl.constexpr, KQ: gl.constexpr, MMA: gl.constexpr, NQ: gl.constexpr,
        QP: gl.constexpr, YN: gl.constexpr, KP: gl.constexpr, LPT: gl.constexpr, KG: gl.constexpr = False,
    ):
        # Layouts (NW warps, K = 128, BV = 16 NW, TP drafts padded, BL record positions):
        # LT   the tile [BV, K] as copied and folded: a row per warp, 4 columns per lane
        # L3   the row loop [rows, TP, K]: the TP queries across lanes, 4 columns per piece,
        #      LKW lanes over K (32 columns per thread; 16 for one query)
        # LC3  the records' sum [positions, TP, BV]: queries across lanes, 4 rows per thread,
        #      positions in-thread (8 / TP lanes over them), warps over the rows
        # OL   the outputs [TP, BV] (LC3 without its positions)
        # LE   the weight tiles [positions, TP], about one element per thread
        # LA1  [BL] positions one per lane (the suffix scan); LP / LW the same held whole by
        #      every thread (in-thread picks)
        # LKC, LWC, LIN, LXI  the copies and loads of keys, values and the drafts' inputs, in
        #      16-byte pieces where the dtype allows
        gl.static_assert(not KG or (MMA and KQ), "KG (keys from global memory) needs MMA and KQ")
        LT: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [LRW, TP, LKW], [NW, 1, 1], [2, 1, 0])
        LC3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [8 // TP, TP, 4], [1, 1, NW], [2, 1, 0])
        OL: gl.constexpr = gl.SliceLayout(0, LC3)
        LCW: gl.constexpr = gl.SliceLayout(1, LC3)
        LCE: gl.constexpr = gl.SliceLayout(2, LC3)
        LE: gl.constexpr = gl.BlockedLayout([1, 1], [32 // TP, TP], [NW, 1], [1, 0])
        LA1: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        LP: gl.constexpr = gl.BlockedLayout([BL], [32], [NW], [0])
        LW: gl.constexpr = gl.BlockedLayout([PD], [32], [NW], [0])
        LKC: gl.constexpr = gl.BlockedLayout([1, VK], [32 * VK // K, K // VK], [NW, 1], [1, 0])
        LWC: gl.constexpr = gl.BlockedLayout([1, VW], [32 * VW // BV, BV // VW], [NW, 1], [1, 0])
        LIN: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
        LXI: gl.constexpr = gl.BlockedLayout([1, 4], [128 // BV, BV // 4], [NW, 1], [1, 0])
        SM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        LLC: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])     # LPT's copy: 8 x 16 bits
        NVB: gl.constexpr = V // BV
        HG: gl.constexpr = HV // Hk

        pid = gl.program_id(0)
        i_b = gl.program_id(1).to(gl.int64)
        i_v = pid % NVB
        i_h = pid // NVB
        i_g = i_h // HG
        v0 = i_v * BV

        o_to = gl.arange(0, TP, layout=gl.SliceLayout(1, OL))
        o_vo = gl.arange(0, BV, layout=gl.SliceLayout(0, OL))
        m_to = (o_to < T)[:, None] & (o_vo < BV)[None, :]
        p_o = out + i_b * stride_o_b + i_h * stride_o_h + v0 + (o_to[:, None] * stride_o_t + o_vo[None, :])
        slot = gl.load(slot_ids + i_b).to(gl.int64)
        if slot < 0:
            gl.store(p_o, gl.zeros([TP, BV], gl.float32, OL).to(out.dtype.element_ty), mask=m_to)
            return
        # slot-strided state (vLLM's pages): the bases moved by the slot's padding
        ckpt, buf_ld, buf_w, buf_k, cursor = _slot_bases(slot, ckpt, buf_ld, buf_w, buf_k, cursor, pad_ckpt, pad_ld,
                                                         pad_w, pad_k, pad_cur)
        pending += slot * pad_pend

        # 1. the tile to shared memory (its own copy group)
        p_S = ckpt + slot * (HV * V * K) + i_h * (V * K) + v0 * K
        if LPT:
            # a pool with an fp16/bf16 copy (LPT 1/2, verify_lp.py's contract): a row that
            # flushes folds the fp32 checkpoint, the others' drafts read the copy, half the
            # bytes; which one is copied waits for the cursor. The copy lands in the first half
            # of the fp32 tile's shared memory
            h = gl.load(cursor + slot)
            n = _draft_count(num_drafts, i_b, h, T, HAS_N)
            s_S = gl.allocate_shared_memory(gl.float32, [BV, K], SM)
            s_L = _lp_tile_view(s_S, BV, K, SM)
            if h + n > WINDOW:
                _async_load(s_S, p_S + _tile_offsets(BV, K, LT), eviction_policy="evict_first")
            else:
                p_L = ckpt_lp + slot * (HV * V * K) + i_h * (V * K) + v0 * K
                _async_load(s_L, p_L + _tile_offsets(BV, K, LLC), eviction_policy="evict_first")
            cp.commit_group()
            _barrier()
        elif MMA:
            # the MMA operand layout reads 8 rows x 32 bytes per warp access; rows K * 4 bytes
            # apart all start in bank 0, an 8-way conflict unswizzled. 16-byte units XOR-ed with
            # the row (mod 8) spread them over the 32 banks (2 wavefronts for 256 bytes, the
            # least), and keep the copy's 16-byte pieces and the row loop's reads contiguous
            s_S = _tile_to_shared(p_S, BV, K, LT, gl.SwizzledSharedLayout(4, 1, 8, [1, 0]))
        else:
            s_S = _tile_to_shared(p_S, BV, K, LT, SM)

        # 2. cursor, draft count, the drafts' inputs (none waits for the cursor)
        if not LPT:
            h = gl.load(cursor + slot)
            n = _draft_count(num_drafts, i_b, h, T, HAS_N)
        LQ: gl.constexpr = gl.SliceLayout(0, L3)
        o_tq = gl.arange(0, TP, layout=gl.SliceLayout(1, LQ))
        o_kq = gl.arange(0, K, layout=gl.SliceLayout(0, LQ))
        p_Ct = C + i_b * stride_C_b + i_g * stride_C_g
        b_Qr = gl.load(p_Ct + (o_tq[:, None] * stride_C_t + o_kq[None, :]), mask=(o_tq < T)[:, None], other=0.0)
        if MMA:
            # the queries as the tensor cores' B operand (NQ rows, zero past T), staged now, while
            # the tile is in flight: loaded after it landed, they would add an L2 round trip to
            # every program's critical path
            LQN: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
            o_tn = gl.arange(0, NQ, layout=gl.SliceLayout(1, LQN))
            o_kn = gl.arange(0, K, layout=gl.SliceLayout(0, LQN))
            b_Qn = gl.load(p_Ct + (o_tn[:, None] * stride_C_t + o_kn[None, :]), mask=(o_tn < T)[:, None], other=0.0)
            s_Q = gl.allocate_shared_memory(C.dtype.element_ty, [NQ, K], gl.SwizzledSharedLayout(8, 1, 8, [1, 0]),
                                            b_Qn)
        o_tb = gl.arange(0, PD, layout=gl.SliceLayout(1, LIN))
        o_kb = gl.arange(0, K, layout=gl.SliceLayout(0, LIN))
        p_Bt = B + i_b * stride_B_b + i_g * stride_B_g
        b_Kdr = gl.load(p_Bt + (o_tb[:, None] * stride_B_t + o_kb[None, :]), mask=(o_tb < T)[:, None], other=0.0)
        o_tx = gl.arange(0, PD, layout=gl.SliceLayout(1, LXI))
        o_vx = gl.arange(0, BV, layout=gl.SliceLayout(0, LXI))
        p_xt = x + i_b * stride_x_b + i_h * stride_x_h + v0
        b_Xdr = gl.load(p_xt + (o_tx[:, None] * stride_x_t + o_vx[None, :]), mask=(o_tx < T)[:, None], other=0.0)
        o_td = gl.arange(0, PD, layout=LA1)
        b_dtr = gl.load(dt + i_b * stride_dt_b + o_td * stride_dt_t + i_h, mask=o_td < T, other=0.0).to(gl.float32)
        b_dtb = gl.load(dt_bias + i_h).to(gl.float32)
        b_A = gl.load(A + i_h).to(gl.float32)
        b_rA = gl.fdiv(1.0, b_A)
        if HAS_Z:
            b_z = gl.load(z + i_b * stride_z_b + i_h * stride_z_h + v0 + (o_to[:, None] * stride_z_t + o_vo[None, :]),
                          mask=m_to, other=0.0).to(gl.float32)
        if HAS_D:
            b_D = gl.load(D + i_h).to(gl.float32)

        # the committed records: log decays (ld_{j+1} and ld_j, one position per lane), the
        # group's keys and this program's rows of x into shared memory. RECMASK predicates them
        # on the cursor (they wait for it), else on the NPOS positions a record can occupy
        # (issued at once); positions at or past the cursor are selected away after either way
        o_l = gl.arange(0, BL, layout=LA1)
        p_ldh = buf_ld + slot * (LB * HV) + i_h
        b_ld1 = gl.load(p_ldh + (o_l + 1) * HV, mask=(o_l + 1 < h) if RECMASK else (o_l + 1 < NPOS), other=0.0)
        b_ldj = gl.load(p_ldh + o_l * HV, mask=(o_l < h) if RECMASK else (o_l < NPOS), other=0.0)
        o_lk = gl.arange(0, BL, layout=gl.SliceLayout(1, LKC))
        o_kk = gl.arange(0, K, layout=gl.SliceLayout(0, LKC))
        p_Kg = buf_k + slot * (LB * Hk * K) + i_g * K
        if KG:
            # the keys only a flushing program reads (MMA and KQ): from global memory in its fold,
            # no shared copy (4 KB a program at window 16: a quarter of Nano-4B's 16.7 KB)
            s_K = None
        else:
            s_K = gl.allocate_shared_memory(buf_k.dtype.element_ty, [BL, K], SM)
            m_lk = (o_lk < h) if RECMASK else (o_lk < NPOS)
            _async_load(s_K, p_Kg + (o_lk[:, None] * (Hk * K) + o_kk[None, :]),
                        mask=m_lk[:, None] & (o_kk < K)[None, :])
        o_lw = gl.arange(0, BL, layout=gl.SliceLayout(1, LWC))
        o_vw = gl.arange(0, BV, layout=gl.SliceLayout(0, LWC))
        p_Wh = buf_w + slot * (LB * HV * V) + i_h * V + v0
        s_W = gl.allocate_shared_memory(buf_w.dtype.element_ty, [BL, BV], SM)
        m_lw = (o_lw < h) if RECMASK else (o_lw < NPOS)
        _async_load(s_W, p_Wh + (o_lw[:, None] * (HV * V) + o_vw[None, :]), mask=m_lw[:, None] & (o_vw < BV)[None, :])
        cp.commit_group()

        # 3. weights. Committed: sfx_j = sum_{j<i<h} ld_i (a reverse scan), dt_j = ld_j / A,
        # L = sum_{j<h} ld_j. Drafts: dt_r, ld_r (0 past the row's count), held whole too.
        flush = h + n > WINDOW
        hc = gl.where(flush, 0, h)                       # committed records the queries see
        b_sfx = gl.associative_scan(gl.where(o_l + 1 < h, b_ld1, 0.0), 0, _add, reverse=True)
        b_dtj = gl.where(o_l < h, b_ldj * b_rA, 0.0)
        b_L = gl.sum(gl.where(o_l < h, b_ldj, 0.0), axis=0)
        b_dtd = gl.where(o_td < n, _softplus(b_dtr + b_dtb), 0.0)
        b_ldd = b_dtd * b_A
        b_lddW = gl.convert_layout(b_ldd, LW)
        o_w = gl.arange(0, PD, layout=LW)
        # E[j, t] = exp(sfx_j + sum_{i<=t} ldd_i) dt_j for j < h' (the records between j and
        # draft t, all same-signed)
        o_jE = gl.arange(0, BL, layout=gl.SliceLayout(1, LE))
        o_tE = gl.arange(0, TP, layout=gl.SliceLayout(0, LE))
        b_DtE = _draft_prefix(o_tE, b_lddW, o_w, TP)
        b_sfxE = gl.convert_layout(b_sfx, gl.SliceLayout(1, LE))
        b_dtjE = gl.convert_layout(b_dtj, gl.SliceLayout(1, LE))
        b_E = gl.where((o_jE < hc)[:, None] & (o_tE < TP)[None, :],
                       gl.exp(b_sfxE[:, None] + b_DtE[None, :]) * b_dtjE[:, None], 0.0)
        s_E = gl.allocate_shared_memory(gl.float32, [BL, TP], SM, b_E)
        # Ed[r, t] = exp(sum_{r<i<=t} ldd_i) dt_r for r <= t
        o_rE = gl.arange(0, PD, layout=gl.SliceLayout(1, LE))
        b_dsx = gl.zeros([PD, TP], gl.float32, LE)
        for i in gl.static_range(1, TP):
            b_dsx += gl.where((o_rE[:, None] < i) & (o_tE[None, :] >= i), _pick(b_lddW, o_w, i), 0.0)
        b_dtdE = gl.convert_layout(b_dtd, gl.SliceLayout(1, LE))
        b_Ed = gl.where(o_rE[:, None] <= o_tE[None, :], gl.exp(b_dsx) * b_dtdE[:, None], 0.0)
        s_Ed = gl.allocate_shared_memory(gl.float32, [PD, TP], SM, b_Ed)
        # the drafts' keys and x (as given) to shared memory for the row loop and the sums
        if MMA and KQ:
            # the keys' products come from the launch before, and the tile's from the tensor
            # cores: the drafts' keys are read only by the program that records them, from global
            # memory then; their 2 KB of shared memory hold the key products instead (read after
            # the tile lands, so staged now), keeping 5 programs per SM at Super's shape
            p_kqp = kq + (i_b * Hk + i_g) * ((BL + PD) * TP)
            o_jp = gl.arange(0, BL, layout=gl.SliceLayout(1, LE))
            o_rp = gl.arange(0, PD, layout=gl.SliceLayout(1, LE))
            s_kqp = gl.allocate_shared_memory(gl.float32, [BL, TP], SM, gl.load(p_kqp + o_jp[:, None] * TP +
                                                                                o_tE[None, :]))
            s_kdqp = gl.allocate_shared_memory(gl.float32, [PD, TP], SM, gl.load(p_kqp + (BL + o_rp)[:, None] * TP +
                                                                                 o_tE[None, :]))
        else:
            s_KD = gl.allocate_shared_memory(B.dtype.element_ty, [PD, K], SM, b_Kdr)
        s_XD = gl.allocate_shared_memory(x.dtype.element_ty, [PD, BV], SM, b_Xdr)
        b_Q3 = gl.expand_dims(b_Qr.to(gl.float32), 0)                                  # [1, TP, K]

        # 4. the copies landed; on a flush C <- g_{0:h-1} C + sum_{j<h} g_{j+1:h-1} dt_j x_j k_j^T
        # in row chunks of the tile in shared memory (one exact fp32 rank-1 update per record,
        # the records read from their shared copies), stored to the checkpoint
        cp.wait_group(0)
        _barrier()
        if MMA:
            # (MMA is the outer test: a constexpr, so that the FMA fold below, whose row slices
            # would split the swizzled tile, is not built beside it)
            if flush:
                # on the tensor cores: dS = X @ K_c per chunk of 32 columns, X[v, j] = coef_j x_j[v]
                # (zero at and past the cursor: records there may hold NaN, and 0 * NaN is NaN in a
                # product), the keys as stored (zeroed there likewise), then C <- g C + dS in fp32
                # X formed in the A operand's layout from the records' shared copy: in registers,
                # not staged (4 KB more shared memory would leave 4 programs per SM, not 5)
                _fold_mma_records(s_S, s_W, s_K, gl.where(o_l < h, gl.exp(b_sfx) * b_dtj, 0.0), h, p_S, gl.exp(b_L),
                                  BV, K, BL, KP, NW, p_K=p_Kg, stride_k=Hk * K, KG=KG, KN=NPOS)
                _barrier()
        else:
            if flush:
                # LF: 4 consecutive rows x 4 columns per thread, so that a record's values for a
                # thread's rows are one vector load; rows RCF = 4 NW per chunk
                LF: gl.constexpr = gl.BlockedLayout([4, 4], [1, 32], [NW, 1], [1, 0])
                RCF: gl.constexpr = 4 * NW
                b_g = gl.exp(b_L)
                b_coefP = gl.convert_layout(gl.where(o_l < h, gl.exp(b_sfx) * b_dtj, 0.0), LP)
                o_lP = gl.arange(0, BL, layout=LP)
                o_tk = gl.arange(0, K, layout=gl.SliceLayout(0, LF))
                s_Wt = s_W.permute([1, 0])                                                  # [BV, BL]
                for r0 in gl.static_range(0, BV, RCF):
                    o_rc = r0 + gl.arange(0, RCF, layout=gl.SliceLayout(1, LF))
                    b_Sc = b_g * s_S.slice(r0, RCF, dim=0).load(LF)
                    for j in gl.static_range(BL):
                        # a uniform branch, not a select: positions past the cursor are never read
                        # (they may hold NaN) and cost nothing
                        if j < h:
                            # w_j [RCF, 1] and k_j [1, K] as 2-d slices in LF itself: no conversion
                            w_j = s_Wt.slice(r0, RCF, dim=0).slice(j, 1, dim=1).load(LF).to(gl.float32)
                            k_j = s_K.slice(j, 1, dim=0).load(LF).to(gl.float32)
                            b_Sc += (_pick(b_coefP, o_lP, j) * w_j) * k_j
                    s_S.slice(r0, RCF, dim=0).store(b_Sc)
                    gl.store(p_S + (o_rc[:, None] * K + o_tk[None, :]), b_Sc)
                    if LPT:
                        # the copy round-to-nearest from the new checkpoint (lowp.store_lp_rows)
                        gl.store(ckpt_lp + slot * (HV * V * K) + i_h * (V * K) + v0 * K +
                                 (o_rc[:, None] * K + o_tk[None, :]), _lp_encode(b_Sc, LPT))
                _barrier()

        # 5. the row loop: the tile's rows, the committed keys (chunks below h'), the drafts' keys
        # (KQ: the keys' products with the queries come from the launch before, formed once per
        # row and group, utils/key_products.py)
        s_y = gl.allocate_shared_memory(gl.float32, [BV, YN], SM)
        if MMA:
            s_y.store(_tile_vectors_mma(s_S, s_Q, BV, K, NQ, QP, NW))
        elif LPT:
            if flush:
                for r0 in gl.static_range(0, BV, RC):
                    s_y.slice(r0, RC, dim=0).store(_rows_q(s_S.slice(r0, RC, dim=0), b_Q3, L3))
            else:
                for r0 in gl.static_range(0, BV, RC):
                    s_y.slice(r0, RC, dim=0).store(_rows_q_lp(s_L.slice(r0, RC, dim=0), b_Q3, L3, LPT))
        else:
            for r0 in gl.static_range(0, BV, RC):
                s_y.slice(r0, RC, dim=0).store(_rows_q(s_S.slice(r0, RC, dim=0), b_Q3, L3))
        if not KQ:
            s_kq = gl.allocate_shared_memory(gl.float32, [BL, TP], SM)
            for r0 in gl.static_range(0, BL, RCK):
                if r0 < hc:
                    s_kq.slice(r0, RCK, dim=0).store(_rows_q(s_K.slice(r0, RCK, dim=0), b_Q3, L3))
            s_kdq = gl.allocate_shared_memory(gl.float32, [PD, TP], SM)
            for r0 in gl.static_range(0, PD, RCD):
                s_kdq.slice(r0, RCD, dim=0).store(_rows_q(s_KD.slice(r0, RCD, dim=0), b_Q3, L3))
        _barrier()
        p_kq = kq + (i_b * Hk + i_g) * ((BL + PD) * TP)
        o_tc3 = gl.arange(0, TP, layout=gl.SliceLayout(0, LCE))

        # 6. y[t] = g_{0:p_t} (C q_t) + sum_{j<h'} x_j E[j,t] (k_j.q_t) + sum_{r<=t} x_r Ed[r,t] (k_r.q_t)
        b_rec = gl.zeros([TP, BV], gl.float32, OL)
        for c0 in gl.static_range(0, BL, 8):
            if c0 < hc:
                o_jc = c0 + gl.arange(0, 8, layout=gl.SliceLayout(1, LCE))
                if MMA and KQ:
                    b_kqc = s_kqp.slice(c0, 8, dim=0).load(LCE)
                elif KQ:
                    b_kqc = gl.load(p_kq + o_jc[:, None] * TP + o_tc3[None, :])
                else:
                    b_kqc = s_kq.slice(c0, 8, dim=0).load(LCE)
                b_wc = gl.where((o_jc < hc)[:, None], s_E.slice(c0, 8, dim=0).load(LCE) * b_kqc, 0.0)
                o_jw = c0 + gl.arange(0, 8, layout=gl.SliceLayout(1, LCW))
                b_Wc = gl.where((o_jw < hc)[:, None], s_W.slice(c0, 8, dim=0).load(LCW).to(gl.float32), 0.0)
                b_rec += gl.sum(gl.expand_dims(b_Wc, 1) * gl.expand_dims(b_wc, 2), axis=0)
        o_rc3 = gl.arange(0, PD, layout=gl.SliceLayout(1, LCE))
        if MMA and KQ:
            b_kdq = s_kdqp.load(LCE)
        elif KQ:
            b_kdq = gl.load(p_kq + (BL + o_rc3)[:, None] * TP + o_tc3[None, :])
        else:
            b_kdq = s_kdq.load(LCE)
        b_wd = s_Ed.load(LCE) * b_kdq                                                     # [PD, TP]
        b_Xc = s_XD.load(LCW).to(gl.float32)                                              # [PD, BV]
        # drafts after t are selected away, not multiplied by zero (a poisoned later draft must
        # leave no trace in an earlier output)
        m_rt = gl.expand_dims(o_rc3[:, None] <= o_tc3[None, :], 2)
        b_rec += gl.sum(gl.where(m_rt, gl.expand_dims(b_Xc, 1) * gl.expand_dims(b_wd, 2), 0.0), axis=0)
        b_G = gl.exp(gl.where(flush, 0.0, b_L) + _draft_prefix(o_to, b_lddW, o_w, TP))  # g_{0:p_t}
        b_y = b_G[:, None] * s_y.slice(0, TP, dim=1).permute([1, 0]).load(OL) + b_rec
        b_xo = s_XD.slice(0, TP, dim=0).load(OL)                                          # x_t as given
        if HAS_D:
            b_y += b_D * b_xo.to(gl.float32)
        if HAS_Z:
            b_y = b_y * b_z / (1.0 + gl.exp(-b_z))
        b_y = gl.where((o_to < n)[:, None], b_y, 0.0)
        gl.store(p_o, b_y.to(out.dtype.element_ty), mask=m_to)

        # the drafts' records at h'..h'+n-1: this program's rows of x (read by no other program;
        # its own reads of the buffer came from the copies); on no flush the head's log decays
        # and the group's keys from their owners (positions >= h, which no program reads)
        m_tn = (o_to < n)[:, None] & (o_vo < BV)[None, :]
        p_wt = p_Wh + ((hc + o_to)[:, None] * (HV * V) + o_vo[None, :])
        gl.store(p_wt, b_xo.to(buf_w.dtype.element_ty), mask=m_tn)
        if not flush:
            if i_v == 0:
                gl.store(p_ldh + (hc + o_td) * HV, b_ldd, mask=o_td < n)
                if i_h % HG == 0:
                    p_kn = p_Kg + ((hc + o_tb)[:, None] * (Hk * K) + o_kb[None, :])
                    if MMA and KQ:
                        b_Kdn = gl.load(p_Bt + (o_tb[:, None] * stride_B_t + o_kb[None, :]), mask=(o_tb < T)[:, None],
                                        other=0.0)
                    else:
                        b_Kdn = s_KD.load(LIN)
                    gl.store(p_kn, b_Kdn.to(gl.float32).to(buf_k.dtype.element_ty), mask=(o_tb < n)[:, None])

        last = _verify_arrive(arrive, cursor, pending, epoch, slot, hc, n, flush, HV * NVB)
        if flush & last:
            # positions 0..n-1 held committed records that other programs of the slot read
            _write_shared_drafts(dt, B, A, dt_bias, buf_ld, buf_k, slot, n, i_b * stride_dt_b, stride_dt_t,
                                 i_b * stride_B_b, stride_B_t, stride_B_g, HV, Hk, K, LB, T, HVP, HKP, NW)


def launch_gluon_verify(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch,
                        arrive, slot_ids, num_drafts, out, window, BV, num_warps, recmask=False, kq=False, mma=False,
                        ckpt_lp=None, lp_code=0, keys_global=None):
    """Launch `_gluon_verify_kernel` (grid `(HV * V / BV, Bt)`); the caller checked
    `gluon_verify_unsupported`. `recmask`: predicate the committed records' copies on the
    cursor (no traffic for empty positions; they then wait for it) rather than the window.
    `kq`: the group's key products with the queries (committed records and drafts) formed first
    by `utils.key_products.verify_key_products`, one program per (row, group), instead of by
    every program of the group's heads and V-blocks. `mma`: the tile's products with the queries
    on the tensor cores (`utils.gluon_mma._tile_vectors_mma`, exact), instead of the row loop's FMA dots.
    `ckpt_lp`, `lp_code` (1 fp16, 2 bf16; FMA dots only, contiguous unpadded checkpoints): a pool's
    low-precision copy as int16 bits, verify_lp.py's contract (rows without an early flush read
    the copy; a flush folds `ckpt` and writes both). `keys_global` (None: the module's
    `KEYS_GLOBAL` as it is at the call; with `mma` and `kq` only): an early flush's fold reads the
    committed keys from global memory, none staged in shared memory."""
    Bt, T, HV, V = x.shape
    Hk, K = B.shape[2], B.shape[3]
    LB = buf_ld.shape[1]
    if Bt == 0:
        return
    tiles = _tiles(T, window, LB, num_warps)
    nq = max(8, tiles["TP"])           # the MMA's N: at least the 8 columns of m16n8k16
    if lp_code and (mma or lp_code not in (1, 2) or ckpt_lp is None):
        raise ValueError("a low-precision copy: fp16 or bf16 (lp_code 1, 2) with the FMA dots")
    pads = slot_pads(ckpt, buf_ld, buf_w, buf_k, cursor, pending)
    if lp_code and any(pads.values()):
        raise ValueError("a low-precision copy takes contiguous, unpadded state")
    kqs = verify_key_products(C, B, buf_k, cursor, slot_ids, num_drafts, window, tiles["BL"], tiles["TP"],
                              tiles["PD"], pads["pad_k"], pads["pad_cur"]) if kq else slot_ids
    # D, z and num_drafts absent: None (the heuristics set HAS_D, HAS_Z, HAS_N)
    _gluon_verify_kernel[(HV * (V // BV), Bt)](
        x, dt, B, C, A, dt_bias, D, z, out,
        ckpt, ckpt if ckpt_lp is None else ckpt_lp, buf_ld, buf_w, buf_k, cursor, pending, epoch, arrive, slot_ids,
        num_drafts, kqs,
        *pads.values(),
        x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1),
        B.stride(0), B.stride(1), B.stride(2), C.stride(0), C.stride(1), C.stride(2),
        z.stride(0) if z is not None else 0, z.stride(1) if z is not None else 0,
        z.stride(2) if z is not None else 0, out.stride(0), out.stride(1), out.stride(2),
        HV=HV, Hk=Hk, V=V, K=K, LB=LB, WINDOW=window, T=T, BV=BV, NW=num_warps,
        VK=16 // buf_k.element_size(), VW=16 // buf_w.element_size(),
        HVP=triton.next_power_of_2(HV), HKP=triton.next_power_of_2(Hk), RECMASK=bool(recmask), KQ=bool(kq),
        MMA=bool(mma), NQ=nq, QP=pieces(C.dtype), YN=nq if mma else tiles["TP"], KP=pieces(buf_k.dtype),
        LPT=int(lp_code), KG=bool(mma and kq and (KEYS_GLOBAL if keys_global is None else keys_global)),
        num_warps=num_warps, **tiles)
