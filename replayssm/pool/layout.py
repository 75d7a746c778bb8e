"""The pool's tensors as one object (docs/state-layout.md): what every backend reads and writes.

Shapes: `N` slots, `HV` value heads, `Hk` key heads, `V`, `K` a head's state dims, `Lb = L + T`
the buffer capacity.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .. import formats


@dataclass
class Layout:
    """`ckpt`: the high-precision checkpoint's parts (`{"data": [N, HV, V, K]}` in the pool's
    dtype, or a format's parts, `replayssm.formats.allocate`); `ckpt_lp`: the optional
    low-precision checkpoint's parts; `buf`: records `ld` `[N, Lb, HV]` (KDA `[N, Lb, HV, K]`),
    `w` `[N, Lb, HV, V]`, `k` `[N, Lb, Hk, K]`, and for GDN/KDA with two checkpoints the raw
    `v`, `beta`; `cursor` `[N]` int32; `pending` `[N]` int32; `epoch` `[N]` int64, checkpoint writes
    (flushes and loads), never reset; `arrive` `[N]` int32, the kernels' arrival counters;
    `stream_seed`, the seed of the stochastic rounding of the high-precision checkpoint (the
    pool's, from its `seed` and `layer`), which kernels that write that checkpoint need."""

    ckpt: dict
    ckpt_lp: Optional[dict]
    buf: dict
    cursor: Tensor
    pending: Tensor
    epoch: Tensor
    arrive: Tensor
    stream_seed: int = 0

    @classmethod
    def allocate(cls, *, N: int, HV: int, Hk: int, V: int, K: int, Lb: int, dtype: torch.dtype,
                 record_dtype: torch.dtype, vector_decay: bool, raw_records: bool,
                 hp_format: Optional[str], lp_format: Optional[str], device) -> "Layout":
        """Zero-filled tensors of a pool (`raw_records`: keep `v` and `beta` for the
        high-precision refold of GDN/KDA's `u`, SPEC section 5)."""
        shape = (N, HV, V, K)
        ckpt = (formats.allocate(hp_format, shape, device, dtype) if hp_format
                else {"data": torch.zeros(shape, dtype=dtype, device=device)})
        ckpt_lp = formats.allocate(lp_format, shape, device, dtype) if lp_format else None
        ld_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        buf = {"ld": torch.zeros((N, Lb, HV, K) if vector_decay else (N, Lb, HV), dtype=ld_dtype,
                                 device=device),
               "w": torch.zeros(N, Lb, HV, V, dtype=record_dtype, device=device),
               "k": torch.zeros(N, Lb, Hk, K, dtype=record_dtype, device=device)}
        if raw_records:
            buf["v"] = torch.zeros(N, Lb, HV, V, dtype=record_dtype, device=device)
            buf["beta"] = torch.zeros(N, Lb, HV, dtype=ld_dtype, device=device)
        zeros = dict(dtype=torch.int32, device=device)
        return cls(ckpt=ckpt, ckpt_lp=ckpt_lp, buf=buf, cursor=torch.zeros(N, **zeros),
                   pending=torch.zeros(N, **zeros),
                   epoch=torch.zeros(N, dtype=torch.int64, device=device),
                   arrive=torch.zeros(N, **zeros))

    def slot_records(self, s: int) -> dict:
        """Slot `s`'s buffer as views (the reference writes records into them in place)."""
        return {name: t[s] for name, t in self.buf.items()}
