"""Tensor-core matrix products at fp32 accuracy, for the verify kernels (`mma`).

A verify step multiplies a program's checkpoint tile by all of its drafts' vectors at once;
as T matrix-vector products on FMA units each draft is a chain of shuffle reductions. As a
product on the tensor cores it is one instruction stream for all drafts, and exact enough
when every operand is split into pieces the tensor cores multiply exactly (below). A single
TF32 or bf16 pass is not: it keeps 11 or 8 significant bits of the fp32 state.
"""
import torch
import triton
import triton.language as tl


# ----------------------------------------------------------------------------------------------
# 16-bit tensor-core products at fp32 accuracy (bf16 pieces, a fresh accumulator per call)
#
# An fp32 value is the exact sum of three bf16 values taken by round-to-nearest (8 + 8 + 8
# significant bits; bf16 has fp32's exponent range). A bf16 x bf16 product is exact in fp32, so
# operands split (`split_bf16`) and multiplied piece by piece lose nothing but the accumulation's rounding. The
# tensor cores' fp32 accumulation truncates, and a long chain of it biases the sum (one chain
# over K = 128 measured 1.1e-7 relative error on the H100 against 8.1e-8 for an fp32 FMA dot):
# so a caller gives every K chunk of at most 32 its own call, whose result it adds into fp32
# registers, and inside a call the leading product has an accumulator of its own.

def pieces(dtype) -> int:
    """How many bf16 pieces a value of this torch dtype takes exactly: bf16 1, fp16 2 (11
    significant bits), fp32 3."""
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
