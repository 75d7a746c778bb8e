"""KDA snapshot verify, the speculative-decoding baseline: the GDN snapshot kernel
(`ops/gdn/snapshot.py`) with the channel-wise decay (`S <- S Diag(a_t)`), one full state
written per draft token."""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..gdn.snapshot import run_snapshot
from ..utils.snapshot import snapshot_commit

__all__ = ["snapshot_verify", "snapshot_commit"]


def snapshot_verify(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                    dt_bias: Tensor, scale: Optional[float], states: Tensor, base: Tensor,
                    slot_ids: Tensor, num_drafts: Optional[Tensor] = None,
                    out: Optional[Tensor] = None, use_qk_l2norm: bool = True,
                    config: Optional[dict] = None, *, validate: bool = True) -> Tensor:
    """Verify T draft tokens of KDA the snapshot way; returns `o` `[Bt, T, HV, V]`.
    `a` `[Bt, T, HV, K]`, `dt_bias` `[HV, K]`; otherwise as the GDN function."""
    return run_snapshot("kda", q, k, v, a, b, A_log, dt_bias, scale, states, base, slot_ids,
                        num_drafts, out, use_qk_l2norm, config, validate)
