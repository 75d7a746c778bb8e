"""The model part of `replayssm demo`: greedy generation with a tiny random-weight hybrid model
of each family, stock transformers beside the integration's schemes and speculative
generation, whether the tokens agree with stock and the tokens per second of each.

On tiny models the time is Python and framework overhead, not state traffic: the tokens per
second show that every path runs, not which is faster on a GPU (`replayssm bench model`).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

# (shipped config, family); the demo's --family picks among them
DEMO_MODELS = (("tiny_nemotron_h", "mamba2"), ("tiny_qwen3_5", "gdn"), ("tiny_kimi_linear", "kda"))
RUNS = ("stock", "conventional", "replay", "spec-lookup", "spec-draft")
NUM_DRAFT = 4
PROMPT_LEN = 18
LEGEND = (
    "stock: transformers' own decode path; conventional: hf.enable(scheme='conventional') (full state rewritten",
    "each token); replay: hf.enable() (ReplaySSM slot pools); spec-lookup / spec-draft: hf.speculative_generate",
    f"with T={NUM_DRAFT} drafts from prompt lookup / from a tiny draft (the target's weights with a perturbed output",
    "head: random-weight models have no trained small sibling). tokens = stock: the generated ids equal stock's.",
    "tok/s on tiny models measures Python overhead, not state traffic (the GPU benchmark: replayssm bench model).",
)


def _bar(total: int, desc: str):
    try:
        from tqdm.auto import tqdm
    except ImportError:                     # the bar is decoration: the table is the output
        return None
    return tqdm(total=total, desc=desc, unit="run", leave=False)


def _perturbed_copy(name: str, device, scale: float = 0.6):
    """A draft that agrees with the target on part of the tokens (same weights, noisy head)."""
    from . import build
    d = build(name, seed=0, device=device)
    with torch.no_grad():
        w = d.get_output_embeddings().weight
        noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(7)).to(w.device)
        w.add_(scale * w.std() * noise)
    d.generation_config.eos_token_id = None
    return d


def _prompt(length: int, device) -> torch.Tensor:
    # a repeated pattern, so that prompt lookup has something to find
    pat = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    return pat.repeat(1, -(-length // 6))[:, :length].to(device)


def model_rows(new_tokens: int, *, families=None, device="cpu", prompt_len: int = PROMPT_LEN,
               progress: bool = True) -> list:
    """One row per (model, run): `model`, `family`, `run`, `tok_s`, `agree` (None for stock),
    `accepted` / `proposed` (speculative runs)."""
    from . import build, disable, enable, speculative_generate

    models = [(n, f) for n, f in DEMO_MODELS if families is None or f in families]
    bar = _bar(len(models) * len(RUNS), "tiny models") if progress else None
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                # tiny matrices: more threads only contend
    try:
        for name, fam in models:
            model = build(name, seed=0, device=device)
            model.generation_config.eos_token_id = None          # every run makes new_tokens tokens
            ids = _prompt(prompt_len, device)
            model.generate(ids, max_new_tokens=2, do_sample=False)       # first-call set-up, untimed
            draft = _perturbed_copy(name, device)
            ref = None
            for run in RUNS:
                if bar is not None:
                    bar.set_postfix_str(f"{name} {run}")
                disable(model)
                if run != "stock":
                    enable(model, scheme="conventional" if run == "conventional" else "replay",
                           max_draft=NUM_DRAFT)
                stats = None
                t0 = time.perf_counter()
                if run.startswith("spec"):
                    out, stats = speculative_generate(model, ids, draft=draft if run == "spec-draft" else None,
                                                      num_draft=NUM_DRAFT, max_new_tokens=new_tokens,
                                                      return_stats=True)
                else:
                    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
                dt = time.perf_counter() - t0
                gen = out[:, ids.shape[1]:]
                if ref is None:
                    ref = gen
                rows.append({"model": name, "family": fam, "run": run, "tok_s": gen.numel() / dt,
                             "agree": None if run == "stock" else bool(torch.equal(gen, ref)),
                             "accepted": stats["accepted"] if stats else None,
                             "proposed": stats["proposed"] if stats else None})
                if bar is not None:
                    bar.update(1)
            disable(model)
    finally:
        torch.set_num_threads(threads)
        if bar is not None:
            bar.close()
    return rows


def format_rows(rows: list) -> list:
    header = f"{'model':17} {'family':7} {'run':13} {'tok/s':>8} {'tokens = stock':>15} {'drafts accepted':>16}"
    lines = [header, "-" * len(header)]
    for r in rows:
        agree = "(reference)" if r["agree"] is None else ("yes" if r["agree"] else "NO")
        acc = "" if r["accepted"] is None else f"{r['accepted']}/{r['proposed']}"
        lines.append(f"{r['model']:17} {r['family']:7} {r['run']:13} {r['tok_s']:8.0f} {agree:>15} {acc:>16}")
    return lines


def run_demo(new_tokens: int, *, families=None, device="cpu", echo: Callable[[str], None] = print,
             progress: bool = True) -> Optional[list]:
    """Print the model part; returns its rows, or None when transformers is not installed."""
    import importlib.util
    if importlib.util.find_spec("transformers") is None:
        echo("Tiny hybrid models: skipped, transformers is not installed (pip install -e '.[hf]').")
        return None
    import transformers
    transformers.logging.set_verbosity_error()
    echo(f"Tiny hybrid models on {device} (random weights, fp32, batch 1, {PROMPT_LEN}-token prompt, {new_tokens} new "
         f"tokens, greedy; transformers {transformers.__version__}):")
    rows = model_rows(new_tokens, families=families, device=device, progress=progress)
    for line in format_rows(rows):
        echo(line)
    agree = all(r["agree"] for r in rows if r["agree"] is not None)
    echo(f"all runs' tokens agree with stock: {'yes' if agree else 'NO'}")
    for line in LEGEND:
        echo(line)
    return rows
