"""Mamba-2 conventional decode: read, update and write the whole fp32 state every step.

The baseline ReplaySSM replaces, with the semantics of vLLM's / mamba_ssm's
`selective_state_update` (slot-indexed state pool, padding rows skipped):

    dt = softplus(dt_raw + dt_bias);  S_s <- exp(dt A) S_s + (dt x) B^T;  y = S_s C + D x;  y *= silu(z)

It is kept honest: one program streams `BV` consecutive rows of a slot's state seen as
`[HV * V, K]` (K contiguous, so each thread issues wide loads; BV > V covers several heads in
one program), reads them once and writes them once; the launch config is a per-shape table
(configs.CONVENTIONAL_CONFIGS), like the replay kernel's.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..utils.checks import check_slot_ids
from ..utils.cursor import eager_bookkeeping, fold_pending
from ..utils.launch import eager_launch_overrides
from .common import OPTIONAL_INPUTS, check_slots, check_tensor, check_token_inputs, head_values, softplus
from .configs import conventional_config, eager_config

__all__ = ["conventional_decode", "eager_decode"]


@triton.jit
def _head_decays(r_a, r_b, A_a, A_b, in_b):
    """`dt = softplus(raw)` and the decay `exp(dt A)` of two heads (scalars), selected per row
    (`in_b`: the row belongs to the second head)."""
    dt_a = softplus(r_a)
    dt_b = softplus(r_b)
    return tl.where(in_b, dt_b, dt_a), tl.where(in_b, tl.exp(dt_b * A_b), tl.exp(dt_a * A_a))


@triton.heuristics(OPTIONAL_INPUTS)
@triton.jit
def _conventional_decode_kernel(
    x, dt, B, C, A, dt_bias, D, z, out, state, slot_ids,
    buf_ld, buf_w, buf_k, cursor, epoch, arrive,
    stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
    stride_z_b, stride_z_h, stride_o_b, stride_o_h,
    HV: tl.constexpr, Hk: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
    BV: tl.constexpr, BK: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    FOLD: tl.constexpr, LB: tl.constexpr, PERHEAD: tl.constexpr,
):
    # FOLD: the eager step of ReplaySSM state (window 1, see decode.replay_decode): `state` is
    # the checkpoint, records still pending behind the slot's cursor are folded into the tile
    # first, and the step flushes (cursor 0, epoch + 1). Otherwise the plain conventional step.
    # A program owns BV consecutive rows of a slot's state seen as [HV * V, K]: it may span
    # several heads (BV > V) or part of one, but never two groups (BV divides a group's rows),
    # so that B and C are one vector per program.
    i_r = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1).to(tl.int64)
    i_g = (i_r * BV) // ((HV // Hk) * V)

    o_r = i_r * BV + tl.arange(0, BV)
    o_h = o_r // V
    o_v = o_r % V
    o_k = tl.arange(0, BK)
    m_k = o_k < K

    p_o = out + i_b * stride_o_b + o_h * stride_o_h + o_v
    slot = tl.load(slot_ids + i_b).to(tl.int64)
    if slot < 0:
        tl.store(p_o, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty))
        return

    p_S = state + slot * (HV * V * K) + o_r[:, None] * K + o_k[None, :]
    if FOLD:
        h = tl.load(cursor + slot)
        e0 = tl.load(epoch + slot)
    # the state is streamed once: keep it from evicting the inputs shared by a group's heads
    if BK == K:
        b_S = tl.load(p_S, eviction_policy="evict_first")                              # [BV, BK]
    else:
        b_S = tl.load(p_S, mask=m_k[None, :], other=0.0, eviction_policy="evict_first")

    # the token's dt (raw), A and D. PERHEAD (BV <= V): the block spans at most two heads, h_a
    # and h_b, whose scalars are selected per row (the softplus and exp then run twice per
    # thread, not once per row the thread holds); else per row
    TWO: tl.constexpr = PERHEAD and BV <= V
    h_a = (i_r * BV) // V
    h_b = tl.minimum(h_a + 1, HV - 1)
    in_b = o_h != h_a
    if TWO:
        r_a = tl.load(dt + i_b * stride_dt_b + h_a).to(tl.float32) + tl.load(dt_bias + h_a).to(tl.float32)
        r_b = tl.load(dt + i_b * stride_dt_b + h_b).to(tl.float32) + tl.load(dt_bias + h_b).to(tl.float32)
        A_a = tl.load(A + h_a).to(tl.float32)
        A_b = tl.load(A + h_b).to(tl.float32)
        if not FOLD:
            b_dt, b_a = _head_decays(r_a, r_b, A_a, A_b, in_b)
    else:
        b_dt = tl.load(dt + i_b * stride_dt_b + o_h).to(tl.float32) + tl.load(dt_bias + o_h).to(tl.float32)
        if not FOLD:
            b_dt = softplus(b_dt)                                                       # [BV]
            b_a = tl.exp(b_dt * tl.load(A + o_h).to(tl.float32))
        else:
            b_A = tl.load(A + o_h).to(tl.float32)
    b_x = tl.load(x + i_b * stride_x_b + o_h * stride_x_h + o_v).to(tl.float32)
    b_k = tl.load(B + i_b * stride_B_b + i_g * stride_B_g + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_q = tl.load(C + i_b * stride_C_b + i_g * stride_C_g + o_k, mask=m_k, other=0.0).to(tl.float32)
    if FOLD:
        # every load issued before the branch, which waits for them all at once
        if HAS_D:
            b_d = head_values(D, o_h, h_a, h_b, in_b, TWO)
        if HAS_Z:
            b_z = tl.load(z + i_b * stride_z_b + o_h * stride_z_h + o_v).to(tl.float32)
        if h > 0:
            if TWO:
                b_Ar = tl.where(in_b, A_b, A_a)
            else:
                b_Ar = b_A
            # the tile re-read (an L1/L2 hit), so that the loaded one is dead in here
            b_S = fold_pending(tl.load(p_S, mask=m_k[None, :], other=0.0), h,
                               buf_ld + slot * (LB * HV) + o_h, buf_w + slot * (LB * HV * V) + o_r,
                               buf_k + slot * (LB * Hk * K) + i_g * K + o_k, HV, HV * V, Hk * K,
                               o_r >= 0, m_k, 1, b_Ar)
        if TWO:
            b_dt, b_a = _head_decays(r_a, r_b, A_a, A_b, in_b)
        else:
            b_dt = softplus(b_dt)
            b_a = tl.exp(b_dt * b_A)

    b_S = b_a[:, None] * b_S + (b_dt * b_x)[:, None] * b_k[None, :]
    if BK == K:
        tl.store(p_S, b_S.to(p_S.dtype.element_ty), eviction_policy="evict_first")
    else:
        tl.store(p_S, b_S.to(p_S.dtype.element_ty), mask=m_k[None, :], eviction_policy="evict_first")

    b_y = tl.sum(b_S * b_q[None, :], axis=1)                                            # [BV]
    if HAS_D:
        if not FOLD:
            b_d = head_values(D, o_h, h_a, h_b, in_b, TWO)
        b_y += b_d * b_x
    if HAS_Z:
        if not FOLD:
            b_z = tl.load(z + i_b * stride_z_b + o_h * stride_z_h + o_v).to(tl.float32)
        b_y = b_y * b_z / (1.0 + tl.exp(-b_z))
    tl.store(p_o, b_y.to(p_o.dtype.element_ty))
    if FOLD:
        eager_bookkeeping(arrive, cursor, epoch, slot, h, e0, i_r == 0, HV * V // BV)


def _launch_conventional(x, dt, B, C, A, dt_bias, D, z, state, slot_ids, out, BV, num_warps,
                         num_stages, perhead=False, pending=None):
    """The conventional step on `state`; with `pending` = `(buf_ld, buf_w, buf_k, cursor,
    epoch, arrive)` the eager step on ReplaySSM state (`state` is then the checkpoint)."""
    Bt, HV, V = x.shape
    Hk, K = B.shape[1], B.shape[2]
    if Bt == 0:
        return
    grid = (HV * V // BV, Bt)
    fold = pending is not None
    # without pending records any pointers stand in, FOLD keeps them unread (None would drop
    # them from the signature, and that moves the other parameters); D and z absent: None (the
    # heuristics set HAS_D, HAS_Z)
    buf_ld, buf_w, buf_k, cursor, epoch, arrive = pending if fold else (state, state, state, slot_ids,
                                                                        slot_ids, slot_ids)
    _conventional_decode_kernel[grid](
        x=x, dt=dt, B=B, C=C, A=A, dt_bias=dt_bias, D=D, z=z, out=out, state=state, slot_ids=slot_ids,
        buf_ld=buf_ld, buf_w=buf_w, buf_k=buf_k, cursor=cursor, epoch=epoch, arrive=arrive,
        stride_x_b=x.stride(0), stride_x_h=x.stride(1), stride_dt_b=dt.stride(0),
        stride_B_b=B.stride(0), stride_B_g=B.stride(1), stride_C_b=C.stride(0), stride_C_g=C.stride(1),
        stride_z_b=z.stride(0) if z is not None else 0, stride_z_h=z.stride(1) if z is not None else 0,
        stride_o_b=out.stride(0), stride_o_h=out.stride(1),
        HV=HV, Hk=Hk, V=V, K=K, BV=BV, BK=triton.next_power_of_2(K),
        FOLD=fold, LB=pending[0].shape[1] if fold else 1,
        PERHEAD=bool(perhead), num_warps=num_warps, num_stages=num_stages,
    )


@torch.library.custom_op("replayssm::mamba2_conventional_decode", mutates_args=("out", "state"))
def _conventional_decode_op(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor,
                            dt_bias: Tensor, D: Optional[Tensor], z: Optional[Tensor],
                            state: Tensor, slot_ids: Tensor, out: Tensor, BV: int,
                            num_warps: int, num_stages: int, perhead: bool) -> None:
    _launch_conventional(x, dt, B, C, A, dt_bias, D, z, state, slot_ids, out, BV, num_warps,
                         num_stages, perhead)


@_conventional_decode_op.register_fake
def _(x, dt, B, C, A, dt_bias, D, z, state, slot_ids, out, BV, num_warps, num_stages, perhead) -> None:
    return None


@torch.library.custom_op("replayssm::mamba2_eager_decode",
                         mutates_args=("out", "ckpt", "cursor", "epoch", "arrive"))
def _eager_decode_op(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, dt_bias: Tensor,
                     D: Optional[Tensor], z: Optional[Tensor], ckpt: Tensor, buf_ld: Tensor,
                     buf_w: Tensor, buf_k: Tensor, cursor: Tensor, epoch: Tensor, arrive: Tensor,
                     slot_ids: Tensor, out: Tensor, BV: int, num_warps: int, num_stages: int,
                     perhead: bool) -> None:
    _launch_conventional(x, dt, B, C, A, dt_bias, D, z, ckpt, slot_ids, out, BV, num_warps,
                         num_stages, perhead, pending=(buf_ld, buf_w, buf_k, cursor, epoch, arrive))


@_eager_decode_op.register_fake
def _(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids,
      out, BV, num_warps, num_stages, perhead) -> None:
    return None


def eager_decode(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive,
                 slot_ids, out, config) -> Tensor:
    """The eager step (`replay_decode` with window 1), inputs already validated: the
    conventional kernel on the checkpoint, with the launch config of EAGER_CONFIGS at this batch
    (else the conventional table's; the `BV`, `num_warps`, `num_stages` of `config` override
    it), after folding each row's pending records; every row flushes."""
    HV, V, Hk, K = x.shape[1], x.shape[2], B.shape[1], B.shape[2]
    over = eager_launch_overrides(eager_config(HV, V, K, Hk, x.shape[0]), config)
    cfg = conventional_config(HV, V, K, Hk, over, batch=x.shape[0])
    if torch.compiler.is_compiling():
        torch.ops.replayssm.mamba2_eager_decode(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w,
                                                buf_k, cursor, epoch, arrive, slot_ids, out,
                                                cfg["BV"], cfg["num_warps"], cfg["num_stages"],
                                                bool(cfg["perhead"]))
    else:
        _launch_conventional(x, dt, B, C, A, dt_bias, D, z, ckpt, slot_ids, out, cfg["BV"],
                             cfg["num_warps"], cfg["num_stages"], cfg["perhead"],
                             pending=(buf_ld, buf_w, buf_k, cursor, epoch, arrive))
    return out


def conventional_decode(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, dt_bias: Tensor,
                        D: Optional[Tensor], z: Optional[Tensor], state: Tensor, slot_ids: Tensor,
                        out: Optional[Tensor] = None, config: Optional[dict] = None, *,
                        validate: bool = True) -> Tensor:
    """One conventional Mamba-2 decode step, updating `state` in place; returns `y`.

    Inputs as in `replay_decode`; `state` `[N, HV, V, K]` fp32, contiguous. `slot_ids` `[Bt]`
    (negative: padding row, `y[b] = 0`, state untouched). `out` `[Bt, HV, V]` of x's dtype.
    `config`: overrides of CONVENTIONAL_CONFIGS (`BV` rows of `[HV * V, K]` per program, a
    power of two dividing a group's `HV // Hk * V` rows; `num_warps`; `num_stages`; `perhead`:
    with BV <= V, dt, decay and D formed once for each of the block's at most two heads).
    `validate`: as in `replay_decode` (slot ids' values checked, a host sync on the device
    except during graph capture or tracing); False skips every check.
    """
    if validate:
        Bt, HV, V, Hk, K = check_token_inputs(x, dt, B, C, A, dt_bias, D, z)
        dev = x.device
        if not isinstance(state, torch.Tensor) or state.dim() != 4:
            raise ValueError(f"state: expected [N, HV, V, K], got {getattr(state, 'shape', type(state).__name__)}")
        N = state.shape[0]
        check_tensor("state", state, (N, HV, V, K), (torch.float32,), dev, contiguous=True)
        check_slot_ids(slot_ids, Bt, dev)
        if out is not None:
            check_tensor("out", out, (Bt, HV, V), (x.dtype,), dev, inner=True)
        check_slots(slot_ids, N)
    cfg = conventional_config(x.shape[1], x.shape[2], B.shape[2], B.shape[1], config, batch=x.shape[0])
    if out is None:
        out = torch.empty_like(x)
    args = (x, dt, B, C, A, dt_bias, D, z, state, slot_ids, out, cfg["BV"], cfg["num_warps"],
            cfg["num_stages"], bool(cfg["perhead"]))
    if torch.compiler.is_compiling():
        torch.ops.replayssm.mamba2_conventional_decode(*args)
    else:
        _launch_conventional(*args)
    return out
