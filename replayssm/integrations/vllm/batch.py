"""The decode rows of one vLLM step onto replayssm calls (plain tensors, no vLLM).

vLLM hands a recurrent layer, for its decode rows, the state index of each request (column 0
of its mamba block table; `NULL_BLOCK_ID` = 0 on CUDA-graph padding rows), the tokens packed
row after row, and with speculative decoding the rows' query starts and the accepted counts
of the step before (`num_accepted_tokens`, 1 + the drafts kept, at least 1). Without
speculation every row decodes one token (`decode`). With it every row goes through
`commit` of the previous step's accepted count (a no-op where nothing is pending, e.g. the
first step after prefill) and `verify` of this step's tokens (1..T of them), which stay
pending until the next step commits them: rollback is the cursor move, one state slot per
request.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import state as S

NULL_BLOCK_ID = 0


def slot_ids(state_indices: Tensor) -> Tensor:
    """vLLM's state indices `[B]` as slot ids: the null block (padding rows) and negative
    indices become -1, so that the kernels touch nothing for them."""
    idx = state_indices.to(torch.int32)
    # the null block is 0, so one comparison and one select cover it and negative ids (each
    # layer runs this every step, in the step's graph)
    return torch.where(idx > NULL_BLOCK_ID, idx, -1)


def pad_tokens(inputs: dict, query_start_loc: Tensor, T: int):
    """Packed tokens `[ntok, ...]` -> `[B, T, ...]` by rows (`query_start_loc` `[B + 1]`), and
    the rows' draft counts `[B]` clamped to `1..T` (padding rows have none; they verify one
    token that nothing reads). Device ops only."""
    qsl = query_start_loc.long()
    B = qsl.shape[0] - 1
    qlen = qsl[1:] - qsl[:-1]
    t = torch.arange(T, device=qsl.device)
    ntok = next(iter(inputs.values())).shape[0]
    src = (qsl[:-1, None] + t[None, :]).clamp(0, max(ntok - 1, 0))
    src = torch.where(t[None, :] < qlen[:, None], src, torch.zeros_like(src)).reshape(-1)
    padded = {k: v.index_select(0, src).reshape(B, T, *v.shape[1:]) for k, v in inputs.items()}
    return padded, qlen.clamp(1, T).to(torch.int32)


def unpad_outputs(y: Tensor, query_start_loc: Tensor, out: Tensor) -> Tensor:
    """`y` `[B, T, HV, V]` back into the packed `out` `[ntok, HV, V]`: token i of row b
    (`query_start_loc[b] <= i < query_start_loc[b + 1]`) takes `y[b, i - query_start_loc[b]]`;
    tokens past the last row (graph padding) take row 0's first output, which nothing reads."""
    B, T = y.shape[:2]
    qsl = query_start_loc.long()
    i = torch.arange(out.shape[0], device=qsl.device)
    b = torch.searchsorted(qsl[1:].contiguous(), i, right=True).clamp(max=B - 1)
    t = (i - qsl[b]).clamp(0, T - 1)
    return out.copy_(y.reshape(B * T, *y.shape[2:]).index_select(0, b * T + t))


def run_decode(executor, state: S.BlockState, state_indices: Tensor, inputs: dict, out: Tensor, *,
               spec_tokens: int = 0, query_start_loc: Optional[Tensor] = None,
               num_accepted: Optional[Tensor] = None) -> Tensor:
    """The decode rows of one step: `state_indices` `[B]` (vLLM's, column 0), `inputs` the
    family's raw token inputs packed `[ntok, ...]`, `out` `[ntok, HV, V]` written in place.

    `spec_tokens` 0: one token per row (`ntok = B`), `executor.decode`. Else (vLLM's
    `num_speculative_tokens`): `query_start_loc` `[B + 1]` of the rows' tokens, `num_accepted`
    `[B]` (None: 1, the count vLLM's own kernels assume without one); commit, then verify.
    A step whose decode tokens number `B * T` has every row at `T` tokens (vLLM hands only the
    decode rows' tokens, at most `T` a row): verified in place, no padding.
    """
    slots = slot_ids(state_indices)
    if spec_tokens == 0:
        return executor.decode(slots, inputs, out)
    T = 1 + spec_tokens
    if query_start_loc is None:
        raise ValueError("speculative decode rows need query_start_loc")
    B = slots.shape[0]
    acc = (torch.ones_like(slots) if num_accepted is None else num_accepted[:B])
    executor.commit(slots, acc)
    ntok = next(iter(inputs.values())).shape[0]
    if ntok == B * T:
        # every row holds T tokens (each holds at most T; vLLM's uniform decode batches, padding
        # rows included): the packed tokens are [B, T, ...] as they lie, and so are the outputs,
        # so no gather, scatter or counts (a dozen launches a layer and step)
        executor.verify(slots, {k: v.view(B, T, *v.shape[1:]) for k, v in inputs.items()}, None,
                        out.view(B, T, *out.shape[1:]))
        return out
    padded, n = pad_tokens(inputs, query_start_loc[:B + 1], T)
    y = torch.empty((B, T, *out.shape[1:]), dtype=out.dtype, device=out.device)
    executor.verify(slots, padded, n, y)
    return unpad_outputs(y, query_start_loc[:B + 1], out)


def before_prefill(state: S.BlockState, state_indices: Tensor, has_initial: Optional[Tensor],
                   A: Optional[Tensor] = None) -> None:
    """Rows vLLM is about to prefill from their state (`has_initial`): fold their records
    into the checkpoint first, since vLLM's prefill reads the checkpoint as the state."""
    if has_initial is None:
        return
    slots = slot_ids(state_indices)
    slots = torch.where(has_initial.to(torch.bool), slots, torch.full_like(slots, -1))
    S.flush(state, slots, A)


def after_prefill(state: S.BlockState, state_indices: Tensor) -> None:
    """vLLM's prefill wrote each row's final state into the checkpoint: records empty."""
    S.seed(state, slot_ids(state_indices))
