"""Mamba-2 (SSD) decode step in plain PyTorch, with the real layer's input conventions.

Per head `h` the state is `S`: `[V, K]` (head dim P = V, state dim N = K). Per token:
`dt = softplus(dt_raw + dt_bias)`, `a = exp(dt * A)`, `S <- a S + (dt x) B^T`,
`y = S C + D x`, then `y * silu(z)` when a gate `z` is given. `B` and `C` are shared by the
value heads of a group (`[G, K]`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import expand_heads


@dataclass
class Mamba2Params:
    """Per-layer parameters. `A`: `[HV]` (negative, `-exp(A_log)`); `dt_bias`: `[HV]`;
    `D`: `[HV]` or None (skip connection)."""

    A: Tensor
    dt_bias: Tensor
    D: Optional[Tensor] = None

    def __post_init__(self):
        # the records keep x and recover dt as ld / A (record_values)
        if isinstance(self.A, Tensor) and bool((self.A == 0).any()):
            raise ValueError("A must be nonzero in every head (Mamba-2's A = -exp(A_log) is "
                             f"negative), got {self.A.tolist() if self.A.numel() <= 16 else 'a zero'}")

    family = "mamba2"
    delta = False          # the buffered value x does not depend on the state
    vector_decay = False

    @property
    def num_heads(self) -> int:
        return self.A.shape[0]

    def input_spec(self, V: int, K: int, Hk: int) -> dict:
        """Trailing shape of each input per token, and whether it is optional."""
        HV = self.num_heads
        return {"x": ((HV, V), False), "dt": ((HV,), False), "B": ((Hk, K), False),
                "C": ((Hk, K), False), "z": ((HV, V), True)}

    def prepare(self, x: Tensor, dt: Tensor, B: Tensor, C: Tensor, z: Optional[Tensor] = None) -> dict:
        """Token inputs `[..., HV, V]`, `[..., HV]`, `[..., G, K]` x2 -> record and query.

        Returns `ld` (`log a = dt A`, `[..., HV]`), `w = x` (`[..., HV, V]`), `k = B`, `q = C`.
        The record keeps the layer's input `x`, not the product `dt x` of SPEC section 2:
        `record_values` forms `dt x` with `dt = ld / A`. Stored in the model's dtype (bf16
        records of a bf16 model), `x` is exact where `dt x` would be rounded.
        """
        dt = F.softplus(dt + self.dt_bias)
        return {"ld": dt * self.A, "w": x, "k": B, "q": C}

    def record_values(self, ld: Tensor, w: Tensor) -> Tensor:
        """The values `dt_j x_j` (`[..., HV, V]`) of buffered records `(ld_j, x_j)`: `dt = ld / A`
        (`A` is never 0: `-exp(A_log)`)."""
        return (ld / self.A)[..., None] * w

    def finish(self, y: Tensor, x: Tensor, z: Optional[Tensor] = None, **_) -> Tensor:
        """Skip connection and gate: `(y + D x) * silu(z)`."""
        if self.D is not None:
            y = y + self.D[:, None] * x
        if z is not None:
            y = y * F.silu(z)
        return y

    def step(self, S: Tensor, x: Tensor, dt: Tensor, B: Tensor, C: Tensor, z: Optional[Tensor] = None):
        """Conventional decode (read-update-write), batched. `S`: `[b, HV, V, K]`.

        Returns `(y [b, HV, V], S_new)`.
        """
        p = self.prepare(x, dt, B, C)
        HV = self.num_heads
        w = F.softplus(dt + self.dt_bias)[..., None] * x
        S = torch.exp(p["ld"])[..., None, None] * S + w[..., None] * expand_heads(B, HV)[..., None, :]
        y = torch.einsum("bhvk,bhk->bhv", S, expand_heads(C, HV))
        return self.finish(y, x, z), S
