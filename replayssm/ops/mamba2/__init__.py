"""Mamba-2 Triton kernels: ReplaySSM standard decode and the conventional baseline.

`replay_decode` (decode.py) and `conventional_decode` (conventional.py) are the public entry
points; both are also registered as torch custom ops (`torch.ops.replayssm.mamba2_replay_decode`,
`torch.ops.replayssm.mamba2_conventional_decode`, and `mamba2_eager_decode` for window 1) so
that they compose with torch.compile. `conventional_decode_lp` (conventional_lp.py) is the
conventional step on a bf16, fp16 or fp8 state, the engines' low-precision baseline. Launch tables in configs.py; device helpers and boundary
checks shared by both kernels in common.py; the Gluon kernel in gluon_decode.py. `lowp_verify`
(verify_lp.py) verifies drafts on two checkpoints (an fp32 or stochastically rounded one and a
low-precision copy, SPEC section 5). The harness
that runs them against the float64 reference is `replayssm.testing.mamba2_harness`.
"""
from __future__ import annotations

from .configs import CONVENTIONAL_CONFIGS, REPLAY_CONFIGS, eager_max_batch
from .conventional import conventional_decode
from .conventional_lp import conventional_decode_lp
from .decode import replay_decode
from .snapshot import snapshot_commit, snapshot_verify
from .verify import replay_verify
from .verify_lp import lowp_verify

__all__ = ["replay_decode", "replay_verify", "lowp_verify", "conventional_decode", "conventional_decode_lp",
           "snapshot_verify", "snapshot_commit", "eager_max_batch", "REPLAY_CONFIGS", "CONVENTIONAL_CONFIGS"]
