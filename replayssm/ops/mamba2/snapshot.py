"""Mamba-2 snapshot verify: the speculative-decoding baseline of serving engines today.

vLLM's `selective_state_update(..., num_accepted_tokens, ...)` verifies T draft tokens by the
conventional recurrence, token by token, writing the state after every draft to a slot of its
own (`ops/utils/snapshot.py`: `states [N, T1, HV, V, K]`, `base [N]`):

    S = states[s, base[s]];  for t < n:  S <- exp(dt_t A) S + (dt_t x_t) B_t^T,
    states[s, (base[s] + 1 + t) % T1] = S,  y_t = (S C_t + D x_t) * silu(z_t)

It is the conventional kernel (conventional.py) generalised to T tokens and kept as honest:
the same programs (`BV` rows of a slot's state seen as `[HV * V, K]`, K contiguous), the same
launch tables (`conventional_config`), each state element read once and written n times.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..utils.checks import check_slot_ids, check_slot_values
from ..utils.snapshot import check_snapshot_state, snapshot_commit, snapshot_launch, snapshot_overrides
from .common import OPTIONAL_INPUTS, check_tensor, check_token_inputs, given, head_values, softplus
from .configs import conventional_config

__all__ = ["snapshot_verify", "snapshot_commit"]


@triton.heuristics(dict(OPTIONAL_INPUTS, HAS_N=given("num_drafts")))
@triton.jit
def _snapshot_verify_kernel(
    x, dt, B, C, A, dt_bias, D, z, out, states, base, slot_ids, num_drafts,
    stride_x_b, stride_x_t, stride_x_h, stride_dt_b, stride_dt_t,
    stride_B_b, stride_B_t, stride_B_g, stride_C_b, stride_C_t, stride_C_g,
    stride_z_b, stride_z_t, stride_z_h, stride_o_b, stride_o_t, stride_o_h,
    T: tl.constexpr, T1: tl.constexpr, HV: tl.constexpr, Hk: tl.constexpr, V: tl.constexpr,
    K: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_N: tl.constexpr, PERHEAD: tl.constexpr,
):
    # A program owns BV consecutive rows of one slot's state seen as [HV * V, K], within one
    # group (BV divides a group's rows), as the conventional kernel's do.
    i_r = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1).to(tl.int64)
    i_g = (i_r * BV) // ((HV // Hk) * V)
    SLOT: tl.constexpr = HV * V * K

    o_r = i_r * BV + tl.arange(0, BV)
    o_h = o_r // V
    o_v = o_r % V
    o_k = tl.arange(0, BK)
    m_k = o_k < K

    p_o = out + i_b * stride_o_b + o_h * stride_o_h + o_v
    slot = tl.load(slot_ids + i_b).to(tl.int64)
    if slot < 0:
        for t in range(T):
            tl.store(p_o + t * stride_o_t, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty))
        return
    if HAS_N:
        n = tl.load(num_drafts + i_b)
    else:
        n = T
    b0 = tl.load(base + slot)
    p_S = states + slot * (T1 * SLOT) + o_r[:, None] * K + o_k[None, :]
    # the one read of the state: evict first, it must not push out the group's shared inputs
    p_R = p_S + b0.to(tl.int64) * SLOT
    if BK == K:
        b_S = tl.load(p_R, eviction_policy="evict_first")                              # [BV, BK]
    else:
        b_S = tl.load(p_R, mask=m_k[None, :], other=0.0, eviction_policy="evict_first")

    # token-independent per-row scalars, once. TWO (PERHEAD, BV <= V): the block spans at most
    # heads h_a and h_b, whose scalars are formed once each and selected per row
    TWO: tl.constexpr = PERHEAD and BV <= V
    h_a = (i_r * BV) // V
    h_b = tl.minimum(h_a + 1, HV - 1)
    in_b = o_h != h_a
    if TWO:
        bias_a = tl.load(dt_bias + h_a).to(tl.float32)
        bias_b = tl.load(dt_bias + h_b).to(tl.float32)
        A_a = tl.load(A + h_a).to(tl.float32)
        A_b = tl.load(A + h_b).to(tl.float32)
    else:
        b_bias = tl.load(dt_bias + o_h).to(tl.float32)
        b_A = tl.load(A + o_h).to(tl.float32)
    if HAS_D:
        b_d = head_values(D, o_h, h_a, h_b, in_b, TWO)

    for t in range(n):
        p_dt = dt + i_b * stride_dt_b + t * stride_dt_t
        if TWO:
            dt_a = softplus(tl.load(p_dt + h_a).to(tl.float32) + bias_a)
            dt_b = softplus(tl.load(p_dt + h_b).to(tl.float32) + bias_b)
            b_dt = tl.where(in_b, dt_b, dt_a)
            b_a = tl.where(in_b, tl.exp(dt_b * A_b), tl.exp(dt_a * A_a))
        else:
            b_dt = softplus(tl.load(p_dt + o_h).to(tl.float32) + b_bias)                 # [BV]
            b_a = tl.exp(b_dt * b_A)
        b_x = tl.load(x + i_b * stride_x_b + t * stride_x_t + o_h * stride_x_h + o_v).to(tl.float32)
        b_k = tl.load(B + i_b * stride_B_b + t * stride_B_t + i_g * stride_B_g + o_k, mask=m_k,
                      other=0.0).to(tl.float32)
        b_q = tl.load(C + i_b * stride_C_b + t * stride_C_t + i_g * stride_C_g + o_k, mask=m_k,
                      other=0.0).to(tl.float32)

        b_S = b_a[:, None] * b_S + (b_dt * b_x)[:, None] * b_k[None, :]
        # draft t's snapshot; T + 1 <= T1, so the slot read above is never among them
        p_W = p_S + ((b0 + 1 + t) % T1).to(tl.int64) * SLOT
        if BK == K:
            tl.store(p_W, b_S, eviction_policy="evict_first")
        else:
            tl.store(p_W, b_S, mask=m_k[None, :], eviction_policy="evict_first")

        b_y = tl.sum(b_S * b_q[None, :], axis=1)                                        # [BV]
        if HAS_D:
            b_y += b_d * b_x
        if HAS_Z:
            b_z = tl.load(z + i_b * stride_z_b + t * stride_z_t + o_h * stride_z_h + o_v).to(tl.float32)
            b_y = b_y * b_z / (1.0 + tl.exp(-b_z))
        tl.store(p_o + t * stride_o_t, b_y.to(p_o.dtype.element_ty))
    for t in range(n, T):
        tl.store(p_o + t * stride_o_t, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty))


def _launch(x, dt, B, C, A, dt_bias, D, z, states, base, slot_ids, num_drafts, out, BV,
            num_warps, num_stages, perhead) -> None:
    Bt, T, HV, V = x.shape
    Hk, K = B.shape[2], B.shape[3]
    if Bt == 0:
        return
    # D, z and num_drafts absent: None (the kernel's heuristics set HAS_D, HAS_Z, HAS_N)
    _snapshot_verify_kernel[(HV * V // BV, Bt)](
        x, dt, B, C, A, dt_bias, D, z, out, states, base, slot_ids, num_drafts,
        x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1),
        B.stride(0), B.stride(1), B.stride(2), C.stride(0), C.stride(1), C.stride(2),
        z.stride(0) if z is not None else 0, z.stride(1) if z is not None else 0,
        z.stride(2) if z is not None else 0, out.stride(0), out.stride(1), out.stride(2),
        T=T, T1=states.shape[1], HV=HV, Hk=Hk, V=V, K=K, BV=BV, BK=triton.next_power_of_2(K),
        PERHEAD=bool(perhead), num_warps=num_warps, num_stages=num_stages,
    )


def _check_draft_inputs(x, dt, B, C, A, dt_bias, D, z) -> tuple:
    """Shapes of a verify's inputs (`[Bt, T, ...]`): the leading dims here, the rest by the
    decode step's checks on token 0; returns (Bt, T, HV, V, Hk, K)."""
    named = (("x", x, 4, "[Bt, T, HV, V]"), ("dt", dt, 3, "[Bt, T, HV]"), ("B", B, 4, "[Bt, T, Hk, K]"),
             ("C", C, 4, "[Bt, T, Hk, K]")) + ((("z", z, 4, "[Bt, T, HV, V]"),) if z is not None else ())
    for name, t, dim, form in named:
        if not isinstance(t, Tensor) or t.dim() != dim:
            raise ValueError(f"{name}: expected {form}, got {getattr(t, 'shape', type(t).__name__)}")
    Bt, T = x.shape[0], x.shape[1]
    if T < 1:
        raise ValueError(f"x: expected T >= 1 draft tokens, got shape {tuple(x.shape)}")
    for name, t, _, _ in named[1:]:
        if tuple(t.shape[:2]) != (Bt, T):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected leading dims [Bt={Bt}, T={T}] as x")
    _, HV, V, Hk, K = check_token_inputs(x[:, 0], dt[:, 0], B[:, 0], C[:, 0], A, dt_bias, D,
                                         z[:, 0] if z is not None else None)
    return Bt, T, HV, V, Hk, K


def snapshot_verify(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, dt_bias: Tensor,
                    D: Optional[Tensor], z: Optional[Tensor], states: Tensor, base: Tensor,
                    slot_ids: Tensor, num_drafts: Optional[Tensor] = None,
                    out: Optional[Tensor] = None, config: Optional[dict] = None, *,
                    validate: bool = True) -> Tensor:
    """Verify T draft tokens the snapshot way; returns `out` `[Bt, T, HV, V]` (x's dtype).

    `x` `[Bt, T, HV, V]`, `dt` `[Bt, T, HV]` (raw), `B, C` `[Bt, T, Hk, K]`, `z` `[Bt, T, HV, V]`
    or None, `A, dt_bias, D` `[HV]` (D may be None). `states` `[N, T1, HV, V, K]` fp32
    contiguous with `T + 1 <= T1`, `base` `[N]` int32, `slot_ids` `[Bt]` (negative: padding row,
    zero output, nothing touched), `num_drafts` `[Bt]` int32 in `1..T` (None: T). Row b runs
    drafts `t < n_b` from `states[s, base[s]]`, writes the state after draft t to
    `states[s, (base[s] + 1 + t) % T1]`, and `out[b, t] = 0` for `t >= n_b`; `base` is moved by
    `snapshot_commit`. Launch config: the conventional kernel's (`configs.conventional_config`,
    with `utils.snapshot.snapshot_launch`); `config` overrides its `BV`, `num_warps`,
    `num_stages`, `perhead`. `validate=False`: no
    check and no host sync (capturable in a CUDA graph when `out` is given).
    """
    if validate:
        Bt, T, HV, V, Hk, K = _check_draft_inputs(x, dt, B, C, A, dt_bias, D, z)
        dev = x.device
        check_slot_ids(slot_ids, Bt, dev)
        N, _ = check_snapshot_state(states, base, slot_ids, num_drafts, Bt, T, HV, V, K, dev)
        if out is not None:
            check_tensor("out", out, (Bt, T, HV, V), (x.dtype,), dev, inner=True)
        check_slot_values(slot_ids, N)
        config = snapshot_overrides(config, extra=("perhead",))
    Bt, T, HV, V = x.shape
    cfg = snapshot_launch(conventional_config(HV, V, B.shape[3], B.shape[2], config, batch=Bt), T, config)
    if out is None:
        out = torch.empty_like(x)
    _launch(x, dt, B, C, A, dt_bias, D, z, states, base, slot_ids, num_drafts, out, cfg["BV"],
            cfg["num_warps"], cfg["num_stages"], cfg["perhead"])
    return out
