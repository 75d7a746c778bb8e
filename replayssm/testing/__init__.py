"""Random layers and inputs with the statistics of real checkpoints, for tests, the demo and
benchmarks. Decays span fast heads and long-memory heads (`a` near 1), where errors matter.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..reference import GDNParams, KDAParams, Mamba2Params

FAMILIES = ("mamba2", "gdn", "kda")


def _inv_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


def make_params(family: str, num_heads: int, head_k_dim: int, *, dtype=torch.float64,
                device="cpu", seed: int = 0, with_D: bool = True):
    """Per-layer parameters drawn as the layers initialise them (mamba_ssm / fla conventions)."""
    g = torch.Generator().manual_seed(seed)
    HV, K = num_heads, head_k_dim

    def rand(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64)

    # time steps log-uniform in [1e-3, 1e-1]: dt_bias = softplus^-1(dt)
    dt0 = torch.exp(rand(HV) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    if family == "mamba2":
        p = Mamba2Params(A=-(1 + 15 * rand(HV)), dt_bias=_inv_softplus(dt0),
                         D=torch.randn(HV, generator=g, dtype=torch.float64) if with_D else None)
        return _to(p, ("A", "dt_bias", "D"), dtype, device)
    if family == "gdn":
        p = GDNParams(A_log=torch.log(1 + 15 * rand(HV)), dt_bias=_inv_softplus(dt0))
        return _to(p, ("A_log", "dt_bias"), dtype, device)
    if family == "kda":
        dtk = torch.exp(rand(HV, K) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        p = KDAParams(A_log=torch.log(1 + 15 * rand(HV)), dt_bias=_inv_softplus(dtk))
        return _to(p, ("A_log", "dt_bias"), dtype, device)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def _to(p, names, dtype, device):
    for n in names:
        t = getattr(p, n)
        if t is not None:
            setattr(p, n, t.to(dtype=dtype, device=device))
    return p


def make_inputs(params, batch: int, head_v_dim: int, head_k_dim: int, num_k_heads: int, *,
                steps: Optional[int] = None, gate: bool = True, dtype=torch.float64, device="cpu",
                generator: Optional[torch.Generator] = None) -> dict:
    """Random token inputs for `params`' family: each tensor `[batch, *trailing]`, or
    `[batch, steps, *trailing]` when `steps` is given (a verify call's `T` tokens)."""
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    lead = (batch,) if steps is None else (batch, steps)
    out = {}
    for name, (shape, optional) in params.input_spec(head_v_dim, head_k_dim, num_k_heads).items():
        if optional and not gate:
            continue
        t = torch.randn(*lead, *shape, generator=g, dtype=torch.float64, device=g.device)
        if name in ("dt", "a"):
            t = 0.5 * t            # around the bias: softplus keeps most steps small
        out[name] = t.to(dtype=dtype, device=device)
    return out


class RelErr:
    """`||a - ref|| / ||ref||` over many calls of `add` (sums of squares, float64): the relative
    error of a kernel across steps or rows against the float64 reference; `rel` is None before
    any `add`, and the absolute error where every reference was zero."""

    def __init__(self):
        self.num = self.den = 0.0
        self.n = 0

    def add(self, a: torch.Tensor, ref: torch.Tensor) -> None:
        self.num += float(((a.double() - ref.double()) ** 2).sum())
        self.den += float((ref.double() ** 2).sum())
        self.n += 1

    @property
    def rel(self) -> Optional[float]:
        if self.n == 0:
            return None
        return (self.num / self.den) ** 0.5 if self.den > 0 else self.num ** 0.5
