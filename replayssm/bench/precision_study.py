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
tensor, one conventional step per token; see `_Batched`; its conventional low-precision rows on
the kernel where `kernels`), which agree to within 1% (round-to-nearest) at a tiny shape.
Results for the issue come from a GPU run (`--engine batched --tokens 131072`); on the CPU every
pool runs the reference, fit for short runs only.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from .. import shapes as shp
from ..pool import SlotPool
from ..formats import allocate, quantize
from ..reference.schemes import shared_lowp_step
from ..testing import make_inputs, make_params
from .common import header, write_results

LP_FORMATS = ("fp16", "bf16", "fp8_e4m3", "nvfp4")
DESIGNS = ("shared", "separate", "separate-fp8sr", "conventional-lowp", "conventional-fp32")
DEFAULT_SHAPES = ("nemotron3-nano-4b", "qwen3.5-4b")
_CONV_FORMATS = ("bf16", "fp16")
ENGINES = ("pool", "batched")
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
                                      device=device, seed=_layer_seed(seed, layer))
            self.state = torch.zeros(batch, shape.HV, shape.V, shape.K, device=device)
            self.seed = _layer_seed(seed, layer)
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


class _Batched:
    """Every variant of one layer as rows of one tensor, stepped by one conventional step per
    token: the same mathematics as the pools, with no loop over rows or variants.

    A pool design has an output path `O` (from the checkpoint its non-flush steps read, with
    records whose GDN `u` came from it) and a high-precision path `H` (from `C_HP`; for GDN the
    `u` a flush recomputes from the raw records). Between flushes both step conventionally in
    fp32 (equal to the pool's unrolled sums within fp32 rounding); a flush outputs from `H`,
    then sets `H <- Q_HP(H)` and `O <- Q_LP(H)` (shared: `O <- H`), as `SlotPool._write`
    stores `S`. Stochastic roundings draw other random numbers than the pools' streams.
    With `kernels`, the conventional low-precision designs are not rows of that tensor: each
    keeps its state in its format, stepped by `conventional_decode_lp` (the serving engines'
    kernel, its outputs from the fp32 update as `params.step`'s).
    """

    def __init__(self, vars_, shape, batch, window, device, seed, layer, kernels=False):
        self.vars, self.B, self.window = vars_, batch, window
        self.pools = [i for i, v in enumerate(vars_) if not v["design"].startswith("conventional")]
        conv = [i for i, v in enumerate(vars_) if v["design"].startswith("conventional")]
        self.lp_kernels = [i for i in conv if kernels and vars_[i]["hp_format"] != "fp32"]
        self.convs = [i for i in conv if i not in self.lp_kernels]
        self.params = make_params(shape.family, shape.HV, shape.K, dtype=torch.float32, device=device,
                                  seed=_layer_seed(seed, layer))
        self.rows = 2 * len(self.pools) + len(self.convs)      # O rows, H rows, conventional rows
        self.S = torch.zeros(self.rows * batch, shape.HV, shape.V, shape.K, device=device)
        self.seed = _layer_seed(seed, layer)
        self.ar = torch.arange(batch, device=device, dtype=torch.int64)
        self.lp_states = {i: allocate(vars_[i]["hp_format"], (batch, shape.HV, shape.V, shape.K), device)
                          for i in self.lp_kernels}
        if self.lp_kernels:
            from ..ops import gdn, mamba2

            self.lp_step = mamba2.conventional_decode_lp if shape.family == "mamba2" else gdn.conventional_decode_lp

    def _kernel_step(self, t: int, i: int, inp: dict) -> torch.Tensor:
        """Token `t` of conventional low-precision variant `i` on the kernel: its outputs `[B, HV, V]`."""
        v, p = self.vars[i], self.params
        # one seed per variant and layer: no two variants share random numbers
        kw = dict(rounding=v["rounding"], seed=(self.seed * 1009 + i) % 2 ** 64, step=t)
        if p.family == "mamba2":
            return self.lp_step(inp["x"], inp["dt"], inp["B"], inp["C"], p.A, p.dt_bias, p.D, inp.get("z"),
                                self.lp_states[i], self.ar, v["hp_format"], **kw)
        return self.lp_step(inp["q"], inp["k"], inp["v"], inp["a"], inp["b"], p.A_log, p.dt_bias, p.scale,
                            self.lp_states[i], self.ar, v["hp_format"], use_qk_l2norm=p.use_qk_l2norm,
                            family=p.family, **kw)

    def _rows(self, j: int) -> slice:
        return slice(j * self.B, (j + 1) * self.B)

    def _round(self, x, fmt, rounding, t, i):
        if fmt == "fp32":
            return x
        # one stream per token, row and variant: no two roundings share random numbers
        stream = (t * len(self.vars) + i) * self.B + self.ar
        return quantize(x, fmt, rounding, seed=self.seed, stream=stream)

    def step(self, t: int, inp: dict) -> torch.Tensor:
        """Token `t` (from 0) for every variant: outputs `[variants, B, HV, V]`."""
        rep = {k: v.repeat(self.rows, *([1] * (v.dim() - 1))) for k, v in inp.items()}
        y, self.S = self.params.step(self.S, **rep)
        y = y.view(self.rows, self.B, *y.shape[1:])
        nP = len(self.pools)
        flush = (t + 1) % self.window == 0
        out = torch.empty(len(self.vars), *y.shape[1:], dtype=y.dtype, device=y.device)
        out[self.pools] = y[nP:2 * nP] if flush else y[:nP]
        out[self.convs] = y[2 * nP:]
        for i in self.lp_kernels:
            out[i] = self._kernel_step(t, i, inp)
        if flush:
            for j, i in enumerate(self.pools):
                v = self.vars[i]
                H = self.S[self._rows(nP + j)]
                lp = H if v["design"] == "shared" else self._round(H, v["read_format"], "nearest", t, i)
                self.S[self._rows(nP + j)] = self._round(H, v["hp_format"], v["rounding"], t, i)
                self.S[self._rows(j)] = self.S[self._rows(nP + j)] if v["design"] == "shared" else lp
        for j, i in enumerate(self.convs):
            v = self.vars[i]
            r = self._rows(2 * nP + j)
            self.S[r] = self._round(self.S[r], v["hp_format"], v["rounding"], t, i)
        return out


def _layer_seed(seed: int, layer: int) -> int:
    return seed * 1_000_003 + layer


def run(shape, *, layers: int = 2, tokens: int = 256, batch: int = 2, window: int = 16,
        designs=DESIGNS, lp_formats=LP_FORMATS, device="cpu", seed: int = 0, engine: str = "pool",
        progress=None, kernels=None, time_budget: float = 0.0) -> list:
    """The study for one shape (`shapes.Shape` or a name / `family/HV/Hk/V/K`): its rows, one per
    variant and log-spaced token count (`checkpoints(tokens)`).

    `engine`: "pool" (a `SlotPool` per variant: on CUDA the precision kernels where they cover
    it, the reference otherwise, one row at a time) or "batched" (`_Batched`: every
    variant in one tensor, fast enough for 131072 tokens on a GPU). `kernels` (batched engine):
    the conventional low-precision designs on `conventional_decode_lp` (None: on CUDA)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    shape = shp.parse(shape) if isinstance(shape, str) else shape
    device = torch.device(device)
    vars_ = variants(designs, lp_formats)
    # The layers of a stack are independent trials (own parameters, own inputs) and every head's
    # recurrence is independent of the others': a stack of `layers` layers is one layer with
    # `layers` times the heads (and groups), which costs one pass over the tokens instead of one
    # per layer (the host's launch overhead, not the GPU, bounds a pass).
    wide = shp.Shape(shape.family, shape.HV * layers, shape.Hk * layers, shape.V, shape.K)
    err2 = torch.zeros(len(vars_), tokens, dtype=torch.float64, device=device)
    ref2 = torch.zeros(tokens, dtype=torch.float64, device=device)
    started = time.perf_counter()
    lseed = _layer_seed(seed, 0)          # the runners draw their parameters from the same seed
    p64 = make_params(wide.family, wide.HV, wide.K, dtype=torch.float64, device=device, seed=lseed)
    if engine == "batched":
        runners = _Batched(vars_, wide, batch, window, device, seed, 0,
                           kernels=device.type == "cuda" if kernels is None else kernels)
    else:
        runners = [_Runner(v, p64, batch, wide, window, device, seed, 0) for v in vars_]
    S64 = torch.zeros(batch, wide.HV, wide.V, wide.K, dtype=torch.float64, device=device)
    g = torch.Generator().manual_seed(lseed)
    chunk = 256              # tokens of inputs drawn and moved to the device at once
    for t in range(tokens):
        if time_budget and t % chunk == 0 and t and time.perf_counter() - started > time_budget:
            # out of time: the rows end at the tokens run so far (`tokens` in each row says so)
            err2, ref2, tokens = err2[:, :t], ref2[:t], t
            break
        if t % chunk == 0:
            inputs = make_inputs(p64, batch, wide.V, wide.K, wide.Hk, steps=min(chunk, tokens - t),
                                 generator=g, device=device)
        inp64 = {k: v[:, t % chunk] for k, v in inputs.items()}
        y64, S64 = p64.step(S64, **inp64)
        inp = {k: v.float() for k, v in inp64.items()}
        ref2[t] += (y64 * y64).sum()
        if engine == "batched":
            err2[:, t] += ((runners.step(t, inp).double() - y64) ** 2).flatten(1).sum(1)
        else:
            for i, r in enumerate(runners):
                err2[i, t] += ((r.step(t, inp).double() - y64) ** 2).sum()
        if progress and (t + 1) % 16384 == 0 and t + 1 < tokens:
            progress(f"{shape.family}: {t + 1}/{tokens} tokens, {time.perf_counter() - started:.0f} s")
    if progress:
        progress(f"{shape.family}: {tokens} tokens, {layers} layers, {len(vars_)} variants, "
                 f"{time.perf_counter() - started:.0f} s")
    return _rows(shape, vars_, (err2 / ref2).sqrt().cpu(),
                 dict(layers=layers, batch=batch, window=window, engine=engine))


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


def plot(rows, path) -> None:
    """Relative error against tokens, log-log: one panel per family and low-precision format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = sorted({r["family"] for r in rows})
    fmts = [f for f in LP_FORMATS if any(r["read_format"] == f for r in rows)] or ["fp32"]
    fig, axes = plt.subplots(len(fams), len(fmts), figsize=(3.4 * len(fmts), 2.9 * len(fams)), squeeze=False)
    for a, fam in enumerate(fams):
        for b, fmt in enumerate(fmts):
            ax = axes[a][b]
            keys = {tuple(r[f] for f in _FIELDS): None for r in rows if r["family"] == fam
                    and (r["read_format"] == fmt or r["design"] == "conventional-fp32")}
            for key in keys:
                pts = [(r["tokens"], r["rel_error"]) for r in rows if tuple(r[f] for f in _FIELDS) == key
                       and r["rel_error"] is not None]
                if not pts:
                    continue
                style = "--" if key[0].startswith("conventional") else "-"
                # RN / SR: the recurrence's rounding where a design has a choice
                label = key[0] + ("" if key[0] in ("separate", "separate-fp8sr", "conventional-fp32")
                                  else " SR" if key[4] == "stochastic" else " RN")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=".", ms=3, label=label)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"{fam}, read {fmt}", fontsize=8)
            ax.set_xlabel("tokens", fontsize=7)
            ax.tick_params(labelsize=6)
            ax.legend(fontsize=5)
        axes[a][0].set_ylabel("output rel. error", fontsize=7)
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
                    help="tokens per sequence (default %(default)s: about 10 minutes on a 2-core CPU "
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
    bad = [s for s in args.shapes if "nvfp4" in args.formats and s.K % 16]
    if bad:
        ap.error(f"nvfp4 needs K divisible by 16: {bad[0]}")
    doc = header("precision_study")
    doc.update(engine=args.engine, layers=args.layers, tokens=args.tokens, batch=args.batch,
               window=args.window, seed=args.seed, time_budget_s=args.time_budget or None,
               teacher_forcing="independent random inputs per layer", reference="float64 conventional recurrence",
               conventional_lowp="conventional_decode_lp kernels" if args.engine == "batched"
               and device.startswith("cuda") else "reference (shared_lowp_step)",
               rows=[])
    for s in args.shapes:
        doc["rows"] += run(s, layers=args.layers, tokens=args.tokens, batch=args.batch, window=args.window,
                           designs=args.designs, lp_formats=args.formats, device=device, seed=args.seed,
                           engine=args.engine, progress=lambda m: print(m, flush=True),
                           time_budget=args.time_budget)
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
