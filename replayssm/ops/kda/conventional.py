"""Conventional (read-update-write) KDA decode, the baseline: the GDN conventional kernel with a
channel-wise decay (`S <- S Diag(a)`, `u = beta (v - S k)`, `S <- S + u k^T`, `o = S q`)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..gdn.conventional import launch_conventional, prepare_conventional

__all__ = ["conventional_decode"]


@torch.library.custom_op("replayssm::kda_conventional_decode", mutates_args=("o", "state"))
def _kda_conventional_decode_op(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
                                A_log: Tensor, dt_bias: Tensor, scale: float, state: Tensor,
                                slot_ids: Tensor, o: Tensor, use_qk_l2norm: bool, BV: int,
                                num_warps: int, num_stages: int) -> None:
    launch_conventional("kda", q, k, v, a, b, A_log, dt_bias, scale, state, slot_ids, o,
                        use_qk_l2norm, BV, num_warps, num_stages)


@_kda_conventional_decode_op.register_fake
def _(q, k, v, a, b, A_log, dt_bias, scale, state, slot_ids, o, use_qk_l2norm, BV, num_warps,
      num_stages) -> None:
    return None


def conventional_decode(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                        dt_bias: Tensor, scale: Optional[float], state: Tensor, slot_ids: Tensor,
                        out: Optional[Tensor] = None, use_qk_l2norm: bool = True,
                        config: Optional[dict] = None, *, validate: bool = True) -> Tensor:
    """One conventional KDA decode step on `state` `[N, HV, V, K]` fp32 (in place); returns `o`
    `[Bt, HV, V]`. a: `[Bt, HV, K]`, dt_bias: `[HV, K]`; otherwise as the GDN function."""
    scale, out, cfg = prepare_conventional("kda", q, k, v, a, b, A_log, dt_bias, scale, state,
                                           slot_ids, out, config, validate)
    torch.ops.replayssm.kda_conventional_decode(
        q, k, v, a, b, A_log, dt_bias, scale, state, slot_ids, out, bool(use_qk_l2norm),
        cfg["BV"], cfg["num_warps"], cfg["num_stages"])
    return out
