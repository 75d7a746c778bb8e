"""Speculative-verification benchmark: ReplaySSM verify + commit against the snapshot scheme
serving engines use, both normalised to one conventional standard decode step, same run.

A verify step is `T` tokens per row verified and the accepted count committed, the accepted
counts a device tensor (as a sampler makes them). `R` steps are captured in one CUDA graph and
replayed; the time per step is the median replay over `R`. Rows start at staggered cursors
(slot `s` at `s mod L`) and every row accepts `accepted` tokens each step, so over the `R`
steps the early flushes fall as they would at that acceptance length (all accepted at `T = 8`,
`L = 16`: every other step).

- `replay`: `ops.<family>.replay_verify` + `ops.utils.commit.commit` on the pool's layout
  (checkpoint plus `L + T` records per sequence).
- `snapshot`: `ops.<family>.snapshot_verify` + `snapshot_commit`: the conventional recurrence
  token by token, one full state written per verified token into `T + 1` state slots per
  sequence, the next step starting from the accepted token's state.
- `conventional`: one `conventional_decode` step (the unit of `ratio_vs_conventional_step`).
- `fork` (`--fork-src DIR`, Mamba-2 and GDN): the public ReplaySSM fork's verify kernels and
  cursor commit as vLLM drives them (`peers.fork`), on the same layer, token inputs (the gate
  too), slots, checkpoint and staggered cursors, its records in its own layout; the replay
  rows then carry `ratio_vs_fork`. Its accuracy against the float64 reference is
  `benchmarks/tools/fork_verify.py`'s check.

`--windows` takes window lengths and `star`: the traffic model's `L*` for the shape and `T`
(`traffic.l_star` at mean acceptance `(T + 1) / 2`, KDA's records with their decay vectors;
rounded, within `[max(T, 2), 32]`: the pool needs `L >= T`, the Gluon kernels take windows up
to 32); each row carries its `window`.

A variant with `lp` (`--variants '[{"lp": "fp16"}]'`) times the replay scheme of a pool with that
low-precision copy beside the fp32 checkpoint: `ops.<family>.lowp_verify` + `commit`, non-flush
rows' drafts reading the copy, flushing rows folding the fp32 checkpoint and rewriting both.

A variant with `switches` (`--variants '[{"switches": {"mamba2_verify_keys_global": true}}]'`)
runs its verify step with those experimental switches set (`bench.switches`: the environment
variables' module attributes, set around the step alone), so a switch is timed interleaved with
the default in one process; its other keys are its launch config, as any variant's.

`us_per_accepted_token` is the step's time over `accepted`, the tokens each row keeps (mean
acceptance length = `accepted`). Token inputs and outputs have `--input-dtype` (bf16 default);
layer parameters and states fp32, records `--record-dtype`.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from .. import shapes, traffic
from ..testing import make_inputs, make_params
from . import switches
from .common import call_accepting, family_ops, graph_time_us, header, layer_kwargs, write_results

SHAPES = ["nemotron3-super", "nemotron3-nano-4b", "qwen3.5-122b", "qwen3.5-4b", "kimi-linear-48b"]


class Case:
    """One benchmark point's inputs and the state of the three schemes."""

    def __init__(self, shape, batch, window, T, *, record_dtype=torch.bfloat16,
                 input_dtype=torch.bfloat16, seed=0, device="cuda", snapshot=True):
        fam, HV, Hk, V, K = shapes.parse(shape)
        self.shape, self.family, self.batch, self.window, self.T = shape, fam, batch, window, T
        self.HV, self.Hk, self.V, self.K = HV, Hk, V, K
        dev = device
        self.params = make_params(fam, HV, K, dtype=torch.float32, device=dev, seed=seed)
        g = torch.Generator(device=dev).manual_seed(seed)
        N, Lb = batch, window + T
        self.slot_ids = torch.randperm(N, generator=g, device=dev).to(torch.int32)
        self.drafts = make_inputs(self.params, batch, V, K, Hk, steps=T, dtype=input_dtype, device=dev,
                                  generator=g)
        self.token = {k: v[:, 0].contiguous() for k, v in self.drafts.items()}
        init = 0.1 * torch.randn(N, HV, V, K, device=dev)
        self.ckpt = init.clone()
        self.state = init.clone()
        ld_shape = (N, Lb, HV, K) if fam == "kda" else (N, Lb, HV)
        self.buf_ld = -0.05 * torch.rand(ld_shape, device=dev)
        self.buf_w = (0.1 * torch.randn(N, Lb, HV, V, device=dev)).to(record_dtype)
        k = torch.randn(N, Lb, Hk, K, device=dev)
        self.buf_k = (k / k.norm(dim=-1, keepdim=True)).to(record_dtype)
        self.cursor = (torch.arange(N, device=dev) % window).to(torch.int32)
        self.pending = torch.zeros(N, dtype=torch.int32, device=dev)
        self.epoch = torch.zeros(N, dtype=torch.int64, device=dev)
        self.arrive = torch.zeros(N, dtype=torch.int32, device=dev)
        self.out = torch.empty(batch, T, HV, V, device=dev, dtype=input_dtype)
        self.out1 = torch.empty(batch, HV, V, device=dev, dtype=input_dtype)
        self.accepted = torch.ones(batch, dtype=torch.int32, device=dev)
        if snapshot:
            self.states = init[:, None].repeat(1, T + 1, 1, 1, 1)
            self.base = torch.zeros(N, dtype=torch.int32, device=dev)
        self.ops = family_ops(fam)
        self.ckpt_lp = {}                    # low-precision copies, made when a variant asks (`_lp_copy`)
        self.buf_v = self.buf_beta = None    # GDN/KDA raw records, likewise (`_raw_records`)

    def _params(self):
        return layer_kwargs(self.family, self.params)

    def replay_step(self, config=None):
        from ..ops.utils.commit import commit

        config, sw = switches.split(config)
        with switches.applied(sw):
            self._verify(config)
        commit(self.cursor, self.pending, self.slot_ids, self.accepted)

    def _verify(self, config):
        state = dict(buf_ld=self.buf_ld, buf_w=self.buf_w, buf_k=self.buf_k, cursor=self.cursor, pending=self.pending,
                     epoch=self.epoch, arrive=self.arrive, slot_ids=self.slot_ids, window=self.window, out=self.out,
                     validate=False)
        if config and "lp" in config:
            # a pool with a low-precision copy beside the fp32 checkpoint (`lowp_verify`; the rest
            # of the variant is its config, none: its defaults)
            rest = {k: v for k, v in config.items() if k != "lp"}
            fn, fam = self.ops.lowp_verify, {}
            if self.family != "mamba2":
                from ..ops.gdn.verify_lp import lowp_verify as fn      # (KDA's wrapper takes *args)
                fam = dict(family=self.family)
            call_accepting(fn, dict(self.drafts, **self._params(), **state, **self._raw_records(), **fam,
                                    ckpt=self.ckpt, ckpt_lp=self._lp_copy(config["lp"]), lp_format=config["lp"],
                                    config=rest or None))
        else:
            call_accepting(self.ops.replay_verify, dict(self.drafts, **self._params(), **state, ckpt=self.ckpt,
                                                        config=config))

    def _lp_copy(self, fmt: str) -> dict:
        # the copy of the checkpoint in `fmt`, round-to-nearest (a pool's after `load`), made once
        from .. import formats

        if fmt not in self.ckpt_lp:
            self.ckpt_lp[fmt] = formats.encode(self.ckpt, fmt, "nearest")
        return self.ckpt_lp[fmt]

    def _raw_records(self) -> dict:
        # GDN/KDA pools with a copy keep each record's raw `v` and `beta` (their flush recomputes
        # `u` from them); Mamba-2 has none
        if self.family == "mamba2":
            return {}
        if self.buf_v is None:
            N, Lb = self.buf_w.shape[:2]
            self.buf_v = (0.1 * torch.randn(N, Lb, self.HV, self.V, device=self.buf_w.device)).to(self.buf_w.dtype)
            self.buf_beta = torch.rand(N, Lb, self.HV, device=self.buf_w.device, dtype=self.buf_ld.dtype)
        return dict(buf_v=self.buf_v, buf_beta=self.buf_beta)

    def snapshot_step(self):
        from ..ops.utils.snapshot import snapshot_commit

        call_accepting(self.ops.snapshot_verify, dict(self.drafts, **self._params(), states=self.states, base=self.base,
                                             slot_ids=self.slot_ids, out=self.out, validate=False))
        snapshot_commit(self.base, self.slot_ids, self.accepted, self.T + 1)

    def conventional_step(self):
        call_accepting(self.ops.conventional_decode, dict(self.token, **self._params(), state=self.state,
                                                 slot_ids=self.slot_ids, out=self.out1, validate=False))

    def memory_per_sequence(self, lp=None) -> dict:
        """Bytes per sequence of each scheme's state (cursor and counters left out); `lp`: replay's
        with that low-precision copy (and GDN/KDA's raw records) besides."""
        extra = list(self._lp_copy(lp).values()) + list(self._raw_records().values()) if lp else []
        rep = sum(t.element_size() * t.numel() for t in [self.ckpt, self.buf_ld, self.buf_w, self.buf_k] + extra)
        state = self.ckpt.element_size() * self.ckpt.numel()
        return {"replay": rep // self.batch, "snapshot": (self.T + 1) * state // self.batch,
                "conventional": state // self.batch}

    def finite(self) -> bool:
        ok = bool(torch.isfinite(self.ckpt).all() and torch.isfinite(self.state).all())
        return ok and (not hasattr(self, "states") or bool(torch.isfinite(self.states).all()))


def _time_steps(step, rounds, reps):
    def run():
        for _ in range(rounds):
            step()
    return graph_time_us(run, reps=reps) / rounds


def measure(shape, batch, window, T, accepted_list, *, rounds=8, reps=10, record_dtype=torch.bfloat16,
            input_dtype=torch.bfloat16, snapshot=True, device="cuda", variants=None, fork=None):
    """Rows of one (shape, batch, T) point: the conventional step, and replay (and snapshot) at
    each accepted count of `accepted_list`; with `variants` (a list of launch-config overrides
    of the verify kernel) one replay row per variant and count as well, its `config` named and
    its `ratio_vs_default` its time over the default replay row's at that count;
    with `fork` (`peers.fork.load_fork`) the public fork's verify step as scheme `fork` (Mamba-2
    and GDN), and the replay rows' `ratio_vs_fork`."""
    case = Case(shape, batch, window, T, record_dtype=record_dtype, input_dtype=input_dtype,
                device=device, snapshot=snapshot)
    fk = None
    if fork is not None and case.family in ("mamba2", "gdn"):
        from .peers.fork import fork_for_case

        fk = fork_for_case(fork, case, gate=True)
    t_conv = _time_steps(case.conventional_step, rounds, reps)
    mem = case.memory_per_sequence()
    base = dict(shape=shape, family=case.family, batch=batch, window=window, T=T,
                record_dtype=str(record_dtype).replace("torch.", ""),
                input_dtype=str(input_dtype).replace("torch.", ""))
    rows = [dict(base, scheme="conventional", accepted=1, us_per_step=t_conv, ratio_vs_conventional_step=1.0,
                 us_per_accepted_token=t_conv, bytes_per_sequence=mem["conventional"])]
    schemes = [("replay", None, case.replay_step)] + ([("snapshot", None, case.snapshot_step)] if snapshot else [])
    schemes += [("fork", None, fk.step)] if fk is not None else []
    schemes += [("replay", cfg, lambda cfg=cfg: case.replay_step(cfg)) for cfg in variants or []]
    for (name, cfg, step), a in itertools.product(schemes, accepted_list):
        case.accepted.fill_(a)
        if fk is not None:
            fk.accepted.fill_(a)
        try:
            t = _time_steps(step, rounds, reps)
        except Exception as e:  # a variant that does not compile or launch is reported, not fatal
            if cfg is None:
                raise
            rows.append(dict(base, scheme=name, config=cfg, accepted=a, error=repr(e)[:300]))
            continue
        row = dict(base, scheme=name, accepted=a, us_per_step=t, ratio_vs_conventional_step=t / t_conv,
                   us_per_accepted_token=t / a, bytes_per_sequence=mem.get(name))
        if cfg is not None:
            row["config"] = cfg
            if "lp" in cfg:
                row["bytes_per_sequence"] = case.memory_per_sequence(cfg["lp"])["replay"]
        rows.append(row)
    # a variant against the default replay step at its accepted count (a copy pool's against the
    # fp32 pool's), the number that decides whether it should become the default
    plain = {r["accepted"]: r["us_per_step"] for r in rows if r["scheme"] == "replay" and "config" not in r}
    for r in rows:
        if "config" in r and "us_per_step" in r:
            r["ratio_vs_default"] = r["us_per_step"] / plain[r["accepted"]]
    if fk is not None:
        forks = {r["accepted"]: r["us_per_step"] for r in rows if r["scheme"] == "fork"}
        for r in rows:
            if r["scheme"] == "replay" and "config" not in r and r["accepted"] in forks:
                r["ratio_vs_fork"] = r["us_per_step"] / forks[r["accepted"]]
    finite = case.finite() and (fk is None or bool(torch.isfinite(fk.ckpt).all()))
    for r in rows:
        r["finite"] = finite
    case = fk = None   # free this point's tensors before the next one is allocated
    torch.cuda.empty_cache()
    return rows


def star_window(shape: str, T: int) -> int:
    """The traffic model's window for `T` drafts at mean acceptance `(T + 1) / 2`, within the
    windows the pool and the Gluon kernels take (`[max(T, 2), 32]`)."""
    sh = shapes.parse(shape)
    r = traffic.record_bytes(sh.V, sh.K, decay_len=sh.K if sh.family == "kda" else 1)
    L = traffic.l_star(sh.V, sh.K, r=r, T=T, A=(T + 1) / 2)
    return int(min(32, max(T, 2, round(L))))


def _windows(spec: str, shape: str, T: int) -> list:
    out = []
    for w in spec.split(","):
        L = star_window(shape, T) if w.strip() == "star" else int(w)
        if L not in out:
            out.append(L)
    return out


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w0 = min((r["window"] for r in rows), key=lambda w: abs(w - 16), default=16)
    rows = [r for r in rows if r["window"] == w0]
    keys = sorted({(r["shape"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.6), squeeze=False)
    for ax, (shape, batch) in zip(axes[0], keys):
        for T in sorted({r["T"] for r in rows}):
            for scheme, style in (("replay", "-o"), ("snapshot", "--x")):
                pts = sorted((r["accepted"], r["ratio_vs_conventional_step"]) for r in rows
                             if (r["shape"], r["batch"], r["T"], r["scheme"]) == (shape, batch, T, scheme))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{scheme} T={T}", ms=3)
        ax.set_title(f"{shape} B={batch}", fontsize=8)
        ax.set_xlabel("tokens accepted per row")
        ax.set_yscale("log")
    axes[0][0].set_ylabel("verify step / conventional step")
    axes[0][-1].legend(fontsize=6)
    fig.suptitle(f"Speculative verification, window {w0} ({torch.cuda.get_device_name()})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="replayssm bench verify", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help="model names or family/HV/Hk/V/K specs, comma-separated (default: %(default)s)")
    ap.add_argument("--batches", default="256,512")
    ap.add_argument("--windows", default="16",
                    help="window lengths, comma-separated; `star`: the traffic model's L* per shape and T")
    ap.add_argument("--drafts", default="2,4,8", help="the T values (tokens per verify step)")
    ap.add_argument("--accepted", default="all", choices=["all", "ends"],
                    help="accepted counts timed: every 1..T, or only 1 and T")
    ap.add_argument("--no-snapshot", action="store_true", help="leave the snapshot scheme out")
    ap.add_argument("--record-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--input-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=8, help="verify steps per captured graph")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--variants", default=None,
                    help="JSON list of verify launch configs to time beside the defaults at every point "
                         '(e.g. \'[{"BV": 64, "num_warps": 4}]\'); their rows carry `config`. A config with '
                         '`lp` (fp16, bf16, fp8_e4m3, nvfp4) times a pool with that low-precision copy beside '
                         'the fp32 checkpoint (`lowp_verify`, its other keys its config); one with `switches` '
                         '(e.g. {"switches": {"gdn_verify_lean": true}}) runs its step with those experimental '
                         'switches set (replayssm.bench.switches), timed beside the default in this process')
    ap.add_argument("--fork-src", default=None, metavar="DIR",
                    help="a checkout of the public ReplaySSM fork (github.com/Johnny-Liou/ReplaySSM; the "
                         "folder holding vllm/, with replayssm.bench.peers.fork.FORK_FILES): its verify "
                         "kernels timed beside ours as scheme `fork` (Mamba-2 and GDN shapes)")
    ap.add_argument("--out", default="verify.json", help="the JSON results file (a plot beside it)")
    args = ap.parse_args(argv)
    variants = None
    if args.variants:
        import json

        try:
            variants = json.loads(args.variants)
            assert isinstance(variants, list) and all(isinstance(v, dict) for v in variants)
        except (ValueError, AssertionError):
            ap.error(f"--variants must be a JSON list of objects, got {args.variants!r}")
        for v in variants:
            try:
                switches.split(v)
            except ValueError as e:
                ap.error(f"--variants: {json.dumps(v)}: {e}")
    for w in args.windows.split(","):
        if w.strip() != "star" and not (w.strip().isdigit() and 1 <= int(w) <= 64):
            ap.error(f"--windows: {w!r} is neither a window length (1..64) nor 'star'")
    try:
        shape_list = [shapes.parse(s) and s for s in args.shapes.split(",")]
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        raise SystemExit(f"{ap.prog}: error: the verify benchmark needs a CUDA device "
                         "(torch.cuda.is_available() is False on this machine)")
    rdt, idt = getattr(torch, args.record_dtype), getattr(torch, args.input_dtype)
    fork = None
    if args.fork_src:
        from .peers.fork import FORK_COMMIT, load_fork

        fork = load_fork(args.fork_src)
    doc = header("verify")
    if fork is not None:
        doc.update(fork="Johnny-Liou/ReplaySSM", fork_commit=FORK_COMMIT)
    doc.update(record_dtype=args.record_dtype, input_dtype=args.input_dtype, windows=args.windows,
               rounds=args.rounds)
    rows = []
    for shape, batch, T in itertools.product(shape_list, map(int, args.batches.split(",")),
                                             map(int, args.drafts.split(","))):
        acc = list(range(1, T + 1)) if args.accepted == "all" else sorted({1, T})
        for L in _windows(args.windows, shape, T):
            if L < T:
                print(f"{shape:18} B={batch:3d} T={T} L={L}: skipped (the pool needs L >= T)", flush=True)
                continue
            r = measure(shape, batch, L, T, acc, rounds=args.rounds, reps=args.reps, record_dtype=rdt,
                        input_dtype=idt, snapshot=not args.no_snapshot, variants=variants, fork=fork)
            rows += r
            doc["rows"] = rows
            write_results(args.out, doc)      # after every point: a run cut short keeps what it measured
            rep = {x["accepted"]: x for x in r if x["scheme"] == "replay" and "config" not in x}
            snap = {x["accepted"]: x for x in r if x["scheme"] == "snapshot"}
            line = (f"{shape:18} B={batch:3d} T={T} L={L:2d} conv {r[0]['us_per_step']:7.1f} us | replay "
                    f"{rep[min(rep)]['ratio_vs_conventional_step']:.2f}-"
                    f"{rep[max(rep)]['ratio_vs_conventional_step']:.2f}x")
            if snap:
                line += (f" | snapshot {snap[min(snap)]['ratio_vs_conventional_step']:.2f}-"
                         f"{snap[max(snap)]['ratio_vs_conventional_step']:.2f}x")
            vs = sorted(x["ratio_vs_fork"] for x in rep.values() if "ratio_vs_fork" in x)
            if vs:
                line += f" | replay / fork {vs[0]:.2f}-{vs[-1]:.2f}x"
            print(line, flush=True)
    path = write_results(args.out, doc)
    try:
        _plot([r for r in rows if "config" not in r], path.with_suffix(".png"))
    except Exception as e:  # plotting is a convenience; the JSON is the result
        print("plot failed:", e)
    for x in rows:
        if "config" in x and "error" not in x:
            print(f"variant {x['shape']:18} B={x['batch']:3d} T={x['T']} accepted={x['accepted']} "
                  f"{x['ratio_vs_conventional_step']:.2f}x ({x['ratio_vs_default']:.3f}x the default's time) "
                  f"{x['config']}")
    rows_default = [x for x in rows if "config" not in x]
    print("\nverify step / conventional step, drafts all rejected .. all accepted")
    print("shape               batch  T   L  conv us   replay        snapshot     per token at A=3 (T=4): replay/snapshot")
    for shape, batch, T, L in sorted({(r["shape"], r["batch"], r["T"], r["window"]) for r in rows_default}):
        sel = [r for r in rows_default if (r["shape"], r["batch"], r["T"], r["window"]) == (shape, batch, T, L)]
        conv = next(r for r in sel if r["scheme"] == "conventional")
        rng = {}
        for scheme in ("replay", "snapshot", "fork"):
            s = sorted((r["accepted"], r["ratio_vs_conventional_step"]) for r in sel if r["scheme"] == scheme)
            rng[scheme] = f"{s[0][1]:.2f}-{s[-1][1]:.2f}x" if s else "-"
        per = ""
        if T == 4:
            a3 = {r["scheme"]: r["us_per_accepted_token"] for r in sel if r["accepted"] == 3}
            if "replay" in a3 and "snapshot" in a3:
                per = f"{a3['snapshot'] / a3['replay']:.2f}x fewer us"
        fork = f"  fork {rng['fork']}" if rng["fork"] != "-" else ""
        print(f"{shape:18} {batch:5d} {T:2d} {L:3d} {conv['us_per_step']:8.1f}   {rng['replay']:12} "
              f"{rng['snapshot']:12} {per}{fork}")
    return doc


if __name__ == "__main__":
    main()
