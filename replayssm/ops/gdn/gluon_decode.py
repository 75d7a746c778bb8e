"""Gated DeltaNet standard decode on ReplaySSM state in Gluon, for the GPU only: the program of
`decode._replay_decode_kernel` (one `(row, value head, V-block)` tile) organised as the
Mamba-2 Gluon kernel is (ops/mamba2/gluon_decode.py: the checkpoint tile copied into shared
memory while every other load is in flight, each layout chosen, the slot's arrival early, the
flush folding in shared memory). The mathematics is that of `decode.py`:

    P k = G(0) C k + sum_{j<h} G(j+1) (k_j . k) u_j       u_t = beta (v - P k)
    P q = G(0) C q + sum_{j<h} G(j+1) (k_j . q) u_j       o   = P q + (k . q) u_t
    flush: C <- G(0) C + sum_{j<h} G(j+1) u_j k_j^T + u_t k^T

with `k`, `q` L2-normalised (and `q` scaled) in the kernel. KDA (`IS_KDA`) decays each key
channel: `G(j)` is a `[K]` vector that scales record j's key (`(k_j * G(j+1)) . k`) and the
checkpoint's columns (`C (G(0) * k)`; the flush `C Diag(G(0))`), its suffix sums scanned over
positions in-thread (layout LD). The CPU interpreter cannot run
Gluon: `decode.replay_decode` runs the Triton kernels there, and the GPU tests compare this one
with the float64 reference.
"""
from __future__ import annotations

from typing import Optional

from ..utils.gluon import HAVE_GLUON, gluon_record_tile, gluon_shape_supported
from ..utils.launch import slot_pads

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

    from ..utils.gluon import (_add, _arrive_early, _barrier, _fold_records, _move_cursor, _record_weights,
                                _rows_view, _slot_bases, _softplus, _tile_to_shared)

__all__ = ["gluon_unsupported", "launch_gluon"]


def gluon_unsupported(family: str, HV: int, Hk: int, V: int, K: int, window: int, Lb: int, BV: int,
                      num_warps: int) -> Optional[str]:
    """Why the Gluon kernel does not cover this family, shape and launch config; None when it does."""
    if family not in ("gdn", "kda"):
        return f"family {family!r} (GDN and KDA only)"
    return gluon_shape_supported(V, K, window, Lb, BV, num_warps) or None


if HAVE_GLUON:

    @gluon.jit
    def _delta_token_loads(q, k, v, a, b, A_log, dt_bias, i_b, i_hv, i_hk, v0, o_y, stride_q_b, stride_q_h,
                           stride_k_b, stride_k_h, stride_v_b, stride_v_h, stride_a_b, stride_a_h, stride_b_b,
                           stride_b_h, K: gl.constexpr, LK: gl.constexpr, LD: gl.constexpr,
                           IS_KDA: gl.constexpr):
        """The token's loads of a (row, value head, V-block) program, in the order both Gluon
        kernels issue them (this one and gluon_lowp.py's): key and query in LK, the V-block's
        values, beta, A_log, and the decay's a and dt_bias (KDA: a `[K]` vector each, in LD)."""
        o_kK = gl.arange(0, K, layout=gl.SliceLayout(0, LK))
        p_qt = q + i_b * stride_q_b + i_hk * stride_q_h
        p_kt = k + i_b * stride_k_b + i_hk * stride_k_h
        b_qK = gl.load(p_qt + o_kK).to(gl.float32)
        b_kK = gl.load(p_kt + o_kK).to(gl.float32)
        b_v = gl.load(v + i_b * stride_v_b + i_hv * stride_v_h + v0 + o_y).to(gl.float32)
        b_braw = gl.load(b + i_b * stride_b_b + i_hv * stride_b_h).to(gl.float32)
        b_Alog = gl.load(A_log + i_hv).to(gl.float32)
        if IS_KDA:
            # KDA: a log decay per key channel ([K], a's and dt_bias's last dim)
            o_kD = gl.arange(0, K, layout=gl.SliceLayout(0, LD))
            b_araw = gl.load(a + i_b * stride_a_b + i_hv * stride_a_h + o_kD).to(gl.float32)
            b_dtb = gl.load(dt_bias + i_hv * K + o_kD).to(gl.float32)
        else:
            o_kD = o_kK                                     # (no decay vector)
            b_araw = gl.load(a + i_b * stride_a_b + i_hv * stride_a_h).to(gl.float32)
            b_dtb = gl.load(dt_bias + i_hv).to(gl.float32)
        return o_kK, o_kD, p_qt, p_kt, b_qK, b_kK, b_v, b_braw, b_Alog, b_araw, b_dtb

    @gluon.jit
    def _kda_fold(s_C, s_u, s_Kw, b_kn, b_g0, p_C, p_Uh, h, SW: gl.constexpr, BV: gl.constexpr,
                  K: gl.constexpr, BL: gl.constexpr, RC: gl.constexpr, U: gl.constexpr, LF: gl.constexpr):
        # KDA's flush: C <- C Diag(G(0)) + sum_{j<h} u_j (k_j * G(j+1))^T + u_t k^T, by row chunks
        # of the tile. The decayed keys k_j * G(j+1) are the ones this step's outputs used, kept
        # in shared memory (`s_Kw`): walking the records per chunk with their decays re-scanned
        # (a load of key and log decay and an exponential per record, chunk and column) made a
        # flush step 2.2x a conventional one. Each thread holds 4 consecutive rows of a chunk (LF),
        # so a record's values are one vector load; U records a loop iteration, loads issued
        # together (the loop stays rolled: the registers of this rare path are every program's)
        o_fk = gl.arange(0, K, layout=gl.SliceLayout(0, LF))
        b_g0F = gl.convert_layout(b_g0, gl.SliceLayout(0, LF))
        b_knF = gl.convert_layout(b_kn, gl.SliceLayout(0, LF))
        n_rec = gl.minimum(h, BL)
        for r0 in gl.static_range(0, BV, RC):
            o_rc = r0 + gl.arange(0, RC, layout=gl.SliceLayout(1, LF))
            b_uc = s_u.slice(r0, RC, dim=0).load(gl.SliceLayout(1, LF))
            b_Cc = s_C.slice(r0, RC, dim=0).load(LF) * b_g0F[None, :] + b_uc[:, None] * b_knF[None, :]
            for g in range(0, n_rec, U):
                for i_u in gl.static_range(U):
                    j = g + i_u
                    w_j = gl.load(p_Uh + j * SW + o_rc, mask=(o_rc >= 0) & (j < n_rec), other=0.0).to(gl.float32)
                    # rows past the cursor hold zeros; j < BL as BL is a multiple of U
                    kw_j = s_Kw.index(j).load(gl.SliceLayout(0, LF))
                    b_Cc += w_j[:, None] * kw_j[None, :]
            gl.store(p_C + o_rc[:, None] * K + o_fk[None, :], b_Cc)

    @gluon.jit
    def _gluon_gdn_kernel(
        q, k, v, a, b, A_log, dt_bias, o,
        ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids,
        pad_ckpt, pad_ld, pad_w, pad_k, pad_cur,
        scale, window,
        stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
        stride_a_b, stride_a_h, stride_b_b, stride_b_h,
        HV: gl.constexpr, HK: gl.constexpr, V: gl.constexpr, K: gl.constexpr, LBCAP: gl.constexpr,
        BV: gl.constexpr, BL: gl.constexpr, RC: gl.constexpr, USE_QK_L2NORM: gl.constexpr,
        NW: gl.constexpr, RECMASK: gl.constexpr, IS_KDA: gl.constexpr, FOLD_GROUP: gl.constexpr,
    ):
        # layouts as in the Mamba-2 kernel (LT tile rows over warps, 4 columns per lane; LR the
        # tile read back for the matvecs; LK key records, 8 columns per thread; LA1 [BL] vectors,
        # one position per lane; LP [BL] held whole by every thread; LY one row per thread), but
        # LW, the value records, holds 8 positions per thread (of each 16) over 2 lanes and rows
        # over 16 lanes and the warps: GDN sums them twice (with k and with q), so the sums are
        # kept mostly in-thread (one shuffle) instead of across 16 lanes
        LT: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
        LR: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])      # C k, C q reads
        LW: gl.constexpr = gl.BlockedLayout([8, 1], [2, 16], [1, NW], [0, 1])
        LK: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])
        LA1: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        LP: gl.constexpr = gl.BlockedLayout([BL], [32], [NW], [0])
        LY: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        # LD  KDA's log-decay records [BL, K]: every position of a column in one thread, columns
        #     over the lanes and warps, so the suffix sums over positions are in-thread scans
        LD: gl.constexpr = gl.BlockedLayout([BL, 1], [1, 32], [1, NW], [0, 1])
        SM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        S1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        NVB: gl.constexpr = V // BV
        HG: gl.constexpr = HV // HK

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
        # slot-strided state (vLLM's pages): the bases moved by the slot's padding
        ckpt, buf_ld, buf_w, buf_k, cursor = _slot_bases(slot, ckpt, buf_ld, buf_w, buf_k, cursor, pad_ckpt, pad_ld,
                                                         pad_w, pad_k, pad_cur)

        # the tile, to shared memory
        p_C = ckpt + (slot * HV + i_hv) * (V * K) + v0 * K
        s_C = _tile_to_shared(p_C, BV, K, LT, SM)
        o_tk = gl.arange(0, K, layout=gl.SliceLayout(0, LT))

        # every other load
        h = gl.load(cursor + slot).to(gl.int32)
        npos = gl.minimum(window, LBCAP)
        o_kK, o_kD, p_qt, p_kt, b_qK, b_kK, b_v, b_braw, b_Alog, b_araw, b_dtb = _delta_token_loads(
            q, k, v, a, b, A_log, dt_bias, i_b, i_hv, i_hk, v0, o_y, stride_q_b, stride_q_h, stride_k_b,
            stride_k_h, stride_v_b, stride_v_h, stride_a_b, stride_a_h, stride_b_b, stride_b_h, K, LK, LD, IS_KDA)

        o_lK = gl.arange(0, BL, layout=gl.SliceLayout(1, LK))
        m_lK = (o_lK < h)[:, None]
        p_Kg = buf_k + slot * (LBCAP * HK * K) + i_hk * K
        b_Kr = gl.load(p_Kg + o_lK[:, None] * (HK * K) + o_kK[None, :],
                       mask=m_lK if RECMASK else (o_lK < npos)[:, None], other=0.0)
        o_lW = gl.arange(0, BL, layout=gl.SliceLayout(1, LW))
        o_rW = gl.arange(0, BV, layout=gl.SliceLayout(0, LW))
        m_lW = (o_lW < h)[:, None]
        p_Uh = buf_w + slot * (LBCAP * HV * V) + i_hv * V + v0
        b_Ur = gl.load(p_Uh + o_lW[:, None] * (HV * V) + o_rW[None, :],
                       mask=m_lW if RECMASK else (o_lW < npos)[:, None], other=0.0)
        o_l = gl.arange(0, BL, layout=LA1)
        if IS_KDA:
            # position j's decay vector at p_ldh + j * HV * K
            o_lD = gl.arange(0, BL, layout=gl.SliceLayout(1, LD))
            p_ldh = buf_ld + slot * (LBCAP * HV * K) + i_hv * K
            m_l1D = (o_lD + 1 < h) if RECMASK else (o_lD + 1 < npos)
            b_ld1 = gl.load(p_ldh + (o_lD + 1)[:, None] * (HV * K) + o_kD[None, :], mask=m_l1D[:, None], other=0.0)
            b_ld0 = gl.load(p_ldh + o_kD)
        else:
            p_ldh = buf_ld + slot * (LBCAP * HV) + i_hv
            b_ld1 = gl.load(p_ldh + (o_l + 1) * HV, mask=(o_l + 1 < h) if RECMASK else (o_l + 1 < npos), other=0.0)
            b_ld0 = gl.load(p_ldh)

        n_arrived = _arrive_early(arrive, slot, h, LA1)

        # the token: normalised key and query, decay, beta
        if USE_QK_L2NORM:
            r_q = scale * gl.rsqrt(gl.sum(b_qK * b_qK, axis=0) + 1e-6)
            r_k = gl.rsqrt(gl.sum(b_kK * b_kK, axis=0) + 1e-6)
        else:
            r_q = scale
            r_k = 1.0
        b_beta = 1.0 / (1.0 + gl.exp(-b_braw))
        b_ld = -gl.exp(b_Alog) * _softplus(b_araw + b_dtb)

        b_Kb = gl.where(m_lK, b_Kr.to(gl.float32), 0.0)
        b_ktq = gl.sum(b_kK * b_qK, axis=0) * (r_k * r_q)
        b_U = gl.where(m_lW, b_Ur.to(gl.float32), 0.0)
        if IS_KDA:
            # per channel: G(j+1) = exp(ld_{j+1} + ... + ld_h) (a reverse scan of same-signed
            # log decays, never a difference of prefix sums) scales record j's key, G(0) the
            # checkpoint's columns (folded into the key and query of its products)
            b_lds = gl.where((o_lD + 1 < h)[:, None], b_ld1,
                             gl.where((o_lD + 1 == h)[:, None], b_ld[None, :], 0.0))     # [BL, K]
            b_GD = gl.where((o_lD < h)[:, None], gl.exp(gl.associative_scan(b_lds, 0, _add, reverse=True)), 0.0)
            b_g0 = gl.exp(gl.where(h > 0, b_ld0, b_ld) + gl.sum(b_lds, axis=0))          # [K]
            b_Kw = b_Kb * gl.convert_layout(b_GD, LK)                                    # k_j * G(j+1)
            b_kk = gl.sum(b_Kw * b_kK[None, :], axis=1) * r_k
            b_kq = gl.sum(b_Kw * b_qK[None, :], axis=1) * r_q
            b_rk = gl.sum(b_U * gl.convert_layout(b_kk, gl.SliceLayout(1, LW))[:, None], axis=0)
            b_rq = gl.sum(b_U * gl.convert_layout(b_kq, gl.SliceLayout(1, LW))[:, None], axis=0)
            b_g0K = gl.convert_layout(b_g0, gl.SliceLayout(0, LK))
            b_qR = gl.convert_layout(b_qK * b_g0K, gl.SliceLayout(0, LR))
            b_kR = gl.convert_layout(b_kK * b_g0K, gl.SliceLayout(0, LR))
            b_g = 1.0
        else:
            # weights G(j+1) (suffix sums of same-signed log decays) and G(0)
            b_coef, b_g = _record_weights(b_ld1, b_ld0, b_ld, h, o_l)
            # the records' products with the token's key and query, their sums over the records
            b_kk = gl.sum(b_Kb * b_kK[None, :], axis=1) * r_k
            b_kq = gl.sum(b_Kb * b_qK[None, :], axis=1) * r_q
            b_cW = gl.convert_layout(b_coef, gl.SliceLayout(1, LW))
            b_rk = gl.sum(b_U * (b_cW * gl.convert_layout(b_kk, gl.SliceLayout(1, LW)))[:, None], axis=0)
            b_rq = gl.sum(b_U * (b_cW * gl.convert_layout(b_kq, gl.SliceLayout(1, LW)))[:, None], axis=0)
            b_qR = gl.convert_layout(b_qK, gl.SliceLayout(0, LR))
            b_kR = gl.convert_layout(b_kK, gl.SliceLayout(0, LR))

        # the tile, once every thread's copies have landed: C k and C q, RC rows at a time, the
        # rows' sums mostly in-thread (LR), through shared memory to the rows' layout
        cp.wait_group(0)
        _barrier()
        s_yk = gl.allocate_shared_memory(gl.float32, [BV], S1)
        s_yq = gl.allocate_shared_memory(gl.float32, [BV], S1)
        for r0 in gl.static_range(0, BV, RC):
            b_Cm = s_C.slice(r0, RC, dim=0).load(LR)
            s_yk.slice(r0, RC, dim=0).store(gl.sum(b_Cm * b_kR[None, :], axis=1))
            s_yq.slice(r0, RC, dim=0).store(gl.sum(b_Cm * b_qR[None, :], axis=1))
        _barrier()
        b_Pk = b_g * (s_yk.load(LY) * r_k) + gl.convert_layout(b_rk, LY)
        b_Pq = b_g * (s_yq.load(LY) * r_q) + gl.convert_layout(b_rq, LY)
        b_u = b_beta * (b_v - b_Pk)
        gl.store(p_o, (b_Pq + b_ktq * b_u).to(o.dtype.element_ty))

        # the record at position h (written on a flush too, dead then; h < LBCAP guards the
        # buffer against a bad cursor)
        in_buf = h < LBCAP
        p_ut = p_Uh + h * (HV * V) + o_y
        gl.store(p_ut, b_u.to(p_ut.dtype.element_ty), mask=(o_y >= 0) & in_buf)
        if i_v == 0:
            if IS_KDA:
                gl.store(p_ldh + h * (HV * K) + o_kD, b_ld, mask=(o_kD >= 0) & in_buf)
            else:
                gl.store(p_ldh + h * HV, b_ld, mask=in_buf)
            if i_hv % HG == 0:
                p_kh = p_Kg + h * (HK * K) + o_kK
                gl.store(p_kh, (b_kK * r_k).to(p_kh.dtype.element_ty), mask=(o_kK >= 0) & in_buf)

        is_flush = h + 1 >= window
        if is_flush:
            # C <- G(0) C + sum_{j<h} G(j+1) u_j k_j^T + u_t k^T, row chunks of the tile in shared
            # memory, one rank-1 update per record, no conversions in the loop (KDA: the decayed
            # keys, `[BL, K]`, staged in shared memory that the layout conversions' scratch frees)
            s_u = gl.allocate_shared_memory(gl.float32, [BV], S1)
            s_u.store(b_u)
            _barrier()
            b_kn = gl.load(p_kt + o_tk).to(gl.float32) * r_k
            if IS_KDA:
                LF: gl.constexpr = gl.BlockedLayout([4, 4], [1, 32], [NW, 1], [1, 0])
                s_Kw = _rows_view(gl.allocate_shared_memory(gl.float32, [BL, K], SM, b_Kw), BL, K)
                _barrier()
                _kda_fold(s_C, s_u, s_Kw, b_kn, b_g0, p_C, p_Uh, h, HV * V, BV, K, BL, 4 * NW, FOLD_GROUP, LF)
            else:
                o_lP = gl.arange(0, BL, layout=LP)
                b_coefP = gl.convert_layout(b_coef, LP)
                p_kj = p_Kg + o_tk
                for r0 in gl.static_range(0, BV, RC):
                    o_rc = r0 + gl.arange(0, RC, layout=gl.SliceLayout(1, LT))
                    b_Cc = s_C.slice(r0, RC, dim=0).load(LT)
                    b_uc = s_u.slice(r0, RC, dim=0).load(gl.SliceLayout(1, LT))
                    b_Cc = b_g * b_Cc + b_uc[:, None] * b_kn[None, :]
                    b_Cc = _fold_records(b_Cc, o_rc, o_tk, o_lP, b_coefP, h, p_Uh, p_kj, HV * V, HK * K, BL)
                    gl.store(p_C + o_rc[:, None] * K + o_tk[None, :], b_Cc)

        _move_cursor(n_arrived, HV * NVB, is_flush, cursor, epoch, arrive, slot, h)


def launch_gluon(q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k, cursor, epoch,
                 arrive, slot_ids, window, o, use_qk_l2norm, BV, num_warps, recmask=True, maxnreg=0,
                 family="gdn", fold_group=1):
    """Launch `_gluon_gdn_kernel` (grid `(HV * V / BV, Bt)`) for `family` "gdn" or "kda"; the
    caller checked `gluon_unsupported`. `fold_group`: KDA's flush folds this many records per
    iteration of its loop (the config's `BC`)."""
    Bt, Hk, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    BL = gluon_record_tile(window, buf_w.shape[1])
    _gluon_gdn_kernel[(HV * (V // BV), Bt)](
        q, k, v, a, b, A_log, dt_bias, o, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids,
        *slot_pads(ckpt, buf_ld, buf_w, buf_k, cursor).values(),
        scale, window,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        HV=HV, HK=Hk, V=V, K=K, LBCAP=buf_w.shape[1], BV=BV, BL=BL,
        RC=4 * num_warps,
        USE_QK_L2NORM=bool(use_qk_l2norm), NW=num_warps, RECMASK=bool(recmask), IS_KDA=family == "kda",
        # GDN's flush has no such loop: one specialisation whatever BC says; no more than the
        # record tile's positions (the fold indexes that many rows of the decayed keys)
        FOLD_GROUP=min(max(1, fold_group), BL) if family == "kda" else 1,
        num_warps=num_warps,
        **({"maxnreg": maxnreg} if maxnreg else {}))
