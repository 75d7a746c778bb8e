"""Exact fp32 products on the 16-bit tensor cores in Gluon, for the verify kernels' tiles
(ops/mamba2/gluon_verify.py, ops/gdn/gluon_verify.py): the split of ops/utils/dots.py
(`dot_bf16x`) in registers of the MMA operand layouts (`mma_v2`, m16n8k16).

An fp32 value is three bf16 pieces by round-to-nearest, exact for normal values (8 + 8 + 8
significant bits; bf16 has fp32's exponent range). A product keeps the pieces' products down to
2^-16 of the leading one, the leading product in an accumulator of its own, and every K chunk
of at most 32 starts a fresh accumulator that is added into fp32 registers: the tensor cores'
accumulation truncates, and one chain over K = 128 measured biased (docs/verify.md).

A tile read as the A operand is best swizzled in shared memory (`gl.SwizzledSharedLayout(4, 1,
8, [1, 0])` for fp32): the operand layout reads 8 rows of 32 bytes per warp access, and rows
K * 4 bytes apart all start in bank 0 unswizzled (8-way conflicts); 16-byte units XOR-ed with
the row (mod 8) spread them over the 32 banks and keep 16-byte copies and row reads contiguous.
The vectors, read transposed as the B operand, likewise in units of 8 elements
(`gl.SwizzledSharedLayout(8, 1, 8, [1, 0])`, ldmatrix for 16-bit ones).
"""
from __future__ import annotations

from .gluon import HAVE_GLUON

__all__ = ["HAVE_GLUON"]

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from .gluon import _barrier, _lp_encode

    @gluon.jit
    def _split_bf16(x):
        # fp32 x as three bf16 pieces by round-to-nearest, x == p0 + p1 + p2 exactly (dots.py)
        p0 = x.to(gl.bfloat16)
        r = x - p0.to(gl.float32)
        p1 = r.to(gl.bfloat16)
        return p0, p1, (r - p1.to(gl.float32)).to(gl.bfloat16)

    @gluon.jit
    def _mma_exact(a0, a1, a2, b, zero, BP: gl.constexpr):
        """`a @ b` at fp32 accuracy as a fresh value (`dots.dot_bf16x`'s products): `a` as its
        three pieces (`_split_bf16`) in the dot-operand layout, `b` fp32 of BP pieces (its
        16-bit source's `pieces`), `zero` the result's zeros in the MMA layout; the leading
        product in an accumulator of its own, the small ones together, smallest first."""
        b0, b1, b2 = _split_bf16(b)
        lead = mma_v2(a0, b0, zero)
        small = mma_v2(a2, b0, zero)
        if BP > 2:
            small = mma_v2(a0, b2, small)
        if BP > 1:
            small = mma_v2(a1, b1, small)
        small = mma_v2(a1, b0, small)
        if BP > 1:
            small = mma_v2(a0, b1, small)
        return lead + small

    @gluon.jit
    def _key_chunk(p_K, stride_k, o_jB, o_kB, m_B, c0: gl.constexpr):
        """Records' keys `[BL, 32]` from global memory, columns c0.., rows `stride_k` apart, zero
        where `m_B` is off, as stored (`_fold_mma`'s KG)."""
        return gl.load(p_K + (o_jB[:, None] * stride_k + (c0 + o_kB)[None, :]), mask=m_B[:, None], other=0.0)

    @gluon.jit
    def _fold_mma(s_S, b_X, s_K, p_S, b_g, BV: gl.constexpr, K: gl.constexpr, BL: gl.constexpr,
                  KP: gl.constexpr, NW: gl.constexpr, p_L=None, LPT: gl.constexpr = 0, p_K=None, stride_k=0,
                  h=0, KG: gl.constexpr = False, KN: gl.constexpr = 0):
        """The flush's fold on the tensor cores, exact as `utils.gluon_mma._tile_vectors_mma`: per
        chunk of 32 of the tile's columns `C_c <- g C_c + X @ K_c` (`X` `[BV, BL]` fp32 in the
        A operand's layout, the keys `[BL, K]` as stored, KP pieces), the products a fresh value
        added to `g C_c` in fp32 (never accumulated inside the MMA, whose truncation would bias
        the checkpoint), stored to shared memory and to the checkpoint `p_S` (LPT 1 / 2: and
        its round-to-nearest fp16 / bf16 copy to `p_L`). KG: the keys read from global memory
        (`p_K` the first record's, rows `stride_k` apart, zero at and past h and, with KN, past
        the KN positions a record can occupy) straight into the B operand's registers instead of
        from `s_K`, each chunk's load issued before the chunk ahead of it is folded: the shared
        tile's store and load between chunks are a barrier, which a load behind it would wait
        for, one L2 round trip a chunk."""
        MM: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        BO: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MM, k_width=2)
        NC: gl.constexpr = 32
        a0, a1, a2 = _split_bf16(b_X)                    # once for every column chunk
        o_r = gl.arange(0, BV, layout=gl.SliceLayout(1, MM))
        o_c = gl.arange(0, NC, layout=gl.SliceLayout(0, MM))
        if KG:
            o_jB = gl.arange(0, BL, layout=gl.SliceLayout(1, BO))
            o_kB = gl.arange(0, NC, layout=gl.SliceLayout(0, BO))
            # (KN: a cursor past the window is no valid state, but the shared path's copy of NPOS
            # positions never reads past them either)
            m_B = ((o_jB < h) & (o_jB < KN)) if KN else (o_jB < h)
            # one-warp programs of a window of 16 load a chunk ahead; others chunk by chunk (Triton
            # 3.6 with the chunk ahead: Super's 4 warps 80 -> 118 registers, 5 -> 4 programs per SM;
            # Nano-4B at window 32 107 -> 156; Nano-4B at window 16 90 -> 94)
            PRE: gl.constexpr = NW == 1 and BL <= 16
            if PRE:
                b_next = _key_chunk(p_K, stride_k, o_jB, o_kB, m_B, 0)
        for c0 in gl.static_range(0, K, NC):
            if KG:
                if PRE:
                    b = b_next.to(gl.float32)
                    if c0 + NC < K:
                        b_next = _key_chunk(p_K, stride_k, o_jB, o_kB, m_B, c0 + NC)
                else:
                    b = _key_chunk(p_K, stride_k, o_jB, o_kB, m_B, c0).to(gl.float32)
            else:
                b = s_K.slice(c0, NC, dim=1).load(BO).to(gl.float32)
            dS = _mma_exact(a0, a1, a2, b, gl.zeros([BV, NC], gl.float32, MM), KP)
            b_Sc = b_g * s_S.slice(c0, NC, dim=1).load(MM) + dS
            s_S.slice(c0, NC, dim=1).store(b_Sc)
            gl.store(p_S + (o_r[:, None] * K + (c0 + o_c)[None, :]), b_Sc)
            if LPT:
                gl.store(p_L + (o_r[:, None] * K + (c0 + o_c)[None, :]), _lp_encode(b_Sc, LPT))

    @gluon.jit
    def _zero_keys_past(s_K, h, BL: gl.constexpr, NW: gl.constexpr):
        """The key records `s_K` `[BL, K]` (shared) at and past position h set to zero in place,
        barriers on both sides: they may hold anything, NaN too, and 0 * NaN is NaN in a product."""
        LKZ: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
        o_jK = gl.arange(0, BL, layout=gl.SliceLayout(1, LKZ))
        b_Kz = s_K.load(LKZ)
        _barrier()
        s_K.store(gl.where((o_jK < h)[:, None], b_Kz, gl.zeros_like(b_Kz)))
        _barrier()

    @gluon.jit
    def _fold_mma_records(s_S, s_W, s_K, b_coef, h, p_S, b_g, BV: gl.constexpr, K: gl.constexpr,
                          BL: gl.constexpr, KP: gl.constexpr, NW: gl.constexpr, p_K=None, stride_k=0,
                          KG: gl.constexpr = False, KN: gl.constexpr = 0):
        """An early flush's fold on the tensor cores, `C <- g C + sum_{j<h} coef_j w_j k_j^T`, from
        the records' shared copies (`s_W` `[BL, BV]` values, `s_K` `[BL, K]` keys as stored) and
        `b_coef` `[BL]` (any layout, zero at and past h): `X[v, j] = coef_j w_j[v]` formed in the
        A operand's registers (records there may hold NaN, and 0 * NaN is NaN in a product, so
        X and the keys are zeroed there; the keys in place: no key is read after a flush's fold),
        then `_fold_mma`. KG: the keys from global memory (`p_K`, `stride_k`, `KN`; `_fold_mma`'s KG),
        `s_K` unused. The caller passes a barrier before reading `s_S` again."""
        MMX: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        AX: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMX, k_width=2)
        o_jX = gl.arange(0, BL, layout=gl.SliceLayout(0, AX))
        b_coefX = gl.convert_layout(b_coef, gl.SliceLayout(0, AX))
        b_WX = s_W.permute([1, 0]).load(AX).to(gl.float32)                          # [BV, BL]
        b_X = gl.where((o_jX < h)[None, :], b_WX * b_coefX[None, :], 0.0)
        if KG:
            _fold_mma(s_S, b_X, s_K, p_S, b_g, BV, K, BL, KP, NW, p_K=p_K, stride_k=stride_k, h=h, KG=True, KN=KN)
        else:
            _zero_keys_past(s_K, h, BL, NW)
            _fold_mma(s_S, b_X, s_K, p_S, b_g, BV, K, BL, KP, NW)

    @gluon.jit
    def _tile_vectors_mma(s_S, s_X, BV: gl.constexpr, K: gl.constexpr, NQ: gl.constexpr, XP: gl.constexpr,
                          NW: gl.constexpr):
        """The tile `[BV, K]` (fp32, shared) times the vectors `s_X` `[NQ, K]` (shared, as given:
        XP pieces; rows past the drafts zero): `[BV, NQ]` fp32 in the MMA layout
        (`NVMMADistributedLayout` v2, warps over the rows), exact (`_mma_exact`), a K chunk of
        32 a call, each chunk's result added into fp32 registers. `s_X` is best swizzled in
        units of 8 elements (module docstring): read transposed as the B operand, its rows K
        elements apart would fall in one bank group. The caller stages it before its wait for
        the tile, so that no load waits after the tile has landed."""
        MM: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MM, k_width=2)
        BO: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MM, k_width=2)
        y = gl.zeros([BV, NQ], gl.float32, MM)
        for k0 in gl.static_range(0, K, 32):
            a0, a1, a2 = _split_bf16(s_S.slice(k0, 32, dim=1).load(AL))
            b = s_X.slice(k0, 32, dim=1).permute([1, 0]).load(BO).to(gl.float32)
            y += _mma_exact(a0, a1, a2, b, gl.zeros([BV, NQ], gl.float32, MM), XP)
        return y

    @gluon.jit
    def _lp_mma_exact(a0, a1, b, zero, XP: gl.constexpr, LPT: gl.constexpr):
        """`_mma_exact` for a 16-bit copy's pieces: `a0` (and `a1` for fp16, LPT 1) times `b`
        (fp32 of XP pieces), the leading product alone, the small ones smallest first."""
        b0, b1, b2 = _split_bf16(b)
        small = zero
        if XP > 2:
            small = mma_v2(a0, b2, small)
        if LPT == 1:
            if XP > 1:
                small = mma_v2(a1, b1, small)
            small = mma_v2(a1, b0, small)
        if XP > 1:
            small = mma_v2(a0, b1, small)
        return mma_v2(a0, b0, zero) + small

    @gluon.jit
    def _tile_vector_pairs_mma(s_S, s_X, s_Z, BV: gl.constexpr, K: gl.constexpr, NQ: gl.constexpr,
                               XP: gl.constexpr, NW: gl.constexpr, LPT: gl.constexpr = 0, RZ: gl.constexpr = False):
        """`_tile_vectors_mma` for two sets of vectors (`s_X`, `s_Z`) at once: each K chunk of
        the tile is read and split once for both products. `LPT` 1 / 2: the tile is a 16-bit
        copy's (int16 bits, fp16 / bf16): a bf16 value is its one piece, an fp16 value two
        (8 + 3 significant bits, exact), so a chunk takes one or two leading products where an
        fp32 tile takes three pieces (`_lp_mma_exact`). `RZ`: an fp32 tile split by truncation
        (`_split_bf16_rz`; for one-piece vectors, XP 1: every product kept either way)."""
        MM: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MM, k_width=2)
        BO: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MM, k_width=2)
        yx = gl.zeros([BV, NQ], gl.float32, MM)
        yz = gl.zeros([BV, NQ], gl.float32, MM)
        for k0 in gl.static_range(0, K, 32):
            if LPT == 1:
                x = s_S.slice(k0, 32, dim=1).load(AL).to(gl.float16, bitcast=True).to(gl.float32)
                a0 = x.to(gl.bfloat16)
                a1 = (x - a0.to(gl.float32)).to(gl.bfloat16)
            elif LPT == 2:
                a0 = s_S.slice(k0, 32, dim=1).load(AL).to(gl.bfloat16, bitcast=True)
                a1 = a0
            elif RZ:
                a0, a1, a2 = _split_bf16_rz(s_S.slice(k0, 32, dim=1).load(AL))
            else:
                a0, a1, a2 = _split_bf16(s_S.slice(k0, 32, dim=1).load(AL))
            bx = s_X.slice(k0, 32, dim=1).permute([1, 0]).load(BO).to(gl.float32)
            bz = s_Z.slice(k0, 32, dim=1).permute([1, 0]).load(BO).to(gl.float32)
            if LPT:
                yx += _lp_mma_exact(a0, a1, bx, gl.zeros([BV, NQ], gl.float32, MM), XP, LPT)
                yz += _lp_mma_exact(a0, a1, bz, gl.zeros([BV, NQ], gl.float32, MM), XP, LPT)
            else:
                yx += _mma_exact(a0, a1, a2, bx, gl.zeros([BV, NQ], gl.float32, MM), XP)
                yz += _mma_exact(a0, a1, a2, bz, gl.zeros([BV, NQ], gl.float32, MM), XP)
        return yx, yz

    @gluon.jit
    def _split_bf16_rz(x):
        # fp32 x as three bf16 pieces by truncation, x == p0 + p1 + p2 exactly for normal x: p0
        # keeps x's leading 8 significant bits, so the rest r has at most 16 and r's own rest at
        # most 8. Each piece's fp32 value is a mask of the bits, not a convert back (fewer
        # instructions than `_split_bf16`; pieces up to 2^-7 and 2^-15 of x, not 2^-8, 2^-16)
        p0 = x.to(gl.bfloat16, fp_downcast_rounding="rtz")
        r = x - (x.to(gl.int32, bitcast=True) & -65536).to(gl.float32, bitcast=True)
        p1 = r.to(gl.bfloat16, fp_downcast_rounding="rtz")
        r2 = r - (r.to(gl.int32, bitcast=True) & -65536).to(gl.float32, bitcast=True)
        return p0, p1, r2.to(gl.bfloat16)

    @gluon.jit
    def _bf16_products_mma(s_A, s_B, M: gl.constexpr, N: gl.constexpr, K: gl.constexpr, NW: gl.constexpr):
        """`A @ B^T` of 16-bit rows as stored, `s_A` `[M, K]` and `s_B` `[N, K]` (shared, bf16: one
        piece each, so every product is exact), fp32 `[M, N]` in the MMA layout, a fresh
        accumulator per K chunk of 32 added in fp32 (the module docstring)."""
        MM: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MM, k_width=2)
        BO: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MM, k_width=2)
        y = gl.zeros([M, N], gl.float32, MM)
        for k0 in gl.static_range(0, K, 32):
            a = s_A.slice(k0, 32, dim=1).load(AL)
            b = s_B.slice(k0, 32, dim=1).permute([1, 0]).load(BO)
            y += mma_v2(a, b, gl.zeros([M, N], gl.float32, MM))
        return y

    @gluon.jit
    def _records_weights_mma(s_U, s_Z, BV: gl.constexpr, BL: gl.constexpr, NW: gl.constexpr):
        """`U^T Z`: 16-bit records `s_U` `[BL, BV]` (shared, bf16: one piece) times fp32 weights
        `s_Z` `[BL, 8]` (shared; three pieces, `_split_bf16`), fp32 `[BV, 8]` in the MMA layout,
        every product exact, each 16 records a fresh value (the leading products in an
        accumulator of their own) added in fp32."""
        MM: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MM, k_width=2)
        BO: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MM, k_width=2)
        y = gl.zeros([BV, 8], gl.float32, MM)
        for j0 in gl.static_range(0, BL, 16):
            a = s_U.slice(j0, 16, dim=0).permute([1, 0]).load(AL)
            b0, b1, b2 = _split_bf16(s_Z.slice(j0, 16, dim=0).load(BO))
            zero = gl.zeros([BV, 8], gl.float32, MM)
            small = mma_v2(a, b1, mma_v2(a, b2, zero))
            y += mma_v2(a, b0, zero) + small
        return y
