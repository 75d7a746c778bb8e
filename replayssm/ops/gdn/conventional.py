"""Conventional (read-update-write) GDN decode: the baseline ReplaySSM is measured against.

The semantics of vLLM's fused recurrent gated-delta-rule decode with in-kernel gating: per
row and value head, read `S` (`[V, K]` fp32), `S <- a S`, `u = beta (v - S k)`,
`S <- S + u k^T`, `o = S q`, write `S` back. Every step moves the whole state twice, so the
kernel is a pure streaming kernel: one `[BV, K]` tile per program, loads contiguous along K.
KDA (`IS_KDA`) scales the key columns by a channel-wise decay instead of a scalar.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..utils.cursor import eager_bookkeeping, fold_pending
from ..utils.launch import eager_launch_overrides
from .common import (_for_store, _interpreting, _load_token, _scale, check_devices,
                     check_slot_ids, check_slot_values, check_tensor,
                     check_token_inputs)
from .configs import _CONVENTIONAL_TABLE, _resolve_config, eager_config

__all__ = ["conventional_decode", "run_conventional", "run_eager"]


@triton.jit
def _conventional_decode_kernel(
    q, k, v, a, b, A_log, dt_bias, o, state, slot_ids, scale,
    buf_ld, buf_w, buf_k, cursor, epoch, arrive,
    stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
    stride_a_b, stride_a_h, stride_b_b, stride_b_h,
    HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
    BV: tl.constexpr, BK: tl.constexpr,
    IS_KDA: tl.constexpr, USE_QK_L2NORM: tl.constexpr, EXACT_BF16: tl.constexpr,
    FOLD: tl.constexpr, LBCAP: tl.constexpr,
):
    # FOLD: the eager step of ReplaySSM state (window 1, see run_eager): `state` is the
    # checkpoint, records still pending behind the slot's cursor are folded into the tile
    # first, and the step flushes (cursor 0, epoch + 1). Otherwise the plain conventional step.
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0).to(tl.int64)
    i_v = pid % NV
    i_bh = pid // NV
    i_hv = i_bh % HV
    i_b = i_bh // HV
    i_hk = i_hv // (HV // HK)

    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    p_o = o + (i_b * HV + i_hv) * V + o_v

    i_s = tl.load(slot_ids + i_b).to(tl.int64)
    if i_s < 0:
        tl.store(p_o, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty), mask=m_v)
        return
    p_S = state + ((i_s * HV + i_hv) * V + o_v)[:, None] * K + o_k[None, :]
    m_S = m_v[:, None] & m_k[None, :]
    if FOLD:
        h = tl.load(cursor + i_s)
        e0 = tl.load(epoch + i_s)
    b_S = tl.load(p_S, mask=m_S, other=0.)                                  # [BV, BK] fp32

    b_q, b_k, b_v, b_ld, b_beta = _load_token(
        q, k, v, a, b, A_log, dt_bias, i_b, i_hv, i_hk, o_v, m_v, o_k, m_k, scale,
        stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
        stride_a_b, stride_a_h, stride_b_b, stride_b_h, K, IS_KDA, USE_QK_L2NORM)
    if FOLD:
        # after every load is issued: the branch waits for them all at once
        if h > 0:
            o_p = i_s * LBCAP
            if IS_KDA:
                p_ld = buf_ld + (o_p * HV + i_hv) * K + o_k
            else:
                p_ld = buf_ld + o_p * HV + i_hv
            # the tile re-read (an L1/L2 hit), so that the loaded one is dead in here
            b_S = fold_pending(tl.load(p_S, mask=m_S, other=0.), h, p_ld, buf_w + (o_p * HV + i_hv) * V + o_v,
                               buf_k + (o_p * HK + i_hk) * K + o_k, HV * K if IS_KDA else HV,
                               HV * V, HK * K, m_v, m_k, 2 if IS_KDA else 0)

    if IS_KDA:
        b_S = b_S * tl.exp(b_ld)[None, :]
    else:
        b_S = b_S * tl.exp(b_ld)
    b_u = b_beta * (b_v - tl.sum(b_S * b_k[None, :], axis=1))              # [BV]
    b_S += b_u[:, None] * b_k[None, :]
    b_o = tl.sum(b_S * b_q[None, :], axis=1)
    tl.store(p_S, b_S, mask=m_S)
    tl.store(p_o, _for_store(b_o, p_o, EXACT_BF16), mask=m_v)
    if FOLD:
        eager_bookkeeping(arrive, cursor, epoch, i_s, h, e0, pid % (HV * NV) == 0, HV * NV)


def launch_conventional(family: str, q, k, v, a, b, A_log, dt_bias, scale: float, state,
                        slot_ids, o, use_qk_l2norm: bool, BV: int, num_warps: int,
                        num_stages: int, pending: Optional[tuple] = None) -> None:
    """The conventional step on `state`; with `pending` = `(buf_ld, buf_w, buf_k, cursor,
    epoch, arrive)` the eager step on ReplaySSM state (`state` is then the checkpoint)."""
    Bt, Hk, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    if Bt == 0:
        return
    BK = triton.next_power_of_2(K)
    BV = min(BV, triton.next_power_of_2(V))
    NV = triton.cdiv(V, BV)
    fold = pending is not None
    # without FOLD the kernel never reads the pool's buffers: any pointers of the right types
    # (not None: that would drop them from the signature, move the other parameters and change
    # the SASS a little)
    buf_ld, buf_w, buf_k, cursor, epoch, arrive = pending if fold else (state, state, state, slot_ids, slot_ids,
                                                                        slot_ids)
    _conventional_decode_kernel[(Bt * HV * NV,)](
        q, k, v, a, b, A_log, dt_bias, o, state, slot_ids, scale,
        buf_ld, buf_w, buf_k, cursor, epoch, arrive,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        HV=HV, HK=Hk, V=V, K=K, BV=BV, BK=BK, IS_KDA=family == "kda",
        USE_QK_L2NORM=bool(use_qk_l2norm), EXACT_BF16=_interpreting(),
        FOLD=fold, LBCAP=buf_w.shape[1] if fold else 1,
        num_warps=num_warps, num_stages=num_stages,
    )


def _register_conventional_op(family: str):
    """The custom op `replayssm::{family}_conventional_decode` (GDN and KDA share the kernel)."""

    @torch.library.custom_op(f"replayssm::{family}_conventional_decode", mutates_args=("o", "state"))
    def op(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
           scale: float, state: Tensor, slot_ids: Tensor, o: Tensor, use_qk_l2norm: bool, BV: int,
           num_warps: int, num_stages: int) -> None:
        launch_conventional(family, q, k, v, a, b, A_log, dt_bias, scale, state, slot_ids, o,
                            use_qk_l2norm, BV, num_warps, num_stages)

    @op.register_fake
    def _(q, k, v, a, b, A_log, dt_bias, scale, state, slot_ids, o, use_qk_l2norm, BV, num_warps,
          num_stages) -> None:
        return None

    return op


_CONVENTIONAL_OPS = {family: _register_conventional_op(family) for family in ("gdn", "kda")}


def _register_eager_op(family: str):
    """The custom op `replayssm::{family}_eager_decode`: the window-1 step of `replay_decode`."""

    @torch.library.custom_op(f"replayssm::{family}_eager_decode",
                             mutates_args=("o", "ckpt", "cursor", "epoch", "arrive"))
    def op(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
           scale: float, ckpt: Tensor, buf_ld: Tensor, buf_w: Tensor, buf_k: Tensor,
           cursor: Tensor, epoch: Tensor, arrive: Tensor, slot_ids: Tensor, o: Tensor,
           use_qk_l2norm: bool, BV: int, num_warps: int, num_stages: int) -> None:
        launch_conventional(family, q, k, v, a, b, A_log, dt_bias, scale, ckpt, slot_ids, o,
                            use_qk_l2norm, BV, num_warps, num_stages,
                            pending=(buf_ld, buf_w, buf_k, cursor, epoch, arrive))

    @op.register_fake
    def _(q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive,
          slot_ids, o, use_qk_l2norm, BV, num_warps, num_stages) -> None:
        return None

    return op


_EAGER_OPS = {family: _register_eager_op(family) for family in ("gdn", "kda")}


def run_eager(family, q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k, cursor,
              epoch, arrive, slot_ids, out, use_qk_l2norm, config) -> Tensor:
    """The eager step (`replay_decode` with window 1), inputs already validated: the
    conventional kernel on the checkpoint, with the launch config of `eager_config` at this
    batch (else the conventional table's; the `BV`, `num_warps`, `num_stages` of `config`
    override it), after folding each row's pending records; every row flushes."""
    V, K = v.shape[-1], q.shape[-1]
    HV, Hk = v.shape[1], q.shape[1]
    over = eager_launch_overrides(eager_config(family, HV, V, K, q.shape[0], Hk=Hk), config)
    cfg = _resolve_config(_CONVENTIONAL_TABLE, family, V, K, over, batch=q.shape[0], HV=HV, Hk=Hk)
    _EAGER_OPS[family](q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k, cursor,
                       epoch, arrive, slot_ids, out, bool(use_qk_l2norm), cfg["BV"],
                       cfg["num_warps"], cfg["num_stages"])
    return out


def prepare_conventional(family, q, k, v, a, b, A_log, dt_bias, scale, state, slot_ids, out,
                         config, validate):
    """Validation, defaults and output allocation shared by the GDN and KDA wrappers."""
    if validate:
        Bt, Hk, K, HV, V = check_token_inputs(family, q, k, v, a, b, A_log, dt_bias, out)
        if not isinstance(state, Tensor) or state.dim() != 4:
            raise ValueError(f"state must be an [N, HV, V, K] tensor, got shape "
                             f"{getattr(state, 'shape', None)}")
        N = state.shape[0]
        check_tensor("state", state, (N, HV, V, K), (torch.float32,), contiguous=True)
        check_slot_ids(slot_ids, Bt)
        check_devices(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state=state,
                      slot_ids=slot_ids, out=out)
        check_slot_values(slot_ids, N)
    else:
        K, V = q.shape[-1], v.shape[-1]
    cfg = _resolve_config(_CONVENTIONAL_TABLE, family, V, K, config, batch=q.shape[0],
                          HV=v.shape[1], Hk=q.shape[1])
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    return _scale(scale, K), out, cfg


def conventional_decode(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                        dt_bias: Tensor, scale: Optional[float], state: Tensor, slot_ids: Tensor,
                        out: Optional[Tensor] = None, use_qk_l2norm: bool = True,
                        config: Optional[dict] = None, *, validate: bool = True) -> Tensor:
    """One conventional GDN decode step: `state[slot]` (`[N, HV, V, K]` fp32) read, updated and
    written in place; returns `o` `[Bt, HV, V]` (dtype of `v`, or `out`).

    Inputs as :func:`replayssm.ops.gdn.replay_decode`: `q, k` `[Bt, Hk, K]`, `v` `[Bt, HV, V]`,
    `a, b` `[Bt, HV]` raw, `A_log, dt_bias` `[HV]`; negative `slot_ids` are padding rows.
    `validate`: as in `replay_decode` (the slot ids' values checked, a host sync on the device
    except during graph capture or tracing); False skips every check.
    """
    return run_conventional("gdn", q, k, v, a, b, A_log, dt_bias, scale, state, slot_ids, out,
                            use_qk_l2norm, config, validate)


def run_conventional(family, q, k, v, a, b, A_log, dt_bias, scale, state, slot_ids, out,
                     use_qk_l2norm, config, validate) -> Tensor:
    """Validate, resolve the config and launch the family's conventional op (GDN and KDA)."""
    scale, out, cfg = prepare_conventional(family, q, k, v, a, b, A_log, dt_bias, scale, state,
                                           slot_ids, out, config, validate)
    _CONVENTIONAL_OPS[family](
        q, k, v, a, b, A_log, dt_bias, scale, state, slot_ids, out, bool(use_qk_l2norm),
        cfg["BV"], cfg["num_warps"], cfg["num_stages"])
    return out
