"""The snapshot baseline's state (every family): one full state per draft token.

What serving engines do today for speculative decoding (vLLM's `selective_state_update` with
`num_accepted_tokens`, and its GDN equivalent): verification runs the conventional recurrence
token by token and writes the state after every draft into a slot of its own; the next step
starts from the accepted token's state. Per sequence `T1 = T_max + 1` slots of `states
[N, T1, HV, V, K]` fp32 form a ring, `base [N]` int32 names the one holding the current state;
a verify of `n` drafts writes slots `base + 1 .. base + n` (mod T1) and never the one it reads,
and `snapshot_commit` moves `base` on by the accepted count.

Here: the commit kernel and the checks of the state at the Python boundary; the verify kernels
are the families' (`ops/<family>/snapshot.py`).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .checks import check_devices, check_slot_ids, check_tensor, may_sync

__all__ = ["snapshot_commit", "check_snapshot_state", "snapshot_overrides", "snapshot_launch"]

_OVERRIDE_KEYS = ("BV", "num_warps", "num_stages")


@triton.jit
def _snapshot_commit_kernel(base, slot_ids, accepted, Bt, T1, BLOCK: tl.constexpr):
    # slots are unique within a call, so each base entry has one writer
    o_b = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_b = o_b < Bt
    b_s = tl.load(slot_ids + o_b, mask=m_b, other=-1).to(tl.int64)
    m_s = m_b & (b_s >= 0)
    b_s = tl.where(m_s, b_s, 0)
    b_a = tl.load(accepted + o_b, mask=m_s, other=0)
    b_0 = tl.load(base + b_s, mask=m_s, other=0)
    tl.store(base + b_s, ((b_0 + b_a) % T1).to(tl.int32), mask=m_s)


def snapshot_commit(base: Tensor, slot_ids: Tensor, accepted: Tensor, T1: int, *,
                    validate: bool = True) -> Tensor:
    """Keep each live row's accepted snapshot: `base[s] = (base[s] + accepted[b]) % T1` for
    `s = slot_ids[b] >= 0`, on the device (no host sync: capturable in a CUDA graph).

    `base` `[N]` int32 (updated in place and returned), `slot_ids` `[Bt]` int32/int64,
    `accepted` `[Bt]` int32 on the device (`1..n_b`, the row's verified drafts), `T1` the
    slots per sequence (`states.shape[1]`).
    """
    if validate:
        check_tensor("base", base, dtypes=(torch.int32,), contiguous=True)
        if base.dim() != 1:
            raise ValueError(f"base has shape {tuple(base.shape)}, expected [N]")
        if not isinstance(slot_ids, Tensor) or slot_ids.dim() != 1:
            raise ValueError(f"slot_ids must be a [Bt] tensor, got {getattr(slot_ids, 'shape', type(slot_ids).__name__)}")
        Bt = slot_ids.shape[0]
        check_slot_ids(slot_ids, Bt)
        check_tensor("accepted", accepted, (Bt,), (torch.int32,), contiguous=True)
        check_devices(base=base, slot_ids=slot_ids, accepted=accepted)
        if isinstance(T1, bool) or not isinstance(T1, int) or T1 < 2:
            raise ValueError(f"T1={T1!r} must be an int >= 2 (the slots per sequence, states.shape[1])")
        if may_sync():
            live = slot_ids >= 0
            bad = live & ((accepted < 1) | (accepted >= T1))
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise ValueError(f"accepted[{i}]={int(accepted[i])} is outside 1..T1-1={T1 - 1}")
    Bt = slot_ids.shape[0]
    if Bt == 0:
        return base
    BLOCK = min(1024, max(16, triton.next_power_of_2(Bt)))
    _snapshot_commit_kernel[(triton.cdiv(Bt, BLOCK),)](base, slot_ids, accepted, Bt, int(T1), BLOCK=BLOCK)
    return base


def snapshot_overrides(config: Optional[dict], extra=()) -> Optional[dict]:
    """The caller's overrides of the conventional launch config that a snapshot kernel takes
    (`BV`, `num_warps`, `num_stages`, and the family's `extra` keys); ValueError for others."""
    if not config:
        return None
    allowed = _OVERRIDE_KEYS + tuple(extra)
    unknown = set(config) - set(allowed)
    if unknown:
        raise ValueError(f"config: unknown keys {sorted(unknown)}; expected a subset of {list(allowed)}")
    return dict(config)


def snapshot_launch(cfg: dict, T: int, config: Optional[dict]) -> dict:
    """The conventional launch config `cfg` as a snapshot kernel runs it: with T > 1 drafts,
    one-warp programs of at most 32 rows unless the caller's `config` sets `BV` or `num_warps`.
    Each draft ends in reductions over K that, across warps, go through shared memory behind a
    barrier, once per draft; the conventional tables' 8-warp programs of 64 rows moved 2.9 TB/s
    at T = 8 on the H200 (Super, batch 256), one-warp programs of 32 rows 3.8 (the conventional
    step 3.9)."""
    if T > 1 and not (config and ("BV" in config or "num_warps" in config)):
        cfg = dict(cfg, BV=min(cfg["BV"], 32), num_warps=1)
    return cfg


def check_snapshot_state(states, base, slot_ids, num_drafts, Bt: int, T: int, HV: int, V: int,
                         K: int, device) -> tuple:
    """Shapes, dtypes and devices of the snapshot state and the per-row draft counts; returns
    `(N, T1)`. The values of `base` (`0..T1-1`) and `num_drafts` (`1..T`) are read back (on the
    device a host sync) wherever `checks.may_sync` allows, as the slot ids' are."""
    if not isinstance(states, Tensor) or states.dim() != 5:
        raise ValueError(f"states must be an [N, T1, HV, V, K] tensor, got shape {getattr(states, 'shape', None)}")
    N, T1 = states.shape[0], states.shape[1]
    check_tensor("states", states, (N, T1, HV, V, K), (torch.float32,), device, contiguous=True)
    if T + 1 > T1:
        raise ValueError(f"states holds T1={T1} slots per sequence: T={T} drafts need T + 1 = {T + 1}")
    check_tensor("base", base, (N,), (torch.int32,), device, contiguous=True)
    check_slot_ids(slot_ids, Bt, device)
    if num_drafts is not None:
        check_tensor("num_drafts", num_drafts, (Bt,), (torch.int32,), device, contiguous=True)
    if may_sync():
        ids = slot_ids.detach().to("cpu", torch.int64)
        live = ids >= 0
        b = base.detach().cpu()
        bad = (b < 0) | (b >= T1)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"base[{i}]={int(b[i])} is outside 0..T1-1={T1 - 1}")
        if num_drafts is not None:
            n = num_drafts.detach().cpu()
            bad = live & ((n < 1) | (n > T))
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise ValueError(f"num_drafts[{i}]={int(n[i])} is outside 1..T={T}")
    return N, T1
