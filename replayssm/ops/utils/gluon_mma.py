"""Tensor-core products at fp32 accuracy in Gluon (mma.sync with TF32 operands), for the Gluon
verify kernels: the pieces of `dots.py` (an fp32 operand split into three TF32 values that sum
to it exactly; small pieces first) on operands already in mma's register layouts.

The accumulation inside an mma chain truncates instead of rounding, so a caller keeps the
chains short (one K chunk) and adds each chunk's result to an fp32 sum in registers: the
products are exact, the truncation reaches only a chunk's partial sum, and the sum over chunks
rounds as an FMA dot's does. GPU only (the CPU interpreter cannot run Gluon)."""
from __future__ import annotations

from .gluon import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    @gluon.jit
    def tf32_hi(x):
        """`x`'s top 11 significant bits as an fp32 value (truncated, so `x - tf32_hi(x)` is
        exact and a TF32 operand holds it whole)."""
        return (x.to(gl.int32, bitcast=True) & -8192).to(gl.float32, bitcast=True)

    @gluon.jit
    def tf32_pieces(x):
        """`x` as three TF32-exact fp32 values, largest first, whose sum is `x` exactly."""
        x1 = tf32_hi(x)
        r = x - x1
        x2 = tf32_hi(r)
        return x1, x2, r - x2

    @gluon.jit
    def mma_split_a(a1, a2, a3, b, acc):
        """`acc + a @ b` for an `a` given as its three pieces and a TF32-exact `b`: three mma
        passes, the smallest piece first."""
        acc = mma_v2(a3, b, acc, input_precision="tf32")
        acc = mma_v2(a2, b, acc, input_precision="tf32")
        return mma_v2(a1, b, acc, input_precision="tf32")

    @gluon.jit
    def mma_split_ab(a1, a2, a3, b1, b2, b3, acc):
        """`acc + a @ b` with both operands given as three pieces: the six products down to
        2^-22 of the leading one (the three dropped ones are below fp32's rounding of the sum),
        small ones first."""
        acc = mma_v2(a1, b3, acc, input_precision="tf32")
        acc = mma_v2(a3, b1, acc, input_precision="tf32")
        acc = mma_v2(a2, b2, acc, input_precision="tf32")
        acc = mma_v2(a1, b2, acc, input_precision="tf32")
        acc = mma_v2(a2, b1, acc, input_precision="tf32")
        return mma_v2(a1, b1, acc, input_precision="tf32")
