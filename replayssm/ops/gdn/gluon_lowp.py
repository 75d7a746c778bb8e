"""GDN (and, through `IS_KDA`, KDA) standard decode's steady rows on a low-precision checkpoint,
in Gluon (GPU only): the program of the fp32 Gluon kernel (gluon_decode.py) with the LP tile's
raw bytes copied into shared memory and decoded as they are read back (ops/utils/gluon_lowp.py),
twice per tile: the rows' products with the key (`C k`, for `u`) and with the query (`C q`).

Why (issue 18): the Triton precision kernel (precision.py) reads a low-precision checkpoint
slower than the Gluon kernel reads fp32, as Mamba-2's did (ops/mamba2/gluon_lowp.py).

The step of `precision.lowp_decode` is then two launches over the same rows, as Mamba-2's:
  1. the Triton kernel with `ROWS=1`: the rows that flush (`h + 1 >= L`), everything but the
     cursor's move (the HP refold and LP copy, or the shared checkpoint's fold; outputs);
  2. this kernel: every other row writes its output and record h (u, the raw v and beta beside
     an LP copy, the decay, the group's key) and moves its cursor to h + 1; a flush row only
     arrives on its slot's counter, and the last of its programs sets cursor 0 and epoch + 1.
Launch 1 runs first: it reads the cursor and epoch before launch 2 moves them. Unlike Mamba-2's,
a steady row's `u` record is arithmetic on the checkpoint (summed here in another order than
the Triton kernel's), so it differs from the single launch's in fp32 rounding, and so does the
key record where the norm's sum does; the HP refold reads the raw records, the checkpoints of
a flush are the same Triton code's. The default (`lowp_config`'s `gluon`) where it covers the shape:
on the H200 at batch 256 (precision_gluon_gdn_h200.json, in git history at 82c90d4) fp16/bf16
reads take 0.70-0.74x the fp32 reads' time at Qwen3.5's shapes and 0.88x at Kimi Linear's (the
Triton kernel 1.5-3.1x).
fp8_e4m3 and NVFP4 copies (Mamba-2's decoders) likewise: on the H100 (precision_lp_h100.json)
0.53-0.54x and 0.62x the fp32 reads' time at Qwen3.5's shapes, KDA fp8 0.73x, where the Triton
kernel took 2.1x and 3.1x. KDA's NVFP4 read (its vector table rearranged from registers: KDA's
key and query, scaled per channel by G(0), are not in memory) takes 0.79x the fp32 reads' time
on the H100 at Kimi Linear's shape (precision_kda_h100.json), where the Triton kernel took 4.5x.
"""
from __future__ import annotations

import os
from typing import Optional

from ..utils.gluon import HAVE_GLUON, gluon_record_tile, gluon_shape_supported
from ..utils import gluon_lowp as _lowp
from ..utils.gluon_lowp import GLUON_LP_CODES, lp_gluon_views, lp_launch_rows
from ..utils.key_products import key_products

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

    from ..utils.gluon import _add, _arrive_early, _barrier, _move_cursor, _record_weights, _softplus
    from ..utils.gluon_lowp import (lp_row_factor, lp_row_sums, lp_row_sums_mma, lp_tile_scales,
                                    lp_tile_to_shared, lp_vector)
    from .gluon_decode import _delta_token_loads

__all__ = ["gluon_lp_unsupported", "use_gluon_lp", "launch_gluon_lp"]


def gluon_lp_unsupported(family: str, lp_code: int, V: int, K: int, window: int, Lb: int,
                         BV: int) -> Optional[str]:
    """Why the steady-row Gluon kernel does not cover this family, read format code, shape and
    block of `BV` rows (`BV / 16` warps), or None when it does."""
    if family not in ("gdn", "kda"):
        return f"family {family!r} (GDN and KDA only)"
    if lp_code not in GLUON_LP_CODES:
        return f"read format code {lp_code} (fp16, bf16, fp8_e4m3, nvfp4 only)"
    if window < 2:
        return "window 1 (the eager step) flushes every row"
    return gluon_shape_supported(V, K, window, Lb, BV, max(1, BV // 16)) or None


def use_gluon_lp(cfg: dict, family: str, lp_code: int, q, V: int, K: int, window: int, Lb: int) -> bool:
    """Whether `lowp_decode` with launch config `cfg` (`lowp.lowp_config`, `gluon` True unless
    the caller says) splits its step into the flush rows' Triton launch and this kernel:
    asked for, on CUDA outside the interpreter, and covered (`gluon_lp_unsupported`)."""
    return bool(cfg["gluon"]) and q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1" \
        and gluon_lp_unsupported(family, lp_code, V, K, window, Lb, cfg["gluon_BV"]) is None


if HAVE_GLUON:

    @gluon.jit
    def _gluon_lp_kernel(
        q, k, v, a, b, A_log, dt_bias, o,
        lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, buf_v, buf_beta, cursor, epoch, arrive, slot_ids, kq,
        scale,
        stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
        stride_a_b, stride_a_h, stride_b_b, stride_b_h,
        HV: gl.constexpr, HK: gl.constexpr, V: gl.constexpr, K: gl.constexpr, LBCAP: gl.constexpr,
        WINDOW: gl.constexpr, BV: gl.constexpr, BL: gl.constexpr, LP: gl.constexpr,
        USE_QK_L2NORM: gl.constexpr, NW: gl.constexpr, RECMASK: gl.constexpr, IS_KDA: gl.constexpr,
        RAW: gl.constexpr, KQ: gl.constexpr, RMMA: gl.constexpr,
    ):
        # the fp32 kernel's layouts (gluon_decode.py) for everything but the tile: LW value
        # records [BL, BV] (8 positions per thread), LK key records [BL, K], LA1 [BL] one
        # position per lane, LY rows [BV], LD KDA's log decays [BL, K] (positions in-thread)
        LW: gl.constexpr = gl.BlockedLayout([8, 1], [2, 16], [1, NW], [0, 1])
        LK: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])
        LA1: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        LY: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        LD: gl.constexpr = gl.BlockedLayout([BL, 1], [1, 32], [1, NW], [0, 1])
        S1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        NVB: gl.constexpr = V // BV
        HG: gl.constexpr = HV // HK
        KE: gl.constexpr = K // 8 if LP == 4 else K          # the copy's elements per row
        NPOS: gl.constexpr = WINDOW if WINDOW < LBCAP else LBCAP

        pid = gl.program_id(0)
        i_b = gl.program_id(1).to(gl.int64)
        i_v = pid % NVB
        i_hv = pid // NVB
        i_hk = i_hv // HG
        v0 = i_v * BV

        o_y = gl.arange(0, BV, layout=LY)
        p_o = o + (i_b * HV + i_hv) * V + v0 + o_y
        slot = gl.load(slot_ids + i_b).to(gl.int64)
        if slot < 0:
            gl.store(p_o, gl.zeros([BV], gl.float32, LY).to(o.dtype.element_ty))
            return

        # 1. the LP tile's bytes, to shared memory
        i_m = slot * HV + i_hv                                      # this head's matrix in the pool
        s_T = lp_tile_to_shared(lp_data + i_m * (V * KE) + v0 * KE, BV, K, LP, NW, RMMA)

        # 2. every other load, as the fp32 kernel issues them, plus the row scales
        h = gl.load(cursor + slot).to(gl.int32)
        o_kK, o_kD, p_qt, p_kt, b_qK, b_kK, b_v, b_braw, b_Alog, b_araw, b_dtb = _delta_token_loads(
            q, k, v, a, b, A_log, dt_bias, i_b, i_hv, i_hk, v0, o_y, stride_q_b, stride_q_h, stride_k_b,
            stride_k_h, stride_v_b, stride_v_h, stride_a_b, stride_a_h, stride_b_b, stride_b_h, K, LK, LD, IS_KDA)
        b_fac = lp_row_factor(lp_scale, lp_tscale, i_m, v0 + o_y, V, LP)
        if LP == 4:
            b_sca, b_scb = lp_tile_scales(lp_scale, i_m, v0, V, K, BV, NW)
        else:
            b_sca = 0
            b_scb = 0

        p_Kg = buf_k + slot * (LBCAP * HK * K) + i_hk * K
        o_l = gl.arange(0, BL, layout=LA1)
        if KQ:
            # (GDN) the key head's products k_j . k and k_j . q with the raw key and query, formed
            # by the launch before (utils/key_products.py) instead of from the key records here
            p_kq = kq + (i_b * HK + i_hk) * (2 * BL) + o_l
            b_kkr = gl.load(p_kq)
            b_kqr = gl.load(p_kq + BL)
        else:
            o_lK = gl.arange(0, BL, layout=gl.SliceLayout(1, LK))
            m_lK = (o_lK < h)[:, None]
            b_Kr = gl.load(p_Kg + o_lK[:, None] * (HK * K) + o_kK[None, :],
                           mask=m_lK if RECMASK else (o_lK < NPOS)[:, None], other=0.0)
        o_lW = gl.arange(0, BL, layout=gl.SliceLayout(1, LW))
        o_rW = gl.arange(0, BV, layout=gl.SliceLayout(0, LW))
        m_lW = (o_lW < h)[:, None]
        o_rec = slot * (LBCAP * HV * V) + i_hv * V + v0             # [N, Lb, HV, V]: u and raw v
        p_Uh = buf_w + o_rec
        b_Ur = gl.load(p_Uh + o_lW[:, None] * (HV * V) + o_rW[None, :],
                       mask=m_lW if RECMASK else (o_lW < NPOS)[:, None], other=0.0)
        if IS_KDA:
            o_lD = gl.arange(0, BL, layout=gl.SliceLayout(1, LD))
            p_ldh = buf_ld + slot * (LBCAP * HV * K) + i_hv * K
            m_l1D = (o_lD + 1 < h) if RECMASK else (o_lD + 1 < NPOS)
            b_ld1 = gl.load(p_ldh + (o_lD + 1)[:, None] * (HV * K) + o_kD[None, :], mask=m_l1D[:, None], other=0.0)
            b_ld0 = gl.load(p_ldh + o_kD)
        else:
            p_ldh = buf_ld + slot * (LBCAP * HV) + i_hv
            b_ld1 = gl.load(p_ldh + (o_l + 1) * HV, mask=(o_l + 1 < h) if RECMASK else (o_l + 1 < NPOS), other=0.0)
            b_ld0 = gl.load(p_ldh)

        n_arrived = _arrive_early(arrive, slot, h, LA1)

        # 3. the token (normalised key and query, decay, beta) and the records' sums, the
        # precision kernel's formulas; a flush row's are formed and dropped (a branch here would
        # let the compiler sink the loads above behind the cursor's wait)
        if USE_QK_L2NORM:
            r_q = scale * gl.rsqrt(gl.sum(b_qK * b_qK, axis=0) + 1e-6)
            r_k = gl.rsqrt(gl.sum(b_kK * b_kK, axis=0) + 1e-6)
        else:
            r_q = scale
            r_k = 1.0
        b_beta = 1.0 / (1.0 + gl.exp(-b_braw))
        b_ld = -gl.exp(b_Alog) * _softplus(b_araw + b_dtb)

        if not KQ:
            b_Kb = gl.where(m_lK, b_Kr.to(gl.float32), 0.0)
        b_ktq = gl.sum(b_kK * b_qK, axis=0) * (r_k * r_q)
        b_U = gl.where(m_lW, b_Ur.to(gl.float32), 0.0)
        if IS_KDA:
            # G(j+1) per channel (a reverse scan of same-signed log decays) scales record j's
            # key; G(0) the checkpoint's columns, folded into the vectors of its products
            b_lds = gl.where((o_lD + 1 < h)[:, None], b_ld1,
                             gl.where((o_lD + 1 == h)[:, None], b_ld[None, :], 0.0))     # [BL, K]
            b_GD = gl.where((o_lD < h)[:, None], gl.exp(gl.associative_scan(b_lds, 0, _add, reverse=True)), 0.0)
            b_g0 = gl.exp(gl.where(h > 0, b_ld0, b_ld) + gl.sum(b_lds, axis=0))          # [K]
            b_Kw = b_Kb * gl.convert_layout(b_GD, LK)
            b_kk = gl.sum(b_Kw * b_kK[None, :], axis=1) * r_k
            b_kq = gl.sum(b_Kw * b_qK[None, :], axis=1) * r_q
            b_rk = gl.sum(b_U * gl.convert_layout(b_kk, gl.SliceLayout(1, LW))[:, None], axis=0)
            b_rq = gl.sum(b_U * gl.convert_layout(b_kq, gl.SliceLayout(1, LW))[:, None], axis=0)
            b_g0K = gl.convert_layout(b_g0, gl.SliceLayout(0, LK))
            # (not in memory: NVFP4's table is rearranged from registers)
            if RMMA:
                b_kx = b_kK * b_g0K
                b_qx = b_qK * b_g0K
            else:
                b_kv = lp_vector(b_kK * b_g0K, p_kt, K, LP, NW, False)
                b_qv = lp_vector(b_qK * b_g0K, p_qt, K, LP, NW, False)
            b_g = 1.0
        else:
            b_coef, b_g = _record_weights(b_ld1, b_ld0, b_ld, h, o_l)
            if KQ:
                b_kk = b_kkr * r_k
                b_kq = b_kqr * r_q
            else:
                b_kk = gl.sum(b_Kb * b_kK[None, :], axis=1) * r_k
                b_kq = gl.sum(b_Kb * b_qK[None, :], axis=1) * r_q
            b_cW = gl.convert_layout(b_coef, gl.SliceLayout(1, LW))
            b_rk = gl.sum(b_U * (b_cW * gl.convert_layout(b_kk, gl.SliceLayout(1, LW)))[:, None], axis=0)
            b_rq = gl.sum(b_U * (b_cW * gl.convert_layout(b_kq, gl.SliceLayout(1, LW)))[:, None], axis=0)
            # the raw key and query: their norms multiply the row sums
            if RMMA:
                b_kx = b_kK
                b_qx = b_qK
            else:
                b_kv = lp_vector(b_kK, p_kt, K, LP, NW, True)
                b_qv = lp_vector(b_qK, p_qt, K, LP, NW, True)

        # 4. the tile, once landed, decoded in row chunks: C k, then C q, through shared memory
        cp.wait_group(0)
        _barrier()
        s_yk = gl.allocate_shared_memory(gl.float32, [BV], S1)
        s_yq = gl.allocate_shared_memory(gl.float32, [BV], S1)
        if RMMA:
            lp_row_sums_mma(s_T, b_kx, b_qx, s_yk, s_yq, BV, K, LP, NW, True)
        else:
            lp_row_sums(s_T, b_kv, s_yk, b_sca, b_scb, BV, K, LP, NW)
            lp_row_sums(s_T, b_qv, s_yq, b_sca, b_scb, BV, K, LP, NW)
        _barrier()
        b_Pk = b_g * ((s_yk.load(LY) * b_fac) * r_k) + gl.convert_layout(b_rk, LY)
        b_Pq = b_g * ((s_yq.load(LY) * b_fac) * r_q) + gl.convert_layout(b_rq, LY)
        b_u = b_beta * (b_v - b_Pk)

        is_flush = h + 1 >= WINDOW
        if not is_flush:
            # a steady row's output and record h (a flush row's are launch 1's: its output from
            # the HP path, and the shared design's record before its fold)
            gl.store(p_o, (b_Pq + b_ktq * b_u).to(o.dtype.element_ty))
            p_ut = p_Uh + h * (HV * V) + o_y
            gl.store(p_ut, b_u.to(p_ut.dtype.element_ty))
            if RAW:
                # the raw v and beta beside an LP copy, from which the flush refolds along C_HP
                p_vt = buf_v + o_rec + h * (HV * V) + o_y
                gl.store(p_vt, b_v.to(p_vt.dtype.element_ty))
            if i_v == 0:
                if IS_KDA:
                    gl.store(p_ldh + h * (HV * K) + o_kD, b_ld)
                else:
                    gl.store(p_ldh + h * HV, b_ld)
                if RAW:
                    p_bt = buf_beta + slot * (LBCAP * HV) + h * HV + i_hv
                    gl.store(p_bt, b_beta.to(p_bt.dtype.element_ty))
                if i_hv % HG == 0:
                    p_kh = p_Kg + h * (HK * K) + o_kK
                    gl.store(p_kh, (b_kK * r_k).to(p_kh.dtype.element_ty))

        _move_cursor(n_arrived, HV * NVB, is_flush, cursor, epoch, arrive, slot, h)


def launch_gluon_lp(q, k, v, a, b, A_log, dt_bias, scale, lp_data, lp_scale, lp_tscale, LP, buf_ld, buf_w, buf_k,
                    buf_v, buf_beta, cursor, epoch, arrive, slot_ids, o, window, BV, use_qk_l2norm=True,
                    family="gdn", maxnreg=0, recmask=None, kq=None, read_mma=None, rows=None):
    """Launch `_gluon_lp_kernel` (grid `(HV * V / BV, Bt)`, `BV / 16` warps) for `family` "gdn"
    or "kda" on the LP parts of `lowp.lp_views` under format code `LP`; `buf_v`, `buf_beta` the
    raw records beside an LP copy, None for the shared design. The caller checked
    `use_gluon_lp` and ran the flush rows first (precision.py, `ROWS=1`). `recmask`: the record
    loads wait for the cursor and skip positions past it (None: on, GDN's and KDA's default).
    `kq` (GDN; None: off; KDA's record weights are per value head): the key head's record
    products formed first (`utils.key_products`), which the kernel loads instead of the key
    records: measured mixed (precision_gluon_kq_h200.json: Qwen3.5-122B fp16 1.41x -> 1.44x at
    batch 256, Qwen3.5-4B 1.38x -> 1.37x, at batch 64 1.26x -> 1.19x), so off by default.
    `read_mma`, `rows` (None: the switches `utils.gluon_lowp.READ_MMA`, `ROWS` at the call): the
    rows summed on the tensor cores; more rows per thread (`lp_launch_rows`)."""
    Bt, Hk, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    LBCAP = buf_w.shape[1]
    BV, nw = lp_launch_rows(BV, V, int(LP), rows)
    BL = gluon_record_tile(window, LBCAP)
    kq = bool(kq) and family == "gdn"            # (None: off)
    kqs = key_products([k, q], buf_k, cursor, slot_ids, BL) if kq else slot_ids
    _gluon_lp_kernel[(HV * (V // BV), Bt)](
        q, k, v, a, b, A_log, dt_bias, o,
        lp_gluon_views(lp_data, LP), lp_scale, lp_tscale, buf_ld, buf_w, buf_k, buf_v, buf_beta,
        cursor, epoch, arrive, slot_ids, kqs, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        HV=HV, HK=Hk, V=V, K=K, LBCAP=LBCAP, WINDOW=int(window), BV=BV, BL=BL,
        LP=int(LP), USE_QK_L2NORM=bool(use_qk_l2norm), NW=nw, RECMASK=recmask is None or bool(recmask), IS_KDA=family == "kda",
        RAW=buf_v is not None, KQ=kq, num_warps=nw,
        RMMA=(_lowp.READ_MMA if read_mma is None else bool(read_mma)) and int(LP) in (1, 2, 3),
        **({"maxnreg": maxnreg} if maxnreg else {}))
