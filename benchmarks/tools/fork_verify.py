"""The public reference implementation's speculative verify kernels beside ours, in one run: the
fork of vLLM at github.com/Johnny-Liou/ReplaySSM (`selective_state_update_replayssm_spec` for
Mamba-2, `gdn_replayssm_spec_decode` for GDN, each followed by its cursor commit) against
`replayssm bench verify`'s replay step (`replay_verify` + `commit`), with the same token inputs,
window, draft length, accepted counts and staggered rows, both replayed from CUDA graphs and
interleaved; then both on the same random layer, checkpoint and history at a small batch, their
outputs and committed states against the float64 reference.

The fork is not a dependency and none of its code is in this tree: its kernel modules are loaded
from a checked-out copy (`--fork-src DIR`, the folder holding `vllm/`), with vLLM's package
imports stood in (`replayssm.bench.peers`). It needs these files of the fork (commit
a84849410ab56cc2b23432969eb2ecfc42a13d9c, `replayssm.bench.peers.fork.FORK_FILES`):

    vllm/model_executor/layers/mamba/ops/triton_helpers.py
    vllm/model_executor/layers/mamba/ops/mamba_ssm.py
    vllm/model_executor/layers/mamba/ops/replayssm_config.py
    vllm/model_executor/layers/mamba/ops/selective_state_update_replayssm_spec.py
    vllm/model_executor/layers/fla/ops/gdn_replayssm_spec_decode.py

A verify step of the fork is what vLLM runs per layer and step with `--use-replayssm-spec`
(`MambaMixer2.conv_ssm_forward`, `GatedDeltaNetAttention` in qwen_gdn_linear_attn.py): its
verify launches (Mamba-2: scatter + key products, non-flush rows, flush rows; GDN: non-flush
rows, flush rows) and the commit of the accepted counts that vLLM's metadata builders run once
per step before them (mamba_attn.py, gdn_attn.py). Ours: `Case.replay_step` of
`replayssm.bench.verify`. `accepted` is the tokens each row keeps of the `T` verified, 1 (all
drafts rejected) .. T (all accepted): vLLM's `num_accepted_tokens`, the bonus token included.
Without `--gate` neither gets the gate `z` (vLLM's mixer passes `z=None` and gates in the norm
that follows); with it both do.

Timing needs a GPU; `--check-only` runs the accuracy check alone, also on the CPU under
TRITON_INTERPRET=1 at small shapes, where fp32 inputs are the default (the interpreter's bf16
`tl.dot` is wrong, and the fork's kernels form their products in the inputs' dtype):

    PYTHONPATH=. python benchmarks/tools/fork_verify.py --fork-src FORK --out fork_verify.json
    PYTHONPATH=. python benchmarks/tools/fork_verify.py --fork-src FORK --check-only \\
        --shapes mamba2/4/1/16/16,gdn/4/2/16/32 --check-batch 4 --drafts 2,4

The accuracy check (`accuracy`) reports, per scheme, the error of the T outputs, of the
checkpoint that the flushing rows' verify wrote, and of the committed state after the commit
(checkpoint plus committed records folded in float64: with 16-bit records it carries their
rounding, the same for both); the fp32 conventional kernel's errors beside them are the
yardstick. Timed rows carry the errors of their (shape, T, scheme).
"""
from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from replayssm import shapes  # noqa: E402
from replayssm.bench.common import call_accepting, family_ops, header, layer_kwargs, write_results  # noqa: E402
from replayssm.bench.peers.fork import FORK_COMMIT, SHAPES, fork_for_case, load_fork, make_fork  # noqa: E402
from replayssm.bench.verify import Case, _time_steps  # noqa: E402
from replayssm.reference import expand_heads, replay  # noqa: E402
from replayssm.testing import RelErr, make_inputs, make_params  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Accuracy: both on one layer, checkpoint and history, against the float64 recurrence


def history_lengths(batch: int, window: int, T: int) -> list:
    """Committed records per row for the accuracy check: even rows flush at this verify
    (`h` in `window - T + 1 .. window`), odd rows do not (`h` in `0 .. window - T`, the longest
    first), so that both launches of the fork and both paths of ours are measured."""
    return [window - (b // 2) % T if b % 2 == 0 else window - T - (b // 2) % (window - T + 1)
            for b in range(batch)]


def _history(family, refp, C0, tokens, h):
    """One slot's committed records from its raw token inputs (float64 of the token dtype's
    values) and the float64 state they imply. Mamba-2: (x, raw dt, B) as the fork keeps them,
    `ld` for ours; GDN: the `u` of the float64 recurrence from `C0`, given to both."""
    HV = C0.shape[0]
    if family == "mamba2":
        x, dt, B = tokens["x"][:h], tokens["dt"][:h], tokens["B"][:h]
        ld = refp.prepare(x, dt, B, B)["ld"]
        return dict(x=x, dt=dt, B=B, ld=ld, S=replay(C0, ld, refp.record_values(ld, x), B))
    S, us = C0.clone(), []
    pr = refp.prepare(*(tokens[n][:h] for n in ("q", "k", "v", "a", "b")))
    for j in range(h):
        S = torch.exp(pr["ld"][j])[:, None, None] * S
        ke = expand_heads(pr["k"][j], HV)
        u = pr["beta"][j][:, None] * (pr["v"][j] - torch.einsum("hvk,hk->hv", S, ke))
        us.append(u)
        S = S + u[:, :, None] * ke[:, None, :]
    return dict(ld=pr["ld"], u=torch.stack(us) if us else pr["v"][:0], k=pr["k"])


def accuracy(fork, name, batch, window, T, dtype, gate, seed, device) -> tuple:
    """Relative errors `{scheme: {"out", "state", "ckpt"}}` of one verify and commit at `batch`
    rows (staggered histories, see `history_lengths`; accepted count `1 + b % T` for row b):
    `out` the T outputs of every row (fp32 outputs, so that the kernels' arithmetic is seen);
    `state` each slot's committed state (checkpoint plus committed records, folded in float64)
    after the commit; `ckpt` the checkpoint that the flushing rows' verify wrote, against the
    float64 fold of their history. `conventional`: our fp32 conventional kernel token by token
    from the float64 state rounded to fp32, the yardstick of DESIGN.md. Also returns the number
    of flushing rows."""
    sh = shapes.parse(name)
    fam, HV, Hk, V, K = sh
    g = torch.Generator().manual_seed(seed)
    p = make_params(fam, HV, K, dtype=torch.float32, device=device, seed=seed)
    # the reference takes the kernels' fp32 parameters exactly, in float64 on the CPU
    refp = make_params(fam, HV, K, dtype=torch.float32, seed=seed)
    for n in ("A", "dt_bias", "D", "A_log"):
        if getattr(refp, n, None) is not None:
            setattr(refp, n, getattr(refp, n).double())
    N = batch
    slots = torch.randperm(N, generator=g)
    hs = history_lengths(batch, window, T)
    acc = [1 + b % T for b in range(batch)]
    C0 = 0.1 * torch.randn(N, HV, V, K, generator=g, dtype=torch.float64)
    hist_in = make_inputs(refp, N, V, K, Hk, steps=window, gate=False, generator=g)
    hist_in = {k: v.to(dtype).double() for k, v in hist_in.items()}    # token inputs: dtype's values
    drafts = make_inputs(refp, batch, V, K, Hk, steps=T, gate=gate, generator=g)
    drafts = {k: v.to(dtype).double() for k, v in drafts.items()}
    dev_drafts = {k: v.to(device=device, dtype=dtype) for k, v in drafts.items()}
    if fam == "mamba2" and not gate:
        dev_drafts["z"] = None

    fk = make_fork(fork, sh, p, N, batch, window, T, slots.to(device), dtype, torch.float32, gate, device)
    Lb = window + T
    f32 = dict(dtype=torch.float32, device=device)
    pool = dict(ckpt=C0.float().to(device), buf_ld=torch.zeros(N, Lb, HV, **f32),
                buf_w=torch.zeros(N, Lb, HV, V, dtype=dtype, device=device),
                buf_k=torch.zeros(N, Lb, Hk, K, dtype=dtype, device=device),
                cursor=torch.zeros(N, dtype=torch.int32, device=device),
                pending=torch.zeros(N, dtype=torch.int32, device=device),
                epoch=torch.zeros(N, dtype=torch.int64, device=device),
                arrive=torch.zeros(N, dtype=torch.int32, device=device))
    fk.ckpt.copy_(pool["ckpt"])
    wp = torch.zeros(N, dtype=torch.int32)
    S_h = torch.empty_like(C0)
    recs = {}
    for b in range(batch):
        s, h = int(slots[b]), hs[b]
        wp[s] = h
        rec = recs[s] = _history(fam, refp, C0[s], {k: v[s] for k, v in hist_in.items()}, h)
        if fam == "mamba2":
            S_h[s] = rec["S"]
            pool["buf_w"][s, :h] = rec["x"].to(device=device, dtype=dtype)
            pool["buf_k"][s, :h] = rec["B"].to(device=device, dtype=dtype)
        else:
            # the records as stored (u, k rounded to the record dtype, ld to fp32) are the history
            ld, u, k = rec["ld"].float().double(), rec["u"].to(dtype).double(), rec["k"].to(dtype).double()
            S_h[s] = replay(C0[s], ld, u, k)
            pool["buf_w"][s, :h] = u.to(device=device, dtype=dtype)
            pool["buf_k"][s, :h] = k.to(device=device, dtype=dtype)
        pool["buf_ld"][s, :h] = rec["ld"].to(**f32)
    pool["cursor"].copy_(wp)
    # the rings start anywhere, so that records wrap around their ends
    fk.set_cursors(wp.to(device), torch.randint(0, fk.buf, (N,), generator=g, dtype=torch.int32).to(device))
    for b in range(batch):
        s, h, rec = int(slots[b]), hs[b], recs[int(slots[b])]
        if fam == "mamba2":
            fk.set_history(s, rec["x"].to(device), rec["dt"].to(device), rec["B"].to(device))
        else:
            fk.set_history(s, *(pool[n][s, :h] for n in ("buf_ld", "buf_w", "buf_k")))

    # the float64 truth: the conventional recurrence from each row's S_h through its T drafts
    ys, Ss, S = [], [], S_h[slots]
    for t in range(T):
        y, S = refp.step(S, *(v[:, t] for v in drafts.values()))
        ys.append(y)
        Ss.append(S)
    y_ref = torch.stack(ys, 1)
    S_acc = torch.stack([Ss[acc[b] - 1][b] for b in range(batch)])
    flushed = [b for b in range(batch) if hs[b] + T > window]

    err = {k: {"out": RelErr(), "state": RelErr(), "ckpt": RelErr()} for k in ("fork_replay", "replay", "conventional")}
    sid = slots.to(device=device, dtype=torch.int32)
    accepted = torch.tensor(acc, dtype=torch.int32, device=device)
    # the fork
    fk.set_tokens(*(v for v in dev_drafts.values() if v is not None))     # make_inputs' order
    fk.verify()
    err["fork_replay"]["out"].add(fk.out.view(batch, T, HV, V).cpu(), y_ref)
    for b in flushed:
        err["fork_replay"]["ckpt"].add(fk.ckpt[int(slots[b])].cpu(), S_h[int(slots[b])])
    fk.commit(accepted)
    for b in range(batch):
        err["fork_replay"]["state"].add(fk.materialize(int(slots[b]), refp).cpu(), S_acc[b])
    # ours
    ops = family_ops(fam)
    out = torch.zeros(batch, T, HV, V, **f32)
    call_accepting(ops.replay_verify, dict(dev_drafts, **layer_kwargs(fam, p), **pool, slot_ids=sid,
                                           window=window, out=out, validate=False))
    err["replay"]["out"].add(out.cpu(), y_ref)
    for b in flushed:
        err["replay"]["ckpt"].add(pool["ckpt"][int(slots[b])].cpu(), S_h[int(slots[b])])
    from replayssm.ops.utils.commit import commit

    commit(pool["cursor"], pool["pending"], sid, accepted)
    for b in range(batch):
        s = int(slots[b])
        h = int(pool["cursor"][s])
        ld = pool["buf_ld"][s, :h].double().cpu()
        w = refp.record_values(ld, pool["buf_w"][s, :h].double().cpu())
        k = pool["buf_k"][s, :h].double().cpu()
        err["replay"]["state"].add(replay(pool["ckpt"][s].double().cpu(), ld, w, k), S_acc[b])
    # the conventional kernel, token by token
    state = S_h.float().to(device)
    o1 = torch.zeros(batch, HV, V, **f32)
    for t in range(T):
        tok = {k: (v[:, t].contiguous() if v is not None else None) for k, v in dev_drafts.items()}
        call_accepting(ops.conventional_decode, dict(tok, **layer_kwargs(fam, p), state=state, slot_ids=sid,
                                                     out=o1, validate=False))
        err["conventional"]["out"].add(o1.cpu(), y_ref[:, t])
        for b in range(batch):
            if acc[b] == t + 1:
                err["conventional"]["state"].add(state[int(slots[b])].cpu(), S_acc[b])
    return {k: {m: e.rel for m, e in v.items()} for k, v in err.items()}, len(flushed)


# ---------------------------------------------------------------------------------------------
# Timing


def measure(fork, name, batch, window, T, accepted_list, *, rounds, reps, repeats, gate, seed=0):
    """Rows of one (shape, T): the conventional step, then the fork's and our verify step at each
    accepted count, timed `repeats` times each, interleaved (median kept)."""
    case = Case(name, batch, window, T, snapshot=False, seed=seed)
    if case.family == "mamba2" and not gate:
        case.drafts["z"] = None
        case.token["z"] = None
    fk = fork_for_case(fork, case, gate, seed)
    t_conv = sorted(_time_steps(case.conventional_step, rounds, reps) for _ in range(repeats))[repeats // 2]
    base = dict(shape=name, family=case.family, batch=batch, window=window, T=T, record_dtype="bfloat16",
                input_dtype="bfloat16", gate=gate)
    rows = [dict(base, scheme="conventional", accepted=1, us_per_step=t_conv, ratio_vs_conventional_step=1.0)]
    for a in accepted_list:
        case.accepted.fill_(a)
        fk.accepted.fill_(a)
        times = {"fork_replay": [], "replay": []}
        for _ in range(repeats):
            times["fork_replay"].append(_time_steps(fk.step, rounds, reps))
            times["replay"].append(_time_steps(case.replay_step, rounds, reps))
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        for k, v in times.items():
            rows.append(dict(base, scheme=k, accepted=a, us_per_step=med[k], us_rounds=v,
                             ratio_vs_conventional_step=med[k] / t_conv, ratio_vs_fork=med[k] / med["fork_replay"]))
    finite = case.finite() and bool(torch.isfinite(fk.ckpt).all())
    # both ran the same number of steps from the same cursors at the same counts: the same
    # cursors now means that they flushed at the same steps
    agree = torch.equal(fk.write_pos, case.cursor)
    if not agree:
        print(f"warning: {name} T={T}: the fork's cursors and ours differ after the same steps", flush=True)
    for r in rows:
        r["finite"], r["cursors_agree"] = finite, agree
    del case, fk
    torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------


def _accepted(spec: str, T: int) -> list:
    if spec == "all":
        return list(range(1, T + 1))
    if spec == "ends":
        return sorted({1, T})
    return sorted({a for a in (int(x) for x in spec.split(",")) if 1 <= a <= T})


def _rng(vals, fmt):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def _table(rows, errors, check):
    """The short tables: times (ranges over the accepted counts), then the errors."""
    if rows:
        print(f"\nverify step at batch {rows[0]['batch']}, window {rows[0]['window']}, accepted 1 (all drafts "
              "rejected) .. T: us, ours / fork, and each over one conventional step")
        print(f"{'shape':18} {'T':>2} {'conv us':>8} {'fork us':>10} {'ours us':>10} {'ours/fork':>11} "
              f"{'fork/conv':>11} {'ours/conv':>11}")
    for shape, T in sorted({(r["shape"], r["T"]) for r in rows}):
        sel = [r for r in rows if (r["shape"], r["T"]) == (shape, T)]
        conv = next(r["us_per_step"] for r in sel if r["scheme"] == "conventional")
        col = {k: {f: [r[f] for r in sel if r["scheme"] == k] for f in ("us_per_step", "ratio_vs_fork",
                                                                           "ratio_vs_conventional_step")}
               for k in ("fork_replay", "replay")}
        f, o = col["fork_replay"], col["replay"]
        print(f"{shape:18} {T:2d} {conv:8.1f} {_rng(f['us_per_step'], '{:.0f}'):>10} "
              f"{_rng(o['us_per_step'], '{:.0f}'):>10} {_rng(o['ratio_vs_fork'], '{:.2f}x'):>11} "
              f"{_rng(f['ratio_vs_conventional_step'], '{:.2f}x'):>11} "
              f"{_rng(o['ratio_vs_conventional_step'], '{:.2f}x'):>11}")
    if errors:
        print(f"\n||x - ref|| / ||ref|| against float64 ({check}): the T outputs; the checkpoint the flushing "
              "rows wrote; the committed state after the commit")
        print(f"{'shape':18} {'T':>2}  {'out: fork':>9} {'ours':>8} {'conv':>8}  {'ckpt: fork':>10} {'ours':>8}  "
              f"{'state: fork':>11} {'ours':>8} {'conv':>8}")
    for (shape, T), e in sorted(errors.items()):
        def cell(s, m, w=8):
            v = e[s][m]
            return f"{v:{w}.1e}" if v is not None else f"{'-':>{w}}"
        print(f"{shape:18} {T:2d}  {cell('fork_replay', 'out', 9)} {cell('replay', 'out')} "
              f"{cell('conventional', 'out')}  {cell('fork_replay', 'ckpt', 10)} {cell('replay', 'ckpt')}  "
              f"{cell('fork_replay', 'state', 11)} {cell('replay', 'state')} {cell('conventional', 'state')}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fork-src", required=True, help="the fork's checkout (the folder holding vllm/)")
    ap.add_argument("--shapes", default=SHAPES, help="model names or family/HV/Hk/V/K (mamba2, gdn)")
    ap.add_argument("--batch", type=int, default=256, help="rows of the timed batch")
    ap.add_argument("--check-batch", type=int, default=16, help="rows of the accuracy check")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--drafts", default="2,4,8", help="the T values (tokens verified per step)")
    ap.add_argument("--accepted", default="all", help="accepted counts timed: all (1..T), ends (1 and T) or a list")
    ap.add_argument("--rounds", type=int, default=8, help="verify steps per captured graph")
    ap.add_argument("--reps", type=int, default=10, help="graph replays per timing (median)")
    ap.add_argument("--repeats", type=int, default=3, help="timings of each scheme, interleaved (median)")
    ap.add_argument("--input-dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="token inputs and records of the accuracy check (default: bfloat16 on a GPU, "
                         "float32 under the interpreter); the timing always uses bfloat16, as the bench")
    ap.add_argument("--gate", action="store_true", help="give both the gate z (vLLM passes none to the fork)")
    ap.add_argument("--check-only", action="store_true", help="only the accuracy check (the CPU's mode)")
    ap.add_argument("--no-check", action="store_true", help="only the timing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="fork_verify.json")
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    if not gpu and not args.check_only:
        ap.error("timing needs a CUDA device; on the CPU pass --check-only")
    try:
        names = [n for n in args.shapes.split(",") if shapes.parse(n)]
    except ValueError as e:
        ap.error(str(e))
    for n in names:
        if shapes.parse(n).family not in ("mamba2", "gdn"):
            ap.error(f"{n}: the fork has spec verify kernels for mamba2 and gdn only")
    drafts = [int(t) for t in args.drafts.split(",")]
    if any(not 1 <= t <= 8 or t > args.window for t in drafts):
        ap.error(f"--drafts {args.drafts}: T must lie in 1..8 and not exceed the window")
    dtype = getattr(torch, args.input_dtype or ("bfloat16" if gpu else "float32"))
    if not gpu and dtype == torch.bfloat16:
        print("note: the interpreter's bf16 tl.dot is wrong and the fork forms its products in bf16: "
              "its bf16 errors here are not the GPU's", flush=True)
    device = "cuda" if gpu else "cpu"
    fork = load_fork(args.fork_src)
    doc = header("fork_verify")
    doc.update(fork="Johnny-Liou/ReplaySSM", fork_commit=FORK_COMMIT, window=args.window, rounds=args.rounds,
               check_batch=args.check_batch, check_input_dtype=str(dtype).replace("torch.", ""), gate=args.gate)
    rows, errors = [], {}
    for name in names:
        for T in drafts:
            if not args.no_check:
                e, nflush = accuracy(fork, name, args.check_batch, args.window, T, dtype, args.gate, args.seed, device)
                errors[(name, T)] = e
                print(f"{name:18} T={T} check at batch {args.check_batch} ({nflush} rows flushing): "
                      + "  ".join(f"{k} out {v['out']:.2e} state {v['state']:.2e}"
                                  + (f" ckpt {v['ckpt']:.2e}" if v["ckpt"] is not None else "")
                                  for k, v in e.items()), flush=True)
            if not args.check_only:
                r = measure(fork, name, args.batch, args.window, T, _accepted(args.accepted, T), rounds=args.rounds,
                            reps=args.reps, repeats=args.repeats, gate=args.gate, seed=args.seed)
                rows += r
                o = [x for x in r if x["scheme"] == "replay"]
                print(f"{name:18} T={T} B={args.batch} conv {r[0]['us_per_step']:.1f} us | ours/fork "
                      f"{_rng([x['ratio_vs_fork'] for x in o], '{:.2f}x')}", flush=True)
            doc["rows"] = _with_errors(rows, errors, args.check_batch)
            write_results(args.out, doc)     # after every point: a run cut short keeps what it measured
    _table(rows, errors, f"batch {args.check_batch}, {doc['check_input_dtype']} inputs and records")
    return doc


def _with_errors(rows, errors, check_batch):
    """Timing rows with the accuracy check's errors of their (shape, T, scheme) attached; without
    timing rows (--check-only), one row per (shape, T, scheme) with the errors alone."""
    fields = lambda e: dict(out_rel_err=e["out"], state_rel_err=e["state"], ckpt_rel_err=e["ckpt"],  # noqa: E731
                            error_batch=check_batch)
    if rows:
        return [dict(r, **fields(errors[(r["shape"], r["T"])][r["scheme"]])) if (r["shape"], r["T"]) in errors
                else r for r in rows]
    return [dict(shape=s, family=shapes.parse(s).family, T=T, scheme=k, **fields(v))
            for (s, T), e in errors.items() for k, v in e.items()]


if __name__ == "__main__":
    main()
