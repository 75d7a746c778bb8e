"""ReplaySSM for one sequence, in plain PyTorch: standard decode (SPEC section 3),
speculative verification (section 4) and the high-precision fold of section 5.

A sequence's buffer is a dict of tensors indexed by position `0..Lb-1`:
`ld` (`[Lb, HV]`, KDA `[Lb, HV, K]`), `w` (`[Lb, HV, V]`: Mamba-2's `x`, GDN/KDA's `u`; the
values the mathematics folds are `params.record_values(ld, w)`), `k` (`[Lb, Hk, K]`) and, for
GDN/KDA with a separate low-precision checkpoint, `v` (`[Lb, HV, V]`) and `beta` (`[Lb, HV]`).
Functions write records into it in place and return outputs *before* the family's
`finish` (skip connection, gate), plus the state to write back when they flush.

`C_hp` is the high-precision checkpoint (carries the recurrence), `C_lp` the low-precision
one (outputs only; None when the pool keeps one checkpoint). Both arrive decoded to the
compute dtype. Records may be stored narrower (bf16 records of an fp32 pool): they are read
in the checkpoint's dtype and written rounded to their own.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .common import apply, expand_heads, replay

RECORD_KEYS = ("ld", "w", "k")
RAW_KEYS = ("v", "beta")


def _put(buf: dict, pos: int, tok: dict, keys) -> None:
    for name in keys:
        if name in tok and name in buf:
            buf[name][pos] = tok[name]


def _rec(buf: dict, name: str, n: int, dtype: torch.dtype) -> Tensor:
    """The first `n` entries of record field `name`, in the compute dtype."""
    return buf[name][:n].to(dtype)


def _records(params, buf: dict, n: int, dtype: torch.dtype):
    """`(ld, values, k)` of the first `n` records in `dtype`: the values as the mathematics
    uses them (`params.record_values`: Mamba-2 stores `x` and forms `dt x`; GDN/KDA store `u`)."""
    ld = _rec(buf, "ld", n, dtype)
    return ld, params.record_values(ld, _rec(buf, "w", n, dtype)), _rec(buf, "k", n, dtype)


def _delta_u(params, C: Tensor, buf: dict, j: int, ld_j: Tensor, k_j: Tensor, v_j: Tensor,
             beta_j: Tensor) -> Tensor:
    """`u_j = beta_j (v_j - a_j S_{j-1} k_j)` output-only, with records `0..j-1` of `buf` and
    the decay of position `j` (`a_j S_{j-1}` is the state at `j` without record `j`)."""
    HV, dt = params.num_heads, C.dtype
    ld = torch.cat([_rec(buf, "ld", j, dt), ld_j[None]])
    w = torch.cat([_rec(buf, "w", j, dt), torch.zeros_like(v_j)[None]])
    k = torch.cat([_rec(buf, "k", j, dt), k_j[None]])
    kv = expand_heads(k_j, HV)
    return beta_j[:, None] * (v_j - apply(C, ld, w, k, kv))


def fold(params, C_hp: Tensor, buf: dict, n: int, recompute: bool) -> Tensor:
    """The state after the first `n` records, along the high-precision path.

    With `recompute` (GDN/KDA with a low-precision checkpoint) each `u_j` is recomputed from
    `C_hp` and the raw `(ld_j, k_j, v_j, beta_j)`, sequentially, because the buffered `u_j`
    came from `C_lp` and carries its rounding error (SPEC section 5). The buffer is not
    modified.
    """
    dt = C_hp.dtype
    if recompute and params.delta and n > 0:
        # the recomputed u stay in the compute dtype: this fold is the high-precision path
        w = _rec(buf, "w", n, dt).clone()
        ld, k, v, beta = (_rec(buf, name, n, dt) for name in ("ld", "k", "v", "beta"))
        tmp = dict(buf, w=w)
        for j in range(n):
            w[j] = _delta_u(params, C_hp, tmp, j, ld[j], k[j], v[j], beta[j])
        return replay(C_hp, ld, w, k)
    return replay(C_hp, *_records(params, buf, n, dt))


def decode_step(params, C_hp: Tensor, C_lp: Optional[Tensor], buf: dict, h: int, window: int,
                tok: dict, recompute: bool):
    """One standard decode step (SPEC section 3, Algorithms 1 and 4).

    `tok`: the prepared token (`params.prepare` of one row: `ld`, `k`, `q`, and `w` or
    `v`/`beta`). Writes the record at position `h`. Returns `(y, S)`: `y` `[HV, V]`, and `S`,
    the new checkpoint when this step flushes (`h + 1 >= window`), else None.
    """
    HV = params.num_heads
    C = C_lp if C_lp is not None else C_hp
    if params.delta:
        tok = dict(tok, w=_delta_u(params, C, buf, h, tok["ld"], tok["k"], tok["v"], tok["beta"]))
    _put(buf, h, tok, RECORD_KEYS + RAW_KEYS)
    q = expand_heads(tok["q"], HV)
    n = h + 1
    if n >= window:
        S = fold(params, C_hp, buf, n, recompute)
        return torch.einsum("hvk,hk->hv", S, q), S
    return apply(C, *_records(params, buf, n, C.dtype), q), None


def _draft_solve(params, C: Tensor, buf: dict, h: int, toks: dict) -> Tensor:
    """The drafts' `u` of GDN/KDA by forward substitution (SPEC section 4).

    Records `0..h-1` are committed, drafts occupy `h..h+T-1` (their `ld`, `k` already written).
    Returns `U` `[T, HV, V]` with `u_s = beta_s (r_s - sum_{i<s} g_{i+1:s} (k_i^T k_s) u_i)`,
    the unit-triangular system `U (I + A Bd) = R Bd` solved row by row. Draft `s` reads only
    drafts before it, so whatever a later (rejected) draft holds, NaN included, never reaches
    an accepted one: no product with a dense diagonal matrix, where `0 * NaN` would spread.
    """
    HV, dt = params.num_heads, C.dtype
    T = toks["ld"].shape[0]
    n = h + T
    ld = _rec(buf, "ld", n, dt)
    k = _rec(buf, "k", n, dt)
    ke = expand_heads(k, HV)                                           # [n, HV, K]
    w_committed = torch.cat([_rec(buf, "w", h, dt), torch.zeros_like(toks["v"])])
    U = torch.empty_like(toks["v"])                                    # [T, HV, V]
    for s in range(T):
        t = h + s                                                      # 0-based position
        r = toks["v"][s] - apply(C, ld[:t + 1], w_committed[:t + 1], k[:t + 1], ke[t])
        for i in range(s):
            g = torch.exp(ld[h + i + 1:t + 1].sum(0))                  # g_{j+1:t}, a direct sum
            gk = ke[h + i] * (g[:, None] if g.dim() == 1 else g)
            r = r - (gk * ke[t]).sum(-1)[:, None] * U[i]
        U[s] = toks["beta"][s][:, None] * r
    return U


def verify_step(params, C_hp: Tensor, C_lp: Optional[Tensor], buf: dict, h: int, window: int,
                toks: dict, recompute: bool):
    """Output-only verification of `T` tokens (SPEC section 4, Algorithm 2).

    `toks`: prepared tokens with a leading `[T]` dim. If `h + T > window` the `h` committed
    records are folded first (the early-flush rule, decided before sampling) and the drafts
    go to positions `0..T-1`. Returns `(Y [T, HV, V], S or None, start)` where `start` is the
    cursor the drafts follow (commit sets `cursor = start + a`).
    """
    HV = params.num_heads
    T = toks["ld"].shape[0]
    S = None
    C = C_lp if C_lp is not None else C_hp
    if h + T > window:
        S = fold(params, C_hp, buf, h, recompute)
        C, h = S, 0
    for s in range(T):
        _put(buf, h + s, {key: val[s] for key, val in toks.items()}, ("ld", "k") + RAW_KEYS)
    if params.delta:
        buf["w"][h:h + T] = _draft_solve(params, C, buf, h, toks)
    else:
        buf["w"][h:h + T] = toks["w"]
    Y = torch.stack([apply(C, *_records(params, buf, h + s + 1, C.dtype), expand_heads(toks["q"][s], HV))
                     for s in range(T)])
    return Y, S, h


def materialize(params, C_hp: Tensor, buf: dict, h: int, recompute: bool) -> Tensor:
    """The current state `S_h` (checkpoint plus the committed records), high-precision path."""
    return fold(params, C_hp, buf, h, recompute)
