"""The short causal convolution before a recurrent layer, over a per-slot input history.

A model integration keeps, per slot, the last `Kc - 1` committed inputs of the depthwise
convolution and room for `T` pending ones (`buf [N + 1, C, Kc - 1 + T]`, the last row a spare
that padding rows write to; `pending [N + 1]`). One step convolves `S <= T` new inputs per row
after that history, applies the activation, and either keeps the inputs pending (a
verification: rejected drafts must leave no trace) or folds them into the history at once.

In PyTorch that is a gather of the histories, a concatenation, a grouped convolution, a
scatter back and several casts: at batch 256 on an H200, about 3 ms of Nemotron-3-Nano-4B's
decode step over its 21 Mamba-2 layers, more than the attention. `short_conv_update` does it in
one pass, each program one row and one block of channels, in fp32.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

ACTIVATIONS = ("silu", "none")


@triton.jit
def _short_conv_kernel(x_ptr, out_ptr, buf_ptr, pend_ptr, slot_ptr, w_ptr, bias_ptr, C, S, spare,
                       sxb, sxs, sob, sos, sbn, sbc,
                       KC: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                       COMMIT_ALL: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    slot = tl.load(slot_ptr + b)
    ok = slot >= 0
    # padding rows read a zero history and write to the spare row (no host read of the ids)
    row = tl.where(ok, slot, spare).to(tl.int64)
    ok = (tl.zeros([BC], dtype=tl.int32) + slot) >= 0      # as a vector: the interpreter masks with no scalars
    hist = buf_ptr + row * sbn + c * sbc
    xrow = x_ptr + b.to(tl.int64) * sxb + c
    if HAS_BIAS:
        bias = tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BC], dtype=tl.float32)
    for t in range(0, S):
        acc = bias
        for j in tl.static_range(KC):
            # position t + j of [history (KC - 1), inputs (S)]; one of the two loads is masked off
            p = t + j
            old = (tl.zeros([BC], dtype=tl.int32) + p) < KC - 1      # a tensor in compiler and interpreter alike
            h = tl.load(hist + p, mask=cm & ok & old, other=0.0).to(tl.float32)
            xv = tl.load(xrow + (p - (KC - 1)) * sxs, mask=cm & ~old, other=0.0).to(tl.float32)
            acc += tl.load(w_ptr + c * KC + j, mask=cm, other=0.0).to(tl.float32) * (h + xv)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + b.to(tl.int64) * sob + t * sos + c, acc.to(out_ptr.dtype.element_ty), mask=cm)
    if COMMIT_ALL:
        # the last KC - 1 positions become the history; position i takes position S + i, which
        # no earlier store of this loop has overwritten (S + i > i)
        for i in tl.static_range(KC - 1):
            p = S + i
            old = (tl.zeros([BC], dtype=tl.int32) + p) < KC - 1
            h = tl.load(hist + p, mask=cm & ok & old, other=0.0)
            xv = tl.load(xrow + (p - (KC - 1)) * sxs, mask=cm & ~old, other=0.0)
            v = tl.where(old, h.to(buf_ptr.dtype.element_ty), xv.to(buf_ptr.dtype.element_ty))
            tl.store(hist + i, v, mask=cm)
    else:
        for t in range(0, S):
            xv = tl.load(xrow + t * sxs, mask=cm, other=0.0)
            tl.store(hist + (KC - 1) + t, xv.to(buf_ptr.dtype.element_ty), mask=cm)
    if tl.program_id(1) == 0:
        if COMMIT_ALL:
            tl.store(pend_ptr + row, tl.zeros([], dtype=pend_ptr.dtype.element_ty))
        else:
            tl.store(pend_ptr + row, tl.zeros([], dtype=pend_ptr.dtype.element_ty) + S)


def short_conv_update(buf: Tensor, pending: Tensor, slots: Tensor, x: Tensor, weight: Tensor,
                      bias: Optional[Tensor], activation: str, *, commit_all: bool,
                      out: Optional[Tensor] = None, block: int = 256, num_warps: int = 2) -> Tensor:
    """Convolve `x [B, S, C]` after each row's committed history in `buf`, activated
    (`activation` in ACTIVATIONS), into `out [B, S, C]` (x's dtype; returned). Rows whose slot is
    negative see a zero history and write only the spare row `buf[-1]`. With `commit_all` the
    inputs join the history (`pending` 0), else they are written pending after it (`pending`
    S). `weight [C, Kc]`, `bias [C]` or None. No host synchronisation: capturable."""
    B, S, C = x.shape
    N1, Cb, P = buf.shape
    Kc = weight.shape[-1]
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if Cb != C or tuple(weight.shape) != (C, Kc) or (bias is not None and tuple(bias.shape) != (C,)):
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, buf {tuple(buf.shape)}, weight "
                         f"{tuple(weight.shape)}, bias {None if bias is None else tuple(bias.shape)}")
    if S < 1 or (not commit_all and Kc - 1 + S > P):
        raise ValueError(f"{S} tokens do not fit the history's {P - (Kc - 1)} pending positions")
    if buf.stride(-1) != 1 or x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError("buf and x need unit stride along their last dimension, weight contiguous")
    if slots.shape != (B,) or pending.shape != (N1,):
        raise ValueError(f"slots {tuple(slots.shape)} / pending {tuple(pending.shape)} do not match "
                         f"batch {B} / {N1} history rows")
    if out is None:
        out = torch.empty(B, S, C, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (B, S, C) or out.stride(-1) != 1:
        raise ValueError(f"out must be [B, S, C] = {(B, S, C)} with unit stride along C, got {tuple(out.shape)}")
    grid = (B, triton.cdiv(C, block))
    _short_conv_kernel[grid](x, out, buf, pending, slots, weight, bias if bias is not None else weight,
                             C, S, N1 - 1, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                             buf.stride(0), buf.stride(1),
                             KC=Kc, BC=block, HAS_BIAS=bias is not None, SILU=activation == "silu",
                             COMMIT_ALL=commit_all, num_warps=num_warps)
    return out
