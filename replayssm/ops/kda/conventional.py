"""Conventional (read-update-write) KDA decode, the baseline: the GDN conventional kernel with a
channel-wise decay (`S <- S Diag(a)`, `u = beta (v - S k)`, `S <- S + u k^T`, `o = S q`)."""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..gdn.conventional import run_conventional

__all__ = ["conventional_decode"]


def conventional_decode(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                        dt_bias: Tensor, scale: Optional[float], state: Tensor, slot_ids: Tensor,
                        out: Optional[Tensor] = None, use_qk_l2norm: bool = True,
                        config: Optional[dict] = None, *, validate: bool = True) -> Tensor:
    """One conventional KDA decode step on `state` `[N, HV, V, K]` fp32 (in place); returns `o`
    `[Bt, HV, V]`. a: `[Bt, HV, K]`, dt_bias: `[HV, K]`; otherwise as the GDN function."""
    return run_conventional("kda", q, k, v, a, b, A_log, dt_bias, scale, state, slot_ids, out,
                            use_qk_l2norm, config, validate)
