"""Standard-decode benchmark: ReplaySSM kernels against the conventional kernels, same run.

Whole windows (`L` steps, the flush included) are captured in one CUDA graph and replayed;
the time per step is the median replay over `L`. Rows are either staggered (slot `s` starts
at cursor `s mod L`: every step some rows flush) or in lock-step (all flush together).
Bytes are the state and record traffic each scheme must move (SPEC section 6, keys once per
key head); TB/s = those bytes over the measured time. The token inputs (x, dt, B, C, z; q, k,
v, a, b), which both schemes read alike, and the outputs are not counted.

Token inputs and outputs have `--input-dtype` (default bf16, as the models hand them over);
layer parameters (A, dt_bias, D; A_log) and the state stay fp32, records `--record-dtype`.

The replay scheme runs what the slot pool runs at each batch: batches up to the shape's
`eager_max_batch` take the eager step (window 1, the conventional kernel on the checkpoint,
the conventional bytes; rows' `path` "eager"), larger ones the window (`path` "windowed").
"""
from __future__ import annotations

import argparse
import itertools

import torch

from .. import shapes, traffic
from ..testing import make_inputs, make_params
from .common import call_accepting, family_ops, copy_bandwidth_tbs, graph_time_us, header, write_results

SHAPES = ["nemotron3-super", "nemotron3-nano-4b", "qwen3.5-4b", "qwen3.5-122b", "kimi-linear-48b"]


class Case:
    """Inputs for `window` steps and the state of both schemes for one benchmark point."""

    def __init__(self, shape, batch, window, cursors="staggered", record_dtype=torch.bfloat16, seed=0, *,
                 input_dtype=torch.bfloat16, device="cuda"):
        """`input_dtype`: token inputs and outputs of both schemes (the same tensors for both);
        layer parameters and state fp32. `device`: "cuda" (the CPU only for tests)."""
        fam, HV, Hk, V, K = shapes.parse(shape)
        self.shape, self.family, self.batch, self.window = shape, fam, batch, window
        self.HV, self.Hk, self.V, self.K = HV, Hk, V, K
        self.record_dtype, self.input_dtype = record_dtype, input_dtype
        dev = device
        self.params = make_params(fam, HV, K, dtype=torch.float32, device=dev, seed=seed)
        g = torch.Generator(device=dev).manual_seed(seed)
        N, Lb = batch, window + 1
        self.slot_ids = torch.randperm(N, generator=g, device=dev)
        self.steps = [make_inputs(self.params, batch, V, K, Hk, dtype=input_dtype, device=dev, generator=g)
                      for _ in range(window)]
        # keep raw gates moderate so that replaying the same window many times stays finite
        init = 0.1 * torch.randn(N, HV, V, K, device=dev)
        self.state = init.clone()
        self.ckpt = init.clone()
        ld_shape = (N, Lb, HV, K) if fam == "kda" else (N, Lb, HV)
        self.buf_ld = -0.05 * torch.rand(ld_shape, device=dev)
        self.buf_w = (0.1 * torch.randn(N, Lb, HV, V, device=dev)).to(record_dtype)
        k = torch.randn(N, Lb, Hk, K, device=dev)
        self.buf_k = (k / k.norm(dim=-1, keepdim=True)).to(record_dtype)
        if cursors == "staggered":
            self.cursor = (torch.arange(N, device=dev) % window).to(torch.int32)
        else:
            self.cursor = torch.zeros(N, dtype=torch.int32, device=dev)
        self.epoch = torch.zeros(N, dtype=torch.int64, device=dev)
        self.arrive = torch.zeros(N, dtype=torch.int32, device=dev)
        self.out = torch.empty(window, batch, HV, V, device=dev, dtype=input_dtype)
        self.ops = family_ops(fam)

    def _common(self, i):
        p = self.params
        if self.family == "mamba2":
            return dict(self.steps[i], A=p.A, dt_bias=p.dt_bias, D=p.D, z=self.steps[i].get("z"))
        return dict(self.steps[i], A_log=p.A_log, dt_bias=p.dt_bias, scale=None, use_qk_l2norm=True)

    def eager(self, config=None) -> bool:
        """Whether the replay steps take the eager path (window 1): the pool's choice at this
        batch (`ops.<family>.eager_max_batch`), or a variant's `eager` key."""
        if config and "eager" in config:
            return bool(config["eager"])
        return self.batch <= self.ops.eager_max_batch(self.HV, self.V, self.K, self.Hk)

    def replay_window(self, config=None):
        for i in range(self.window):
            self.replay_step(i, config)

    def replay_step(self, i, config=None):
        """Step `i` of the window on the replay state (the eager step where `eager` says so)."""
        window = 1 if self.eager(config) else self.window
        config = {k: v for k, v in (config or {}).items() if k != "eager"} or None
        call_accepting(self.ops.replay_decode, dict(self._common(i), ckpt=self.ckpt, buf_ld=self.buf_ld,
                                                    buf_w=self.buf_w, buf_k=self.buf_k, cursor=self.cursor,
                                                    epoch=self.epoch, arrive=self.arrive, slot_ids=self.slot_ids,
                                                    window=window, out=self.out[i], config=config,
                                                    validate=False))

    def conventional_window(self, config=None):
        for i in range(self.window):
            call_accepting(self.ops.conventional_decode, dict(self._common(i), state=self.state, slot_ids=self.slot_ids,
                                                     out=self.out[i], config=config, validate=False))

    def bytes_per_step(self, config=None):
        """(conventional, replay) bytes per step for the whole batch; the eager path moves the
        conventional kernel's bytes."""
        conv = 2 * traffic.state_bytes(self.V, self.K) * self.HV * self.batch
        if self.eager(config):
            return conv, conv
        rb = torch.finfo(self.record_dtype).bits // 8
        per_window = sum(traffic.decode_step_bytes(h, self.window, self.HV, self.V, self.K, self.Hk,
                                                   value_bytes=rb, key_bytes=rb,
                                                   decay_len=self.K if self.family == "kda" else 1)
                         for h in range(self.window))
        return conv, per_window / self.window * self.batch


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def measure(shape, batch, window, cursors, record_dtype, reps, replay_cfg=None, conv_cfg=None, *,
            input_dtype=torch.bfloat16, device="cuda"):
    case = Case(shape, batch, window, cursors, record_dtype, input_dtype=input_dtype, device=device)
    t_conv = graph_time_us(lambda: case.conventional_window(conv_cfg), reps=reps) / window
    t_rep = graph_time_us(lambda: case.replay_window(replay_cfg), reps=reps) / window
    b_conv, b_rep = case.bytes_per_step(replay_cfg)
    finite = bool(torch.isfinite(case.ckpt).all() and torch.isfinite(case.state).all())
    path = "eager" if case.eager(replay_cfg) else "windowed"
    base = dict(shape=shape, family=case.family, batch=batch, window=window, cursors=cursors,
                record_dtype=_name(record_dtype), input_dtype=_name(input_dtype), finite=finite)
    case = None       # free this point's tensors before the next one is allocated
    torch.cuda.empty_cache()
    return [dict(base, scheme="conventional", us_per_step=t_conv, tb_per_s=b_conv / t_conv / 1e6,
                 bytes_per_step=b_conv, ratio_vs_conventional=1.0),
            dict(base, scheme="replay", path=path, us_per_step=t_rep, tb_per_s=b_rep / t_rep / 1e6,
                 bytes_per_step=b_rep, ratio_vs_conventional=t_conv / t_rep)]


def sweep_configs(shape, candidates_conv, candidates_rep, batch=256, window=16, reps=10, *,
                  record_dtype=torch.bfloat16, input_dtype=torch.bfloat16):
    """Time each launch config at one point; returns the best of each kernel and all rows."""
    rows, best = [], {}
    for kind, cands in (("conventional", candidates_conv), ("replay", candidates_rep)):
        for cfg in cands:
            case = Case(shape, batch, window, record_dtype=record_dtype, input_dtype=input_dtype)
            fn = case.conventional_window if kind == "conventional" else case.replay_window
            try:
                t = graph_time_us(lambda: fn(cfg), reps=reps) / window
            except Exception as e:  # a config that does not compile or launch is skipped
                rows.append(dict(shape=shape, scheme=kind, config=cfg, error=repr(e)[:200]))
                continue
            b_conv, b_rep = case.bytes_per_step(cfg if kind == "replay" else None)
            b = b_conv if kind == "conventional" else b_rep
            rows.append(dict(shape=shape, scheme=kind, config=cfg, us_per_step=t, tb_per_s=b / t / 1e6))
            if kind not in best or t < best[kind][1]:
                best[kind] = (cfg, t)
            del case
            torch.cuda.empty_cache()
    return best, rows


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for shape in sorted({r["shape"] for r in rows}):
        pts = sorted((r["batch"], r["ratio_vs_conventional"]) for r in rows
                     if r["shape"] == shape and r["scheme"] == "replay" and r["window"] == 16
                     and r["cursors"] == "staggered")
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=shape)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("speed-up over conventional kernel")
    ax.set_title(f"ReplaySSM decode, window 16, staggered rows ({torch.cuda.get_device_name()})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    # an explicit prog: the default, sys.argv[0], reads "cli.py" when run through `replayssm bench`
    ap = argparse.ArgumentParser(prog="replayssm bench decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help="model names or family/HV/Hk/V/K specs, comma-separated (default: %(default)s)")
    ap.add_argument("--batches", default="1,8,64,256,512", help="batch sizes, comma-separated (default: %(default)s)")
    ap.add_argument("--windows", default="8,16,32", help="window lengths L, comma-separated (default: %(default)s)")
    ap.add_argument("--cursors", default="staggered,lockstep",
                    help="row cursor patterns, comma-separated: staggered, lockstep (default: %(default)s)")
    ap.add_argument("--record-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="dtype of the buffered records (values and keys; default: %(default)s)")
    ap.add_argument("--input-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="dtype of the token inputs and outputs of both kernels (layer parameters "
                         "and state stay fp32; default: %(default)s)")
    ap.add_argument("--reps", type=int, default=15, help="graph replays timed per point, the median kept (default: %(default)s)")
    ap.add_argument("--sweep", action="store_true", help="first pick launch configs per shape at batch 256")
    ap.add_argument("--sweep-replay-only", action="store_true", help="with --sweep: keep the conventional tables")
    ap.add_argument("--variants", default=None,
                    help="JSON list of replay configs to time against one conventional run per point "
                         "(a config's \"eager\" key forces the eager step on or off)")
    ap.add_argument("--out", default="decode.json", help="the JSON results file (a plot beside it)")
    args = ap.parse_args(argv)
    try:
        for spec in args.shapes.split(","):
            shapes.parse(spec)
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        raise SystemExit(f"{ap.prog}: error: the decode benchmark needs a CUDA device "
                         "(torch.cuda.is_available() is False on this machine)")
    rdt, idt = getattr(torch, args.record_dtype), getattr(torch, args.input_dtype)
    doc = header("decode")
    doc["record_dtype"], doc["input_dtype"] = args.record_dtype, args.input_dtype
    doc["copy_tb_per_s"] = copy_bandwidth_tbs()
    print(f"{doc['device']}: device-to-device copy {doc['copy_tb_per_s']:.2f} TB/s; "
          f"records {args.record_dtype}, token inputs {args.input_dtype}", flush=True)
    shape_list = args.shapes.split(",")
    chosen = {}
    if args.sweep:
        doc["sweep"] = []
        for shape in shape_list:
            fam, _, _, V, _ = shapes.parse(shape)
            # replay kernels only: the conventional tables already reach 3.75-3.94 TB/s
            rep = [dict(BV=bv, num_warps=w, maxnreg=r) for bv, w, r in
                   ((16, 4, 0), (32, 4, 0), (32, 8, 0), (64, 4, 0), (64, 8, 0), (16, 2, 128))
                   if bv <= V]
            conv = [] if args.sweep_replay_only else [
                dict(BV=bv, num_warps=w) for bv in ((32, 64, 128, 256) if fam == "mamba2" else (8, 16, 32, 64))
                for w in (4, 8)]
            best, rows = sweep_configs(shape, conv, rep, record_dtype=rdt, input_dtype=idt)
            doc["sweep"] += rows
            chosen[shape] = {k: v[0] for k, v in best.items()}
            print(f"sweep {shape}: " + ", ".join(f"{k} {v[0]} {v[1]:.1f} us" for k, v in best.items()), flush=True)
        doc["configs"] = chosen
    if args.variants:
        import json

        doc["variants"] = []
        for shape, window, batch in itertools.product(shape_list, map(int, args.windows.split(",")),
                                                      map(int, args.batches.split(","))):
            case = Case(shape, batch, window, record_dtype=rdt, input_dtype=idt)
            t_conv = graph_time_us(case.conventional_window, reps=args.reps) / window
            for cfg in json.loads(args.variants):
                try:
                    t = graph_time_us(lambda: case.replay_window(cfg), reps=args.reps) / window
                except Exception as e:
                    print(f"{shape} B={batch} {cfg}: failed {e!r}"[:300])
                    continue
                doc["variants"].append(dict(shape=shape, batch=batch, window=window, config=cfg,
                                            record_dtype=args.record_dtype, input_dtype=args.input_dtype,
                                            us_conv=t_conv, us_replay=t, ratio=t_conv / t))
                print(f"{shape:18} L={window:2d} B={batch:3d} conv {t_conv:7.1f} us  replay {t:7.1f} us  "
                      f"{t_conv / t:5.2f}x  {cfg}",
                      flush=True)
            del case
            torch.cuda.empty_cache()
        write_results(args.out, doc)
        return doc
    rows = []
    for shape, window, batch, cur in itertools.product(shape_list, map(int, args.windows.split(",")),
                                                       map(int, args.batches.split(",")), args.cursors.split(",")):
        cfg = chosen.get(shape, {})
        r = measure(shape, batch, window, cur, rdt, args.reps, cfg.get("replay"), cfg.get("conventional"),
                    input_dtype=idt)
        rows += r
        doc["rows"] = rows
        write_results(args.out, doc)      # after every point: a run cut short keeps what it measured
        print(f"{shape:18} L={window:2d} B={batch:3d} {cur:9} conv {r[0]['us_per_step']:8.1f} us "
              f"{r[0]['tb_per_s']:5.2f} TB/s | replay {r[1]['us_per_step']:8.1f} us {r[1]['tb_per_s']:5.2f} TB/s "
              f"| {r[1]['ratio_vs_conventional']:.2f}x", flush=True)
    doc["rows"] = rows
    path = write_results(args.out, doc)
    try:
        _plot(rows, path.with_suffix(".png"))
    except Exception as e:  # plotting is a convenience; the JSON is the result
        print("plot failed:", e)
    print("\nshape               batch  conv us  TB/s  replay us  TB/s  ratio  path   (window 16, staggered)")
    for r in rows:
        if r["window"] == 16 and r["cursors"] == "staggered" and r["scheme"] == "replay":
            c = next(x for x in rows if x["scheme"] == "conventional" and all(
                x[k] == r[k] for k in ("shape", "batch", "window", "cursors")))
            print(f"{r['shape']:18} {r['batch']:5d} {c['us_per_step']:8.1f} {c['tb_per_s']:5.2f} "
                  f"{r['us_per_step']:9.1f} {r['tb_per_s']:5.2f} {r['ratio_vs_conventional']:6.2f}x  {r['path']}")
    return doc


if __name__ == "__main__":
    main()
