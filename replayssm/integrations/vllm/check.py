"""Greedy generation with vLLM on a local model, for the plugin's GPU checks: prints the
tokens of a fixed set of requests as one `TOKENS <json>` line (compared between runs with
`REPLAYSSM_VLLM=1` and `=0`). Requests of different lengths and token budgets arrive
together and finish at different steps (continuous batching). With
`REPLAYSSM_VLLM_CHECK_TOP2=1` also a `TOP2 <json>` line: per request and generated token, the
two most likely tokens and their log-probabilities, for `near_tie_divergences`.
`REPLAYSSM_VLLM_CHECK_WORKLOAD=prefix` generates two waves of requests that share prefixes
(`prefix_waves`) instead, for prefix caching, and a `CACHE <json>` line gives vLLM's
prefix-cache counters; `=python`, prompts of Python source from a trained byte-level model's
held-out text (`python_requests`), and a `SPEC <json>` line gives vLLM's draft counters.
`with_mtp_layer` makes a NemotronH model folder with a multi-token-prediction drafter;
`trained_qwen3_5(src, dst)` the folder vLLM serves a trained Qwen3.5 from.

    python -m replayssm.integrations.vllm.check MODEL_DIR eager|graph [JSON_LLM_KWARGS]
"""
from __future__ import annotations

import json
import os
import sys
from typing import List, Sequence


def near_tie_divergences(ref: Sequence[Sequence[int]], top2: Sequence, got: Sequence[Sequence[int]],
                         bound: float) -> List[str]:
    """Where greedy tokens `got` may leave the reference's `ref` (per request): only at a
    near-tie, the reference's two most likely tokens (`top2[r][t]`: `[[token, logprob],
    [token, logprob]]`, the reference's own step `t`) within `bound` nats of each other and
    `got` taking the other. Up to a request's first divergence the two runs have the same
    context, so the reference's probabilities there are the ones `got` decided on; after it
    nothing is compared. Returns what breaks this, one line per request (empty: none)."""
    bad = []
    if len(ref) != len(got):
        return [f"{len(got)} requests against the reference's {len(ref)}"]
    for r, (a, b) in enumerate(zip(ref, got)):
        if len(a) != len(b):
            bad.append(f"request {r}: {len(b)} tokens against {len(a)}")
            continue
        t = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if t is None:
            continue
        (t1, lp1), (t2, lp2) = top2[r][t][:2]
        if {t1, t2} != {a[t], b[t]} or abs(lp1 - lp2) > bound:
            bad.append(f"request {r} step {t}: token {b[t]} where the reference took {a[t]}, "
                       f"its top two {t1} ({lp1:.4f}), {t2} ({lp2:.4f})")
    return bad


def with_mtp_layer(src, dst, seed: int = 0) -> None:
    """A copy of the NemotronH model folder `src` in `dst` with one multi-token-prediction
    layer of random weights (an attention layer, vLLM's `nemotron_h_mtp` drafter, method
    `mtp`), so that speculative decoding can run with a drafter that vLLM verifies on the
    device with asynchronous scheduling, and whose drafts are mostly rejected. The target's
    own weights are unchanged (its loader skips `mtp.`)."""
    import shutil
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("model_type") != "nemotron_h":
        raise ValueError(f"{src}: a NemotronH model is needed, not {cfg.get('model_type')!r}")
    # one attention layer: vLLM's own config reads the pattern, transformers' the list
    cfg.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*",
               mtp_layers_block_type=["full_attention"])
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    weights = load_file(src / "model.safetensors")
    dtype = weights["lm_head.weight"].dtype
    h, hd = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(seed)
    shapes = {"eh_proj": (h, 2 * h), "mixer.q_proj": (q, h), "mixer.k_proj": (kv, h),
              "mixer.v_proj": (kv, h), "mixer.o_proj": (h, q)}
    for name, shape in shapes.items():
        weights[f"mtp.layers.0.{name}.weight"] = (0.02 * torch.randn(shape, generator=g)).to(dtype)
    for norm in ("enorm", "hnorm", "norm", "final_layernorm"):
        weights[f"mtp.layers.0.{norm}.weight"] = torch.ones(h, dtype=dtype)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})


def qwen3_5_config(text: dict, **top) -> dict:
    """The config vLLM serves Qwen3.5 from (`Qwen3_5ForConditionalGeneration`) around the text
    model `text`, with a one-layer vision tower that `language_model_only` leaves unbuilt;
    `top`: more top-level fields (token ids)."""
    from transformers import Qwen3_5Config
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"])
    cfg = Qwen3_5Config(text_config=text, vision_config=vision,
                        tie_word_embeddings=text.get("tie_word_embeddings", False), **top)
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    return cfg


def _copy_tokenizer(src, dst, also=()) -> None:
    """The tokenizer's files of model folder `src` (and the files named in `also`) into `dst`."""
    import shutil
    from pathlib import Path
    for f in Path(src).iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json" or f.name in also:
            shutil.copy(f, Path(dst) / f.name)


def tiny_qwen3_5(dst, tokenizer_from, seed: int = 0) -> None:
    """A tiny random-weight Qwen3.5 in `dst` (`qwen3_5_config`): the text model at the shapes
    of `../shared/vllm/make_models.py`'s Qwen3-Next (3 GDN layers, 1 attention layer, here with
    dense MLPs, as Qwen3.5-4B has); the tokenizer files of the model folder `tokenizer_from`.
    The image and video token ids are put inside the tiny vocabulary (the prompts of `main`
    never hold them)."""
    from pathlib import Path

    import torch
    from transformers import Qwen3_5ForConditionalGeneration
    dst, tok = Path(dst), Path(tokenizer_from)
    text = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = qwen3_5_config(text, image_token_id=1020, video_token_id=1021, vision_start_token_id=1022,
                         vision_end_token_id=1023)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(cfg).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(dst)
    _copy_tokenizer(tok, dst)


def trained_qwen3_5(src, dst) -> None:
    """The trained byte-level Qwen3.5 (`Qwen3_5ForCausalLM` in `src`, `replayssm train`) as
    vLLM 0.25 serves Qwen3.5, `Qwen3_5ForConditionalGeneration` (`qwen3_5_config`) in `dst`: the
    same text weights under the language model's names, bf16, the tokenizer files; the image
    and video token ids on the padded vocabulary's unused rows (above the byte tokens and
    `<pad>` `<s>` `</s>`, never in a prompt)."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration
    src, dst = Path(src), Path(dst)
    causal = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    text = causal.config.to_dict()
    first_free = 259                         # 256 bytes + <pad> <s> </s>
    if text["vocab_size"] < first_free + 4:
        raise ValueError(f"{src}: vocabulary of {text['vocab_size']} has no 4 unused ids above {first_free - 1}")
    cfg = qwen3_5_config(text, image_token_id=first_free, video_token_id=first_free + 1,
                         vision_start_token_id=first_free + 2, vision_end_token_id=first_free + 3)
    model = Qwen3_5ForConditionalGeneration(cfg)
    weights = {k if k.startswith("lm_head.") else "model.language_model." + k[len("model."):]: v
               for k, v in causal.state_dict().items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or any(not k.startswith("model.visual.") for k in missing):
        raise RuntimeError(f"{src}: weights that do not map onto Qwen3.5's language model: "
                           f"unexpected {unexpected[:4]}, missing {[k for k in missing if 'visual' not in k][:4]}")
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(dst)
    _copy_tokenizer(src, dst, also=("heldout.bin",))


def python_requests(folder):
    """12 prompts of 5..104 bytes of Python source from spread offsets of a trained byte-level
    model's held-out text (`heldout.bin` in its folder; token ids are the bytes), 8..28 tokens
    to generate each: text the model predicts well, so n-gram drafts are accepted as they would
    be in use."""
    from pathlib import Path
    held = (Path(folder) / "heldout.bin").read_bytes()
    prompts = []
    for i in range(12):
        n = 5 + 9 * i
        at = (i * 20011) % (len(held) - n)
        prompts.append({"prompt_token_ids": list(held[at:at + n])})
    return prompts, [8 + 5 * (i % 5) for i in range(12)]


def plain_requests():
    """12 prompts of 5..104 tokens, 8..28 tokens each to generate."""
    # with 3 speculative tokens, stock vLLM 0.25.0 (plugin off) gave a 4-token prompt
    # (1 + num_speculative_tokens) another first token than without speculation (seen on the
    # H200 at 316393e), which would hide what the plugin does
    prompts = [{"prompt_token_ids": [1] + [10 + (7 * i + j) % 500 for j in range(4 + 9 * i)]} for i in range(12)]
    return prompts, [8 + 5 * (i % 5) for i in range(12)]


def prefix_waves(seed: int = 0):
    """Requests sharing the prefixes of one 1,600-token text, in two waves (the first fills
    vLLM's prefix cache, the second hits it): prefixes of varied lengths (under a block, at
    and past block boundaries whatever the block size, the whole of an earlier prompt) with
    suffixes of 0..20 other tokens, 6..30 tokens generated each."""
    import random
    rng = random.Random(seed)
    text = [1] + [rng.randrange(10, 1000) for _ in range(1599)]

    def wave(lengths, tag):
        prompts = []
        for i, n in enumerate(lengths):
            tail = [rng.randrange(10, 1000) for _ in range((7 * i + tag) % 21)]
            prompts.append({"prompt_token_ids": text[:n] + tail})
        return prompts, [6 + (6 * i + tag) % 25 for i in range(len(lengths))]

    first = wave([1600, 1200, 800, 400], 0)
    # the second wave repeats the first's longest prompt (a hit on its last whole block)
    second = wave([1600, 1599, 1400, 1100, 900, 700, 520, 333, 257, 100, 48], 3)
    second[0][0] = first[0][0]
    return [first, second]


def wave_requests():
    """48 prompts of 20..85 tokens, each repeating a 7-token pattern (n-gram lookup finds
    drafts), 16..46 tokens to generate each: with `max_num_seqs` well below 48, requests join
    (and prefill) while others verify drafts, over several waves."""
    import random
    rng = random.Random(7)
    prompts, budgets = [], []
    for i in range(48):
        unit = [rng.randrange(10, 1000) for _ in range(7)]
        n = 20 + (13 * i) % 66
        prompts.append({"prompt_token_ids": [1] + (unit * (n // 7 + 1))[:n - 1]})
        budgets.append(16 + (11 * i) % 31)
    return prompts, budgets


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    model, mode = argv[0], argv[1]
    extra = json.loads(argv[2]) if len(argv) > 2 else {}
    from vllm import LLM, SamplingParams

    from . import status
    from ._compat import metric_values, prefix_cache_counters
    # REPLAYSSM_VLLM_CHECK_GPU_MEMORY: the GPU's share per engine, lower when several run side by side
    share = float(os.environ.get("REPLAYSSM_VLLM_CHECK_GPU_MEMORY", "0.3"))
    kw = dict(model=model, enforce_eager=(mode == "eager"), gpu_memory_utilization=share, max_model_len=512,
              max_num_seqs=32, seed=0)
    work = os.environ.get("REPLAYSSM_VLLM_CHECK_WORKLOAD", "plain")
    prefix = work == "prefix"
    if prefix:                         # its prompts are long; its counters need vLLM's stats
        kw.update(max_model_len=2048, disable_log_stats=False)
    if work == "python":               # the draft counters need vLLM's stats
        kw.update(disable_log_stats=False)
    kw.update(extra)
    llm = LLM(**kw)
    top2 = os.environ.get("REPLAYSSM_VLLM_CHECK_TOP2", "0") == "1"
    if prefix:
        waves = prefix_waves()
    else:
        waves = [{"waves": wave_requests, "python": lambda: python_requests(model)}.get(work, plain_requests)()]
    outs = []
    for prompts, budgets in waves:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2 if top2 else None)
                  for n in budgets]
        outs += llm.generate(prompts, params, use_tqdm=False)
    print("PLUGIN", json.dumps(status()), flush=True)
    print("CACHE " + json.dumps(prefix_cache_counters(llm)), flush=True)
    print("SPEC " + json.dumps(metric_values(llm, lambda name: name.startswith("spec_decode_num_"))), flush=True)
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
    if top2:
        # vLLM returns the sampled token's log-probability beside the top ones: keep the top two
        rows = [[sorted(([tok, lp.logprob] for tok, lp in step.items()), key=lambda x: -x[1])[:2]
                 for step in o.outputs[0].logprobs] for o in outs]
        print("TOP2 " + json.dumps(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
