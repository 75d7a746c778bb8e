"""Mamba-2 conventional decode with a low-precision state: the baseline serving engines offer
(a bf16 or fp16 state, or fp8 with scales), as a kernel, to set against ReplaySSM's separate
precisions (SPEC section 5).

Each step reads the state in its format, updates it in fp32 with the arithmetic of the fp32
conventional kernel (conventional.py), computes `y` from the fp32 update, and writes the update
back in the format: round-to-nearest (`formats.encode(S, fmt)` bit for bit, ops/utils/lowp.py) or
seeded stochastic rounding (`formats.encode(S, fmt, "stochastic", seed, stream=slot * 2**32 +
step)` bit for bit, ops/utils/sround.py). The rounding feeds back into the next step's state:
this is the design whose error SPEC section 5 models.

A program owns `BV` consecutive rows of a slot's state seen as `[HV * V, K]` (the conventional
table's blocks, which never span two groups), and works through them in chunks of `RC` rows, so
that the integer work of the encoding stays in registers. An fp8 row's scale covers all of K, so
every row is encoded where it is computed.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..utils.checks import check_devices, check_slot_ids
from ..utils.lowp import load_lp_tile, store_lp_rows
from ..utils.lp_state import STATE_FORMATS, row_chunk, state_args, state_size
from ..utils.sround import store_sr_rows
from .common import OPTIONAL_INPUTS, check_slots, check_tensor, check_token_inputs, softplus
from .configs import conventional_config

__all__ = ["conventional_decode_lp", "STATE_FORMATS"]


@triton.heuristics(OPTIONAL_INPUTS)
@triton.jit
def _conventional_lp_kernel(
    x, dt, B, C, A, dt_bias, D, z, out, s_data, s_scale, slot_ids, sr_key, step,
    stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
    stride_z_b, stride_z_h, stride_o_b, stride_o_h,
    HV: tl.constexpr, Hk: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
    BV: tl.constexpr, BK: tl.constexpr, RC: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    SF: tl.constexpr, SR: tl.constexpr, USE_STEP_PTR: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1).to(tl.int64)
    i_g = (i_r * BV) // ((HV // Hk) * V)
    o_k = tl.arange(0, BK)
    m_k = o_k < K

    slot = tl.load(slot_ids + i_b).to(tl.int64)
    if slot < 0:
        o_r = i_r * BV + tl.arange(0, BV)
        p_o = out + i_b * stride_o_b + (o_r // V) * stride_o_h + o_r % V
        tl.store(p_o, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty))
        return

    b_k = tl.load(B + i_b * stride_B_b + i_g * stride_B_g + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_q = tl.load(C + i_b * stride_C_b + i_g * stride_C_g + o_k, mask=m_k, other=0.0).to(tl.float32)
    # the slot's state as one matrix of HV * V rows: the helpers' row index is then the flat
    # row, and the stochastic rounding's element index (head * V + row) * K + col
    if USE_STEP_PTR:
        st = slot * 4294967296 + tl.load(step).to(tl.int64)
    else:
        st = slot * 4294967296 + step
    for r0 in tl.static_range(0, BV, RC):
        o_r = i_r * BV + r0 + tl.arange(0, RC)
        m_r = o_r >= 0
        o_h = o_r // V
        o_v = o_r % V
        b_S = load_lp_tile(s_data, s_scale, s_scale, slot, o_r, m_r, o_k, m_k, V * HV, K, SF)   # [RC, BK]
        # the fp32 conventional kernel's arithmetic, so that both write the same fp32 update
        b_dt = softplus(tl.load(dt + i_b * stride_dt_b + o_h).to(tl.float32)
                        + tl.load(dt_bias + o_h).to(tl.float32))
        b_a = tl.exp(b_dt * tl.load(A + o_h).to(tl.float32))
        b_x = tl.load(x + i_b * stride_x_b + o_h * stride_x_h + o_v).to(tl.float32)
        b_S = b_a[:, None] * b_S + (b_dt * b_x)[:, None] * b_k[None, :]
        if SR:
            store_sr_rows(b_S, s_data, s_scale, slot, 0, o_r, m_r, o_k, m_k, sr_key, st, V * HV, K, SF)
        else:
            store_lp_rows(b_S, s_data, s_scale, slot, o_r, m_r, o_k, m_k, V * HV, K, SF)
        b_y = tl.sum(b_S * b_q[None, :], axis=1)                                        # [RC]
        if HAS_D:
            b_y += tl.load(D + o_h).to(tl.float32) * b_x
        if HAS_Z:
            b_z = tl.load(z + i_b * stride_z_b + o_h * stride_z_h + o_v).to(tl.float32)
            b_y = b_y * b_z / (1.0 + tl.exp(-b_z))
        p_o = out + i_b * stride_o_b + o_h * stride_o_h + o_v
        tl.store(p_o, b_y.to(p_o.dtype.element_ty))


def conventional_decode_lp(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, dt_bias: Tensor,
                           D: Optional[Tensor], z: Optional[Tensor], state, slot_ids: Tensor, fmt: str,
                           out: Optional[Tensor] = None, config: Optional[dict] = None, *,
                           rounding: str = "nearest", seed: int = 0, step: Union[int, Tensor] = 0,
                           scales: Optional[Tensor] = None, validate: bool = True) -> Tensor:
    """One conventional Mamba-2 decode step on a low-precision state, in place; returns `y`.

    Token inputs, `slot_ids` (negative: a padding row, `y[b] = 0`, no state touched), `out` and
    `validate` as :func:`conventional_decode`. `state`: the `[N, HV, V, K]` state in `fmt`, one of
    `STATE_FORMATS` ("fp16", "bf16", "fp8_e4m3"): the dict of parts of `formats.allocate(fmt,
    [N, HV, V, K])`, or the element tensor (float16, bfloat16, float8_e4m3fn) with, for fp8, its
    row scales `scales` `[N, HV, V]` float32 (`formats.encode`'s "scale": `element * scale` is the
    value). Contiguous. The new state is written `rounding="nearest"` (round half to even) or
    `"stochastic"`: `formats.encode(S, fmt, "stochastic", seed=seed, stream=slot * 2**32 + step)`
    of the step's fp32 update, bit for bit (`step` an int in `[0, 2**32)`, e.g. the token
    position; the same `(seed, step, slot)` gives the same random numbers on every device; or a
    one-element int32/int64 tensor on the inputs' device holding it, which the kernel reads, so
    that a replayed CUDA graph takes a new step each time: its value is not checked).
    `config`: overrides of the conventional table (`BV`, `num_warps`, `num_stages`; `perhead` is
    accepted and ignored) and `RC`, rows encoded at once (a power of two dividing `BV`).
    """
    N = state_size(state)
    if validate:
        Bt, HV, V, Hk, K = check_token_inputs(x, dt, B, C, A, dt_bias, D, z)
        dev = x.device
        check_slot_ids(slot_ids, Bt, dev)
        if out is not None:
            check_tensor("out", out, (Bt, HV, V), (x.dtype,), dev, inner=True)
        parts = state if isinstance(state, dict) else {"data": state, "scale": scales}
        check_devices(x=x, state=parts.get("data"), scales=parts.get("scale"))
    Bt, HV, V = x.shape
    Hk, K = B.shape[1], B.shape[2]
    st = state_args(state, scales, fmt, rounding, seed, step, N, HV, V, K, device=x.device, validate=validate)
    if validate:
        check_slots(slot_ids, N)
    over = dict(config or {})
    rc = over.pop("RC", None)
    cfg = conventional_config(HV, V, K, Hk, over or None, batch=Bt)
    BV, BK = cfg["BV"], triton.next_power_of_2(K)
    rc = row_chunk(BV, BK, cfg["num_warps"], rc, SF=st["SF"], SR=st["SR"])
    if out is None:
        out = torch.empty_like(x)
    if Bt == 0:
        return out
    _conventional_lp_kernel[(HV * V // BV, Bt)](
        x=x, dt=dt, B=B, C=C, A=A, dt_bias=dt_bias, D=D, z=z, out=out, slot_ids=slot_ids, **st,
        stride_x_b=x.stride(0), stride_x_h=x.stride(1), stride_dt_b=dt.stride(0),
        stride_B_b=B.stride(0), stride_B_g=B.stride(1), stride_C_b=C.stride(0), stride_C_g=C.stride(1),
        stride_z_b=z.stride(0) if z is not None else 0, stride_z_h=z.stride(1) if z is not None else 0,
        stride_o_b=out.stride(0), stride_o_h=out.stride(1),
        HV=HV, Hk=Hk, V=V, K=K, BV=BV, BK=BK, RC=rc,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
