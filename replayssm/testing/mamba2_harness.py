"""The Mamba-2 kernels (`replayssm.ops.mamba2`) against the float64 reference: the harness of the
tests and of the GPU check.

`compare_with_reference` drives both kernels and the float64 reference over the same random
inputs (rows at staggered window positions, a padding row, rows permuted every step) and
returns their errors; `gpu_check` runs it at real model shapes.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..ops.mamba2 import conventional_decode, replay_decode
from ..reference import Mamba2Params
from ..shapes import of_family
from . import make_inputs, make_params

__all__ = ["SMALL", "model_shape", "compare_with_reference", "gpu_check"]

# a shape for the CPU interpreter: two groups of two heads
SMALL = dict(HV=4, Hk=2, V=16, K=32)


def model_shape(name: str) -> dict:
    """A Mamba-2 model's shape as keywords: `HV`, `Hk` (groups), `V`, `K`."""
    s = of_family("mamba2")[name]
    return dict(HV=s.HV, Hk=s.Hk, V=s.V, K=s.K)


def _rel(num: float, den: float) -> float:
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


def compare_with_reference(HV: int, Hk: int, V: int, K: int, *, window: int, n_slots: int,
                           windows: int, device="cpu", record_dtype=torch.float32,
                           input_dtype=torch.float32, inputs_on: Optional[torch.dtype] = None,
                           seed: int = 0, spare: int = 2,
                           config: Optional[dict] = None, conv_config: Optional[dict] = None,
                           state_scale: float = 0.1) -> dict:
    """Run `replay_decode` and `conventional_decode` side by side against the float64 reference.

    `n_slots` live slots (plus `spare` unused ones) of a pool with buffer capacity `window + 2`;
    slot `s` joins the batch at step `s`, so rows sit at different window positions; each step
    the batch is the live slots plus one padding row, in a random order. Runs
    `windows * window + n_slots` steps. Kernel inputs are drawn in float64, cast to
    `input_dtype` (after rounding them to `inputs_on` when given: e.g. bf16 values, the
    activations of a bf16 model, passed as fp32 so that the outputs keep fp32 precision); the
    reference (`Mamba2Params.step`) runs on float64 copies of those values and of the fp32
    layer parameters, so input rounding is not counted as kernel error.

    Returns relative errors `||kernel - ref|| / ||ref||` over all steps: `out_replay`,
    `out_conventional` (outputs of live rows), `ckpt_replay`, `ckpt_conventional` (each slot's
    checkpoint / state right after each of its flushes), plus `flushes` (count), `steps`,
    `cursor_ok` (device cursors and epochs matched the host model after every step) and
    `padding_zero` (padding rows were exactly 0 in both kernels).
    """
    dev = torch.device(device)
    f64 = torch.float64
    p = make_params("mamba2", HV, K, seed=seed)
    A, dt_bias, D = (t.to(torch.float32) for t in (p.A, p.dt_bias, p.D))
    ref = Mamba2Params(A=A.to(dev, f64), dt_bias=dt_bias.to(dev, f64), D=D.to(dev, f64))
    A, dt_bias, D = (t.to(dev) for t in (A, dt_bias, D))

    g = torch.Generator().manual_seed(seed + 1)
    N = n_slots + spare
    Lb = window + 2
    S0 = (state_scale * torch.randn(N, HV, V, K, generator=g, dtype=f64)).to(torch.float32)
    ckpt = S0.to(dev)
    state = S0.clone().to(dev)
    S_ref = S0.to(dev, f64)
    buf_ld = torch.zeros(N, Lb, HV, device=dev)
    buf_w = torch.zeros(N, Lb, HV, V, device=dev, dtype=record_dtype)
    buf_k = torch.zeros(N, Lb, Hk, K, device=dev, dtype=record_dtype)
    cursor = torch.zeros(N, dtype=torch.int32, device=dev)
    epoch = torch.zeros(N, dtype=torch.int64, device=dev)
    arrive = torch.zeros(N, dtype=torch.int32, device=dev)
    h_model = [0] * N
    e_model = [0] * N

    Bt = n_slots + 1
    steps = windows * window + n_slots
    acc = dict(out_replay=[0.0, 0.0], out_conventional=[0.0, 0.0], ckpt_replay=[0.0, 0.0],
               ckpt_conventional=[0.0, 0.0])
    flushes = 0
    cursor_ok = padding_zero = True
    for t in range(steps):
        live = [s for s in range(n_slots) if t >= s]
        rows = live + [-1] * (Bt - len(live))
        perm = torch.randperm(Bt, generator=g).tolist()
        rows = [rows[i] for i in perm]
        slot_ids = torch.tensor(rows, dtype=torch.int32, device=dev)
        inp = make_inputs(p, Bt, V, K, Hk, generator=g)
        inp = {k: (v if inputs_on is None else v.to(inputs_on)).to(input_dtype) for k, v in inp.items()}
        dinp = {k: v.to(dev) for k, v in inp.items()}
        args = (dinp["x"], dinp["dt"], dinp["B"], dinp["C"], A, dt_bias, D, dinp["z"])
        y_rep = replay_decode(*args, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, slot_ids, window,
                              config=config, arrive=arrive)
        y_conv = conventional_decode(*args, state, slot_ids, config=conv_config)

        idx = [i for i, s in enumerate(rows) if s >= 0]
        pad = [i for i, s in enumerate(rows) if s < 0]
        sl = [rows[i] for i in idx]
        y_ref, S_new = ref.step(S_ref[sl], *(dinp[k][idx].to(f64) for k in ("x", "dt", "B", "C", "z")))
        S_ref[sl] = S_new
        yr, yc = y_rep.to(f64), y_conv.to(f64)
        for name, y in (("out_replay", yr), ("out_conventional", yc)):
            acc[name][0] += float(((y[idx] - y_ref) ** 2).sum())
            acc[name][1] += float((y_ref ** 2).sum())
        if pad:
            padding_zero &= bool((yr[pad] == 0).all()) and bool((yc[pad] == 0).all())

        flushed = []
        for s in sl:
            h_model[s] += 1
            if h_model[s] >= window:
                h_model[s] = 0
                e_model[s] += 1
                flushed.append(s)
        cursor_ok &= cursor.tolist() == h_model and epoch.tolist() == e_model
        if flushed:
            flushes += len(flushed)
            ref_S = S_ref[flushed]
            for name, St in (("ckpt_replay", ckpt), ("ckpt_conventional", state)):
                acc[name][0] += float(((St[flushed].to(f64) - ref_S) ** 2).sum())
                acc[name][1] += float((ref_S ** 2).sum())
    res = {k: _rel(*v) for k, v in acc.items()}
    res.update(flushes=flushes, steps=steps, cursor_ok=cursor_ok, padding_zero=padding_zero,
               arrive_zero=bool((arrive == 0).all()))
    return res


def gpu_check(device="cuda", *, shapes=("nemotron3-super", "nemotron3-nano-4b"), n_slots: int = 16,
              window: int = 16, windows: int = 4, seed: int = 0) -> dict:
    """One correctness check of both kernels at real shapes on `device`.

    For each shape: fp32 records, bf16 records, and bf16 records on inputs that are bf16
    values (a bf16 model's activations), `windows` windows of `window` steps on `n_slots`
    staggered slots. Returns `{shape: {"fp32": errors, "bf16": errors, "bf16_on_bf16_inputs":
    errors, "ok": bool}}` with the errors of `compare_with_reference`; `ok` requires the replay
    kernel's output and checkpoint errors with fp32 records, and with bf16 records on bf16
    inputs (exact copies of x and B), within 1.5x the conventional kernel's (+2e-8, a third of
    fp32's unit roundoff, as in the tests), bf16-record errors below 1e-2 on
    fp32 inputs, and the cursor, epoch and padding bookkeeping exact.
    """
    out = {}
    for name in shapes:
        HV, Hk, V, K = model_shape(name).values()
        r = {}
        for tag, rd, on in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
                            ("bf16_on_bf16_inputs", torch.bfloat16, torch.bfloat16)):
            r[tag] = compare_with_reference(HV, Hk, V, K, window=window, n_slots=n_slots,
                                            windows=windows, device=device, record_dtype=rd,
                                            inputs_on=on, seed=seed)
        within = all(r[t][f"{w}_replay"] <= 1.5 * r[t][f"{w}_conventional"] + 2e-8
                     for t in ("fp32", "bf16_on_bf16_inputs") for w in ("out", "ckpt"))
        r["ok"] = bool(
            within and r["bf16"]["out_replay"] < 1e-2 and r["bf16"]["ckpt_replay"] < 1e-2
            and all(r[t]["cursor_ok"] and r[t]["padding_zero"] and r[t]["arrive_zero"]
                    for t in ("fp32", "bf16", "bf16_on_bf16_inputs")))
        out[name] = r
    return out
