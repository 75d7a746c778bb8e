"""Tensor-core matrix products at fp32 accuracy, for the verify kernels (every family).

A verify step multiplies a program's checkpoint tile by all of its drafts' vectors at once;
as T matrix-vector products on FMA units each draft is a chain of shuffle reductions, and the
chains, not the bytes, set the time. A TF32 product keeps 11 significant bits of each operand,
so an fp32 operand is split into three TF32 values that sum to it exactly (11 + 11 + 2 bits,
by truncation: integer masks, the same on the interpreter and the GPU). Each partial product is
then exact in the fp32 accumulator and the only rounding left is the accumulation's, as in an
fp32 FMA dot. Operands whose values are already TF32-exact (bf16 or fp16 records and inputs,
widened to fp32) need no split.

Operands are fp32 tensors of at least 16 x 16 (tl.dot's minimum). bf16 operands are widened
first: the interpreter's bf16 dot is wrong (DESIGN.md).
"""
import triton
import triton.language as tl


@triton.jit
def tf32_hi(x):
    """The TF32 value of `x`'s top 11 significant bits (truncated): `x - tf32_hi(x)` is exact."""
    return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _dot1(a, b, acc):
    return tl.dot(a, b, acc, input_precision="tf32")


@triton.jit
def dot_f32(a, b, acc, A_EXACT: tl.constexpr, B_EXACT: tl.constexpr):
    """`acc + a @ b` with fp32 `a` `[M, K]`, `b` `[K, N]`, `acc` `[M, N]` fp32. `A_EXACT` /
    `B_EXACT`: the operand's values are TF32-exact (one piece), else it is split in three.
    Both split: the six products down to 2^-22 of the leading one (the three dropped ones are
    below fp32's rounding of the sum). Small pieces are accumulated first."""
    if A_EXACT and B_EXACT:
        acc = _dot1(a, b, acc)
    elif B_EXACT:
        a1 = tf32_hi(a)
        r = a - a1
        a2 = tf32_hi(r)
        acc = _dot1(r - a2, b, acc)
        acc = _dot1(a2, b, acc)
        acc = _dot1(a1, b, acc)
    elif A_EXACT:
        b1 = tf32_hi(b)
        r = b - b1
        b2 = tf32_hi(r)
        acc = _dot1(a, r - b2, acc)
        acc = _dot1(a, b2, acc)
        acc = _dot1(a, b1, acc)
    else:
        a1 = tf32_hi(a)
        ra = a - a1
        a2 = tf32_hi(ra)
        a3 = ra - a2
        b1 = tf32_hi(b)
        rb = b - b1
        b2 = tf32_hi(rb)
        b3 = rb - b2
        acc = _dot1(a1, b3, acc)
        acc = _dot1(a3, b1, acc)
        acc = _dot1(a2, b2, acc)
        acc = _dot1(a1, b2, acc)
        acc = _dot1(a2, b1, acc)
        acc = _dot1(a1, b1, acc)
    return acc


# ----------------------------------------------------------------------------------------------
# 16-bit tensor-core products at fp32 accuracy (bf16 pieces, a fresh accumulator per call)
#
# An fp32 value is the exact sum of three bf16 values taken by round-to-nearest (8 + 8 + 8
# significant bits; bf16 has fp32's exponent range). A bf16 x bf16 product is exact in fp32, so
# `split` operands multiplied piece by piece lose nothing but the accumulation's rounding. The
# tensor cores' fp32 accumulation truncates, and a long chain of it biases the sum (one chain
# over K = 128 measured 1.1e-7 relative error on the H100 against 8.1e-8 for an fp32 FMA dot):
# so a caller gives every K chunk of at most 32 its own call, whose result it adds into fp32
# registers, and inside a call the leading product has an accumulator of its own.

def pieces(dtype) -> int:
    """How many bf16 pieces a value of this torch dtype takes exactly: bf16 1, fp16 2 (11
    significant bits), fp32 3."""
    import torch
    return {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 3)


@triton.jit
def split_bf16(x):
    """fp32 `x` as bf16 `(p0, p1, p2)` with `x == p0 + p1 + p2` exactly for normal values; a
    16-bit `x` needs only the first one or two (`pieces`)."""
    p0 = x.to(tl.bfloat16)
    r = x - p0.to(tl.float32)
    p1 = r.to(tl.bfloat16)
    p2 = (r - p1.to(tl.float32)).to(tl.bfloat16)
    return p0, p1, p2


@triton.jit
def _mma(a, b, acc, WIDEN: tl.constexpr):
    # WIDEN (the CPU interpreter, whose bf16 dot is wrong: DESIGN.md): the same exact pieces
    # as fp32 in an IEEE product
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, out_dtype=tl.float32)


@triton.jit
def dot_bf16x(a, b, NA: tl.constexpr, NB: tl.constexpr, WIDEN: tl.constexpr):
    """`a @ b` (`[M, K] @ [K, N]`, K at most 32, dims at least 16) at fp32 accuracy on the
    tensor cores, as a fresh fp32 value: `a` and `b` given in fp32 (or any float type), of
    `NA` / `NB` bf16 pieces (`pieces`). The products down to 2^-16 of the leading one are
    formed (the dropped ones, pieces i + j > 2, lie below fp32's rounding of the sum), the
    small ones accumulated together first, the leading one on its own."""
    a0, a1, a2 = split_bf16(a.to(tl.float32))
    b0, b1, b2 = split_bf16(b.to(tl.float32))
    lead = _mma(a0, b0, None, WIDEN)
    if NA > 1 or NB > 1:
        small = tl.zeros_like(lead)
        if NA > 2:
            small = _mma(a2, b0, small, WIDEN)
        if NB > 2:
            small = _mma(a0, b2, small, WIDEN)
        if NA > 1 and NB > 1:
            small = _mma(a1, b1, small, WIDEN)
        if NA > 1:
            small = _mma(a1, b0, small, WIDEN)
        if NB > 1:
            small = _mma(a0, b1, small, WIDEN)
        lead = lead + small
    return lead
