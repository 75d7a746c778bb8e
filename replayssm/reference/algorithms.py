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
compute dtype.
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


def _records(params, buf: dict, n: int):
    """`(ld, values, k)` of the first `n` records: the values as the mathematics uses them
    (`params.record_values`: Mamba-2 stores `x` and forms `dt x`; GDN/KDA store `u`)."""
    ld = buf["ld"][:n]
    return ld, params.record_values(ld, buf["w"][:n]), buf["k"][:n]


def _delta_u(params, C: Tensor, buf: dict, j: int, ld_j: Tensor, k_j: Tensor, v_j: Tensor,
             beta_j: Tensor) -> Tensor:
    """`u_j = beta_j (v_j - a_j S_{j-1} k_j)` output-only, with records `0..j-1` of `buf` and
    the decay of position `j` (`a_j S_{j-1}` is the state at `j` without record `j`)."""
    HV = params.num_heads
    ld = torch.cat([buf["ld"][:j], ld_j[None]])
    w = torch.cat([buf["w"][:j], torch.zeros_like(buf["w"][:1])])
    k = torch.cat([buf["k"][:j], k_j[None]])
    kv = expand_heads(k_j, HV)
    return beta_j[:, None] * (v_j - apply(C, ld, w, k, kv))


def fold(params, C_hp: Tensor, buf: dict, n: int, recompute: bool) -> Tensor:
    """The state after the first `n` records, along the high-precision path.

    With `recompute` (GDN/KDA with a low-precision checkpoint) each `u_j` is recomputed from
    `C_hp` and the raw `(ld_j, k_j, v_j, beta_j)`, sequentially, because the buffered `u_j`
    came from `C_lp` and carries its rounding error (SPEC section 5). The buffer is not
    modified.
    """
    if recompute and params.delta and n > 0:
        w = buf["w"][:n].clone()
        tmp = dict(buf, w=w)
        for j in range(n):
            w[j] = _delta_u(params, C_hp, tmp, j, buf["ld"][j], buf["k"][j], buf["v"][j], buf["beta"][j])
        return replay(C_hp, buf["ld"][:n], w, buf["k"][:n])
    return replay(C_hp, *_records(params, buf, n))


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
    return apply(C, *_records(params, buf, n), q), None


def _draft_solve(params, C: Tensor, buf: dict, h: int, toks: dict) -> Tensor:
    """The drafts' `u` of GDN/KDA as one unit-triangular solve (SPEC section 4).

    Records `0..h-1` are committed, drafts occupy `h..h+T-1` (their `ld`, `k` already written).
    Returns `U` `[T, HV, V]` solving `U (I + A Bd) = R Bd`, per head.
    """
    HV = params.num_heads
    T = toks["ld"].shape[0]
    n = h + T
    ld = buf["ld"][:n]
    cum = torch.cat([torch.zeros_like(ld[:1]), torch.cumsum(ld, 0)])   # cum[t] = log g_{1:t}
    ke = expand_heads(buf["k"][:n], HV)                                # [n, HV, K]
    w_committed = torch.cat([buf["w"][:h], torch.zeros_like(buf["w"][h:n])])
    R = torch.empty_like(toks["v"])                                     # [T, HV, V]
    A = torch.zeros(HV, T, T, dtype=C.dtype, device=C.device)          # A[:, i, s], i < s
    for s in range(T):
        t = h + s + 1                                                   # 1-based position
        R[s] = toks["v"][s] - apply(C, ld[:t], w_committed[:t], buf["k"][:t], ke[t - 1])
        for i in range(s):
            j = h + i + 1
            g = torch.exp(cum[t] - cum[j])                              # g_{j+1:t}
            gk = ke[j - 1] * (g[:, None] if g.dim() == 1 else g)
            A[:, i, s] = (gk * ke[t - 1]).sum(-1)
    Bd = torch.diag_embed(toks["beta"].transpose(0, 1))                 # [HV, T, T]
    M = torch.eye(T, dtype=C.dtype, device=C.device) + A @ Bd           # unit upper triangular
    rhs = R.permute(1, 2, 0) @ Bd                                       # [HV, V, T]
    # U M = rhs  <=>  M^T U^T = rhs^T, a lower unit-triangular system
    Ut = torch.linalg.solve_triangular(M.transpose(1, 2), rhs.transpose(1, 2), upper=False, unitriangular=True)
    return Ut.permute(1, 0, 2)                                          # [T, HV, V]


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
    Y = torch.stack([apply(C, *_records(params, buf, h + s + 1), expand_heads(toks["q"][s], HV))
                     for s in range(T)])
    return Y, S, h


def materialize(params, C_hp: Tensor, buf: dict, h: int, recompute: bool) -> Tensor:
    """The current state `S_h` (checkpoint plus the committed records), high-precision path."""
    return fold(params, C_hp, buf, h, recompute)
