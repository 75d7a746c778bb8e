"""GDN (and, through `IS_KDA`, KDA) conventional decode with a low-precision state: the baseline
serving engines offer (a bf16 or fp16 state, or fp8 with scales), as a kernel, to set against
ReplaySSM's separate precisions (SPEC section 5).

Each step reads the state in its format, runs the fp32 conventional kernel's arithmetic on it
(conventional.py: `S <- a S`, `u = beta (v - S k)`, `S <- S + u k^T`, `o = S q`) and writes the
update back in the format: round-to-nearest (`formats.encode(S, fmt)` bit for bit of the fp32
update, ops/utils/lowp.py) or seeded stochastic rounding (`formats.encode(S, fmt, "stochastic",
seed, stream=slot * 2**32 + step)` bit for bit, ops/utils/sround.py). The next step starts from
the rounded state, so the rounding feeds back: the design whose error SPEC section 5 models.

A program owns `BV` value rows of one head (the conventional table's blocks) and works through
them in chunks of `RC` rows; `u` of a row needs only that row of `S`, and an fp8 row's scale
covers all of K, so every row is encoded where it is computed.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..utils.lowp import load_lp_tile, store_lp_rows
from ..utils.lp_state import STATE_FORMATS, row_chunk, state_args, state_size
from ..utils.sround import store_sr_rows
from .common import (_for_store, _interpreting, _load_head, _load_qk, _scale, check_devices, check_slot_ids,
                     check_slot_values, check_token_inputs)
from .configs import _CONVENTIONAL_TABLE, _resolve_config

__all__ = ["conventional_decode_lp", "STATE_FORMATS"]


@triton.jit
def _conventional_lp_kernel(
    q, k, v, a, b, A_log, dt_bias, o, s_data, s_scale, slot_ids, scale, sr_key, step,
    stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
    stride_a_b, stride_a_h, stride_b_b, stride_b_h,
    HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
    BV: tl.constexpr, BK: tl.constexpr, RC: tl.constexpr,
    IS_KDA: tl.constexpr, USE_QK_L2NORM: tl.constexpr, EXACT_BF16: tl.constexpr,
    SF: tl.constexpr, SR: tl.constexpr, USE_STEP_PTR: tl.constexpr,
):
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0).to(tl.int64)
    i_v = pid % NV
    i_bh = pid // NV
    i_hv = i_bh % HV
    i_b = i_bh // HV
    i_hk = i_hv // (HV // HK)
    o_k = tl.arange(0, BK)
    m_k = o_k < K

    i_s = tl.load(slot_ids + i_b).to(tl.int64)
    if i_s < 0:
        o_v = i_v * BV + tl.arange(0, BV)
        p_o = o + (i_b * HV + i_hv) * V + o_v
        tl.store(p_o, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty), mask=o_v < V)
        return

    b_q, b_k = _load_qk(q, k, i_b, i_hk, o_k, m_k, scale, stride_q_b, stride_q_h, stride_k_b, stride_k_h,
                        USE_QK_L2NORM)
    i_m = i_s * HV + i_hv                                   # this head's matrix in the pool
    if USE_STEP_PTR:
        st = i_s * 4294967296 + tl.load(step).to(tl.int64)
    else:
        st = i_s * 4294967296 + step
    for r0 in tl.static_range(0, BV, RC):
        o_r = i_v * BV + r0 + tl.arange(0, RC)
        m_r = o_r < V
        b_v, b_ld, b_beta = _load_head(v, a, b, A_log, dt_bias, i_b, i_hv, o_r, m_r, o_k, m_k,
                                       stride_v_b, stride_v_h, stride_a_b, stride_a_h, stride_b_b,
                                       stride_b_h, K, IS_KDA)
        b_S = load_lp_tile(s_data, s_scale, s_scale, i_m, o_r, m_r, o_k, m_k, V, K, SF)   # [RC, BK]
        # the fp32 conventional kernel's arithmetic, so that both write the same fp32 update
        if IS_KDA:
            b_S = b_S * tl.exp(b_ld)[None, :]
        else:
            b_S = b_S * tl.exp(b_ld)
        b_u = b_beta * (b_v - tl.sum(b_S * b_k[None, :], axis=1))                      # [RC]
        b_S += b_u[:, None] * b_k[None, :]
        b_o = tl.sum(b_S * b_q[None, :], axis=1)
        if SR:
            store_sr_rows(b_S, s_data, s_scale, i_m, i_hv, o_r, m_r, o_k, m_k, sr_key, st, V, K, SF)
        else:
            store_lp_rows(b_S, s_data, s_scale, i_m, o_r, m_r, o_k, m_k, V, K, SF)
        p_o = o + (i_b * HV + i_hv) * V + o_r
        tl.store(p_o, _for_store(b_o, p_o, EXACT_BF16), mask=m_r)


def conventional_decode_lp(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                           dt_bias: Tensor, scale: Optional[float], state, slot_ids: Tensor, fmt: str,
                           out: Optional[Tensor] = None, use_qk_l2norm: bool = True,
                           config: Optional[dict] = None, *, rounding: str = "nearest", seed: int = 0,
                           step: Union[int, Tensor] = 0, scales: Optional[Tensor] = None, family: str = "gdn",
                           validate: bool = True) -> Tensor:
    """One conventional GDN (`family="gdn"`) or KDA (`"kda"`) decode step on a low-precision
    state, in place; returns `o` `[Bt, HV, V]` (dtype of `v`, or `out`).

    Token inputs, `slot_ids` (negative: a padding row, `o[b] = 0`, no state touched), `out`,
    `use_qk_l2norm` and `validate` as :func:`conventional_decode` (KDA: `a` `[Bt, HV, K]`,
    `dt_bias` `[HV, K]`). `state`: the `[N, HV, V, K]` state in `fmt`, one of `STATE_FORMATS`
    ("fp16", "bf16", "fp8_e4m3"): the dict of parts of `formats.allocate(fmt, [N, HV, V, K])`, or
    the element tensor (float16, bfloat16, float8_e4m3fn) with, for fp8, its row scales `scales`
    `[N, HV, V]` float32. Contiguous. The new state is written `rounding="nearest"` or
    `"stochastic"`: `formats.encode(S, fmt, "stochastic", seed=seed, stream=slot * 2**32 + step)`
    of the step's fp32 update, bit for bit (`step` an int in `[0, 2**32)`, or a one-element
    int32/int64 tensor on the inputs' device holding it, read by the kernel so that a replayed
    CUDA graph takes a new step each time: its value is not checked). `config`: overrides
    of the conventional table (`BV`, `num_warps`, `num_stages`) and `RC`, rows encoded at once (a
    power of two dividing the block).
    """
    if family not in ("gdn", "kda"):
        raise ValueError(f"family must be 'gdn' or 'kda', got {family!r}")
    N = state_size(state)
    if validate:
        Bt, Hk, K, HV, V = check_token_inputs(family, q, k, v, a, b, A_log, dt_bias, out)
        check_slot_ids(slot_ids, Bt)
        parts = state if isinstance(state, dict) else {"data": state, "scale": scales}
        check_devices(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state=parts.get("data"),
                      scales=parts.get("scale"), slot_ids=slot_ids, out=out)
    Bt, Hk, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    st = state_args(state, scales, fmt, rounding, seed, step, N, HV, V, K, device=q.device, validate=validate)
    if validate:
        check_slot_values(slot_ids, N)
    over = dict(config or {})
    rc = over.pop("RC", None)
    cfg = _resolve_config(_CONVENTIONAL_TABLE, family, V, K, over or None, batch=Bt, HV=HV, Hk=Hk)
    BK = triton.next_power_of_2(K)
    BV = min(cfg["BV"], triton.next_power_of_2(V))
    rc = row_chunk(BV, BK, cfg["num_warps"], rc, SF=st["SF"], SR=st["SR"])
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if Bt == 0:
        return out
    _conventional_lp_kernel[(Bt * HV * triton.cdiv(V, BV),)](
        q, k, v, a, b, A_log, dt_bias, out, st["s_data"], st["s_scale"], slot_ids, _scale(scale, K),
        st["sr_key"], st["step"],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        HV=HV, HK=Hk, V=V, K=K, BV=BV, BK=BK, RC=rc, IS_KDA=family == "kda",
        USE_QK_L2NORM=bool(use_qk_l2norm), EXACT_BF16=_interpreting(), SF=st["SF"], SR=st["SR"],
        USE_STEP_PTR=st["USE_STEP_PTR"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
