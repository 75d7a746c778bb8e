"""Whole-model decode benchmark: a transformers hybrid model's decode step with the integration's
conventional scheme (the project's tuned conventional kernels on a full fp32 state per
sequence and layer) against ReplaySSM (`hf.enable`), same model, same prefilled cache, same run.

Per (model, context, batch): random bf16 weights from the shipped config (`hf.build`), one
stock prefill of `context` random tokens per row into a transformers `StaticCache` (in chunks
of at most `--prefill-tokens` tokens, logits of the last position only), then for each scheme
the recurrent layers are enabled on that cache (`hf.attach_cache`) and one decode step (batch
rows, one token each, the attention layers reading `context` cached positions) is captured in
a CUDA graph and replayed; the row's `us_per_step` is the median replay. A step that cannot be
captured is timed eagerly with CUDA events instead, and its row says so (`timing`). The step
writes its key/value at the same position every replay and advances the recurrent state, so
the replay scheme's flushes fall as in decoding (every `window` steps).

`ratio_vs_conventional` is the conventional step's time over the scheme's (above 1: faster).
`first_token_agreement` is the fraction of rows whose first decoded token equals the
conventional scheme's (bf16 model, fp32 states: both schemes should agree on nearly all rows).
The `no-recurrence` scheme (`--schemes ...,no-recurrence`) skips the recurrent layers' state
step: its time is the model's time outside the recurrence, and conventional / its time is the
most any scheme of the recurrent state can gain in this model. The `replay-fp16`,
`replay-bf16`, `replay-fp8` and `replay-nvfp4` schemes are ReplaySSM with separate precisions
(`hf.enable(lp_format=...)`, the rows' `lp_format`): the non-flush steps read a low-precision
copy of the checkpoint, the flushes the fp32 one, which carries the recurrence; their outputs
carry the copy's rounding, which `first_token_agreement` shows. `--spec-schemes` adds them to
the speculative rows (verification on `ops.<family>.lowp_verify`), and `no-recurrence` there
the round with the recurrent layers' verify and commit skipped (its `ratio_vs_snapshot` the
most any scheme can gain over the snapshot scheme).
Points whose key/value cache would not fit are skipped with the reason in the row. A prefill
forward that runs out of memory (transformers' torch scans grow with batch x tokens^2) is
retried with half the tokens, from a fresh cache; a point whose prefill does not fit at one
token a forward is skipped with its reason too (rows: `prefill_tokens_per_forward`).
The attention layers run `hf.use_gqa_attention` (`--attention gqa`, every scheme alike): each
key/value head is read once per step, where transformers' own SDPA path (`--attention sdpa`)
writes a copy of the cache per query head and step, which at batch 256 takes most of the step.

Speculative rows (`speculative_rows`, batches `--spec-batches`): one round of speculative
generation's target work, the verification forward of `T` tokens per row (`--drafts`: the last
token and `T - 1` drafts, as `speculative_generate` feeds them) through the whole model and the
commit of `accepted` tokens per row (`--accepted`, a fixed acceptance: the tokens a round keeps,
the same every round; drafting itself is left out, as prompt lookup costs no GPU time), for the
ReplaySSM scheme and the snapshot scheme serving engines use (`enable(scheme="snapshot")`:
`T + 1` full states per sequence and layer), captured in a CUDA graph of one round that moves
its cache positions and recurrent cursors on like generation. `tokens_per_s` is
`batch * accepted` over the round's time; `ratio_vs_snapshot` the replay scheme's tokens per
second over the snapshot scheme's; `verify_agreement` the fraction of the round's argmax tokens
(every row and position) equal to the snapshot scheme's.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import time

import torch

from .common import graph_time_us, header, positive_ints, write_results
# prefill and PREFILL_OOM are part of this module's interface (tests, callers)
from .model_cache import (PREFILL_OOM, _free, _no_room, _prefill_or_none, kv_bytes, prefill,  # noqa: F401
                          rewind, step_budget)

MODELS = {"nemotron3-nano-4b": "nemotron3_nano_4b", "qwen3.5-4b": "qwen3_5_4b"}
# the separate-precision design (SPEC section 5): non-flush steps read a low-precision copy of the
# checkpoint, flushes carry the fp32 one; the outputs differ from fp32 reads by the copy's rounding
LP_SCHEMES = {"replay-fp16": "fp16", "replay-bf16": "bf16", "replay-fp8": "fp8_e4m3", "replay-nvfp4": "nvfp4"}
SCHEMES = ("conventional", "replay", *LP_SCHEMES, "stock", "no-recurrence")
SPEC_SCHEMES = ("snapshot", "replay", *LP_SCHEMES, "no-recurrence")
ATTENTION = ("gqa", "sdpa")


def _pool_scheme(scheme: str) -> str:
    """The `hf.enable` scheme a benchmark scheme runs on: the low-precision reads and the
    no-recurrence floor are the replay scheme's pools (with `LP_SCHEMES[scheme]`, or skipped)."""
    return "replay" if scheme in LP_SCHEMES or scheme == "no-recurrence" else scheme


def build(name: str, *, dtype=torch.bfloat16, device="cuda", attention: str = "gqa", **overrides):
    """The random-weight model of `name` (a key of MODELS or a shipped config) with its attention
    layers on `attention`: "gqa" (`hf.use_gqa_attention`: each key/value head read once, as a
    serving engine's attention does) or "sdpa" (transformers' path, which copies the key/value
    cache per query head and step: most of the step at batch 256, the same for every scheme)."""
    from ..integrations import hf
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    model = hf.build(MODELS.get(name, name), dtype=dtype, device=device, **overrides)
    if attention == "gqa":
        hf.use_gqa_attention(model)
    return model


def eager_time_us(fn, reps: int = 20, warmup: int = 2) -> float:
    """Median time of `fn()` in microseconds, launched eagerly (CUDA events on the GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = torch.cuda.is_available()
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return times[len(times) // 2]


@contextlib.contextmanager
def _capturable_masks():
    """transformers 5.17's SDPA mask asks whether the causal mask may be skipped; for a
    multi-token forward it compares the static cache's length (a device tensor) on the host,
    which a CUDA graph cannot capture. While a graph of such a forward is captured the mask is
    built, as the stock test decides for any cache that holds tokens. One-token forwards keep
    the stock answer (no mask: SDPA's grouped-query kernel instead of the masked one)."""
    from transformers import masking_utils as mu
    original = mu._ignore_causal_mask_sdpa

    def no_host_read(padding_mask, q_length, *args, **kwargs):
        if q_length != 1 and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return False
        return original(padding_mask, q_length, *args, **kwargs)
    mu._ignore_causal_mask_sdpa = no_host_read
    try:
        yield
    finally:
        mu._ignore_causal_mask_sdpa = original


def _skip_recurrence(state, batch: int, device, T: int = 1) -> None:
    """The `no-recurrence` scheme: every recurrent layer's state step (decode; verify of up to
    `T` tokens and its commit) replaced by zero outputs (no state read or written), the rest of
    the model as in the other schemes. Its step time is what the model spends outside the
    recurrence: conventional / it bounds any scheme's ratio (wrong tokens by design; only its
    time is reported)."""
    for layer in state.layers.values():
        pool = layer.pool
        zeros = torch.zeros(batch, T, pool.HV, pool.V, dtype=pool.dtype, device=device)
        pool.decode = lambda slot_ids, *, out=None, validate=True, _z=zeros, **inputs: _z[:slot_ids.shape[0], 0]
        pool.verify = (lambda slot_ids, *, num_drafts=None, out=None, validate=True, _z=zeros, **inputs:
                       _z[:slot_ids.shape[0], :next(iter(inputs.values())).shape[1]])
        pool.commit = lambda slot_ids, accepted, *, validate=True: None


def _time_step(step, reps: int, graphs: bool):
    """(us, timing): the captured step, or eager with the reason when capture fails."""
    if graphs and torch.cuda.is_available():
        try:
            with _capturable_masks():
                return graph_time_us(step, reps=reps, warmup=2), "cuda_graph"
        except Exception as e:             # noqa: BLE001 - any capture failure falls back, said in the row
            torch.cuda.synchronize()
            import traceback
            where = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in traceback.extract_tb(e.__traceback__)]
            print(f"graph capture failed ({type(e).__name__}), timing eagerly; innermost frames: {where[-6:]}")
            why = f"eager: graph capture failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
            return eager_time_us(step, reps=reps), why
    return eager_time_us(step, reps=reps), "eager" + ("" if graphs else ": --no-graphs")


@torch.no_grad()
def measure(name: str, batches, contexts, schemes=("conventional", "replay"), *, dtype=torch.bfloat16,
            device="cuda", window: int = 16, record_dtype=torch.bfloat16, reps: int = 20, graphs: bool = True,
            prefill_tokens: int = 131072, kv_budget: float = 0.6, model=None, real: int = 0,
            attention: str = "gqa", **overrides) -> list:
    """Rows of one model (a key of MODELS or a shipped config name) over contexts x batches."""
    from ..integrations import hf
    label = name
    if model is None:
        model = build(name, dtype=dtype, device=device, attention=attention, **overrides)
    rows = []
    for context, batch in itertools.product(contexts, batches):
        base = {"model": label, "batch": batch, "context": context, "dtype": str(dtype).replace("torch.", ""),
                "window": window, "record_dtype": str(record_dtype).replace("torch.", "")}
        need = kv_bytes(model, batch, context + step_budget(reps))
        why = _no_room(need, device, kv_budget)
        if why:
            rows += [dict(base, scheme=s, us_per_step=None, ratio_vs_conventional=None, timing=why)
                     for s in schemes]
            continue
        hf.disable(model)
        cache, first = _prefill_or_none(model, batch, context, prefill_tokens, step_budget(reps), real)
        if cache is None:
            rows += [dict(base, scheme=s, us_per_step=None, ratio_vs_conventional=None, timing=PREFILL_OOM)
                     for s in schemes]
            continue
        base["prefill_tokens_per_forward"] = cache._replayssm_prefill_tokens
        pos = torch.tensor([context], device=first.device)
        got = {}
        for scheme in schemes:
            rewind(cache, context)
            pos.fill_(context)
            if scheme == "stock":
                hf.disable(model)
            else:
                try:
                    hf.enable(model, scheme=_pool_scheme(scheme), window=window,
                              max_draft=1, num_slots=batch, lp_format=LP_SCHEMES.get(scheme),
                              record_dtype=record_dtype if scheme != "conventional" else None)
                except torch.OutOfMemoryError:
                    # a low-precision copy beside the fp32 checkpoint may not fit beside the cache
                    hf.disable(model)
                    _free()
                    rows.append(dict(base, scheme=scheme, us_per_step=None, lp_format=LP_SCHEMES.get(scheme),
                                     timing=f"skipped: the {scheme} scheme's state for {batch} sequences "
                                            "does not fit beside the weights and key/value cache"))
                    continue
                hf.attach_cache(model, cache)
                if scheme == "no-recurrence":
                    _skip_recurrence(hf.replay_state(model), batch, first.device)

            def step():
                logits = model(input_ids=first, past_key_values=cache, cache_position=pos, use_cache=True,
                               logits_to_keep=1).logits
                pos.add_(1)           # on the device: a replayed graph moves on like decoding
                return logits

            try:
                got[scheme] = step()[:, -1].argmax(-1)          # one eager step first: the tokens
                us, timing = _time_step(step, reps, graphs)
            except torch.OutOfMemoryError:
                # with attention="sdpa" transformers copies the key/value cache per step
                # (repeat_kv): more than the cache itself, which the room check counts
                us, timing = None, "skipped: out of memory in the step"
            rows.append(dict(base, scheme=scheme, us_per_step=us, timing=timing, lp_format=LP_SCHEMES.get(scheme),
                             tokens_per_s=batch / us * 1e6 if us else None, kv_bytes=need))
            hf.disable(model)
            _free()
        conv = next((r for r in rows[-len(schemes):] if r["scheme"] == "conventional" and r["us_per_step"]), None)
        for r in rows[-len(schemes):]:
            r["ratio_vs_conventional"] = conv["us_per_step"] / r["us_per_step"] if conv and r["us_per_step"] else None
            if "conventional" in got and r["scheme"] in got and r["scheme"] != "no-recurrence":
                r["first_token_agreement"] = float((got[r["scheme"]] == got["conventional"]).float().mean())
        cache = None                       # the next point's prefill needs the memory
        _free()
    return rows


@torch.no_grad()
def measure_speculative(name: str, batches, contexts, *, T: int = 4, accepted: int = 3, dtype=torch.bfloat16,
                        device="cuda", window: int = 16, record_dtype=torch.bfloat16, reps: int = 20,
                        graphs: bool = True, prefill_tokens: int = 131072, kv_budget: float = 0.6, model=None,
                        real: int = 0, attention: str = "gqa", schemes=("snapshot", "replay"), **overrides) -> list:
    """Speculative rows of one model: a verification round (`T` tokens per row, `accepted`
    kept) of the snapshot scheme and `schemes`' others (replay, replay-FMT), from the same
    prefilled cache."""
    from ..integrations import hf
    if not 1 <= accepted <= T:
        raise ValueError(f"accepted must lie in 1..T={T}, got {accepted}")
    schemes = tuple(schemes)
    if schemes[:1] != ("snapshot",) or not set(schemes[1:]) <= set(SPEC_SCHEMES[1:]):
        raise ValueError(f"speculative schemes: snapshot first (the ratios' base), then of "
                         f"{', '.join(SPEC_SCHEMES[1:])}; got {schemes}")
    if model is None:
        model = build(name, dtype=dtype, device=device, attention=attention, **overrides)
    steps = step_budget(reps) * accepted + T
    rows = []
    for context, batch in itertools.product(contexts, batches):
        base = {"model": name, "batch": batch, "context": context, "T": T, "accepted": accepted,
                "dtype": str(dtype).replace("torch.", ""), "window": window,
                "record_dtype": str(record_dtype).replace("torch.", "")}
        need = kv_bytes(model, batch, context + steps)
        why = _no_room(need, device, kv_budget)
        if why:
            rows += [dict(base, scheme=s, us_per_round=None, tokens_per_s=None, timing=why)
                     for s in schemes]
            continue
        hf.disable(model)
        cache, first = _prefill_or_none(model, batch, context, prefill_tokens, steps, real)
        if cache is None:
            rows += [dict(base, scheme=s, us_per_round=None, tokens_per_s=None, ratio_vs_snapshot=None,
                          timing=PREFILL_OOM) for s in schemes]
            continue
        base["prefill_tokens_per_forward"] = cache._replayssm_prefill_tokens
        tokens = first.expand(batch, T).contiguous()
        pos = torch.arange(context, context + T, device=first.device)
        got = {}
        for scheme in schemes:
            rewind(cache, context)
            pos.copy_(torch.arange(context, context + T, device=pos.device))
            kind = _pool_scheme(scheme)
            try:
                hf.enable(model, scheme=kind, window=window, max_draft=T, num_slots=batch,
                          record_dtype=record_dtype if kind == "replay" else None, lp_format=LP_SCHEMES.get(scheme))
            except torch.OutOfMemoryError:
                # the scheme's recurrent state for `batch` sequences does not fit beside the cache
                hf.disable(model)
                _free()
                rows.append(dict(base, scheme=scheme, us_per_round=None, tokens_per_s=None,
                                 timing=f"skipped: the {scheme} scheme's state for {batch} sequences "
                                        "does not fit beside the weights and key/value cache"))
                continue
            hf.attach_cache(model, cache)
            state, binding = hf.replay_state(model), cache._replayssm_binding
            if scheme == "no-recurrence":
                _skip_recurrence(state, batch, first.device, T)
            keep = torch.full((batch,), accepted, dtype=torch.int32, device=first.device)

            def round_():
                state.verifying = True
                try:
                    logits = model(input_ids=tokens, past_key_values=cache, cache_position=pos, use_cache=True,
                                   logits_to_keep=T).logits
                finally:
                    state.verifying = False
                state.commit(binding, keep)
                pos.add_(accepted)            # on the device: a replayed graph moves on like generation
                return logits

            try:
                got[scheme] = round_().argmax(-1)
                us, timing = _time_step(round_, reps, graphs)
            except torch.OutOfMemoryError:
                hf.disable(model)
                state = binding = None         # round_ reads these cells: the pools go with them
                _free()
                rows.append(dict(base, scheme=scheme, us_per_round=None, tokens_per_s=None,
                                 timing="skipped: out of memory in the round"))
                continue
            rows.append(dict(base, scheme=scheme, us_per_round=us, timing=timing, lp_format=LP_SCHEMES.get(scheme),
                             tokens_per_s=batch * accepted / us * 1e6,
                             # the recurrent layers' state per sequence, all layers
                             bytes_per_sequence=None if scheme == "no-recurrence" else sum(
                                 layer.pool.memory_per_sequence()[kind] for layer in state.layers.values()),
                             verify_agreement=(float((got[scheme] == got["snapshot"]).float().mean())
                                               if "snapshot" in got and scheme != "no-recurrence" else None)))
            hf.disable(model)
            # the next scheme's pools need this one's memory: `state` (and `round_`, which reads
            # it) would hold the pools through the next `enable`, and the snapshot scheme's
            # T + 1 states then left no room for the replay pools at batch 256
            state = binding = None
            _free()
        snap = rows[-len(schemes)]
        for r in rows[-len(schemes):]:
            r["ratio_vs_snapshot"] = (r["tokens_per_s"] / snap["tokens_per_s"]
                                      if r["tokens_per_s"] and snap["tokens_per_s"] else None)
        cache = None
        _free()
    return rows


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["model"], r["context"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(3.4 * len(keys), 3.4), squeeze=False)
    for ax, (model, context) in zip(axes[0], keys):
        for scheme in sorted({r["scheme"] for r in rows} - {"conventional"}):
            pts = sorted((r["batch"], r["ratio_vs_conventional"]) for r in rows
                         if (r["model"], r["context"], r["scheme"]) == (model, context, scheme)
                         and r["ratio_vs_conventional"] is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", ms=3, label=scheme)
        ax.axhline(1.0, color="gray", lw=0.6)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model}, context {context}", fontsize=8)
        ax.set_xlabel("batch")
    axes[0][0].set_ylabel("conventional step / scheme's step")
    axes[0][-1].legend(fontsize=6)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    fig.suptitle(f"Whole-model decode step ({dev})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _batches(text: str) -> list:
    """argparse type: comma-separated positive batch sizes, or 0 for none."""
    return [] if text.strip() == "0" else positive_ints(text)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="replayssm bench model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS),
                    help="comma-separated: %(default)s, or any shipped config (hf.config_names())")
    ap.add_argument("--batches", type=_batches, default=[1, 64, 256], help="batches of the decode rows (0: none)")
    ap.add_argument("--contexts", type=positive_ints, default=[2048, 16384], help="prefilled positions per row")
    ap.add_argument("--schemes", default="conventional,replay",
                    help=f"comma-separated, of {','.join(SCHEMES)} (stock: transformers' own decode path; "
                         "no-recurrence: the recurrent layers' state step skipped, the time spent outside it; "
                         "replay-FMT: non-flush steps read an FMT copy of the fp32 checkpoint)")
    ap.add_argument("--attention", default="gqa", choices=ATTENTION,
                    help="the attention layers' path, the same for every scheme (see build())")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--record-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--prefill-tokens", type=int, default=131072, help="most tokens per prefill forward")
    ap.add_argument("--real-prefill", type=int, default=0,
                    help="prefill only this many positions through the model, the rest of the context "
                         "with random keys/values (0: all; see prefill())")
    ap.add_argument("--no-graphs", action="store_true", help="time the steps eagerly (CUDA events)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the weights' dtype")
    ap.add_argument("--device", default="cuda", help="cuda (cpu: the bookkeeping only, timed on the host)")
    ap.add_argument("--spec-batches", type=_batches, default=[64, 256, 512],
                    help="batches of the speculative rows (0: none)")
    ap.add_argument("--spec-contexts", type=positive_ints, default=None,
                    help="prefilled positions of the speculative rows (default: --contexts); the "
                         "snapshot scheme's T + 1 states fit beside a smaller cache")
    ap.add_argument("--drafts", type=int, default=4, help="T: tokens per verification round")
    ap.add_argument("--spec-schemes", default="snapshot,replay",
                    help=f"the speculative rows' schemes: snapshot (the ratios' base, always run) and of "
                         f"{','.join(SPEC_SCHEMES[1:])}")
    ap.add_argument("--accepted", type=int, default=3, help="tokens a round keeps (1..T), every round")
    ap.add_argument("--out", default="model.json", help="the JSON results file (a plot beside it)")
    args = ap.parse_args(argv)
    from ..integrations import hf
    models, schemes = args.models.split(","), args.schemes.split(",")
    for m in models:
        if m not in MODELS and m not in hf.config_names():
            ap.error(f"unknown model {m!r}; choose from {', '.join(MODELS)} or a shipped config")
    for s in schemes:
        if s not in SCHEMES:
            ap.error(f"unknown scheme {s!r}; choose from {', '.join(SCHEMES)}")
    spec_schemes = ["snapshot"] + [s for s in SPEC_SCHEMES[1:] if s in args.spec_schemes.split(",")]
    for s in set(args.spec_schemes.split(",")) - set(spec_schemes):
        ap.error(f"unknown speculative scheme {s!r}; choose from {', '.join(SPEC_SCHEMES)}")
    # stock decoding advances the cache's own recurrent states, which the other schemes start from
    schemes = sorted(set(schemes), key=SCHEMES.index)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"{ap.prog}: error: the model benchmark needs a CUDA device "
                         "(torch.cuda.is_available() is False on this machine)")
    import transformers
    transformers.logging.set_verbosity_error()
    doc = header("model")
    spec_batches = args.spec_batches
    if not args.batches and not spec_batches:
        ap.error("--batches 0 and --spec-batches 0 leave nothing to measure")
    if not 1 <= args.accepted <= args.drafts:
        ap.error(f"--accepted must lie in 1..--drafts ({args.drafts}), got {args.accepted}")
    doc.update(attention=args.attention, window=args.window, record_dtype=args.record_dtype, dtype=args.dtype,
               prefill=("whole context through the model" if args.real_prefill == 0 else
                        f"{args.real_prefill} positions through the model, the rest random keys/values"),
               transformers=transformers.__version__,
               speculative=(f"T = {args.drafts} tokens per round, {args.accepted} kept per row every round "
                            "(fixed acceptance; drafting not timed)") if spec_batches else "not measured")
    doc["speculative_rows"] = []
    rows = []
    for m in models:
        # one model for the decode and the speculative points (two would not fit beside the caches)
        model = build(m, dtype=getattr(torch, args.dtype), device=args.device, attention=args.attention)
        if args.batches:
            rows += measure(m, args.batches, args.contexts, schemes, window=args.window, reps=args.reps,
                            dtype=getattr(torch, args.dtype), device=args.device,
                            record_dtype=getattr(torch, args.record_dtype), graphs=not args.no_graphs,
                            prefill_tokens=args.prefill_tokens, real=args.real_prefill, model=model)
        doc["rows"] = rows
        write_results(args.out, doc)      # after every model: a run cut short keeps what it measured
        if spec_batches:
            doc["speculative_rows"] += measure_speculative(
                m, spec_batches, args.spec_contexts or args.contexts, T=args.drafts, accepted=args.accepted,
                window=args.window, reps=args.reps, dtype=getattr(torch, args.dtype), device=args.device,
                record_dtype=getattr(torch, args.record_dtype), graphs=not args.no_graphs,
                prefill_tokens=args.prefill_tokens, real=args.real_prefill, model=model, schemes=spec_schemes)
            write_results(args.out, doc)
        model = None
        _free()
    path = write_results(args.out, doc)
    try:
        if rows:                           # the plot is of the decode rows
            _plot(rows, path.with_suffix(".png"))
    except Exception as e:  # plotting is a convenience; the JSON is the result
        print("plot failed:", e)
    if rows:
        print(f"\nwhole-model decode step, {args.dtype} weights, window {args.window}")
        print("model               context batch scheme        us/step   ratio  agree  timing")
    for r in rows:
        us = "-" if r["us_per_step"] is None else f"{r['us_per_step']:9.1f}"
        ratio = "-" if r["ratio_vs_conventional"] is None else f"{r['ratio_vs_conventional']:5.2f}x"
        agree = f"{r['first_token_agreement']:.2f}" if r.get("first_token_agreement") is not None else "-"
        print(f"{r['model']:19} {r['context']:7d} {r['batch']:5d} {r['scheme']:12} {us:>9} {ratio:>7} {agree:>6}  "
              f"{r['timing']}")
    if doc["speculative_rows"]:
        print(f"\nspeculative rounds: {doc['speculative']}")
        print("model               context batch scheme        us/round   tokens/s  vs snapshot  agree  timing")
        for r in doc["speculative_rows"]:
            if r["us_per_round"] is None:
                print(f"{r['model']:19} {r['context']:7d} {r['batch']:5d} {r['scheme']:12} {r['timing']}")
                continue
            ratio = "-" if r["ratio_vs_snapshot"] is None else f"{r['ratio_vs_snapshot']:.2f}x"
            agree = "-" if r["verify_agreement"] is None else f"{r['verify_agreement']:.2f}"
            print(f"{r['model']:19} {r['context']:7d} {r['batch']:5d} {r['scheme']:12} {r['us_per_round']:9.1f} "
                  f"{r['tokens_per_s']:10.0f} {ratio:>12} {agree:>6}  {r['timing']}")
    return doc


if __name__ == "__main__":
    main()
