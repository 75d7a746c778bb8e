"""Mamba-2 speculative verification on ReplaySSM state with exact 16-bit tensor-core products
(config key `mma`).

The step of `verify._replay_verify_kernel` (its docstring has the mathematics and the
contract), as products: every draft's query is a column of `C Q^T` (`[BV, K] @ [K, TP]`), the
committed and draft keys' inner products with the queries are `[BL | TP, K] @ [K, TP]`, the
records' and drafts' weighted values are `[BV, BL | TP] @ [BL | TP, TP]`, and an early flush's
fold is `X @ K_rec` (`[BV, BL] @ [BL, K]`). Each runs on 16-bit tensor cores at fp32
accuracy (`utils.dots.dot_bf16x`: fp32 operands split into three exact bf16 pieces, 16-bit
operands as given, a fresh accumulator per K chunk added into fp32 registers). Exact TF32
pieces in one accumulation chain over K measured 1.51-1.54x the conventional kernel's error on
the H200, past the 1.5x bar.

The tile is streamed in K chunks of BKC columns rather than held whole: chunk by chunk the fold
(on a flush: `C_c <- g C_c + X @ K_c`, stored), the queries' product and the keys' products.
The flush branch is uniform per program and hoisted out of the chunk loop. A non-finite value
in a verified draft makes its own and later outputs of that row NaN (in a product it would
reach earlier drafts through 0 * NaN, so the product takes finite values only).
"""
import triton
import triton.language as tl

from ..utils.cursor import slot_bases, verify_hand_off
from ..utils.dots import dot_bf16x, pieces
from .common import OPTIONAL_INPUTS, draft_decays, given, verify_row_bounds, write_shared_drafts

__all__ = []


def _pieces(name):
    return lambda args: pieces(args[name].dtype)


@triton.jit
def _chunk(S_c, p_S, m_S, b_Xf, g_all, p_kb, o_l, m_l, o_kc, m_kc, b_QTc, b_Kdc, b_Y, b_Gc, b_Gd,
           FOLD: tl.constexpr, NKB: tl.constexpr, NKD: tl.constexpr, NQ: tl.constexpr,
           Hk: tl.constexpr, K: tl.constexpr, KQ: tl.constexpr, WIDEN: tl.constexpr):
    """One K chunk: the fold (FOLD: stored), the queries' product, the keys' products (unless
    KQ: formed by the launch before)."""
    if FOLD or not KQ:
        b_Kbc = tl.load(p_kb + o_l[:, None] * (Hk * K) + o_kc[None, :], mask=m_l[:, None] & m_kc[None, :],
                        other=0.0)                                                      # [BL, BKC]
    if FOLD:
        S_c = S_c * g_all + dot_bf16x(b_Xf, b_Kbc, 3, NKB, WIDEN)
        tl.store(p_S, S_c, mask=m_S)
    b_Y += dot_bf16x(S_c, b_QTc, 3, NQ, WIDEN)
    if not KQ:
        b_Gc += dot_bf16x(b_Kbc, b_QTc, NKB, NQ, WIDEN)
        b_Gd += dot_bf16x(b_Kdc, b_QTc, NKD, NQ, WIDEN)
    return b_Y, b_Gc, b_Gd


@triton.jit
def _tile_pass(p_S0, m_v, p_kb, C, B, off_C, off_B, stride_C_t, stride_B_t, o_v, o_l, m_l, o_t, m_t, b_Xf,
               g_all, b_Y, b_Gc, b_Gd, FOLD: tl.constexpr, NKB: tl.constexpr, NKD: tl.constexpr,
               NQ: tl.constexpr, Hk: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr,
               KQ: tl.constexpr, WIDEN: tl.constexpr):
    for kc in tl.static_range(0, BK, BKC):
        o_kc = kc + tl.arange(0, BKC)
        m_kc = o_kc < K
        p_S = p_S0 + (o_v[:, None] * K + o_kc[None, :])
        m_S = m_v[:, None] & m_kc[None, :]
        S_c = tl.load(p_S, mask=m_S, other=0.0, eviction_policy="evict_first")          # [BV, BKC]
        b_QTc = tl.load(C + off_C + o_t[None, :] * stride_C_t + o_kc[:, None], mask=m_kc[:, None] & m_t[None, :],
                        other=0.0)                                                      # [BKC, TP]
        if KQ:
            b_Kdc = b_QTc          # not read
        else:
            b_Kdc = tl.load(B + off_B + o_t[:, None] * stride_B_t + o_kc[None, :],
                            mask=m_t[:, None] & m_kc[None, :], other=0.0)               # [TP, BKC]
        b_Y, b_Gc, b_Gd = _chunk(S_c, p_S, m_S, b_Xf, g_all, p_kb, o_l, m_l, o_kc, m_kc, b_QTc, b_Kdc, b_Y, b_Gc,
                                 b_Gd, FOLD, NKB, NKD, NQ, Hk, K, KQ, WIDEN)
    return b_Y, b_Gc, b_Gd


@triton.heuristics(dict(OPTIONAL_INPUTS, HAS_N=given("num_drafts"), NKB=_pieces("buf_k"), NKD=_pieces("B"),
                        NQ=_pieces("C"), NW=_pieces("buf_w"), NX=_pieces("x")))
@triton.jit
def _replay_verify_mma_kernel(
    x, dt, B, C, A, dt_bias, D, z, out,
    ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch, arrive, slot_ids, num_drafts, kq,
    pad_ckpt, pad_ld, pad_w, pad_k, pad_cur, pad_pend,
    stride_x_b, stride_x_t, stride_x_h, stride_dt_b, stride_dt_t,
    stride_B_b, stride_B_t, stride_B_g, stride_C_b, stride_C_t, stride_C_g,
    stride_z_b, stride_z_t, stride_z_h, stride_o_b, stride_o_t, stride_o_h,
    HV: tl.constexpr, Hk: tl.constexpr, V: tl.constexpr, K: tl.constexpr, LB: tl.constexpr,
    WINDOW: tl.constexpr, T: tl.constexpr, TP: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    BKC: tl.constexpr, BL: tl.constexpr, NVB: tl.constexpr, HVP: tl.constexpr, HKP: tl.constexpr,
    NKB: tl.constexpr, NKD: tl.constexpr, NQ: tl.constexpr, NW: tl.constexpr, NX: tl.constexpr,
    KQ: tl.constexpr, WIDEN: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_N: tl.constexpr,
):
    # grid (HV * NVB, Bt): a program owns V-block i_v of head i_h; value rows are every
    # product's M side
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
        b_0 = tl.zeros([BV, TP], dtype=tl.float32).to(p_o.dtype.element_ty)
        tl.store(p_o + o_t[None, :] * stride_o_t + o_v[:, None], b_0,
                 mask=m_v[:, None] & (o_t < T)[None, :])
        return
    ckpt, buf_ld, buf_w, buf_k, cursor = slot_bases(slot, ckpt, buf_ld, buf_w, buf_k, cursor, pad_ckpt, pad_ld,
                                                    pad_w, pad_k, pad_cur)
    pending += slot * pad_pend

    h, n, flush, hc, m_t, m_l, m_c = verify_row_bounds(cursor, slot, num_drafts, i_b, o_t, o_l, T, WINDOW, HAS_N)

    # committed records (all h of them: the fold reads them; the queries only those < h'):
    # log decays of this head, values of its rows (transposed); the group's keys per chunk
    p_ld = buf_ld + slot * (LB * HV) + i_h
    p_kb = buf_k + slot * (LB * Hk * K) + i_g * K
    p_wb = buf_w + slot * (LB * HV * V) + i_h * V
    b_ldc = tl.load(p_ld + o_l * HV, mask=m_l, other=0.0)                               # [BL]
    b_WbT = tl.load(p_wb + o_l[None, :] * (HV * V) + o_v[:, None], mask=m_v[:, None] & m_l[None, :],
                    other=0.0).to(tl.float32)                                           # [BV, BL]

    # the drafts' values and decays (rows >= n masked to zero at the load: never read)
    p_xT = x + i_b * stride_x_b + i_h * stride_x_h + o_t[None, :] * stride_x_t + o_v[:, None]
    m_vt = m_v[:, None] & m_t[None, :]
    b_XiT = tl.load(p_xT, mask=m_vt, other=0.0)                                        # [BV, TP]
    b_XdT = b_XiT.to(tl.float32)
    b_rA, b_dtd, b_ldd = draft_decays(dt, dt_bias, A, i_b * stride_dt_b, stride_dt_t, i_h, o_t, m_t)   # [TP]

    # committed suffixes sum_{j<i<h} ld_i and the drafts' sums sum_{r<i<=t} ld_i, each of
    # same-signed terms (never a difference of prefix sums: weights near 1 keep full precision)
    b_sfx = tl.sum(tl.where(o_l[None, :] > o_l[:, None], b_ldc[None, :], 0.0), axis=1)   # [BL]
    b_dsx = tl.zeros([TP, TP], dtype=tl.float32)                                        # [r, t]
    for i in tl.static_range(1, T):
        ld_i = tl.sum(tl.where(o_t == i, b_ldd, 0.0), axis=0)
        b_dsx += tl.where((o_t[:, None] < i) & (o_t[None, :] >= i), ld_i, 0.0)
    b_Dt = tl.sum(tl.where(o_t[:, None] <= o_t[None, :], b_ldd[:, None], 0.0), axis=0)   # [TP]: up to t

    # the tile in K chunks. On a flush, C <- g_{0:h-1} C + sum_{j<h} g_{j+1:h-1} dt_j x_j k_j^T
    # per chunk (stored: the drafts start from it), then the products with the queries
    p_S0 = ckpt + slot * (HV * V * K) + i_h * (V * K)
    off_C = i_b * stride_C_b + i_g * stride_C_g
    off_B = i_b * stride_B_b + i_g * stride_B_g
    b_Y = tl.zeros([BV, TP], dtype=tl.float32)
    b_Gc = tl.zeros([BL, TP], dtype=tl.float32)                                         # k_j . q_t
    b_Gd = tl.zeros([TP, TP], dtype=tl.float32)                                         # k_r . q_t
    if flush:
        b_Xf = b_WbT * tl.where(m_l, tl.exp(b_sfx) * (b_ldc * b_rA), 0.0)[None, :]
        g_all = tl.exp(tl.sum(b_ldc, axis=0))
        b_Y, b_Gc, b_Gd = _tile_pass(p_S0, m_v, p_kb, C, B, off_C, off_B, stride_C_t, stride_B_t, o_v, o_l, m_l,
                                     o_t, m_t, b_Xf, g_all, b_Y, b_Gc, b_Gd, True, NKB, NKD, NQ, Hk, K, BK, BKC,
                                     KQ, WIDEN)
    else:
        b_Y, b_Gc, b_Gd = _tile_pass(p_S0, m_v, p_kb, C, B, off_C, off_B, stride_C_t, stride_B_t, o_v, o_l, m_l,
                                     o_t, m_t, b_WbT, 1.0, b_Y, b_Gc, b_Gd, False, NKB, NKD, NQ, Hk, K, BK, BKC,
                                     KQ, WIDEN)
    b_Lc = tl.sum(tl.where(m_c, b_ldc, 0.0), axis=0)                                   # log g_{0:hc-1}
    if KQ:
        # utils.key_products.verify_key_products: [BL + TP, TP] of the group, zero past h' and n
        p_kq = kq + (i_b * Hk + i_g) * ((BL + TP) * TP)
        b_Gc = tl.load(p_kq + o_l[:, None] * TP + o_t[None, :])
        b_Gd = tl.load(p_kq + (BL + o_t)[:, None] * TP + o_t[None, :])

    # y[:, t] = g_{0:p_t} C q_t + committed records' terms + drafts' terms (r <= t)
    b_Y = b_Y * tl.exp(b_Lc + b_Dt)[None, :]
    b_Wc = tl.where(m_c[:, None], tl.exp(b_sfx[:, None] + b_Dt[None, :]) * (b_ldc * b_rA)[:, None] * b_Gc, 0.0)
    b_Y += dot_bf16x(b_WbT, b_Wc, NW, 3, WIDEN)
    b_Wd = tl.where(o_t[:, None] <= o_t[None, :], tl.exp(b_dsx) * b_dtd[:, None] * b_Gd, 0.0)
    b_bad = (b_XdT != b_XdT) | (tl.abs(b_XdT) == float("inf"))
    b_Y += dot_bf16x(tl.where(b_bad, 0.0, b_XdT), b_Wd, NX, 3, WIDEN)
    b_Y = tl.where(tl.cumsum(b_bad.to(tl.int32), axis=1) > 0, float("nan"), b_Y)
    if HAS_D:
        b_Y += tl.load(D + i_h).to(tl.float32) * b_XdT
    if HAS_Z:
        b_zT = tl.load(z + i_b * stride_z_b + i_h * stride_z_h + o_t[None, :] * stride_z_t + o_v[:, None],
                       mask=m_vt, other=0.0).to(tl.float32)
        b_Y = b_Y * b_zT / (1.0 + tl.exp(-b_zT))
    b_Y = tl.where(m_t[None, :], b_Y, 0.0)
    tl.store(p_o + o_t[None, :] * stride_o_t + o_v[:, None], b_Y.to(p_o.dtype.element_ty),
             mask=m_v[:, None] & (o_t < T)[None, :])

    # the drafts' records at h'..h'+n-1. A program's own rows of x: after a barrier (its threads
    # read those positions above). x as given (exact when the buffer has x's dtype).
    tl.debug_barrier()
    tl.store(p_wb + (hc + o_t)[None, :] * (HV * V) + o_v[:, None], b_XiT.to(buf_w.dtype.element_ty), mask=m_vt)
    if not flush:
        # positions >= h, which no program reads: the owners write them directly
        if i_v == 0:
            tl.store(p_ld + (hc + o_t) * HV, b_ldd, mask=m_t)
            if i_h % HG == 0:
                b_Kd = tl.load(B + off_B + o_t[:, None] * stride_B_t + o_k[None, :],
                               mask=m_t[:, None] & m_k[None, :], other=0.0)
                tl.store(p_kb + (hc + o_t)[:, None] * (Hk * K) + o_k[None, :], b_Kd.to(buf_k.dtype.element_ty),
                         mask=m_t[:, None] & m_k[None, :])

    last = verify_hand_off(arrive, cursor, pending, epoch, slot, hc, n, flush, HV * NVB)
    if flush & last:
        # positions 0..n-1 held committed records that other programs of the slot read
        write_shared_drafts(dt, B, A, dt_bias, buf_ld, buf_k, slot, n, i_b * stride_dt_b, stride_dt_t,
                            i_b * stride_B_b, stride_B_t, stride_B_g, o_k, m_k, HV, Hk, K, LB, T, HVP, HKP)
