"""Commit of a verify step on the device: the accepted counts move each row's cursor past the
drafts it keeps; rejected drafts stay behind the cursor and are overwritten later
(docs/state-layout.md, `commit`). One launch, no host synchronisation, capturable in a CUDA
graph: the accepted counts arrive as a device tensor, as a serving engine's sampler makes them.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["commit", "clear_pending"]

_BLOCK = 128


@triton.jit
def _commit_kernel(cursor, pending, slot_ids, accepted, Bt, stride_c, stride_p, BLOCK: tl.constexpr):
    o_b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_b = o_b < Bt
    slot = tl.load(slot_ids + o_b, mask=m_b, other=-1).to(tl.int64)
    live = m_b & (slot >= 0)
    p_cur = cursor + slot * stride_c
    p_pen = pending + slot * stride_p
    p = tl.load(p_pen, mask=live, other=0)
    # unvalidated counts are clamped to 0..pending, so that no cursor passes the drafts that
    # were written (a commit without a verify, pending 0, moves nothing)
    a = tl.minimum(tl.maximum(tl.load(accepted + o_b, mask=live, other=0).to(tl.int32), 0), p)
    h = tl.load(p_cur, mask=live, other=0)
    tl.store(p_cur, h + a, mask=live)
    tl.store(p_pen, tl.zeros_like(p), mask=live)


def commit(cursor: Tensor, pending: Tensor, slot_ids: Tensor, accepted: Tensor) -> None:
    """`cursor[s] += clamp(accepted[b], 0, pending[s])`, `pending[s] = 0` for every row b with
    `s = slot_ids[b] >= 0`, in place. `cursor`, `pending` `[N]` int32, any stride (vLLM's
    blocks hold them in the page); `slot_ids`, `accepted` `[Bt]` int32/int64 on the same device,
    contiguous. The caller validates (the pool refuses counts outside `1..pending` before this
    runs)."""
    Bt = slot_ids.shape[0]
    if Bt == 0:
        return
    _commit_kernel[(triton.cdiv(Bt, _BLOCK),)](cursor=cursor, pending=pending, slot_ids=slot_ids,
                                               accepted=accepted, Bt=Bt, stride_c=cursor.stride(0),
                                               stride_p=pending.stride(0), BLOCK=_BLOCK)


@triton.jit
def _clear_pending_kernel(pending, slot_ids, Bt, stride_p, BLOCK: tl.constexpr):
    o_b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_b = o_b < Bt
    slot = tl.load(slot_ids + o_b, mask=m_b, other=-1).to(tl.int64)
    tl.store(pending + slot * stride_p, tl.zeros([BLOCK], dtype=tl.int32), mask=m_b & (slot >= 0))


def clear_pending(pending: Tensor, slot_ids: Tensor) -> None:
    """`pending[s] = 0` for every `s = slot_ids[b] >= 0` (a decode discards the drafts of a
    verify left uncommitted), in one launch: padding rows are masked in the kernel rather than
    mapped to a spare entry by separate comparison, select, cast and scatter launches, which
    count where a decode step takes a few microseconds. `pending` `[N]` int32, any stride;
    `slot_ids` `[Bt]` int32/int64, contiguous, on its device."""
    Bt = slot_ids.shape[0]
    if Bt == 0:
        return
    _clear_pending_kernel[(triton.cdiv(Bt, _BLOCK),)](pending=pending, slot_ids=slot_ids, Bt=Bt,
                                                      stride_p=pending.stride(0), BLOCK=_BLOCK)
