"""ReplaySSM state inside the blocks vLLM allocates per request (plain PyTorch, no vLLM).

vLLM gives each recurrent layer a tuple of tensors, one per declared state shape, each
`[num_blocks, *shape]`, all of a block's tensors packed into one page (so the slot stride of
every tensor is the page, not the tensor's own size). A request's state is block `s` of each
(its state index in vLLM's metadata, our slot id). `StateSpec` declares the tensors, in the
order vLLM allocates them:

    0 conv state      vLLM's own shape and dtype (its convolution kernels keep using it)
    1 ckpt            [HV, V, K] fp32       the checkpoint (where vLLM keeps its SSM state)
    2 ld              [Lb, HV] fp32         record decays (log a_j)
    3 w               [Lb, HV, V] records   Mamba-2 x_j, GDN u_j
    4 k               [Lb, Hk, K] records   Mamba-2 B_j, GDN the normalised key
    5 counters        [2] int32             cursor, pending

so that tensor 1 is where vLLM's own prefill writes its final state (the checkpoint, seeded
with cursor 0). With `side_records` (prefix caching in `align` mode and
`REPLAYSSM_VLLM_PREFIX_RECORDS=side`) the page holds tensors 0, 1 and 5 only, so that it is
stock's size and vLLM's cache block stock's, and tensors 2-4 are the plugin's own,
`[num_blocks, ...]` each, indexed by block as the pages are (`BlockState.from_kv_cache`'s
`side`). The epoch (checkpoint writes; it keys only the stochastic rounding of narrow
checkpoints, and this checkpoint is fp32) and the kernels' arrival counters are the plugin's,
`[num_blocks]` each, outside the pages.

`BlockState` holds the views; `flush`, `commit`, `seed` act on them with device tensors only
(no host sync, CUDA-graph safe); the executors run decode and verify on them: `KernelExecutor`
through the kernels (directly when they accept a slot stride, else through contiguous scratch
rows), `ReferenceExecutor` through `SlotPool`'s reference (the CPU, tests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

_SIZES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.int32: 4}
N_TENSORS = 6                     # the tensors a block holds, in the order above


@dataclass(frozen=True)
class StateSpec:
    """One layer's declaration. `family` "mamba2" or "gdn"; `HV`, `Hk`, `V`, `K` as in
    docs/state-layout.md; `window` `L`; `max_draft` `T` (1 + vLLM's speculative tokens, 1
    without speculation); `record_dtype`; vLLM's conv state `conv_shape` / `conv_dtype`."""

    family: str
    HV: int
    Hk: int
    V: int
    K: int
    window: int
    max_draft: int
    record_dtype: torch.dtype
    conv_shape: Tuple[int, ...]
    conv_dtype: torch.dtype
    side_records: bool = False

    def __post_init__(self):
        if self.family not in ("mamba2", "gdn"):
            raise ValueError(f"family must be 'mamba2' or 'gdn', got {self.family!r}")
        if self.HV % self.Hk:
            raise ValueError(f"Hk={self.Hk} must divide HV={self.HV}")
        if not 1 <= self.max_draft <= 8:
            raise ValueError(f"max_draft {self.max_draft} (1 + speculative tokens) must be in 1..8 "
                             "(the verify kernels take at most 8 tokens)")
        if self.window < self.max_draft:
            raise ValueError(f"window {self.window} is smaller than max_draft {self.max_draft}")
        if self.record_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"record dtype {self.record_dtype} must be fp32, bf16 or fp16")

    @property
    def capacity(self) -> int:
        return self.window + self.max_draft

    def shapes(self) -> Tuple[Tuple[int, ...], ...]:
        """The tensors of vLLM's page, as declared to it."""
        full = (tuple(self.conv_shape), (self.HV, self.V, self.K), *self.record_shapes(), (2,))
        return (full[0], full[1], full[5]) if self.side_records else full

    def dtypes(self) -> Tuple[torch.dtype, ...]:
        full = (self.conv_dtype, torch.float32, *self.record_dtypes(), torch.int32)
        return (full[0], full[1], full[5]) if self.side_records else full

    def record_shapes(self) -> Tuple[Tuple[int, ...], ...]:
        """The records' tensors (decays, values, keys) per block, in the page or beside it."""
        Lb = self.capacity
        return (Lb, self.HV), (Lb, self.HV, self.V), (Lb, self.Hk, self.K)

    def record_dtypes(self) -> Tuple[torch.dtype, ...]:
        return torch.float32, self.record_dtype, self.record_dtype

    def page_bytes(self) -> int:
        """Bytes of one block's state in vLLM's page, before vLLM pads the page."""
        return sum(_numel(s) * _SIZES[d] for s, d in zip(self.shapes(), self.dtypes()))

    def side_bytes(self) -> int:
        """Bytes of one block's records outside the page (0 unless `side_records`)."""
        if not self.side_records:
            return 0
        return sum(_numel(s) * _SIZES[d] for s, d in zip(self.record_shapes(), self.record_dtypes()))

    def check_alignment(self) -> None:
        """vLLM places each tensor right after the previous one in the page: each must start at
        a multiple of its element size (vLLM asserts it too, later and less clearly)."""
        off = 0
        for i, (s, d) in enumerate(zip(self.shapes(), self.dtypes())):
            if off % _SIZES[d]:
                raise ValueError(f"state tensor {i} ({d}) would start at byte {off}, not a multiple of "
                                 f"{_SIZES[d]}: conv shape {self.conv_shape} x {self.conv_dtype}")
            off += _numel(s) * _SIZES[d]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


@dataclass
class BlockState:
    """Views of one layer's state over vLLM's blocks (`N` = num_blocks): `ckpt` `[N, HV, V, K]`,
    `ld`, `w`, `k`, `cursor`, `pending` (strided in dim 0), and the plugin's `epoch` (int64)
    and `arrive` (int32), contiguous `[N]`."""

    spec: StateSpec
    conv: Tensor
    ckpt: Tensor
    ld: Tensor
    w: Tensor
    k: Tensor
    cursor: Tensor
    pending: Tensor
    epoch: Tensor
    arrive: Tensor

    @property
    def N(self) -> int:
        return self.ckpt.shape[0]

    @classmethod
    def from_kv_cache(cls, spec: StateSpec, kv_cache: Sequence[Tensor],
                      side: Optional[Sequence[Tensor]] = None) -> "BlockState":
        """The views of the tensors vLLM bound to the layer (`layer.kv_cache`), checked against
        the declaration; with `spec.side_records`, the records' own tensors `side` (decays,
        values, keys; `allocate_side`)."""
        n = len(spec.shapes())
        if len(kv_cache) != n:
            raise ValueError(f"expected the {n} state tensors replayssm declared, got {len(kv_cache)}")
        N = kv_cache[0].shape[0]
        for i, (t, s, d) in enumerate(zip(kv_cache, spec.shapes(), spec.dtypes())):
            if tuple(t.shape) != (N, *s) or t.dtype != d:
                raise ValueError(f"state tensor {i} is {tuple(t.shape)} {t.dtype}, declared {(N, *s)} {d}")
        if spec.side_records:
            if side is None or len(side) != 3:
                raise ValueError("side_records: the records' three tensors (decays, values, keys) are needed")
            for name, t, s, d in zip(("decays", "values", "keys"), side, spec.record_shapes(), spec.record_dtypes()):
                if tuple(t.shape) != (N, *s) or t.dtype != d or t.device != kv_cache[0].device:
                    raise ValueError(f"side records' {name} are {tuple(t.shape)} {t.dtype} on {t.device}, "
                                     f"declared {(N, *s)} {d} on {kv_cache[0].device}")
            (ld, w, k), counters = side, kv_cache[2]
        elif side is not None:
            raise ValueError("records outside the page given for a spec that keeps them in it")
        else:
            (ld, w, k), counters = kv_cache[2:5], kv_cache[5]
        dev = counters.device
        return cls(spec=spec, conv=kv_cache[0], ckpt=kv_cache[1], ld=ld, w=w, k=k,
                   cursor=counters[:, 0], pending=counters[:, 1],
                   epoch=torch.zeros(N, dtype=torch.int64, device=dev),
                   arrive=torch.zeros(N, dtype=torch.int32, device=dev))

    @staticmethod
    def allocate_side(spec: StateSpec, N: int, device="cpu") -> Tuple[Tensor, ...]:
        """The records' tensors outside the page for `N` blocks (`spec.side_records`), zeros."""
        return tuple(torch.zeros((N, *s), dtype=d, device=device)
                     for s, d in zip(spec.record_shapes(), spec.record_dtypes()))

    @classmethod
    def allocate_paged(cls, spec: StateSpec, N: int, device="cpu", pad_bytes: int = 0) -> "BlockState":
        """Tensors laid out as vLLM lays them (one page per block, each tensor strided by the
        page), for tests and tools without vLLM: returns the state; `.pages` the raw bytes."""
        page = spec.page_bytes() + pad_bytes
        raw = torch.zeros(N * page, dtype=torch.uint8, device=device)
        views, off = [], 0
        for s, d in zip(spec.shapes(), spec.dtypes()):
            size = _SIZES[d]
            inner = torch.empty((N, *s)).stride()[1:]
            views.append(torch.as_strided(raw.view(d), (N, *s), (page // size, *inner), off // size))
            off += _numel(s) * size
        side = cls.allocate_side(spec, N, device) if spec.side_records else None
        st = cls.from_kv_cache(spec, views, side)
        st.pages = raw
        return st


def page_view(state: BlockState) -> Tensor:
    """Each block's page as one row `[N, words]` (int32 words where the page allows, else
    bytes): the region from the first tensor's start over `spec.page_bytes()`, at vLLM's page
    stride, so that copying a row copies every tensor of the block (conv state included).
    Built once per state: a decode step asks for it in every layer."""
    view = state.__dict__.get("_page_view")
    if view is None:
        view = state.__dict__["_page_view"] = _page_view(state)
    return view


def _page_view(state: BlockState) -> Tensor:
    parts = (state.conv, state.ckpt, state.cursor) + (() if state.spec.side_records else (state.ld, state.w, state.k))
    start = min(t.storage_offset() * t.element_size() for t in parts)
    stride = state.conv.stride(0) * state.conv.element_size()
    size = state.spec.page_bytes()
    raw = torch.empty(0, dtype=torch.uint8, device=state.conv.device)
    raw.set_(state.conv.untyped_storage(), start, (state.N, size), (stride, 1))
    if start % 4 == 0 and stride % 4 == 0 and size % 4 == 0:
        return raw.view(torch.int32)
    return raw


# ------------------------------------------------------------------------------ device ops

def live_rows(slots: Tensor) -> Tuple[Tensor, Tensor]:
    """`(live, index)`: the rows with a slot (>= 0) and an index safe to gather with (padding
    rows read block 0, vLLM's null block, and their results are masked away)."""
    live = slots >= 0
    return live, torch.where(live, slots, torch.zeros_like(slots)).long()


def record_values(family: str, A: Optional[Tensor], ld: Tensor, w: Tensor) -> Tensor:
    """The value each record folds (Mamba-2 `dt_j x_j` with `dt = ld / A`; GDN `u_j`)."""
    if family == "mamba2":
        return (ld / A.float())[..., None] * w
    return w


@torch.no_grad()
def flush(state: BlockState, slots: Tensor, A: Optional[Tensor] = None) -> None:
    """Fold each row's committed records into its checkpoint, `cursor = 0`, `pending = 0`,
    `epoch += 1` (rows with cursor 0 keep their checkpoint). Batched over rows, no host sync;
    padding rows (slot < 0) are untouched. `A` `[HV]`: Mamba-2's decay rate (None for GDN).

    S = exp(sum_j ld_j) C + sum_j exp(sum_{i>j} ld_i) w_j k_j^T over records j < cursor."""
    spec = state.spec
    live, idx = live_rows(slots)
    if idx.numel() == 0:
        return
    Lb = spec.capacity
    h = state.cursor.index_select(0, idx).clamp(0, Lb)
    pos = torch.arange(Lb, device=idx.device)
    m = (pos[None, :] < h[:, None]) & live[:, None]                                 # [B, Lb]
    ld = torch.where(m[..., None], state.ld.index_select(0, idx), 0.0)               # [B, Lb, HV]
    w = record_values(spec.family, A, ld, state.w.index_select(0, idx).float())
    w = torch.where(m[..., None, None], w, 0.0)                                      # stale records may hold NaN
    k = state.k.index_select(0, idx).float().repeat_interleave(spec.HV // spec.Hk, dim=2)
    k = torch.where(m[..., None, None], k, 0.0)
    total = ld.sum(1)                                                                # [B, HV]
    tail = torch.exp(total[:, None] - ld.cumsum(1))                                  # decay after record j
    C = state.ckpt.index_select(0, idx)
    S = torch.exp(total)[..., None, None] * C + torch.einsum("blh,blhv,blhk->bhvk", tail, w, k)
    S = torch.where(live[:, None, None, None], S, C)
    state.ckpt.index_copy_(0, idx, S)
    _set_counters(state, idx, live, cursor=0, pending=0, epoch_step=1)


def _set_counters(state: BlockState, idx: Tensor, live: Tensor, *, cursor=None, pending=None,
                  epoch_step: int = 0) -> None:
    # padding rows index block 0 (null block): write back what it held
    if cursor is not None:
        old = state.cursor.index_select(0, idx)
        state.cursor.index_copy_(0, idx, torch.where(live, torch.full_like(old, cursor), old))
    if pending is not None:
        old = state.pending.index_select(0, idx)
        state.pending.index_copy_(0, idx, torch.where(live, torch.full_like(old, pending), old))
    if epoch_step:
        old = state.epoch.index_select(0, idx)
        state.epoch.index_copy_(0, idx, old + live.to(old.dtype) * epoch_step)


@torch.no_grad()
def seed(state: BlockState, slots: Tensor) -> None:
    """After vLLM's prefill wrote the final state into the checkpoint: empty records
    (`cursor = 0`, `pending = 0`), one checkpoint write counted."""
    live, idx = live_rows(slots)
    if idx.numel():
        _set_counters(state, idx, live, cursor=0, pending=0, epoch_step=1)


@torch.no_grad()
def commit(state: BlockState, slots: Tensor, accepted: Tensor) -> None:
    """`cursor += clamp(accepted, 0, pending)`, `pending = 0` per live row: the cursor move of
    `ops.utils.commit.commit` on strided views, in device ops (no sync)."""
    live, idx = live_rows(slots)
    if idx.numel() == 0:
        return
    p = state.pending.index_select(0, idx)
    a = torch.minimum(accepted.to(p.dtype).clamp(min=0), p)
    h = state.cursor.index_select(0, idx)
    state.cursor.index_copy_(0, idx, torch.where(live, h + a, h))
    state.pending.index_copy_(0, idx, torch.where(live, torch.zeros_like(p), p))
