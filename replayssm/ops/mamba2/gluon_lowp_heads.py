"""Mamba-2's steady rows on a low-precision checkpoint in Gluon, several heads per program
(`REPLAYSSM_GLUON_LP_HEADS=N`, experimental, off: not yet run on a GPU): the program of
gluon_lowp.py over `N` heads of one group at once, their `N * BV` rows stacked.

Why: an fp8 program of one head reads an 8 KB tile and does about 600 instructions of other work
(the slot's cursor and arrival, the group's vector and key products, the records and weights,
addresses; docs/precision.md), the work that keeps fp8 and NVFP4 reads far from their byte
bounds. A head's tile is its `V x K` matrix, and the heads of a slot are adjacent in the
checkpoint, so `N` heads' V-blocks are one copy of `N * BV` rows (contiguous where BV = V); the
group's vector `C`, its key products, the cursor and the arrival are read once for all of them,
and the per-head terms (decay, records' weights, `dt`, `D`) are gathered per row. The arithmetic
of each row is gluon_lowp.py's, in the same order, for every read format (NVFP4's block scales
copied into shared memory with the tile, read back a row chunk at a time).
"""
from __future__ import annotations

from ..utils.gluon import HAVE_GLUON
from .common import OPTIONAL_INPUTS

if HAVE_GLUON:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

    from ..utils.gluon import _arrive_early, _async_load, _barrier, _move_cursor, _record_weights, _softplus
    from ..utils.gluon_lowp import _nvfp4_chunk, lp_row_sums, lp_row_sums_mma, lp_vector

__all__ = ["heads_unsupported", "launch_gluon_lp_heads"]


# The heads' copy of the tile a program stages, at most: Super's fp16 tile is 16 KB a head, and
# 16 heads (256 KB) are past an SM's 227 KB (Triton 3.6 compiles it, the launch would fail)
MAX_TILE_BYTES = 64 * 1024


def heads_unsupported(heads: int, lp_code: int, HV: int, Hk: int, BV: int = 0, K: int = 0) -> str:
    """'' when `heads` heads per program cover this read format and head layout (and, given
    `BV` and `K`, their tiles fit `MAX_TILE_BYTES`), else why not."""
    if heads < 2 or heads & (heads - 1):
        return f"heads={heads}: a power of two from 2"
    if lp_code not in (1, 2, 3, 4):
        return f"read format code {lp_code} (fp16, bf16, fp8_e4m3, nvfp4)"
    if HV % Hk or (HV // Hk) % heads:
        return f"heads={heads} must divide the group's {HV // max(Hk, 1)} heads"
    tile = heads * BV * K * {1: 2, 2: 2, 3: 1, 4: 0.5}[lp_code]
    if tile > MAX_TILE_BYTES:
        return f"heads={heads}: {tile / 1024:.0f} KB of tiles a program (at most {MAX_TILE_BYTES // 1024} KB)"
    return ""


if HAVE_GLUON:

    @triton.heuristics(OPTIONAL_INPUTS)
    @gluon.jit
    def _gluon_lp_heads_kernel(
        x, dt, B, C, A, dt_bias, D, z, out,
        lp_data, lp_scale, lp_tscale, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids, kq,
        stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
        stride_z_b, stride_z_h, stride_o_b, stride_o_h,
        HV: gl.constexpr, Hk: gl.constexpr, V: gl.constexpr, K: gl.constexpr, LB: gl.constexpr,
        WINDOW: gl.constexpr, BV: gl.constexpr, BL: gl.constexpr, LP: gl.constexpr,
        HAS_D: gl.constexpr, HAS_Z: gl.constexpr, NW: gl.constexpr, NH: gl.constexpr, KQ: gl.constexpr,
        RMMA: gl.constexpr,
    ):
        # gluon_lowp.py's layouts over R = NH * BV rows: LW value records [BL, R], LK key
        # records [BL, K], LY rows [R], LA1 [BL] one position per lane
        R: gl.constexpr = NH * BV
        LW: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [1, NW], [1, 0])
        LK: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])
        LY: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        LA1: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        NVB: gl.constexpr = V // BV
        HG: gl.constexpr = HV // Hk

        pid = gl.program_id(0)
        i_b = gl.program_id(1).to(gl.int64)
        i_v = pid % NVB
        i_h0 = (pid // NVB) * NH
        i_g = i_h0 // HG
        v0 = i_v * BV

        # row r: head i_h0 + r // BV, its row v0 + r % BV
        o_y = gl.arange(0, R, layout=LY)
        o_hy = o_y // BV
        o_vy = v0 + o_y % BV
        p_o = out + i_b * stride_o_b + (i_h0 + o_hy) * stride_o_h + o_vy
        slot = gl.load(slot_ids + i_b).to(gl.int64)
        if slot < 0:
            gl.store(p_o, gl.zeros([R], gl.float32, LY).to(out.dtype.element_ty))
            return

        # 1. the heads' LP rows, to shared memory: one copy (rows BV apart per head, V rows apart
        # between heads: one block where BV = V); NVFP4's block scales likewise, same group
        KE: gl.constexpr = K // 8 if LP == 4 else K                  # the copy's elements per row
        VEC: gl.constexpr = 4 if LP == 4 else (16 if LP == 3 else 8)
        TC: gl.constexpr = KE // VEC
        LT: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // TC, TC], [NW, 1], [1, 0])
        o_rT = gl.arange(0, R, layout=gl.SliceLayout(1, LT))
        o_cT = gl.arange(0, KE, layout=gl.SliceLayout(0, LT))
        i_m0 = slot * HV + i_h0                                     # the first head's matrix
        SM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        # (RMMA: swizzled as the tensor cores read it, utils/gluon_lowp.lp_tile_to_shared)
        ST: gl.constexpr = gl.SwizzledSharedLayout(VEC, 1, 8, [1, 0]) if RMMA else SM
        s_T = gl.allocate_shared_memory(lp_data.dtype.element_ty, [R, KE], ST)
        _async_load(s_T, lp_data + i_m0 * (V * KE) + ((o_rT // BV) * (V * KE) + (v0 + o_rT % BV) * KE)[:, None]
                    + o_cT[None, :], eviction_policy="evict_first")
        if LP == 4:
            KS: gl.constexpr = K // 16
            LSC: gl.constexpr = gl.BlockedLayout([1, KS], [32, 1], [NW, 1], [1, 0])
            o_rS = gl.arange(0, R, layout=gl.SliceLayout(1, LSC))
            o_bS = gl.arange(0, KS, layout=gl.SliceLayout(0, LSC))
            s_sc = gl.allocate_shared_memory(lp_scale.dtype.element_ty, [R, KS], SM)
            _async_load(s_sc, lp_scale + i_m0 * (V * KS) + ((o_rS // BV) * (V * KS) + (v0 + o_rS % BV) * KS)[:, None]
                        + o_bS[None, :])
        cp.commit_group()
        _barrier()

        # 2. every other load: the group's once, the heads' per row (gathered), the records
        h = gl.load(cursor + slot)
        NPOS: gl.constexpr = WINDOW if WINDOW < LB else LB
        o_kK = gl.arange(0, K, layout=gl.SliceLayout(0, LK))
        p_Bt = B + i_b * stride_B_b + i_g * stride_B_g
        p_Ct = C + i_b * stride_C_b + i_g * stride_C_g
        b_qK = gl.load(p_Ct + o_kK).to(gl.float32)
        b_kcK = gl.load(p_Bt + o_kK).to(gl.float32)
        b_xi = gl.load(x + i_b * stride_x_b + (i_h0 + o_hy) * stride_x_h + o_vy)
        b_x = b_xi.to(gl.float32)
        if HAS_Z:
            b_z = gl.load(z + i_b * stride_z_b + (i_h0 + o_hy) * stride_z_h + o_vy).to(gl.float32)
        if HAS_D:
            b_D = gl.load(D + i_h0 + o_hy).to(gl.float32)
        if LP == 3:
            b_fac = gl.load(lp_scale + i_m0 * V + o_hy * V + o_vy)
        elif LP == 4:
            b_fac = gl.load(lp_tscale + i_m0 + o_hy) * 16384.0
        else:
            b_fac = 1.0
        if not RMMA:
            b_qv = lp_vector(b_qK, p_Ct, K, LP, NW, True)
        p_Kg = buf_k + slot * (LB * Hk * K) + i_g * K
        o_l = gl.arange(0, BL, layout=LA1)
        if KQ:
            b_kq = gl.load(kq + (i_b * Hk + i_g) * BL + o_l)
        else:
            o_lK = gl.arange(0, BL, layout=gl.SliceLayout(1, LK))
            b_Kr = gl.load(p_Kg + o_lK[:, None] * (Hk * K) + o_kK[None, :], mask=(o_lK < NPOS)[:, None], other=0.0)
        o_lW = gl.arange(0, BL, layout=gl.SliceLayout(1, LW))
        o_rW = gl.arange(0, R, layout=gl.SliceLayout(0, LW))
        m_lW = (o_lW < h)[:, None]
        p_W0 = buf_w + slot * (LB * HV * V) + i_h0 * V
        b_Wr = gl.load(p_W0 + o_lW[:, None] * (HV * V) + ((o_rW // BV) * V + v0 + o_rW % BV)[None, :],
                       mask=(o_lW < NPOS)[:, None], other=0.0)
        p_ld0 = buf_ld + slot * (LB * HV) + i_h0
        n_arrived = _arrive_early(arrive, slot, h, LA1)

        # 3. per head: the token's log decay, the records' weights, g; per row by the head's rows
        if not KQ:
            b_Kb = gl.where((o_lK < h)[:, None], b_Kr.to(gl.float32), 0.0)
            b_kq = gl.sum(b_Kb * b_qK[None, :], axis=1)                                  # [BL]
        b_kqW = gl.convert_layout(b_kq, gl.SliceLayout(1, LW))
        b_kcq = gl.sum(b_kcK * b_qK, axis=0)
        h_rW = o_rW // BV
        b_cw = gl.zeros([BL, R], gl.float32, LW)
        b_g = gl.zeros([R], gl.float32, LY)
        b_dt = gl.zeros([R], gl.float32, LY)
        b_ldy = gl.zeros([R], gl.float32, LY)
        for j in gl.static_range(NH):
            a_j = gl.load(A + i_h0 + j).to(gl.float32)
            dt_j = _softplus(gl.load(dt + i_b * stride_dt_b + i_h0 + j).to(gl.float32) +
                             gl.load(dt_bias + i_h0 + j).to(gl.float32))
            ld_j = dt_j * a_j
            b_ld1 = gl.load(p_ld0 + j + (o_l + 1) * HV, mask=o_l + 1 < NPOS, other=0.0)
            b_ldj = gl.load(p_ld0 + j + o_l * HV, mask=o_l < NPOS, other=0.0)
            c_j, g_j = _record_weights(b_ld1, gl.load(p_ld0 + j), ld_j, h, o_l)
            c_j = gl.where(o_l < h, c_j * (b_ldj * gl.fdiv(1.0, a_j)), 0.0)
            b_cw = gl.where((h_rW == j)[None, :], (gl.convert_layout(c_j, gl.SliceLayout(1, LW)) * b_kqW)[:, None],
                            b_cw)
            b_g = gl.where(o_hy == j, g_j, b_g)
            b_dt = gl.where(o_hy == j, dt_j, b_dt)
            b_ldy = gl.where(o_hy == j, ld_j, b_ldy)
        b_W = gl.where(m_lW, b_Wr.to(gl.float32), 0.0)
        b_rec = gl.sum(b_W * b_cw, axis=0)                                              # [R]

        # 4. the rows, once landed
        cp.wait_group(0)
        _barrier()
        s_y = gl.allocate_shared_memory(gl.float32, [R], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        if LP == 4:
            # row chunks of 8 per warp, each with its block scales from shared memory
            RC4: gl.constexpr = 8 * NW
            LS4: gl.constexpr = gl.SliceLayout(2, gl.BlockedLayout([1, 2, 2], [8, 4, 1], [NW, 1, 1], [2, 1, 0]))
            for c in gl.static_range(R // RC4):
                b_sc = s_sc.slice(c * RC4, RC4, dim=0).load(LS4)
                s_y.slice(c * RC4, RC4, dim=0).store(_nvfp4_chunk(s_T, b_qv, b_sc, c * RC4, RC4, K, NW))
        elif RMMA:
            lp_row_sums_mma(s_T, b_qK, b_qK, s_y, s_y, R, K, LP, NW, False)
        else:
            lp_row_sums(s_T, b_qv, s_y, 0, 0, R, K, LP, NW)
        _barrier()
        b_y = b_g * (s_y.load(LY) * b_fac) + gl.convert_layout(b_rec, LY) + b_kcq * (b_dt * b_x)
        if HAS_D:
            b_y += b_D * b_x
        if HAS_Z:
            b_y = b_y * b_z / (1.0 + gl.exp(-b_z))

        is_flush = h + 1 >= WINDOW
        if not is_flush:
            gl.store(p_o, b_y.to(out.dtype.element_ty))
            p_wt = p_W0 + h * (HV * V) + o_hy * V + o_vy
            gl.store(p_wt, b_xi.to(p_wt.dtype.element_ty))
            # each head's log decay from its first row (V-block 0), the group's key once
            gl.store(p_ld0 + h * HV + o_hy, b_ldy, mask=(o_y % BV == 0) & (i_v == 0))
            if i_v == 0:
                if i_h0 % HG == 0:
                    p_kh = p_Kg + h * (Hk * K) + o_kK
                    gl.store(p_kh, b_kcK.to(p_kh.dtype.element_ty))

        _move_cursor(n_arrived, (HV // NH) * NVB, is_flush, cursor, epoch, arrive, slot, h)


def launch_gluon_lp_heads(x, dt, B, C, A, dt_bias, D, z, lp_data, lp_scale, lp_tscale, LP, buf_ld, buf_w, buf_k,
                          cursor, epoch, arrive, slot_ids, out, window, BV, heads, kq=None, read_mma=False):
    """Launch `_gluon_lp_heads_kernel` (grid `(HV / heads * V / BV, Bt)`, `BV / 16` warps) on the LP
    parts of `lowp.lp_views` (`lp_data` as `utils.gluon_lowp.lp_gluon_views`) under format
    code `LP`, gluon_lowp.launch_gluon_lp's contract; the caller checked `heads_unsupported`.
    `kq` (None: on): the group's key products formed by the launch before; `read_mma`: fp16, bf16
    and fp8 rows summed on the tensor cores (`utils.gluon_lowp.lp_row_sums_mma`)."""
    from ..utils.gluon import gluon_record_tile
    from ..utils.key_products import key_products

    Bt, HV, V = x.shape
    Hk, K = B.shape[1], B.shape[2]
    LB = buf_ld.shape[1]
    nw = BV // 16
    BL = gluon_record_tile(window, LB)
    kq = kq is None or bool(kq)
    kqs = key_products([C], buf_k, cursor, slot_ids, BL) if kq else slot_ids
    _gluon_lp_heads_kernel[((HV // heads) * (V // BV), Bt)](
        x=x, dt=dt, B=B, C=C, A=A, dt_bias=dt_bias, D=D, z=z, out=out, lp_data=lp_data, lp_scale=lp_scale,
        lp_tscale=lp_tscale,
        buf_ld=buf_ld, buf_w=buf_w, buf_k=buf_k, cursor=cursor, epoch=epoch, arrive=arrive, slot_ids=slot_ids,
        kq=kqs, stride_x_b=x.stride(0), stride_x_h=x.stride(1), stride_dt_b=dt.stride(0),
        stride_B_b=B.stride(0), stride_B_g=B.stride(1), stride_C_b=C.stride(0), stride_C_g=C.stride(1),
        stride_z_b=z.stride(0) if z is not None else 0, stride_z_h=z.stride(1) if z is not None else 0,
        stride_o_b=out.stride(0), stride_o_h=out.stride(1),
        HV=HV, Hk=Hk, V=V, K=K, LB=LB, WINDOW=int(window), BV=BV, BL=BL, LP=int(LP),
        NW=nw, num_warps=nw, NH=int(heads), KQ=kq, RMMA=bool(read_mma) and int(LP) < 4)
