"""Mamba-2 standard decode on ReplaySSM state in Gluon (Triton's lower-level dialect), for the
GPU only: the per-head program of `decode._replay_decode_kernel` (records summed inside each
warp), with the checkpoint tile staged in shared memory by asynchronous copies.

Why (docs/kernels.md, "What limits them", the Triton kernels at batch 256): in the Triton
kernel each program is a chain of memory round trips taken one after another, because every
load is written after a barrier that a layout conversion or a cross-warp sum brings, and the
compiler does not move a load across one; issuing the loads earlier in Triton kept their
values in registers (the compiler picks their layouts) and cost more occupancy than it saved.
Here every layout is chosen, so the program
  1. issues the tile's copy into shared memory (`cp.async`, no registers held while in flight),
  2. issues every other load its outputs need (cursor first, then the token's inputs and the
     records, each in the layout of its first use),
  3. forms the weights, the key products and the records' sum while the tile arrives,
  4. waits for the copies and reads the tile back, in a layout that keeps most of each row's
     sum in-thread, and
  5. on a flush folds the records into the tile still in shared memory (no second read of the
     checkpoint), in row chunks, with no layout conversion in the fold's loop.
The mathematics and the state contract are those of `decode.py` (and SPEC sections 2-3); the
CPU interpreter cannot run Gluon, so `decode.replay_decode` runs the Triton kernel there, and
the GPU tests compare this kernel with the float64 reference.
"""
from __future__ import annotations

from typing import Optional

from ..utils.gluon import HAVE_GLUON, gluon_record_tile, gluon_shape_supported
from ..utils.key_products import key_products
from ..utils.launch import slot_pads
from .common import OPTIONAL_INPUTS

if HAVE_GLUON:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

    from ..utils.gluon import (_arrive_early, _barrier, _fold_records, _move_cursor, _record_weights,
                                _slot_bases, _softplus, _tile_to_shared)

__all__ = ["HAVE_GLUON", "gluon_supported", "gluon_unsupported", "launch_gluon"]


def gluon_supported(HV: int, V: int, K: int, Hk: int, window: int, Lb: int, BV: int,
                    num_warps: int) -> bool:
    """Whether the Gluon kernel covers this shape and launch config (`gluon_unsupported` says
    why not)."""
    return not gluon_unsupported(HV, V, K, Hk, window, Lb, BV, num_warps)


def gluon_unsupported(HV: int, V: int, K: int, Hk: int, window: int, Lb: int, BV: int,
                      num_warps: int) -> Optional[str]:
    """Why the Gluon kernel does not cover this shape and launch config, or None when it does."""
    return gluon_shape_supported(V, K, window, Lb, BV, num_warps) or None


if HAVE_GLUON:

    @triton.heuristics(OPTIONAL_INPUTS)
    @gluon.jit
    def _gluon_replay_kernel(
        x, dt, B, C, A, dt_bias, D, z, out,
        ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids, kq,
        pad_ckpt, pad_ld, pad_w, pad_k, pad_cur,
        stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
        stride_z_b, stride_z_h, stride_o_b, stride_o_h,
        HV: gl.constexpr, Hk: gl.constexpr, V: gl.constexpr, K: gl.constexpr, LB: gl.constexpr,
        WINDOW: gl.constexpr, BV: gl.constexpr, BL: gl.constexpr, RC: gl.constexpr,
        HAS_D: gl.constexpr, HAS_Z: gl.constexpr, NW: gl.constexpr, RECMASK: gl.constexpr,
        KQ: gl.constexpr,
    ):
        # Layouts (NW warps, K = 128, BV = 16 NW, BL = 16 or, for windows above 16, 32):
        # LT  the tile [BV, K]: a row per warp and repetition, 4 columns per lane (16-byte copies)
        # LW  value records [BL, BV]: positions over 16 lanes, 8 rows per thread, so that the sum
        #     over positions stays inside a warp
        # LK  key records [BL, K]: 8 columns per thread over 16 lanes, positions over 2 lanes and
        #     the warps
        # LP  [BL] vectors held whole by every thread: the fold picks its coefficients in-thread
        # LY  [BV] outputs, one row per thread; LA1 the same for [BL] vectors, one position per
        #     lane (the log decays and their suffix sums, a scan across lanes)
        # RC  rows per chunk of the tile's reads and of the fold (4 * NW)
        LT: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
        # LR  the tile's rows read back for C q: 4 rows per warp, 16 columns per thread in four
        #     16-byte pieces (conflict-free), a row's sum mostly in-thread (3 shuffles, not 5)
        LR: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
        LW: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [1, NW], [1, 0])
        LK: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])
        LP: gl.constexpr = gl.BlockedLayout([BL], [32], [NW], [0])
        LY: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        SM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        LA1: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        NVB: gl.constexpr = V // BV
        HG: gl.constexpr = HV // Hk

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
        # slot-strided state (vLLM's pages): the bases moved by the slot's padding
        ckpt, buf_ld, buf_w, buf_k, cursor = _slot_bases(slot, ckpt, buf_ld, buf_w, buf_k, cursor, pad_ckpt, pad_ld,
                                                         pad_w, pad_k, pad_cur)

        # 1. the tile, to shared memory, in 16-byte pieces
        p_S = ckpt + slot * (HV * V * K) + i_h * (V * K) + v0 * K
        s_S = _tile_to_shared(p_S, BV, K, LT, SM)
        o_tk = gl.arange(0, K, layout=gl.SliceLayout(0, LT))

        # 2. every other load: the cursor, the token's inputs, the records. RECMASK predicates the
        # record loads on the cursor (no traffic for empty positions, but they wait for it);
        # otherwise they cover the window's positions and are issued at once. Positions at or
        # past the cursor are removed by selects after the load either way.
        h = gl.load(cursor + slot)
        NPOS: gl.constexpr = WINDOW if WINDOW < LB else LB
        b_dtr = gl.load(dt + i_b * stride_dt_b + i_h).to(gl.float32)
        b_dtb = gl.load(dt_bias + i_h).to(gl.float32)
        b_A = gl.load(A + i_h).to(gl.float32)
        # 1 / A for the records' dt_j = ld_j / A, formed here rather than at its use: fewer registers
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

        p_Kg = buf_k + slot * (LB * Hk * K) + i_g * K
        o_l = gl.arange(0, BL, layout=LA1)                          # positions, one per lane
        if KQ:
            # the group's key products k_j . q, formed once per (row, group) by the launch before
            # (utils/key_products.py) rather than by each of the group's programs from the key
            # records (their registers and their L2 reads)
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

        # 3. weights, key products, the records' sum
        b_dt = _softplus(b_dtr + b_dtb)
        b_ld = b_dt * b_A
        b_coef, b_g = _record_weights(b_ld1, b_ld0, b_ld, h, o_l)                        # g_{j+1:h}, g_{0:h}
        # the records keep x: their dt_j = ld_j / A enters the weights (a select past the
        # cursor, where the loaded value may be stale)
        b_coef = gl.where(o_l < h, b_coef * (b_ldj * b_rA), 0.0)
        if not KQ:
            b_Kb = gl.where(m_lK, b_Kr.to(gl.float32), 0.0)
            b_kq = gl.sum(b_Kb * b_qK[None, :], axis=1)                                  # [BL]
        b_kcq = gl.sum(b_kcK * b_qK, axis=0)
        b_cw = gl.convert_layout(b_coef, gl.SliceLayout(1, LW)) * gl.convert_layout(b_kq, gl.SliceLayout(1, LW))
        b_W = gl.where(m_lW, b_Wr.to(gl.float32), 0.0)
        b_rec = gl.sum(b_W * b_cw[:, None], axis=0)                                      # [BV]
        b_w = b_dt * b_x                                                                 # the token's w

        # 4. the tile, once every thread's copies have landed, RC rows at a time in LR; the row
        # sums go through shared memory to the outputs' layout
        b_qR = gl.convert_layout(b_qK, gl.SliceLayout(0, LR))
        cp.wait_group(0)
        _barrier()
        s_y = gl.allocate_shared_memory(gl.float32, [BV], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        for r0 in gl.static_range(0, BV, RC):
            b_Sm = s_S.slice(r0, RC, dim=0).load(LR)
            s_y.slice(r0, RC, dim=0).store(gl.sum(b_Sm * b_qR[None, :], axis=1))
        _barrier()
        b_y = b_g * s_y.load(LY) + gl.convert_layout(b_rec, LY) + b_kcq * b_w
        if HAS_D:
            b_y += b_D * b_x
        if HAS_Z:
            b_y = b_y * b_z / (1.0 + gl.exp(-b_z))
        gl.store(p_o, b_y.to(out.dtype.element_ty))

        is_flush = h + 1 >= WINDOW
        if is_flush:
            # 5. C <- g_{0:h} C + sum_{j<h} g_{j+1:h} dt_j x_j k_j^T + dt x k_h^T, row chunks of the tile
            # in shared memory, one rank-1 update per record (exact fp32), no conversions
            b_kcT = gl.load(p_Bt + o_tk).to(gl.float32)
            o_lP = gl.arange(0, BL, layout=LP)
            b_coefP = gl.convert_layout(b_coef, LP)          # whole in every thread: in-thread picks
            p_kj = p_Kg + o_tk
            for r0 in gl.static_range(0, BV, RC):
                o_rc = r0 + gl.arange(0, RC, layout=gl.SliceLayout(1, LT))
                b_Sc = s_S.slice(r0, RC, dim=0).load(LT)                                # [RC, K]
                b_xr = gl.load(x + i_b * stride_x_b + i_h * stride_x_h + v0 + o_rc).to(gl.float32)
                b_Sc = b_g * b_Sc + (b_dt * b_xr)[:, None] * b_kcT[None, :]
                b_Sc = _fold_records(b_Sc, o_rc, o_tk, o_lP, b_coefP, h, p_Wh, p_kj, HV * V, Hk * K, BL)
                gl.store(p_S + o_rc[:, None] * K + o_tk[None, :], b_Sc)
        else:
            # the record: this program's x as given; the head's log decay and the group's key
            # from the programs of the first value block (and the group's first head)
            p_wt = p_Wh + h * (HV * V) + o_y
            gl.store(p_wt, b_xi.to(p_wt.dtype.element_ty))
            if i_v == 0:
                gl.store(p_ldh + h * HV, b_ld)
                if i_h % HG == 0:
                    p_kh = p_Kg + h * (Hk * K) + o_kK
                    gl.store(p_kh, b_kcK.to(p_kh.dtype.element_ty))

        _move_cursor(n_arrived, HV * NVB, is_flush, cursor, epoch, arrive, slot, h)


def launch_gluon(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive,
                 slot_ids, out, window, BV, num_warps, maxnreg=0, recmask=True, kq=False):
    """Launch `_gluon_replay_kernel` (grid `(HV * V / BV, Bt)`); the caller checked
    `gluon_supported`. The tile is read and folded in chunks of 4 * num_warps rows. `kq`: the
    groups' key products formed first (`utils.key_products`, `Bt * Hk` programs), which the
    kernel loads instead of the key records (a flush still reads the records to fold them)."""
    Bt, HV, V = x.shape
    Hk, K = B.shape[1], B.shape[2]
    LB = buf_ld.shape[1]
    BL = gluon_record_tile(window, LB)
    pads = slot_pads(ckpt, buf_ld, buf_w, buf_k, cursor)
    kqs = key_products([C], buf_k, cursor, slot_ids, BL, pads["pad_k"], pads["pad_cur"]) if kq else slot_ids
    # D and z absent: None (the heuristics set HAS_D / HAS_Z)
    _gluon_replay_kernel[(HV * (V // BV), Bt)](
        x=x, dt=dt, B=B, C=C, A=A, dt_bias=dt_bias, D=D, z=z, out=out,
        ckpt=ckpt, buf_ld=buf_ld, buf_w=buf_w, buf_k=buf_k, cursor=cursor, epoch=epoch, arrive=arrive,
        slot_ids=slot_ids, kq=kqs, **pads,
        stride_x_b=x.stride(0), stride_x_h=x.stride(1), stride_dt_b=dt.stride(0),
        stride_B_b=B.stride(0), stride_B_g=B.stride(1), stride_C_b=C.stride(0), stride_C_g=C.stride(1),
        stride_z_b=z.stride(0) if z is not None else 0, stride_z_h=z.stride(1) if z is not None else 0,
        stride_o_b=out.stride(0), stride_o_h=out.stride(1),
        HV=HV, Hk=Hk, V=V, K=K, LB=LB, WINDOW=window, BV=BV, BL=BL,
        RC=4 * num_warps, NW=num_warps, num_warps=num_warps, RECMASK=bool(recmask), KQ=bool(kq),
        **({"maxnreg": maxnreg} if maxnreg else {}))
