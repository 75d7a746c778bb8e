"""The pool's one seam to the kernels: implementations registered per (family, operation).

An operation the GPU kernels cover has a "triton" entry; the pool runs it there and everything
else on the reference (`replayssm.reference.algorithms`, on any device). Kernel modules are
imported when first called, so a pool on the reference never needs Triton.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

_REGISTRY: Dict[Tuple[str, str, str], Callable] = {}


def register(family: str, op: str, backend: str = "triton"):
    """Decorator: `fn` implements `op` of `family` on `backend`."""
    def deco(fn):
        _REGISTRY[(family, op, backend)] = fn
        return fn
    return deco


def get(family: str, op: str, backend: str = "triton"):
    """The implementation, or None when the backend does not cover the operation."""
    return _REGISTRY.get((family, op, backend))


# ---------------------------------------------------------------------------------------------
# triton: standard decode (one fp32 checkpoint: "decode"; with a low-precision copy: "decode_lp")

def _mamba2():
    from ..ops import mamba2
    return mamba2


def _gdn():
    from ..ops import gdn
    return gdn


def _kda():
    from ..ops import kda
    return kda


def _state(layout, slot_ids, window, out):
    return dict(ckpt=layout.ckpt["data"], buf_ld=layout.buf["ld"], buf_w=layout.buf["w"],
                buf_k=layout.buf["k"], cursor=layout.cursor, epoch=layout.epoch,
                arrive=layout.arrive, slot_ids=slot_ids, window=window, out=out, validate=False)


@register("mamba2", "decode")
def _mamba2_decode(params, layout, slot_ids, inputs, window, out):
    inputs = dict(inputs)
    z = inputs.pop("z", None)
    return _mamba2().replay_decode(A=params.A, dt_bias=params.dt_bias, D=params.D, z=z, **inputs,
                                   **_state(layout, slot_ids, window, out))


def _delta_decode(kernels):
    def run(params, layout, slot_ids, inputs, window, out):
        return kernels().replay_decode(A_log=params.A_log, dt_bias=params.dt_bias, scale=params.scale,
                                       use_qk_l2norm=params.use_qk_l2norm, **inputs,
                                       **_state(layout, slot_ids, window, out))
    return run


def _eager_max_batch(kernels):
    # the kernels' tables, which both backends follow so that they keep the same cursors
    def run(HV, V, K, Hk):
        return kernels().eager_max_batch(HV, V, K, Hk)
    return run


register("gdn", "decode")(_delta_decode(_gdn))
register("kda", "decode")(_delta_decode(_kda))
for _family, _kernels in (("mamba2", _mamba2), ("gdn", _gdn), ("kda", _kda)):
    register(_family, "eager_max_batch", "any")(_eager_max_batch(_kernels))


# ---------------------------------------------------------------------------------------------
# triton: standard decode of pools with an fp32 checkpoint and a low-precision copy read by
# non-flush steps, of pools whose fp16/bf16/fp8 HP checkpoint beside such a copy is written with
# stochastic rounding, and of the shared design: one checkpoint in fp16, bf16, fp8_e4m3 or
# nvfp4, read by every step, rewritten at the flush with the pool's rounding (lp_format None)
# (SPEC section 5; ops/<family>/precision.py)

_HP_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
              torch.float8_e4m3fn: "fp8_e4m3"}


def _lowp_state(layout, slot_ids, window, out, hp_rounding="stochastic"):
    # the HP format from its parts (NVFP4: packed bytes and a tensor scale); the seed of its
    # stochastic rounding from the layout
    parts = layout.ckpt
    hp_format = "nvfp4" if "tensor_scale" in parts else _HP_DTYPES[parts["data"].dtype]
    ckpt = parts["data"] if hp_format == "fp32" else parts
    return dict(ckpt=ckpt, ckpt_lp=layout.ckpt_lp, buf_ld=layout.buf["ld"],
                buf_w=layout.buf["w"], buf_k=layout.buf["k"], cursor=layout.cursor, epoch=layout.epoch,
                arrive=layout.arrive, slot_ids=slot_ids, window=window, out=out, validate=False,
                hp_format=hp_format, seed=layout.stream_seed, hp_rounding=hp_rounding)


@register("mamba2", "decode_lp")
def _mamba2_decode_lp(params, layout, slot_ids, inputs, window, out, lp_format, hp_rounding="stochastic"):
    from ..ops.mamba2 import precision
    inputs = dict(inputs)
    z = inputs.pop("z", None)
    return precision.lowp_decode(A=params.A, dt_bias=params.dt_bias, D=params.D, z=z, **inputs,
                                 lp_format=lp_format, **_lowp_state(layout, slot_ids, window, out, hp_rounding))


def _delta_decode_lp(family):
    def run(params, layout, slot_ids, inputs, window, out, lp_format, hp_rounding="stochastic"):
        from ..ops.gdn import precision
        # (the shared design keeps no raw records)
        return precision.lowp_decode(A_log=params.A_log, dt_bias=params.dt_bias, scale=params.scale,
                                     use_qk_l2norm=params.use_qk_l2norm, **inputs, lp_format=lp_format,
                                     buf_v=layout.buf.get("v"), buf_beta=layout.buf.get("beta"), family=family,
                                     **_lowp_state(layout, slot_ids, window, out, hp_rounding))
    return run


register("gdn", "decode_lp")(_delta_decode_lp("gdn"))
register("kda", "decode_lp")(_delta_decode_lp("kda"))


# ---------------------------------------------------------------------------------------------
# triton: speculative verification and its commit (docs/state-layout.md, `verify`, `commit`)

def _verify_state(layout, slot_ids, window, num_drafts, out):
    return dict(ckpt=layout.ckpt["data"], buf_ld=layout.buf["ld"], buf_w=layout.buf["w"],
                buf_k=layout.buf["k"], cursor=layout.cursor, pending=layout.pending,
                epoch=layout.epoch, arrive=layout.arrive, slot_ids=slot_ids, window=window,
                num_drafts=num_drafts, out=out, validate=False)


def _mamba2_verify(params, layout, slot_ids, inputs, window, num_drafts, out):
    inputs = dict(inputs)
    z = inputs.pop("z", None)
    return _mamba2().replay_verify(A=params.A, dt_bias=params.dt_bias, D=params.D, z=z, **inputs,
                                   **_verify_state(layout, slot_ids, window, num_drafts, out))


def _delta_verify(kernels):
    def run(params, layout, slot_ids, inputs, window, num_drafts, out):
        return kernels().replay_verify(A_log=params.A_log, dt_bias=params.dt_bias, scale=params.scale,
                                       use_qk_l2norm=params.use_qk_l2norm, **inputs,
                                       **_verify_state(layout, slot_ids, window, num_drafts, out))
    return run


def _commit(layout, slot_ids, accepted):
    from ..ops.utils.commit import commit
    commit(layout.cursor, layout.pending, slot_ids, accepted)


def _clear_pending(layout, slot_ids):
    from ..ops.utils.commit import clear_pending
    clear_pending(layout.pending, slot_ids)


for _family, _run in (("mamba2", _mamba2_verify), ("gdn", _delta_verify(_gdn)), ("kda", _delta_verify(_kda))):
    register(_family, "verify")(_run)
    register(_family, "commit")(_commit)
    register(_family, "clear_pending")(_clear_pending)


# ---------------------------------------------------------------------------------------------
# Low-precision copies read slower than the fp32 checkpoint: the point of a copy is a faster
# read, so a pool that would read one slower says so when it is built (SlotPool warns).
# Measured non-flush steps at batch 256, window 16 (`replayssm bench precision`), the copy's
# read over fp32 reads in the same run: (family, lp_format) -> (card, results file, [(shape,
# ratio)]). An entry goes once a run measures the pair at or above 1. None now: the last,
# KDA's NVFP4 copy (0.22x on the Triton precision kernel), reads at 1.26x on the Gluon kernel
# (H100, benchmarks/results/precision_kda_h100.json).

SLOW_LP_READS: dict = {}


def slow_lp_read(family: str, lp_format) -> Optional[str]:
    """Why reading an `lp_format` copy is slower than reading the fp32 checkpoint for `family`
    (the measured ratios, their card and file), or None where no run measured it slower."""
    entry = SLOW_LP_READS.get((family, lp_format))
    if entry is None:
        return None
    card, path, points = entry
    ratios = ", ".join(f"{shape} {ratio:.2f}x" for shape, ratio in points)
    return (f"a {family} pool reads its {lp_format} copy slower than the fp32 checkpoint: {ratios} the "
            f"speed of fp32 reads on an {card} (batch 256, window 16, non-flush steps; {path}); "
            "an fp16, bf16 or fp8_e4m3 copy reads faster than fp32")


# ---------------------------------------------------------------------------------------------
# triton: speculative verification of pools with a low-precision copy or a narrow high-precision
# checkpoint (SPEC section 5, Algorithm 3; ops/<family>/verify_lp.py)

_VERIFY_LP_HP = ("fp32", "fp16", "bf16", "fp8_e4m3")
_VERIFY_LP_COPY = ("fp16", "bf16", "fp8_e4m3", "nvfp4")


def verify_lp_covers(hp_format, hp_rounding, lp_format, family: str = "mamba2") -> bool:
    """Whether the `verify_lp` kernels take a pool's checkpoints: an fp32 HP beside any copy,
    or an fp16/bf16/fp8_e4m3 HP (stochastic or nearest) beside an fp16/bf16/fp8_e4m3 copy or
    alone (NVFP4's scale per head needs the fp32 matrix), or an NVFP4 checkpoint alone (its
    early flush forms the head's scale from the whole fold: ops/<family>/verify_lp.py). One
    fp32 checkpoint is `verify`'s. `family`: every family is covered alike."""
    hp = hp_format or "fp32"
    if hp == "nvfp4" and lp_format is None:
        return family in ("mamba2", "gdn", "kda") and hp_rounding in ("stochastic", "nearest")
    if hp not in _VERIFY_LP_HP or lp_format not in (None,) + _VERIFY_LP_COPY:
        return False
    if hp == "fp32":
        return lp_format is not None
    return lp_format != "nvfp4" and hp_rounding in ("stochastic", "nearest")


def _verify_lp_state(layout, slot_ids, window, num_drafts, out, lp_format, hp_rounding):
    # decode's state arguments (the HP format from its parts) and verification's own
    return dict(_lowp_state(layout, slot_ids, window, out, hp_rounding), lp_format=lp_format,
                pending=layout.pending, num_drafts=num_drafts)


@register("mamba2", "verify_lp")
def _mamba2_verify_lp(params, layout, slot_ids, inputs, window, num_drafts, out, lp_format, hp_rounding):
    from ..ops.mamba2 import verify_lp
    inputs = dict(inputs)
    z = inputs.pop("z", None)
    return verify_lp.lowp_verify(A=params.A, dt_bias=params.dt_bias, D=params.D, z=z, **inputs,
                                 **_verify_lp_state(layout, slot_ids, window, num_drafts, out, lp_format,
                                                    hp_rounding))


def _delta_verify_lp(family):
    def run(params, layout, slot_ids, inputs, window, num_drafts, out, lp_format, hp_rounding):
        from ..ops.gdn import verify_lp
        return verify_lp.lowp_verify(A_log=params.A_log, dt_bias=params.dt_bias, scale=params.scale,
                                     use_qk_l2norm=params.use_qk_l2norm, **inputs, buf_v=layout.buf.get("v"),
                                     buf_beta=layout.buf.get("beta"), family=family,
                                     **_verify_lp_state(layout, slot_ids, window, num_drafts, out, lp_format,
                                                        hp_rounding))
    return run


register("gdn", "verify_lp")(_delta_verify_lp("gdn"))
register("kda", "verify_lp")(_delta_verify_lp("kda"))
