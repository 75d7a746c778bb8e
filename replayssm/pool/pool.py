"""The slot pool: checkpoints, record buffers and cursors of one layer for `N` sequences.

Layout and semantics: docs/state-layout.md. Rows are addressed by slot-id tensors, as serving
engines address their state pools; a negative id marks a padding row (zero output, nothing
touched). Every public method validates its arguments first and raises `ValueError` naming
the offending value before anything changes. An empty batch is accepted and changes nothing.
The operations are decode-time only: they run under `torch.no_grad`, so inputs that require
grad never pull the pool's tensors into an autograd graph.

On the CPU (and for configurations the GPU kernels do not cover, said in `backend_note`) the
pool runs the reference of `replayssm.reference.algorithms`; on CUDA the kernels registered in
`backends` plug into the same tensors (`layout.Layout`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import warnings
from typing import Optional

import torch
from torch import Tensor

from .. import formats
from ..reference import algorithms as R
from . import backends
from . import validate as check
from .layout import Layout

_STREAM_SLOT_STRIDE = 1 << 32
# low-precision checkpoint formats whose reads the decode kernels decode (None: no LP copy)
_KERNEL_LP_FORMATS = (None, "fp16", "bf16", "fp8_e4m3", "nvfp4")
# high-precision checkpoint formats the decode kernels write (nvfp4: only without a copy)
_KERNEL_HP_FORMATS = (None, "fp32", "fp16", "bf16", "fp8_e4m3", "nvfp4")
# default `layer` ids: distinct for every pool built in this process, in construction order
_LAYER_IDS = itertools.count()


class SlowReadWarning(UserWarning):
    """A pool's low-precision copy reads slower than its fp32 checkpoint on the GPU (measured:
    `backends.SLOW_LP_READS`): the copy costs memory and buys no speed there."""


class SlotPool:
    """Recurrent state of one layer for `num_slots` sequences, kept as ReplaySSM state.

    Args:
        params: a family's parameters (`Mamba2Params`, `GDNParams`, `KDAParams`); copied to
            the pool's dtype and device.
        num_slots: `N`, the number of sequence slots.
        head_v_dim, head_k_dim: `V` and `K` of a head's `[V, K]` state.
        num_k_heads: `Hk`, key heads (Mamba-2 groups); divides `params.num_heads`.
        window: `L`, the replay window (records folded into the checkpoint every `L` tokens).
        max_draft: `T`, the most tokens one `verify` call takes (buffer capacity `L + T`).
        dtype: compute dtype (float32, or float64 for the reference); also the checkpoint's
            storage when `hp_format` is None.
        hp_format: storage format of the high-precision checkpoint (None: `dtype` itself; or one
            of `replayssm.formats.FORMATS`).
        hp_rounding: rounding of the high-precision checkpoint ("stochastic" by default for
            formats narrower than fp32, else "nearest").
        lp_format: format of an optional low-precision checkpoint read by non-flush steps
            (always round-to-nearest).
        record_dtype: storage dtype of buffered values and keys (default: `dtype`): float32,
            float64, bfloat16 or float16. Mamba-2 records keep the inputs `x` and `B` as
            given, so on a bf16 model bf16 records lose nothing and move half the bytes;
            GDN/KDA records hold the computed `u`, which bf16 rounds (about 2e-3 relative
            output error, not growing).
        seed, layer: key the stochastic-rounding streams, with the slot and its checkpoint
            write count (`epoch`, never reset), so that no two roundings share random numbers
            across sequences of one slot or across pools. `layer` (an integer, e.g. the layer's
            index in its model) defaults to a fresh id per pool built in this process; give it
            for runs reproducible from `seed` alone.
        backend: "reference" (plain PyTorch, any device), "triton" (the GPU kernels: CUDA, fp32
            state; with or without a low-precision copy in fp16, bf16, fp8_e4m3 or nvfp4, or
            one narrow checkpoint, the shared design) or "auto" (triton where it applies).
            Operations the kernels do not cover run on the reference, on the same tensors
            (`backend_note` speaks of decode; `verify` follows `backends.verify_lp_covers`).
        eager_max_batch: `decode` batches of at most this many rows take the eager step
            (window 1: every row flushes, folding the records it still holds, so the
            checkpoint is the state, as in conventional decoding; no record is written).
            Small batches are latency-bound and gain nothing from the window. None: the
            kernels' measured choice for this shape (`replayssm.ops.<family>.eager_max_batch`,
            0 for shapes they have not measured), on either backend, so that both keep the
            same cursors.
    """

    def __init__(self, params, num_slots: int, head_v_dim: int, head_k_dim: int, num_k_heads: int,
                 *, window: int = 16, max_draft: int = 1, dtype: torch.dtype = torch.float32,
                 device=None, hp_format: Optional[str] = None, hp_rounding: Optional[str] = None,
                 lp_format: Optional[str] = None, record_dtype: Optional[torch.dtype] = None,
                 seed: int = 0, layer: Optional[int] = None, backend: str = "auto",
                 eager_max_batch: Optional[int] = None):
        check.params(params)
        check.positive_ints(num_slots=num_slots, head_v_dim=head_v_dim, head_k_dim=head_k_dim,
                            num_k_heads=num_k_heads, window=window, max_draft=max_draft)
        if eager_max_batch is not None and (not isinstance(eager_max_batch, int)
                                            or isinstance(eager_max_batch, bool) or eager_max_batch < 0):
            raise ValueError(f"eager_max_batch must be None or an integer >= 0, got {eager_max_batch!r}")
        if max_draft > window:
            raise ValueError(f"window {window} is too small for max_draft {max_draft} (need window >= max_draft)")
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        check.record_dtype(record_dtype)
        check.count("seed", seed)
        check.count("layer", layer, optional=True)
        check.params_shapes(params, head_k_dim)
        HV = params.num_heads
        if HV % num_k_heads:
            raise ValueError(f"num_k_heads {num_k_heads} must divide the {HV} value heads")
        if hp_format is not None:
            formats.check_format(hp_format)
        if lp_format is not None:
            formats.check_format(lp_format)
        if hp_rounding is None:
            hp_rounding = "nearest" if hp_format in (None, "fp32") else "stochastic"
        if hp_rounding not in formats.ROUNDINGS:
            raise ValueError(f"hp_rounding must be one of {formats.ROUNDINGS}, got {hp_rounding!r}")
        if "nvfp4" in (hp_format, lp_format) and head_k_dim % 16:
            raise ValueError(f"nvfp4 needs head_k_dim divisible by 16, got {head_k_dim}")
        device = check.device(device)

        self.params = _params_to(params, dtype, device)
        self.family = params.family
        self.N, self.HV, self.V, self.K, self.Hk = num_slots, HV, head_v_dim, head_k_dim, num_k_heads
        self.window, self.max_draft, self.capacity = window, max_draft, window + max_draft
        self.dtype, self.device, self.seed = dtype, device, int(seed)
        self.layer = next(_LAYER_IDS) if layer is None else int(layer)
        digest = hashlib.blake2b(f"{self.seed}:{self.layer}".encode(), digest_size=8).digest()
        self.stream_seed = int.from_bytes(digest, "little")   # the seed the roundings draw from
        self.hp_format, self.hp_rounding, self.lp_format = hp_format, hp_rounding, lp_format
        self.record_dtype = record_dtype or dtype
        # GDN/KDA with two checkpoints: `u` of non-flush steps came from C_LP; refold from raw inputs
        self.recompute = bool(self.params.delta and lp_format is not None)

        self.layout = Layout.allocate(N=num_slots, HV=HV, Hk=num_k_heads, V=head_v_dim, K=head_k_dim,
                                      Lb=self.capacity, dtype=dtype, record_dtype=self.record_dtype,
                                      vector_decay=self.params.vector_decay, raw_records=self.recompute,
                                      hp_format=hp_format, lp_format=lp_format, device=device)
        lay = self.layout
        lay.stream_seed = self.stream_seed        # the kernels' stochastic rounding, as _write's
        # the tensors by name, as docs/state-layout.md calls them
        self.ckpt, self.ckpt_lp, self.buf = lay.ckpt, lay.ckpt_lp, lay.buf
        self.cursor, self.pending, self.epoch, self.arrive = lay.cursor, lay.pending, lay.epoch, lay.arrive
        self.backend = self._pick_backend(backend)
        if eager_max_batch is None:
            eager_max_batch = backends.get(self.family, "eager_max_batch", "any")(
                HV, head_v_dim, head_k_dim, num_k_heads)
        self.eager_max_batch = eager_max_batch

    def _pick_backend(self, backend: str) -> str:
        if backend not in ("auto", "reference", "triton"):
            raise ValueError(f"backend must be 'auto', 'reference' or 'triton', got {backend!r}")
        why = None
        interpreted = self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
        if self.device.type != "cuda" and not (interpreted and backend == "triton"):
            why = f"device {self.device} is not CUDA (on the CPU: TRITON_INTERPRET=1 and backend='triton')"
        elif self.dtype != torch.float32 or self.hp_format not in _KERNEL_HP_FORMATS:
            why = ("the kernels cover a float32 pool's high-precision checkpoint in fp32, fp16, bf16, "
                   "fp8_e4m3 or (alone) nvfp4")
        elif self.hp_format not in (None, "fp32") and self.lp_format is not None and (
                self.hp_rounding != "stochastic" or "nvfp4" in (self.hp_format, self.lp_format)):
            # alone (the shared design) a narrow checkpoint takes either rounding, NVFP4 included
            why = ("beside a low-precision copy the kernels write an fp16/bf16/fp8 high-precision "
                   "checkpoint with stochastic rounding only, and the copy in fp16/bf16/fp8")
        elif self.lp_format not in _KERNEL_LP_FORMATS:
            why = f"the kernels read low-precision checkpoints in {_KERNEL_LP_FORMATS[1:]}, not {self.lp_format}"
        elif self.record_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            why = f"record dtype {self.record_dtype} is not fp32/bf16/fp16"
        if backend == "triton" and why:
            raise ValueError(f"backend 'triton' unavailable: {why}")
        if backend == "reference":
            why = "backend='reference' was asked for"
        # why decode runs on the reference; None when it runs on the kernels. A pool with a
        # low-precision copy, or with one narrow checkpoint (the shared design), decodes on the
        # precision kernels (ops/<family>/precision.py); `verify` says what it runs on.
        self.backend_note = why
        if backend == "auto" and why and self.device.type == "cuda":
            warnings.warn(f"SlotPool on {self.device} decodes on the reference: {why}", stacklevel=3)
        slow = backends.slow_lp_read(self.family, self.lp_format)
        if slow and not why and self.device.type == "cuda":
            warnings.warn(f"SlotPool on {self.device}: {slow}", SlowReadWarning, stacklevel=3)
        return "reference" if why else "triton"

    # ------------------------------------------------------------------ storage helpers
    def _read(self, parts: Optional[dict], fmt: Optional[str], s: int) -> Optional[Tensor]:
        if parts is None:
            return None
        if fmt is None:
            return parts["data"][s]
        return formats.decode({k: v[s:s + 1] for k, v in parts.items()}, fmt, self.dtype)[0]

    def _write(self, s: int, S: Tensor) -> None:
        """Store a new checkpoint of slot `s` (HP with its rounding, LP round-to-nearest) and
        count the write in `epoch[s]`.

        The stochastic-rounding stream is keyed by the pool's `stream_seed` (seed and layer),
        the slot and its write count, which `reset` leaves alone: no two roundings share
        random numbers."""
        if self.hp_format is None:
            self.ckpt["data"][s] = S
        else:
            stream = torch.tensor([s * _STREAM_SLOT_STRIDE + int(self.epoch[s])], device=self.device)
            parts = formats.encode(S[None], self.hp_format, self.hp_rounding, seed=self.stream_seed,
                                   stream=stream)
            for key, val in parts.items():
                self.ckpt[key][s] = val[0]
        if self.ckpt_lp is not None:
            parts = formats.encode(S[None], self.lp_format, "nearest")
            for key, val in parts.items():
                self.ckpt_lp[key][s] = val[0]
        self.epoch[s] += 1

    # ------------------------------------------------------------------ operations
    @torch.no_grad()   # decode-time state is never differentiated; a graph would grow every step
    def decode(self, slot_ids: Tensor, *, out: Optional[Tensor] = None, validate: bool = True,
               **inputs: Tensor) -> Tensor:
        """One standard decode step (SPEC section 3) for a batch of rows.

        `slot_ids`: `[B]`; inputs per family, each `[B, ...]` (Mamba-2: `x`, `dt`, `B`, `C`,
        optional `z`; GDN/KDA: `q`, `k`, `v`, `a`, `b`). Returns `[B, HV, V]`. Drafts of a
        previous `verify` that were not committed are discarded. A batch of at most
        `eager_max_batch` rows takes the eager step (window 1).

        `out`: `[B, HV, V]` in the pool's dtype, contiguous, on its device (checked when
        `validate`); the outputs are written into it and it is returned, on either backend.
        On the triton backend `out` and `validate=False` make the call free of host
        synchronisation and allocation, so it can be captured in a CUDA graph (validate once,
        outside the graph). An empty batch returns `[0, HV, V]` and changes nothing.
        """
        if validate:
            slot_ids = check.slots(self, slot_ids)
            inputs = check.inputs(self, inputs, slot_ids.shape[0], steps=False)
            check.out(self, out, slot_ids.shape[0])
        B = slot_ids.shape[0]
        if B == 0:
            return out if out is not None else torch.zeros(0, self.HV, self.V, dtype=self.dtype,
                                                           device=self.device)
        window = 1 if B <= self.eager_max_batch else self.window
        if self.backend == "triton":
            return self._decode_kernel(slot_ids, inputs, out, window)
        raw = {k: v for k, v in inputs.items() if k != "z"}
        prep = self.params.prepare(**raw)
        y_all = torch.zeros(B, self.HV, self.V, dtype=self.dtype, device=self.device)
        for b, s in enumerate(slot_ids.tolist()):
            if s < 0:
                continue
            tok = {k: v[b] for k, v in prep.items()}
            h = int(self.cursor[s])
            y, S = R.decode_step(self.params, self._read(self.ckpt, self.hp_format, s),
                                 self._read(self.ckpt_lp, self.lp_format, s), self.layout.slot_records(s),
                                 h, window, tok, self.recompute)
            y_all[b] = y
            if S is not None:
                self._write(s, S)
                self.cursor[s] = 0
            else:
                self.cursor[s] = h + 1
            self.pending[s] = 0
        y_all = self._finish(y_all, slot_ids, inputs)
        return y_all if out is None else out.copy_(y_all)

    def _decode_kernel(self, slot_ids: Tensor, inputs: dict, out: Optional[Tensor], window: int) -> Tensor:
        inputs = {k: v.contiguous() for k, v in inputs.items()}
        if self.lp_format is None and self.hp_format in (None, "fp32"):
            y = backends.get(self.family, "decode")(self.params, self.layout, slot_ids, inputs, window, out)
        else:
            # a low-precision copy, or one narrow checkpoint (the shared design, lp_format None)
            y = backends.get(self.family, "decode_lp")(self.params, self.layout, slot_ids, inputs, window,
                                                        out, self.lp_format, self.hp_rounding)
        # a decode discards drafts left uncommitted
        backends.get(self.family, "clear_pending")(self.layout, slot_ids)
        return y

    @torch.no_grad()
    def verify(self, slot_ids: Tensor, *, num_drafts: Optional[Tensor] = None,
               out: Optional[Tensor] = None, validate: bool = True, **inputs: Tensor) -> Tensor:
        """Output-only verification of `T` tokens per row (SPEC section 4).

        Inputs `[B, T, ...]`, `1 <= T <= max_draft`. Returns `[B, T, HV, V]`, the outputs the
        conventional recurrence would give for the tokens in order. `num_drafts` `[B]` int
        (default: `T` for every row): row b verifies its first `num_drafts[b]` tokens
        (`1..T`), its outputs past them are zero whatever those tokens hold (NaN and Inf
        included; with `validate=False` a count outside `0..T` is clamped to it, on every
        backend, as the kernels do). The tokens stay pending until `commit`; a row
        whose cursor `h` has `h + num_drafts[b] > window` first folds its committed records
        into the checkpoint (the early flush, decided from the cursor alone).

        `out` `[B, T, HV, V]` as for `decode`. On the triton backend, `out` and
        `validate=False` make the call free of host synchronisation and allocation (CUDA
        graphs): validate once, outside the graph. A pool with a low-precision copy, or with
        one fp16/bf16/fp8/nvfp4 checkpoint, verifies on `ops.<family>.lowp_verify` there
        (`backends.verify_lp_covers`).
        """
        if validate:
            slot_ids = check.slots(self, slot_ids)
            inputs = check.inputs(self, inputs, slot_ids.shape[0], steps=True)
        B = slot_ids.shape[0]
        T = next(iter(inputs.values())).shape[1]
        if validate:
            check.num_drafts(self, num_drafts, B, T)
            check.out(self, out, B, T)
        if B == 0:
            return out if out is not None else torch.zeros(0, T, self.HV, self.V, dtype=self.dtype,
                                                           device=self.device)
        if self.backend == "triton":
            args = (self.params, self.layout, slot_ids, {k: v.contiguous() for k, v in inputs.items()},
                    self.window, num_drafts, out)
            # one fp32 checkpoint: the verify kernels; a low-precision copy or a narrow HP
            # checkpoint: the verify_lp kernels where they cover it, else the reference below
            if self.lp_format is None and self.hp_format in (None, "fp32"):
                return backends.get(self.family, "verify")(*args)
            if backends.verify_lp_covers(self.hp_format, self.hp_rounding, self.lp_format, self.family):
                return backends.get(self.family, "verify_lp")(*args, self.lp_format, self.hp_rounding)
        raw = {k: v for k, v in inputs.items() if k != "z"}
        prep = self.params.prepare(**raw)
        # unvalidated counts are clamped to 0..T as the kernels clamp them, so that no row's
        # pending count passes the drafts it wrote; a row with none verifies nothing
        ns = [T] * B if num_drafts is None else [min(max(int(n), 0), T) for n in num_drafts.tolist()]
        y_all = torch.zeros(B, T, self.HV, self.V, dtype=self.dtype, device=self.device)
        for b, s in enumerate(slot_ids.tolist()):
            if s < 0:
                continue
            n = ns[b]
            if n == 0:
                self.pending[s] = 0
                continue
            toks = {k: v[b, :n] for k, v in prep.items()}
            Y, S, start = R.verify_step(self.params, self._read(self.ckpt, self.hp_format, s),
                                        self._read(self.ckpt_lp, self.lp_format, s), self.layout.slot_records(s),
                                        int(self.cursor[s]), self.window, toks, self.recompute)
            y_all[b, :n] = Y
            if S is not None:
                self._write(s, S)
            self.cursor[s] = start
            self.pending[s] = n
        y_all = self._finish(y_all, slot_ids, inputs)
        if num_drafts is not None:
            # a select, not a product: the skip term and gate of an unverified token may be
            # NaN or Inf (an engine's unused draft positions hold anything), and NaN * 0 is NaN
            keep = torch.arange(T, device=self.device)[None, :] < torch.tensor(ns, device=self.device)[:, None]
            y_all = y_all.masked_fill(~keep[:, :, None, None], 0)
        return y_all if out is None else out.copy_(y_all)

    @torch.no_grad()
    def commit(self, slot_ids: Tensor, accepted: Tensor, *, validate: bool = True) -> None:
        """Accept the first `accepted[b]` (`1..num_drafts[b]`) tokens of each row's last
        `verify`.

        Rejected tokens stay behind the cursor and are overwritten later: rollback is the
        cursor move itself. `accepted` `[B]` int on the pool's device (as a sampler makes
        it); on the triton backend one launch, and with `validate=False` no host
        synchronisation (unvalidated counts are clamped to `0..pending`).
        """
        if validate:
            slot_ids = check.slots(self, slot_ids)
            check.accepted(self, slot_ids, accepted)
        if slot_ids.shape[0] == 0:
            return
        run = backends.get(self.family, "commit") if self.backend == "triton" else None
        if run is not None:
            run(self.layout, slot_ids, accepted)
            return
        valid = slot_ids >= 0
        s, a = slot_ids[valid].long(), accepted[valid]
        a = torch.minimum(a.to(torch.int32).clamp(min=0), self.pending[s])
        self.cursor[s] += a
        self.pending[s] = 0

    def memory_per_sequence(self) -> dict:
        """Bytes of recurrent state one sequence holds, per scheme: `"replay"`, this pool's
        (checkpoints, `L + T` records, cursor, pending and epoch: every per-slot tensor), and
        `"snapshot"`, the `T + 1` full states per sequence that snapshot verification keeps
        (one per draft token plus the state it starts from) at the pool's checkpoint format."""
        lay = self.layout
        tensors = [*lay.ckpt.values(), *(lay.ckpt_lp or {}).values(), *lay.buf.values(), lay.cursor,
                   lay.pending, lay.epoch]
        replay = sum(t.element_size() * t.numel() for t in tensors) // self.N
        state = sum(t.element_size() * t.numel() for t in lay.ckpt.values()) // self.N
        return {"replay": int(replay), "snapshot": int((self.max_draft + 1) * state)}

    @torch.no_grad()
    def reset(self, slot_ids: Tensor) -> None:
        """Free slots: zero state, cursor 0, no pending drafts (a new sequence starts empty)."""
        slot_ids = check.slots(self, slot_ids)
        s = slot_ids[slot_ids >= 0].long()
        for store in (self.ckpt, self.ckpt_lp or {}):
            for t in store.values():
                t[s] = 0
        self.cursor[s] = 0
        self.pending[s] = 0

    free = reset

    @torch.no_grad()
    def load(self, slot_ids: Tensor, state: Tensor) -> None:
        """Install states (e.g. after prefill): `state` `[B, HV, V, K]` becomes each slot's
        checkpoint (rounded to the pool's formats), with an empty buffer."""
        slot_ids = check.slots(self, slot_ids)
        check.state(self, slot_ids, state)
        state = state.to(self.dtype)
        for b, s in enumerate(slot_ids.tolist()):
            if s >= 0:
                self._write(s, state[b])
                self.cursor[s] = 0
                self.pending[s] = 0

    @torch.no_grad()
    def materialize(self, slot_ids: Tensor) -> Tensor:
        """The current state of each slot, `[B, HV, V, K]` (checkpoint plus committed records,
        along the high-precision path); zero for padding rows. Changes nothing."""
        slot_ids = check.slots(self, slot_ids)
        out = torch.zeros(slot_ids.shape[0], self.HV, self.V, self.K, dtype=self.dtype, device=self.device)
        for b, s in enumerate(slot_ids.tolist()):
            if s >= 0:
                out[b] = R.materialize(self.params, self._read(self.ckpt, self.hp_format, s),
                                       self.layout.slot_records(s), int(self.cursor[s]), self.recompute)
        return out

    def _finish(self, out: Tensor, slot_ids: Tensor, inputs: dict) -> Tensor:
        out = self.params.finish(out, **inputs)
        pad = slot_ids < 0
        if bool(pad.any()):
            out[pad] = 0
        return out


def _params_to(params, dtype, device):
    """A copy of `params` with every tensor field on `device` in `dtype`, detached (a model's
    `nn.Parameter`s must not tie the pool to autograd, nor alias its storage)."""
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    return type(params)(**{k: (v.detach().to(dtype=dtype, device=device, copy=True)
                               if isinstance(v, Tensor) else v) for k, v in fields.items()})
