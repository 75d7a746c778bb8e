"""Gated DeltaNet (and Kimi Delta Attention) speculative verification in Gluon, for the GPU only: the contract of
`verify._replay_verify_kernel` (one `(row, value head, V-block)` program, T drafts, outputs only;
docs/state-layout.md, `verify`), organised as the standard-decode Gluon kernel is
(gluon_decode.py: the checkpoint tile copied into shared memory while every other load is in
flight, each layout chosen).

The drafts follow `S_h`, the state after the `h` committed records, with or without an early
flush (after one, `S_h` is the folded checkpoint). With `a_t` draft t's decay:

    S_h x = g C x + sum_{j<h} c_j (k_j . x) u_j           (g, c_j: the records' decay weights)
    P_t x = (a_0 ... a_t) S_h x + sum_{r<t} (a_{r+1} ... a_t) (k_r . x) u_r
    u_t   = beta_t (v_t - P_t k_t)                         (forward substitution over the drafts)
    o_t   = P_t q_t + (k_t . q_t) u_t

for the 2T vectors `x` (the drafts' normalised keys and scaled queries). A program
  1. copies into shared memory the key records of the window, the tile and the u records up
     to the cursor (asynchronous copies), and issues every other load;
  2. forms, while the tile arrives, the drafts' Gram products (`k_t . k_r`, `q_t . k_r`) and
     the records' weighted products with the 2T vectors (`c_j (k_j . x)`), to shared memory;
  3. reads the tile back in row chunks, each once, forming its rows' 2T dots together: in the
     products' layout the drafts sit on 4 lanes and K on the other 8 (a thread holds 8T operand
     values, 16 columns of each row, and a dot ends in 3 shuffles);
  4. adds the records' terms and solves the drafts in order, one row per thread with every
     draft's terms in-thread: a draft reads only the drafts before it (selects, never a
     product with a zero weight), so a poisoned later draft cannot reach an earlier output;
  5. writes the outputs and the drafts' u; on an early flush folds the records into the tile
     (decode's arithmetic: `g C + sum_j c_j u_j k_j^T`, one rank-1 update per record, read
     from shared memory; with `mma` on the tensor cores, exact) and stores the new checkpoint;
  6. hands the cursor over at its end (`utils.gluon._verify_arrive`); on an early flush the
     slot's last program then writes the drafts' decays and keys, which the slot's other
     programs read as committed records until they all arrived.

KDA (`IS_KDA`; `a` `[Bt, T, HV, K]`, `dt_bias` `[HV, K]`, `buf_ld` `[N, Lb, HV, K]`) decays each
key channel, so no weight can be applied after a dot: `S_h = C Diag(g) + sum_j u_j (c_j * k_j)^T`
with `[K]` weights (an in-thread reverse scan over the record decays, copied to shared memory
like the keys), and with `A_t = a_0 ... a_t` per channel

    P_t x = C (g * A_t * x) + sum_{j<h} ((c_j * k_j) . (A_t * x)) u_j + sum_{r<t} ((k_r * a_{r+1} ... a_t) . x) u_r

so the drafts' vectors carry the decays into the same products (the weighted record keys replace
the decays in shared memory, and are what a flush folds in), and the drafts' Gram rows are formed
in order with the earlier drafts' keys kept weighted (`_kda_draft_grams`, before the draft loads
of step 1, while the tile arrives). The solve then takes unit weights.

A pool with an fp16/bf16 copy beside the fp32 checkpoint (`lp_code`; verify_lp.py's
contract) stages the copy's tile for a row without an early flush (half the bytes), and the fp32
tile for a row with one, which it refolds along the HP path before the products (each u_j from
the raw v_j and beta_j: the buffered u came from the copy) and writes to both checkpoints; its
drafts then follow the folded tile alone. The drafts' raw v and beta go behind the cursor.

The CPU interpreter cannot run Gluon (`verify.replay_verify` runs the Triton kernel there); the
GPU tests (tests/test_verify_gluon_gdn.py) compare this one with the reference and the Triton kernel.
"""
from __future__ import annotations

from ..utils.gluon import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

    from ..utils.gluon import (_add, _barrier, _draft_count, _products_to_shared, _record_weights, _rows_view,
                                _slot_bases, _softplus, _tile_to_shared, _verify_arrive)
    from ..utils.gluon_mma import _fold_mma_records, _records_weights_mma, _tile_vector_pairs_mma
    from .gluon_verify_drafts import (_draft_products_mma, _fold_kda, _kda_draft_grams, _records_to_shared,
                                      _refold_lp, _refold_lp_mma, _row_pair_products, _solve_weights,
                                      _stage_keys_queries, _stage_lp_tile, _write_drafts_beta,
                                      _write_drafts_shared, _write_drafts_shared_kda)

__all__ = ["HAVE_GLUON"]


if HAVE_GLUON:

    @gluon.jit
    def _gluon_verify_kernel(
        q, k, v, a, b, A_log, dt_bias, o,
        ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch, arrive, slot_ids, num_drafts, kq,
        ckpt_lp, buf_v, buf_beta,
        pad_ckpt, pad_ld, pad_w, pad_k, pad_cur, pad_pend,
        scale, window,
        stride_q_b, stride_q_t, stride_q_h, stride_k_b, stride_k_t, stride_k_h,
        stride_v_b, stride_v_t, stride_v_h, stride_a_b, stride_a_t, stride_a_h,
        stride_b_b, stride_b_t, stride_b_h,
        T: gl.constexpr, TP: gl.constexpr, TL: gl.constexpr, HV: gl.constexpr, HK: gl.constexpr,
        V: gl.constexpr, K: gl.constexpr, LBCAP: gl.constexpr, BV: gl.constexpr, BL: gl.constexpr,
        RC: gl.constexpr, RCF: gl.constexpr, HVP: gl.constexpr, HKP: gl.constexpr, VW: gl.constexpr,
        VK: gl.constexpr, USE_QK_L2NORM: gl.constexpr, HAS_NDRAFT: gl.constexpr, NW: gl.constexpr,
        IS_KDA: gl.constexpr, KQ: gl.constexpr, MMA: gl.constexpr, XP: gl.constexpr, SWZ: gl.constexpr,
        KP: gl.constexpr, LPT: gl.constexpr, RFL: gl.constexpr, RFM: gl.constexpr, LEAN: gl.constexpr,
    ):
        # Layouts (NW warps, BV = 16 NW rows (32 NW with ROWS = 2), K = 128, TP = T padded to a power of two >= 2):
        # L3  the products [rows, TP, K]: rows over the warps, drafts over TL lanes (TP / TL per
        #     thread), K over the other 32 / TL lanes, 4 columns per piece
        # LD  [TP, K] the drafts' keys and queries as operands (the same on every warp)
        # LR  [rows, K] the tile's row chunks, the record keys and the drafts as rows
        # LO  [rows, TP] their products
        # LS  [BV, TP] the solve: one row per thread, every draft of it in-thread; LY its rows,
        #     LC its drafts (whole in every thread)
        # LT  the tile [BV, K] as copied and folded (4 columns per lane), LA1 [BL] positions one
        #     per lane (the decay scan)
        # LE  (KDA) [BL, K] the records' log decays and weighted keys, every position of a column
        #     in one thread (in-thread scans)
        KL: gl.constexpr = 32 // TL
        L3: gl.constexpr = gl.BlockedLayout([1, TP // TL, 4], [1, TL, KL], [NW, 1, 1], [2, 1, 0])
        LD: gl.constexpr = gl.SliceLayout(0, L3)
        LR: gl.constexpr = gl.SliceLayout(1, L3)
        LO: gl.constexpr = gl.SliceLayout(2, L3)
        LS: gl.constexpr = gl.BlockedLayout([1, TP], [32, 1], [NW, 1], [1, 0])
        LY: gl.constexpr = gl.SliceLayout(1, LS)
        LC: gl.constexpr = gl.SliceLayout(0, LS)
        LT: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
        LA1: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        LE: gl.constexpr = gl.BlockedLayout([BL, 1], [1, 32], [1, NW], [0, 1])
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

        # outputs [BV, TP] in LS: draft t of the row at ((i_b T + t) HV + i_hv) V
        o_y = gl.arange(0, BV, layout=LY)
        o_c = gl.arange(0, TP, layout=LC)
        m_o = (o_y >= 0)[:, None] & (o_c < T)[None, :]
        p_o = o + (i_b * T * HV + i_hv) * V + v0 + o_y[:, None] + (o_c * (HV * V))[None, :]
        slot = gl.load(slot_ids + i_b).to(gl.int64)
        if slot < 0:
            gl.store(p_o, gl.zeros([BV, TP], gl.float32, LS).to(o.dtype.element_ty), mask=m_o)
            return
        # slot-strided state (vLLM's pages): the bases moved by the slot's padding
        ckpt, buf_ld, buf_w, buf_k, cursor = _slot_bases(slot, ckpt, buf_ld, buf_w, buf_k, cursor, pad_ckpt, pad_ld,
                                                         pad_w, pad_k, pad_cur)
        pending += slot * pad_pend

        # 1. to shared memory: the key records over the window (not waiting for the cursor: the
        # products with them are formed while the tile arrives; positions at or past the cursor
        # are selected away), the tile, the u records 0..h-1 (zeros past the cursor); then
        # every other load
        p_C = ckpt + (slot * HV + i_hv) * (V * K) + v0 * K
        p_Kg = buf_k + slot * (LBCAP * HK * K) + i_hk * K
        p_Uh = buf_w + slot * (LBCAP * HV * V) + i_hv * V + v0
        if KQ:
            # (GDN) the key head's products, formed by the launch before: the first copy group
            s_Gk0, s_Gq0, s_Zkr, s_Zqr = _products_to_shared(kq + (i_b * HK + i_hk) * (2 * TP * TP + 2 * BL * TP),
                                                             TP, BL, SM, NW)
        s_K = _records_to_shared(p_Kg, gl.minimum(window, LBCAP), BL, K, HK * K, VK, NW)
        if IS_KDA:
            # the records' log decays, [K] each, shifted (row j: position j + 1), over the window
            # as the keys; the same buffer later holds the weighted keys
            p_ldh = buf_ld + slot * (LBCAP * HV * K) + i_hv * K
            s_LD = _records_to_shared(p_ldh + HV * K, gl.minimum(window, LBCAP) - 1, BL, K, HV * K, 4, NW)
        if LPT:
            # a pool with a 16-bit copy (LPT 1 fp16, 2 bf16; verify_lp.py's contract): a row that
            # flushes refolds the fp32 checkpoint along the HP path (the raw v and beta records),
            # the others' drafts read the copy, half the bytes, staged in the first half of the
            # fp32 tile's shared memory; which one waits for the cursor. The drafts then follow
            # the tile alone (records hr = 0) after a flush, the copy and its records otherwise
            h = gl.load(cursor + slot).to(gl.int32)
            n = _draft_count(num_drafts, i_b, h, T, HAS_NDRAFT).to(gl.int32)
            flush = h + n > window
            p_L = ckpt_lp + (slot * HV + i_hv) * (V * K) + v0 * K
            s_C, s_L = _stage_lp_tile(p_C, p_L, flush, BV, K, LT, SWZ, MMA, NW)
            hc = gl.where(flush, 0, h)
            hr = hc
            s_U = _records_to_shared(p_Uh, hr, BL, BV, HV * V, VW, NW)
            s_Vr = _records_to_shared(buf_v + slot * (LBCAP * HV * V) + i_hv * V + v0, gl.where(flush, h, 0), BL, BV,
                                      HV * V, VW, NW)
        else:
            if MMA:
                # read as the A operand of the tensor cores (the products and the fold): swizzled,
                # utils/gluon_mma.py
                s_C = _tile_to_shared(p_C, BV, K, LT, gl.SwizzledSharedLayout(4, 1, SWZ, [1, 0]))
            else:
                s_C = _tile_to_shared(p_C, BV, K, LT, SM)
            h = gl.load(cursor + slot).to(gl.int32)
            s_U = _records_to_shared(p_Uh, h, BL, BV, HV * V, VW, NW)

            if HAS_NDRAFT:
                # unvalidated counts are clamped to 0..T, so that no draft lands past the buffer
                n = gl.minimum(gl.maximum(gl.load(num_drafts + i_b).to(gl.int32), 0), T)
            else:
                n = h * 0 + T
            flush = h + n > window
            hc = gl.where(flush, 0, h)               # where the drafts' records go (h')
            hr = h                                   # the committed records the drafts follow
        if IS_KDA:
            # 2. (KDA, first: the draft vectors in LD are loaded after it, not held through it)
            # the drafts' Gram rows and running decays, while the tile arrives
            s_Gk = gl.allocate_shared_memory(gl.float32, [TP, TP], SM)
            s_Gq = gl.allocate_shared_memory(gl.float32, [TP, TP], SM)
            s_A = gl.allocate_shared_memory(gl.float32, [TP, K], SM)
            _kda_draft_grams(q, k, a, A_log, dt_bias, p_ldh, i_b, i_hv, i_hk, hc, n,
                             (h + n <= window) & (i_v == 0), scale,
                             stride_q_b, stride_q_t, stride_q_h, stride_k_b, stride_k_t, stride_k_h,
                             stride_a_b, stride_a_t, stride_a_h, s_Gk, s_Gq, s_A,
                             HV, K, LBCAP, TP, USE_QK_L2NORM, NW)

        o_tD = gl.arange(0, TP, layout=gl.SliceLayout(1, LD))
        o_kD = gl.arange(0, K, layout=gl.SliceLayout(0, LD))
        m_D = (o_tD < T)[:, None] & (o_kD >= 0)[None, :]
        b_kD = gl.load(k + i_b * stride_k_b + i_hk * stride_k_h + o_tD[:, None] * stride_k_t + o_kD[None, :],
                       mask=m_D, other=0.0).to(gl.float32)
        b_qD = gl.load(q + i_b * stride_q_b + i_hk * stride_q_h + o_tD[:, None] * stride_q_t + o_kD[None, :],
                       mask=m_D, other=0.0).to(gl.float32)
        if LEAN:
            s_kq = _stage_keys_queries(k, q, i_b, i_hk, stride_k_b, stride_k_t, stride_k_h, stride_q_b, stride_q_t,
                                       stride_q_h, T, K, NW)
            s_kx = s_kq.slice(0, 8, dim=0)
            s_qx = s_kq.slice(8, 8, dim=0)
        elif MMA:
            # the raw keys and queries as the tensor cores' B operands (8 rows, zero past T),
            # staged while the tile is in flight (utils/gluon_mma.py)
            LXN: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
            o_tx = gl.arange(0, 8, layout=gl.SliceLayout(1, LXN))
            o_kx = gl.arange(0, K, layout=gl.SliceLayout(0, LXN))
            m_x = (o_tx < T)[:, None] & (o_kx >= 0)[None, :]
            SWX: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
            s_kx = gl.allocate_shared_memory(k.dtype.element_ty, [8, K], SWX, gl.load(
                k + i_b * stride_k_b + i_hk * stride_k_h + o_tx[:, None] * stride_k_t + o_kx[None, :], mask=m_x,
                other=0.0))
            s_qx = gl.allocate_shared_memory(q.dtype.element_ty, [8, K], SWX, gl.load(
                q + i_b * stride_q_b + i_hk * stride_q_h + o_tx[:, None] * stride_q_t + o_kx[None, :], mask=m_x,
                other=0.0))
        m_c = o_c < T
        b_vr = gl.load(v + i_b * stride_v_b + i_hv * stride_v_h + v0 + o_y[:, None] + (o_c * stride_v_t)[None, :],
                       mask=m_o, other=0.0)
        if not IS_KDA:
            b_ar = gl.load(a + i_b * stride_a_b + i_hv * stride_a_h + o_c * stride_a_t, mask=m_c, other=0.0)
        b_br = gl.load(b + i_b * stride_b_b + i_hv * stride_b_h + o_c * stride_b_t, mask=m_c, other=0.0)
        b_Alog = gl.load(A_log + i_hv).to(gl.float32)
        if not IS_KDA:
            b_dtb = gl.load(dt_bias + i_hv).to(gl.float32)
        o_l = gl.arange(0, BL, layout=LA1)
        p_beta = buf_beta + slot * (LBCAP * HV) + i_hv
        if IS_KDA:
            o_lE = gl.arange(0, BL, layout=gl.SliceLayout(1, LE))
            o_kE = gl.arange(0, K, layout=gl.SliceLayout(0, LE))
            b_ld0 = gl.load(p_ldh + o_kE)
        else:
            p_ldh = buf_ld + slot * (LBCAP * HV) + i_hv
            b_ld1 = gl.load(p_ldh + (o_l + 1) * HV, mask=o_l + 1 < hr, other=0.0)
            b_ld0 = gl.load(p_ldh)

        # the drafts' normalised keys, scaled queries (as verify's _load_qk), log decays
        if USE_QK_L2NORM:
            b_rk = gl.rsqrt(gl.sum(b_kD * b_kD, axis=1) + 1e-6)
            b_rq = gl.rsqrt(gl.sum(b_qD * b_qD, axis=1) + 1e-6)
            b_kD = b_kD * b_rk[:, None]
            b_qD = b_qD * b_rq[:, None]
        b_qD = b_qD * scale
        if LEAN:
            # the factors of the raw vectors' products (_draft_products_mma, the tile's below)
            s_f = gl.allocate_shared_memory(gl.float32, [16], S1)
            if USE_QK_L2NORM:
                s_f.slice(0, TP).store(b_rk)
                s_f.slice(8, TP).store(b_rq * scale)
            else:
                s_f.store(gl.where(gl.arange(0, 16, layout=LA1) < 8, 1.0, scale))
            # the decays once per draft, not in every thread (the same values)
            b_ldc1 = -gl.exp(b_Alog) * _softplus(gl.convert_layout(b_ar, LA1).to(gl.float32) + b_dtb)
            b_ldc = gl.convert_layout(b_ldc1, LC)
        elif not IS_KDA:
            b_ldc = -gl.exp(b_Alog) * _softplus(b_ar.to(gl.float32) + b_dtb)          # [TP] LC

        # without a flush, the drafts' decays (KDA: in the Gram loop below) and keys at h + t now
        # (V-block 0 of the head, of the key head's first value head): no program of this launch
        # reads positions >= h
        sole = (h + n <= window) & (i_v == 0)
        if LEAN:
            o_c1 = gl.arange(0, TP, layout=LA1)
            gl.store(p_ldh + (hc + o_c1) * HV, b_ldc1, mask=(o_c1 < T) & (o_c1 < n) & (hc + o_c1 < LBCAP) & sole)
        elif not IS_KDA:
            gl.store(p_ldh + (hc + o_c) * HV, b_ldc, mask=m_c & (o_c < n) & (hc + o_c < LBCAP) & sole)
        if i_hv % HG == 0:
            p_kh = p_Kg + ((hc + o_tD) * (HK * K))[:, None] + o_kD[None, :]
            m_kh = m_D & ((o_tD < n) & (hc + o_tD < LBCAP))[:, None] & sole
            gl.store(p_kh, b_kD.to(p_kh.dtype.element_ty), mask=m_kh)

        if IS_KDA:
            b_g = 1.0
            # once the record keys and decays have landed (the tile and the u may still be in
            # flight), per channel: record j's weight c_j = exp(ld_{j+1} + ... + ld_{h-1}) (an
            # in-thread reverse scan of same-signed log decays, never a difference of prefix sums),
            # the checkpoint's g = exp(ld_0 + ... + ld_{h-1}): S_h = C Diag(g) + sum_j u_j (c_j k_j)^T;
            # the weighted keys (zero at or past the cursor: selects) replace the decays. (h: hr, the
            # records the drafts follow, none after a copy pool's refold)
            cp.wait_group(3 if LPT else 2)           # (a copy's raw v records: one group more)
            _barrier()
            b_lds = gl.where((o_lE + 1 < hr)[:, None], s_LD.load(LE), 0.0)
            b_gE = gl.exp(gl.where(hr > 0, b_ld0, 0.0) + gl.sum(b_lds, axis=0))          # [K]
            b_Kw = gl.where((o_lE < hr)[:, None], s_K.load(LE).to(gl.float32) *
                            gl.exp(gl.associative_scan(b_lds, 0, _add, reverse=True)), 0.0)
            _barrier()
            s_Kw = s_LD
            s_Kw.store(b_Kw)
            _barrier()
            # the drafts' vectors decayed to their own position (x_t a_0 ... a_t), so that S_h's
            # terms need no weight
            b_AD = gl.where((o_tD < n)[:, None], s_A.load(LD), 0.0)      # rows past n: unwritten
            b_kD = b_kD * b_AD
            b_qD = b_qD * b_AD
            # the records' products with the 2T vectors: [j, t] = (c_j * k_j) . (x_t * a_0 ... a_t)
            s_Zk = gl.allocate_shared_memory(gl.float32, [BL, TP], SM)
            s_Zq = gl.allocate_shared_memory(gl.float32, [BL, TP], SM)
            _row_pair_products(s_Kw, b_kD, b_qD, s_Zk, s_Zq, BL, NW, LR, 0)
            # and the checkpoint's products take g too: C (g * a_0 ... a_t * x_t)
            b_gD = gl.convert_layout(b_gE, gl.SliceLayout(0, LD))[None, :]
            b_kD = b_kD * b_gD
            b_qD = b_qD * b_gD
        else:
            # 2. the records' weights at the cursor (c_j, zero past it; g), to shared memory
            b_coef, b_g = _record_weights(b_ld1, b_ld0, 0.0, hr, o_l)
            s_c = gl.allocate_shared_memory(gl.float32, [BL], S1)
            s_c.store(b_coef)
            # and repeated over RCF rows for the flush's fold, which takes c_j by a runtime index
            LF: gl.constexpr = gl.BlockedLayout([1, RCF], [32, 1], [NW, 1], [1, 0])
            s_cR = gl.allocate_shared_memory(gl.float32, [BL, RCF], SM)
            s_cR.store(gl.convert_layout(b_coef, gl.SliceLayout(1, LF))[:, None] + gl.zeros([BL, RCF], gl.float32, LF))
            # the drafts' Gram products: [t, r] = k_t . k_r and q_t . k_r (KQ: copied from the
            # launch before, utils/key_products.py, as are the records' products)
            if KQ:
                s_Gk = s_Gk0
                s_Gq = s_Gq0
            elif LEAN:
                s_G = gl.allocate_shared_memory(gl.float32, [2 * TP, TP], SM)     # (below, on the tensor cores)
            else:
                s_Gk = gl.allocate_shared_memory(gl.float32, [TP, TP], SM)
                s_Gq = gl.allocate_shared_memory(gl.float32, [TP, TP], SM)
                b_kR = gl.convert_layout(b_kD, LR)
                s_Gk.store(gl.sum(b_kR[:, None, :] * b_kD[None, :, :], axis=2))
                b_qR = gl.convert_layout(b_qD, LR)
                s_Gq.store(gl.sum(b_qR[:, None, :] * b_kD[None, :, :], axis=2))
            # the records' products with the 2T vectors, weighted: [j, t] = c_j (k_j . x_t) (zero at
            # or past the cursor: a select), once the keys have landed (the tile and the u may still
            # be in flight)
            if LPT:
                cp.wait_group(3)                     # (the raw v records' group after the u's)
            else:
                cp.wait_group(2)
            _barrier()
            s_Zk = gl.allocate_shared_memory(gl.float32, [BL, TP], SM)
            s_Zq = gl.allocate_shared_memory(gl.float32, [BL, TP], SM)
            if LEAN:
                _draft_products_mma(s_kq, s_K, s_c, s_f, hr, s_G, s_Zk, s_Zq, BL, K, NW)
            else:
                o_jO = gl.arange(0, NW, layout=gl.SliceLayout(1, LO))
                for j0 in gl.static_range(0, BL, NW):
                    b_cj = s_c.slice(j0, NW).load(gl.SliceLayout(1, LO))[:, None]
                    m_jO = ((j0 + o_jO) < hr)[:, None]
                    if KQ:
                        # (landed with the first copy group, which the wait above covers)
                        b_zk = s_Zkr.slice(j0, NW, dim=0).load(LO)
                        b_zq = s_Zqr.slice(j0, NW, dim=0).load(LO)
                    else:
                        b_Kj = s_K.slice(j0, NW, dim=0).load(LR).to(gl.float32)[:, None, :]
                        b_zk = gl.sum(b_Kj * b_kD[None, :, :], axis=2)
                        b_zq = gl.sum(b_Kj * b_qD[None, :, :], axis=2)
                    s_Zk.slice(j0, NW, dim=0).store(gl.where(m_jO, b_cj * b_zk, 0.0))
                    s_Zq.slice(j0, NW, dim=0).store(gl.where(m_jO, b_cj * b_zq, 0.0))

        # 3. C x for the 2T vectors, RC rows at a time, each chunk of the tile read once
        cp.wait_group(0)
        _barrier()
        if LPT:
            if flush:
                if RFM:
                    _refold_lp_mma(s_C, s_K, s_Vr, p_ldh, p_beta, h, p_C, p_L, BV, K, BL, HV, KP, NW, LPT)
                else:
                    _refold_lp(s_C, s_K, s_Vr, p_ldh, p_beta, h, p_C, p_L, BV, K, BL, RFL, HV, LT, LPT, IS_KDA)
                _barrier()
        if MMA:
            # on the tensor cores, exact (utils/gluon_mma.py): the tile times the drafts' raw
            # keys and queries as given, the norms and scale applied to the products' columns
            MM: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
            o_nM = gl.arange(0, 8, layout=gl.SliceLayout(0, MM))
            f_k = gl.zeros([8], gl.float32, gl.SliceLayout(0, MM)) + 1.0
            f_q = f_k * scale
            if LEAN:
                f_k = s_f.slice(0, 8).load(gl.SliceLayout(0, MM))
                f_q = s_f.slice(8, 8).load(gl.SliceLayout(0, MM))
            elif USE_QK_L2NORM:
                for t in gl.static_range(TP):
                    on = o_nM == t
                    f_k = gl.where(on, gl.sum(gl.where(o_tD == t, b_rk, 0.0), axis=0), f_k)
                    f_q = gl.where(on, scale * gl.sum(gl.where(o_tD == t, b_rq, 0.0), axis=0), f_q)
            s_Yk8 = gl.allocate_shared_memory(gl.float32, [BV, 8], SM)
            s_Yq8 = gl.allocate_shared_memory(gl.float32, [BV, 8], SM)
            if LPT:
                if flush:
                    b_Yk, b_Yq = _tile_vector_pairs_mma(s_C, s_kx, s_qx, BV, K, 8, XP, NW, 0, LEAN)
                else:
                    b_Yk, b_Yq = _tile_vector_pairs_mma(s_L, s_kx, s_qx, BV, K, 8, XP, NW, LPT)
            else:
                b_Yk, b_Yq = _tile_vector_pairs_mma(s_C, s_kx, s_qx, BV, K, 8, XP, NW, 0, LEAN)
            if LEAN:
                # g C x and the records' terms together: U^T Z on the tensor cores too
                s_Yk8.store(b_g * (b_Yk * f_k[None, :]) + _records_weights_mma(s_U, s_Zk, BV, BL, NW))
                s_Yq8.store(b_g * (b_Yq * f_q[None, :]) + _records_weights_mma(s_U, s_Zq, BV, BL, NW))
            else:
                s_Yk8.store(b_Yk * f_k[None, :])
                s_Yq8.store(b_Yq * f_q[None, :])
            if LEAN:
                s_W = gl.allocate_shared_memory(gl.float32, [2 * TP, TP], SM)
                s_v = gl.allocate_shared_memory(gl.float32, [2 * TP], S1)
                _solve_weights(b_ldc, s_G, s_W, s_v, TP, LC, NW)
            s_Yk = s_Yk8.slice(0, TP, dim=1)
            s_Yq = s_Yq8.slice(0, TP, dim=1)
        else:
            s_Yk = gl.allocate_shared_memory(gl.float32, [BV, TP], SM)
            s_Yq = gl.allocate_shared_memory(gl.float32, [BV, TP], SM)
            if LPT:
                if flush:
                    _row_pair_products(s_C, b_kD, b_qD, s_Yk, s_Yq, BV, RC, LR, 0)
                else:
                    _row_pair_products(s_L, b_kD, b_qD, s_Yk, s_Yq, BV, RC, LR, LPT)
            else:
                _row_pair_products(s_C, b_kD, b_qD, s_Yk, s_Yq, BV, RC, LR, 0)
        _barrier()

        # S_h x = g C x + sum_{j<h} c_j (k_j . x) u_j, per row and draft (on a flush too: the
        # drafts follow the folded checkpoint, which is this)
        if LEAN:
            b_Sk = s_Yk.load(LS)                     # (all of it formed on the tensor cores)
            b_Sq = s_Yq.load(LS)
            s_U1 = _rows_view(s_U, BL, BV)
            hb = gl.minimum(hr, BL)
        else:
            b_Sk = b_g * s_Yk.load(LS)
            b_Sq = b_g * s_Yq.load(LS)
            s_U1 = _rows_view(s_U, BL, BV)
            s_Zk1 = _rows_view(s_Zk, BL, TP)
            s_Zq1 = _rows_view(s_Zq, BL, TP)
            hb = gl.minimum(hr, BL)                  # (a bad cursor past the window reads no further)
            for j in range(0, hb):
                b_uj = s_U1.index(j).load(LY).to(gl.float32)[:, None]
                b_Sk += b_uj * s_Zk1.index(j).load(LC)[None, :]
                b_Sq += b_uj * s_Zq1.index(j).load(LC)[None, :]

        # 4. the drafts in order. lw[r]: log decay from draft r + 1 to the current one (reset
        # when r is solved, as verify.py's b_La); lb: from draft 0 to the current one
        if LEAN:
            b_bet = gl.convert_layout(1.0 / (1.0 + gl.exp(-gl.convert_layout(b_br, LA1).to(gl.float32))), LC)
        else:
            b_bet = 1.0 / (1.0 + gl.exp(-b_br.to(gl.float32)))
        b_V = b_vr.to(gl.float32)
        b_lw = gl.zeros([TP], gl.float32, LC)
        b_lb = gl.sum(b_lw, axis=0)
        b_Ud = gl.zeros([BV, TP], gl.float32, LS)
        b_O = gl.zeros([BV, TP], gl.float32, LS)
        if LEAN:
            # (the loop's factors formed once: _solve_weights)
            s_W1 = _rows_view(s_W, 2 * TP, TP)
            b_gv = s_v.slice(0, TP).load(LC)
            b_kqv = s_v.slice(TP, TP).load(LC)
        else:
            s_Gk1 = _rows_view(s_Gk, TP, TP)
            s_Gq1 = _rows_view(s_Gq, TP, TP)
        for t in gl.static_range(T):
            is_t = o_c == t
            col = is_t[None, :]
            if LEAN:
                g_t = gl.sum(gl.where(is_t, b_gv, 0.0), axis=0)
            elif IS_KDA:
                # KDA's decays are in the products (Gram rows, decayed vectors): unit weights
                g_t = 1.0
                b_w = 1.0
            else:
                ld_t = gl.sum(gl.where(is_t, b_ldc, 0.0), axis=0)
                b_lw = b_lw + ld_t
                b_lb = b_lb + ld_t
                g_t = gl.exp(b_lb)
            beta_t = gl.sum(gl.where(is_t, b_bet, 0.0), axis=0)
            if LEAN:
                kq_t = gl.sum(gl.where(is_t, b_kqv, 0.0), axis=0)
                w_k = s_W1.index(t).load(LC)[None, :]
                w_q = s_W1.index(TP + t).load(LC)[None, :]
            else:
                b_gk = s_Gk1.index(t).load(LC)
                b_gq = s_Gq1.index(t).load(LC)
                kq_t = gl.sum(gl.where(is_t, b_gq, 0.0), axis=0)
                if not IS_KDA:
                    b_w = gl.exp(b_lw)
                before = o_c < t
                w_k = gl.where(before, b_w * b_gk, 0.0)[None, :]
                w_q = gl.where(before, b_w * b_gq, 0.0)[None, :]
            b_Pk = g_t * gl.sum(gl.where(col, b_Sk, 0.0), axis=1) + gl.sum(b_Ud * w_k, axis=1)
            b_u = beta_t * (gl.sum(gl.where(col, b_V, 0.0), axis=1) - b_Pk)
            b_Pq = g_t * gl.sum(gl.where(col, b_Sq, 0.0), axis=1) + gl.sum(b_Ud * w_q, axis=1)
            b_Ud = gl.where(col, b_u[:, None], b_Ud)
            b_O = gl.where(col, (b_Pq + kq_t * b_u)[:, None], b_O)
            if not IS_KDA:
                if not LEAN:
                    b_lw = gl.where(is_t, 0.0, b_lw)
        m_n = (o_c < n)[None, :]
        gl.store(p_o, gl.where(m_n, b_O, 0.0).to(o.dtype.element_ty), mask=m_o)

        # 5. the drafts' u at h' + t (< LBCAP guards other slots against a bad cursor): on a
        # flush over records 0..n-1 of this program's rows, which it reads from shared memory
        p_w = p_Uh + o_y[:, None] + ((hc + o_c) * (HV * V))[None, :]
        gl.store(p_w, b_Ud.to(p_w.dtype.element_ty), mask=m_o & m_n & (hc + o_c < LBCAP)[None, :])
        if LPT:
            # the raw records a later flush refolds: v likewise, beta as the decays (below: sole)
            p_vw = buf_v + slot * (LBCAP * HV * V) + i_hv * V + v0 + o_y[:, None] + ((hc + o_c) * (HV * V))[None, :]
            gl.store(p_vw, b_vr.to(p_vw.dtype.element_ty), mask=m_o & m_n & (hc + o_c < LBCAP)[None, :])
            gl.store(p_beta + (hc + o_c) * HV, b_bet, mask=m_c & (o_c < n) & (hc + o_c < LBCAP) & sole)
        # 6. an early flush: C <- g C + sum_{j<h} c_j u_j k_j^T, RCF rows of the tile at a time
        # (the arithmetic of utils.gluon._fold_records, one rank-1 update per record, but a
        # loop to the cursor: unrolled over the window, its loads were hoisted into registers),
        # stored as the new checkpoint. KDA: C <- C Diag(g) + sum_{j<h} u_j (c_j * k_j)^T, the
        # weighted keys from shared memory
        if LPT:
            pass                                     # (the refold above wrote both checkpoints)
        elif IS_KDA:
            if flush:
                _fold_kda(s_C, s_U1, s_Kw, b_gE, hb, p_C, BV, K, BL, RCF, LT)
        elif MMA:
            if flush:
                # on the tensor cores, exact (utils.gluon_mma._fold_mma_records): at Qwen3.5-4B's
                # shape, T = 8, it took the all-accepted step from 1.53x to 1.43x a conventional one
                _fold_mma_records(s_C, s_U, s_K, b_coef, hb, p_C, b_g, BV, K, BL, KP, NW)
        else:
            if flush:
                o_tk = gl.arange(0, K, layout=gl.SliceLayout(0, LT))
                s_K1 = _rows_view(s_K, BL, K)
                s_cR1 = _rows_view(s_cR, BL, RCF)
                for r0 in gl.static_range(0, BV, RCF):
                    o_rc = r0 + gl.arange(0, RCF, layout=gl.SliceLayout(1, LT))
                    b_Cc = b_g * s_C.slice(r0, RCF, dim=0).load(LT)
                    # the records from shared memory, one at a time (c_j repeated over the rows)
                    for jf in range(0, hb):
                        b_cw = s_cR1.index(jf).load(gl.SliceLayout(1, LT)) * \
                            s_U1.index(jf).slice(r0, RCF).load(gl.SliceLayout(1, LT)).to(gl.float32)
                        b_Cc += b_cw[:, None] * s_K1.index(jf).load(gl.SliceLayout(0, LT)).to(gl.float32)[None, :]
                    gl.store(p_C + o_rc[:, None] * K + o_tk[None, :], b_Cc)

        # the hand-off; on a flush the slot's last program writes the drafts' decays and keys
        last = _verify_arrive(arrive, cursor, pending, epoch, slot, hc, n, flush, HV * NVB)
        if last & flush:
            if IS_KDA:
                _write_drafts_shared_kda(k, a, A_log, dt_bias, buf_ld, buf_k, i_b, slot, n,
                                         stride_k_b, stride_k_t, stride_k_h, stride_a_b, stride_a_t, stride_a_h,
                                         T, HV, HK, K, LBCAP, USE_QK_L2NORM, NW)
            else:
                _write_drafts_shared(k, a, A_log, dt_bias, buf_ld, buf_k, i_b, slot, n,
                                     stride_k_b, stride_k_t, stride_k_h, stride_a_b, stride_a_t, stride_a_h,
                                     T, HV, HK, K, LBCAP, HVP, HKP, USE_QK_L2NORM, NW)
            if LPT:
                _write_drafts_beta(b, buf_beta, i_b, slot, n, stride_b_b, stride_b_t, stride_b_h, T, HV, LBCAP, HVP, NW)
