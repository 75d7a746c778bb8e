"""The model part of `replayssm demo`: greedy generation with a small hybrid model of each
family, stock transformers beside the integration's schemes and speculative generation, whether
the tokens agree with stock, the drafts accepted and the tokens per second of each.

The models are the shipped trained ones (`configs.trained_names()`: byte-level models of Python
source with a trained draft each), continuing a Python prompt; a family without them falls back
to its tiny random-weight model with a perturbed copy as draft.

On small models the time is Python and framework overhead, not state traffic: the tokens per
second show that every path runs, not which is faster on a GPU (`replayssm bench model`).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

# family -> (trained model, its draft, the tiny random-weight fallback); the demo's --family picks
DEMO_MODELS = {"mamba2": ("trained-nemotron-h", "trained-nemotron-h-draft", "tiny_nemotron_h"),
               "gdn": ("trained-qwen3-5", "trained-qwen3-5-draft", "tiny_qwen3_5"),
               "kda": ("trained-kimi-linear", "trained-kimi-linear-draft", "tiny_kimi_linear")}
RUNS = ("stock", "conventional", "replay", "spec-lookup", "spec-draft")
NUM_DRAFT = 4
# the trained models' prompt lookup proposes only after a match of this many tokens (as vLLM's
# n-gram drafter with prompt_lookup_min = max = 3): shorter matches of byte tokens predict little
# (random-weight models, whose output never repeats 3 tokens of their prompt, go down to 1)
LOOKUP_NGRAM = 3
PROMPT_LEN = 18             # the random-weight models' prompt, in tokens
# the trained models' prompt: Python source, bytes = tokens
PYTHON_PROMPT = '''import os


def read_lines(path):
    """Return the lines of the text file at path, without their line endings."""
    with open(path, encoding="utf-8") as f:
'''
def legend(random_drafts: bool) -> tuple:
    """The lines under the table; `random_drafts`: some family ran its random-weight models,
    whose draft is a copy of the main model with a perturbed output head."""
    draft = "the family's draft model" + (" (a random-weight model's: its copy with a perturbed output head)"
                                         if random_drafts else " (trained-...-draft)")
    return (
        "stock: transformers' own decode path; conventional: hf.enable(scheme='conventional') (full state "
        "rewritten each token);",
        "replay: hf.enable() (ReplaySSM slot pools); spec-lookup / spec-draft: hf.speculative_generate with "
        f"T={NUM_DRAFT} drafts",
        f"from prompt lookup (trained models: after a {LOOKUP_NGRAM}-token match; none: a plain step) / from",
        f"{draft};",
        "drafts accepted: accepted / proposed.",
        "tokens = stock: the generated ids equal stock's. tok/s on small models measures Python overhead, not "
        "state traffic",
        "(replayssm bench model).",
    )


def _bar(total: int, desc: str):
    try:
        from tqdm.auto import tqdm
    except ImportError:                     # the bar is decoration: the table is the output
        return None
    return tqdm(total=total, desc=desc, unit="run", leave=False)


def _perturbed_copy(name: str, device, scale: float = 0.6):
    """A draft for a random-weight model: the same weights with a noisy head, so that it agrees
    with the target on part of the tokens."""
    from . import build
    d = build(name, seed=0, device=device)
    with torch.no_grad():
        w = d.get_output_embeddings().weight
        noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(7)).to(w.device)
        w.add_(scale * w.std() * noise)
    return d


def _prompt(length: int, device) -> torch.Tensor:
    # a repeated pattern, so that prompt lookup has something to find
    pat = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    return pat.repeat(1, -(-length // 6))[:, :length].to(device)


def _models(family: str, device):
    """(name, model, draft, prompt ids, trained) of `family`."""
    from . import build, trained_names
    main, draft_name, tiny = DEMO_MODELS[family]
    if main in trained_names() and draft_name in trained_names():
        # weights saved in bf16, run in fp32 as the random-weight models are
        model, draft = build(main, device=device), build(draft_name, device=device)
        ids = torch.tensor([list(PYTHON_PROMPT.encode())], device=device)
        return main, model, draft, ids, True
    return tiny, build(tiny, seed=0, device=device), _perturbed_copy(tiny, device), _prompt(PROMPT_LEN, device), False


def _text(ids: torch.Tensor) -> str:
    """A byte-level model's tokens as text (ids above 255 are its special tokens)."""
    return bytes(int(i) for i in ids.reshape(-1).tolist() if i < 256).decode("utf-8", errors="replace")


def model_rows(new_tokens: int, *, families=None, device="cpu", progress: bool = True) -> list:
    """One row per (model, run): `model`, `family`, `run`, `tok_s`, `agree` (None for stock),
    `accepted` / `proposed` (speculative runs), `prompt_tokens`, `trained` and, on the stock
    row of a trained model, `text` (its continuation)."""
    from . import disable, enable, speculative_generate

    fams = [f for f in DEMO_MODELS if families is None or f in families]
    bar = _bar(len(fams) * len(RUNS), "models") if progress else None
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                # small matrices: more threads only contend
    try:
        for fam in fams:
            name, model, draft, ids, trained = _models(fam, device)
            for m in (model, draft):
                m.generation_config.eos_token_id = None          # every run makes new_tokens tokens
            model.generate(ids, max_new_tokens=2, do_sample=False)       # first-call set-up, untimed
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
                                                      ngram=LOOKUP_NGRAM, min_ngram=LOOKUP_NGRAM if trained else 1,
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
                             "proposed": stats["proposed"] if stats else None,
                             "prompt_tokens": ids.shape[1], "trained": trained,
                             "text": _text(gen) if trained and run == "stock" else None})
                if bar is not None:
                    bar.update(1)
            disable(model)
    finally:
        torch.set_num_threads(threads)
        if bar is not None:
            bar.close()
    return rows


def format_rows(rows: list) -> list:
    header = f"{'model':25} {'family':7} {'run':13} {'tok/s':>8} {'tokens = stock':>15} {'drafts accepted':>21}"
    lines = [header, "-" * len(header)]
    for r in rows:
        agree = "(reference)" if r["agree"] is None else ("yes" if r["agree"] else "NO")
        acc = "" if r["accepted"] is None else \
            f"{r['accepted']}/{r['proposed']} {100 * r['accepted'] / max(r['proposed'], 1):3.0f}%"
        lines.append(f"{r['model']:25} {r['family']:7} {r['run']:13} {r['tok_s']:8.0f} {agree:>15} {acc:>21}")
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
    transformers.utils.logging.disable_progress_bar()       # loading bars would split the table
    echo(f"Hybrid models on {device} (fp32, batch 1, {new_tokens} new tokens, greedy; "
         f"transformers {transformers.__version__}):")
    rows = model_rows(new_tokens, families=families, device=device, progress=progress)
    for fam in dict.fromkeys(r["family"] for r in rows):
        r = next(r for r in rows if r["family"] == fam)
        if r["trained"]:
            echo(f"{r['model']} continues the Python prompt ({r['prompt_tokens']} bytes) with:")
            for line in (PYTHON_PROMPT + r["text"]).splitlines()[-12:]:
                echo("  | " + line)
        else:
            echo(f"{fam}: {r['model']} with random weights (no trained model shipped), a repeating prompt of "
                 f"{r['prompt_tokens']} tokens")
    for line in format_rows(rows):
        echo(line)
    agree = all(r["agree"] for r in rows if r["agree"] is not None)
    echo(f"all runs' tokens agree with stock: {'yes' if agree else 'NO'}")
    for line in legend(any(not r["trained"] for r in rows)):
        echo(line)
    return rows
