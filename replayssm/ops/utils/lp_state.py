"""The Python boundary of conventional decoding with a low-precision state (every family's
`conventional_lp.py`): the state's formats, its parts as the kernels take them, and the rounding,
seed and step of its writes.

The state is `[N, HV, V, K]` in fp16, bf16 or scaled fp8-e4m3 (`formats.allocate`'s parts: the
elements, and for fp8 one fp32 scale per row of K), rewritten every step round-to-nearest or with
seeded stochastic rounding. A stochastic write of slot `s` at step `t` is bit for bit
`formats.encode(S, fmt, "stochastic", seed=seed, stream=s * 2**32 + t)` of the step's fp32
update `S` (`[1, HV, V, K]`, element index `(head * V + row) * K + col`), as the precision
kernels' high-precision writes (ops/utils/sround.py) with the step in place of the epoch.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .checks import check_tensor
from .lowp import LP_CODES, lp_views
from .sround import seed_key

__all__ = ["STATE_FORMATS", "ROUNDINGS", "state_size", "state_args", "row_chunk"]

STATE_FORMATS = ("fp16", "bf16", "fp8_e4m3")
ROUNDINGS = ("nearest", "stochastic")


def _parts(state, scales: Optional[Tensor], fmt: str) -> dict:
    """`state` as a dict of parts: a dict as is (no `scales` beside it), or the element tensor with
    `scales` for fp8."""
    if isinstance(state, dict):
        if scales is not None:
            raise ValueError("scales: the state is a dict of parts, which holds its own 'scale'")
        return state
    if fmt == "fp8_e4m3":
        if scales is None:
            raise ValueError("an fp8_e4m3 state needs its row scales: scales [N, HV, V] float32 "
                             "(or pass the dict of parts of formats.allocate)")
        return {"data": state, "scale": scales}
    if scales is not None:
        raise ValueError(f"scales: a {fmt} state has none (only fp8_e4m3 carries row scales)")
    return {"data": state}


def state_size(state) -> int:
    """The slot count `N` of a state (a tensor or a dict of parts), 0 when it has no 4-d data."""
    data = state.get("data") if isinstance(state, dict) else state
    return data.shape[0] if isinstance(data, Tensor) and data.dim() == 4 else 0


def state_args(state, scales: Optional[Tensor], fmt: str, rounding: str, seed: int, step,
               N: int, HV: int, V: int, K: int, *, device=None, validate: bool = True) -> dict:
    """The kernels' state arguments after checking every one (ValueError naming it):
    `s_data`, `s_scale` (integer views, `lowp.lp_views`), `sr_key`, `step` and the constexprs
    `SF` (the format code of `lowp.LP_CODES`), `SR` (stochastic rounding) and `USE_STEP_PTR`.
    `step` an int, or a one-element int32/int64 tensor on `device` that the kernel reads (a
    replayed CUDA graph then takes a new step each time; its value unchecked)."""
    step_ptr = isinstance(step, Tensor)
    if step_ptr:
        if validate:
            check_tensor("step", step, None, (torch.int32, torch.int64), device)
            if step.numel() != 1:
                raise ValueError(f"step: a tensor step holds one element, got shape {tuple(step.shape)}")
        tensor_step, step = step, 0
    if fmt not in STATE_FORMATS:
        hint = " (an fp32 state is conventional_decode's)" if fmt == "fp32" else ""
        raise ValueError(f"fmt {fmt!r} has no conventional low-precision kernel; expected one of "
                         f"{STATE_FORMATS}{hint}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding {rounding!r}; expected one of {ROUNDINGS}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed={seed!r} must be an int in [0, 2**64)")
    # the stream is slot * 2**32 + step: a step beyond 32 bits would alias the next slot's
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2 ** 32:
        raise ValueError(f"step={step!r} must be an int in [0, 2**32)")
    try:
        data, scale, _ = lp_views(_parts(state, scales, fmt), fmt, N, HV, V, K)
    except ValueError as e:
        raise ValueError(str(e).replace("ckpt_lp", "state")) from None
    return dict(s_data=data, s_scale=scale if scale is not None else data, sr_key=seed_key(seed),
                step=tensor_step if step_ptr else step, SF=LP_CODES[fmt], SR=rounding == "stochastic",
                USE_STEP_PTR=step_ptr)


def row_chunk(BV: int, BK: int, num_warps: int, RC: Optional[int] = None, *, SF: int = 1,
              SR: bool = False) -> int:
    """Rows a program encodes at once: `RC` when given (a power of two dividing `BV`), else up to
    16 elements per thread, 8 for fp8 (`SF` 3: float64 quotients) or stochastic rounding (64-bit
    uniforms), which keeps the encoding in registers (untuned: Triton 3.6 at the Mamba-2 table's
    BV 64, 8 warps: 104 registers for bf16 round-to-nearest at 8 elements, 174 at 16, fp8
    stochastic 120 at 4, 214 at 8, spilling at 16)."""
    if RC is None:
        per_thread = 8 if SR or SF == 3 else 16
        RC = 1
        while RC < BV and 2 * RC * BK <= per_thread * 32 * num_warps:
            RC *= 2
        return RC
    if isinstance(RC, bool) or not isinstance(RC, int) or RC < 1 or RC & (RC - 1) or BV % RC:
        raise ValueError(f"config RC={RC!r} must be a power of two dividing BV={BV}")
    return RC
