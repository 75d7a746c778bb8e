"""Pieces of the GDN/KDA Gluon verify kernel (gluon_verify.py), for the GPU only: the records'
copies into shared memory and the row products with the drafts' vectors (with `LEAN`, the
drafts' own products on the tensor cores and the solve's factors formed once), KDA's drafts'
Gram rows, a pool's 16-bit copy (its tile's staging, an early flush's refold along the HP
path), and the early flush's hand-off: the slot's last program writes the drafts' shared fields
(decays, normalised keys; with a copy, the gates) at positions `0..n-1`, recomputed from the
inputs, which the slot's other programs read as committed records until they all arrived.
"""
from __future__ import annotations

from ..utils.gluon import HAVE_GLUON

__all__ = ["HAVE_GLUON"]

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

    from ..utils.gluon import (_add, _async_load, _barrier, _lp_decode, _lp_encode, _lp_tile_view, _record_weights,
                                _rows_view, _softplus, _tile_offsets)
    from ..utils.gluon_mma import (_bf16_products_mma, _fold_mma, _mma_exact, _split_bf16, _tile_vectors_mma,
                                   _zero_keys_past)

    @gluon.jit
    def _stage_keys_queries(k, q, i_b, i_hk, stride_k_b, stride_k_t, stride_k_h, stride_q_b, stride_q_t,
                            stride_q_h, T: gl.constexpr, K: gl.constexpr, NW: gl.constexpr):
        """(GDN, `mma` with `LEAN`: bf16 inputs.) The drafts' raw keys (rows 0..7) and queries (rows
        8..15), zero past T, stored from registers into one `[16, K]` shared buffer swizzled as
        the tensor cores read it (utils/gluon_mma.py), while the tile is in flight: the B
        operands of the tile's products and both operands of `_draft_products_mma`. The
        caller's barrier comes before a read."""
        LXN: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
        o_r = gl.arange(0, 16, layout=gl.SliceLayout(1, LXN))
        o_kx = gl.arange(0, K, layout=gl.SliceLayout(0, LXN))
        o_t = o_r % 8
        p_k = k + i_b * stride_k_b + i_hk * stride_k_h + o_t * stride_k_t
        p_q = q + i_b * stride_q_b + i_hk * stride_q_h + o_t * stride_q_t
        m_x = (o_t < T)[:, None] & (o_kx >= 0)[None, :]
        return gl.allocate_shared_memory(k.dtype.element_ty, [16, K], gl.SwizzledSharedLayout(8, 1, 8, [1, 0]),
                                         gl.load(gl.where(o_r < 8, p_k, p_q)[:, None] + o_kx[None, :], mask=m_x,
                                                 other=0.0))

    @gluon.jit
    def _solve_weights(b_ldc, s_G, s_W, s_v, TP: gl.constexpr, LC: gl.constexpr, NW: gl.constexpr):
        """(GDN with `LEAN`.) The solve's per-draft factors formed once, one element per thread,
        where the solve's loop formed them in every thread: `s_W` `[2 TP, TP]` rows t and TP + t
        the weights w_k, w_q of draft t on the earlier drafts r < t (exp of the log decays
        ld_{r+1} + ... + ld_t summed in that order, times the Gram rows of `s_G`; zero from r = t
        on), and `s_v` `[2 TP]` g_t = exp(ld_0 + ... + ld_t) and k_t . q_t: the same values the
        loop forms, bit for bit. `b_ldc`: the drafts' log decays, whole in every thread (LC); `s_G`
        written and a barrier passed; the caller's barrier comes before a read."""
        LW2: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [NW, 1], [1, 0])
        o_t = gl.arange(0, TP, layout=gl.SliceLayout(1, LW2))[:, None]
        o_r = gl.arange(0, TP, layout=gl.SliceLayout(0, LW2))[None, :]
        o_c = gl.arange(0, TP, layout=LC)
        lw = gl.zeros([TP, TP], gl.float32, LW2)
        lb = gl.zeros([TP, TP], gl.float32, LW2)
        for s in gl.static_range(TP):
            ld_s = gl.sum(gl.where(o_c == s, b_ldc, 0.0), axis=0)
            lw = gl.where((o_r < s) & (s <= o_t), lw + ld_s, lw)
            lb = gl.where(s <= o_t, lb + ld_s, lb)
        before = o_r < o_t
        b_w = gl.exp(lw)
        b_gq = s_G.slice(TP, TP, dim=0).load(LW2)
        s_W.slice(0, TP, dim=0).store(gl.where(before, b_w * s_G.slice(0, TP, dim=0).load(LW2), 0.0))
        s_W.slice(TP, TP, dim=0).store(gl.where(before, b_w * b_gq, 0.0))
        # (lb is the same along a row; its first column taken)
        s_v.slice(0, TP).store(gl.sum(gl.where(o_r == 0, gl.exp(lb), 0.0), axis=1))
        s_v.slice(TP, TP).store(gl.sum(gl.where(o_r == o_t, b_gq, 0.0), axis=1))

    @gluon.jit
    def _draft_products_mma(s_kq, s_K, s_c, s_f, hr, s_G, s_Zk, s_Zq, BL: gl.constexpr, K: gl.constexpr,
                            NW: gl.constexpr):
        """(GDN, `mma` with `LEAN`: bf16 inputs and key records.) What every program of a key head
        forms beside the tile's products, on the tensor cores too, from the raw vectors as stored
        (exact products, `utils.gluon_mma._bf16_products_mma`) with the norms and the scale
        applied after, as to the tile's products: the drafts' Gram rows into `s_G` `[16, 8]`
        (row t: k_t . k_r; row 8 + t: q_t . k_r) and the key records' products with the drafts'
        keys and queries, weighted by c_j (`s_c`) and zero at or past the cursor `hr` (a select:
        records there may hold anything), into `s_Zk`, `s_Zq` `[BL, 8]`. `s_kq`:
        `_stage_keys_queries`' buffer; `s_f` `[16]` its rows' factors (the keys' inverse norms,
        the queries' times the scale); the key records `s_K` landed, and a barrier passed."""
        MM: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        f_r = s_f.load(gl.SliceLayout(1, MM))[:, None]
        f_k = s_f.slice(0, 8).load(gl.SliceLayout(0, MM))[None, :]
        f_q = s_f.slice(8, 8).load(gl.SliceLayout(0, MM))[None, :]
        s_kx = s_kq.slice(0, 8, dim=0)
        s_G.store(_bf16_products_mma(s_kq, s_kx, 16, 8, K, NW) * f_r * f_k)
        o_j = gl.arange(0, BL, layout=gl.SliceLayout(1, MM))
        m_j = (o_j < hr)[:, None]
        b_c = s_c.load(gl.SliceLayout(1, MM))[:, None]
        s_Zk.store(gl.where(m_j, b_c * (_bf16_products_mma(s_K, s_kx, BL, 8, K, NW) * f_k), 0.0))
        s_Zq.store(gl.where(m_j, b_c * (_bf16_products_mma(s_K, s_kq.slice(8, 8, dim=0), BL, 8, K, NW) * f_q), 0.0))

    @gluon.jit
    def _stage_lp_tile(p_C, p_L, flush, BV: gl.constexpr, K: gl.constexpr, LT: gl.constexpr, SWZ: gl.constexpr,
                       MMA: gl.constexpr, NW: gl.constexpr):
        """(A pool with a 16-bit copy, verify_lp.py's contract.) The fp32 tile `[BV, K]` at
        `p_C` into shared memory for a row that flushes, else the copy's tile at `p_L` (int16
        bits, half the bytes) into the first half of the same memory, one copy group, waited on
        by the caller; returns both views (`s_C` fp32, `s_L` int16). With `MMA` both are
        swizzled as the tensor cores read them (utils/gluon_mma.py)."""
        SM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        LLC: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])      # 8 x 16 bits
        s_C = gl.allocate_shared_memory(gl.float32, [BV, K], gl.SwizzledSharedLayout(4, 1, SWZ, [1, 0]) if MMA else SM)
        s_L = _lp_tile_view(s_C, BV, K, gl.SwizzledSharedLayout(8, 1, 8, [1, 0]) if MMA else SM)
        if flush:
            _async_load(s_C, p_C + _tile_offsets(BV, K, LT), eviction_policy="evict_first")
        else:
            _async_load(s_L, p_L + _tile_offsets(BV, K, LLC), eviction_policy="evict_first")
        cp.commit_group()
        _barrier()
        return s_C, s_L

    @gluon.jit
    def _write_drafts_shared(k, a, A_log, dt_bias, buf_ld, buf_k, i_b, slot, n,
                             stride_k_b, stride_k_t, stride_k_h, stride_a_b, stride_a_t, stride_a_h,
                             T: gl.constexpr, HV: gl.constexpr, HK: gl.constexpr, K: gl.constexpr,
                             LBCAP: gl.constexpr, HVP: gl.constexpr, HKP: gl.constexpr,
                             USE_QK_L2NORM: gl.constexpr, NW: gl.constexpr):
        """On an early flush, by the slot's last program: every value head's log decay and every
        key head's normalised key of drafts `0..n-1` at positions `0..n-1`, recomputed from the
        inputs (verify._write_shared), which the slot's other programs read as committed records
        until they all arrived."""
        LH: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
        LV: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        o_hk = gl.arange(0, HKP, layout=gl.SliceLayout(1, LH))
        o_kh = gl.arange(0, K, layout=gl.SliceLayout(0, LH))
        m_kh = (o_hk < HK)[:, None] & (o_kh >= 0)[None, :]
        o_hv = gl.arange(0, HVP, layout=LV)
        m_hv = o_hv < HV
        b_A = gl.exp(gl.load(A_log + o_hv, mask=m_hv, other=0.0).to(gl.float32))
        b_dt = gl.load(dt_bias + o_hv, mask=m_hv, other=0.0).to(gl.float32)
        for t in gl.static_range(T):
            ok = t < n
            b_k = gl.load(k + i_b * stride_k_b + t * stride_k_t + o_hk[:, None] * stride_k_h + o_kh[None, :],
                          mask=m_kh, other=0.0).to(gl.float32)
            if USE_QK_L2NORM:
                b_k = b_k * gl.rsqrt(gl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
            p_kb = buf_k + ((slot * LBCAP + t) * HK + o_hk)[:, None] * K + o_kh[None, :]
            gl.store(p_kb, b_k.to(p_kb.dtype.element_ty), mask=m_kh & ok)
            b_a = gl.load(a + i_b * stride_a_b + t * stride_a_t + o_hv * stride_a_h, mask=m_hv,
                          other=0.0).to(gl.float32)
            gl.store(buf_ld + (slot * LBCAP + t) * HV + o_hv, -b_A * _softplus(b_a + b_dt), mask=m_hv & ok)

    @gluon.jit
    def _write_drafts_shared_kda(k, a, A_log, dt_bias, buf_ld, buf_k, i_b, slot, n,
                                 stride_k_b, stride_k_t, stride_k_h, stride_a_b, stride_a_t, stride_a_h,
                                 T: gl.constexpr, HV: gl.constexpr, HK: gl.constexpr, K: gl.constexpr,
                                 LBCAP: gl.constexpr, USE_QK_L2NORM: gl.constexpr, NW: gl.constexpr):
        """`_write_drafts_shared` for KDA, whose decays are `[K]` vectors: value heads (then key
        heads) RH at a time, a loop over them with the drafts unrolled inside, so that the
        registers of this rare path (every program's) stay bounded at any HV and T."""
        RH: gl.constexpr = 2 * NW
        LH: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
        o_r = gl.arange(0, RH, layout=gl.SliceLayout(1, LH))
        o_kh = gl.arange(0, K, layout=gl.SliceLayout(0, LH))
        for h0 in range(0, HV, RH):
            o_hv = h0 + o_r
            m_hv = (o_hv < HV)[:, None] & (o_kh >= 0)[None, :]
            b_A = gl.exp(gl.load(A_log + o_hv, mask=o_hv < HV, other=0.0).to(gl.float32))[:, None]
            b_dt = gl.load(dt_bias + o_hv[:, None] * K + o_kh[None, :], mask=m_hv, other=0.0).to(gl.float32)
            for t in gl.static_range(T):
                b_a = gl.load(a + i_b * stride_a_b + t * stride_a_t + o_hv[:, None] * stride_a_h + o_kh[None, :],
                              mask=m_hv, other=0.0).to(gl.float32)
                gl.store(buf_ld + ((slot * LBCAP + t) * HV + o_hv)[:, None] * K + o_kh[None, :],
                         -b_A * _softplus(b_a + b_dt), mask=m_hv & (t < n))
        for h0 in range(0, HK, RH):
            o_hk = h0 + o_r
            m_kh = (o_hk < HK)[:, None] & (o_kh >= 0)[None, :]
            for t in gl.static_range(T):
                b_k = gl.load(k + i_b * stride_k_b + t * stride_k_t + o_hk[:, None] * stride_k_h + o_kh[None, :],
                              mask=m_kh, other=0.0).to(gl.float32)
                if USE_QK_L2NORM:
                    b_k = b_k * gl.rsqrt(gl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
                p_kb = buf_k + ((slot * LBCAP + t) * HK + o_hk)[:, None] * K + o_kh[None, :]
                gl.store(p_kb, b_k.to(p_kb.dtype.element_ty), mask=m_kh & (t < n))

    @gluon.jit
    def _records_to_shared(p_R, h, BL: gl.constexpr, N: gl.constexpr, STRIDE: gl.constexpr,
                           VEC: gl.constexpr, NW: gl.constexpr):
        """Start the asynchronous copy of records `0..h-1` (`N` contiguous elements each, STRIDE
        apart from `p_R`, in pieces of VEC elements = 16 bytes) into a `[BL, N]` buffer, as one
        commit group; positions from `h` on are filled with zeros."""
        LQ: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // (N // VEC), N // VEC], [NW, 1], [1, 0])
        o_r = gl.arange(0, BL, layout=gl.SliceLayout(1, LQ))
        o_n = gl.arange(0, N, layout=gl.SliceLayout(0, LQ))
        s_R = gl.allocate_shared_memory(p_R.dtype.element_ty, [BL, N], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        _async_load(s_R, p_R + (o_r[:, None] * STRIDE + o_n[None, :]), mask=(o_r < h)[:, None] & (o_n >= 0)[None, :])
        cp.commit_group()
        return s_R

    @gluon.jit
    def _row_pair_products(s_R, b_x, b_z, s_X, s_Z, N: gl.constexpr, STEP: gl.constexpr, LR: gl.constexpr,
                           LPT: gl.constexpr):
        """Rows `s_R` `[N, K]` (shared) times two sets of vectors held in registers (`b_x`, `b_z`,
        `[TP, K]` in `SliceLayout(0, L3)`), STEP rows (LR's) at a time, into the shared `[N, TP]`
        `s_X`, `s_Z`: each row chunk read once for both. `LPT` 1 / 2: the rows are a 16-bit copy's
        int16 bits (fp16 / bf16), decoded exactly."""
        for r0 in gl.static_range(0, N, STEP):
            if LPT:
                b_m = _lp_decode(s_R.slice(r0, STEP, dim=0).load(LR), LPT)[:, None, :]
            else:
                b_m = s_R.slice(r0, STEP, dim=0).load(LR)[:, None, :]
            s_X.slice(r0, STEP, dim=0).store(gl.sum(b_m * b_x[None, :, :], axis=2))
            s_Z.slice(r0, STEP, dim=0).store(gl.sum(b_m * b_z[None, :, :], axis=2))

    @gluon.jit
    def _kda_draft_grams(q, k, a, A_log, dt_bias, p_ldh, i_b, i_hv, i_hk, hc, n, sole, scale,
                         stride_q_b, stride_q_t, stride_q_h, stride_k_b, stride_k_t, stride_k_h,
                         stride_a_b, stride_a_t, stride_a_h, s_Gk, s_Gq, s_A,
                         HV: gl.constexpr, K: gl.constexpr, LBCAP: gl.constexpr, TP: gl.constexpr,
                         USE_QK_L2NORM: gl.constexpr, NW: gl.constexpr):
        """KDA's drafts in order: draft t's decay vector a_t, its Gram rows `[t, r] = (k_r * a_{r+1}
        ... a_t) . x_t` for x = k_t, q_t (`[t, t]`: k_t . q_t; columns past t zero) and the
        running decay `a_0 ... a_t`, to the shared `[TP, TP]` s_Gk, s_Gq and `[TP, K]` s_A (rows
        past n unwritten); without a flush (`sole`) the decay's record at h' + t. The weighted
        keys are products of factors <= 1, as the recurrence applies them, never a difference of
        log sums. A loop to n: unrolled, every draft's loads would be hoisted into registers."""
        LG: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
        o_rG = gl.arange(0, TP, layout=gl.SliceLayout(1, LG))
        o_kG = gl.arange(0, K, layout=gl.SliceLayout(0, LG))
        b_AG = gl.exp(gl.load(A_log + i_hv).to(gl.float32))
        b_dtG = gl.load(dt_bias + i_hv * K + o_kG).to(gl.float32)
        b_KW = gl.zeros([TP, K], gl.float32, LG)
        b_cum = gl.zeros([K], gl.float32, gl.SliceLayout(0, LG)) + 1.0
        s_A1 = _rows_view(s_A, TP, K)
        s_Gk1 = _rows_view(s_Gk, TP, TP)
        s_Gq1 = _rows_view(s_Gq, TP, TP)
        for t in range(0, n):
            b_kt = gl.load(k + i_b * stride_k_b + t * stride_k_t + i_hk * stride_k_h + o_kG).to(gl.float32)
            b_qt = gl.load(q + i_b * stride_q_b + t * stride_q_t + i_hk * stride_q_h + o_kG).to(gl.float32)
            b_at = gl.load(a + i_b * stride_a_b + t * stride_a_t + i_hv * stride_a_h + o_kG).to(gl.float32)
            if USE_QK_L2NORM:
                b_kt = b_kt * gl.rsqrt(gl.sum(b_kt * b_kt, axis=0) + 1e-6)
                b_qt = b_qt * gl.rsqrt(gl.sum(b_qt * b_qt, axis=0) + 1e-6)
            b_qt = b_qt * scale
            b_ldt = -b_AG * _softplus(b_at + b_dtG)
            b_et = gl.exp(b_ldt)
            b_KW = gl.where((o_rG == t)[:, None], b_kt[None, :], b_KW * b_et[None, :])
            s_Gk1.index(t).store(gl.sum(b_KW * b_kt[None, :], axis=1))
            s_Gq1.index(t).store(gl.sum(b_KW * b_qt[None, :], axis=1))
            b_cum = b_cum * b_et
            s_A1.index(t).store(b_cum)
            gl.store(p_ldh + (hc + t) * (HV * K) + o_kG, b_ldt, mask=(o_kG >= 0) & (hc + t < LBCAP) & sole)

    @gluon.jit
    def _fold_kda(s_C, s_U1, s_Kw, b_gE, hb, p_C, BV: gl.constexpr, K: gl.constexpr, BL: gl.constexpr,
                  RCF: gl.constexpr, LT: gl.constexpr):
        """KDA's early flush: `C <- C Diag(g) + sum_{j<h} u_j (c_j * k_j)^T`, RCF rows of the tile
        at a time, the u records (`s_U1`, rows view) and the weighted keys `s_Kw` from shared
        memory, stored as the new checkpoint `p_C`."""
        o_tk = gl.arange(0, K, layout=gl.SliceLayout(0, LT))
        s_Kw1 = _rows_view(s_Kw, BL, K)
        b_gT = gl.convert_layout(b_gE, gl.SliceLayout(0, LT))[None, :]
        for r0 in gl.static_range(0, BV, RCF):
            o_rc = r0 + gl.arange(0, RCF, layout=gl.SliceLayout(1, LT))
            b_Cc = s_C.slice(r0, RCF, dim=0).load(LT) * b_gT
            for jf in range(0, hb):
                b_uw = s_U1.index(jf).slice(r0, RCF).load(gl.SliceLayout(1, LT)).to(gl.float32)
                b_Cc += b_uw[:, None] * s_Kw1.index(jf).load(gl.SliceLayout(0, LT))[None, :]
            gl.store(p_C + o_rc[:, None] * K + o_tk[None, :], b_Cc)

    @gluon.jit
    def _refold_lp(s_C, s_K, s_Vr, p_ld, p_beta, h, p_C, p_L, BV: gl.constexpr, K: gl.constexpr, BL: gl.constexpr,
                   RCF: gl.constexpr, HV: gl.constexpr, LT: gl.constexpr, LPT: gl.constexpr,
                   IS_KDA: gl.constexpr = False):
        """An early flush of a pool with a 16-bit copy (verify_lp.py's contract): the fp32 tile
        `s_C` (shared) folded over records `0..h-1` along the HP path, `S <- a_j S;
        u_j = beta_j (v_j - S k_j); S <- S + u_j k_j^T`, each u_j recomputed from the raw v_j
        (`s_Vr` `[BL, BV]`, this program's rows) and beta_j (the buffered u came from the copy),
        RCF rows at a time (LT's), in place, and stored to the checkpoint `p_C` and the copy
        `p_L` (round-to-nearest). `p_ld`, `p_beta`: the head's log decay and beta at position 0,
        positions HV apart (KDA: `S <- S Diag(a_j)`, the decays `[K]` per position, HV K apart).
        The caller passes a barrier before reading `s_C` again."""
        o_tk = gl.arange(0, K, layout=gl.SliceLayout(0, LT))
        s_K1 = _rows_view(s_K, BL, K)
        s_V1 = _rows_view(s_Vr, BL, BV)
        hb = gl.minimum(h, BL)
        for r0 in gl.static_range(0, BV, RCF):
            o_rc = r0 + gl.arange(0, RCF, layout=gl.SliceLayout(1, LT))
            b_Cc = s_C.slice(r0, RCF, dim=0).load(LT)
            for j in range(0, hb):
                b_kj = s_K1.index(j).load(gl.SliceLayout(0, LT)).to(gl.float32)
                b_vj = s_V1.index(j).slice(r0, RCF).load(gl.SliceLayout(1, LT)).to(gl.float32)
                if IS_KDA:
                    b_Cc = b_Cc * gl.exp(gl.load(p_ld + j * (HV * K) + o_tk))[None, :]
                else:
                    b_Cc = b_Cc * gl.exp(gl.load(p_ld + j * HV))
                b_u = gl.load(p_beta + j * HV) * (b_vj - gl.sum(b_Cc * b_kj[None, :], axis=1))
                b_Cc += b_u[:, None] * b_kj[None, :]
            s_C.slice(r0, RCF, dim=0).store(b_Cc)
            gl.store(p_C + o_rc[:, None] * K + o_tk[None, :], b_Cc)
            gl.store(p_L + o_rc[:, None] * K + o_tk[None, :], _lp_encode(b_Cc, LPT))

    @gluon.jit
    def _refold_lp_mma(s_C, s_K, s_Vr, p_ld, p_beta, h, p_C, p_L, BV: gl.constexpr, K: gl.constexpr,
                       BL: gl.constexpr, HV: gl.constexpr, KP: gl.constexpr, NW: gl.constexpr, LPT: gl.constexpr):
        """`_refold_lp`'s result with its products on the tensor cores (exact: utils/gluon_mma.py).
        The recurrence `S <- a_j S; u_j = beta_j (v_j - S k_j); S <- S + u_j k_j^T` over records
        j < h, unrolled from the old tile C: `a_0..a_j S_{j-1} k_j = e_j (C k_j) + sum_{i<j} d_ji
        (k_i . k_j) u_i` with `e_j = exp(ld_0 + .. + ld_j)` and `d_ji = exp(ld_{i+1} + .. + ld_j)`,
        so `W = C K^T` (one product of the tile with the records' keys) and the keys' Gram give
        every u_j by a forward substitution per row over h scalars (no pass over the tile per
        record), and the new tile is `g C + sum_j c_j u_j k_j^T` (the fold's product). The decays
        are sums of consecutive log decays, never differences of prefix sums. The keys past the
        cursor are zeroed in place first (they may hold NaN; no key is read after a flush's
        refold). Writes `s_C`, `p_C` and the copy `p_L`; the caller passes a barrier after."""
        MM: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        AX: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MM, k_width=2)
        # the Gram [BL, BL]: warps over its columns (BL is 16 or 32 rows; BV = 16 NW)
        MG: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NW], instr_shape=[16, 8])
        AG: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MG, k_width=2)
        BG: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MG, k_width=2)
        LA: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        hb = gl.minimum(h, BL)
        _zero_keys_past(s_K, hb, BL, NW)
        # the decays: e_j (an inclusive scan), the fold's c_j = exp(ld_{j+1} + .. + ld_{h-1}) and g
        o_l = gl.arange(0, BL, layout=LA)
        b_ldv = gl.load(p_ld + o_l * HV, mask=o_l < hb, other=0.0)
        b_e = gl.exp(gl.associative_scan(b_ldv, 0, _add))
        b_ld1 = gl.load(p_ld + (o_l + 1) * HV, mask=o_l + 1 < hb, other=0.0)
        b_coef, b_g = _record_weights(b_ld1, gl.load(p_ld), 0.0, hb, o_l)
        # the keys' Gram, 32 columns of K a product (a fresh accumulator each, added in fp32),
        # weighted below the diagonal: cf[j, i] = d_ji (k_i . k_j), i < j
        b_G = gl.zeros([BL, BL], gl.float32, MG)
        for k0 in gl.static_range(0, K, 32):
            a0, a1, a2 = _split_bf16(s_K.slice(k0, 32, dim=1).load(AG).to(gl.float32))
            b_G += _mma_exact(a0, a1, a2, s_K.slice(k0, 32, dim=1).permute([1, 0]).load(BG).to(gl.float32),
                              gl.zeros([BL, BL], gl.float32, MG), KP)
        o_jG = gl.arange(0, BL, layout=gl.SliceLayout(1, MG))
        o_iG = gl.arange(0, BL, layout=gl.SliceLayout(0, MG))
        b_D = gl.zeros([BL, BL], gl.float32, MG)
        for m in range(1, hb):
            b_D += gl.where((o_iG[None, :] < m) & (o_jG[:, None] >= m), gl.load(p_ld + m * HV), 0.0)
        s_cf = gl.allocate_shared_memory(gl.float32, [BL, BL], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]),
                                         gl.where(o_iG[None, :] < o_jG[:, None], gl.exp(b_D) * b_G, 0.0))
        # W = C K^T scaled by e_j, its columns through shared memory (selected out of registers
        # they took twice the registers of the rest), then u_j row by row in order (column j of U)
        b_W = _tile_vectors_mma(s_C, s_K, BV, K, BL, KP, NW) * gl.convert_layout(b_e, gl.SliceLayout(0, MM))[None, :]
        s_W = gl.allocate_shared_memory(gl.float32, [BL, BV], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]),
                                        gl.permute(b_W, [1, 0]))
        o_jM = gl.arange(0, BL, layout=gl.SliceLayout(0, MM))
        b_U = gl.zeros([BV, BL], gl.float32, MM)
        _barrier()
        s_cf1 = _rows_view(s_cf, BL, BL)
        s_W1 = _rows_view(s_W, BL, BV)
        s_V1 = _rows_view(s_Vr, BL, BV)
        for j in range(0, hb):
            b_acc = gl.sum(b_U * s_cf1.index(j).load(gl.SliceLayout(0, MM))[None, :], axis=1) + \
                s_W1.index(j).load(gl.SliceLayout(1, MM))
            b_u = gl.load(p_beta + j * HV) * (s_V1.index(j).load(gl.SliceLayout(1, MM)).to(gl.float32) - b_acc)
            b_U = gl.where((o_jM == j)[None, :], b_u[:, None], b_U)
        b_X = gl.convert_layout(b_U * gl.convert_layout(b_coef, gl.SliceLayout(0, MM))[None, :], AX)
        _fold_mma(s_C, b_X, s_K, p_C, b_g, BV, K, BL, KP, NW, p_L, LPT)

    @gluon.jit
    def _write_drafts_beta(b, buf_beta, i_b, slot, n, stride_b_b, stride_b_t, stride_b_h, T: gl.constexpr,
                           HV: gl.constexpr, LBCAP: gl.constexpr, HVP: gl.constexpr, NW: gl.constexpr):
        """With a 16-bit copy, on an early flush, by the slot's last program: every value head's
        beta of drafts `0..n-1` at positions `0..n-1` (the raw records a later flush refolds),
        which the slot's other programs read as committed records until they all arrived."""
        LV: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        o_hv = gl.arange(0, HVP, layout=LV)
        m_hv = o_hv < HV
        for t in gl.static_range(T):
            b_bt = gl.load(b + i_b * stride_b_b + t * stride_b_t + o_hv * stride_b_h, mask=m_hv, other=0.0)
            gl.store(buf_beta + (slot * LBCAP + t) * HV + o_hv, 1.0 / (1.0 + gl.exp(-b_bt.to(gl.float32))),
                     mask=m_hv & (t < n))
