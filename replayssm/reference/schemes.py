"""The schemes ReplaySSM replaces, kept as baselines for tests and studies.

- conventional decode: read-update-write of the whole state every token (`params.step`);
- snapshot-per-draft verification (serving engines today): every draft's state is written
  out, and the commit keeps the snapshot of the last accepted token;
- the naive shared low-precision state: the conventional recurrence whose state is stored in
  a low-precision format after every token, so rounding error feeds back (SPEC section 5).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..formats import quantize


def snapshot_verify(params, S: Tensor, **inputs: Tensor):
    """Verify `T` tokens by running the recurrence and writing one state per draft.

    `S`: `[b, HV, V, K]`; inputs `[b, T, ...]`. Returns `(Y [b, T, HV, V], snaps [b, T, HV, V, K])`.
    """
    T = next(iter(inputs.values())).shape[1]
    ys, snaps = [], []
    for s in range(T):
        y, S = params.step(S, **{name: t[:, s] for name, t in inputs.items()})
        ys.append(y)
        snaps.append(S)
    return torch.stack(ys, 1), torch.stack(snaps, 1)


def snapshot_commit(snaps: Tensor, accepted: Tensor) -> Tensor:
    """The state after `accepted[b]` tokens (`1..T`): the snapshot of the last accepted one."""
    idx = (accepted.long() - 1).to(snaps.device)
    return snaps[torch.arange(snaps.shape[0], device=snaps.device), idx]


def shared_lowp_step(params, S: Tensor, fmt: str, rounding: str = "nearest", *, seed: int = 0,
                     stream: Optional[Tensor] = None, **inputs: Tensor):
    """One conventional step whose new state is stored in `fmt` (read back on the next step)."""
    y, S = params.step(S, **inputs)
    return y, quantize(S, fmt, rounding, seed=seed, stream=stream)
