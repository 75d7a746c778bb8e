"""Gated DeltaNet decode step in plain PyTorch, with the real layer's input conventions
(Qwen3.5 / Qwen3-Next).

Per value head the state is `S`: `[V, K]`. Per token: `q, k` L2-normalised, `q` scaled by
`scale` (default `K^-0.5`); `a = exp(-exp(A_log) * softplus(a_raw + dt_bias))`,
`beta = sigmoid(b_raw)`; `S <- a S (I - beta k k^T) + beta v k^T`, `o = S q`. Written in the
outer-product form of SPEC section 1: `u = beta (v - a S k)`, `S <- a S + u k^T`.
`HV` value heads share `Hk` key/query heads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import expand_heads, l2norm


@dataclass
class GDNParams:
    """Per-layer parameters. `A_log`: `[HV]`; `dt_bias`: `[HV]`; `scale`: query scale
    (None: `K^-0.5`); `use_qk_l2norm`: normalise q and k inside the op, as the layers do."""

    A_log: Tensor
    dt_bias: Tensor
    scale: Optional[float] = None
    use_qk_l2norm: bool = True

    family = "gdn"
    delta = True
    vector_decay = False

    @property
    def num_heads(self) -> int:
        return self.A_log.shape[0]

    def input_spec(self, V: int, K: int, Hk: int) -> dict:
        HV = self.num_heads
        return {"q": ((Hk, K), False), "k": ((Hk, K), False), "v": ((HV, V), False),
                "a": ((HV,), False), "b": ((HV,), False)}

    def _decay(self, a: Tensor) -> Tensor:
        return -torch.exp(self.A_log) * F.softplus(a + self.dt_bias)

    def prepare(self, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor) -> dict:
        """Returns `ld` (`[..., HV]`), `beta` (`[..., HV]`), normalised `k`, scaled `q`
        (`[..., Hk, K]`) and `v`."""
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        if self.use_qk_l2norm:
            q, k = l2norm(q), l2norm(k)
        return {"ld": self._decay(a), "beta": torch.sigmoid(b), "k": k, "q": q * scale, "v": v}

    def finish(self, y: Tensor, **_) -> Tensor:
        return y

    def record_values(self, ld: Tensor, w: Tensor) -> Tensor:
        """The values of buffered records: the stored `u` itself."""
        return w

    def step(self, S: Tensor, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor):
        """Conventional decode, batched. `S`: `[b, HV, V, K]`. Returns `(o [b, HV, V], S_new)`."""
        p = self.prepare(q, k, v, a, b)
        HV = self.num_heads
        ke, qe = expand_heads(p["k"], HV), expand_heads(p["q"], HV)
        S = torch.exp(p["ld"])[..., None, None] * S
        u = p["beta"][..., None] * (v - torch.einsum("bhvk,bhk->bhv", S, ke))
        S = S + u[..., None] * ke[..., None, :]
        return torch.einsum("bhvk,bhk->bhv", S, qe), S
