"""Kimi Delta Attention decode kernels: ReplaySSM standard decode and the conventional baseline
(custom ops `torch.ops.replayssm.kda_replay_decode`, `torch.ops.replayssm.kda_conventional_decode`).
The kernels are shared with GDN (`replayssm.ops.gdn`), specialised for the channel-wise decay.
"""
from __future__ import annotations

from typing import Optional

from ..gdn.configs import conventional_config as _conventional_config
from ..gdn.configs import eager_max_batch as _eager_max_batch
from ..gdn.configs import replay_config as _replay_config
from ..gdn.verify_lp import lowp_verify as _lowp_verify
from ..utils.launch import arrive_counter
from .conventional import conventional_decode
from .conventional_lp import conventional_decode_lp
from .decode import replay_decode
from .snapshot import snapshot_commit, snapshot_verify
from .verify import replay_verify

__all__ = ["replay_decode", "conventional_decode", "replay_config", "conventional_config", "eager_max_batch",
           "arrive_counter", "replay_verify", "snapshot_verify", "snapshot_commit", "conventional_decode_lp",
           "lowp_verify"]


def replay_config(V: int, K: int, config: Optional[dict] = None, *, HG: int = 1,
                  batch: Optional[int] = None, G: Optional[int] = None) -> dict:
    """The launch config `replay_decode` uses for `V`, `K`, `HG` value heads per key head (`G`:
    its former name, still accepted) and `batch` rows (with overrides)."""
    return _replay_config(V, K, config, family="kda", HG=HG, batch=batch)


def conventional_config(V: int, K: int, config: Optional[dict] = None, *,
                        batch: Optional[int] = None) -> dict:
    """The launch config `conventional_decode` (and the eager step) uses for `V`, `K` and
    `batch` rows (with overrides)."""
    return _conventional_config(V, K, config, family="kda", batch=batch)


def eager_max_batch(HV: int, V: int, K: int, Hk: int) -> int:
    """The largest batch for which the tables prefer the eager step (`replay_decode` with
    window 1) at this shape (0: never)."""
    return _eager_max_batch(HV, V, K, "kda", Hk=Hk)


def lowp_verify(*args, **kwargs):
    """Verification of drafts on two checkpoints (SPEC section 5): `replayssm.ops.gdn.lowp_verify`
    with `family="kda"` (`a` `[Bt, T, HV, K]`, `dt_bias` `[HV, K]`, `buf_ld` `[N, Lb, HV, K]`)."""
    return _lowp_verify(*args, family="kda", **kwargs)
