"""Mamba-2 standard decode's steady rows on a low-precision checkpoint, in Gluon (GPU only): the
program of the fp32 Gluon kernel (gluon_decode.py) with the LP tile's raw bytes copied into
shared memory and decoded as they are read back (ops/utils/gluon_lowp.py).

Why (issue 18): the Triton precision kernel (precision.py) reads a low-precision checkpoint
slower than the fp32 Gluon kernel reads fp32 (0.56x for fp16, 0.22x for NVFP4 at batch 256), as
the Triton replay kernels once did: a chain of memory round trips per program, and NVFP4's
decode gathering every byte twice.

A step of `precision.lowp_decode` on CUDA is then two launches over the same rows, each row
handled by exactly one of them (every program of a row sees the same cursor):
  1. the Triton kernel with `ROWS=1`: the rows that flush (`h + 1 >= L`, one step in L): output,
     HP checkpoint and LP copy, as the single launch does, but the cursor and epoch are left;
  2. this kernel: every other row reads the LP tile, writes its output and record h and moves its
     cursor to h + 1; a flush row only arrives on its slot's counter, and the last of its programs
     moves the cursor to 0 and the epoch on (what launch 1 left), after every program of the
     slot has read the cursor. Its output is launch 1's and is not written here.
Launch 1 runs first: it reads the cursor and epoch (the stochastic rounding's stream) before
launch 2 moves them. Everything a row writes is bit for bit what the single launch writes
except the steady rows' outputs (another summation order, the scales applied to partial sums).
"""
from __future__ import annotations

import os
from typing import Optional

from ..utils.gluon import HAVE_GLUON, gluon_record_tile, gluon_shape_supported
from ..utils import gluon_lowp as _lowp
from ..utils.gluon_lowp import GLUON_LP_CODES, lp_gluon_views, lp_launch_rows
from ..utils.key_products import key_products
from .common import OPTIONAL_INPUTS
from .gluon_lowp_heads import heads_unsupported, launch_gluon_lp_heads

if HAVE_GLUON:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

    from ..utils.gluon import _arrive_early, _barrier, _move_cursor, _record_weights, _softplus
    from ..utils.gluon_lowp import (lp_row_factor, lp_row_sums, lp_row_sums_mma, lp_tile_scales,
                                    lp_tile_to_shared, lp_vector)

__all__ = ["HEADS", "gluon_lp_unsupported", "use_gluon_lp", "launch_gluon_lp"]

# REPLAYSSM_GLUON_LP_HEADS=N (experimental; 1, the default: one head per program): N heads of a
# group per program (gluon_lowp_heads.py), where `heads_unsupported` has no objection
_HEADS = os.environ.get("REPLAYSSM_GLUON_LP_HEADS", "1")
if not _HEADS.isdigit() or int(_HEADS) < 1 or int(_HEADS) & (int(_HEADS) - 1):
    raise ValueError(f"REPLAYSSM_GLUON_LP_HEADS={_HEADS!r}: a power of two (heads per program)")
HEADS = int(_HEADS)


def gluon_lp_unsupported(lp_code: int, V: int, K: int, window: int, Lb: int, BV: int) -> Optional[str]:
    """Why the steady-row Gluon kernel does not cover this read format, shape and block of `BV`
    rows (`BV / 16` warps), or None when it does."""
    if lp_code not in GLUON_LP_CODES:
        return f"read format code {lp_code} (fp16, bf16, fp8_e4m3, nvfp4 only)"
    if window < 2:
        return "window 1 (the eager step) flushes every row"
    return gluon_shape_supported(V, K, window, Lb, BV, max(1, BV // 16)) or None


def use_gluon_lp(cfg: dict, lp_code: int, x, V: int, K: int, window: int, Lb: int) -> bool:
    """Whether `lowp_decode` with launch config `cfg` (`lowp.lowp_config`) splits its step into the
    flush rows' Triton launch and this kernel: asked for (`gluon`), on CUDA outside the
    interpreter, and covered (`gluon_lp_unsupported`)."""
    return bool(cfg["gluon"]) and x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1" \
        and gluon_lp_unsupported(lp_code, V, K, window, Lb, cfg["gluon_BV"]) is None


if HAVE_GLUON:

    @triton.heuristics(OPTIONAL_INPUTS)
    @gluon.jit
    def _gluon_lp_kernel(
        x, dt, B, C, A, dt_bias, D, z, out,
        lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids, kq,
        stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
        stride_z_b, stride_z_h, stride_o_b, stride_o_h,
        HV: gl.constexpr, Hk: gl.constexpr, V: gl.constexpr, K: gl.constexpr, LB: gl.constexpr,
        WINDOW: gl.constexpr, BV: gl.constexpr, BL: gl.constexpr, LP: gl.constexpr,
        HAS_D: gl.constexpr, HAS_Z: gl.constexpr, NW: gl.constexpr, RECMASK: gl.constexpr,
        KQ: gl.constexpr, RMMA: gl.constexpr,
    ):
        # the fp32 kernel's layouts (gluon_decode.py) for everything but the tile: LW value
        # records [BL, BV], LK key records [BL, K], LY outputs [BV], LA1 [BL] one position per lane
        LW: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [1, NW], [1, 0])
        LK: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])
        LY: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        LA1: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        NVB: gl.constexpr = V // BV
        HG: gl.constexpr = HV // Hk
        KE: gl.constexpr = K // 8 if LP == 4 else K          # the copy's elements per row

        pid = gl.program_id(0)
        i_b = gl.program_id(1).to(gl.int64)
        i_v = pid % NVB
        i_h = pid // NVB
        i_g = i_h // HG
        v0 = i_v * BV

        o_y = gl.arange(0, BV, layout=LY)
        p_o = out + i_b * stride_o_b + i_h * stride_o_h + v0 + o_y
        slot = gl.load(slot_ids + i_b).to(gl.int64)
        if slot < 0:
            gl.store(p_o, gl.zeros([BV], gl.float32, LY).to(out.dtype.element_ty))
            return

        # 1. the LP tile's bytes, to shared memory
        i_m = slot * HV + i_h                                       # this head's matrix in the pool
        s_T = lp_tile_to_shared(lp_data + i_m * (V * KE) + v0 * KE, BV, K, LP, NW, RMMA)

        # 2. every other load, as the fp32 kernel issues them (the records over the window's
        # positions unless RECMASK), plus the row scales
        h = gl.load(cursor + slot)
        NPOS: gl.constexpr = WINDOW if WINDOW < LB else LB
        b_dtr = gl.load(dt + i_b * stride_dt_b + i_h).to(gl.float32)
        b_dtb = gl.load(dt_bias + i_h).to(gl.float32)
        b_A = gl.load(A + i_h).to(gl.float32)
        b_rA = gl.fdiv(1.0, b_A)
        o_kK = gl.arange(0, K, layout=gl.SliceLayout(0, LK))
        p_Bt = B + i_b * stride_B_b + i_g * stride_B_g
        p_Ct = C + i_b * stride_C_b + i_g * stride_C_g
        b_qK = gl.load(p_Ct + o_kK).to(gl.float32)
        b_kcK = gl.load(p_Bt + o_kK).to(gl.float32)
        b_xi = gl.load(x + i_b * stride_x_b + i_h * stride_x_h + v0 + o_y)
        b_x = b_xi.to(gl.float32)
        if HAS_Z:
            b_z = gl.load(z + i_b * stride_z_b + i_h * stride_z_h + v0 + o_y).to(gl.float32)
        if HAS_D:
            b_D = gl.load(D + i_h).to(gl.float32)
        b_fac = lp_row_factor(lp_scale, lp_tscale, i_m, v0 + o_y, V, LP)
        if LP == 4:
            b_sca, b_scb = lp_tile_scales(lp_scale, i_m, v0, V, K, BV, NW)
        else:
            b_sca = 0
            b_scb = 0
        if not RMMA:
            b_qv = lp_vector(b_qK, p_Ct, K, LP, NW, True)

        p_Kg = buf_k + slot * (LB * Hk * K) + i_g * K
        o_l = gl.arange(0, BL, layout=LA1)
        if KQ:
            # the group's key products, formed by the launch before (utils/key_products.py)
            b_kq = gl.load(kq + (i_b * Hk + i_g) * BL + o_l)
        else:
            o_lK = gl.arange(0, BL, layout=gl.SliceLayout(1, LK))
            m_lK = (o_lK < h)[:, None]
            m_lKl = m_lK if RECMASK else (o_lK < NPOS)[:, None]
            b_Kr = gl.load(p_Kg + o_lK[:, None] * (Hk * K) + o_kK[None, :], mask=m_lKl, other=0.0)
        o_lW = gl.arange(0, BL, layout=gl.SliceLayout(1, LW))
        o_rW = gl.arange(0, BV, layout=gl.SliceLayout(0, LW))
        m_lW = (o_lW < h)[:, None]
        m_lWl = m_lW if RECMASK else (o_lW < NPOS)[:, None]
        p_Wh = buf_w + slot * (LB * HV * V) + i_h * V + v0
        b_Wr = gl.load(p_Wh + o_lW[:, None] * (HV * V) + o_rW[None, :], mask=m_lWl, other=0.0)
        p_ldh = buf_ld + slot * (LB * HV) + i_h
        b_ld1 = gl.load(p_ldh + (o_l + 1) * HV, mask=(o_l + 1 < h) if RECMASK else (o_l + 1 < NPOS), other=0.0)
        b_ldj = gl.load(p_ldh + o_l * HV, mask=(o_l < h) if RECMASK else (o_l < NPOS), other=0.0)
        b_ld0 = gl.load(p_ldh)
        n_arrived = _arrive_early(arrive, slot, h, LA1)

        # 3. weights, key products, the records' sum (a flush row's are formed and dropped:
        # a branch here would let the compiler sink the loads above behind the cursor's wait)
        b_dt = _softplus(b_dtr + b_dtb)
        b_ld = b_dt * b_A
        b_coef, b_g = _record_weights(b_ld1, b_ld0, b_ld, h, o_l)
        b_coef = gl.where(o_l < h, b_coef * (b_ldj * b_rA), 0.0)
        if not KQ:
            b_Kb = gl.where(m_lK, b_Kr.to(gl.float32), 0.0)
            b_kq = gl.sum(b_Kb * b_qK[None, :], axis=1)                                  # [BL]
        b_kcq = gl.sum(b_kcK * b_qK, axis=0)
        b_cw = gl.convert_layout(b_coef, gl.SliceLayout(1, LW)) * gl.convert_layout(b_kq, gl.SliceLayout(1, LW))
        b_W = gl.where(m_lW, b_Wr.to(gl.float32), 0.0)
        b_rec = gl.sum(b_W * b_cw[:, None], axis=0)                                      # [BV]
        b_w = b_dt * b_x

        # 4. the tile, once landed, decoded in row chunks; the row sums through shared memory
        cp.wait_group(0)
        _barrier()
        s_y = gl.allocate_shared_memory(gl.float32, [BV], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        if RMMA:
            lp_row_sums_mma(s_T, b_qK, b_qK, s_y, s_y, BV, K, LP, NW, False)
        else:
            lp_row_sums(s_T, b_qv, s_y, b_sca, b_scb, BV, K, LP, NW)
        _barrier()
        b_y = b_g * (s_y.load(LY) * b_fac) + gl.convert_layout(b_rec, LY) + b_kcq * b_w
        if HAS_D:
            b_y += b_D * b_x
        if HAS_Z:
            b_y = b_y * b_z / (1.0 + gl.exp(-b_z))

        is_flush = h + 1 >= WINDOW
        if not is_flush:
            gl.store(p_o, b_y.to(out.dtype.element_ty))
            # the record: this program's x; the head's log decay and the group's key from the
            # programs of the first value block (and the group's first head)
            p_wt = p_Wh + h * (HV * V) + o_y
            gl.store(p_wt, b_xi.to(p_wt.dtype.element_ty))
            if i_v == 0:
                gl.store(p_ldh + h * HV, b_ld)
                if i_h % HG == 0:
                    p_kh = p_Kg + h * (Hk * K) + o_kK
                    gl.store(p_kh, b_kcK.to(p_kh.dtype.element_ty))

        _move_cursor(n_arrived, HV * NVB, is_flush, cursor, epoch, arrive, slot, h)


def launch_gluon_lp(x, dt, B, C, A, dt_bias, D, z, lp_data, lp_scale, lp_tscale, LP, buf_ld, buf_w, buf_k,
                    cursor, epoch, arrive, slot_ids, out, window, BV, maxnreg=0, recmask=None, kq=None,
                    read_mma=None, heads=None, rows=None):
    """Launch `_gluon_lp_kernel` (grid `(HV * V / BV, Bt)`, `BV / 16` warps) on the LP parts of
    `lowp.lp_views` under format code `LP`; the caller checked `gluon_lp_unsupported` and runs
    the flush rows first (precision.py, `ROWS=1`). `recmask`: the record loads wait for the
    cursor and skip positions past it (None: off, Mamba-2's default). `kq` (None: on, Mamba-2's
    default): the group's key products formed first (`utils.key_products`, a launch of `Bt * Hk`
    programs), which the kernel then loads instead of the key records. `read_mma` (None: the
    module switch `utils.gluon_lowp.READ_MMA` at the call): fp16, bf16 and fp8 rows summed on the
    tensor cores (`lp_row_sums_mma`). `heads` (None: the module's `HEADS` at the call): that many
    heads per program (gluon_lowp_heads.py, where it applies; `recmask` and `maxnreg` do not
    apply there). `rows` (None: `utils.gluon_lowp.ROWS` at the call): more rows per thread
    (`lp_launch_rows`)."""
    Bt, HV, V = x.shape
    Hk, K = B.shape[1], B.shape[2]
    heads = HEADS if heads is None else int(heads)
    if heads > 1 and not heads_unsupported(heads, int(LP), HV, Hk, BV, K):
        launch_gluon_lp_heads(x, dt, B, C, A, dt_bias, D, z, lp_gluon_views(lp_data, LP), lp_scale, lp_tscale, LP,
                              buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids, out, window, BV, heads, kq,
                              _lowp.READ_MMA if read_mma is None else bool(read_mma))
        return
    LB = buf_ld.shape[1]
    BV, nw = lp_launch_rows(BV, V, int(LP), rows)
    BL = gluon_record_tile(window, LB)
    # measured (precision_gluon_kq_h200.json, batch 256, non-flush steps over fp32 reads):
    # Nano-4B fp16 1.43x -> 1.68x, fp8 1.47x -> 2.01x; Super fp8 1.92x -> 2.12x, fp16 unchanged
    kq = kq is None or bool(kq)
    kqs = key_products([C], buf_k, cursor, slot_ids, BL) if kq else slot_ids
    _gluon_lp_kernel[(HV * (V // BV), Bt)](
        x=x, dt=dt, B=B, C=C, A=A, dt_bias=dt_bias, D=D, z=z, out=out,
        lp_data=lp_gluon_views(lp_data, LP), lp_scale=lp_scale, lp_tscale=lp_tscale,
        buf_ld=buf_ld, buf_w=buf_w, buf_k=buf_k, cursor=cursor, epoch=epoch, arrive=arrive, slot_ids=slot_ids,
        kq=kqs, stride_x_b=x.stride(0), stride_x_h=x.stride(1), stride_dt_b=dt.stride(0),
        stride_B_b=B.stride(0), stride_B_g=B.stride(1), stride_C_b=C.stride(0), stride_C_g=C.stride(1),
        stride_z_b=z.stride(0) if z is not None else 0, stride_z_h=z.stride(1) if z is not None else 0,
        stride_o_b=out.stride(0), stride_o_h=out.stride(1),
        HV=HV, Hk=Hk, V=V, K=K, LB=LB, WINDOW=int(window), BV=BV, BL=BL, LP=int(LP),
        NW=nw, num_warps=nw, RECMASK=bool(recmask), KQ=kq,
        RMMA=(_lowp.READ_MMA if read_mma is None else bool(read_mma)) and int(LP) in (1, 2, 3),
        **({"maxnreg": maxnreg} if maxnreg else {}))
