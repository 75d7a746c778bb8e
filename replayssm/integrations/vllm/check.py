"""Greedy generation with vLLM on a local model, for the plugin's GPU checks: prints the
tokens of a fixed set of requests as one `TOKENS <json>` line (compared between runs with
`REPLAYSSM_VLLM=1` and `=0`). Requests of different lengths and token budgets arrive
together and finish at different steps (continuous batching).

    python -m replayssm.integrations.vllm.check MODEL_DIR eager|graph [JSON_LLM_KWARGS]
"""
from __future__ import annotations

import json
import os
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    model, mode = argv[0], argv[1]
    extra = json.loads(argv[2]) if len(argv) > 2 else {}
    from vllm import LLM, SamplingParams

    from . import status
    # REPLAYSSM_VLLM_CHECK_GPU_MEMORY: the GPU's share per engine, lower when several run side by side
    share = float(os.environ.get("REPLAYSSM_VLLM_CHECK_GPU_MEMORY", "0.3"))
    kw = dict(model=model, enforce_eager=(mode == "eager"), gpu_memory_utilization=share, max_model_len=512,
              max_num_seqs=32, seed=0)
    kw.update(extra)
    llm = LLM(**kw)
    # prompts of 5..104 tokens: with 3 speculative tokens, stock vLLM 0.25.0 (plugin off) gave a
    # 4-token prompt (1 + num_speculative_tokens) another first token than without speculation
    # (benchmarks/results/vllm_check_h200.log), which would hide what the plugin does
    prompts = [{"prompt_token_ids": [1] + [10 + (7 * i + j) % 500 for j in range(4 + 9 * i)]} for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * (i % 5), ignore_eos=True) for i in range(12)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    print("PLUGIN", json.dumps(status()), flush=True)
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
