"""Gluon reads of a low-precision checkpoint (the parts of ops/utils/lowp.py: fp16, bf16, scaled
fp8-e4m3, NVFP4) for the Gluon kernels of the steady rows (ops/<family>/gluon_lowp.py): a head's
tile of raw bytes copied asynchronously into shared memory in 16-byte pieces, then read back in
row chunks and decoded while its products with a vector are formed.

Decoding is exact (`formats.decode`'s values), so hardware conversions serve where the H200 has
them: fp16 and bf16 elements, fp8-e4m3 elements and NVFP4's e4m3 block scales by converts. The
e2m1 codes, which it cannot convert, are placed into fp16 bits two codes per 32-bit word: nibble
`n` becomes `((n & 7) << 9) | ((n & 8) << 12)`, the fp16 of `e2m1(n) * 2**-14` (code 1, 0.5, is
the subnormal `2**-15`), so four shifts and masks of a word of eight codes give four words of two
fp16 halves each (`E2M1_PAIRS`). Scales multiply partial sums rather than elements: a row's dot
product is `sum_k value_k v_k`, with `value_k = e4m3_k * scale_row` (fp8) or `e2m1_k * block_k *
tensor` (NVFP4) exact products, so `scale_row * sum_k e4m3_k v_k` and `tensor * 2**14 * sum_b
block_b sum_{k in b} (e2m1_k 2**-14) v_k` are the same sums in another order (the outputs differ
from the Triton kernels' in rounding only; nothing these kernels write depends on it).

Layouts (NW warps, K = 128; the tile holds BV = 16 * NW rows):
  fp16/bf16  int16 `[BV, K]`, copied 8 per piece; read back 4 rows per warp and chunk, 16
             elements per thread in two pieces
  fp8        uint8 `[BV, K]`, 16 per piece; read back 4 rows per warp, one piece per thread
  NVFP4      int32 words `[BV, K / 8]` (eight codes each), 4 per piece; read back as `[RC, 8, 2]`
             (row, block of 16 codes, word), 8 rows per warp, a thread's two blocks of a row in
             one piece, so that a block's sum and its scale stay in-thread
In every read a quarter-warp reads 128 contiguous bytes: no bank conflicts.

Gluon kernels run on the GPU only (the interpreter cannot run them).
"""
from __future__ import annotations

import os

from .gluon import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    from .gluon import _async_load, _barrier
    from .gluon_mma import _split_bf16

    # a shared tile seen with another dtype or shape: `_reinterpret` in Triton 3.6 (the H200
    # machine's), `reinterpret` later
    _NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

__all__ = ["HAVE_GLUON", "GLUON_LP_CODES", "E2M1_PAIRS", "e2m1_pair_bits", "lp_gluon_views", "lp_launch_rows",
           "lp_row_chunk"]

# the read formats of the steady-row kernels (lowp.LP_CODES)
GLUON_LP_CODES = (1, 2, 3, 4)
# REPLAYSSM_GLUON_LP_READ_MMA=1 (experimental, off: not yet run on a GPU): the steady rows' fp16,
# bf16 and fp8 reads summed on the tensor cores (`lp_row_sums_mma`), read at each launch
READ_MMA = os.environ.get("REPLAYSSM_GLUON_LP_READ_MMA") == "1"
# REPLAYSSM_GLUON_LP_ROWS=m (experimental; 1, the default): m times the rows per thread of the
# steady-row kernels' reads (`lp_launch_rows`), read at each launch
_ROWS = os.environ.get("REPLAYSSM_GLUON_LP_ROWS", "1")
if not _ROWS.isdigit() or int(_ROWS) < 1 or int(_ROWS) & (int(_ROWS) - 1):
    raise ValueError(f"REPLAYSSM_GLUON_LP_ROWS={_ROWS!r}: a power of two (rows per thread)")
ROWS = int(_ROWS)
# NVFP4 word -> fp16 pairs: (shift, left?) of the code bits and of the sign bits; pair i holds code
# i of the word in its low half and code i + 4 in its high half (byte j's low nibble is code 2j)
E2M1_PAIRS = ((9, 12), (5, 8), (1, 4), (-3, 0))
_CODE_MASK = 0x0E000E00
_SIGN_MASK = -0x7FFF8000          # 0x80008000 as an int32


def e2m1_pair_bits(word: int, i: int) -> int:
    """The fp16 pair `i` (0..3) of an NVFP4 word of eight codes (uint32 as a Python int), with the
    shifts of `_e2m1_word_dot` (`E2M1_PAIRS`): low half code `i`, high half code `i + 4`, each
    `e2m1 * 2**-14` in fp16."""
    sc, ss = E2M1_PAIRS[i]
    w = word & 0xFFFFFFFF
    code = (w << sc) if sc >= 0 else (w >> -sc)
    sign = (w << ss) if ss >= 0 else (w >> -ss)
    return ((code & _CODE_MASK) | (sign & (_SIGN_MASK & 0xFFFFFFFF))) & 0xFFFFFFFF


def lp_gluon_views(lp_data, lp_code: int):
    """The LP elements as the Gluon kernels copy them: fp16/bf16 and fp8 as lowp's integer views
    (int16, uint8), NVFP4's packed bytes as int32 words `[N, HV, V, K / 8]`."""
    import torch
    return lp_data.view(torch.int32) if lp_code == 4 else lp_data


def lp_launch_rows(BV: int, V: int, lp_code: int, rows=None):
    """`(BV, num_warps)` of a steady-row launch whose config says `BV` rows in `BV / 16` warps,
    with `rows` (None: `ROWS` at the call) times the rows per thread: the block grows while it
    divides V, then the warps shrink. A program's per-row work is then shared by more rows (the
    cursor, the token's vectors and key products, the records' weights: the instructions that
    keep fp8 reads off their byte bound). NVFP4's read-back then takes the tile as one chunk."""
    rows = ROWS if rows is None else int(rows)
    nw = max(1, BV // 16)
    while rows > 1 and 2 * BV <= V and V % (2 * BV) == 0:
        BV, rows = 2 * BV, rows // 2
    while rows > 1 and nw > 1:
        nw, rows = nw // 2, rows // 2
    return BV, nw


def lp_row_chunk(lp_code: int, num_warps: int) -> int:
    """Rows per chunk of the tile's read-back: 4 per warp, NVFP4 8 (a tile is two chunks)."""
    return (8 if lp_code == 4 else 4) * num_warps


if HAVE_GLUON:

    @gluon.jit
    def _copy_to_shared(p_T, R: gl.constexpr, C: gl.constexpr, LT: gl.constexpr):
        """Start the asynchronous copy of the `[R, C]` tile at `p_T` (rows C elements apart) into
        shared memory in LT's pieces; returns the shared tile (the barrier keeps the assembler
        from scheduling the copies after the cursor's wait)."""
        o_r = gl.arange(0, R, layout=gl.SliceLayout(1, LT))
        o_c = gl.arange(0, C, layout=gl.SliceLayout(0, LT))
        s_T = gl.allocate_shared_memory(p_T.dtype.element_ty, [R, C], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        _async_load(s_T, p_T + (o_r[:, None] * C + o_c[None, :]), eviction_policy="evict_first")
        cp.commit_group()
        _barrier()
        return s_T

    @gluon.jit
    def lp_tile_to_shared(p_T, BV: gl.constexpr, K: gl.constexpr, LP: gl.constexpr, NW: gl.constexpr,
                          MMA: gl.constexpr = False):
        """Start copying the `[BV, K]` LP tile whose first row is at `p_T` (in the element type of
        `lp_gluon_views`: int16, uint8, int32 words) into shared memory; returns the shared tile.
        The caller waits for it (`cp.wait_group(0)` and a barrier) before `lp_row_sums`. `MMA`:
        a 16-bit tile swizzled as the tensor cores read it (`lp_row_sums_mma`)."""
        if MMA and LP < 4:
            # 16-byte units XOR-ed with the row (mod 8): the operand reads of 8 or 16 rows at one
            # column spread over the banks (rows K elements apart all start in bank 0)
            VEC: gl.constexpr = 16 if LP == 3 else 8
            LT: gl.constexpr = gl.BlockedLayout([1, VEC], [2 * VEC // 8, 32 // (2 * VEC // 8)], [NW, 1], [1, 0])
            o_r = gl.arange(0, BV, layout=gl.SliceLayout(1, LT))
            o_c = gl.arange(0, K, layout=gl.SliceLayout(0, LT))
            s_T = gl.allocate_shared_memory(p_T.dtype.element_ty, [BV, K], gl.SwizzledSharedLayout(VEC, 1, 8, [1, 0]))
            _async_load(s_T, p_T + (o_r[:, None] * K + o_c[None, :]), eviction_policy="evict_first")
            cp.commit_group()
            _barrier()
            return s_T
        elif LP == 4:
            return _copy_to_shared(p_T, BV, K // 8, gl.BlockedLayout([1, 4], [8, 4], [NW, 1], [1, 0]))
        elif LP == 3:
            return _copy_to_shared(p_T, BV, K, gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0]))
        else:
            return _copy_to_shared(p_T, BV, K, gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0]))

    @gluon.jit
    def lp_vector(b_vK, p_v, K: gl.constexpr, LP: gl.constexpr, NW: gl.constexpr, GATHER: gl.constexpr):
        """A vector `v` `[K]` in the form `lp_row_sums` takes it: fp16/bf16/fp8 `b_vK` (fp32, any
        layout) converted to the read-back's column layout; NVFP4 a shared `[8, K / 8]` table,
        `t[i, w] = v[8 w + i]` (code i of word w), gathered from `p_v` (fp32 or any float type;
        `GATHER`) or, where `v` is not in memory (KDA's vectors scaled per channel), rearranged
        from `b_vK` in registers; read by `lp_row_sums` after the caller's barrier."""
        if LP == 4:
            LQ: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [NW, 1], [1, 0])
            if GATHER:
                o_i = gl.arange(0, 8, layout=gl.SliceLayout(1, LQ))
                o_w = gl.arange(0, K // 8, layout=gl.SliceLayout(0, LQ))
                b_t = gl.load(p_v + (o_w[None, :] * 8 + o_i[:, None])).to(gl.float32)
            else:
                b_t = gl.convert_layout(gl.permute(gl.reshape(b_vK, [K // 8, 8]), [1, 0]), LQ)
            s_t = gl.allocate_shared_memory(gl.float32, [8, K // 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
            s_t.store(b_t)
            return s_t
        elif LP == 3:
            return gl.convert_layout(b_vK, gl.SliceLayout(0, gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])))
        else:
            return gl.convert_layout(b_vK, gl.SliceLayout(0, gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])))

    @gluon.jit
    def lp_block_scales(lp_scale, i_m, r0, V: gl.constexpr, K: gl.constexpr, RC: gl.constexpr,
                        NW: gl.constexpr):
        """NVFP4: the e4m3 block scales of rows `r0 .. r0 + RC - 1` of head matrix `i_m`, raw
        (uint8 `[RC, K / 16]`, in the layout of a chunk's block sums); issue early, decode with
        `e4m3_to_f32`."""
        LS: gl.constexpr = gl.SliceLayout(2, gl.BlockedLayout([1, 2, 2], [8, 4, 1], [NW, 1, 1], [2, 1, 0]))
        o_r = r0 + gl.arange(0, RC, layout=gl.SliceLayout(1, LS))
        o_b = gl.arange(0, K // 16, layout=gl.SliceLayout(0, LS))
        return gl.load(lp_scale + i_m * (V * (K // 16)) + o_r[:, None] * (K // 16) + o_b[None, :])

    @gluon.jit
    def lp_tile_scales(lp_scale, i_m, v0, V: gl.constexpr, K: gl.constexpr, BV: gl.constexpr, NW: gl.constexpr):
        """NVFP4: the block scales `lp_row_sums` takes for the tile of rows `v0 .. v0 + BV - 1` of head
        matrix `i_m` (`lp_block_scales`): its two row chunks of 8 per warp, or with more rows a
        thread (`lp_launch_rows`) the whole tile's at once and 0."""
        RC4: gl.constexpr = 8 * NW
        if BV > 2 * RC4:
            return lp_block_scales(lp_scale, i_m, v0, V, K, BV, NW), 0
        else:
            return (lp_block_scales(lp_scale, i_m, v0, V, K, RC4, NW),
                    lp_block_scales(lp_scale, i_m, v0 + RC4, V, K, RC4, NW))

    @gluon.jit
    def e4m3_to_f32(b):
        """e4m3 ("fn") bits (uint8) to fp32 by the hardware convert: exact, NaN for 0x7F/0xFF."""
        return b.to(gl.float8e4nv, bitcast=True).to(gl.float32)

    @gluon.jit
    def _f16_halves(p):
        # the two fp16 halves of int32 words as fp32 (exact converts)
        lo = p.to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        hi = (p >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        return lo, hi

    @gluon.jit
    def _e2m1_word_dot(w, s_t, L3: gl.constexpr):
        """`sum over the eight codes of each word of (e2m1 * 2**-14) * v` for a `[RC, 8, 2]` word
        tile `w` (int32), `v` from the shared table of `lp_vector`: fp32 `[RC, 8, 2]`."""
        LV: gl.constexpr = gl.SliceLayout(0, L3)
        # [code, block, word]; indexed along its first dim, so its layout is that of the rest
        if _NEW_REINTERPRET:
            s_t3 = s_t.reinterpret(gl.float32, [8, 8, 2], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        else:
            s_t3 = s_t._reinterpret(gl.float32, [8, 8, 2], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        CM: gl.constexpr = 0x0E000E00
        SG: gl.constexpr = -0x7FFF8000
        lo, hi = _f16_halves(((w << 9) & CM) | ((w << 12) & SG))
        acc = lo * s_t3.index(0).load(LV)[None, :, :] + hi * s_t3.index(4).load(LV)[None, :, :]
        lo, hi = _f16_halves(((w << 5) & CM) | ((w << 8) & SG))
        acc += lo * s_t3.index(1).load(LV)[None, :, :] + hi * s_t3.index(5).load(LV)[None, :, :]
        lo, hi = _f16_halves(((w << 1) & CM) | ((w << 4) & SG))
        acc += lo * s_t3.index(2).load(LV)[None, :, :] + hi * s_t3.index(6).load(LV)[None, :, :]
        lo, hi = _f16_halves(((w >> 3) & CM) | (w & SG))
        acc += lo * s_t3.index(3).load(LV)[None, :, :] + hi * s_t3.index(7).load(LV)[None, :, :]
        return acc

    @gluon.jit
    def _nvfp4_chunk(s_T, s_t, b_sc, r0, RC: gl.constexpr, K: gl.constexpr, NW: gl.constexpr):
        # rows r0 .. r0 + RC - 1: sum_b block_b * (block b's code sums), [RC]; the layout
        # [rows, blocks of 16 codes, words of 8 codes]
        L3: gl.constexpr = gl.BlockedLayout([1, 2, 2], [8, 4, 1], [NW, 1, 1], [2, 1, 0])
        S3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        if _NEW_REINTERPRET:
            s_T3 = s_T.reinterpret(gl.int32, [s_T.shape[0], K // 16, 2], S3)
        else:
            s_T3 = s_T._reinterpret(gl.int32, [s_T.shape[0], K // 16, 2], S3)
        w = s_T3.slice(r0, RC, dim=0).load(L3)
        b_blk = gl.sum(_e2m1_word_dot(w, s_t, L3), axis=2)                   # [RC, K / 16]
        return gl.sum(b_blk * e4m3_to_f32(b_sc), axis=1)

    @gluon.jit
    def lp_row_sums(s_T, b_v, s_y, sc_a, sc_b, BV: gl.constexpr, K: gl.constexpr, LP: gl.constexpr,
                    NW: gl.constexpr):
        """The rows' products `sum_k T[r, k] v_k` of the LP tile in shared memory (`s_T`, landed)
        with `b_v` (`lp_vector`), stored to the shared `[BV]` fp32 `s_y`, before the row factor of
        `lp_row_factor`: fp8 rows without their scale, NVFP4 rows without the tensor scale and
        2**14 (`sc_a`, `sc_b`: the raw block scales of the tile's two chunks, `lp_block_scales`;
        unused otherwise). The caller passes a barrier before reading `s_y`."""
        if LP == 4:
            RC4: gl.constexpr = 8 * NW
            if BV > 2 * RC4:
                # (more rows a thread, `lp_launch_rows`: the whole tile as one chunk, `sc_a` its
                # block scales, `lp_block_scales` of BV rows)
                s_y.store(_nvfp4_chunk(s_T, b_v, sc_a, 0, BV, K, NW))
            else:
                s_y.slice(0, RC4, dim=0).store(_nvfp4_chunk(s_T, b_v, sc_a, 0, RC4, K, NW))
                s_y.slice(RC4, RC4, dim=0).store(_nvfp4_chunk(s_T, b_v, sc_b, RC4, RC4, K, NW))
        else:
            RC: gl.constexpr = 4 * NW
            SPT: gl.constexpr = 16 if LP == 3 else 8          # elements per 16-byte piece
            LR: gl.constexpr = gl.BlockedLayout([1, SPT], [4, 8], [NW, 1], [1, 0])
            for r0 in gl.static_range(0, BV, RC):
                b = s_T.slice(r0, RC, dim=0).load(LR)
                if LP == 1:
                    b_f = b.to(gl.float16, bitcast=True).to(gl.float32)
                elif LP == 2:
                    b_f = b.to(gl.bfloat16, bitcast=True).to(gl.float32)
                else:
                    b_f = e4m3_to_f32(b)
                s_y.slice(r0, RC, dim=0).store(gl.sum(b_f * b_v[None, :], axis=1))

    @gluon.jit
    def lp_row_factor(lp_scale, lp_tscale, i_m, o_r, V: gl.constexpr, LP: gl.constexpr):
        """What multiplies `lp_row_sums`' rows `o_r` of head matrix `i_m`: fp8 their row scales,
        NVFP4 the tensor scale times 2**14 (a power of two: exact), else 1."""
        if LP == 3:
            return gl.load(lp_scale + i_m * V + o_r)
        elif LP == 4:
            return gl.load(lp_tscale + i_m) * 16384.0
        else:
            return 1.0

    @gluon.jit
    def _vector_pieces(b_v, F16: gl.constexpr):
        """fp32 `v` `[K]` as the B operand's pieces: fp16 (F16) three pieces of `v * 2^s`, `2^s`
        putting max |v| in [2^14, 2^15) (so no piece overflows, and a bf16 or fp16 `v` is its
        first piece exactly; two pieces hold 22 of the largest element's 24 bits, the third the
        rest, down to 2^-38 of the largest element), else bf16 three pieces of `v`
        (`_split_bf16`, exact); and `2^-s`."""
        if F16:
            e = (gl.max(gl.abs(b_v), axis=0).to(gl.int32, bitcast=True) >> 23) & 255
            e = gl.minimum(gl.maximum(268 - e, 2), 252)              # 127 + s, kept normal
            b_s = b_v * (e << 23).to(gl.float32, bitcast=True)
            p0 = b_s.to(gl.float16)
            r1 = b_s - p0.to(gl.float32)
            p1 = r1.to(gl.float16)
            p2 = (r1 - p1.to(gl.float32)).to(gl.float16)
            inv = ((254 - e) << 23).to(gl.float32, bitcast=True)                  # 2^-s
            return p0.to(gl.float32), p1.to(gl.float32), p2.to(gl.float32), inv
        else:
            p0, p1, p2 = _split_bf16(b_v)
            return p0.to(gl.float32), p1.to(gl.float32), p2.to(gl.float32), 1.0

    @gluon.jit
    def lp_row_sums_mma(s_T, b_x, b_z, s_yx, s_yz, BV: gl.constexpr, K: gl.constexpr, LP: gl.constexpr,
                        NW: gl.constexpr, TWO: gl.constexpr):
        """`lp_row_sums` on the tensor cores for fp16, bf16 and fp8 copies (LP 1..3): the tile's rows
        times `b_x` (and `b_z`, TWO) `[K]` fp32 (any layout, as the row sums' vectors before
        `lp_vector`), stored to the shared `[BV]` fp32 `s_yx` (`s_yz`), before `lp_row_factor`.
        The tile's elements are exact in fp16 (fp16, fp8) or bf16 (bf16), the B operand's
        columns the vectors' pieces in the same type (`_vector_pieces`), so every product is
        exact; the tensor cores sum K = 128 in one chain, whose error (about 1e-7 relative) lies
        far below the copy's own rounding. A 16-bit tile is read as stored (`lp_tile_to_shared`
        with MMA, swizzled), an fp8 tile 32 columns at a time in the operand's layout, converted
        to fp16 in registers. Replaces per element a convert, an FMA and a share of the shuffles
        by a share of the MMA."""
        F16: gl.constexpr = LP != 2
        DT: gl.constexpr = gl.float16 if F16 else gl.bfloat16
        NP: gl.constexpr = 3                 # the B columns each vector's pieces take (of 4)
        MM: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MM, k_width=2)
        BO: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MM, k_width=2)
        LB: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [NW, 1], [1, 0])
        o_n = gl.arange(0, 8, layout=gl.SliceLayout(0, LB))[None, :]
        x0, x1, x2, f_x = _vector_pieces(gl.convert_layout(b_x, gl.SliceLayout(1, LB)), F16)
        b = gl.where(o_n == 0, x0[:, None], gl.where(o_n == 1, x1[:, None], gl.where(o_n == 2, x2[:, None], 0.0)))
        f_z = 1.0
        if TWO:
            z0, z1, z2, f_z = _vector_pieces(gl.convert_layout(b_z, gl.SliceLayout(1, LB)), F16)
            b = gl.where(o_n == 4, z0[:, None], gl.where(o_n == 5, z1[:, None], gl.where(o_n == 6, z2[:, None], b)))
        s_B = gl.allocate_shared_memory(DT, [K, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]), b.to(DT))
        _barrier()
        y = gl.zeros([BV, 8], gl.float32, MM)
        if LP == 3:
            for k0 in gl.static_range(0, K, 32):
                a = s_T.slice(k0, 32, dim=1).load(AL).to(gl.float8e4nv, bitcast=True).to(gl.float16)
                y = mma_v2(a, s_B.slice(k0, 32, dim=0).load(BO), y)
        else:
            y = mma_v2(s_T.load(AL).to(DT, bitcast=True), s_B.load(BO), y)
        o_nM = gl.arange(0, 8, layout=gl.SliceLayout(0, MM))[None, :]
        s_yx.store(gl.sum(gl.where(o_nM < NP, y, 0.0), axis=1) * f_x)
        if TWO:
            s_yz.store(gl.sum(gl.where((o_nM >= 4) & (o_nM < 4 + NP), y, 0.0), axis=1) * f_z)
