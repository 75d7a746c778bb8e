"""Gated DeltaNet decode kernels: ReplaySSM standard decode and the conventional baseline.

`replay_decode` keeps the state as checkpoint + ring buffer (docs/state-layout.md);
`conventional_decode` reads, updates and writes the full state every step
(`conventional_decode_lp`: the same on a bf16, fp16 or fp8 state, GDN or KDA). Both are also
registered as torch custom ops (`torch.ops.replayssm.gdn_replay_decode`,
`torch.ops.replayssm.gdn_conventional_decode`) for torch.compile and CUDA graphs.

Modules: `configs` (launch tables), `common` (the token loads both kernels share, the checks at
the Python boundary), `conventional` (the conventional kernel and the eager step), `decode`
(the replay kernels), `gluon_decode` (the Gluon replay kernel, GPU only), `verify_lp`
(`lowp_verify`: drafts verified on two checkpoints, SPEC section 5, GDN or KDA). KDA
(`replayssm.ops.kda`) builds on these; the harness that runs them against the float64
reference is `replayssm.testing.delta_harness`.
"""
from __future__ import annotations

from ..utils.launch import arrive_counter
from .configs import conventional_config, replay_config
from .configs import eager_max_batch as _eager_max_batch
from .conventional import conventional_decode
from .conventional_lp import conventional_decode_lp
from .decode import replay_decode
from .snapshot import snapshot_commit, snapshot_verify
from .verify import replay_verify
from .verify_lp import lowp_verify

__all__ = ["replay_decode", "conventional_decode", "conventional_decode_lp", "replay_config", "conventional_config",
           "eager_max_batch", "arrive_counter", "replay_verify", "lowp_verify", "snapshot_verify",
           "snapshot_commit"]


def eager_max_batch(HV: int, V: int, K: int, Hk: int) -> int:
    """The largest batch for which the tables prefer the eager step (`replay_decode` with
    window 1) at this shape (0: never). The slot pool decodes such batches with window 1."""
    return _eager_max_batch(HV, V, K, "gdn", Hk=Hk)
