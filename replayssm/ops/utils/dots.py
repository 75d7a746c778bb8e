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
