"""Model-level precision study (issue 18): how far each way of storing the recurrent state in
low precision moves a whole hybrid model's next-token distributions from the fp32 state's, as
a teacher-forced sequence grows.

A causal LM built from a shipped config (`hf.build`, random weights, seeded; `tiny_nemotron_h`
and `tiny_qwen3_5` by default, the real `nemotron3-nano-4b` / `qwen3.5-4b` on CUDA when
`--models` asks), one random token sequence per row of `--batch`, or one of the trained models
(`hf.trained_names()`, e.g. `trained-nemotron-h`) on consecutive stretches of its held-out
Python bytes (`heldout.bin`, the text it was scored on), teacher forced: the model's
own prefill of the first `--prefill` tokens (the stock path, which seeds each layer's pool),
then `--tokens` decode steps through plain forward calls of the enabled model, each feeding the
sequence's true next token (no `generate`, no sampling: every design sees the same inputs).

Designs, through `hf.enable`'s options (the same names as the layer study, `precision_study`),
for each low-precision format `LP` of `--formats`:

* `replay-fp32`: the fp32 replay pools, run a second time: the reference pass's own design,
  its KL exactly 0 where the run is deterministic (a check of the study itself);
* `separate`: an fp32 checkpoint carries the recurrence, non-flush steps read an `LP` copy
  (`enable(lp_format=LP)`); `separate-fp8sr`: the same with the recurrence's checkpoint in
  fp8_e4m3, stochastically rounded;
* `shared`: one `LP` checkpoint, round-to-nearest or stochastic (`enable(hp_format=LP,
  hp_rounding=...)`);
* `conventional-lowp` (`LP` bf16, fp16): a conventional state rounded to `LP` every token,
  nearest or stochastic: the shared design with `window=1` (every step flushes, so the one
  checkpoint is the state, read and rewritten each token, as serving engines keep it);
* `conventional-fp32`: `enable(scheme="conventional")`, the fp32 recurrence rewritten every
  token: how far reordering the same fp32 arithmetic alone moves the distributions.

Every replay design decodes with `eager_max_batch=0`: at the small batches of a study the
kernels' measured choice is the eager step (window 1), whose flush every token would never read
a low-precision copy. The reference is the fp32 replay pools (`enable()` with window
`--window`); per decode step and row `KL(p_ref || p_design)` of the next-token distributions
(log-softmax of the fp32 logits in float64). Rows, per design and log-spaced decode-step count
(1, 2, 4, ... `tokens`, as the layer study): `kl`, the mean over the steps `(previous count,
count]` and the rows; `kl_at`, at the count itself; `top1_agree`, the fraction of those steps
whose argmax token is the reference's; `first_nonfinite`, the first step whose logits are not
finite (None while all are). Models whose key head dim is not a multiple of 16 cannot keep an
NVFP4 state: their NVFP4 variants are left out and the document's `skipped` says so.

`--config KEY=VALUE` sets a config value of every model before it is built: the tiny NemotronH
ships a time-step range of 0.05-0.5, which leaves every head a memory of tens of tokens, so that
a low-precision state's rounding cannot accumulate; `time_step_min=0.001 time_step_max=0.1`
(the full models' range) adds heads that remember about a thousand.

Cost: models that take a transformers cache (`forced.StaticPass`) run every design in one pass
(`forced.Lockstep`): a copy of the model per design beside the reference, each with its own
static cache and pools, stepped together and compared on the device after each step; on CUDA
the copies' steps replay from one CUDA graph, each copy on its own stream, so a tiny model's
small kernels run side by side. Other models (the pure Mamba-2 `cache_params` model) run one
eager pass per design plus the reference's. `--time-budget S` ends each model's pass (or its
reference pass, `S / (designs + 1)` there) S seconds after its first step (which compiles
kernels) at the steps reached; progress lines give the time a step.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import time
import warnings
from pathlib import Path

import torch

from . import forced
from .common import header, recording_slow_reads, write_results
from .model import MODELS
from .precision_study import LP_FORMATS, _csv, checkpoints
from .precision_study import plot as layer_plot
from .precision_study import DESIGNS as LAYER_DESIGNS
from .precision_study import variants as layer_variants

DESIGNS = ("replay-fp32",) + LAYER_DESIGNS
DEFAULT_MODELS = ("tiny_nemotron_h", "tiny_qwen3_5")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_FIELDS = ("design", "read_format", "hp_format", "rounding")


def variants(designs=DESIGNS, lp_formats=LP_FORMATS) -> list:
    """The runs of a study: dicts with `design`, `read_format`, `hp_format`, `rounding`, as
    `precision_study.variants`, the reference's own design `replay-fp32` first."""
    designs = list(designs)
    for d in designs:
        if d not in DESIGNS:
            raise ValueError(f"unknown design {d!r}; expected one of {DESIGNS}")
    out = [dict(design="replay-fp32", read_format="fp32", hp_format="fp32", rounding="nearest")] \
        if "replay-fp32" in designs else []
    return out + layer_variants([d for d in designs if d != "replay-fp32"], lp_formats)


def enable_options(var: dict, window: int) -> dict:
    """`hf.enable`'s keyword arguments for variant `var`."""
    d = var["design"]
    if d == "conventional-fp32":
        return dict(scheme="conventional")
    # max_draft 1: the study never verifies; eager_max_batch 0: see the module docstring
    opts = dict(window=1 if d == "conventional-lowp" else window, max_draft=1, eager_max_batch=0)
    if d.startswith("separate"):
        opts["lp_format"] = var["read_format"]
    if var["hp_format"] != "fp32":
        opts.update(hp_format=var["hp_format"], hp_rounding=var["rounding"])
    return opts


def kl_div(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """`KL(softmax(ref) || softmax(logits))` per row, `[..., vocab]` -> `[...]` float64 (NaN
    where `logits` is not finite)."""
    lp = torch.log_softmax(ref_logits.double(), -1)
    lq = torch.log_softmax(logits.double(), -1)
    # the float64 sums of a distribution this close to the reference can round below zero
    return (lp.exp() * (lp - lq)).sum(-1).clamp(min=0)


def _sequences(name: str, vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    """`[batch, length]` token ids: a trained model's held-out bytes, row after row (its own
    text, never trained on), else random ids above the tiny configs' pad/bos/eos ids (0-2;
    random weights make every token alike)."""
    if name.startswith("trained-"):
        from ..integrations import hf
        held = (hf.trained_path(name) / "heldout.bin").read_bytes()
        if len(held) < batch * length:
            raise ValueError(f"{name}: its held-out text has {len(held):,} bytes, fewer than batch x "
                             f"(prefill + tokens) = {batch * length:,}")
        return torch.tensor(list(held[:batch * length]), dtype=torch.long).reshape(batch, length)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)       # the time the GPU took, not the host's queue


def _adapters(model) -> list:
    from ..integrations import hf
    return [layer.adapter for layer in hf.replay_state(model).layers.values()]


def run(name: str, *, tokens: int = 256, prefill: int = 64, batch: int = 1, window: int = 16,
        designs=DESIGNS, lp_formats=LP_FORMATS, device="cpu", dtype: torch.dtype = torch.float32,
        seed: int = 0, backend: str = "auto", time_budget: float = 0.0, progress=None,
        skipped=None, overrides=None, graphs: bool = True, only=None) -> list:
    """The study for one model (a shipped config name or an alias of `bench.model.MODELS`):
    its rows, one per variant and log-spaced decode-step count (`checkpoints(tokens)`).
    NVFP4 variants of a model whose key head dim is not a multiple of 16 are left out and
    appended to `skipped` (a list) when given. `overrides`: config values set before the model is
    built (`hf.build`), e.g. `time_step_min=0.001, time_step_max=0.1` for the tiny NemotronH,
    whose shipped range (0.05-0.5) keeps every head's memory to tens of tokens. Models that take
    a transformers cache run all variants side by side on static caches (`forced.Lockstep`; on
    CUDA replayed from one CUDA graph unless `graphs` is off), others one pass per variant on
    the dynamic cache (`forced.DynamicPass`); the rows' `timing` says which. `only`: (design,
    format) pairs, the variants kept of `designs` x `lp_formats` (both roundings where a design
    has two; None keeps all)."""
    from ..integrations import hf

    device = torch.device(device)
    cfg_name = MODELS.get(name, name)
    model = hf.build(cfg_name, dtype=dtype, seed=seed, device=device, **(overrides or {}))
    ids = _sequences(cfg_name, model.config.vocab_size, batch, prefill + tokens, seed).to(device)
    static = forced.StaticPass(model, ids, prefill, graphs=graphs) if forced.StaticPass.supports(model) else None
    if static is not None:
        static.prefill_cache()            # stock, before any design is enabled
    hf.enable(model, window=window, max_draft=1, eager_max_batch=0, num_slots=batch, backend=backend)
    family = "+".join(sorted({a.family for a in _adapters(model)}))
    vars_ = [v for v in variants(designs, lp_formats)
             if only is None or (v["design"], v["read_format"]) in only or v["design"] == "replay-fp32"]
    bad_k = sorted({a.K for a in _adapters(model) if a.K % 16})
    if bad_k:
        drop = [v for v in vars_ if "nvfp4" in (v["read_format"], v["hp_format"])]
        vars_ = [v for v in vars_ if v not in drop]
        if drop and skipped is not None:
            skipped.append(dict(model=name, format="nvfp4", variants=len(drop),
                                why=f"key head dim {bad_k[0]} is not a multiple of 16"))
    if static is not None:
        rows = _side_by_side(name, model, static, ids, vars_, family=family, prefill=prefill, window=window,
                             dtype=dtype, seed=seed, backend=backend, time_budget=time_budget,
                             progress=progress, overrides=overrides, graphs=graphs)
        hf.disable(model)
        return rows
    vocab = model.config.vocab_size
    started = time.perf_counter()
    share = time_budget / (len(vars_) + 1) if time_budget else 0.0

    ref = torch.empty(tokens, batch, vocab, dtype=torch.float32, device=device)
    n = 0
    pass_ = forced.DynamicPass(model, ids, prefill)
    for logits in pass_.steps(tokens):
        ref[n] = logits
        n += 1
        if n == 1:
            # the budget is for steady steps: the first one compiles kernels
            _sync(device)
            started = time.perf_counter()
        if share and n % 16 == 0:
            _sync(device)
            if time.perf_counter() - started > share:
                break       # out of time: every design runs the steps the reference reached
    tokens, ref = n, ref[:n]
    if progress:
        progress(f"{name}: reference (fp32 replay) {tokens} steps, {time.perf_counter() - started:.0f} s")

    rows = []
    for var in vars_:
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hf.enable(model, num_slots=batch, backend=backend, seed=seed, **enable_options(var, window))
        pool = next(iter(hf.replay_state(model).layers.values())).pool
        got = torch.empty_like(ref)
        pass_ = forced.DynamicPass(model, ids, prefill)
        for t, logits in enumerate(pass_.steps(tokens)):
            got[t] = logits             # one copy a step: the comparison runs after the pass
        kl, agree = _compare(ref, got)
        del got
        _sync(device)
        extra = dict(model=name, family=family, prefill=prefill, batch=batch, window=window,
                     dtype=str(dtype).replace("torch.", ""), backend=getattr(pool, "backend", None),
                     fallback=" / ".join(str(w.message) for w in caught) or None,
                     seconds=round(time.perf_counter() - t0, 2), timing=pass_.timing)
        rows += _rows(var, kl.cpu(), agree.cpu(), extra)
        if progress:
            last = rows[-1]["kl"]
            progress(f"{name}: {var['design']:18} read {var['read_format']:8} hp {var['hp_format']:8} "
                     f"{var['rounding']:10} KL {last if last is None else f'{last:.2e}'}, "
                     f"{time.perf_counter() - t0:.1f} s")
    hf.disable(model)
    del model, ref
    gc.collect()
    return rows


class _Tally:
    """Per step, each design's `KL(ref || design)` and argmax agreement with the reference
    (copy 0 of `outs`), averaged over the rows, written at a step counter on the device: no
    host sync, so it runs inside a replayed graph."""

    def __init__(self, tokens: int, designs: int, device):
        self.kl = torch.full((tokens, designs), math.nan, dtype=torch.float64, device=device)
        self.agree = torch.zeros(tokens, designs, dtype=torch.float64, device=device)
        self.n = torch.zeros(1, dtype=torch.long, device=device)

    def __call__(self, outs: torch.Tensor) -> None:
        ref, got = outs[:1], outs[1:]
        self.kl.index_copy_(0, self.n, kl_div(ref, got).mean(-1)[None])
        self.agree.index_copy_(0, self.n, (got.argmax(-1) == ref.argmax(-1)).double().mean(-1)[None])
        self.n.add_(1)


def _side_by_side(name, model, static, ids, vars_, *, family, prefill, window, dtype, seed, backend,
                  time_budget, progress, overrides, graphs) -> list:
    """The study of a static-cache model in one pass (`forced.Lockstep`): a copy of the model per
    variant beside the reference (`model`, enabled), each copy prefilled and enabled with its
    design, every step compared on the device. The time budget ends the pass for all."""
    from ..integrations import hf

    device, batch = ids.device, ids.shape[0]
    tokens = ids.shape[1] - prefill
    passes, extras = [static], []
    for var in vars_:
        copy = hf.build(MODELS.get(name, name), dtype=dtype, seed=seed, device=device, **(overrides or {}))
        p = forced.StaticPass(copy, ids, prefill, graphs=graphs)
        p.prefill_cache()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hf.enable(copy, num_slots=batch, backend=backend, seed=seed, **enable_options(var, window))
        pool = next(iter(hf.replay_state(copy).layers.values())).pool
        passes.append(p)
        extras.append(dict(backend=getattr(pool, "backend", None),
                           fallback=" / ".join(str(w.message) for w in caught) or None))
    tally = _Tally(tokens, len(vars_), device)
    lock = forced.Lockstep(passes, graphs=graphs)
    t0 = started = time.perf_counter()
    n, report = 0, 1024
    for _ in lock.steps(tokens, after=tally):
        n += 1
        if n == 1:          # the first step compiles kernels (and the second captures the graph)
            _sync(device)
            started = time.perf_counter()
        if (time_budget and n % 16 == 0) or (progress and n == report):
            _sync(device)
            took = time.perf_counter() - started
            if progress and n == report:
                report *= 2
                progress(f"{name}: {n} steps of {len(passes)} copies, {1e3 * took / (n - 1):.2f} ms a step")
            if time_budget and took > time_budget:
                break
    _sync(device)
    seconds = round(time.perf_counter() - t0, 2)
    if progress:
        progress(f"{name}: {n} steps of {len(passes)} copies side by side, {seconds:.0f} s ({lock.timing})")
    kl, agree = tally.kl[:n].cpu(), tally.agree[:n].cpu()
    rows = []
    for i, (var, extra) in enumerate(zip(vars_, extras)):
        extra = dict(model=name, family=family, prefill=prefill, batch=batch, window=window,
                     dtype=str(dtype).replace("torch.", ""), seconds=seconds, timing=lock.timing, **extra)
        rows += _rows(var, kl[:, i], agree[:, i], extra)
        if progress:
            last = rows[-1]["kl"]
            progress(f"{name}: {var['design']:18} read {var['read_format']:8} hp {var['hp_format']:8} "
                     f"{var['rounding']:10} KL {last if last is None else f'{last:.2e}'}")
    for p in passes[1:]:
        hf.disable(p.model)
    return rows


def _compare(ref: torch.Tensor, got: torch.Tensor, chunk: int = 1 << 24):
    """Per step, `KL(ref || got)` and the fraction of rows whose argmax agrees, averaged over the
    rows: `[tokens]` float64 each, from logits `[tokens, B, vocab]`. In chunks of about `chunk`
    elements (float64 temporaries of a 131K vocabulary stay near 128 MB); after the pass, so a
    long pass launches one copy a step rather than a dozen small reductions."""
    n, per = ref.shape[0], max(1, chunk // max(1, ref[0].numel()))
    kl = torch.empty(n, dtype=torch.float64, device=ref.device)
    agree = torch.empty(n, dtype=torch.float64, device=ref.device)
    for lo in range(0, n, per):
        r, g = ref[lo:lo + per], got[lo:lo + per]
        kl[lo:lo + per] = kl_div(r, g).mean(-1)
        agree[lo:lo + per] = (g.argmax(-1) == r.argmax(-1)).double().mean(-1)
    return kl, agree


def _rows(var: dict, kl: torch.Tensor, agree: torch.Tensor, extra: dict) -> list:
    bad = (~torch.isfinite(kl)).nonzero()
    first_bad = int(bad[0]) + 1 if bad.numel() else None          # steps count from 1
    rows, lo = [], 0
    for cp in checkpoints(kl.shape[0]) if kl.shape[0] else []:
        seg = kl[lo:cp]
        rows.append(dict(var, tokens=cp, kl=_finite(seg.mean().item()), kl_at=_finite(kl[cp - 1].item()),
                         top1_agree=agree[lo:cp].mean().item(), first_nonfinite=first_bad, **extra))
        lo = cp
    return rows


def _finite(x: float):
    """JSON has no NaN/inf: a non-finite KL is None (`first_nonfinite` says from where)."""
    return x if math.isfinite(x) else None


def table(rows) -> str:
    """One line per model and variant: `kl` at each decode-step count."""
    cps = sorted({r["tokens"] for r in rows})
    if len(cps) > 9:     # keep a line readable: every other count, always the last
        cps = cps[::-2][::-1]
    head = f"{'model':18} {'design':18} {'read':9} {'hp':9} {'rounding':10} " + \
        " ".join(f"{c:>8}" for c in cps) + f" {'top1':>6} {'non-finite':>10}"
    lines = [head, "-" * len(head)]
    seen = {}
    for r in rows:
        seen.setdefault((r["model"],) + tuple(r[f] for f in _FIELDS), {})[r["tokens"]] = r
    for key, by_t in seen.items():
        last = by_t[max(by_t)]
        cells = " ".join(f"{by_t[c]['kl']:8.1e}" if c in by_t and by_t[c]["kl"] is not None
                         else f"{'-':>8}" for c in cps)
        nf = last["first_nonfinite"]
        lines.append(f"{key[0]:18} {key[1]:18} {key[2]:9} {key[3]:9} {key[4]:10} {cells} "
                     f"{last['top1_agree']:6.3f} {'-' if nf is None else nf:>10}")
    return "\n".join(lines)


def plot(rows, path) -> None:
    """KL against decode steps, log-log: one panel per model and low-precision format (the
    layer study's plot; zeros, the reference's own design, do not show on a log axis)."""
    layer_plot(rows, path, group="model", value="kl", xlabel="decode steps", ylabel="KL(fp32 || design)")


def _override(text: str) -> tuple:
    # KEY=VALUE, the value as JSON where it parses (numbers, true, lists), else the string
    key, sep, val = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(val)
    except json.JSONDecodeError:
        return key.strip(), val


def _pairs(text: str) -> list:
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        d, _, f = item.partition(":")
        if d not in DESIGNS or (d not in ("replay-fp32", "conventional-fp32") and f not in LP_FORMATS):
            raise argparse.ArgumentTypeError(f"expected DESIGN:FORMAT (designs {', '.join(DESIGNS)}; formats "
                                             f"{', '.join(LP_FORMATS)}), got {item!r}")
        out.append((d, f or "fp32"))
    if not out:
        raise argparse.ArgumentTypeError("no variants given")
    return out


def _positive(text: str) -> int:
    try:
        val = int(text)
    except ValueError:
        val = 0
    if val < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return val


def main(argv=None) -> dict:
    from ..integrations import hf

    ap = argparse.ArgumentParser(prog="replayssm study precision-model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=lambda s: [m.strip() for m in s.split(",") if m.strip()],
                    default=list(DEFAULT_MODELS),
                    help=f"comma-separated shipped configs, trained models or {', '.join(MODELS)} (default: "
                         f"{','.join(DEFAULT_MODELS)})")
    ap.add_argument("--tokens", type=_positive, default=256,
                    help="teacher-forced decode steps after the prefill (default %(default)s)")
    ap.add_argument("--prefill", type=_positive, default=64, help="prompt tokens prefilled (default %(default)s)")
    ap.add_argument("--batch", type=_positive, default=1, help="sequences, one per row (default %(default)s)")
    ap.add_argument("--window", type=_positive, default=16, help="replay window L (default %(default)s)")
    ap.add_argument("--designs", type=lambda s: _csv(s, DESIGNS, "design"), default=list(DESIGNS),
                    help="comma-separated designs (default: all of " + ",".join(DESIGNS) + ")")
    ap.add_argument("--formats", type=lambda s: _csv(s, LP_FORMATS, "format"), default=list(LP_FORMATS),
                    help="low-precision formats (default: all of " + ",".join(LP_FORMATS) + ")")
    ap.add_argument("--variants", type=_pairs, default=None, metavar="DESIGN:FORMAT,...",
                    help="only these (design, format) pairs, e.g. separate:nvfp4,shared:fp8_e4m3 (both "
                         "roundings where the design has two; replay-fp32 needs no format); replaces "
                         "--designs and --formats")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES),
                    help="model weights (default %(default)s: the state's rounding is the only difference)")
    ap.add_argument("--backend", default="auto", choices=("auto", "reference", "triton"),
                    help="the pools' backend (default auto: the kernels on CUDA)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda where available)")
    ap.add_argument("--seed", type=int, default=0, help="weights, tokens and rounding streams")
    ap.add_argument("--config", type=_override, action="append", default=[], metavar="KEY=VALUE",
                    help="a config value for every model, repeatable (e.g. time_step_min=0.001)")
    ap.add_argument("--out", default="benchmarks/results/precision_model_study.json",
                    help="JSON results (a .png plot beside it)")
    ap.add_argument("--no-plot", dest="do_plot", action="store_false")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false",
                    help="step eagerly on CUDA too (default: decode steps replayed from a CUDA graph)")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds per model after its first step (0: none): the pass of all designs side by "
                         "side ends at the steps it reached (one pass per design: the reference's gets "
                         "1/(designs + 1) of them and its step count is every design's)")
    ap.add_argument("--merge", nargs="+", metavar="PART", default=None,
                    help="merge the documents of several runs (e.g. one model each, on machines or calls of "
                         "their own) into --out, with table and plot")
    args = ap.parse_args(argv)
    if args.merge:
        return _merge_main(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {device}: CUDA is not available on this machine")
    for m in args.models:
        if m not in MODELS and m not in hf.config_names() and m not in hf.trained_names():
            ap.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}, a shipped config or a trained model "
                     f"({', '.join(hf.trained_names()) or 'none shipped'})")
    only = None
    if args.variants:
        only = set(args.variants)
        args.designs = list(dict.fromkeys(d for d, _ in args.variants))
        args.formats = list(dict.fromkeys(f for _, f in args.variants if f in LP_FORMATS)) or list(LP_FORMATS)
    if args.seed < 0:
        ap.error(f"--seed must be >= 0, got {args.seed}")
    for m in args.models:       # a misspelt key would be kept by the config and change nothing
        known = hf.config(MODELS.get(m, m)).to_dict()
        for key, _ in args.config:
            if key not in known:
                ap.error(f"--config {key}: {m}'s config has no such key")
    doc = header("precision_model_study")
    doc.update(models=args.models, tokens=args.tokens, prefill=args.prefill, batch=args.batch,
               window=args.window, dtype=args.dtype, seed=args.seed, config_overrides=dict(args.config),
               time_budget_s=args.time_budget or None,
               teacher_forcing="random tokens (a trained model: its held-out bytes); stock prefill, then one "
                               "true token per forward call", graphs=args.graphs,
               reference="fp32 replay pools (enable(window=...))", metric="KL(p_fp32 || p_design), nats",
               skipped=[], rows=[])
    for m in args.models:
        with recording_slow_reads(doc):
            doc["rows"] += run(m, tokens=args.tokens, prefill=args.prefill, batch=args.batch, window=args.window,
                               designs=args.designs, lp_formats=args.formats, device=device,
                               dtype=DTYPES[args.dtype], seed=args.seed, backend=args.backend,
                               time_budget=args.time_budget, progress=lambda s: print(s, flush=True),
                               skipped=doc["skipped"], overrides=dict(args.config), graphs=args.graphs,
                               only=only)
        write_results(args.out, doc)      # after every model: a run cut short keeps what it measured
    print(f"\nmean KL(p_fp32 || p_design) over the decode steps up to each count ({args.prefill} prefilled, "
          f"batch {args.batch}, window {args.window}, {args.dtype} weights, {device}):")
    return _finish(doc, args)


def _finish(doc: dict, args) -> dict:
    print(table(doc["rows"]))
    for s in doc["skipped"]:
        print(f"skipped: {s['model']} {s['format']} ({s['variants']} variants): {s['why']}")
    path = write_results(args.out, doc)
    if args.do_plot:
        plot(doc["rows"], Path(path).with_suffix(".png"))
    return doc


_PROVENANCE = ("command", "device", "git_commit", "git_commit_note", "date", "time_budget_s")


def merge(docs: list) -> dict:
    """One document from the documents of several runs of the same settings (each some of the
    models, or a share of the variants): their rows and skips in order, the first one's header, and
    `parts` saying what each ran, how many decode steps its reference reached (a part cut by its
    time budget reaches fewer) and its own provenance (command, device, code, date)."""
    if not docs:
        raise ValueError("nothing to merge")
    keys = ("prefill", "batch", "window", "dtype", "seed", "config_overrides", "graphs")
    for d in docs[1:]:
        diff = [k for k in keys if d.get(k) != docs[0].get(k)]
        if diff:
            raise ValueError(f"the parts differ in {', '.join(diff)}: not one study")
    out = dict(docs[0], rows=[], skipped=[], parts=[])
    out["models"] = list(dict.fromkeys(m for d in docs for m in d["models"]))
    out["slow_read_warnings"] = list(dict.fromkeys(w for d in docs for w in d.get("slow_read_warnings", [])))
    for d in docs:
        out["rows"] += d["rows"]
        out["skipped"] += [s for s in d["skipped"] if s not in out["skipped"]]
        out["parts"].append(dict(models=d["models"], variants=sorted({tuple(r[f] for f in _FIELDS) for r in d["rows"]}),
                                 steps=max((r["tokens"] for r in d["rows"]), default=0),
                                 **{k: d[k] for k in _PROVENANCE if d.get(k) is not None}))
    if len({p.get("git_commit") for p in out["parts"]}) > 1:
        out["git_commit_note"] = "the parts ran different code: each part's git_commit"
    return out


def _merge_main(args) -> dict:
    docs = []
    for p in args.merge:
        try:
            docs.append(json.loads(Path(p).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"--merge: cannot read {p}: {e}")
    doc = merge(docs)
    print(f"mean KL(p_fp32 || p_design) over the decode steps up to each count ({doc['prefill']} prefilled, "
          f"batch {doc['batch']}, window {doc['window']}, {doc['dtype']} weights; {len(docs)} parts side by side):")
    return _finish(doc, args)


if __name__ == "__main__":
    main()
