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


class Rows:
    """How a step's packed decode tokens (`query_start_loc` `[B + 1]` of `ntok` tokens) lie
    on `[B, T]` rows: `pad` gathers a packed tensor into rows (positions past a row's tokens
    take token 0, which nothing reads), `n` the rows' token counts `[B]` clamped to `1..T`
    (padding rows have none; they verify one token that nothing reads), `unpad` scatters
    `[B, T, ...]` outputs back (tokens past the last row, graph padding, take the last row's
    last output, which nothing reads). Device ops only."""

    def __init__(self, query_start_loc: Tensor, T: int, ntok: int):
        qsl = query_start_loc.long()
        B = qsl.shape[0] - 1
        qlen = qsl[1:] - qsl[:-1]
        t = torch.arange(T, device=qsl.device)
        src = (qsl[:-1, None] + t[None, :]).clamp(0, max(ntok - 1, 0))
        self.src = torch.where(t[None, :] < qlen[:, None], src, torch.zeros_like(src)).reshape(-1)
        self.n = qlen.clamp(1, T).to(torch.int32)
        i = torch.arange(ntok, device=qsl.device)
        b = torch.searchsorted(qsl[1:].contiguous(), i, right=True).clamp(max=B - 1)
        self.dst = b * T + (i - qsl[b]).clamp(0, T - 1)
        self.B, self.T = B, T

    def pad(self, t: Tensor) -> Tensor:
        return t.index_select(0, self.src).view(self.B, self.T, *t.shape[1:])

    def unpad(self, y: Tensor, out: Tensor) -> Tensor:
        flat = y.reshape(self.B * self.T, *y.shape[2:])
        if out.is_contiguous():
            return torch.index_select(flat, 0, self.dst, out=out)
        return out.copy_(flat.index_select(0, self.dst))


def pad_tokens(inputs: dict, query_start_loc: Tensor, T: int):
    """Packed tokens `[ntok, ...]` -> `[B, T, ...]` by rows, and the rows' token counts (`Rows`)."""
    rows = Rows(query_start_loc, T, next(iter(inputs.values())).shape[0])
    return {k: rows.pad(v) for k, v in inputs.items()}, rows.n


def unpad_outputs(y: Tensor, query_start_loc: Tensor, out: Tensor) -> Tensor:
    """`y` `[B, T, HV, V]` back into the packed `out` `[ntok, HV, V]` (`Rows.unpad`)."""
    return Rows(query_start_loc, y.shape[1], out.shape[0]).unpad(y, out)


class StepMemo:
    """What every recurrent layer of a step derives alike from the step's metadata (slot ids,
    the rows' index maps), derived by the first layer and reused by the rest. vLLM runs a
    step whose rows hold unequal token counts outside its full CUDA graphs, with each layer's
    recurrence called from Python, where every op is host time per layer: on the
    Nemotron-3-Super slice a layer's call took 1.9 ms of host time against 0.5 ms for vLLM's
    own (H200, under the profiler), about half of it the slot ids, the index maps and the
    gathers of each input. `owner`: an object that is the same for the layers of one step
    and new each step (vLLM's attention metadata of the layers' group); None: nothing is
    shared. Entries keep their key tensor alive, so no other tensor can take
    its address while the step lasts. Nothing crosses the edge of a CUDA-graph capture: a
    value computed outside it would be a constant of the graph (vLLM warms a graph's batch up
    eagerly before capturing it), and one computed inside it lives in the graph's memory."""

    def __init__(self):
        self._owner, self._capturing, self._values = None, False, {}

    def get(self, owner, name: str, key: Tensor, make):
        if owner is None:
            return make()
        capturing = _capturing()
        if self._owner is not owner or self._capturing != capturing:
            self._owner, self._capturing, self._values = owner, capturing, {}
        k = (name, key.data_ptr(), tuple(key.shape), tuple(key.stride()))
        hit = self._values.get(k)
        if hit is None:
            hit = self._values[k] = (key, make())
        return hit[1]


STEP = StepMemo()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _inputs(inputs, rows_of):
    # a layer passes a function where it can gather its packed projections before splitting
    # them (two gathers for Mamba-2's x, B, C, dt instead of four)
    return inputs(rows_of) if callable(inputs) else {k: rows_of(v) for k, v in inputs.items()}


def run_decode(executor, state: S.BlockState, state_indices: Tensor, inputs, out: Tensor, *,
               spec_tokens: int = 0, query_start_loc: Optional[Tensor] = None,
               num_accepted: Optional[Tensor] = None, step=None) -> Tensor:
    """The decode rows of one step: `state_indices` `[B]` (vLLM's, column 0), `inputs` the
    family's raw token inputs packed `[ntok, ...]` (a dict, or a function that builds it from
    a function mapping a packed tensor onto the kernels' rows), `out` `[ntok, HV, V]` written
    in place. `step`: the step's metadata, for `STEP` (None: nothing shared between calls).

    `spec_tokens` 0: one token per row (`ntok = B`), `executor.decode`. Else (vLLM's
    `num_speculative_tokens`): `query_start_loc` `[B + 1]` of the rows' tokens, `num_accepted`
    `[B]` (None: 1, the count vLLM's own kernels assume without one); commit, then verify.
    A step whose decode tokens number `B * T` has every row at `T` tokens (vLLM hands only the
    decode rows' tokens, at most `T` a row): verified in place, no padding.
    """
    slots = STEP.get(step, "slots", state_indices, lambda: slot_ids(state_indices))
    if spec_tokens == 0:
        return executor.decode(slots, _inputs(inputs, lambda t: t), out)
    T = 1 + spec_tokens
    if query_start_loc is None:
        raise ValueError("speculative decode rows need query_start_loc")
    B = slots.shape[0]
    acc = (torch.ones_like(slots) if num_accepted is None else num_accepted[:B])
    executor.commit(slots, acc)
    ntok = out.shape[0]
    if ntok == B * T:
        # every row holds T tokens (each holds at most T; vLLM's uniform decode batches, padding
        # rows included): the packed tokens are [B, T, ...] as they lie, and so are the outputs,
        # so no gather, scatter or counts (a dozen launches a layer and step)
        executor.verify(slots, _inputs(inputs, lambda t: t.view(B, T, *t.shape[1:])), None,
                        out.view(B, T, *out.shape[1:]))
        return out
    rows = STEP.get(step, f"rows{B}x{T}x{ntok}", query_start_loc,
                    lambda: Rows(query_start_loc[:B + 1], T, ntok))
    y = torch.empty((B, T, *out.shape[1:]), dtype=out.dtype, device=out.device)
    executor.verify(slots, _inputs(inputs, rows.pad), rows.n, y)
    return rows.unpad(y, out)


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
