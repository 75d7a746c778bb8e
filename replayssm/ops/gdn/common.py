"""Pieces the GDN and KDA kernels (replay and conventional) share: the `@triton.jit` loads of
one token (query, key, value, decay, beta) and the conversion of stores, and the checks of
every argument at the Python boundary (shape, dtype, device, contiguity, slot and cursor range).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..utils.checks import (check_devices, check_slot_ids, check_slot_rows, check_slot_values, check_tensor,
                            check_window, may_sync)

__all__ = ["check_token_inputs", "check_state", "check_slot_ids", "check_slot_values", "check_devices",
           "check_cursor_values"]


def _interpreting() -> bool:
    """Whether the kernels run under the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---------------------------------------------------------------------------------------------
# Triton helpers shared by the replay and conventional kernels of both families.
# ---------------------------------------------------------------------------------------------

@triton.jit
def _rne_bf16(x):
    # fp32 -> bf16 round-to-nearest-even with integer ops; the CPU interpreter's .to(bf16)
    # truncates, so interpreter runs use this to measure what the GPU's cvt.rn does.
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _for_store(x, p, EXACT_BF16: tl.constexpr):
    """`x` (fp32) converted to the element type of pointer `p`; EXACT_BF16 (the interpreter):
    bf16 by round-to-nearest-even as on the GPU."""
    y = x.to(p.dtype.element_ty)
    if EXACT_BF16:
        if p.dtype.element_ty == tl.bfloat16:
            y = _rne_bf16(x)
    return y


@triton.jit
def _load_qk(q, k, i_b, i_hk, o_k, m_k, scale, stride_q_b, stride_q_h, stride_k_b, stride_k_h,
             USE_QK_L2NORM: tl.constexpr):
    """The current token's key (L2-normalised) and query (normalised, scaled) of one key head,
    `[BK]` fp32."""
    b_q = tl.load(q + i_b * stride_q_b + i_hk * stride_q_h + o_k, mask=m_k, other=0.).to(tl.float32)
    b_k = tl.load(k + i_b * stride_k_b + i_hk * stride_k_h + o_k, mask=m_k, other=0.).to(tl.float32)
    if USE_QK_L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    return b_q * scale, b_k


@triton.jit
def _load_head(v, a, b, A_log, dt_bias, i_b, i_hv, o_v, m_v, o_k, m_k,
               stride_v_b, stride_v_h, stride_a_b, stride_a_h, stride_b_b, stride_b_h,
               K: tl.constexpr, IS_KDA: tl.constexpr):
    """The current token of one value head: value block `[BV]`, log decay (scalar, or `[BK]`
    for KDA, zero on padded channels) and beta, fp32."""
    b_v = tl.load(v + i_b * stride_v_b + i_hv * stride_v_h + o_v, mask=m_v, other=0.).to(tl.float32)
    b_beta = tl.sigmoid(tl.load(b + i_b * stride_b_b + i_hv * stride_b_h).to(tl.float32))
    b_A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    if IS_KDA:
        b_a = tl.load(a + i_b * stride_a_b + i_hv * stride_a_h + o_k, mask=m_k, other=0.).to(tl.float32)
        b_dt = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_x = b_a + b_dt
    else:
        b_a = tl.load(a + i_b * stride_a_b + i_hv * stride_a_h).to(tl.float32)
        b_x = b_a + tl.load(dt_bias + i_hv).to(tl.float32)
    # softplus(x) = max(x, 0) + log1p(exp(-|x|)), log1p written out (Goldberg) because the
    # gate inputs of long-memory heads are very negative: log(1 + tiny) would lose most digits
    b_e = tl.exp(-tl.abs(b_x))
    b_1e = 1.0 + b_e
    b_d = b_1e - 1.0
    b_l1p = tl.where(b_d == 0.0, b_e, tl.log(b_1e) * (b_e / tl.where(b_d == 0.0, 1.0, b_d)))
    b_ld = -b_A * (tl.maximum(b_x, 0.0) + b_l1p)
    if IS_KDA:
        b_ld = tl.where(m_k, b_ld, 0.)
    return b_v, b_ld, b_beta


@triton.jit
def _load_token(q, k, v, a, b, A_log, dt_bias, i_b, i_hv, i_hk, o_v, m_v, o_k, m_k, scale,
                stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
                stride_a_b, stride_a_h, stride_b_b, stride_b_h,
                K: tl.constexpr, IS_KDA: tl.constexpr, USE_QK_L2NORM: tl.constexpr):
    """`_load_qk` and `_load_head` of one (row, value head): q, k, v, log decay, beta."""
    b_q, b_k = _load_qk(q, k, i_b, i_hk, o_k, m_k, scale, stride_q_b, stride_q_h, stride_k_b,
                        stride_k_h, USE_QK_L2NORM)
    b_v, b_ld, b_beta = _load_head(v, a, b, A_log, dt_bias, i_b, i_hv, o_v, m_v, o_k, m_k,
                                   stride_v_b, stride_v_h, stride_a_b, stride_a_h, stride_b_b,
                                   stride_b_h, K, IS_KDA)
    return b_q, b_k, b_v, b_ld, b_beta


# ---------------------------------------------------------------------------------------------
# Validation at the Python boundary: which arguments GDN and KDA take and their shapes (both
# schemes); the checks themselves are every family's (ops/utils/checks.py).
# ---------------------------------------------------------------------------------------------

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_RECORD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_token_inputs(family: str, q, k, v, a, b, A_log, dt_bias, out) -> tuple:
    """Shapes, dtypes and strides of one step's inputs; returns `(Bt, Hk, K, HV, V)`."""
    if not isinstance(q, Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a [Bt, Hk, K] tensor, got shape {getattr(q, 'shape', None)}")
    Bt, Hk, K = q.shape
    check_tensor("k", k, (Bt, Hk, K))
    if not isinstance(v, Tensor) or v.dim() != 3 or v.shape[0] != Bt:
        raise ValueError(f"v must be a [Bt={Bt}, HV, V] tensor, got shape {getattr(v, 'shape', None)}")
    HV, V = v.shape[1], v.shape[2]
    if Hk < 1 or HV % Hk:
        raise ValueError(f"value heads HV={HV} must be a multiple of key heads Hk={Hk}")
    if family == "kda":
        check_tensor("a", a, (Bt, HV, K))
        check_tensor("dt_bias", dt_bias, (HV, K))
    else:
        check_tensor("a", a, (Bt, HV))
        check_tensor("dt_bias", dt_bias, (HV,))
    check_tensor("b", b, (Bt, HV))
    check_tensor("A_log", A_log, (HV,))
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("A_log", A_log),
                    ("dt_bias", dt_bias)):
        check_tensor(name, t, dtypes=_FLOATS)
    for name, t in (("q", q), ("k", k), ("v", v)) + ((("a", a),) if family == "kda" else ()):
        check_tensor(name, t, inner=True)
    check_tensor("A_log", A_log, contiguous=True)
    check_tensor("dt_bias", dt_bias, contiguous=True)
    if out is not None:
        check_tensor("out", out, (Bt, HV, V), _FLOATS, contiguous=True)
    return Bt, Hk, K, HV, V


def check_state(family: str, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive,
                HV: int, Hk: int, V: int, K: int, window, slot_strided: bool = False) -> tuple:
    """Shapes and dtypes of the pool tensors; returns `(N, Lb)`. `slot_strided`: the kernel
    takes a slot stride (`utils.launch.slot_pads`), so `ckpt`, the buffers and `cursor` need
    only contiguous rows (`epoch` and `arrive` stay contiguous)."""
    if not isinstance(ckpt, Tensor) or ckpt.dim() != 4:
        raise ValueError(f"ckpt must be an [N, HV, V, K] tensor, got shape {getattr(ckpt, 'shape', None)}")
    N = ckpt.shape[0]
    check_tensor("ckpt", ckpt, (N, HV, V, K), (torch.float32,))
    if not isinstance(buf_w, Tensor) or buf_w.dim() != 4:
        raise ValueError(f"buf_w must be an [N, Lb, HV, V] tensor, got shape {getattr(buf_w, 'shape', None)}")
    Lb = buf_w.shape[1]
    check_tensor("buf_w", buf_w, (N, Lb, HV, V))
    check_tensor("buf_ld", buf_ld, (N, Lb, HV, K) if family == "kda" else (N, Lb, HV))
    check_tensor("buf_k", buf_k, (N, Lb, Hk, K))
    check_tensor("buf_ld", buf_ld, dtypes=(torch.float32,))
    check_tensor("buf_w", buf_w, dtypes=_RECORD_DTYPES)
    check_tensor("buf_k", buf_k, dtypes=_RECORD_DTYPES)
    check_tensor("cursor", cursor, (N,), (torch.int32,))
    check_tensor("epoch", epoch, (N,), (torch.int64,))
    check_tensor("arrive", arrive, (N,), (torch.int32,))
    rows = dict(ckpt=ckpt, buf_ld=buf_ld, buf_w=buf_w, buf_k=buf_k)
    contiguous = dict(epoch=epoch, arrive=arrive)
    if slot_strided:
        check_slot_rows(**rows)
    else:
        contiguous.update(rows, cursor=cursor)
    for name, t in contiguous.items():
        check_tensor(name, t, contiguous=True)
    check_window(window, Lb)
    return N, Lb


def check_cursor_values(cursor: Tensor, slot_ids: Tensor, Lb: int, window: int) -> None:
    """The rows' cursors leave room for the new record and do not pass the window, which
    sizes the kernel's record tiles (a host sync: skipped where `utils.checks.may_sync` says no)."""
    if not may_sync():
        return
    ids = slot_ids.detach().cpu().long()
    ids = ids[ids >= 0]
    if ids.numel():
        h = cursor.detach().cpu()[ids]
        # window 1 (the eager step) folds whatever the buffer holds
        bad = (h < 0) | (h >= Lb) | ((h > window) & (window > 1))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            lim = f"min(window={window}, Lb-1={Lb - 1})" if window > 1 else f"Lb-1={Lb - 1}"
            raise ValueError(f"cursor[{int(ids[i])}]={int(h[i])} is outside 0..{lim}")


def _scale(scale, K: int) -> float:
    if scale is None:
        return K ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale={scale!r} must be a finite float or None")
    return float(scale)


# ---------------------------------------------------------------------------------------------
# The drafts' shared records, written by the Triton verify kernels (verify.py, verify_mma.py,
# verify_lp.py)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _log_decay(b_x, b_A):
    """`-A softplus(x)` with the operations of `common._load_head` (the same bits)."""
    b_e = tl.exp(-tl.abs(b_x))
    b_1e = 1.0 + b_e
    b_d = b_1e - 1.0
    b_l1p = tl.where(b_d == 0.0, b_e, tl.log(b_1e) * (b_e / tl.where(b_d == 0.0, 1.0, b_d)))
    return -b_A * (tl.maximum(b_x, 0.0) + b_l1p)


@triton.jit
def _write_shared(k, a, A_log, dt_bias, buf_ld, buf_k, i_b, i_s, n, o_k, m_k,
                  stride_k_b, stride_k_t, stride_k_h, stride_a_b, stride_a_t, stride_a_h,
                  T: tl.constexpr, HV: tl.constexpr, HK: tl.constexpr, K: tl.constexpr,
                  LBCAP: tl.constexpr, HVP: tl.constexpr, HKP: tl.constexpr,
                  IS_KDA: tl.constexpr, USE_QK_L2NORM: tl.constexpr, EXACT_BF16: tl.constexpr):
    """On an early flush, the drafts' fields other programs of the slot read as committed
    records until they all arrived: every value head's log decay and every key head's key at
    positions `0..n-1`, recomputed from the inputs by the slot's last program."""
    o_hv = tl.arange(0, HVP)
    m_hv = o_hv < HV
    o_hk = tl.arange(0, HKP)
    m_hk = o_hk < HK
    b_A = tl.exp(tl.load(A_log + o_hv, mask=m_hv, other=0.).to(tl.float32))
    if IS_KDA:
        b_dt = tl.load(dt_bias + o_hv[:, None] * K + o_k[None, :], mask=m_hv[:, None] & m_k[None, :],
                       other=0.).to(tl.float32)
    else:
        b_dt = tl.load(dt_bias + o_hv, mask=m_hv, other=0.).to(tl.float32)
    for t in tl.static_range(T):
        ok = t < n
        p_kt = k + i_b * stride_k_b + t * stride_k_t
        m_kh = m_hk[:, None] & m_k[None, :]
        b_k = tl.load(p_kt + o_hk[:, None] * stride_k_h + o_k[None, :], mask=m_kh, other=0.).to(tl.float32)
        if USE_QK_L2NORM:
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
        p_kb = buf_k + ((i_s * LBCAP + t) * HK + o_hk)[:, None] * K + o_k[None, :]
        tl.store(p_kb, _for_store(b_k, p_kb, EXACT_BF16), mask=tl.where(ok, m_kh, False))
        p_at = a + i_b * stride_a_b + t * stride_a_t
        if IS_KDA:
            m_a = m_hv[:, None] & m_k[None, :]
            b_a = tl.load(p_at + o_hv[:, None] * stride_a_h + o_k[None, :], mask=m_a, other=0.).to(tl.float32)
            b_ld = tl.where(m_a, _log_decay(b_a + b_dt, b_A[:, None]), 0.)
            tl.store(buf_ld + ((i_s * LBCAP + t) * HV + o_hv)[:, None] * K + o_k[None, :], b_ld,
                     mask=tl.where(ok, m_a, False))
        else:
            b_a = tl.load(p_at + o_hv * stride_a_h, mask=m_hv, other=0.).to(tl.float32)
            tl.store(buf_ld + (i_s * LBCAP + t) * HV + o_hv, _log_decay(b_a + b_dt, b_A),
                     mask=tl.where(ok, m_hv, False))
