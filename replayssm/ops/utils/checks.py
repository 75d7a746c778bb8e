"""The checks of every family's kernels at the Python boundary: tensors (shape, dtype, device,
contiguity), slot ids (dtype, shape, range, duplicates) and the window. Each raises ValueError
naming the offending argument and value; which arguments a kernel takes, and their shapes, are
the family's (`ops/<family>/common.py`).

One policy for the values held in tensors, in every family's kernels: a call that validates
(`validate=True`, the default) checks its slot ids' values (range, duplicates;
`check_slot_values`) and, where the family checks them, its cursors, on the CPU and on the
device alike. On the device that reads them back, a host sync, which is skipped only while a
CUDA graph is being captured or torch.compile traces (`may_sync`): there the shapes, dtypes and
devices are still checked. `validate=False` checks nothing at all.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .launch import capturing, slot_strided

__all__ = ["may_sync", "check_tensor", "check_devices", "check_window", "check_slot_ids",
           "check_slot_values", "SLOT_DTYPES"]

SLOT_DTYPES = (torch.int32, torch.int64)


def may_sync() -> bool:
    """Whether a check may read device values back: always, except while a CUDA graph is being
    captured or torch.compile traces (the policy's one exception, module docstring). The
    compiler is asked first: its tracer cannot step into the capture query."""
    return not (torch.compiler.is_compiling() or capturing())


def check_tensor(name: str, t, shape: Optional[Sequence[int]] = None, dtypes: Optional[Sequence] = None,
                 device=None, *, contiguous: bool = False, inner: bool = False) -> None:
    """Raise ValueError naming `name` unless `t` is a tensor of `shape`, a dtype in `dtypes`,
    on `device` (each None: any); `contiguous`: fully contiguous; `inner`: last dim contiguous."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected one of {[str(d) for d in dtypes]}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} is on {t.device}, expected device {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()})")
    if inner and t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (strides {t.stride()})")


def check_devices(**tensors) -> None:
    """All the given tensors (None and non-tensors skipped) on the device of the first."""
    devs = {name: t.device for name, t in tensors.items() if isinstance(t, Tensor)}
    if not devs:
        return
    first = next(iter(devs.values()))
    for name, d in devs.items():
        if d != first:
            raise ValueError(f"{name} is on {d}, expected device {first} (all tensors on one device)")


def check_window(window, Lb: int) -> None:
    """The replay window: an int in `[1, Lb]`."""
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= Lb:
        raise ValueError(f"window={window!r} must be an int in [1, Lb={Lb}]")


def check_slot_ids(slot_ids, Bt: int, device=None) -> None:
    """`slot_ids` a contiguous `[Bt]` int32/int64 tensor (on `device`, when given)."""
    check_tensor("slot_ids", slot_ids, (Bt,), SLOT_DTYPES, device, contiguous=True)


def check_slot_values(slot_ids: Tensor, N: int) -> None:
    """Live slot ids (the non-negative ones) below `N` and each at most once, wherever the ids
    are. On the device a host sync: skipped only where `may_sync` says no (graph capture,
    compilation)."""
    if not may_sync():
        return
    ids = slot_ids.detach().to("cpu", torch.int64)
    live = ids[ids >= 0]
    if live.numel() and int(live.max()) >= N:
        raise ValueError(f"slot_ids holds {int(live.max())}, out of range for a pool of N={N} slots")
    u, c = live.unique(return_counts=True)
    if bool((c > 1).any()):
        raise ValueError(f"slot_ids repeats slot(s) {[int(x) for x in u[c > 1]]} (more than once "
                         "in one call)")


def check_slot_rows(**tensors) -> None:
    """Each `[N, ...]` tensor laid out as slot rows (`utils.launch.slot_strided`): its rows
    contiguous and at least a row apart, so the kernels' slot stride can address them."""
    for name, t in tensors.items():
        if not slot_strided(t):
            raise ValueError(f"{name} must be contiguous within each slot's row, rows at least a row apart "
                             f"(strides {t.stride()})")
