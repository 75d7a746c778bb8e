"""Layer-level precision study (issue 18, SPEC section 5): how far each way of storing the
recurrent state in low precision drives a stack of layers' outputs from the float64 recurrence,
as the sequence grows.

Per family (Mamba-2, GDN) a stack of `--layers` layers at a real shape (run as one layer with
`--layers` times the heads: see `run`), each with its own parameters drawn as the models
initialise them (`testing.make_params`: fast heads and long-memory heads with a decay near 1) and its own fixed random inputs (`testing.make_inputs`,
a few sequences per pool). Teacher forcing with independent inputs per layer: no design's
error reaches another layer's input. Without trained projections a layer's output would have to
pass through a random map to become the next layer's q/k/v/dt, which yields inputs of the same
statistics as fresh random ones; independent inputs keep every layer an independent trial and
the run free of a reference pass per layer.

Designs (`DESIGNS`), for each low-precision format `LP` of `--formats`:

* `shared`: one checkpoint in `LP`, written at every flush with round-to-nearest or stochastic
  rounding and read by every step (`SlotPool(hp_format=LP)`): the rounding feeds back.
* `separate`: an fp32 checkpoint carries the recurrence, an `LP` copy serves the non-flush
  outputs (`SlotPool(lp_format=LP)`, on the kernels on CUDA).
* `separate-fp8sr`: as `separate` with the high-precision checkpoint in fp8_e4m3 written with
  stochastic rounding.
* `conventional-lowp` (`LP` in bf16, fp16): the conventional recurrence whose state is rounded
  to `LP` after every token (`reference.schemes.shared_lowp_step`), nearest or stochastic, as
  serving engines keep bf16/fp16 states; on CUDA the batched engine runs them on the engines'
  kernel, `conventional_decode_lp` (the state stored in `LP`, stochastic rounding's streams
  `slot * 2**32 + token`).
* `conventional-fp32`: the conventional fp32 recurrence, the floor every design is held to.

The reference is the conventional recurrence in float64 (`params.step`), batched over the
sequences; the pool's float64 reference decode computes the same state (SPEC section 2) with a
loop over rows. Error at token `t`: `||y_t - y64_t|| / ||y64_t||` over every layer and sequence
of the stack; each row reports the mean of it over the tokens `(previous count, tokens]` of
log-spaced counts (`rel_error`) and its value at the count itself (`rel_error_at`), and the
first token whose outputs are not finite (`first_nonfinite`, None while they all are).

Two engines of the same mathematics: `pool` (a `SlotPool` per variant; on CUDA the pools decode
on the precision kernels, shared designs included, but for `separate-fp8sr` with an NVFP4 copy,
which runs on the reference, one row at a time) and `batched` (every variant as rows of one
tensor, one conventional step per token; see `precision_engine.BatchedEngine`; its conventional
low-precision rows on the kernel where `kernels`), which agree to within 1% (round-to-nearest)
at a tiny shape. The batched engine steps a window of `--window` tokens per call of one function
of device data (`--loop`, `precision_engine.WindowLoop`): on CUDA captured once in a CUDA graph
and replayed (`graph`, the default there: a few host calls per window instead of a few hundred
torch calls per token), on the CPU run eagerly (`window`, the default there); `token` steps
token by token from the host, as the pool engine does. The three give the same rows (bit for
bit on the CPU). Results for the issue come from a GPU run (`--engine batched --tokens 131072`);
on the CPU every pool runs the reference, fit for short runs only.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Optional

import torch

from .. import shapes as shp
from ..pool import SlotPool
from ..reference.schemes import shared_lowp_step
from ..testing import make_params
from .common import header, recording_slow_reads, write_results
from .precision_engine import INPUT_CHUNK, BatchedEngine, StudyInputs, WindowLoop, layer_seed

LP_FORMATS = ("fp16", "bf16", "fp8_e4m3", "nvfp4")
DESIGNS = ("shared", "separate", "separate-fp8sr", "conventional-lowp", "conventional-fp32")
DEFAULT_SHAPES = ("nemotron3-nano-4b", "qwen3.5-4b")
_CONV_FORMATS = ("bf16", "fp16")
ENGINES = ("pool", "batched")
LOOPS = ("token", "window", "graph")
_FIELDS = ("design", "family", "read_format", "hp_format", "rounding")


def variants(designs=DESIGNS, lp_formats=LP_FORMATS) -> list:
    """The runs of a study: dicts with `design`, `read_format` (what the outputs are computed
    from), `hp_format` (what carries the recurrence) and `rounding` (of the recurrence's state)."""
    out = []
    for d in designs:
        if d not in DESIGNS:
            raise ValueError(f"unknown design {d!r}; expected one of {DESIGNS}")
        if d == "conventional-fp32":
            out.append(dict(design=d, read_format="fp32", hp_format="fp32", rounding="nearest"))
            continue
        for f in lp_formats:
            if f not in LP_FORMATS:
                raise ValueError(f"unknown low-precision format {f!r}; expected one of {LP_FORMATS}")
            if d == "shared":
                out += [dict(design=d, read_format=f, hp_format=f, rounding=r) for r in ("nearest", "stochastic")]
            elif d == "separate":
                out.append(dict(design=d, read_format=f, hp_format="fp32", rounding="nearest"))
            elif d == "separate-fp8sr":
                out.append(dict(design=d, read_format=f, hp_format="fp8_e4m3", rounding="stochastic"))
            elif f in _CONV_FORMATS:
                out += [dict(design=d, read_format=f, hp_format=f, rounding=r) for r in ("nearest", "stochastic")]
    return out


def checkpoints(tokens: int) -> list:
    """Log-spaced token counts 1, 2, 4, ... ending with `tokens` itself."""
    pts, t = [], 1
    while t < tokens:
        pts.append(t)
        t *= 2
    return pts + [tokens]


class _Runner:
    """One variant on one layer: a pool (or a conventional state) fed one token per step."""

    def __init__(self, var, params, batch, shape, window, device, seed, layer):
        self.var, self.B = var, batch
        self.slots = torch.arange(batch, device=device)
        self.pool = self.state = None
        d = var["design"]
        if d.startswith("conventional"):
            self.params = make_params(shape.family, shape.HV, shape.K, dtype=torch.float32,
                                      device=device, seed=layer_seed(seed, layer))
            self.state = torch.zeros(batch, shape.HV, shape.V, shape.K, device=device)
            self.seed = layer_seed(seed, layer)
            return
        hp = None if var["hp_format"] == "fp32" else var["hp_format"]
        lp = None if d == "shared" else var["read_format"]
        # the decode kernels cover every pool here but an fp8 HP beside an NVFP4 copy (its scale
        # per head needs the fp32 matrix); "auto" would warn for that one
        backend = "reference" if hp is not None and lp == "nvfp4" else "auto"
        # eager_max_batch=0: a few rows must still take the window (the eager step keeps no records)
        self.pool = SlotPool(params, batch, shape.V, shape.K, shape.Hk, window=window, dtype=torch.float32,
                             device=device, hp_format=hp, hp_rounding=var["rounding"] if hp else None,
                             lp_format=lp, seed=seed, layer=layer, backend=backend, eager_max_batch=0)

    def step(self, t: int, inp: dict) -> torch.Tensor:
        if self.pool is not None:
            return self.pool.decode(self.slots, **inp)
        if self.var["design"] == "conventional-fp32":
            y, self.state = self.params.step(self.state, **inp)
            return y
        # a fresh stream per token and row: no two roundings share random numbers
        stream = t * self.B + torch.arange(self.B, device=self.state.device, dtype=torch.int64)
        y, self.state = shared_lowp_step(self.params, self.state, self.var["read_format"], self.var["rounding"],
                                         seed=self.seed, stream=stream, **inp)
        return y


def resolve_loop(engine: str, device, loop: Optional[str] = None) -> str:
    """The loop `run` steps the tokens with: `loop` checked against the engine and device, or
    by default "graph" for the batched engine on CUDA, "window" for it elsewhere, "token" for
    the pools."""
    device = torch.device(device)
    if loop is None:
        return "token" if engine == "pool" else "graph" if device.type == "cuda" else "window"
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
    if engine == "pool" and loop != "token":
        raise ValueError(f"the pool engine steps token by token; loop {loop!r} is the batched engine's")
    if loop == "graph" and device.type != "cuda":
        raise ValueError(f"loop 'graph' replays CUDA graphs; device {device} is not CUDA")
    return loop


def run(shape, *, layers: int = 2, tokens: int = 256, batch: int = 2, window: int = 16,
        designs=DESIGNS, lp_formats=LP_FORMATS, device="cpu", seed: int = 0, engine: str = "pool",
        progress=None, kernels=None, time_budget: float = 0.0, loop: Optional[str] = None) -> list:
    """The study for one shape (`shapes.Shape` or a name / `family/HV/Hk/V/K`): its rows, one per
    variant and log-spaced token count (`checkpoints(tokens)`).

    `engine`: "pool" (a `SlotPool` per variant: on CUDA the precision kernels where they cover
    it, the reference otherwise, one row at a time) or "batched" (`BatchedEngine`: every
    variant in one tensor, fast enough for 131072 tokens on a GPU). `kernels` (batched engine):
    the conventional low-precision designs on `conventional_decode_lp` (None: on CUDA). `loop`
    (`resolve_loop`): "token", one step of every variant per token from the host; "window" or
    "graph" (batched engine), a window of tokens per call of one function of device data
    (`WindowLoop`), run eagerly or replayed from a CUDA graph; the same numbers every way."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    shape = shp.parse(shape) if isinstance(shape, str) else shape
    device = torch.device(device)
    loop = resolve_loop(engine, device, loop)
    vars_ = variants(designs, lp_formats)
    # The layers of a stack are independent trials (own parameters, own inputs) and every head's
    # recurrence is independent of the others': a stack of `layers` layers is one layer with
    # `layers` times the heads (and groups), which costs one pass over the tokens instead of one
    # per layer (the host's launch overhead, not the GPU, bounds a pass).
    wide = shp.Shape(shape.family, shape.HV * layers, shape.Hk * layers, shape.V, shape.K)
    err2 = torch.zeros(len(vars_), tokens, dtype=torch.float64, device=device)
    ref2 = torch.zeros(tokens, dtype=torch.float64, device=device)
    started = time.perf_counter()
    lseed = layer_seed(seed, 0)          # the runners draw their parameters from the same seed
    p64 = make_params(wide.family, wide.HV, wide.K, dtype=torch.float64, device=device, seed=lseed)
    if engine == "batched":
        runners = BatchedEngine(vars_, wide, batch, window, device, seed, 0,
                                kernels=device.type == "cuda" if kernels is None else kernels)
    else:
        runners = [_Runner(v, p64, batch, wide, window, device, seed, 0) for v in vars_]
    S64 = torch.zeros(batch, wide.HV, wide.V, wide.K, dtype=torch.float64, device=device)
    feed = StudyInputs(p64, batch, wide, tokens, torch.Generator().manual_seed(lseed), device)
    windows = None if loop == "token" else WindowLoop(runners, p64, S64, window, graphs=loop == "graph")
    step = 1 if windows is None else window
    t = checked = 0
    while t < tokens:
        m = min(step, tokens - t)
        inputs = feed.take(t, m)       # first: a new chunk is drawn while the GPU works
        if time_budget and t // INPUT_CHUNK > checked // INPUT_CHUNK:
            checked = t
            if device.type == "cuda":
                torch.cuda.synchronize(device)       # the time the GPU took, not the host's queue
            if time.perf_counter() - started > time_budget:
                # out of time: the rows end at the tokens run so far (`tokens` in each row says so)
                err2, ref2, tokens = err2[:, :t], ref2[:t], t
                break
        if windows is not None:
            e, r = windows.run(t, inputs)
            err2[:, t:t + m] = e
            ref2[t:t + m] = r
        else:
            inp64 = {k: v[:, 0] for k, v in inputs.items()}
            y64, S64 = p64.step(S64, **inp64)
            inp = {k: v.float() for k, v in inp64.items()}
            ref2[t] += (y64 * y64).sum()
            if engine == "batched":
                err2[:, t] += ((runners.step(t, inp).double() - y64) ** 2).flatten(1).sum(1)
            else:
                for i, r in enumerate(runners):
                    err2[i, t] += ((r.step(t, inp).double() - y64) ** 2).sum()
        t += m
        if progress and t // 16384 > (t - m) // 16384 and t < tokens:
            progress(f"{shape.family}: {t}/{tokens} tokens, {time.perf_counter() - started:.0f} s")
    if progress:
        progress(f"{shape.family}: {tokens} tokens, {layers} layers, {len(vars_)} variants, "
                 f"{time.perf_counter() - started:.0f} s")
    return _rows(shape, vars_, (err2 / ref2).sqrt().cpu(),
                 dict(layers=layers, batch=batch, window=window, engine=engine, loop=loop))


def _rows(shape, vars_, rel, extra) -> list:
    tokens = rel.shape[1]
    name = next((n for n, s in shp.MODEL_SHAPES.items() if s == shape), "/".join(map(str, shape)))
    rows = []
    for i, v in enumerate(vars_):
        bad = (~torch.isfinite(rel[i])).nonzero()
        first_bad = int(bad[0]) + 1 if bad.numel() else None      # tokens count from 1
        lo = 0
        for cp in checkpoints(tokens):
            seg = rel[i, lo:cp]
            rows.append(dict(shape=name, family=shape.family, design=v["design"], read_format=v["read_format"],
                             hp_format=v["hp_format"], rounding=v["rounding"], tokens=cp,
                             rel_error=_finite(seg.mean().item()), rel_error_at=_finite(rel[i, cp - 1].item()),
                             first_nonfinite=first_bad, HV=shape.HV, Hk=shape.Hk, V=shape.V, K=shape.K, **extra))
            lo = cp
    return rows


def _finite(x: float):
    """JSON has no NaN/inf: a non-finite error is None (`first_nonfinite` says from where)."""
    return x if math.isfinite(x) else None


def table(rows) -> str:
    """The rows as a text table: one line per variant, `rel_error` at each token count."""
    cps = sorted({r["tokens"] for r in rows})
    if len(cps) > 9:     # keep a line readable: every other count, always the last
        cps = cps[::-2][::-1]
    head = f"{'family':7} {'design':18} {'read':9} {'hp':9} {'rounding':10} " + \
        " ".join(f"{c:>8}" for c in cps) + f" {'non-finite':>10}"
    lines = [head, "-" * len(head)]
    seen = {}
    for r in rows:
        seen.setdefault(tuple(r[f] for f in _FIELDS), {})[r["tokens"]] = r
    for key, by_t in seen.items():
        last = by_t[max(by_t)]
        cells = " ".join(f"{by_t[c]['rel_error']:8.1e}" if c in by_t and by_t[c]["rel_error"] is not None
                         else f"{'-':>8}" for c in cps)
        nf = last["first_nonfinite"]
        lines.append(f"{key[1]:7} {key[0]:18} {key[2]:9} {key[3]:9} {key[4]:10} {cells} "
                     f"{'-' if nf is None else nf:>10}")
    return "\n".join(lines)


def plot(rows, path, *, group: str = "family", value: str = "rel_error", xlabel: str = "tokens",
         ylabel: str = "output rel. error") -> None:
    """`value` against `tokens`, log-log: one panel per `group` (a family; the model study: a
    model) and low-precision format, one line per design, read format and rounding (zeros and
    None, which a log axis cannot show, left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fields = ("design", group, "read_format", "hp_format", "rounding")
    groups = list(dict.fromkeys(r[group] for r in rows))
    fmts = [f for f in LP_FORMATS if any(r["read_format"] == f for r in rows)] or ["fp32"]
    fig, axes = plt.subplots(len(groups), len(fmts), figsize=(3.4 * len(fmts), 2.9 * len(groups)), squeeze=False)
    for a, grp in enumerate(groups):
        for b, fmt in enumerate(fmts):
            ax = axes[a][b]
            keys = {tuple(r[f] for f in fields): None for r in rows if r[group] == grp
                    and (r["read_format"] == fmt or r["design"] == "conventional-fp32")}
            for key in keys:
                pts = [(r["tokens"], r[value]) for r in rows if tuple(r[f] for f in fields) == key and r[value]]
                if not pts:
                    continue
                style = "--" if key[0].startswith("conventional") else "-"
                # RN / SR: the recurrence's rounding where a design has a choice
                label = key[0] + ("" if key[0] in ("separate", "separate-fp8sr", "conventional-fp32")
                                  else " SR" if key[4] == "stochastic" else " RN")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=".", ms=3, label=label)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"{grp}, read {fmt}", fontsize=8)
            ax.set_xlabel(xlabel, fontsize=7)
            ax.tick_params(labelsize=6)
            ax.legend(fontsize=5)
        axes[a][0].set_ylabel(ylabel, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _csv(text: str, allowed, what: str) -> list:
    items = [s.strip() for s in text.split(",") if s.strip()]
    for s in items:
        if s not in allowed:
            raise argparse.ArgumentTypeError(f"unknown {what} {s!r}; expected some of {', '.join(allowed)}")
    return items


def _shapes_arg(text: str) -> list:
    try:
        return [shp.parse(s.strip()) for s in text.split(",") if s.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> int:
    try:
        val = int(text)
    except ValueError:
        val = 0
    if val < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return val


def _fewer_heads(s, heads: int):
    """`s` with `heads` value heads and as many key heads as keep its ratio (at least one)."""
    Hk = max(1, heads * s.Hk // s.HV)
    while heads % Hk:
        Hk -= 1
    return shp.Shape(s.family, heads, Hk, s.V, s.K)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="replayssm study precision", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=_shapes_arg, default=list(map(shp.parse, DEFAULT_SHAPES)),
                    help="comma-separated model shapes or family/HV/Hk/V/K (default: "
                         f"{','.join(DEFAULT_SHAPES)})")
    ap.add_argument("--heads", type=int, default=0,
                    help="value heads per layer, the shape's head dims and group ratio kept "
                         "(default 0: the shape's own)")
    ap.add_argument("--layers", type=_positive, default=2, help="layers per stack (default %(default)s)")
    ap.add_argument("--tokens", type=_positive, default=64,
                    help="tokens per sequence (default %(default)s: about 2 minutes on a 2-core CPU "
                         "at the default shapes; the GPU study: 131072)")
    ap.add_argument("--batch", type=_positive, default=2, help="sequences per pool (default %(default)s)")
    ap.add_argument("--window", type=_positive, default=16, help="replay window L (default %(default)s)")
    ap.add_argument("--designs", type=lambda s: _csv(s, DESIGNS, "design"), default=list(DESIGNS))
    ap.add_argument("--formats", type=lambda s: _csv(s, LP_FORMATS, "format"), default=list(LP_FORMATS),
                    help="low-precision formats (default: all of " + ",".join(LP_FORMATS) + ")")
    ap.add_argument("--engine", default="pool", choices=ENGINES,
                    help="pool: a SlotPool per variant (the kernels where they apply, else the "
                         "reference, row by row); batched: every variant in one tensor, the same "
                         "mathematics, for long GPU runs (default %(default)s)")
    ap.add_argument("--loop", default=None, choices=LOOPS,
                    help="batched engine: graph (a window of tokens per CUDA-graph replay; the default "
                         "on CUDA), window (the same window function run eagerly; the default on the "
                         "CPU) or token (one host step per token, the pool engine's only loop)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda where available)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/precision_study.json",
                    help="JSON results (a .png plot beside it)")
    ap.add_argument("--no-plot", dest="do_plot", action="store_false")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds per shape (0: none); a shape out of time ends its rows at the tokens run")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {device}: CUDA is not available on this machine")
    if args.heads < 0:
        ap.error(f"--heads must be >= 0, got {args.heads}")
    if args.heads:
        args.shapes = [_fewer_heads(s, args.heads) for s in args.shapes]
    try:
        loop = resolve_loop(args.engine, device, args.loop)
    except ValueError as e:
        ap.error(str(e))
    bad = [s for s in args.shapes if "nvfp4" in args.formats and s.K % 16]
    if bad:
        ap.error(f"nvfp4 needs K divisible by 16: {bad[0]}")
    doc = header("precision_study")
    doc.update(engine=args.engine, loop=loop, layers=args.layers, tokens=args.tokens, batch=args.batch,
               window=args.window, seed=args.seed, time_budget_s=args.time_budget or None,
               teacher_forcing="independent random inputs per layer", reference="float64 conventional recurrence",
               conventional_lowp="conventional_decode_lp kernels" if args.engine == "batched"
               and device.startswith("cuda") else "reference (shared_lowp_step)",
               rows=[])
    for s in args.shapes:
        with recording_slow_reads(doc):
            doc["rows"] += run(s, layers=args.layers, tokens=args.tokens, batch=args.batch, window=args.window,
                               designs=args.designs, lp_formats=args.formats, device=device, seed=args.seed,
                               engine=args.engine, progress=lambda m: print(m, flush=True),
                               time_budget=args.time_budget, loop=loop)
        write_results(args.out, doc)      # after every shape: a run cut short keeps what it measured
    print(f"\nmean output relative error against float64 over the tokens up to each count "
          f"({args.layers} layers, {args.batch} sequences, window {args.window}, {device}):")
    print(table(doc["rows"]))
    path = write_results(args.out, doc)
    if args.do_plot:
        plot(doc["rows"], Path(path).with_suffix(".png"))
    return doc


if __name__ == "__main__":
    main()
