"""The models trained here: one per family and a draft per family, built from the shipped tiny
configs (`replayssm.integrations.hf.configs`) at a trainable width, on the byte vocabulary,
with the recurrent heads initialised to the full models' time-step / decay ranges.

Why the decay ranges matter: transformers' Qwen3.5 init (dt_bias = 1, A in [0.01, 16]) gives
per-step decays exp(-A softplus(1)) down to e^-21, and the shipped tiny configs use NemotronH
time steps of 0.05-0.5; such heads forget within tens of tokens, while the full models' heads
(time steps log-uniform in [1e-3, 1e-1], A in [1, 16], as Mamba-2 and flash-linear-attention
initialise them) keep memory over thousands, which is what the precision study needs to see.
"""
from __future__ import annotations

import math

import torch

from .tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB

FAMILIES = {"mamba2": "tiny_nemotron_h", "gdn": "tiny_qwen3_5", "kda": "tiny_kimi_linear"}
# the full models' time-step range (Mamba-2, GDN and KDA initialisations alike)
DT_MIN, DT_MAX = 1e-3, 1e-1
# decay rates A of GDN heads, as flash-linear-attention and Kimi Linear draw them
A_MIN, A_MAX = 1.0, 16.0
# the vocabulary rounded up to a multiple of 8 (tensor-core friendly logits); the extra rows
# are never targets and learn to take no probability
VOCAB_PADDED = (VOCAB + 7) // 8 * 8

_COMMON = dict(vocab_size=VOCAB_PADDED, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
               initializer_range=0.02, max_position_embeddings=1 << 17, tie_word_embeddings=False)


def _pattern(n_recurrent_per_attention: int, blocks: int, rec: str, att: str) -> list:
    return [att if (i + 1) % (n_recurrent_per_attention + 1) == 0 else rec for i in range(blocks)]


def _nemotron(layers: int, width: int, per_attention: int) -> dict:
    # NemotronH blocks hold one mixer each: pairs of (mamba, mlp), every third mixer attention
    mixers = _pattern(per_attention, layers, "mamba", "attention")
    types = [t for m in mixers for t in (m, "mlp")]
    return dict(hidden_size=width, intermediate_size=2 * width, layers_block_type=types, num_hidden_layers=len(types),
                num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                mamba_num_heads=width // 16, mamba_head_dim=32, ssm_state_size=64, n_groups=1, chunk_size=64,
                time_step_min=DT_MIN, time_step_max=DT_MAX, time_step_floor=1e-4)


def _qwen(layers: int, width: int, per_attention: int) -> dict:
    types = _pattern(per_attention, layers, "linear_attention", "full_attention")
    return dict(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers, layer_types=types,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=width // 64,
                linear_num_value_heads=width // 32)


def _kimi(layers: int, width: int, per_attention: int) -> dict:
    types = _pattern(per_attention, layers, "linear_attention", "full_attention")
    return dict(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers, layer_types=types,
                mlp_layer_types=["dense"] * layers, num_attention_heads=4, num_key_value_heads=4,
                kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                linear_head_dim=32, linear_num_heads=width // 32)


# (layers, width) of the main models and of the drafts: a draft costs a fraction of its main
# model per token; it is of the same family (its own recurrent state rolls back too), with the
# same vocabulary. Sized so that all six models take under 30 MB in bf16.
_SIZES = {False: (6, 256), True: (2, 128)}
# recurrent mixers per attention layer: the full models' ratio (NemotronH about 2, Qwen3.5 and
# Kimi Linear 3) in the main models; the 2-layer drafts take one of each, since transformers'
# hybrid caches need an attention layer to count the sequence's length
_PER_ATTENTION = {("mamba2", False): 2, ("gdn", False): 3, ("kda", False): 3}
_BUILD = {"mamba2": _nemotron, "gdn": _qwen, "kda": _kimi}


def model_name(family: str, draft: bool = False) -> str:
    return f"trained-{ {'mamba2': 'nemotron-h', 'gdn': 'qwen3-5', 'kda': 'kimi-linear'}[family] }" \
        + ("-draft" if draft else "")


def overrides(family: str, draft: bool = False) -> dict:
    """The keys that turn the shipped tiny config of `family` into the trained model's."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    return {**_COMMON, **_BUILD[family](*_SIZES[bool(draft)], _PER_ATTENTION.get((family, bool(draft)), 1))}


def config(family: str, draft: bool = False, **extra):
    from ..integrations.hf import config as hf_config
    return hf_config(FAMILIES[family], **{**overrides(family, draft), **extra})


def _inv_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


@torch.no_grad()
def long_memory_init(model, generator: torch.Generator) -> int:
    """Set every recurrent mixer's `dt_bias` to softplus^-1 of time steps log-uniform in
    [DT_MIN, DT_MAX] and, for GDN, `A_log` to log of A uniform in [A_MIN, A_MAX]. NemotronH keeps
    its A = 1..H (its own init; the time steps come from the config but are redrawn here from
    `generator` so the whole init follows the seed). Returns the number of mixers set."""
    n = 0
    for mod in model.modules():
        dt_bias, A_log = getattr(mod, "dt_bias", None), getattr(mod, "A_log", None)
        if not isinstance(dt_bias, torch.nn.Parameter) or not isinstance(A_log, torch.nn.Parameter):
            continue
        u = torch.rand(dt_bias.shape, generator=generator, dtype=torch.float64)
        dt = torch.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
        dt_bias.copy_(_inv_softplus(dt).to(dt_bias.dtype))
        if type(mod).__name__.endswith("GatedDeltaNet"):
            a = torch.empty(A_log.shape, dtype=torch.float64).uniform_(A_MIN, A_MAX, generator=generator)
            A_log.copy_(a.log().to(A_log.dtype))
        elif type(mod).__name__.endswith("ForgetGate"):
            # Kimi Linear draws A the same way in transformers; redrawn for the seed's sake
            a = torch.empty(A_log.shape, dtype=torch.float64).uniform_(A_MIN, A_MAX, generator=generator)
            A_log.copy_(a.log().to(A_log.dtype))
        n += 1
    return n


def init_decays(model) -> list:
    """Each recurrent mixer's per-step decay of its heads at zero input, exp(-A softplus(dt_bias))
    (per head, or per channel for KDA): how much of the state one step keeps."""
    out = []
    for mod in model.modules():
        dt_bias, A_log = getattr(mod, "dt_bias", None), getattr(mod, "A_log", None)
        if not isinstance(dt_bias, torch.nn.Parameter) or not isinstance(A_log, torch.nn.Parameter):
            continue
        A = A_log.detach().float().exp().reshape(-1)
        dt = torch.nn.functional.softplus(dt_bias.detach().float())
        if dt.numel() != A.numel():                     # KDA: one dt per channel of each head
            A = A.repeat_interleave(dt.numel() // A.numel())
        out.append(torch.exp(-A * dt))
    return out


def build(family: str, draft: bool = False, seed: int = 0, **extra):
    """The model with fresh weights from `seed`, in fp32, in train mode."""
    from transformers import AutoModelForCausalLM
    cfg = config(family, draft, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if long_memory_init(model, torch.Generator().manual_seed(seed)) == 0:
        raise RuntimeError(f"{family}: no recurrent mixer with dt_bias and A_log found")
    return model.train()
