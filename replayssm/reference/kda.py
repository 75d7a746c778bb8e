"""Kimi Delta Attention decode step in plain PyTorch (Kimi Linear's conventions).

As GDN, but the decay is channel-wise over the key dim:
`a = exp(-exp(A_log) * softplus(a_raw + dt_bias))` with `a_raw`: `[HV, K]`, `dt_bias`: `[HV, K]`.
`S <- S Diag(a) (I - beta k k^T) + beta v k^T`, i.e. `u = beta (v - S (a * k))`,
`S <- S Diag(a) + u k^T`, `o = S q`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import expand_heads, l2norm


@dataclass
class KDAParams:
    """Per-layer parameters. `A_log`: `[HV]`; `dt_bias`: `[HV, K]`; `scale` (None: `K^-0.5`)."""

    A_log: Tensor
    dt_bias: Tensor
    scale: Optional[float] = None
    use_qk_l2norm: bool = True

    family = "kda"
    delta = True
    vector_decay = True

    @property
    def num_heads(self) -> int:
        return self.A_log.shape[0]

    def input_spec(self, V: int, K: int, Hk: int) -> dict:
        HV = self.num_heads
        return {"q": ((Hk, K), False), "k": ((Hk, K), False), "v": ((HV, V), False),
                "a": ((HV, K), False), "b": ((HV,), False)}

    def prepare(self, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor) -> dict:
        """Returns `ld` (`[..., HV, K]`), `beta` (`[..., HV]`), normalised `k`, scaled `q`, `v`."""
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        if self.use_qk_l2norm:
            q, k = l2norm(q), l2norm(k)
        ld = -torch.exp(self.A_log)[:, None] * F.softplus(a + self.dt_bias)
        return {"ld": ld, "beta": torch.sigmoid(b), "k": k, "q": q * scale, "v": v}

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
        S = S * torch.exp(p["ld"])[..., None, :]
        u = p["beta"][..., None] * (v - torch.einsum("bhvk,bhk->bhv", S, ke))
        S = S + u[..., None] * ke[..., None, :]
        return torch.einsum("bhvk,bhk->bhv", S, qe), S
