"""Conventional KDA decoding on a low-precision state (`ops.gdn.conventional_lp`'s kernel,
specialised for the channel-wise decay)."""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..gdn.conventional_lp import conventional_decode_lp as _gdn_lp

__all__ = ["conventional_decode_lp"]


def conventional_decode_lp(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
                           scale: Optional[float], state, slot_ids: Tensor, fmt: str, out: Optional[Tensor] = None,
                           use_qk_l2norm: bool = True, config: Optional[dict] = None, *, rounding: str = "nearest",
                           seed: int = 0, step: int = 0, scales: Optional[Tensor] = None,
                           validate: bool = True) -> Tensor:
    """As :func:`replayssm.ops.gdn.conventional_decode_lp` for a KDA layer (a: `[Bt, HV, K]`,
    dt_bias: `[HV, K]`)."""
    return _gdn_lp(q, k, v, a, b, A_log, dt_bias, scale, state, slot_ids, fmt, out, use_qk_l2norm, config,
                   rounding=rounding, seed=seed, step=step, scales=scales, family="kda", validate=validate)
