"""Serving benchmark: decode throughput of stock vLLM against vLLM with the replayssm plugin.

A random-weight model (vLLM's `load_format="dummy"`) at a real layer shape: the shipped
transformers config of Nemotron-3-Nano-4B (`--model nemotron3_nano_4b`; NemotronH, 21 Mamba-2
layers) or of Qwen3.5-4B (`--model qwen3_5_4b`: 24 GDN layers, served as vLLM serves Qwen3.5,
`Qwen3_5ForConditionalGeneration` with `language_model_only`, its vision tower a one-layer
stand-in that is never built; GDN prefill on Triton), or a 120B-class slice at its full model's
widths (`--model nemotron3_super_slice`: 11 of Nemotron-3-Super's 88 layers, all 512 experts;
`--model qwen3_5_122b_slice`: 8 of Qwen3.5-122B-A10B's 48, all 256 experts, served as
`Qwen3_5MoeForConditionalGeneration`; `slices.py` says what was cut, and `--composition` prints
a decode step's composition beside the full model's without vLLM), optionally cut to its first
`--layers` layers. No tokenizer
(`skip_tokenizer_init`): prompts are token ids. Each (scheme, speculation) pair runs in its own
process, since the plugin registers when vLLM starts (`REPLAYSSM_VLLM=1` for `replayssm`, 0
for `stock`); within it every batch size is timed on the same engine.

Schemes (`--schemes`): `stock` (vLLM's defaults: for NemotronH vLLM 0.25 resolves the SSM
state's `auto` dtype to float32, the model config's `mamba_ssm_cache_dtype` where it names
one; the rows' `ssm_cache_dtype` says what the engine used), `stock-fp32` (stock with
`mamba_ssm_cache_dtype="float32"` asked for, the state precision of the plugin's checkpoint)
`replayssm` (the plugin, `REPLAYSSM_VLLM=1`, with vLLM's `1 + drafts` state blocks per
request under speculation, `REPLAYSSM_VLLM_SPEC_BLOCKS=vllm`) and `replayssm-one-block` (the
plugin's default, one block, `REPLAYSSM_VLLM_SPEC_BLOCKS=one`; without drafts the two are
the same), `replayssm-side` (one block, and under `--prefix-caching` the records outside vLLM's
pages, `REPLAYSSM_VLLM_PREFIX_RECORDS=side`, so that its cache blocks are stock's). `--profile DIR`
has vLLM's torch profiler record iterations 8-23 of the first batch's decode per engine (its
CUDA-time tables and traces under `DIR/<scheme>_<speculative>`); those rows carry
`profiled: true`, their timings perturbed by the profiler, and `trace`: the GPU's busy time
per step, the idle share and the kernels by time (`trace.py`).

CUDA graphs (`--capture`): by default captured at the timed batches and, with drafts, at
their verify steps' token counts (`capture_sizes`), in every scheme alike; `default` keeps
vLLM's list, which stops at 512 tokens (the first committed n-gram rows ran so: eager).

Per batch `B`: `B` prompts of `--prompt` tokens; an untimed `generate` of `--warmup` tokens
each (kernels compile in an engine's first decode steps); one `generate` with `max_tokens=1` (the
prefill and first token) and one with `1 + --decode` tokens, both with `ignore_eos`; the
decode throughput is `B * decode / (t_long - t_short)` (`tokens_per_s`), `ratio_vs_stock`
the plugin's over stock's at the same batch and speculation. `--speculative ngram` adds n-gram
drafting (`--drafts` tokens, prompt lookup 1..3) to both schemes, `ngram_gpu` the same lookup
on the GPU, `mtp` NemotronH's multi-token-prediction drafter (`SPECULATIVE`: with dummy
weights its drafts are mostly rejected, so it times verification at a low acceptance with
vLLM's asynchronous scheduling on); the n-gram prompts repeat a short
pattern so that lookups find drafts, and the rows carry vLLM's draft acceptance where its
metrics report it. JSON rows: `model`, `batch`, `scheme`, `speculative`, `tokens_per_s`,
`ratio_vs_stock`, `ratio_vs_stock_fp32` (when that scheme ran), `max_concurrency` (the requests
vLLM's cache holds at once, from its start-up log), `state_mode` (the plugin's executors:
"strided" on vLLM's pages, "staged" through scratch rows), plus the timings.

    python -m replayssm.bench.vllm_serving --batches 64,256,512 --out benchmarks/results/vllm_h200.json

The plot (tokens per second against batch, a panel per speculation) is written beside the
JSON; `--replot FILE.json` draws it again from a results file, without vLLM or a GPU.

Prefix caching (`--prefix-caching`): every engine with `enable_prefix_caching` in vLLM's
`align` mode (the one the plugin supports; stock in the same mode, so that the two differ in
the state they keep only), plain decoding. `--shared-prefix N[,N...]` puts the same `N` tokens
before every prompt's own `--prompt` tokens (a row per length; each length its own prefix); the
untimed warm-up prompts share that prefix and differ after it, so with caching on the timed
`max_tokens=1` run (`prefill_s`, the batch's time to first token) reads the prefix from the
cache and prefills the rest. With caching on, the decode run takes a third set of prompts behind
the same prefix, so that its prefill finds the cache as the timed first-token run found it (the
same prompts would find that run's own blocks) and the two prefills cancel in `tokens_per_s`.
The rows carry vLLM's prefix-cache counters (`prefix_cache_hits_delta`,
`prefix_cache_queries_delta`, in tokens, over both runs) and `block_size`, the tokens per cache
block vLLM chose at start-up (in `align` mode the cache's granularity: vLLM sizes the block so
that its attention page holds one recurrent state, and the plugin's state, records included,
is larger than stock's). `--block-size N` asks every engine for N-token blocks (vLLM raises it
where a state needs more), so that both caches have the same granularity and time to first
token compares the prefill paths alone.

Needs vLLM 0.25.0 and a GPU (the bring-up in ../shared/vllm on the project's GPU machine).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from ..integrations.vllm import _compat
from ..argtypes import positive_int
from .common import positive_ints

MODELS = ("nemotron3_nano_4b", "qwen3_5_4b", "nemotron3_super_slice", "qwen3_5_122b_slice")
SCHEMES = ("stock", "stock-fp32", "replayssm", "replayssm-one-block", "replayssm-side")
# vLLM's n-gram drafter on the host (`ngram`: vLLM then turns its asynchronous scheduling off,
# and the host's drafting and scheduling sit between the GPU's steps) or on the GPU
# (`ngram_gpu`: asynchronous scheduling stays on, as in plain decoding); `mtp`, NemotronH's
# multi-token-prediction drafter (one attention layer of dummy weights, asynchronous
# scheduling on; its drafts are mostly rejected, in both engines alike)
SPECULATIVE = ("none", "ngram", "ngram_gpu", "mtp")
# decode steps vLLM's profiler records (`--profile`), after 8 it skips; `trace.summarise` divides by it
PROFILE_STEPS = 16


def model_dir(name: str, layers: int, out: Path, mtp: bool = False) -> Path:
    """A vLLM model folder (config.json only: weights are vLLM's dummy ones) for the shipped
    config `name`, cut to its first `layers` layers (0: all); with `mtp` (NemotronH) one
    multi-token-prediction layer beside, an attention layer as `check.with_mtp_layer` adds."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    from ..integrations.hf.configs import _DIR
    cfg = {k: v for k, v in json.loads((_DIR / f"{name}.json").read_text()).items() if not k.startswith("_")}
    if name.startswith("nemotron"):
        if layers:
            pattern = cfg["hybrid_override_pattern"][:layers]
            if "M" not in pattern:
                raise ValueError(f"the first {layers} layers of {name} hold no Mamba-2 layer")
            cfg.update(hybrid_override_pattern=pattern, num_hidden_layers=len(pattern))
        cfg.update(architectures=["NemotronHForCausalLM"], torch_dtype="bfloat16")
        if mtp:
            cfg.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*",
                       mtp_layers_block_type=["full_attention"])
    else:
        if mtp:
            raise ValueError(f"{name}: the MTP drafter is NemotronH's (`--speculative mtp`)")
        if layers:
            kinds = cfg["layer_types"][:layers]
            if "linear_attention" not in kinds:
                raise ValueError(f"the first {layers} layers of {name} hold no GDN layer")
            cfg.update(layer_types=kinds, num_hidden_layers=len(kinds))
        cfg = qwen3_5_served(cfg)
    d = out / f"{name}_{layers or 'all'}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


def qwen3_5_served(text: dict) -> dict:
    """The config vLLM serves a Qwen3.5 text config `text` from: the multimodal class around it
    (`Qwen3_5ForConditionalGeneration`, or `Qwen3_5MoeForConditionalGeneration` for the MoE
    text model), with a one-layer vision tower that `language_model_only` leaves unbuilt."""
    if text.get("model_type") == "qwen3_5_moe_text":
        from transformers import Qwen3_5MoeConfig
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"])
        cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision,
                               tie_word_embeddings=text.get("tie_word_embeddings", False))
        cfg.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    else:
        from ..integrations.vllm.check import qwen3_5_config
        cfg = qwen3_5_config(text)
    out = cfg.to_dict()
    out["torch_dtype"] = "bfloat16"
    return out


def _vocab(cfg: dict) -> int:
    """The prompts' token ids stay below this: the vocabulary, or Qwen3.5's first multimodal
    special token (an image token with no image would be refused or misread)."""
    vocab = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]
    special = [v for k, v in cfg.items() if k.endswith("_token_id") and isinstance(v, int) and v > 2]
    return min([vocab] + special)


def prompts(batch: int, length: int, vocab: int, repeat: bool, seed: int = 0) -> list:
    """`batch` prompts of `length` token ids; with `repeat`, each a period-7 pattern (n-gram
    lookup finds continuations in it)."""
    import random
    rng = random.Random(seed)
    out = []
    for _ in range(batch):
        if repeat:
            unit = [rng.randrange(3, vocab) for _ in range(7)]
            ids = (unit * (length // 7 + 1))[:length]
        else:
            ids = [rng.randrange(3, vocab) for _ in range(length)]
        out.append({"prompt_token_ids": ids})
    return out


def with_prefix(ps: list, prefix: int, vocab: int) -> list:
    """`ps` each behind the same `prefix` token ids (`--shared-prefix`); prefixes of different
    lengths differ from their first token, so that one never hits another's cached blocks."""
    import random
    rng = random.Random(1000 + prefix)
    head = [rng.randrange(3, vocab) for _ in range(prefix)]
    return [{"prompt_token_ids": head + p["prompt_token_ids"]} for p in ps]


def capture_sizes(batches, drafts) -> list:
    """CUDA-graph sizes (tokens) for `--capture batches`: each batch, and with `drafts` each
    batch's verify step of `1 + drafts` tokens a row. vLLM's default stops at 512 tokens, which
    leaves speculative steps at batch 256 and 512 (1024, 2048 tokens with 3 drafts) eager in
    both schemes, measuring Python rather than the GPU."""
    return sorted(set(batches) | {b * (1 + (drafts or 0)) for b in batches})


_ACCEPTANCE = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def _acceptance(llm) -> dict:
    """Draft acceptance from vLLM's metrics, where it reports them (empty otherwise)."""
    return _compat.metric_values(llm, lambda name: name in _ACCEPTANCE)


def worker(args) -> int:
    """One engine: prints a `RESULT {json}` line per batch."""
    from vllm import LLM, SamplingParams
    spec = None
    if args.speculative == "mtp":
        spec = {"method": "mtp", "num_speculative_tokens": args.drafts}
    elif args.speculative in SPECULATIVE[1:]:
        spec = {"method": args.speculative, "num_speculative_tokens": args.drafts, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1}
    cfg = json.loads((Path(args.model_dir) / "config.json").read_text())
    extra = {"mamba_ssm_cache_dtype": "float32"} if args.scheme == "stock-fp32" else {}
    if "text_config" in cfg:          # Qwen3.5: the GDN prefill on Triton (FlashInfer's is not in
        extra.update(gdn_prefill_backend="triton", language_model_only=True)   # the offline bring-up)
    if args.capture == "batches":
        extra["compilation_config"] = {"cudagraph_capture_sizes": capture_sizes(args.batches, spec and args.drafts)}
    if args.profile:
        extra["profiler_config"] = dict(
            profiler="torch",
            torch_profiler_dir=os.path.abspath(_profile_dir(args.profile, args.scheme, args.speculative)),
            torch_profiler_with_stack=False, ignore_frontend=True, delay_iterations=8,
            max_iterations=PROFILE_STEPS)
    if args.block_size:
        extra["block_size"] = args.block_size
    if args.prefix_caching:
        extra.update(enable_prefix_caching=True, mamba_cache_mode="align")
    else:
        extra["enable_prefix_caching"] = False
    llm = LLM(model=args.model_dir, load_format="dummy", skip_tokenizer_init=True, seed=0,
              max_num_seqs=max(args.batches),
              max_model_len=max(args.shared_prefix) + args.prompt + max(args.decode, args.warmup) + 8,
              gpu_memory_utilization=args.gpu_memory, speculative_config=spec,
              disable_log_stats=spec is None and not args.prefix_caching, **extra)
    try:    # what vLLM resolved its SSM state dtype to ("auto" becomes float32 for NemotronH in 0.25)
        ssm_dtype = str(llm.llm_engine.vllm_config.cache_config.mamba_ssm_cache_dtype)
    except AttributeError:
        ssm_dtype = None
    points = [(batch, prefix) for batch in args.batches for prefix in args.shared_prefix]
    for i, (batch, prefix) in enumerate(points):
        def prompt_set(seed):
            got = prompts(batch, args.prompt, _vocab(cfg), repeat=spec is not None, seed=seed)
            return with_prefix(got, prefix, _vocab(cfg)) if prefix else got
        ps = prompt_set(0)
        # behind a prefix or with caching on, the warm-up shares the prefix only and the decode
        # run's prompts are new too: both timed runs find only the prefix cached (module docstring)
        fresh = bool(prefix) or args.prefix_caching
        warm_ps = prompt_set(1) if fresh else ps
        full_ps = prompt_set(2) if args.prefix_caching else ps
        short = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
        full = SamplingParams(temperature=0.0, max_tokens=1 + args.decode, ignore_eos=True, detokenize=False)
        # warm-up at this batch with decode steps past a window's flush: the first decode steps
        # of an engine compile kernels (Triton's JIT), which must not land in the timed run
        if args.warmup:
            warm = SamplingParams(temperature=0.0, max_tokens=args.warmup, ignore_eos=True, detokenize=False)
            llm.generate(warm_ps, warm, use_tqdm=False)
        cached = _compat.prefix_cache_counters(llm)
        t0 = time.perf_counter()
        llm.generate(ps, short, use_tqdm=False)
        t1 = time.perf_counter()
        before = _acceptance(llm)
        profiled = bool(args.profile) and i == 0
        if profiled:
            llm.start_profile()
        outs = llm.generate(full_ps, full, use_tqdm=False)
        if profiled:
            llm.stop_profile()
        t2 = time.perf_counter()
        after = _acceptance(llm)
        made = sum(len(o.outputs[0].token_ids) for o in outs) - batch     # past the first token
        row = {"batch": batch, "shared_prefix": prefix, "ssm_cache_dtype": ssm_dtype, "prefill_s": t1 - t0,
               "generate_s": t2 - t1, "decode_tokens": made,
               "tokens_per_s": made / max(t2 - t1 - (t1 - t0), 1e-9), "profiled": profiled}
        row.update({f"{k}_delta": (after[k] - before.get(k, 0)) for k in after if after[k] is not None})
        row.update({f"{k}_delta": (v - cached.get(k, 0))
                    for k, v in _compat.prefix_cache_counters(llm).items() if v is not None})
        print("RESULT " + json.dumps(row), flush=True)
    return 0


# CUDA's limit on a grid's second dimension, which vLLM 0.25's GDN prefill kernel
# (`chunk_gated_delta_rule_fwd_h`, grid (V / BV, sequences x value heads)) meets at start-up,
# when it profiles a batch of `max_num_seqs` sequences: "Triton Error [CUDA]: invalid argument"
# in stock and plugin engines alike (the Qwen3.5-122B slice, 64 heads, at 1024)
GRID_Y_MAX = 65535


def gdn_batch_limit(name: str) -> Optional[int]:
    """The largest batch vLLM 0.25 can start model `name` with (None: no GDN layer)."""
    from ..integrations.hf.configs import _DIR
    heads = json.loads((_DIR / f"{name}.json").read_text()).get("linear_num_value_heads")
    return GRID_Y_MAX // heads if heads else None


def acceptance(row: dict) -> Optional[float]:
    """Accepted draft tokens over draft tokens, from the row's metric deltas (None without)."""
    drafts = row.get("spec_decode_num_draft_tokens_delta")
    return row["spec_decode_num_accepted_tokens_delta"] / drafts if drafts else None


def _ratio(row: dict, base: dict):
    a, b = row.get("tokens_per_s"), base.get("tokens_per_s")
    return a / b if a and b else None


def root_cause(output: str, lines: int = 40) -> str:
    """A failed engine's output from its first traceback or error line on (`lines` of it), else
    its last lines: the engine core's own exception comes before the front end's "Engine core
    initialization failed" (vLLM prefixes each core line with its process, so match anywhere)."""
    got = output.splitlines()
    first = next((i for i, x in enumerate(got) if "Traceback" in x or "Error" in x), None)
    return "\n".join(got[-lines:] if first is None else got[first:first + lines])


def _run_engine(args, scheme: str, speculative: str, folder: Path) -> list:
    plugin = scheme.startswith("replayssm")
    env = dict(os.environ, REPLAYSSM_VLLM="1" if plugin else "0")
    if plugin:
        env["REPLAYSSM_VLLM_SPEC_BLOCKS"] = "vllm" if scheme == "replayssm" else "one"
        env["REPLAYSSM_VLLM_PREFIX_RECORDS"] = "side" if scheme == "replayssm-side" else "page"
    cmd = [sys.executable, "-m", "replayssm.bench.vllm_serving", "--worker", "--scheme", scheme,
           "--capture", args.capture, "--model-dir", str(folder), *(["--profile", args.profile] if args.profile else []),
           "--batches", ",".join(map(str, args.batches)), "--prompt", str(args.prompt), "--decode", str(args.decode),
           "--speculative", speculative, "--drafts", str(args.drafts), "--warmup", str(args.warmup),
           "--gpu-memory", str(args.gpu_memory), "--shared-prefix", ",".join(map(str, args.shared_prefix)),
           *(["--prefix-caching"] if args.prefix_caching else []),
           *(["--block-size", str(args.block_size)] if args.block_size else [])]
    r = _run_worker(cmd, env, args.timeout)
    if r.returncode != 0 and any(m in r.stdout + r.stderr for m in _compat.START_UP_MEMORY_ERRORS):
        # the engine before this one may still hold memory that vLLM's start-up counts as taken
        time.sleep(15)
        r = _run_worker(cmd, env, args.timeout)
    rows = [json.loads(line[len("RESULT "):]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    # how the plugin's layers reached vLLM's blocks (its log lines: "... KernelExecutor (strided)")
    modes = sorted(set(re.findall(r"KernelExecutor \((\w+)\)", r.stdout + r.stderr)))
    # how many requests vLLM's cache holds at once (its start-up log): a batch above it is
    # preempted and recomputed, which the throughput then measures
    conc = re.findall(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x", r.stdout + r.stderr)
    # the tokens per cache block, where vLLM raised it to hold a recurrent state in one page
    block = re.findall(r"Setting attention block size to (\d+) tokens", r.stdout + r.stderr)
    for row in rows:
        row["state_mode"] = ",".join(modes) if plugin else None
        row["max_concurrency"] = float(conc[-1]) if conc else None
        row["block_size"] = int(block[-1]) if block else args.block_size
        if row.get("profiled"):
            row["trace"] = _trace_summary(_profile_dir(args.profile, scheme, speculative))
    if r.returncode != 0 or not rows:
        # vLLM's engine core reports its failure as "see root cause above": keep the whole output
        log = Path(args.out).with_suffix(f".{scheme}_{speculative}.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(r.stdout + "\n--- stderr ---\n" + r.stderr)
        cause = root_cause(r.stdout + r.stderr)
        print(f"{scheme} / {speculative}: engine failed (rc {r.returncode}; whole output: {log}):\n{cause}")
        # the points it measured before it stopped (a timeout) stay; the others carry the error
        done = {(row["batch"], row.get("shared_prefix")): row for row in rows}
        return [done.get((b, p)) or {"batch": b, "shared_prefix": p, "tokens_per_s": None,
                                     "error": f"rc {r.returncode}: {cause[-600:]}"}
                for b in args.batches for p in args.shared_prefix]
    return rows


def _run_worker(cmd: list, env: dict, timeout: int) -> subprocess.CompletedProcess:
    """One engine's worker process; past `timeout` seconds it is killed and what it printed so far
    comes back (rc -9: the rows it finished are kept, `_run_engine`)."""
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        return subprocess.CompletedProcess(cmd, -9, text(e.stdout),
                                           text(e.stderr) + f"\nTimeoutExpired: killed after {timeout} s")


def _profile_dir(profile: str, scheme: str, speculative: str) -> str:
    """Where an engine's profiler traces go under `--profile`."""
    return os.path.join(profile, f"{scheme}_{speculative}")


def _trace_summary(folder: str) -> dict:
    """GPU busy time per step and the kernels by time from an engine's profiler traces
    (`trace.summarise`), printed and returned for the profiled row; a trace that cannot be
    read leaves its reason instead (the timings stand without it)."""
    from . import trace
    try:
        got = trace.summarise(folder, PROFILE_STEPS)
    except (OSError, ValueError) as e:
        return {"error": str(e)}
    print(f"\nprofile {folder}:\n{trace.report(got)}")
    return got


def _non_negative(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def _non_negative_ints(text: str) -> list:
    return [_non_negative(t) for t in text.split(",")]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="replayssm bench vllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODELS[0], choices=MODELS)
    ap.add_argument("--layers", type=int, default=0, help="first layers of the hybrid pattern (0: all)")
    ap.add_argument("--batches", type=positive_ints, default=[64, 256, 512])
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--decode", type=int, default=128, help="decode tokens timed per request")
    ap.add_argument("--speculative", default="none,ngram",
                    help=f"comma-separated of {', '.join(SPECULATIVE)} (runs of each; 'none,ngram': both)")
    ap.add_argument("--drafts", type=int, default=3, help="draft tokens per step (n-gram, MTP)")
    ap.add_argument("--schemes", default="stock,replayssm",
                    help=f"comma-separated of {', '.join(SCHEMES)} (stock always runs: the ratios' base)")
    ap.add_argument("--profile", default=None, help="folder for vLLM's torch-profiler output (first batch)")
    ap.add_argument("--capture", default="batches", choices=("batches", "default"),
                    help="CUDA-graph sizes: the timed batches and their verify steps' tokens (both schemes), "
                         "or vLLM's default list (up to 512 tokens)")
    ap.add_argument("--warmup", type=_non_negative, default=24,
                    help="decode tokens per request of the untimed run before each batch (kernels compile "
                         "there; 0: none)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="every engine with prefix caching in vLLM's align mode (plain decoding only)")
    ap.add_argument("--shared-prefix", type=_non_negative_ints, default=[0],
                    help="tokens of one prefix shared by every prompt, before its own --prompt tokens "
                         "(comma-separated: a row per length)")
    ap.add_argument("--block-size", type=positive_int, default=None,
                    help="tokens per cache block in every engine (vLLM raises it where a recurrent state needs "
                         "more): the same prefix-caching granularity in both engines")
    ap.add_argument("--gpu-memory", type=float, default=0.85, help="vLLM's gpu_memory_utilization")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per engine")
    ap.add_argument("--out", default="vllm.json", help="the JSON results file (a plot beside it)")
    ap.add_argument("--replot", metavar="FILE", help="only draw FILE's plot (FILE.png) from its rows")
    ap.add_argument("--composition", action="store_true",
                    help="only print what a decode step of --model moves at each of --batches (recurrent state, "
                         "attention KV, experts, other weights), beside its full model's for a slice, and the "
                         "requests its cache holds on one 80 GB card (no vLLM, no GPU)")
    ap.add_argument("--context", type=int, default=2048, help="tokens of KV each request reads (--composition)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--scheme", default="stock", help=argparse.SUPPRESS)
    return ap


def plot(doc: dict, path: Path) -> None:
    """Tokens per second against batch (against the shared prefix's length where rows sweep
    it), a line per scheme, a panel per speculation (rows timed under the profiler left out:
    perturbed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in doc["rows"] if r.get("tokens_per_s") and not r.get("profiled")]
    specs = sorted({r["speculative"] for r in rows})
    if not specs:
        raise ValueError("no timed rows to plot")
    x = "shared_prefix" if len({r.get("shared_prefix") for r in rows}) > 1 else "batch"
    fig, axes = plt.subplots(1, len(specs), figsize=(4.2 * len(specs), 3.6), squeeze=False)
    for ax, spec in zip(axes[0], specs):
        for scheme in [s for s in SCHEMES if any(r["scheme"] == s and r["speculative"] == spec for r in rows)]:
            pts = sorted((r[x], r["tokens_per_s"]) for r in rows
                         if r["scheme"] == scheme and r["speculative"] == spec)
            ax.plot([b for b, _ in pts], [t for _, t in pts], "-o", ms=4, label=scheme)
        ticks = sorted({r[x] for r in rows if r["speculative"] == spec})
        if ticks[0] > 0:
            ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(b) for b in ticks])
        ax.minorticks_off()
        ax.set_xlabel("batch (requests)" if x == "batch" else "shared prefix (tokens)")
        ax.set_ylabel("decode tokens / s")
        # from zero, so that the schemes' ratio reads off the heights
        ax.set_ylim(0, 1.1 * max(r["tokens_per_s"] for r in rows if r["speculative"] == spec))
        ax.set_title(f"speculative: {spec}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"vLLM {doc.get('vllm')}, {doc.get('model')}\n{doc.get('device')}, "
                 f"code {str(doc.get('git_commit', ''))[:7]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.composition:
        from .slices import report
        print(report(args.model, args.batches, args.context))
        return 0
    if args.replot:
        src = Path(args.replot)
        plot(json.loads(src.read_text()), src.with_suffix(".png"))
        print("wrote", src.with_suffix(".png"))
        return 0
    specs = args.speculative.split(",")
    for s in specs:
        if s not in SPECULATIVE:
            ap.error(f"--speculative: unknown {s!r}; choose from {', '.join(SPECULATIVE)}")
    if "mtp" in specs and not args.model.startswith("nemotron"):
        ap.error(f"--speculative mtp: the MTP drafter is NemotronH's; {args.model} has none here")
    schemes = args.schemes.split(",")
    for s in schemes:
        if s not in SCHEMES:
            ap.error(f"--schemes: unknown {s!r}; choose from {', '.join(SCHEMES)}")
    schemes = ["stock"] + [s for s in SCHEMES[1:] if s in schemes]
    if args.prefix_caching and any(s != "none" for s in specs) and any(s.startswith("replayssm") for s in schemes) \
            and os.environ.get("REPLAYSSM_VLLM_PREFIX_SPEC") != "1":
        ap.error("--prefix-caching: the plugin does not yet combine prefix caching with speculative decoding "
                 "unless REPLAYSSM_VLLM_PREFIX_SPEC=1 (experimental); run it with --speculative none")
    limit = gdn_batch_limit(args.model)
    if limit is not None and max(args.batches) > limit:
        ap.error(f"--batches: vLLM 0.25 cannot start {args.model} with more than {limit} sequences (its GDN "
                 f"prefill kernel's grid holds sequences x value heads in CUDA's {GRID_Y_MAX} limit)")
    if _compat.vllm_version() is None:
        raise SystemExit(f"{ap.prog}: error: vLLM is not installed here (the benchmark runs vLLM 0.25.0 on a GPU)")
    import torch
    if not torch.cuda.is_available():
        raise SystemExit(f"{ap.prog}: error: the vLLM benchmark needs a CUDA device")
    from .common import header, write_results
    doc = header("vllm")
    doc.update(vllm=_compat.vllm_version(), model=args.model, layers=args.layers or "all", prompt=args.prompt,
               decode=args.decode, drafts=args.drafts, schemes=schemes, capture=args.capture,
               prefix_caching=args.prefix_caching, shared_prefix=args.shared_prefix, rows=[])
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_dir(args.model, args.layers, Path(tmp), mtp="mtp" in specs)
        for spec in specs:
            got = {}
            for s in schemes:          # stock first: every later engine's rows carry their ratios
                got[s] = _run_engine(args, s, spec, folder)
                for j, r in enumerate(got[s]):
                    row = dict(r, model=args.model, scheme=s, speculative=spec,
                               ratio_vs_stock=_ratio(r, got["stock"][j]))
                    if "stock-fp32" in got:
                        row["ratio_vs_stock_fp32"] = _ratio(r, got["stock-fp32"][j])
                    doc["rows"].append(row)
                    print(f"{spec} {s} batch {r['batch']} prefix {r.get('shared_prefix') or 0}: "
                          f"tokens/s {r.get('tokens_per_s')}, prefill s {r.get('prefill_s')}", flush=True)
                # written after each engine: a run stopped from outside keeps what it measured
                write_results(args.out, doc)
    print(f"\nvLLM {doc['vllm']} decode throughput, {args.model} ({doc['layers']} layers), "
          f"{args.prompt} prompt + {args.decode} decode tokens per request")
    w = max(len(s) for s in SCHEMES)          # the scheme column holds the longest name
    pre_col = any(args.shared_prefix)          # a shared prefix's length and the cache's block
    print(f"{'speculative':11} {'scheme':{w}} batch" + ("  prefix  block" if pre_col else "")
          + "   tokens/s  vs stock  vs stock-fp32  accepted  prefill ms")
    key = lambda r: (r["speculative"], r["batch"], r.get("shared_prefix"))  # noqa: E731
    base = {key(r): acceptance(r) for r in doc["rows"] if r["scheme"] == "stock"}
    for r in doc["rows"]:
        tps = "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:10.0f}"
        ratios = [r.get(k) for k in ("ratio_vs_stock", "ratio_vs_stock_fp32")]
        ratios = ["-" if x is None else f"{x:.2f}x" for x in ratios]
        acc, ref = acceptance(r), base.get(key(r))
        # a ratio compares like with like only where both engines accepted the same drafts
        flag = " (not stock's: compare with care)" if acc is not None and ref and abs(acc - ref) > 0.02 else ""
        acc = "-" if acc is None else f"{acc:.1%}"
        pre = "-" if r.get("prefill_s") is None else f"{1e3 * r['prefill_s']:.1f}"
        cols = f" {r.get('shared_prefix') or 0:7d} {r.get('block_size') or '-':>6}" if pre_col else ""
        print(f"{r['speculative']:11} {r['scheme']:{w}} {r['batch']:5d}{cols} {tps:>10} {ratios[0]:>9} {ratios[1]:>14} "
              f"{acc:>9} {pre:>11}{flag}")
    try:
        plot(doc, Path(args.out).with_suffix(".png"))
    except Exception as e:  # the JSON is the result; a plot that fails must not lose it
        print("plot failed:", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
