"""Mamba-2 standard decode on ReplaySSM state (checkpoint + ring buffer of records), in Triton.

One launch per decode step; a program owns one row and a block of `BV` value rows of one head
(or, `rows=True`, BV consecutive rows of the checkpoint seen as `[HV * V, K]`). Window 1 is the
eager step: the conventional kernel with its pending records folded (conventional.py).
The contract is docs/state-layout.md ("Standard decode step"); the mathematics is SPEC.md
sections 2-3; the float64 oracle is `replayssm.reference.Mamba2Params.step`.

Per row with slot `s` and cursor `h = cursor[s]`, window `L`:

    record h      = (ld, w, k) = (dt*A, x, B)         dt = softplus(dt_raw + dt_bias)
    y             = g_{0:h} (C_s q) + sum_{j<=h} g_{j+1:h} (k_j . q) dt_j x_j  (+ D x, * silu(z))
    if h + 1 < L: write record h to the buffer; cursor[s] = h + 1
    else:         C_s <- g_{0:h} C_s + sum_{j<=h} g_{j+1:h} dt_j x_j k_j^T;  cursor[s] = 0; epoch[s] += 1

with `g_{i:h} = exp(sum_{i<=j<=h} ld_j)` and, for buffered records, `dt_j = ld_j / A`. The
record keeps `x` (SPEC's `w = dt x` is formed when it is read): in a buffer of the model's
dtype it is an exact copy, so bf16 records of a bf16 model add no rounding. Record `h` (the
current token) comes from registers; on a flush step it is folded straight into the
checkpoint and never written to the buffer (the buffer restarts at position 0, so it would be
dead on arrival).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..utils.checks import check_window
from ..utils.cursor import hand_off, slot_bases
from ..utils.launch import arrive_counter, gluon_aligned, require_contiguous_slots, slot_pads
from ..utils.tiles import tile_dot, tile_offsets
from .common import (OPTIONAL_INPUTS, check_slots, check_state, check_tensor, check_token_inputs,
                     group_keys, head_values, head_weights, load_tile, record_masks, records_dot,
                     token_decay)
from .configs import REPLAY_CONFIGS, resolve_config
from .conventional import eager_decode
from .gluon_decode import gluon_supported, launch_gluon

__all__ = ["replay_decode"]


# ----------------------------------------------------------------------------------------------
# Kernels

@triton.heuristics(dict(OPTIONAL_INPUTS,
                         EVEN=lambda args: args["V"] % args["BV"] == 0 and args["BK"] == args["K"]))
@triton.jit
def _replay_decode_kernel(
    x, dt, B, C, A, dt_bias, D, z, out,
    ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids,
    pad_ckpt, pad_ld, pad_w, pad_k, pad_cur,
    stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
    stride_z_b, stride_z_h, stride_o_b, stride_o_h,
    HV: tl.constexpr, Hk: tl.constexpr, V: tl.constexpr, K: tl.constexpr, LB: tl.constexpr,
    WINDOW: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, BL: tl.constexpr,
    NVB: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, RECMASK: tl.constexpr,
    EVEN: tl.constexpr, RC: tl.constexpr, KS: tl.constexpr, WS: tl.constexpr,
):
    # grid (HV * NVB, Bt): a program owns V-block i_v of head i_h
    pid = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    i_v = pid % NVB
    i_h = pid // NVB
    HG: tl.constexpr = HV // Hk
    i_g = i_h // HG

    o_v = i_v * BV + tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    o_l = tl.arange(0, BL)
    m_v = o_v < V
    m_k = o_k < K

    p_o = out + i_b * stride_o_b + i_h * stride_o_h + o_v
    slot = tl.load(slot_ids + i_b).to(tl.int64)
    if slot < 0:
        tl.store(p_o, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty), mask=m_v)
        return
    # slot-strided state (vLLM's pages): the bases moved by the slot's padding
    ckpt, buf_ld, buf_w, buf_k, cursor = slot_bases(slot, ckpt, buf_ld, buf_w, buf_k, cursor, pad_ckpt, pad_ld,
                                                    pad_w, pad_k, pad_cur)

    h = tl.load(cursor + slot)
    NPOS: tl.constexpr = WINDOW if WINDOW < LB else LB
    m_j, m_j1, m_lj, m_lj1 = record_masks(o_l, h, NPOS, RECMASK)

    # tile offsets in int32 (a slot's checkpoint is far below 2^31 elements), added to a
    # scalar 64-bit base: a tile of 64-bit addresses would hold twice the registers
    o_S, m_S = tile_offsets(o_v, m_v, K, BK, KS)
    p_S0 = ckpt + slot * (HV * V * K)

    b_kc, b_q, b_kq, b_kcq = group_keys(buf_k + slot * (LB * Hk * K) + i_g * K, Hk * K,
                                        B + i_b * stride_B_b + i_g * stride_B_g,
                                        C + i_b * stride_C_b + i_g * stride_C_g,
                                        o_l, o_k, m_k, m_j, m_lj)
    is_flush = h + 1 >= WINDOW

    b_S = load_tile(p_S0 + i_h * (V * K) + o_S, m_S, EVEN)
    p_Wh = buf_w + slot * (LB * HV * V) + i_h * V
    if WS == 0:
        b_W = tl.load(p_Wh + (o_l[:, None] * (HV * V) + o_v[None, :]),
                      mask=m_lj[:, None] & m_v[None, :], other=0.0)
        b_W = tl.where(m_j[:, None], b_W.to(tl.float32), 0.0)                           # [BL, BV]

    # the current token's record, in registers
    b_dt, b_ld, b_rA = token_decay(dt, dt_bias, A, i_b * stride_dt_b, i_h)
    b_xi = tl.load(x + i_b * stride_x_b + i_h * stride_x_h + o_v, mask=m_v, other=0.0)
    b_x = b_xi.to(tl.float32)
    b_w = b_dt * b_x                                                                    # [BV]
    b_coef, b_g = head_weights(buf_ld + slot * (LB * HV) + i_h, HV, b_ld, b_rA, h, o_l, m_j, m_j1,
                               m_lj, m_lj1)

    b_y = b_g * tile_dot(b_S, b_q, BK, KS)                                              # [BV]
    if WS == 0:
        b_y += tl.sum(b_W * (b_coef * b_kq)[:, None], axis=0)
    else:
        b_cw = b_coef * b_kq
        b_y += records_dot(p_Wh, HV * V, b_cw, b_cw, V, i_v * BV, h, NPOS, V, BV, BL, WS, RECMASK)
    b_y += b_kcq * b_w
    if HAS_D:
        b_y += tl.load(D + i_h).to(tl.float32) * b_x
    if HAS_Z:
        b_z = tl.load(z + i_b * stride_z_b + i_h * stride_z_h + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_y = b_y * b_z / (1.0 + tl.exp(-b_z))
    tl.store(p_o, b_y.to(p_o.dtype.element_ty), mask=m_v)

    if is_flush:
        # C <- g_{0:h} C + sum_{j<h} g_{j+1:h} w_j k_j^T + w_h k_h^T; the current token is
        # folded directly, never written to the buffer. Row chunks of RC, the tile re-read (this
        # program just read it: L2 hits), one rank-1 update per record (exact fp32): the
        # registers of this rare path, which every program is allocated, stay those of an
        # [RC, BK] tile.
        p_kj = buf_k + slot * (LB * Hk * K) + i_g * K + o_k
        for r0 in tl.static_range(0, BV, RC):
            o_r = i_v * BV + r0 + tl.arange(0, RC)
            m_r = o_r < V
            p_Sr = p_S0 + i_h * (V * K) + (o_r[:, None] * K + o_k[None, :])
            m_Sr = m_r[:, None] & m_k[None, :]
            b_Sr = tl.load(p_Sr, mask=m_Sr, other=0.0)                                  # [RC, BK]
            b_xr = tl.load(x + i_b * stride_x_b + i_h * stride_x_h + o_r, mask=m_r, other=0.0)
            b_Sr = b_g * b_Sr + (b_dt * b_xr.to(tl.float32))[:, None] * b_kc[None, :]
            p_wj = buf_w + slot * (LB * HV * V) + i_h * V + o_r
            for j in range(0, h):
                c_j = tl.sum(tl.where(o_l == j, b_coef, 0.0), axis=0)
                w_j = tl.load(p_wj + j * (HV * V), mask=m_r, other=0.0).to(tl.float32)
                k_j = tl.load(p_kj + j * (Hk * K), mask=m_k, other=0.0).to(tl.float32)
                b_Sr += (c_j * w_j)[:, None] * k_j[None, :]
            tl.store(p_Sr, b_Sr, mask=m_Sr)
    else:
        # the record keeps x as given (exact when the buffer has x's dtype)
        p_wh = buf_w + slot * (LB * HV * V) + h * (HV * V) + i_h * V + o_v
        tl.store(p_wh, b_xi.to(p_wh.dtype.element_ty), mask=m_v)
        if i_v == 0:
            tl.store(buf_ld + slot * (LB * HV) + h * HV + i_h, b_ld)
            # the group's key: written by the program holding its first head
            if i_h % HG == 0:
                p_kh = buf_k + slot * (LB * Hk * K) + h * (Hk * K) + i_g * K + o_k
                tl.store(p_kh, b_kc.to(p_kh.dtype.element_ty), mask=m_k)

    # the cursor moves once all HV * NVB programs of the slot have read it (ops/utils/cursor.py)
    hand_off(arrive, cursor, epoch, slot, h, is_flush, HV * NVB)


@triton.heuristics(OPTIONAL_INPUTS)
@triton.jit
def _replay_decode_rows_kernel(
    x, dt, B, C, A, dt_bias, D, z, out,
    ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids,
    pad_ckpt, pad_ld, pad_w, pad_k, pad_cur,
    stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
    stride_z_b, stride_z_h, stride_o_b, stride_o_h,
    HV: tl.constexpr, Hk: tl.constexpr, V: tl.constexpr, K: tl.constexpr, LB: tl.constexpr,
    WINDOW: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, BL: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, RECMASK: tl.constexpr, RC: tl.constexpr,
    WS: tl.constexpr,
):
    # grid (HV * V // BV, Bt): a program owns BV consecutive rows of the slot's checkpoint seen
    # as [HV * V, K], as the conventional kernel's programs do, within one group. With V not a
    # power of two (Nano-4B: 80) such blocks fill every lane where per-head blocks cannot;
    # BV <= V, so a block spans at most two heads, `h_a` and `h_a + 1`: their weights are
    # formed per head and selected per row.
    i_r = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    HG: tl.constexpr = HV // Hk
    r0 = i_r * BV
    i_g = r0 // (HG * V)
    h_a = r0 // V
    h_b = tl.minimum(h_a + 1, HV - 1)

    o_r = r0 + tl.arange(0, BV)
    o_h = o_r // V
    in_b = o_h != h_a                                                                   # [BV]
    o_k = tl.arange(0, BK)
    o_l = tl.arange(0, BL)
    m_k = o_k < K

    p_o = out + i_b * stride_o_b + o_h * stride_o_h + (o_r - o_h * V)
    slot = tl.load(slot_ids + i_b).to(tl.int64)
    if slot < 0:
        tl.store(p_o, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty))
        return
    # slot-strided state (vLLM's pages): the bases moved by the slot's padding
    ckpt, buf_ld, buf_w, buf_k, cursor = slot_bases(slot, ckpt, buf_ld, buf_w, buf_k, cursor, pad_ckpt, pad_ld,
                                                    pad_w, pad_k, pad_cur)

    h = tl.load(cursor + slot)
    m_j, m_j1, m_lj, m_lj1 = record_masks(o_l, h, WINDOW if WINDOW < LB else LB, RECMASK)

    p_S = ckpt + slot * (HV * V * K) + r0 * K
    o_S = tl.arange(0, BV)[:, None] * K + o_k[None, :]
    b_S = load_tile(p_S + o_S, m_k[None, :], BK == K)                                  # [BV, BK]

    b_kc, b_q, b_kq, b_kcq = group_keys(buf_k + slot * (LB * Hk * K) + i_g * K, Hk * K,
                                        B + i_b * stride_B_b + i_g * stride_B_g,
                                        C + i_b * stride_C_b + i_g * stride_C_g,
                                        o_l, o_k, m_k, m_j, m_lj)
    p_W = buf_w + slot * (LB * HV * V) + r0
    if WS == 0:
        b_W = tl.load(p_W + (o_l[:, None] * (HV * V) + tl.arange(0, BV)[None, :]), mask=m_lj[:, None], other=0.0)
        b_W = tl.where(m_j[:, None], b_W.to(tl.float32), 0.0)                           # [BL, BV]

    # the current token: dt and log decay of the block's two heads (scalars), selected per row
    dt_a, b_ld_a, rA_a = token_decay(dt, dt_bias, A, i_b * stride_dt_b, h_a)
    dt_b, b_ld_b, rA_b = token_decay(dt, dt_bias, A, i_b * stride_dt_b, h_b)
    b_dt = tl.where(in_b, dt_b, dt_a)                                                   # [BV]
    b_ldr = tl.where(in_b, b_ld_b, b_ld_a)
    b_xi = tl.load(x + i_b * stride_x_b + o_h * stride_x_h + (o_r - o_h * V))
    b_x = b_xi.to(tl.float32)
    b_w = b_dt * b_x
    p_ld = buf_ld + slot * (LB * HV)
    c_a, g_a = head_weights(p_ld + h_a, HV, b_ld_a, rA_a, h, o_l, m_j, m_j1, m_lj, m_lj1)
    c_b, g_b = head_weights(p_ld + h_b, HV, b_ld_b, rA_b, h, o_l, m_j, m_j1, m_lj, m_lj1)

    b_g = tl.where(in_b, g_b, g_a)                                                      # [BV]
    b_y = b_g * tl.sum(b_S * b_q[None, :], axis=1)
    if WS == 0:
        b_y += tl.sum(b_W * tl.where(in_b[None, :], (c_b * b_kq)[:, None], (c_a * b_kq)[:, None]), axis=0)
    else:
        b_y += records_dot(p_W - r0, HV * V, c_a * b_kq, c_b * b_kq, (h_a + 1) * V, r0, h,
                            WINDOW if WINDOW < LB else LB, HV * V, BV, BL, WS, RECMASK)
    b_y += b_kcq * b_w
    if HAS_D:
        b_y += head_values(D, o_h, h_a, h_b, in_b, True) * b_x
    if HAS_Z:
        b_z = tl.load(z + i_b * stride_z_b + o_h * stride_z_h + (o_r - o_h * V)).to(tl.float32)
        b_y = b_y * b_z / (1.0 + tl.exp(-b_z))
    tl.store(p_o, b_y.to(p_o.dtype.element_ty))

    is_flush = h + 1 >= WINDOW
    if is_flush:
        # C <- g_{0:h} C + sum_{j<h} g_{j+1:h} w_j k_j^T + w_h k_h^T, in row chunks of RC re-read
        # from L2, one rank-1 update per record (exact fp32), as the per-head kernel does
        for c0 in tl.static_range(0, BV, RC):
            o_c = tl.arange(0, RC)
            o_rc = r0 + c0 + o_c
            o_hc = o_rc // V
            in_bc = o_hc != h_a
            p_Sc = p_S + (c0 + o_c)[:, None] * K + o_k[None, :]
            b_Sc = tl.load(p_Sc, mask=m_k[None, :], other=0.0)                         # [RC, BK]
            b_dtc = tl.where(in_bc, dt_b, dt_a)
            b_xc = tl.load(x + i_b * stride_x_b + o_hc * stride_x_h + (o_rc - o_hc * V)).to(tl.float32)
            b_Sc = tl.where(in_bc, g_b, g_a)[:, None] * b_Sc + (b_dtc * b_xc)[:, None] * b_kc[None, :]
            for j in range(0, h):
                c_j = tl.where(in_bc, tl.sum(tl.where(o_l == j, c_b, 0.0), axis=0),
                               tl.sum(tl.where(o_l == j, c_a, 0.0), axis=0))
                w_j = tl.load(p_W + j * (HV * V) + c0 + o_c).to(tl.float32)
                k_j = tl.load(buf_k + slot * (LB * Hk * K) + j * (Hk * K) + i_g * K + o_k, mask=m_k,
                              other=0.0).to(tl.float32)
                b_Sc += (c_j * w_j)[:, None] * k_j[None, :]
            tl.store(p_Sc, b_Sc, mask=m_k[None, :])
    else:
        # the record: x of these rows; the log decay of each head whose first row is here; the
        # group's key from the program holding the group's first row
        tl.store(p_W + h * (HV * V) + tl.arange(0, BV), b_xi.to(p_W.dtype.element_ty))
        tl.store(p_ld + h * HV + o_h, b_ldr, mask=o_r == o_h * V)
        if r0 % (HG * V) == 0:
            p_kh = buf_k + slot * (LB * Hk * K) + h * (Hk * K) + i_g * K + o_k
            tl.store(p_kh, b_kc.to(p_kh.dtype.element_ty), mask=m_k)
    hand_off(arrive, cursor, epoch, slot, h, is_flush, HV * V // BV)



# ----------------------------------------------------------------------------------------------
# Launch and the Python boundary


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _launch_replay(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, epoch,
                   arrive, slot_ids, out, window, BV, num_warps, num_stages, recmask=True, maxnreg=0,
                   KS=1, rows=False, warpsum=False, gluon=False, kq=False):
    Bt, HV, V = x.shape
    Hk, K = B.shape[1], B.shape[2]
    LB = buf_ld.shape[1]
    if Bt == 0:
        return
    if gluon and not _interpreting() and gluon_supported(HV, V, K, Hk, window, LB, BV, num_warps) \
            and gluon_aligned(ckpt, buf_ld, buf_w, buf_k):
        launch_gluon(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive,
                     slot_ids, out, window, BV, num_warps, maxnreg, recmask, kq)
        return
    # record tiles cover positions 0..min(window, Lb) - 1 (cursors never pass the window)
    BL = max(16, triton.next_power_of_2(min(window, LB)))
    extra = {"maxnreg": maxnreg} if maxnreg and not _interpreting() else {}
    # D and z absent: None (the kernels' heuristics set HAS_D / HAS_Z; EVEN too, from V, BV, K)
    args = dict(x=x, dt=dt, B=B, C=C, A=A, dt_bias=dt_bias, D=D, z=z, out=out, ckpt=ckpt,
                buf_ld=buf_ld, buf_w=buf_w, buf_k=buf_k,
                cursor=cursor, epoch=epoch, arrive=arrive, slot_ids=slot_ids,
                **slot_pads(ckpt, buf_ld, buf_w, buf_k, cursor),
                stride_x_b=x.stride(0), stride_x_h=x.stride(1), stride_dt_b=dt.stride(0),
                stride_B_b=B.stride(0), stride_B_g=B.stride(1), stride_C_b=C.stride(0), stride_C_g=C.stride(1),
                stride_z_b=z.stride(0) if z is not None else 0, stride_z_h=z.stride(1) if z is not None else 0,
                stride_o_b=out.stride(0), stride_o_h=out.stride(1))
    meta = dict(HV=HV, Hk=Hk, V=V, K=K, LB=LB, WINDOW=window, BV=BV, BK=triton.next_power_of_2(K), BL=BL,
                RECMASK=bool(recmask), RC=min(16, BV),
                WS=num_warps if warpsum and BL <= 16 else 0, num_warps=num_warps, num_stages=num_stages,
                **extra)
    if rows:
        _replay_decode_rows_kernel[(HV * V // BV, Bt)](**args, **meta)
    else:
        nvb = triton.cdiv(V, BV)
        _replay_decode_kernel[(HV * nvb, Bt)](**args, NVB=nvb, KS=KS, **meta)


@torch.library.custom_op(
    "replayssm::mamba2_replay_decode",
    mutates_args=("out", "ckpt", "buf_ld", "buf_w", "buf_k", "cursor", "epoch", "arrive"),
)
def _replay_decode_op(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, dt_bias: Tensor,
                      D: Optional[Tensor], z: Optional[Tensor], ckpt: Tensor, buf_ld: Tensor,
                      buf_w: Tensor, buf_k: Tensor, cursor: Tensor, epoch: Tensor, arrive: Tensor,
                      slot_ids: Tensor, out: Tensor, window: int, BV: int, num_warps: int,
                      num_stages: int, recmask: bool, maxnreg: int, KS: int, rows: bool,
                      warpsum: bool, gluon: bool, kq: bool) -> None:
    _launch_replay(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, epoch,
                   arrive, slot_ids, out, window, BV, num_warps, num_stages, recmask, maxnreg, KS,
                   rows, warpsum, gluon, kq)


@_replay_decode_op.register_fake
def _(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive,
      slot_ids, out, window, BV, num_warps, num_stages, recmask, maxnreg, KS, rows, warpsum,
      gluon, kq) -> None:
    return None


def replay_decode(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, dt_bias: Tensor,
                  D: Optional[Tensor], z: Optional[Tensor], ckpt: Tensor, buf_ld: Tensor,
                  buf_w: Tensor, buf_k: Tensor, cursor: Tensor, epoch: Tensor, slot_ids: Tensor,
                  window: int, out: Optional[Tensor] = None, config: Optional[dict] = None, *,
                  arrive: Optional[Tensor] = None, validate: bool = True) -> Tensor:
    """One Mamba-2 standard decode step on ReplaySSM state, in place; returns `y`.

    Token inputs: `x` `[Bt, HV, V]`; `dt` `[Bt, HV]` (raw, before `softplus(dt + dt_bias)`);
    `B`, `C` `[Bt, Hk, K]` (Hk groups); `z` `[Bt, HV, V]` or None (gate `y * silu(z)`). Layer
    parameters:
    `A`, `dt_bias` `[HV]`, `D` `[HV]` or None. State (docs/state-layout.md, modified in place):
    `ckpt` `[N, HV, V, K]` fp32; `buf_ld` `[N, Lb, HV]` fp32; `buf_w` `[N, Lb, HV, V]` and
    `buf_k` `[N, Lb, Hk, K]` fp32, bf16 or fp16; `cursor` `[N]` int32; `epoch` `[N]` int64.
    `slot_ids` `[Bt]` int32/int64 (negative: padding row, `y[b] = 0`, nothing touched);
    `window` the replay window `L` (`1 <= L <= Lb`); every live slot must hold `cursor < L`
    (the pool's invariant in standard decode; not checked, it would need a device sync).
    Window 1 is the eager step (the checkpoint is the state after every step, as in
    conventional decoding, and no record is written): the conventional kernel on the
    checkpoint, which first folds the records a row still holds (any cursor below `Lb`);
    `config` then sets only its `BV`, `num_warps`, `num_stages` (see `configs.conventional_config`).
    `configs.eager_max_batch` says up to which batch the tables prefer it.

    `out` `[Bt, HV, V]` of x's dtype: written when given (then the call allocates nothing and is
    capturable in a CUDA graph). `config`: overrides of the launch config (see configs.py).
    `arrive` `[N]` int32, zero-initialised: per-slot arrival counters (left at zero after each
    call); by default a cached per-device tensor, allocated on first use: pass one allocated
    before graph capture. `validate=True` checks shapes, dtypes, devices and the slot ids'
    values (range, duplicates: a host sync on the device, skipped while a CUDA graph is captured
    or torch.compile traces; ops/utils/checks.py); `validate=False` skips every check.
    """
    if validate:
        Bt, HV, V, Hk, K = check_token_inputs(x, dt, B, C, A, dt_bias, D, z)
        dev = x.device
        N, Lb = check_state(ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids, Bt=Bt, HV=HV, V=V,
                            Hk=Hk, K=K, device=dev, slot_strided=window != 1)
        if out is not None:
            check_tensor("out", out, (Bt, HV, V), (x.dtype,), dev, inner=True)
        check_window(window, Lb)
        check_slots(slot_ids, N)
    cfg = resolve_config(REPLAY_CONFIGS, x.shape[1], x.shape[2], B.shape[2], B.shape[1], config,
                         with_flush=True, batch=x.shape[0], window=window)
    if out is None:
        out = torch.empty_like(x)
    if arrive is None:
        arrive = arrive_counter(x.device, ckpt.shape[0])
    if window == 1:
        require_contiguous_slots("the eager step (window 1)", ckpt, buf_ld, buf_w, buf_k, cursor)
        return eager_decode(x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor,
                            epoch, arrive, slot_ids, out, config)
    args = (x, dt, B, C, A, dt_bias, D, z, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive,
            slot_ids, out, int(window), cfg["BV"], cfg["num_warps"], cfg["num_stages"],
            bool(cfg["recmask"]), cfg["maxnreg"], cfg["KS"], bool(cfg["rows"]), bool(cfg["warpsum"]),
            bool(cfg["gluon"]), bool(cfg["kq"]))
    if torch.compiler.is_compiling():
        torch.ops.replayssm.mamba2_replay_decode(*args)
    else:
        _launch_replay(*args)
    return out
