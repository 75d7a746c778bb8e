"""The harness of the GDN and KDA kernels: `simulate` runs the replay kernel and the
conventional kernel side by side against the float64 reference over many windows (the tests'
harness); `gpu_check` runs it at the models' real shapes on a GPU.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..reference import GDNParams, KDAParams, replay
from ..reference.common import l2norm
from ..ops.utils.launch import arrive_counter
from ..shapes import of_family
from . import make_inputs, make_params

__all__ = ["simulate", "gpu_check", "real_shapes"]

# A grouped-key KDA stand-in (Kimi's layers have one key head per value head): Qwen3.5-122B's
# dims, for the Hk < HV path
KDA_GROUPED_SHAPE = ("gqa-122b-shape", "qwen3.5-122b")


def real_shapes(family: str) -> dict:
    """`{name: {"HV", "Hk", "V", "K"}}`: the family's model shapes of `replayssm.shapes`, one per
    distinct set of dims; for KDA also the grouped-key stand-in (`KDA_GROUPED_SHAPE`)."""
    out, seen = {}, set()
    for name, s in of_family(family).items():
        dims = (s.HV, s.Hk, s.V, s.K)
        if dims not in seen:
            seen.add(dims)
            out[name] = dict(HV=s.HV, Hk=s.Hk, V=s.V, K=s.K)
    if family == "kda":
        s = of_family("gdn")[KDA_GROUPED_SHAPE[1]]
        out[KDA_GROUPED_SHAPE[0]] = dict(HV=s.HV, Hk=s.Hk, V=s.V, K=s.K)
    return out


def _family_fns(family: str):
    if family == "gdn":
        from ..ops import gdn as ops
    elif family == "kda":
        from ..ops import kda as ops
    else:
        raise ValueError(f"family={family!r}: expected 'gdn' or 'kda'")
    return ops.replay_decode, ops.conventional_decode


def _rel(num: float, den: float) -> float:
    return (num / den) ** 0.5 if den > 0 else float("nan")


def simulate(family: str = "gdn", *, HV: int = 4, Hk: int = 2, V: int = 16, K: int = 32,
             window: int = 4, windows: int = 64, live_slots: int = 3, pad_rows: int = 1,
             unused_slots: int = 1, extra_capacity: int = 0,
             record_dtypes: Sequence[torch.dtype] = (torch.float32,),
             start_cursors: Optional[Sequence[int]] = None, device="cpu", seed: int = 0,
             config: Optional[dict] = None, conv_config: Optional[dict] = None,
             poison: bool = True) -> dict:
    """Run `windows * window` decode steps of the replay kernel (one pool per record dtype) and
    of the conventional kernel on the same fp32 inputs, against the float64 reference
    (`Params.step` on float64 copies of the same inputs and parameters).

    Slots start at staggered cursors (`start_cursors`, default spread over `0..window-1` with
    one slot at `window - 1`, so it flushes on its first step), their buffers pre-filled with
    random records that the reference folds in float64. Rows are shuffled every step, with
    `pad_rows` padding rows; `unused_slots` slots are never addressed.

    Returns relative errors `||x - ref|| / ||ref||` accumulated over all steps:
    `conv_out`, `conv_state` (the conventional state at the moments the replay pool flushes),
    and per record dtype `replay_out[<dtype>]`, `replay_out_late[<dtype>]` (the second half of
    the steps only: growth shows as late > all), `replay_ckpt[<dtype>]` (checkpoints right after
    each flush); plus `problems`, a list of bookkeeping/poison violations (empty when all is
    right): cursors and epochs against a host-side model, outputs left unwritten (`out` is
    pre-filled with NaN), padding rows not exactly zero, unused slots changed bit-wise.
    """
    rep_fn, conv_fn = _family_fns(family)
    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    p32 = make_params(family, HV, K, dtype=torch.float32, seed=seed)
    P64 = GDNParams if family == "gdn" else KDAParams
    p64 = P64(A_log=p32.A_log.double(), dt_bias=p32.dt_bias.double())
    A_log, dt_bias = p32.A_log.to(dev), p32.dt_bias.to(dev)
    Lb = window + extra_capacity
    N = live_slots + unused_slots
    live = torch.randperm(N, generator=g)[:live_slots].sort().values
    unused = [s for s in range(N) if s not in set(live.tolist())]
    if start_cursors is None:
        start_cursors = [(window - 1 - (i * max(1, window // max(1, live_slots)))) % window
                         for i in range(live_slots)]
    cur0 = torch.zeros(N, dtype=torch.int32)
    cur0[live] = torch.tensor(list(start_cursors), dtype=torch.int32)

    # initial checkpoints and records; the records are bf16-representable so that every
    # record dtype starts from exactly the same state
    kvec = K if family == "kda" else None
    C0 = (0.1 * torch.randn(N, HV, V, K, generator=g)).float()
    a0 = 0.5 * torch.randn(N, Lb, HV, *(() if kvec is None else (kvec,)), generator=g, dtype=torch.float64)
    if family == "kda":
        ld0 = (-torch.exp(p64.A_log)[:, None] * torch.nn.functional.softplus(a0 + p64.dt_bias)).float()
    else:
        ld0 = (-torch.exp(p64.A_log) * torch.nn.functional.softplus(a0 + p64.dt_bias)).float()
    w0 = (0.3 * torch.randn(N, Lb, HV, V, generator=g)).bfloat16().float()
    k0 = l2norm(torch.randn(N, Lb, Hk, K, generator=g, dtype=torch.float64)).bfloat16().float()
    S_ref = C0.double().clone()
    for s in live.tolist():
        c = int(cur0[s])
        S_ref[s] = replay(C0[s].double(), ld0[s, :c].double(), w0[s, :c].double(), k0[s, :c].double())

    SENT = 1.0e30
    pools = {}
    for dt in record_dtypes:
        pool = {"ckpt": C0.clone(), "buf_ld": ld0.clone(), "buf_w": w0.to(dt),
                "buf_k": k0.to(dt), "cursor": cur0.clone(),
                "epoch": torch.zeros(N, dtype=torch.int64)}
        for s in unused:
            for name in ("ckpt", "buf_ld", "buf_w", "buf_k"):
                pool[name][s] = SENT
            pool["cursor"][s] = 12345
            pool["epoch"][s] = 777
        pools[dt] = {n: t.to(dev) for n, t in pool.items()}
    conv_state = S_ref.float()
    # the float64 reference runs on the device (real shapes on a GPU are too slow on its host)
    S_ref = S_ref.to(dev)
    p64_dev = P64(A_log=p64.A_log.to(dev), dt_bias=p64.dt_bias.to(dev))
    conv_state[unused] = SENT
    conv_state = conv_state.to(dev)
    untouched = {str(dt): {n: t[unused].clone() for n, t in pool.items()} for dt, pool in pools.items()}
    conv_untouched = conv_state[unused].clone()

    exp_cur = cur0.clone().long()
    exp_ep = torch.zeros(N, dtype=torch.int64)
    Bt = live_slots + pad_rows
    acc = {"conv_out": [0.0, 0.0], "conv_state": [0.0, 0.0]}
    for dt in record_dtypes:
        acc[f"out_{dt}"] = [0.0, 0.0]
        acc[f"late_{dt}"] = [0.0, 0.0]
        acc[f"ckpt_{dt}"] = [0.0, 0.0]
    problems = []
    steps = windows * window
    for step in range(steps):
        ids = torch.cat([live, torch.full((pad_rows,), -1, dtype=torch.int64)])
        ids = ids[torch.randperm(Bt, generator=g)]
        rows = (ids >= 0).nonzero()[:, 0]
        slots = ids[rows]
        x32 = make_inputs(p64, Bt, V, K, Hk, dtype=torch.float32, generator=g)
        xd = {n: t.to(dev) for n, t in x32.items()}
        slot_ids = ids.to(torch.int32).to(dev)
        slots_d, rows_d = slots.to(dev), rows.to(dev)
        o_ref, S_new = p64_dev.step(S_ref[slots_d], **{n: t[rows_d].double() for n, t in xd.items()})
        S_ref[slots_d] = S_new
        flushed = slots[(exp_cur[slots] + 1) >= window]
        exp_ep[flushed] += 1
        exp_cur[slots] = torch.where(exp_cur[slots] + 1 >= window, 0, exp_cur[slots] + 1)

        def out_buf():
            return torch.full((Bt, HV, V), float("nan"), device=dev) if poison else None

        oc = conv_fn(xd["q"], xd["k"], xd["v"], xd["a"], xd["b"], A_log, dt_bias, None,
                     conv_state, slot_ids, out=out_buf(), config=conv_config)
        outs = {"conv_out": oc}
        for dt, pool in pools.items():
            outs[f"out_{dt}"] = rep_fn(xd["q"], xd["k"], xd["v"], xd["a"], xd["b"], A_log,
                                       dt_bias, None, pool["ckpt"], pool["buf_ld"], pool["buf_w"],
                                       pool["buf_k"], pool["cursor"], pool["epoch"], slot_ids,
                                       window, out=out_buf(), config=config)
        for name, o in outs.items():
            if poison:
                if bool(torch.isnan(o).any()):
                    problems.append(f"step {step}: {name} left NaN (unwritten) elements")
                if bool((o[(ids < 0).to(dev)] != 0).any()):
                    problems.append(f"step {step}: {name} padding rows not zero")
            d = (o[rows_d].double() - o_ref)
            err, ref = float((d * d).sum()), float((o_ref * o_ref).sum())
            acc[name][0] += err
            acc[name][1] += ref
            if step >= steps // 2 and name.startswith("out_"):
                acc["late_" + name[4:]][0] += err
                acc["late_" + name[4:]][1] += ref
        if len(flushed):
            flushed = flushed.to(dev)
            ref = S_ref[flushed]
            den = float((ref * ref).sum())
            dc = conv_state[flushed].double() - ref
            acc["conv_state"][0] += float((dc * dc).sum())
            acc["conv_state"][1] += den
            for dt, pool in pools.items():
                dr = pool["ckpt"][flushed].double() - ref
                acc[f"ckpt_{dt}"][0] += float((dr * dr).sum())
                acc[f"ckpt_{dt}"][1] += den
        for dt, pool in pools.items():
            cur, ep = pool["cursor"].cpu().long(), pool["epoch"].cpu()
            if not torch.equal(cur[live], exp_cur[live]) or not torch.equal(ep[live], exp_ep[live]):
                problems.append(f"step {step} ({dt}): cursor {cur[live].tolist()} epoch "
                                f"{ep[live].tolist()}, expected {exp_cur[live].tolist()} "
                                f"{exp_ep[live].tolist()}")
    for dt, pool in pools.items():
        for n, t in pool.items():
            if not torch.equal(t[unused].view(torch.uint8) if t.dtype.is_floating_point else t[unused],
                               untouched[str(dt)][n].view(torch.uint8) if t.dtype.is_floating_point
                               else untouched[str(dt)][n]):
                problems.append(f"unused slot's {n} ({dt}) changed")
        arrive = arrive_counter(dev, N)
        if bool((arrive != 0).any()):
            problems.append(f"arrive counters not re-armed: {arrive.tolist()}")
    if not torch.equal(conv_state[unused].view(torch.uint8), conv_untouched.view(torch.uint8)):
        problems.append("conventional: unused slot's state changed")

    res = {"conv_out": _rel(*acc["conv_out"]), "conv_state": _rel(*acc["conv_state"]),
           "replay_out": {}, "replay_out_late": {}, "replay_ckpt": {}, "steps": steps,
           "problems": problems}
    for dt in record_dtypes:
        res["replay_out"][str(dt).replace("torch.", "")] = _rel(*acc[f"out_{dt}"])
        res["replay_out_late"][str(dt).replace("torch.", "")] = _rel(*acc[f"late_{dt}"])
        res["replay_ckpt"][str(dt).replace("torch.", "")] = _rel(*acc[f"ckpt_{dt}"])
    return res


def gpu_check(device="cuda", *, family: str = "gdn", windows: int = 16, window: int = 16,
              live_slots: int = 8, shapes: Optional[dict] = None, config: Optional[dict] = None,
              conv_config: Optional[dict] = None) -> dict:
    """Errors of the replay kernel (fp32 and bf16 records) and of the conventional kernel
    against the float64 reference at real shapes (default `real_shapes(family)`),
    `windows * window` steps each, rows at staggered window positions. Returns
    `{shape: simulate(...) result}`."""
    out = {}
    for name, shp in (shapes or real_shapes(family)).items():
        out[name] = simulate(family, **shp, window=window, windows=windows, live_slots=live_slots,
                             pad_rows=2, unused_slots=1, extra_capacity=2,
                             record_dtypes=(torch.float32, torch.bfloat16), device=device,
                             config=config, conv_config=conv_config)
    return out
