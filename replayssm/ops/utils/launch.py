"""Pieces the kernels of every family share."""
from __future__ import annotations

import math

import torch
from torch import Tensor

_ARRIVE_CACHE: dict = {}
_SCRATCH_CACHE: dict = {}


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (no host syncs or allocation then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def arrive_counter(device, N: int) -> Tensor:
    """A zeroed `[N]` int32 counter for the cursor hand-off, cached per (device, N).

    The kernels leave it zeroed, so one buffer serves every layer and step on one stream. A
    pool that runs layers on several streams at once should own one per stream and pass it as
    `arrive=` (the slot pool owns one). Created on first use, which must not be inside a
    CUDA-graph capture (warm up first, or pass `arrive=`).
    """
    key = (torch.device(device), int(N))
    t = _ARRIVE_CACHE.get(key)
    if t is None:
        if capturing():
            raise ValueError("arrive counter not allocated yet: call once before capturing "
                             "a CUDA graph, or pass arrive=")
        t = torch.zeros(N, dtype=torch.int32, device=device)
        _ARRIVE_CACHE[key] = t
    return t


def scratch_f32(device, numel: int) -> Tensor:
    """An fp32 scratch buffer of `numel` elements, cached per (device, numel): a launch writes it
    and the next launch of the same step reads it, so one buffer serves every layer and step on
    one stream (contents undefined between steps). Created on first use, which may be inside a
    CUDA-graph capture (vLLM captures without an eager warm-up of each size): it then comes from
    the graph's private pool and, held by this cache, stays allocated after the capture, so no
    later allocation of that pool reuses it and eager steps may use it too; `empty` records no
    kernel in the graph."""
    key = (torch.device(device), int(numel))
    t = _SCRATCH_CACHE.get(key)
    if t is None:
        t = torch.empty(int(numel), dtype=torch.float32, device=device)
        _SCRATCH_CACHE[key] = t
    return t


def table_key(table: dict, key: tuple):
    """The key under which a launch-config table holds the entry of `key`, a shape
    `(family, HV, Hk, V, K)` (the field order of `replayssm.shapes.Shape`): the exact key, else
    the key with `Hk` None (an entry for every key-head count), else with `HV` and `Hk` None
    (every head count); None when the table has none. An entry present but empty counts (for
    the eager tables it means never the eager step)."""
    family, HV, Hk, V, K = key
    for k in (key, (family, HV, None, V, K), (family, None, None, V, K)):
        if k in table:
            return k
    return None


def table_entry(table: dict, key: tuple, batch=None):
    """A launch-config table's entry for the shape `key` (`(family, HV, Hk, V, K)`, looked up as
    `table_key` says): a config dict, or the first of a list of `(max_batch, config)` whose
    `max_batch` >= `batch` (the last one past them all; the first when `batch` is None). None
    when the table has no entry."""
    found = table_key(table, key)
    entry = table[found] if found is not None else None
    if not entry or isinstance(entry, dict):
        return entry or None
    return next((cfg for max_batch, cfg in entry if batch is None or batch <= max_batch), entry[-1][1])


def eager_launch_overrides(entry, config) -> dict:
    """The eager step's overrides of the conventional launch config: its table's `entry`
    (or none), then the `BV`, `num_warps`, `num_stages` of the caller's `config` (the other
    keys of a replay config do not apply to it)."""
    over = dict(entry or {})
    over.update({key: val for key, val in (config or {}).items() if key in ("BV", "num_warps", "num_stages")})
    return over


# The eager step wins while a step's state traffic is latency-bound: on the H200 the measured
# crossover of every tuned shape sits near 32 MiB of fp32 state per step (Super, Nano-4B and
# Qwen3.5-122B at batch 8, Qwen3.5-4B at 16). States far below a real layer's (under 1 MiB a
# row) are latency-bound at any batch; there the window is kept, as the tests' small shapes use.
_EAGER_STATE_BYTES = 32 << 20
_EAGER_MIN_ROW_BYTES = 1 << 20


def eager_reach(HV: int, V: int, K: int) -> int:
    """The batch up to which a shape in no table takes the eager step (a power of two; 0:
    never), from the fp32 state bytes one row moves per step."""
    row = 4 * HV * V * K
    if row < _EAGER_MIN_ROW_BYTES:
        return 0
    b = 1
    while 2 * b * row <= _EAGER_STATE_BYTES:
        b *= 2
    return b if b * row <= _EAGER_STATE_BYTES else 0


def slot_strided(t: Tensor) -> bool:
    """Whether `t` (`[N, ...]`) is laid out as slot rows the kernels can address with a slot
    stride: each row contiguous, rows apart by at least a row (vLLM's pages put a request's
    tensors side by side, so a slot's row of one tensor is strided by the whole page)."""
    if t.dim() == 1:
        return True
    inner = t.stride()[1:] == torch.empty(t.shape[1:], device="meta").stride()
    return inner and t.stride(0) >= math.prod(t.shape[1:])


def slot_pads(ckpt: Tensor, buf_ld: Tensor, buf_w: Tensor, buf_k: Tensor, cursor: Tensor,
              pending: Tensor = None) -> dict:
    """The kernels' slot paddings: per state tensor, its slot stride less its row size, in
    elements (0 for the pool's contiguous tensors). The kernels index rows as
    `base + slot * rowsize`; shifting each base by `slot * pad` first lands them on
    `slot * stride` without touching the addressing that follows."""
    out = dict(pad_ckpt=_slot_pad(ckpt), pad_ld=_slot_pad(buf_ld), pad_w=_slot_pad(buf_w), pad_k=_slot_pad(buf_k),
               pad_cur=_slot_pad(cursor))
    if pending is not None:
        out["pad_pend"] = _slot_pad(pending)
    return out


def _slot_pad(t: Tensor) -> int:
    """One state tensor's slot padding: its slot stride less its row size, in elements."""
    return t.stride(0) - math.prod(t.shape[1:])


def require_contiguous_slots(what: str, *tensors: Tensor) -> None:
    """For paths that take no slot stride (the eager step): refuse slot-strided state, with a
    host-side look at the strides (no sync), even when the caller skips validation."""
    for t in tensors:
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{what} needs contiguous state tensors (strides {t.stride()}); slot-strided "
                             "state (vLLM's pages) is taken by the windowed decode and verify kernels only")


def gluon_aligned(ckpt: Tensor, buf_ld: Tensor, buf_w: Tensor, buf_k: Tensor) -> bool:
    """Whether the Gluon kernels can take this state: they copy its rows in 16-byte pieces
    (cp.async), which compile only where Triton's launch-time specialisation proves the
    alignment, i.e. each tensor's start 16-byte aligned and its slot padding divisible by 16
    elements (always so for the pool's contiguous tensors; vLLM's pages where their sizes
    are round). Elsewhere the launchers run the Triton kernels, which vectorise as far as the
    alignment allows."""
    state = (ckpt, buf_ld, buf_w, buf_k)
    return all(t.data_ptr() % 16 == 0 and _slot_pad(t) % 16 == 0 for t in state)
