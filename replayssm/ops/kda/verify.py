"""ReplaySSM speculative verification for Kimi Delta Attention (channel-wise decay).

The kernel is the GDN one (`replayssm.ops.gdn.verify`) with `IS_KDA`: a token's log decay is a
`[K]` vector per value head, `buf_ld` is `[N, Lb, HV, K]`, and every decay weight scales the key
columns instead of a whole term.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..gdn.verify import run_verify

__all__ = ["replay_verify"]


def replay_verify(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                  dt_bias: Tensor, scale: Optional[float], ckpt: Tensor, buf_ld: Tensor,
                  buf_w: Tensor, buf_k: Tensor, cursor: Tensor, pending: Tensor, epoch: Tensor,
                  slot_ids: Tensor, window: int, num_drafts: Optional[Tensor] = None,
                  out: Optional[Tensor] = None, use_qk_l2norm: bool = True,
                  config: Optional[dict] = None, *, arrive: Optional[Tensor] = None,
                  validate: bool = True) -> Tensor:
    """Output-only verification of `T` tokens per row of a KDA layer, in one launch.

    As :func:`replayssm.ops.gdn.replay_verify`, except for the channel-wise decay:
    a: `[Bt, T, HV, K]` raw decay input, dt_bias: `[HV, K]`, A_log: `[HV]`
    (`log a = -exp(A_log)[:, None] * softplus(a + dt_bias)`), buf_ld: `[N, Lb, HV, K]` fp32.
    Other arguments: q, k `[Bt, T, Hk, K]`; v `[Bt, T, HV, V]`; b `[Bt, T, HV]`; ckpt
    `[N, HV, V, K]` fp32; buf_w `[N, Lb, HV, V]`; buf_k `[N, Lb, Hk, K]`; cursor, pending `[N]`
    int32; epoch `[N]` int64; slot_ids `[Bt]` (negative: padding); num_drafts `[Bt]` int32 or
    None. Returns `out` `[Bt, T, HV, V]`.
    """
    return run_verify("kda", q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k,
                      cursor, pending, epoch, slot_ids, window, num_drafts, out, use_qk_l2norm,
                      config, arrive, validate)
