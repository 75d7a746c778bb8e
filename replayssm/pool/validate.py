"""The pool's one validator: arguments checked at the Python boundary, before anything
changes, with `ValueError` naming the offending value.

Host synchronisation policy: validation reads slot ids, draft and accepted counts on the host
(one copy each); it is the only part of an operation that does. `validate=False` (`decode`,
`verify`, `commit`) skips it, and on the triton backend the operation is then free of host
synchronisation, for CUDA graphs (validate once, outside the graph).
"""
from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import Tensor

from ..reference import GDNParams, KDAParams, Mamba2Params

PARAM_TYPES = (Mamba2Params, GDNParams, KDAParams)
RECORD_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def positive_ints(**values) -> None:
    for name, val in values.items():
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {val!r}")


def count(name: str, val, *, optional: bool = False) -> None:
    """An integer >= 0 (`numbers.Integral`: numpy integers too), or None when `optional`."""
    if val is None and optional:
        return
    if not isinstance(val, numbers.Integral) or isinstance(val, bool) or val < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {val!r}")


def params(p) -> None:
    if not isinstance(p, PARAM_TYPES):
        raise ValueError(f"params must be one of {[t.__name__ for t in PARAM_TYPES]} "
                         f"(e.g. replayssm.testing.make_params), got {type(p).__name__}")


def params_shapes(p, head_k_dim: int) -> None:
    """Each parameter tensor's shape against the head count and `head_k_dim` (KDA's `dt_bias` is
    per key channel): a mismatch would otherwise surface inside the first step's arithmetic."""
    HV = p.num_heads
    want = {"dt_bias": (HV, head_k_dim) if p.family == "kda" else (HV,), "D": (HV,)}
    for name, shape in want.items():
        t = getattr(p, name, None)
        if isinstance(t, torch.Tensor) and tuple(t.shape) != shape:
            what = f" (head_k_dim {head_k_dim})" if p.family == "kda" and name == "dt_bias" else ""
            raise ValueError(f"params.{name} must have shape {list(shape)} for {HV} heads{what}, "
                             f"got {list(t.shape)}")


def record_dtype(dtype) -> None:
    if dtype is not None and dtype not in RECORD_DTYPES:
        raise ValueError(f"record_dtype must be one of {RECORD_DTYPES}, got {dtype!r}")


def device(dev) -> torch.device:
    """The canonical device (`"cuda"` -> `cuda:0`, so comparisons with tensors' devices hold)."""
    try:
        dev = torch.empty(0, device=dev if dev is not None else "cpu").device
    except (RuntimeError, TypeError, AssertionError) as err:
        # (a CPU-only torch asserts "Torch not compiled with CUDA enabled" for any cuda device)
        raise ValueError(f"device {dev!r} is not usable here: {err}") from None
    if dev.type == "meta":
        raise ValueError("device 'meta' holds no data; a pool needs real storage")
    return dev


def slots(pool, slot_ids) -> Tensor:
    """`[B]` int32/int64 on the pool's device, ids `< N`, no valid id twice (B may be 0)."""
    if not isinstance(slot_ids, Tensor):
        raise ValueError(f"slot_ids must be a tensor, got {type(slot_ids).__name__}")
    if slot_ids.dim() != 1:
        raise ValueError(f"slot_ids must be a 1-D tensor, got shape {tuple(slot_ids.shape)}")
    if slot_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_ids must be int32 or int64, got {slot_ids.dtype}")
    if slot_ids.device != pool.device:
        raise ValueError(f"slot_ids are on {slot_ids.device}, the pool on {pool.device}")
    ids = slot_ids.tolist()
    bad = [s for s in ids if s >= pool.N]
    if bad:
        raise ValueError(f"slot id {bad[0]} out of range for a pool of {pool.N} slots")
    valid = [s for s in ids if s >= 0]
    if len(set(valid)) != len(valid):
        dup = next(s for s in valid if valid.count(s) > 1)
        raise ValueError(f"slot id {dup} appears more than once in one call")
    return slot_ids


def inputs(pool, given: dict, batch: int, steps: bool) -> dict:
    """The family's token inputs, `[batch, ...]` (or `[batch, T, ...]` with `steps`), cast to
    the pool's dtype."""
    spec = pool.params.input_spec(pool.V, pool.K, pool.Hk)
    unknown = set(given) - set(spec)
    if unknown:
        raise ValueError(f"unknown input {sorted(unknown)[0]!r} for {pool.family}; expected {sorted(spec)}")
    T = None
    out = {}
    for name, (shape, optional) in spec.items():
        t = given.get(name)
        if t is None:
            if optional:
                continue
            raise ValueError(f"missing input {name!r} for {pool.family}")
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise ValueError(f"input {name!r} must be a floating-point tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.device != pool.device:
            raise ValueError(f"input {name!r} is on {t.device}, the pool on {pool.device}")
        dims = ", ".join(map(str, shape))
        if steps:
            if t.dim() != 2 + len(shape) or t.shape[0] != batch:
                raise ValueError(f"input {name!r} has shape {tuple(t.shape)}, expected [{batch}, T, {dims}]")
            T = t.shape[1] if T is None else T
            if t.shape[1] != T:
                raise ValueError(f"input {name!r} has {t.shape[1]} tokens, others {T}")
            if tuple(t.shape[2:]) != shape:
                raise ValueError(f"input {name!r} has shape {tuple(t.shape)}, expected [{batch}, {T}, {dims}]")
        elif tuple(t.shape) != (batch, *shape):
            raise ValueError(f"input {name!r} has shape {tuple(t.shape)}, expected {(batch, *shape)}")
        out[name] = t.to(pool.dtype)
    if steps and T is not None and not 1 <= T <= pool.max_draft:
        raise ValueError(f"verify got T={T} tokens; this pool takes 1..{pool.max_draft} (max_draft)")
    return out


def out(pool, o: Optional[Tensor], batch: int, steps: Optional[int] = None) -> None:
    """`out=` of decode (`[B, HV, V]`) or verify (`[B, T, HV, V]`, `steps = T`): the pool's
    dtype, on its device, contiguous."""
    if o is None:
        return
    expect = (batch, pool.HV, pool.V) if steps is None else (batch, steps, pool.HV, pool.V)
    if not isinstance(o, Tensor):
        raise ValueError(f"out must be a tensor of shape {expect}, got {type(o).__name__}")
    if tuple(o.shape) != expect or o.dtype != pool.dtype or o.device != pool.device:
        raise ValueError(f"out must be a {pool.dtype} tensor of shape {expect} on {pool.device}, "
                         f"got {o.dtype} {tuple(o.shape)} on {o.device}")
    if not o.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {o.stride()}")


def num_drafts(pool, n, batch: int, T: int) -> None:
    """Per-row draft counts of `verify`: None, or a `[B]` int32/int64 tensor on the pool's
    device with every entry in `1..T`."""
    if n is None:
        return
    if not isinstance(n, Tensor) or tuple(n.shape) != (batch,):
        raise ValueError(f"num_drafts must be a tensor of shape ({batch},), got "
                         f"{tuple(n.shape) if isinstance(n, Tensor) else type(n).__name__}")
    if n.dtype not in (torch.int32, torch.int64) or n.device != pool.device:
        raise ValueError(f"num_drafts must be an int32/int64 tensor on {pool.device}, "
                         f"got {n.dtype} on {n.device}")
    bad = [v for v in n.tolist() if not 1 <= v <= T]
    if bad:
        raise ValueError(f"num_drafts holds {bad[0]}, outside 1..{T} (the tokens given)")


def accepted(pool, slot_ids: Tensor, acc) -> None:
    """Accepted counts of `commit`: `1..pending` per valid row (a row without a verify since
    its last commit or decode has nothing pending and is refused)."""
    if not isinstance(acc, Tensor) or acc.shape != slot_ids.shape:
        raise ValueError(f"accepted must be a tensor of shape {tuple(slot_ids.shape)}, got "
                         f"{tuple(acc.shape) if isinstance(acc, Tensor) else type(acc).__name__}")
    if acc.dtype not in (torch.int32, torch.int64) or acc.device != pool.device:
        raise ValueError(f"accepted must be an int32/int64 tensor on {pool.device}, "
                         f"got {acc.dtype} on {acc.device}")
    valid = slot_ids >= 0
    s, a = slot_ids[valid].long(), acc[valid]
    for si, ai, pi in zip(s.tolist(), a.tolist(), pool.pending[s].tolist()):
        if pi == 0:
            raise ValueError(f"slot {si} has no pending verified tokens to commit")
        if not 1 <= ai <= pi:
            raise ValueError(f"accepted {ai} for slot {si} is outside 1..{pi}")


def state(pool, slot_ids: Tensor, st) -> None:
    """States of `load`: `[B, HV, V, K]` floating point on the pool's device."""
    expect = (slot_ids.shape[0], pool.HV, pool.V, pool.K)
    if not isinstance(st, Tensor) or tuple(st.shape) != expect:
        raise ValueError(f"state must have shape {expect}, got "
                         f"{tuple(st.shape) if isinstance(st, Tensor) else type(st).__name__}")
    if not st.is_floating_point() or st.device != pool.device:
        raise ValueError(f"state must be floating point on {pool.device}, got {st.dtype} on {st.device}")
