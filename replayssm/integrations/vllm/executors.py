"""Decode and verify on a `BlockState` (vLLM's blocks): the kernels, or `SlotPool`'s reference.

Both executors take the same calls, with slot ids `[B]` (negative: padding row) and the
family's raw inputs (Mamba-2 `x`, `dt`, `B`, `C`; GDN `q`, `k`, `v`, `a`, `b`), `[B, ...]` for
`decode` and `[B, T, ...]` for `verify`, and write the outputs `[B, HV, V]` / `[B, T, HV, V]`
into `out`; `commit` moves the cursors by the accepted counts (`state.commit`; the kernel
executor in one launch). Flush and seeding are `state.flush` / `seed` for both.

`KernelExecutor` calls `replayssm.ops.<family>.replay_decode` / `replay_verify` with
`validate=False` (no host sync: capturable in vLLM's CUDA graphs). vLLM's views are strided by
the page; the windowed decode and verify kernels take a slot stride per state tensor
(`ops.utils.launch.slot_pads`), so mode "strided" passes the views as they are. Mode "staged"
gathers the batch's rows into contiguous scratch `[B_max, ...]`, runs the kernels on rows
`0..B-1` and writes the rows back (three times the state traffic: kept as the fallback for
views the kernels refuse). `probe_strided` asks the kernels' own boundary checks whether they
accept the views.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...ops.utils.commit import clear_pending, commit
from ...reference import GDNParams, Mamba2Params
from .state import BlockState, live_rows
from .state import commit as commit_views

_STAGED = ("ckpt", "ld", "w", "k", "cursor", "pending", "epoch")
# staging buffers by (device, rows, each staged tensor's row shape and dtype): one set serves
# every layer of that shape, since the layers of a step run one after another on one stream and
# each call writes its rows back before it returns (one set per layer would take a whole
# `max_batch` copy of the state per layer, after vLLM has sized its cache)
_SCRATCH: dict = {}


def _shared_scratch(state: BlockState, max_batch: int) -> dict:
    dev = state.ckpt.device
    key = (str(dev), max_batch) + tuple((name, tuple(getattr(state, name).shape[1:]), getattr(state, name).dtype)
                                        for name in _STAGED)
    if key not in _SCRATCH:
        bufs = {name: torch.zeros((max_batch, *getattr(state, name).shape[1:]), dtype=getattr(state, name).dtype,
                                  device=dev) for name in _STAGED}
        bufs["arrive"] = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        _SCRATCH[key] = bufs
    return _SCRATCH[key]


def params_for(family: str, **tensors) -> object:
    """The reference parameters of a layer: Mamba-2 `A` (= -exp(A_log)), `dt_bias`, `D`;
    GDN `A_log`, `dt_bias`."""
    if family == "mamba2":
        return Mamba2Params(A=tensors["A"], dt_bias=tensors["dt_bias"], D=tensors.get("D"))
    return GDNParams(A_log=tensors["A_log"], dt_bias=tensors["dt_bias"])


def _ops(family: str):
    if family == "mamba2":
        from ...ops import mamba2
        return mamba2
    from ...ops import gdn
    return gdn


class KernelExecutor:
    """The Triton kernels on `state`; `params` the layer's tensors (`params_for`'s names),
    `max_batch` the most rows of one call (scratch rows in mode "staged")."""

    def __init__(self, state: BlockState, params: dict, *, mode: str, max_batch: int):
        if mode not in ("strided", "staged"):
            raise ValueError(f"mode must be 'strided' or 'staged', got {mode!r}")
        self.state, self.params, self.mode = state, dict(params), mode
        self.family = state.spec.family
        if mode == "staged":
            # allocated now, outside any graph capture, and reused by every call (and layer)
            self.scratch = _shared_scratch(state, max_batch)
            self.rows = torch.arange(max_batch, dtype=torch.int32, device=state.ckpt.device)

    def _tensors(self, slots: Tensor):
        """(state tensors for the kernels, slot ids for them, write-back or None)."""
        st = self.state
        if self.mode == "strided":
            t = {name: getattr(st, name) for name in _STAGED}
            t["arrive"] = st.arrive
            return t, slots, None
        B = slots.shape[0]
        if B > self.rows.shape[0]:
            raise ValueError(f"batch of {B} rows exceeds the {self.rows.shape[0]} scratch rows")
        live, idx = live_rows(slots)
        for name in _STAGED:
            torch.index_select(getattr(st, name), 0, idx, out=self.scratch[name][:B])
        # a block vLLM recycles keeps its last owner's bytes (it zeroes attention blocks only),
        # and GDN may decode a 1-token prompt without a prefill: keep the counters in range so
        # the kernels cannot index records outside the buffer
        self.scratch["cursor"][:B].clamp_(0, st.spec.window)
        self.scratch["pending"][:B].clamp_(0, st.spec.max_draft)
        ids = torch.where(live, self.rows[:B], torch.full_like(self.rows[:B], -1))

        def write_back():
            # padding rows gathered block 0 and the kernels left them alone: same bytes back
            for name in _STAGED:
                getattr(st, name).index_copy_(0, idx, self.scratch[name][:B])
        return self.scratch, ids, write_back

    def _call(self, op: str, slots: Tensor, inputs: dict, out: Tensor, num_drafts=None,
              validate: bool = False) -> Tensor:
        t, ids, write_back = self._tensors(slots)
        ops = _ops(self.family)
        state = dict(ckpt=t["ckpt"], buf_ld=t["ld"], buf_w=t["w"], buf_k=t["k"], cursor=t["cursor"],
                     epoch=t["epoch"], arrive=t["arrive"], slot_ids=ids, window=self.state.spec.window,
                     out=out, validate=validate)
        if op == "verify":
            state.update(pending=t["pending"], num_drafts=num_drafts)
        p = self.params
        if self.family == "mamba2":
            fn = ops.replay_decode if op == "decode" else ops.replay_verify
            y = fn(A=p["A"], dt_bias=p["dt_bias"], D=p.get("D"), z=None, **inputs, **state)
        else:
            fn = ops.replay_decode if op == "decode" else ops.replay_verify
            y = fn(A_log=p["A_log"], dt_bias=p["dt_bias"], scale=None, use_qk_l2norm=True, **inputs, **state)
        if op == "decode" and write_back is None and self.state.spec.max_draft > 1:
            # the kernels leave pending alone in decode; the pool's contract zeroes it (one
            # launch on the page views). Without speculation (max_draft 1) no verify ever set it
            # (seed and flush write 0), and a step's graph is better off without the launch
            clear_pending(self.state.pending, slots)
        if write_back is not None:
            if op == "decode":
                self.scratch["pending"][:slots.shape[0]].zero_()
            write_back()
        return y

    def decode(self, slots: Tensor, inputs: dict, out: Tensor) -> Tensor:
        return self._call("decode", slots, inputs, out)

    def verify(self, slots: Tensor, inputs: dict, num_drafts: Optional[Tensor], out: Tensor) -> Tensor:
        return self._call("verify", slots, inputs, out, num_drafts=num_drafts)

    def commit(self, slots: Tensor, accepted: Tensor) -> None:
        """`state.commit` in one launch (the pool's commit kernel, on the page views)."""
        commit(self.state.cursor, self.state.pending, slots, accepted)


def probe_strided(state: BlockState, params: dict, inputs: dict, out: Tensor) -> bool:
    """Whether the kernels accept `state`'s strided views: one decode call with a single padding
    row (touches nothing) and the kernels' own boundary checks on. `inputs`, `out`: one row."""
    ex = KernelExecutor(state, params, mode="strided", max_batch=1)
    slots = torch.full((1,), -1, dtype=torch.int32, device=state.ckpt.device)
    try:
        ex._call("decode", slots, inputs, out, validate=True)
    except ValueError:
        return False
    return True


class ReferenceExecutor:
    """`SlotPool`'s reference (`backend="reference"`) on the views of `state`: the pool's
    tensors are replaced by them, so its decode and verify read and write vLLM's blocks."""

    def __init__(self, state: BlockState, params: dict):
        from ...pool import Layout, SlotPool
        spec = state.spec
        p = params_for(spec.family, **params)
        pool = SlotPool(p, 1, spec.V, spec.K, spec.Hk, window=spec.window, max_draft=spec.max_draft,
                        dtype=torch.float32, device=state.ckpt.device, record_dtype=spec.record_dtype,
                        backend="reference", eager_max_batch=0)
        pool.N = state.N
        pool.layout = Layout(ckpt={"data": state.ckpt}, ckpt_lp=None,
                             buf={"ld": state.ld, "w": state.w, "k": state.k}, cursor=state.cursor,
                             pending=torch.zeros(state.N, dtype=torch.int32), epoch=state.epoch,
                             arrive=state.arrive)
        pool.ckpt, pool.buf = pool.layout.ckpt, pool.layout.buf
        pool.cursor, pool.pending, pool.epoch = state.cursor, state.pending, state.epoch
        self.pool, self.state = pool, state

    def decode(self, slots: Tensor, inputs: dict, out: Tensor) -> Tensor:
        y = self.pool.decode(slots, **{k: v.float() for k, v in inputs.items()})
        return out.copy_(y)

    def verify(self, slots: Tensor, inputs: dict, num_drafts: Optional[Tensor], out: Tensor) -> Tensor:
        y = self.pool.verify(slots, num_drafts=num_drafts, **{k: v.float() for k, v in inputs.items()})
        return out.copy_(y)

    def commit(self, slots: Tensor, accepted: Tensor) -> None:
        commit_views(self.state, slots, accepted)


def make_executor(state: BlockState, params: dict, *, mode: str, max_batch: int,
                  probe_inputs: Optional[dict] = None, probe_out: Optional[Tensor] = None):
    """The executor for `mode` ("reference", "strided", "staged", or "auto": strided when
    `probe_strided` says the kernels take the views, else staged)."""
    if mode == "reference":
        return ReferenceExecutor(state, params)
    if mode == "auto":
        ok = probe_inputs is not None and probe_strided(state, params, probe_inputs, probe_out)
        mode = "strided" if ok else "staged"
    elif mode == "strided" and state.spec.window == 1:
        # window 1 is the eager step, whose kernels take no slot stride
        raise ValueError("REPLAYSSM_VLLM_STATE=strided needs a window above 1: use 'auto' or 'staged'")
    return KernelExecutor(state, params, mode=mode, max_batch=max_batch)
