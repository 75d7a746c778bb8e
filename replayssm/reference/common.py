"""Shared pieces of the reference: head grouping and the unrolled recurrence (SPEC section 2).

Notation follows SPEC.md. A *record* of position `j` in a window is `(ld_j, w_j, k_j)`:
`ld_j = log a_j` (the decay in log space: `[HV]`, or `[HV, K]` for KDA's channel-wise decay),
`w_j` (`[HV, V]`: `dt*x` for Mamba-2, `u` for GDN/KDA) and `k_j` (`[Hk, K]`, one key per group
of value heads). Buffers may store another form of `w_j` (Mamba-2 keeps `x_j`); the functions
here take the values themselves (`params.record_values` forms them).

All functions here act on one sequence; the slot pool loops over rows. They are written for
float64 clarity, not speed.
"""
from __future__ import annotations

import torch
from torch import Tensor


def expand_heads(k: Tensor, num_heads: int) -> Tensor:
    """Repeat key heads for their value heads: `[..., Hk, K]` -> `[..., HV, K]`.

    Value head `i` uses key head `i // (HV // Hk)`, the convention of Mamba-2 (groups) and of
    flash-linear-attention's GDN/KDA (GQA-style key heads).
    """
    hk = k.shape[-2]
    if num_heads % hk:
        raise ValueError(f"value heads ({num_heads}) must be a multiple of key heads ({hk})")
    return k.repeat_interleave(num_heads // hk, dim=-2)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """L2-normalise the last dim as the GDN/KDA layers do: `x / sqrt(sum x^2 + eps)`."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _col_decay(d: Tensor) -> Tensor:
    """Broadcast a decay over the state's columns: scalar `[HV]` -> `[HV, 1, 1]`; vector
    `[HV, K]` (KDA) -> `[HV, 1, K]` (it scales the key dim)."""
    return d[:, None, None] if d.dim() == 1 else d[:, None, :]


def _decayed(C: Tensor, ld: Tensor, k: Tensor):
    """The two decayed pieces of SPEC section 2's unrolled state `S_n`.

    Returns `g_{1:n} C` (`[HV, V, K]`; KDA: the decay scales the key columns) and the decayed
    keys `g_{j+1:n} k_j` expanded to value heads (`[n, HV, K]`), so that
    `S_n = g_{1:n} C + sum_j w_j (g_{j+1:n} k_j)^T`.
    """
    # Suffix sums, each of same-signed terms: `total - cumsum` would cancel catastrophically
    # in fp32 for fast-decaying heads, whose window sums are large.
    sfx = torch.flip(torch.cumsum(torch.flip(ld, (0,)), 0), (0,))   # log g_{j:n}
    total = sfx[0] if ld.shape[0] else ld.sum(0)                    # log g_{1:n}
    g = torch.exp(torch.cat([sfx[1:], torch.zeros_like(ld[:1])]))   # [n, HV(, K)]: g_{j+1:n}
    kw = expand_heads(k, C.shape[0]) * (g[..., None] if g.dim() == 2 else g)
    return torch.exp(_col_decay(total)) * C, kw


def replay(C: Tensor, ld: Tensor, w: Tensor, k: Tensor) -> Tensor:
    """REPLAY: the state after `n` records, materialised.

    `C`: `[HV, V, K]` checkpoint; `ld`: `[n, HV]` or `[n, HV, K]`; `w`: `[n, HV, V]`;
    `k`: `[n, Hk, K]`. Returns `S_n = g_{1:n} C + sum_j g_{j+1:n} w_j k_j^T` (KDA: the decay
    scales the key columns).
    """
    Cg, kw = _decayed(C, ld, k)
    return Cg + torch.einsum("jhv,jhk->hvk", w, kw)


def apply(C: Tensor, ld: Tensor, w: Tensor, k: Tensor, vec: Tensor) -> Tensor:
    """Output-only product `S_n vec` without materialising `S_n` (SPEC section 2).

    Same arguments as :func:`replay`, plus `vec`: `[HV, K]` (queries or keys already expanded
    to value heads). Returns `[HV, V]`:
    `g_{1:n} (C vec) + sum_j g_{j+1:n} (k_j^T vec) w_j`; for KDA the decays multiply `vec`
    channel-wise instead: `C (g_{1:n} * vec) + sum_j ((g_{j+1:n} * k_j)^T vec) w_j`.
    """
    Cg, kw = _decayed(C, ld, k)
    return torch.einsum("hvk,hk->hv", Cg, vec) + torch.einsum("jhk,hk,jhv->hv", kw, vec, w)
