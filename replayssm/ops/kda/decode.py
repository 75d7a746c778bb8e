"""ReplaySSM standard decode for Kimi Delta Attention (channel-wise decay).

The kernel is the GDN one (`replayssm.ops.gdn.decode`) with `IS_KDA`: the log decay of a token
is a `[K]` vector per value head, `buf_ld` is `[N, Lb, HV, K]`, and every decay weight scales the
key columns (`C Diag(g)`, `g * k_j`) instead of multiplying a whole term (SPEC section 2).
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..gdn.decode import run_replay

__all__ = ["replay_decode"]


def replay_decode(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                  dt_bias: Tensor, scale: Optional[float], ckpt: Tensor, buf_ld: Tensor,
                  buf_w: Tensor, buf_k: Tensor, cursor: Tensor, epoch: Tensor, slot_ids: Tensor,
                  window: int, out: Optional[Tensor] = None, use_qk_l2norm: bool = True,
                  config: Optional[dict] = None, *, arrive: Optional[Tensor] = None,
                  validate: bool = True) -> Tensor:
    """One ReplaySSM standard-decode step of a KDA layer, in one launch (docs/state-layout.md).

    As :func:`replayssm.ops.gdn.replay_decode`, except for the channel-wise decay:
    a: `[Bt, HV, K]` raw decay input, dt_bias: `[HV, K]`, A_log: `[HV]`
    (`log a = -exp(A_log)[:, None] * softplus(a + dt_bias)`), buf_ld: `[N, Lb, HV, K]` fp32.
    Other arguments: q, k `[Bt, Hk, K]`; v `[Bt, HV, V]`; b `[Bt, HV]`; ckpt `[N, HV, V, K]` fp32;
    buf_w `[N, Lb, HV, V]`; buf_k `[N, Lb, Hk, K]`; cursor `[N]` int32; epoch `[N]` int64;
    slot_ids `[Bt]` (negative: padding). Returns `out` `[Bt, HV, V]`.
    """
    return run_replay("kda", q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k,
                      cursor, epoch, slot_ids, window, out, use_qk_l2norm, config, arrive, validate)
