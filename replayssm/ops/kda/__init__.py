"""Kimi Delta Attention decode kernels: ReplaySSM standard decode and the conventional baseline
(custom ops `torch.ops.replayssm.kda_replay_decode`, `torch.ops.replayssm.kda_conventional_decode`).
The kernels are shared with GDN (`replayssm.ops.gdn`), specialised for the channel-wise decay.
"""
from __future__ import annotations

from typing import Optional

from ..gdn import SHAPES as _GDN_SHAPES
from ..gdn import simulate as _simulate
from ..gdn.conventional import conventional_config as _conventional_config
from ..gdn.decode import arrive_counter
from ..gdn.decode import eager_max_batch as _eager_max_batch
from ..gdn.decode import replay_config as _replay_config
from .conventional import conventional_decode
from .decode import replay_decode

__all__ = ["replay_decode", "conventional_decode", "replay_config", "conventional_config", "eager_max_batch",
           "arrive_counter", "simulate", "gpu_check"]

# Kimi-Linear-48B's KDA layers (32 heads of 128, one key head per value head, as in
# replayssm.traffic), plus a grouped-key stand-in at Qwen3.5-122B's shape for the Hk < HV path.
SHAPES = {"kimi-linear-48b": {"HV": 32, "Hk": 32, "V": 128, "K": 128},
          "gqa-122b-shape": dict(_GDN_SHAPES["qwen3.5-122b"])}


def replay_config(V: int, K: int, config: Optional[dict] = None, *, G: int = 1,
                  batch: Optional[int] = None) -> dict:
    """The launch config `replay_decode` uses for `V`, `K`, `G` value heads per key head and
    `batch` rows (with overrides)."""
    return _replay_config(V, K, config, family="kda", G=G, batch=batch)


def conventional_config(V: int, K: int, config: Optional[dict] = None, *,
                        batch: Optional[int] = None) -> dict:
    """The launch config `conventional_decode` (and the eager step) uses for `V`, `K` and
    `batch` rows (with overrides)."""
    return _conventional_config(V, K, config, family="kda", batch=batch)


def eager_max_batch(HV: int, V: int, K: int, Hk: int) -> int:
    """The largest batch for which the tables prefer the eager step (`replay_decode` with
    window 1) at this shape (0: never)."""
    return _eager_max_batch(HV, V, K, "kda")


def simulate(**kwargs) -> dict:
    """`replayssm.ops.gdn.simulate` for KDA."""
    return _simulate("kda", **kwargs)


def gpu_check(device="cuda", **kwargs) -> dict:
    """Errors of the KDA replay kernel (fp32 and bf16 records) and of the conventional kernel
    against the float64 reference at real shapes; see `replayssm.ops.gdn.gpu_check`."""
    from ..gdn import gpu_check as _gpu_check
    kwargs.setdefault("shapes", SHAPES)
    return _gpu_check(device, family="kda", **kwargs)
