"""transformers hybrid models on ReplaySSM state.

    from replayssm.integrations import hf
    hf.enable(model, window=16, max_draft=8)      # recurrent layers decode on slot pools
    hf.enable(model, scheme="conventional")       # or: full states rewritten each token (baseline)
    hf.enable(model, scheme="snapshot")           # or: T + 1 full states per sequence (speculation baseline)
    out = model.generate(input_ids, max_new_tokens=64)
    out = hf.speculative_generate(model, input_ids, draft=small_model, num_draft=4, max_new_tokens=64)
    hf.disable(model)                             # stock transformers again

Supported mixers: NemotronH, Bamba, GraniteMoeHybrid, Zamba2 and Falcon-H1 (Mamba-2),
Qwen3.5 and Qwen3-Next (Gated DeltaNet), Kimi Linear (KDA). `configs` builds the shipped
architectures (Nemotron-3-Nano-4B, Qwen3.5-4B and a tiny model of each class) with random
weights. `use_gqa_attention` runs a model's attention layers without transformers' per-step copy
of the key/value cache (attention.py).
"""
from .attention import use_gqa_attention
from .configs import build, config, config_names, trained_names, trained_path
from .enable import SCHEMES, attach_cache, disable, enable, is_enabled, replay_state
from .mixers import UnsupportedModelError
from .speculative import speculative_generate

__all__ = ["enable", "disable", "is_enabled", "replay_state", "attach_cache", "SCHEMES", "speculative_generate",
           "UnsupportedModelError", "build", "config", "config_names", "trained_names", "trained_path",
           "use_gqa_attention"]
