"""ReplaySSM state of a model: one `SlotPool` and one short-convolution history per
recurrent layer, and the slots of the sequences in flight.

A generation's rows are bound to slots through its transformers cache object: the first
recurrent layer's prefill allocates one slot per row (`Binding`), every layer then addresses
the same slots, and the slots return to the free list when the binding is released (the
generation loops, `generate` and `speculative_generate`, free a finished row at once; the
cache's finalizer frees the rest).
"""
from __future__ import annotations

import gc
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ...pool import SlotPool
from ...ops.utils.launch import capturing
from .conventional import ConventionalPool
from .snapshot import SnapshotPool


def _kernel_activation(act) -> Optional[str]:
    """The fused convolution's name for `act` (SiLU or none), None for any other activation."""
    if act is None or isinstance(act, torch.nn.Identity):
        return "none"
    if act is F.silu or isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation":
        return "silu"
    return None


class ConvHistory:
    """The short convolution's inputs per slot, with rollback.

    `buf` `[N, C, Kc - 1 + T]`: positions `0..Kc-2` hold the last `Kc - 1` committed inputs
    (what the next token's convolution reads); `run` writes a call's `S <= T` inputs after
    them, pending, and `commit(a)` makes the first `a` of them part of the history, so that
    rejected drafts leave no trace (the next `run` reads committed positions only).
    """

    def __init__(self, num_slots: int, channels: int, kernel: int, max_tokens: int,
                 dtype: torch.dtype, device):
        self.kernel, self.max_tokens = kernel, max_tokens
        # one spare row past the slots: padding rows write there, so `run` needs no host read
        # of the slot ids (a decode step can be captured in a CUDA graph)
        self.buf = torch.zeros(num_slots + 1, channels, kernel - 1 + max_tokens, dtype=dtype, device=device)
        self.pending = torch.zeros(num_slots + 1, dtype=torch.long, device=device)

    def grow(self, num_slots: int) -> None:
        extra = num_slots + 1 - self.buf.shape[0]
        self.buf = torch.cat([self.buf[:-1], self.buf.new_zeros(extra, *self.buf.shape[1:]), self.buf[-1:]])
        self.pending = torch.cat([self.pending[:-1], self.pending.new_zeros(extra), self.pending[-1:]])

    def load(self, slots: Tensor, inputs: Tensor) -> None:
        """Seed from a prefill's last inputs `[B, C, n]` (`n` any; fewer than `Kc - 1` are
        left-padded with zeros, as the causal convolution pads)."""
        keep = self.kernel - 1
        n = inputs.shape[-1]
        last = inputs[..., -keep:] if n >= keep else F.pad(inputs, (keep - n, 0))
        ok = slots >= 0
        s = slots[ok].long()
        self.buf[s] = 0
        self.buf[s, :, :keep] = last[ok].to(self.buf.dtype)
        self.pending[s] = 0

    def run(self, slots: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], act,
            *, commit_all: bool = False) -> Tensor:
        """Causal depthwise convolution of `x` `[B, S, C]` after each row's committed history,
        activated. The `S` inputs (`S <= T`) become pending; with `commit_all` (any `S`) they
        join the history at once. Padding rows (slot < 0) see a zero history and write nothing."""
        kernel_act = _kernel_activation(act)
        if x.is_cuda and kernel_act is not None and x.stride(-1) == 1:
            # on the GPU one fused pass (ops/shortconv.py) instead of gather, cat, conv, scatter
            from ...ops.shortconv import short_conv_update
            return short_conv_update(self.buf, self.pending, slots, x, weight.contiguous(), bias, kernel_act,
                                     commit_all=commit_all)
        B, S, C = x.shape
        keep = self.kernel - 1
        ok = slots >= 0
        s = torch.where(ok, slots.long(), self.buf.shape[0] - 1)
        hist = self.buf[s, :, :keep] * ok[:, None, None].to(self.buf.dtype)
        xt = x.transpose(1, 2).to(hist.dtype)
        full = torch.cat([hist, xt], dim=-1)
        out = F.conv1d(full.to(weight.dtype), weight[:, None, :], bias, groups=C)[..., -S:]
        # index_fill_, not `pending[s] = n`: a Python value is copied from the host, which a
        # CUDA graph cannot capture
        if commit_all:
            self.buf[s, :, :keep] = full[..., -keep:]
            self.pending.index_fill_(0, s, 0)
        else:
            self.buf[s, :, keep:keep + S] = xt
            self.pending.index_fill_(0, s, S)
        return act(out).to(x.dtype).transpose(1, 2)

    def commit(self, slots: Tensor, accepted: Tensor) -> None:
        """Keep the first `accepted[b]` pending inputs of each row; the window moves on.
        Padding rows keep the spare row's history as it is (no host read: capturable)."""
        ok = slots >= 0
        s = torch.where(ok, slots.long(), self.buf.shape[0] - 1)
        a = torch.where(ok, accepted.to(self.pending.device).long(), 0)
        keep = self.kernel - 1
        idx = (a[:, None] + torch.arange(keep, device=a.device))[:, None, :]
        rows = self.buf[s]
        self.buf[s, :, :keep] = torch.gather(rows, 2, idx.expand(-1, rows.shape[1], -1))
        self.pending.index_fill_(0, s, 0)

    def reset(self, slots: Tensor) -> None:
        s = slots[slots >= 0].long()
        self.buf[s] = 0
        self.pending[s] = 0


class LayerState:
    """One recurrent layer: its adapter, pool and convolution history."""

    def __init__(self, index: int, adapter, opts: dict, num_slots: int, device, dtype):
        self.index, self.adapter, self.opts = index, adapter, opts
        self.pool = self._pool(num_slots, device)
        self.conv = ConvHistory(num_slots, adapter.conv_dim, adapter.conv_kernel, opts["max_tokens"],
                                dtype, device)

    def _pool(self, num_slots: int, device):
        a, o = self.adapter, self.opts
        if o["scheme"] == "conventional":
            return ConventionalPool(a.params(), num_slots, a.V, a.K, a.Hk, device=device, backend=o["backend"])
        if o["scheme"] == "snapshot":
            return SnapshotPool(a.params(), num_slots, a.V, a.K, a.Hk, max_draft=o["max_tokens"], device=device,
                                backend=o["backend"])
        return SlotPool(a.params(), num_slots, a.V, a.K, a.Hk, window=o["window"], max_draft=o["max_tokens"],
                        dtype=torch.float32, device=device, record_dtype=o["record_dtype"],
                        hp_format=o["hp_format"], hp_rounding=o["hp_rounding"], lp_format=o["lp_format"],
                        seed=o["seed"], layer=self.index, backend=o["backend"],
                        eager_max_batch=o["eager_max_batch"])

    def grow(self, num_slots: int, live: Tensor) -> None:
        """Rebuild the pool with more slots, moving the live slots' states (materialized:
        the same state, folded into the checkpoint)."""
        new = self._pool(num_slots, self.pool.device)
        if isinstance(new, SlotPool):
            # the rounding streams go on counting writes: no slot reuses the random numbers it drew
            new.epoch[:self.pool.N] = self.pool.epoch
        if live.numel():
            new.load(live, self.pool.materialize(live))
        self.pool = new
        self.conv.grow(num_slots)


class Binding:
    """The slots of one generation's rows (`slots` `[B]`, -1 for a freed row)."""

    def __init__(self, state: "ReplayState", slots: Tensor):
        self.state_ref = weakref.ref(state)
        self.slots = slots

    def release(self, rows: Optional[Tensor] = None) -> None:
        """Free the slots of `rows` (a bool mask `[B]`; all rows by default); they read as
        padding afterwards."""
        state = self.state_ref()
        sel = torch.ones_like(self.slots, dtype=torch.bool) if rows is None else rows.to(self.slots.device)
        freed = self.slots[sel & (self.slots >= 0)]
        if state is not None and freed.numel():
            state.free(freed)
        self.slots = torch.where(sel, torch.full_like(self.slots, -1), self.slots)


class ReplayState:
    """All ReplaySSM state of one enabled model."""

    def __init__(self, adapters: dict, *, window: int, record_dtype, max_draft: int, backend: str,
                 num_slots: int, device, dtype, scheme: str = "replay", lp_format: Optional[str] = None,
                 hp_format: Optional[str] = None, hp_rounding: Optional[str] = None, seed: int = 0,
                 eager_max_batch: Optional[int] = None):
        # the precision options and eager_max_batch reach the replay scheme's pools only
        self.opts = {"window": window, "record_dtype": record_dtype, "max_tokens": max_draft,
                     "backend": backend, "scheme": scheme, "lp_format": lp_format, "hp_format": hp_format,
                     "hp_rounding": hp_rounding, "seed": seed, "eager_max_batch": eager_max_batch}
        self.num_slots = num_slots
        self.layers = {i: LayerState(i, a, self.opts, num_slots, device, dtype) for i, a in adapters.items()}
        for layer in self.layers.values():
            layer.state_ref = weakref.ref(self)
        self.free_slots = list(range(num_slots))
        # while True, multi-token forwards leave their tokens pending (speculative verification)
        self.verifying = False
        self.latest = lambda: None

    @property
    def max_tokens(self) -> int:
        return self.opts["max_tokens"]

    @property
    def scheme(self) -> str:
        return self.opts["scheme"]

    def allocate(self, n: int, device) -> Tensor:
        if len(self.free_slots) < n:
            gc.collect()                   # caches of finished generations free their slots
        if len(self.free_slots) < n:
            self._grow(max(2 * self.num_slots, self.num_slots + n - len(self.free_slots)))
        got, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(got, dtype=torch.long, device=device)

    def free(self, slots: Tensor) -> None:
        for layer in self.layers.values():
            pool_slots = slots.to(layer.pool.device)
            layer.pool.reset(pool_slots)
            layer.conv.reset(pool_slots)
        self.free_slots.extend(int(s) for s in slots.tolist())

    def _grow(self, num_slots: int) -> None:
        taken = sorted(set(range(self.num_slots)) - set(self.free_slots))
        for layer in self.layers.values():
            layer.grow(num_slots, torch.tensor(taken, dtype=torch.long, device=layer.pool.device))
        self.free_slots.extend(range(self.num_slots, num_slots))
        self.num_slots = num_slots

    def bind(self, cache, batch: int, device) -> Binding:
        """The binding of `cache`'s rows, made (slots allocated) on first use."""
        binding = getattr(cache, "_replayssm_binding", None)
        if binding is None or binding.state_ref() is not self:
            binding = Binding(self, self.allocate(batch, device))
            cache._replayssm_binding = binding
            weakref.finalize(cache, binding.release)
        self.latest = weakref.ref(binding)         # the generation in progress (`generate` frees its rows)
        return binding

    def commit(self, binding: Binding, accepted: Tensor) -> None:
        """Accept the first `accepted[b]` tokens of each row's last verification, in every
        recurrent layer (pool and convolution history)."""
        live = capturing() or bool((binding.slots >= 0).any())
        for layer in self.layers.values():
            slots = binding.slots.to(layer.pool.device)
            acc = accepted.to(layer.pool.device)
            if live:
                # in a CUDA graph: no host reads (the pools' checks; padding rows are skipped on the device)
                layer.pool.commit(slots, acc, validate=not capturing())
            layer.conv.commit(slots, acc)
