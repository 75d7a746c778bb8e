"""Mamba-2 speculative verification on ReplaySSM state with tensor-core products (T >= 5).

The same step as `verify._replay_verify_kernel` (its docstring has the mathematics and the
contract), arranged for many drafts. There each draft is a matrix-vector product of the
`[BV, K]` checkpoint tile, a chain of shuffle reductions per draft: at T = 8 the chains set
the time (8.5x a conventional step on the H200 at batch 256). Here every draft's query is a
column of one product `C Q^T` (`[BV, K] @ [K, TP]`), and the records' and drafts' inner
products and their weighted sums over values are products too, all at fp32 accuracy through
`utils.dots` (fp32 operands split into exact TF32 pieces). The early-flush fold is one product
over the records as well. Drafts are padded to TP = 16 columns, so the small-T launches stay on
the row-dot kernel; and the tensor cores' accumulation truncates, which at T = 2 and 4 put the
outputs' error just past 1.5x the conventional kernel's (1.51-1.54x on the H200), within it at
T = 8. A non-finite draft value makes its own and later outputs of that value row NaN (in a
product it would reach earlier drafts through 0 * NaN, so the product takes finite values
only).
"""
import torch
import triton
import triton.language as tl

from ..utils.cursor import slot_bases, verify_hand_off
from ..utils.dots import dot_f32
from .common import OPTIONAL_INPUTS, draft_decays, given, load_tile, verify_row_bounds, write_shared_drafts

__all__ = []


def _exact(name):
    # a tensor whose values are TF32-exact (16-bit floats): its products need no split
    return lambda args: args[name].dtype in (torch.bfloat16, torch.float16)


@triton.heuristics(dict(OPTIONAL_INPUTS, HAS_N=given("num_drafts"),
                        EVEN=lambda args: args["V"] % args["BV"] == 0 and args["BK"] == args["K"],
                        KB_EXACT=_exact("buf_k"), KD_EXACT=_exact("B"), Q_EXACT=_exact("C"),
                        W_EXACT=_exact("buf_w"), X_EXACT=_exact("x")))
@triton.jit
def _replay_verify_tc_kernel(
    x, dt, B, C, A, dt_bias, D, z, out,
    ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch, arrive, slot_ids, num_drafts,
    pad_ckpt, pad_ld, pad_w, pad_k, pad_cur, pad_pend,
    stride_x_b, stride_x_t, stride_x_h, stride_dt_b, stride_dt_t,
    stride_B_b, stride_B_t, stride_B_g, stride_C_b, stride_C_t, stride_C_g,
    stride_z_b, stride_z_t, stride_z_h, stride_o_b, stride_o_t, stride_o_h,
    HV: tl.constexpr, Hk: tl.constexpr, V: tl.constexpr, K: tl.constexpr, LB: tl.constexpr,
    WINDOW: tl.constexpr, T: tl.constexpr, TP: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    BL: tl.constexpr, NVB: tl.constexpr, HVP: tl.constexpr, HKP: tl.constexpr,
    KB_EXACT: tl.constexpr, KD_EXACT: tl.constexpr, Q_EXACT: tl.constexpr, W_EXACT: tl.constexpr,
    X_EXACT: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_N: tl.constexpr, EVEN: tl.constexpr,
):
    # grid (HV * NVB, Bt): a program owns V-block i_v of head i_h. Tiles are oriented with the
    # value rows first ([BV, *]) so that every product has the checkpoint's rows as its M side.
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
    # slot-strided state (vLLM's pages): the bases moved by the slot's padding
    ckpt, buf_ld, buf_w, buf_k, cursor = slot_bases(slot, ckpt, buf_ld, buf_w, buf_k, cursor, pad_ckpt, pad_ld,
                                                    pad_w, pad_k, pad_cur)
    pending += slot * pad_pend

    h, n, flush, hc, m_t, m_l, m_c = verify_row_bounds(cursor, slot, num_drafts, i_b, o_t, o_l, T, WINDOW, HAS_N)

    # int32 tile offsets on a 64-bit scalar base (a slot's checkpoint is far below 2^31 elements)
    p_S = ckpt + slot * (HV * V * K) + i_h * (V * K) + (o_v[:, None] * K + o_k[None, :])
    m_S = m_v[:, None] & m_k[None, :]
    b_S = load_tile(p_S, m_S, EVEN)                                                     # [BV, BK]

    # committed records (all h of them: the fold reads them; the queries only those < h'):
    # log decays of this head, keys of its group, values of its rows (transposed)
    p_ld = buf_ld + slot * (LB * HV) + i_h
    p_kb = buf_k + slot * (LB * Hk * K) + i_g * K
    p_wb = buf_w + slot * (LB * HV * V) + i_h * V
    b_ldc = tl.load(p_ld + o_l * HV, mask=m_l, other=0.0)                               # [BL]
    b_Kb = tl.load(p_kb + o_l[:, None] * (Hk * K) + o_k[None, :], mask=m_l[:, None] & m_k[None, :],
                   other=0.0).to(tl.float32)                                            # [BL, BK]
    b_WbT = tl.load(p_wb + o_l[None, :] * (HV * V) + o_v[:, None], mask=m_v[:, None] & m_l[None, :],
                    other=0.0).to(tl.float32)                                           # [BV, BL]

    # the drafts, from the inputs (rows >= n masked to zero at the load: never read)
    b_Kd = tl.load(B + i_b * stride_B_b + i_g * stride_B_g + o_t[:, None] * stride_B_t + o_k[None, :],
                   mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)          # [TP, BK]
    b_QT = tl.load(C + i_b * stride_C_b + i_g * stride_C_g + o_t[None, :] * stride_C_t + o_k[:, None],
                   mask=m_k[:, None] & m_t[None, :], other=0.0).to(tl.float32)          # [BK, TP]
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

    if flush:
        # C <- g_{0:h-1} C + sum_{j<h} g_{j+1:h-1} dt_j x_j k_j^T: one product over the records
        # (fp32 accuracy, utils.dots), then stored: the drafts follow from here
        b_cf = tl.where(m_l, tl.exp(b_sfx) * (b_ldc * b_rA), 0.0)
        b_S = b_S * tl.exp(tl.sum(b_ldc, axis=0))
        b_S = dot_f32(b_WbT * b_cf[None, :], b_Kb, b_S, False, KB_EXACT)
        tl.store(p_S, b_S, mask=m_S)
    b_Lc = tl.sum(tl.where(m_c, b_ldc, 0.0), axis=0)                                   # log g_{0:hc-1}

    # y[:, t] = g_{0:p_t} C q_t + committed records' terms + drafts' terms (r <= t)
    b_Y = dot_f32(b_S, b_QT, tl.zeros([BV, TP], dtype=tl.float32), False, Q_EXACT)
    b_Y = b_Y * tl.exp(b_Lc + b_Dt)[None, :]
    b_Gc = dot_f32(b_Kb, b_QT, tl.zeros([BL, TP], dtype=tl.float32), KB_EXACT, Q_EXACT)  # k_j . q_t
    b_Wc = tl.where(m_c[:, None], tl.exp(b_sfx[:, None] + b_Dt[None, :]) * (b_ldc * b_rA)[:, None] * b_Gc, 0.0)
    b_Y = dot_f32(b_WbT, b_Wc, b_Y, W_EXACT, False)
    b_Gd = dot_f32(b_Kd, b_QT, tl.zeros([TP, TP], dtype=tl.float32), KD_EXACT, Q_EXACT)  # k_r . q_t
    b_Wd = tl.where(o_t[:, None] <= o_t[None, :], tl.exp(b_dsx) * b_dtd[:, None] * b_Gd, 0.0)
    # a draft's values enter its own and later outputs only. In a product a non-finite value
    # would reach earlier ones too (0 * NaN), so the product takes the finite values and an
    # output after a non-finite draft value of its row is NaN
    b_bad = (b_XdT != b_XdT) | (tl.abs(b_XdT) == float("inf"))
    b_Y = dot_f32(tl.where(b_bad, 0.0, b_XdT), b_Wd, b_Y, X_EXACT, False)
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
    # read those positions in the fold). x as given (exact when the buffer has x's dtype).
    tl.debug_barrier()
    tl.store(p_wb + (hc + o_t)[None, :] * (HV * V) + o_v[:, None], b_XiT.to(buf_w.dtype.element_ty), mask=m_vt)
    if not flush:
        # positions >= h, which no program reads: the owners write them directly
        if i_v == 0:
            tl.store(p_ld + (hc + o_t) * HV, b_ldd, mask=m_t)
            if i_h % HG == 0:
                tl.store(p_kb + (hc + o_t)[:, None] * (Hk * K) + o_k[None, :], b_Kd.to(buf_k.dtype.element_ty),
                         mask=m_t[:, None] & m_k[None, :])

    last = verify_hand_off(arrive, cursor, pending, epoch, slot, hc, n, flush, HV * NVB)
    if flush & last:
        # positions 0..n-1 held committed records that other programs of the slot read
        write_shared_drafts(dt, B, A, dt_bias, buf_ld, buf_k, slot, n, i_b * stride_dt_b, stride_dt_t,
                            i_b * stride_B_b, stride_B_t, stride_B_g, o_k, m_k, HV, Hk, K, LB, T, HVP, HKP)
