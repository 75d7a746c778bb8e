"""The early flush's hand-off of Mamba-2's Gluon verify kernel (gluon_verify.py), for the GPU
only: the slot's last program writes the drafts' shared fields (every head's log decay, every
group's key) at positions `0..n-1`, from the inputs, which the slot's other programs read as
committed records until they all arrived.
"""
from __future__ import annotations

from ..utils.gluon import HAVE_GLUON

__all__ = ["HAVE_GLUON"]

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from ..utils.gluon import _softplus

    @gluon.jit
    def _write_shared_drafts(dt, B, A, dt_bias, buf_ld, buf_k, slot, n, off_dt, stride_dt_t, off_B, stride_B_t,
                             stride_B_g, HV: gl.constexpr, Hk: gl.constexpr, K: gl.constexpr, LB: gl.constexpr,
                             T: gl.constexpr, HVP: gl.constexpr, HKP: gl.constexpr, NW: gl.constexpr):
        """`common.write_shared_drafts` in Gluon: after an early flush, by the slot's last program,
        every head's log decay and every group's key of the drafts at positions `0..n-1`, from
        the inputs (other programs of the slot read these positions as committed records until
        all arrived)."""
        LH: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        LG: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
        o_hv = gl.arange(0, HVP, layout=LH)
        m_hv = o_hv < HV
        o_g = gl.arange(0, HKP, layout=gl.SliceLayout(1, LG))
        o_k = gl.arange(0, K, layout=gl.SliceLayout(0, LG))
        m_gk = (o_g < Hk)[:, None] & (o_k < K)[None, :]
        b_As = gl.load(A + o_hv, mask=m_hv, other=0.0).to(gl.float32)
        b_bias = gl.load(dt_bias + o_hv, mask=m_hv, other=0.0).to(gl.float32)
        p_lds = buf_ld + slot * (LB * HV) + o_hv
        p_ks = buf_k + slot * (LB * Hk * K) + o_g[:, None] * K + o_k[None, :]
        for t in gl.static_range(T):
            if t < n:
                b_dts = gl.load(dt + off_dt + t * stride_dt_t + o_hv, mask=m_hv, other=0.0).to(gl.float32)
                gl.store(p_lds + t * HV, _softplus(b_dts + b_bias) * b_As, mask=m_hv)
                b_Ks = gl.load(B + off_B + t * stride_B_t + o_g[:, None] * stride_B_g + o_k[None, :], mask=m_gk,
                               other=0.0)
                gl.store(p_ks + t * (Hk * K), b_Ks.to(gl.float32).to(buf_k.dtype.element_ty), mask=m_gk)
