"""The early flush's hand-off of the GDN/KDA Gluon verify kernel (gluon_verify.py), for the GPU
only: the slot's last program writes the drafts' shared fields (decays, normalised keys) at
positions `0..n-1`, recomputed from the inputs, which the slot's other programs read as
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
