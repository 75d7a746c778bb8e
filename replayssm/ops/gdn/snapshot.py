"""GDN / KDA snapshot verify: the speculative-decoding baseline of serving engines today.

vLLM's fused recurrent gated-delta-rule verify runs the conventional recurrence over the T
draft tokens, token by token, and writes the state after every draft to a slot of its own
(`ops/utils/snapshot.py`: `states [N, T1, HV, V, K]`, `base [N]`). Per row and value head:

    S = states[s, base[s]];  for t < n:  S <- a_t S (KDA: S Diag(a_t)),  u = beta_t (v_t - S k_t),
    S <- S + u k_t^T,  o_t = S q_t,  states[s, (base[s] + 1 + t) % T1] = S

It is the conventional kernel (conventional.py) generalised to T tokens and kept as honest:
the same `[BV, K]` programs (K contiguous), the same token loads and gating (common.py), the
same launch tables (`conventional_config`), each state element read once and written n times.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..utils.snapshot import check_snapshot_state, snapshot_commit, snapshot_launch, snapshot_overrides
from .common import (_FLOATS, _for_store, _interpreting, _load_token, _scale, check_devices,
                     check_slot_values, check_tensor, check_token_inputs)
from .configs import conventional_config

__all__ = ["snapshot_verify", "snapshot_commit", "run_snapshot"]


@triton.jit
def _snapshot_verify_kernel(
    q, k, v, a, b, A_log, dt_bias, o, states, base, slot_ids, num_drafts, scale,
    stride_q_b, stride_q_t, stride_q_h, stride_k_b, stride_k_t, stride_k_h,
    stride_v_b, stride_v_t, stride_v_h, stride_a_b, stride_a_t, stride_a_h,
    stride_b_b, stride_b_t, stride_b_h,
    T: tl.constexpr, T1: tl.constexpr, HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr,
    K: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, IS_KDA: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, EXACT_BF16: tl.constexpr, HAS_N: tl.constexpr,
):
    NV: tl.constexpr = (V + BV - 1) // BV
    SLOT: tl.constexpr = HV * V * K
    pid = tl.program_id(0).to(tl.int64)
    i_v = pid % NV
    i_bh = pid // NV
    i_hv = i_bh % HV
    i_b = i_bh // HV
    i_hk = i_hv // (HV // HK)

    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    # out is [Bt, T, HV, V] contiguous
    p_o = o + (i_b * T * HV + i_hv) * V + o_v

    i_s = tl.load(slot_ids + i_b).to(tl.int64)
    if i_s < 0:
        for t in range(T):
            tl.store(p_o + t * (HV * V), tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty), mask=m_v)
        return
    if HAS_N:
        n = tl.load(num_drafts + i_b)
    else:
        n = T
    b0 = tl.load(base + i_s)
    p_S = states + i_s * (T1 * SLOT) + (i_hv * V + o_v)[:, None] * K + o_k[None, :]
    m_S = m_v[:, None] & m_k[None, :]
    b_S = tl.load(p_S + b0.to(tl.int64) * SLOT, mask=m_S, other=0.)                   # [BV, BK] fp32

    for t in range(n):
        b_q, b_k, b_v, b_ld, b_beta = _load_token(
            q + t * stride_q_t, k + t * stride_k_t, v + t * stride_v_t, a + t * stride_a_t,
            b + t * stride_b_t, A_log, dt_bias, i_b, i_hv, i_hk, o_v, m_v, o_k, m_k, scale,
            stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
            stride_a_b, stride_a_h, stride_b_b, stride_b_h, K, IS_KDA, USE_QK_L2NORM)
        if IS_KDA:
            b_S = b_S * tl.exp(b_ld)[None, :]
        else:
            b_S = b_S * tl.exp(b_ld)
        b_u = b_beta * (b_v - tl.sum(b_S * b_k[None, :], axis=1))                      # [BV]
        b_S += b_u[:, None] * b_k[None, :]
        b_o = tl.sum(b_S * b_q[None, :], axis=1)
        # draft t's snapshot; T + 1 <= T1, so the slot read above is never among them
        tl.store(p_S + ((b0 + 1 + t) % T1).to(tl.int64) * SLOT, b_S, mask=m_S)
        tl.store(p_o + t * (HV * V), _for_store(b_o, p_o, EXACT_BF16), mask=m_v)
    for t in range(n, T):
        tl.store(p_o + t * (HV * V), tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty), mask=m_v)


def launch_snapshot(family: str, q, k, v, a, b, A_log, dt_bias, scale: float, states, base,
                    slot_ids, num_drafts, o, use_qk_l2norm: bool, BV: int, num_warps: int,
                    num_stages: int) -> None:
    """The snapshot verify kernel, inputs validated and the launch config resolved."""
    Bt, T, Hk, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if Bt == 0:
        return
    BV = min(BV, triton.next_power_of_2(V))
    NV = triton.cdiv(V, BV)
    _snapshot_verify_kernel[(Bt * HV * NV,)](
        q, k, v, a, b, A_log, dt_bias, o, states, base, slot_ids,
        num_drafts if num_drafts is not None else slot_ids, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        T=T, T1=states.shape[1], HV=HV, HK=Hk, V=V, K=K, BV=BV, BK=triton.next_power_of_2(K),
        IS_KDA=family == "kda", USE_QK_L2NORM=bool(use_qk_l2norm), EXACT_BF16=_interpreting(),
        HAS_N=num_drafts is not None, num_warps=num_warps, num_stages=num_stages,
    )


def _check_draft_inputs(family, q, k, v, a, b, A_log, dt_bias) -> tuple:
    """Shapes of a verify's inputs (`[Bt, T, ...]`): the leading dims here, the rest by the
    decode step's checks on token 0; returns (Bt, T, Hk, K, HV, V)."""
    a_form = "[Bt, T, HV, K]" if family == "kda" else "[Bt, T, HV]"
    named = (("q", q, "[Bt, T, Hk, K]"), ("k", k, "[Bt, T, Hk, K]"), ("v", v, "[Bt, T, HV, V]"),
             ("a", a, a_form), ("b", b, "[Bt, T, HV]"))
    for name, t, form in named:
        if not isinstance(t, Tensor) or t.dim() != form.count(",") + 1:
            raise ValueError(f"{name} must be a {form} tensor, got shape {getattr(t, 'shape', None)}")
    Bt, T = q.shape[0], q.shape[1]
    if T < 1:
        raise ValueError(f"q: expected T >= 1 draft tokens, got shape {tuple(q.shape)}")
    for name, t, _ in named[1:]:
        if tuple(t.shape[:2]) != (Bt, T):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected leading dims [Bt={Bt}, T={T}] as q")
    _, Hk, K, HV, V = check_token_inputs(family, q[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0],
                                         A_log, dt_bias, None)
    return Bt, T, Hk, K, HV, V


def run_snapshot(family: str, q, k, v, a, b, A_log, dt_bias, scale, states, base, slot_ids,
                 num_drafts, out, use_qk_l2norm, config, validate) -> Tensor:
    """Validate, resolve the conventional launch config and launch (GDN and KDA)."""
    if validate:
        Bt, T, Hk, K, HV, V = _check_draft_inputs(family, q, k, v, a, b, A_log, dt_bias)
        if out is not None:
            check_tensor("out", out, (Bt, T, HV, V), _FLOATS, contiguous=True)
        check_devices(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, states=states,
                      base=base, slot_ids=slot_ids, num_drafts=num_drafts, out=out)
        N, _ = check_snapshot_state(states, base, slot_ids, num_drafts, Bt, T, HV, V, K, q.device)
        check_slot_values(slot_ids, N)
        config = snapshot_overrides(config)
    V, K = v.shape[-1], q.shape[-1]
    cfg = snapshot_launch(conventional_config(V, K, config, family, batch=q.shape[0], HV=v.shape[2],
                                              Hk=q.shape[2]), q.shape[1], config)
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    launch_snapshot(family, q, k, v, a, b, A_log, dt_bias, _scale(scale, K), states, base,
                    slot_ids, num_drafts, out, use_qk_l2norm, cfg["BV"], cfg["num_warps"],
                    cfg["num_stages"])
    return out


def snapshot_verify(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                    dt_bias: Tensor, scale: Optional[float], states: Tensor, base: Tensor,
                    slot_ids: Tensor, num_drafts: Optional[Tensor] = None,
                    out: Optional[Tensor] = None, use_qk_l2norm: bool = True,
                    config: Optional[dict] = None, *, validate: bool = True) -> Tensor:
    """Verify T draft tokens of GDN the snapshot way; returns `o` `[Bt, T, HV, V]` (v's dtype,
    or `out`, contiguous).

    `q, k` `[Bt, T, Hk, K]`, `v` `[Bt, T, HV, V]`, `a, b` `[Bt, T, HV]` raw, `A_log, dt_bias`
    `[HV]`, `scale` None: `K^-0.5`. `states` `[N, T1, HV, V, K]` fp32 contiguous with
    `T + 1 <= T1`, `base` `[N]` int32, `slot_ids` `[Bt]` (negative: padding row, zero output,
    nothing touched), `num_drafts` `[Bt]` int32 in `1..T` (None: T). Row b runs drafts
    `t < n_b` from `states[s, base[s]]`, writes the state after draft t to
    `states[s, (base[s] + 1 + t) % T1]`, and `o[b, t] = 0` for `t >= n_b`; `base` is moved by
    `snapshot_commit`. Launch config: the conventional kernel's (`configs.conventional_config`,
    with `utils.snapshot.snapshot_launch`); `config` overrides its `BV`, `num_warps`,
    `num_stages`. `validate=False`: no check and no host sync (capturable in a CUDA graph when
    `out` is given).
    """
    return run_snapshot("gdn", q, k, v, a, b, A_log, dt_bias, scale, states, base, slot_ids,
                        num_drafts, out, use_qk_l2norm, config, validate)
