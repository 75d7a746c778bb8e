"""Pieces the Gluon kernels of every family share (ops/mamba2/gluon_decode.py,
ops/gdn/gluon_decode.py): the Triton-version shims, where they apply, and the steps of a
program that do not depend on the family (the tile's copy into shared memory, the early arrival
on the slot's counter, the records' weights, the fold of one row chunk, the cursor's move, the
copy of a verify's key products from the launch before it).
Gluon kernels run on the GPU only; see docs/kernels.md ("The Gluon kernels")."""
from __future__ import annotations

try:  # Gluon ships with recent Triton (3.6 on the H200 machine); without it the Triton kernels run
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    # the copy to shared memory: `async_copy_global_to_shared` in Triton 3.6 (the H200
    # machine's), renamed `async_load` later (the old name then raises)
    _async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    # the program's barrier: `thread_barrier` in Triton 3.6, `barrier` later
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

__all__ = ["HAVE_GLUON", "gluon_record_tile", "gluon_shape_supported"]


def gluon_record_tile(window: int, Lb: int) -> int:
    """Positions in the Gluon kernels' record tiles: 16 for windows up to 16, else 32."""
    return 16 if min(window, Lb) <= 16 else 32


def gluon_shape_supported(V: int, K: int, window: int, Lb: int, BV: int, num_warps: int) -> str:
    """'' when the Gluon kernels' layouts cover this shape and launch config, else why not."""
    if not HAVE_GLUON:
        return "this Triton has no Gluon"
    if K != 128:
        return f"K={K} (the layouts are written for K=128)"
    if BV != 16 * num_warps or V % BV:
        return f"BV={BV} must be 16 * num_warps={16 * num_warps} and divide V={V}"
    if min(window, Lb) > 32:
        return f"window {window}: record tiles of up to 32 positions"
    return ""


if HAVE_GLUON:

    # a shared buffer seen with another shape or layout: `_reinterpret` in Triton 3.6 (the H200
    # machine's), `reinterpret` later
    if hasattr(gl.shared_memory_descriptor, "_reinterpret"):
        @gluon.jit
        def _rows_view(s_X, R: gl.constexpr, N: gl.constexpr):
            """The unswizzled `[R, N]` buffer `s_X` with a layout of one dimension, so that
            `index(i)` gives its row i at a run-time i (an `[N]` buffer; a 2-D layout would stay
            2-D)."""
            return s_X._reinterpret(s_X.dtype, [R, N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        @gluon.jit
        def _rows_view(s_X, R: gl.constexpr, N: gl.constexpr):
            """As above, with the later name."""
            return s_X.reinterpret(s_X.dtype, [R, N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    _NEW_REINTERPRET = gl.constexpr(not hasattr(gl.shared_memory_descriptor, "_reinterpret"))

    @gluon.jit
    def _slot_bases(slot, ckpt, buf_ld, buf_w, buf_k, cursor, pad_ckpt, pad_ld, pad_w, pad_k, pad_cur):
        """`utils.cursor.slot_bases` for the Gluon kernels."""
        return (ckpt + slot * pad_ckpt, buf_ld + slot * pad_ld, buf_w + slot * pad_w, buf_k + slot * pad_k,
                cursor + slot * pad_cur)

    @gluon.jit
    def _softplus(x):
        # as the Triton kernels' softplus (Gluon cannot call Triton functions): max(x, 0) +
        # log1p(exp(-|x|)), log1p by Goldberg's correction
        e = gl.exp(-gl.abs(x))
        p = 1.0 + e
        den = gl.where(p == 1.0, 1.0, p - 1.0)
        l1p = gl.where(p == 1.0, e, gl.log(p) * (e / den))
        return gl.maximum(x, 0.0) + l1p

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _tile_offsets(R: gl.constexpr, C: gl.constexpr, L: gl.constexpr):
        # element offsets of a row-major [R, C] tile, rows C apart, in layout L
        o_r = gl.arange(0, R, layout=gl.SliceLayout(1, L))
        o_c = gl.arange(0, C, layout=gl.SliceLayout(0, L))
        return o_r[:, None] * C + o_c[None, :]

    @gluon.jit
    def _tile_to_shared(p_T, BV: gl.constexpr, K: gl.constexpr, LT: gl.constexpr, SM: gl.constexpr):
        """Start the asynchronous copy of the `[BV, K]` fp32 tile at `p_T` (rows K apart) into
        shared memory, in the 16-byte pieces of LT; returns the shared tile. The barrier after it
        keeps the assembler from scheduling the copies after the cursor's wait."""
        s_T = gl.allocate_shared_memory(gl.float32, [BV, K], SM)
        _async_load(s_T, p_T + _tile_offsets(BV, K, LT), eviction_policy="evict_first")
        cp.commit_group()
        _barrier()
        return s_T

    @gluon.jit
    def _lp_tile_view(s_S, BV: gl.constexpr, K: gl.constexpr, SM: gl.constexpr):
        """The first half of an fp32 `[BV, K]` shared tile seen as an int16 `[BV, K]` tile (a
        16-bit copy's bits, copied there instead of the fp32 rows)."""
        if _NEW_REINTERPRET:
            s_2 = s_S.reinterpret(gl.int16, [2 * BV, K], SM)
        else:
            s_2 = s_S._reinterpret(gl.int16, [2 * BV, K], SM)
        return s_2.slice(0, BV, dim=0)

    @gluon.jit
    def _lp_decode(b, LPT: gl.constexpr):
        # a 16-bit copy's int16 bits (LPT 1 fp16, 2 bf16) as fp32, exactly
        if LPT == 1:
            return b.to(gl.float16, bitcast=True).to(gl.float32)
        else:
            return b.to(gl.bfloat16, bitcast=True).to(gl.float32)

    @gluon.jit
    def _lp_encode(b, LPT: gl.constexpr):
        # fp32 -> fp16 / bf16 round-to-nearest, saturating at the largest finite value (NaN kept),
        # as int16 bits: lowp.store_lp_rows's values
        if LPT == 1:
            big: gl.constexpr = 65504.0
            return gl.where(gl.abs(b) > big, gl.where(b > 0, big, -big), b).to(gl.float16).to(gl.int16, bitcast=True)
        else:
            bigb: gl.constexpr = 3.3895313892515355e38
            return gl.where(gl.abs(b) > bigb, gl.where(b > 0, bigb, -bigb), b).to(gl.bfloat16).to(gl.int16,
                                                                                                 bitcast=True)

    @gluon.jit
    def _draft_count(num_drafts, i_b, h, T: gl.constexpr, HAS_N: gl.constexpr):
        # a row's draft count; unvalidated counts are clamped to 0..T, so that no draft lands
        # past the buffer
        if HAS_N:
            return gl.minimum(gl.maximum(gl.load(num_drafts + i_b), 0), T)
        else:
            return h * 0 + T

    @gluon.jit
    def _arrive_early(arrive, slot, h, LA1: gl.constexpr):
        """Arrive on the slot's counter now (the hand-off of ops/utils/cursor.py): every thread
        stores the cursor it read to shared memory before the barrier, so no thread of this
        program reads the cursor after the arrival (the last program to arrive rewrites it at
        its end, `_move_cursor`); the atomic's reply then overlaps the loads in flight instead of
        ending the program, which measured faster."""
        s_h = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        s_h.store(gl.zeros([1], gl.int32, LA1) + h)
        _barrier()
        return gl.atomic_add(arrive + slot, (h >= 0).to(gl.int32), sem="relaxed")

    @gluon.jit
    def _record_weights(b_ld1, b_ld0, b_ld, h, o_l):
        """The records' weights at cursor h, one position per lane (`o_l`): record j enters with
        `g_{j+1:h} = exp(ld_{j+1} + ... + ld_h)` (a reverse scan of same-signed log decays, never
        a difference of prefix sums), the checkpoint with `g_{0:h}`. `b_ld1` holds `ld_{j+1}` as
        loaded, `b_ld0` the log decay at position 0, `b_ld` the token's. Returns (coef, g)."""
        b_lds = gl.where(o_l + 1 < h, b_ld1, gl.where(o_l + 1 == h, b_ld, 0.0))
        b_sfx = gl.associative_scan(b_lds, 0, _add, reverse=True)
        b_coef = gl.where(o_l < h, gl.exp(b_sfx), 0.0)
        b_g = gl.exp(gl.where(h > 0, b_ld0, b_ld) + gl.sum(b_lds, axis=0))
        return b_coef, b_g

    @gluon.jit
    def _fold_records(b_Tc, o_rc, o_tk, o_lP, b_coefP, h, p_W, p_kj, STRIDE_W: gl.constexpr,
                      STRIDE_K: gl.constexpr, BL: gl.constexpr):
        """A flush's records folded into one row chunk `b_Tc` of the tile: one rank-1 update
        `coef_j w_j k_j^T` per record j < h (exact fp32), unrolled over the BL positions (loads
        masked past the cursor), no layout conversion: `w_j` (rows `o_rc` at `p_W`, positions
        STRIDE_W apart) in the chunk's row layout, `k_j` (at `p_kj`, positions STRIDE_K apart)
        in its column layout, the coefficients held whole by every thread (`b_coefP`)."""
        for j in gl.static_range(BL):
            m_j = j < h
            c_j = gl.sum(gl.where(o_lP == j, b_coefP, 0.0), axis=0)
            w_j = gl.load(p_W + j * STRIDE_W + o_rc, mask=(o_rc >= 0) & m_j, other=0.0).to(gl.float32)
            k_j = gl.load(p_kj + j * STRIDE_K, mask=(o_tk >= 0) & m_j, other=0.0).to(gl.float32)
            b_Tc += (c_j * w_j)[:, None] * k_j[None, :]
        return b_Tc

    @gluon.jit
    def _move_cursor(n_arrived, NPROG: gl.constexpr, is_flush, cursor, epoch, arrive, slot, h):
        """The last of the slot's NPROG programs to arrive moves the cursor: 0 and the next
        epoch on a flush, else h + 1; and re-arms the counter (the end of ops/utils/cursor.py's
        `hand_off`, which a Gluon kernel cannot call)."""
        if n_arrived == NPROG - 1:
            if is_flush:
                gl.store(cursor + slot, 0)
                gl.store(epoch + slot, gl.load(epoch + slot) + 1)
            else:
                gl.store(cursor + slot, (h + 1).to(gl.int32))
            gl.store(arrive + slot, 0)

    @gluon.jit
    def _verify_arrive(arrive, cursor, pending, epoch, slot, h_new, n, flush, NPROG: gl.constexpr):
        """The verify step's hand-off (ops/utils/cursor.py's `verify_hand_off`, which a Gluon
        kernel cannot call): every program arrives at its end, after a barrier over its threads,
        acq_rel, so that all other programs' loads are done when the last one stores; the last
        sets `cursor = h_new`, `pending = n`, on an early flush `epoch += 1`, re-arms the counter,
        and returns True (the caller then writes what the slot's other programs read: on an early
        flush the drafts overwrite committed records at positions 0..n-1). Not the decode's early
        arrival: a verify's last program overwrites records that the others may still read."""
        _barrier()
        n_arrived = gl.atomic_add(arrive + slot, 1, sem="acq_rel")
        last = n_arrived == NPROG - 1
        if last:
            if flush:
                gl.store(epoch + slot, gl.load(epoch + slot) + 1)
            gl.store(cursor + slot, h_new.to(gl.int32))
            gl.store(pending + slot, n.to(gl.int32))
            gl.store(arrive + slot, 0)
        return last

    @gluon.jit
    def _products_to_shared(p_kq, TP: gl.constexpr, BL: gl.constexpr, SM: gl.constexpr, NW: gl.constexpr):
        """Start the asynchronous copy, as one commit group, of a row's key-head products from the
        launch before (`utils.key_products.gdn_verify_key_products`: `[TP, TP]` k_t . k_r and q_t . k_r,
        `[BL, TP]` k_j . k_t and k_j . q_t) into shared memory: no registers held while they land."""
        VG: gl.constexpr = 4 if TP >= 4 else TP
        LG: gl.constexpr = gl.BlockedLayout([1, VG], [32 // (TP // VG), TP // VG], [NW, 1], [1, 0])
        o_r = gl.arange(0, TP, layout=gl.SliceLayout(1, LG))
        o_j = gl.arange(0, BL, layout=gl.SliceLayout(1, LG))
        o_c = gl.arange(0, TP, layout=gl.SliceLayout(0, LG))
        s_Gk = gl.allocate_shared_memory(gl.float32, [TP, TP], SM)
        s_Gq = gl.allocate_shared_memory(gl.float32, [TP, TP], SM)
        s_Zk = gl.allocate_shared_memory(gl.float32, [BL, TP], SM)
        s_Zq = gl.allocate_shared_memory(gl.float32, [BL, TP], SM)
        _async_load(s_Gk, p_kq + (o_r[:, None] * TP + o_c[None, :]))
        _async_load(s_Gq, p_kq + TP * TP + (o_r[:, None] * TP + o_c[None, :]))
        _async_load(s_Zk, p_kq + 2 * TP * TP + (o_j[:, None] * TP + o_c[None, :]))
        _async_load(s_Zq, p_kq + (2 * TP * TP + BL * TP) + (o_j[:, None] * TP + o_c[None, :]))
        cp.commit_group()
        return s_Gk, s_Gq, s_Zk, s_Zq
