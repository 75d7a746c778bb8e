"""120B-class slices: Nemotron-3-Super and Qwen3.5-122B-A10B at their real layer widths with
fewer layers, and what one decode step of a config moves, so that a slice's step can be set
beside the full model's.

The shipped configs `nemotron3_super_slice` and `qwen3_5_122b_slice`
(`replayssm/integrations/hf/configs/`) keep every width of the full model (hidden size, heads,
head and state dims, conv kernel, expert count, top-k and expert shapes, vocabulary) and a
contiguous run of its layer pattern with the full model's proportions of layer kinds; their
`_full` entry holds what differs in the full model (the layer count and pattern), their
`_source` entry where each number comes from.

Why the shares of a step stay those of the full model (`composition`): every per-layer term
(a recurrent layer's state read and write, an attention layer's KV read, the weights of its
mixers, the routed experts a batch touches) is the full model's, and the slice has each kind of
layer in the full model's proportion, so each component scales by the same factor, the slice's
fraction of the layers. All experts are kept: with fewer experts the same batch would touch a
smaller set per layer (`E (1 - (1 - k/E)^B)` of them), shrinking the expert share. What does
not scale is the one-off work outside the layers (the output head), whose share grows.

    python -m replayssm.bench.vllm_serving --model nemotron3_super_slice --composition --batches 256
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

SLICES = ("nemotron3_super_slice", "qwen3_5_122b_slice")

# The card the slices are sized for: its nominal 80 GB (an H100 reports about 79 GiB, 85e9
# bytes, so this is the conservative side), with the benchmark's default share for vLLM, and a
# reserve for what is not the cache: activations at vLLM's profiling batch (the fused-MoE
# buffers at 16K tokens are a few GB), CUDA graphs, the CUDA context. An assumption, not a
# measurement: the engine's start-up log ("Maximum concurrency") is the real figure.
GPU_BYTES = 80e9
GPU_SHARE = 0.85
RESERVE_BYTES = 8e9


def load(name: str) -> dict:
    """The shipped config `name` as stored (its `_source`, `_slice`, `_full` notes included)."""
    from ..integrations.hf.configs import _DIR, config_names
    path = _DIR / f"{name}.json"
    if not path.exists():
        raise ValueError(f"unknown config {name!r}; shipped: {config_names()}")
    return json.loads(path.read_text())


def sliced(name: str) -> dict:
    """The config as served (notes dropped)."""
    return {k: v for k, v in load(name).items() if not k.startswith("_")}


def full(name: str) -> dict:
    """The full model's config: the slice with its `_full` entry applied (the config itself
    when it has none)."""
    raw = load(name)
    return dict(sliced(name), **raw.get("_full", {}))


@dataclass(frozen=True)
class Anatomy:
    """What a decode step of a config reads, per layer kind. Weights count the matrices and
    convolution filters (norms, biases and per-head scalars are left out: under 0.1%).
    `layers`: counts of "recurrent", "attention", "moe", "mlp" layers (a Qwen3.5 layer is a
    mixer and an MoE block, so it counts in both); `*_weights`: elements of one layer's
    matrices (`moe_dense`: router, shared experts, latent projections; `expert`: one routed
    expert); `state`, `conv`: elements of one request's recurrent and conv state in a layer;
    `conv_width`: the conv state's tokens (kernel - 1); `kv`: K and V elements per token in an
    attention layer; `embed`: the output head."""

    family: str
    layers: dict
    recurrent_weights: int
    attention_weights: int
    mlp_weights: int
    moe_dense_weights: int
    expert_weights: int
    experts: int
    top_k: int
    HV: int
    Hk: int
    V: int
    K: int
    conv: int
    conv_width: int
    kv: int
    embed: int
    hidden: int
    tied: bool

    @property
    def state(self) -> int:
        return self.HV * self.V * self.K

    def weights(self) -> int:
        """Elements of every weight matrix, all experts and the input embedding included."""
        n = self.layers
        return (n["recurrent"] * self.recurrent_weights + n["attention"] * self.attention_weights
                + n["mlp"] * self.mlp_weights
                + n["moe"] * (self.moe_dense_weights + self.experts * self.expert_weights)
                + self.embed * (1 if self.tied else 2))


def anatomy(cfg: dict) -> Anatomy:
    """The `Anatomy` of a NemotronH (`nemotron_h`) or Qwen3.5 (`qwen3_5_text`,
    `qwen3_5_moe_text`) config, as the plain dict of its JSON."""
    kind = cfg.get("model_type")
    h, heads, kv_heads, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    attn = lambda q_out: h * q_out + 2 * h * kv_heads * hd + heads * hd * h     # noqa: E731  q, k and v, o
    common = dict(kv=2 * kv_heads * hd, embed=cfg["vocab_size"] * h, hidden=h,
                  tied=bool(cfg.get("tie_word_embeddings", False)))
    if kind == "nemotron_h":
        p = cfg["hybrid_override_pattern"]
        HV, V, K, G, ck = (cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["ssm_state_size"], cfg["n_groups"],
                           cfg["conv_kernel"])
        inner, conv_dim = HV * V, HV * V + 2 * G * K
        E = (cfg.get("n_routed_experts") or 0) if "E" in p else 0
        latent = cfg.get("moe_latent_size")
        shared = cfg.get("moe_shared_expert_intermediate_size", 0) * cfg.get("n_shared_experts", 0)
        return Anatomy(
            family="mamba2", layers=dict(recurrent=p.count("M"), attention=p.count("*"), moe=p.count("E"),
                                         mlp=p.count("-")),
            # in_proj (z, x, B, C, dt), the conv filters, out_proj
            recurrent_weights=h * (2 * inner + 2 * G * K + HV) + conv_dim * ck + inner * h,
            attention_weights=attn(heads * hd),
            mlp_weights=2 * h * cfg.get("intermediate_size", 0) if "-" in p else 0,   # up, down (squared ReLU)
            # router, shared experts (up, down), the latent projections in and out
            moe_dense_weights=(h * E + 2 * h * shared + (2 * h * latent if latent else 0)) if E else 0,
            expert_weights=2 * (latent or h) * cfg["moe_intermediate_size"] if E else 0,   # up, down
            experts=E, top_k=cfg.get("num_experts_per_tok", 0) if E else 0, HV=HV, Hk=G, V=V, K=K,
            conv=conv_dim * (ck - 1), conv_width=ck - 1, **common)
    if kind in ("qwen3_5_text", "qwen3_5_moe_text"):
        kinds = cfg["layer_types"]
        HV, Hk, V, K, ck = (cfg["linear_num_value_heads"], cfg["linear_num_key_heads"], cfg["linear_value_head_dim"],
                            cfg["linear_key_head_dim"], cfg["linear_conv_kernel_dim"])
        conv_dim = 2 * Hk * K + HV * V
        moe = kind == "qwen3_5_moe_text"
        E = cfg["num_experts"] if moe else 0
        return Anatomy(
            family="gdn", layers=dict(recurrent=kinds.count("linear_attention"),
                                      attention=kinds.count("full_attention"),
                                      moe=len(kinds) if moe else 0, mlp=0 if moe else len(kinds)),
            # in_proj_qkvz, in_proj_ba, the conv filters, out_proj
            recurrent_weights=h * (conv_dim + HV * V) + h * 2 * HV + conv_dim * ck + HV * V * h,
            # q_proj also makes the output gate
            attention_weights=attn((2 if cfg.get("attn_output_gate", True) else 1) * heads * hd),
            mlp_weights=0 if moe else 3 * h * cfg["intermediate_size"],        # gate, up, down (SwiGLU)
            # router, shared expert (gate, up, down), its gate
            moe_dense_weights=h * E + 3 * h * cfg["shared_expert_intermediate_size"] + h if moe else 0,
            expert_weights=3 * h * cfg["moe_intermediate_size"] if moe else 0, experts=E,
            top_k=cfg["num_experts_per_tok"] if moe else 0, HV=HV, Hk=Hk, V=V, K=K,
            conv=conv_dim * (ck - 1), conv_width=ck - 1, **common)
    raise ValueError(f"model_type {kind!r}: expected nemotron_h, qwen3_5_text or qwen3_5_moe_text")


def experts_touched(experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts `tokens` tokens route to, each picking `top_k` of `experts`
    uniformly (random weights route so): `E (1 - (1 - k/E)^tokens)`."""
    if not experts:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


COMPONENTS = ("recurrent", "attention", "experts", "dense")


def composition(cfg: dict, batch: int, context: int, *, state_bytes: int = 4, conv_bytes: int = 2,
                weight_bytes: int = 2, kv_bytes: int = 2) -> dict:
    """Bytes one decode step at `batch` requests of `context` tokens moves, per component, and
    their shares (`share_<component>`):

    - `recurrent`: each recurrent layer reads and writes every request's state (`state_bytes`
      an element: 4, fp32, is vLLM's NemotronH default and the plugin's checkpoint) and conv state;
    - `attention`: each attention layer reads `context` tokens of K and V per request;
    - `experts`: each MoE layer reads the routed experts the batch touches (`experts_touched`);
    - `dense`: every other weight once (mixers' projections, router, shared experts, latent
      projections, the output head) and the batch's embedding rows.
    """
    a = anatomy(cfg)
    n = a.layers
    out = {
        "recurrent": n["recurrent"] * batch * 2 * (a.state * state_bytes + a.conv * conv_bytes),
        "attention": n["attention"] * batch * context * a.kv * kv_bytes,
        "experts": n["moe"] * experts_touched(a.experts, a.top_k, batch) * a.expert_weights * weight_bytes,
        "dense": weight_bytes * (n["recurrent"] * a.recurrent_weights + n["attention"] * a.attention_weights
                                 + n["mlp"] * a.mlp_weights + n["moe"] * a.moe_dense_weights
                                 + a.embed + batch * a.hidden),
    }
    total = sum(out.values())
    out["total"] = total
    out.update({f"share_{k}": out[k] / total for k in COMPONENTS})
    return out


def request_bytes(cfg: dict, scheme: str, drafts: int = 0, tokens: int = 256, window: int = 16) -> int:
    """Cache bytes one request takes in vLLM: per recurrent layer, `1 + drafts` blocks of the
    stock state (vLLM's conv state in bf16; the SSM state fp32 for NemotronH as its config asks,
    the model's bf16 for Qwen3.5, vLLM's `auto`) or, for `scheme="replayssm"`, one block of the
    plugin's (`integrations.vllm.state.StateSpec`: checkpoint, `window + 1 + drafts` records,
    its default record dtypes); per attention layer the pages its `tokens` of K and V fill, vLLM
    sizing attention pages to the recurrent page (its hybrid cache has one page size)."""
    if scheme not in ("stock", "replayssm"):
        raise ValueError(f"scheme {scheme!r}: expected 'stock' or 'replayssm'")
    a = anatomy(cfg)
    page = state_page_bytes(cfg, scheme, drafts, window)
    blocks = 1 + drafts if scheme == "stock" else 1
    attn_pages = math.ceil(tokens * a.kv * 2 / page)
    return page * (a.layers["recurrent"] * blocks + a.layers["attention"] * attn_pages)


def state_page_bytes(cfg: dict, scheme: str, drafts: int = 0, window: int = 16) -> int:
    """One recurrent layer's state block in vLLM, before padding (`request_bytes`' rules;
    `replayssm-side`: the plugin's page with its records beside it, `StateSpec.side_records`)."""
    import torch

    from ..integrations.vllm.state import StateSpec
    a = anatomy(cfg)
    if scheme == "stock":
        ssm = 4 if a.family == "mamba2" and cfg.get("mamba_ssm_cache_dtype", "float32") == "float32" else 2
        return a.conv * 2 + a.state * ssm
    if scheme in ("replayssm", "replayssm-side"):
        rec = torch.bfloat16 if a.family == "mamba2" else torch.float32
        spec = StateSpec(family=a.family, HV=a.HV, Hk=a.Hk, V=a.V, K=a.K, window=window, max_draft=1 + drafts,
                         record_dtype=rec, conv_shape=(a.conv_width, a.conv // a.conv_width),
                         conv_dtype=torch.bfloat16, side_records=scheme == "replayssm-side")
        return spec.page_bytes()
    raise ValueError(f"scheme {scheme!r}: expected 'stock', 'replayssm' or 'replayssm-side'")


def cache_block_tokens(cfg: dict, scheme: str, drafts: int = 0, window: int = 16, align: int = 16) -> int:
    """Tokens per cache block vLLM 0.25 chooses for the config (its rule for hybrid models:
    the fewest multiples of the attention kernel's `align` tokens whose bf16 K and V page holds
    one recurrent state page). In prefix caching's `align` mode this is the cache's
    granularity: a prompt finds cached only the whole blocks before its last token."""
    per_token = anatomy(cfg).kv * 2
    return align * math.ceil(state_page_bytes(cfg, scheme, drafts, window) / (align * per_token))


def fit(cfg: dict, *, gpu_bytes: float = GPU_BYTES, share: float = GPU_SHARE, reserve: float = RESERVE_BYTES,
        weight_bytes: int = 2) -> dict:
    """The config on one card: `weights` (bytes, bf16, every expert), `cache` (what is left for
    vLLM's cache of `share` of `gpu_bytes` after the weights and `reserve`)."""
    weights = anatomy(cfg).weights() * weight_bytes
    return {"weights": weights, "cache": gpu_bytes * share - reserve - weights}


def requests_held(cfg: dict, scheme: str, drafts: int = 0, tokens: int = 256, **fit_kw) -> int:
    """Requests the cache of `fit` holds at once (0 when the weights leave no room)."""
    return max(0, int(fit(cfg, **fit_kw)["cache"] // request_bytes(cfg, scheme, drafts, tokens)))


def report(name: str, batches, context: int, tokens: int = 256) -> str:
    """The composition of a step of the slice beside the full model's, at each batch, and the
    slice's memory on one card (text, Markdown tables)."""
    raw, cut, whole = load(name), sliced(name), full(name)
    a, b = anatomy(cut), anatomy(whole)
    has_full = "_full" in raw
    kinds = lambda x: " / ".join(f"{x.layers[k]} {k}" for k in ("recurrent", "attention", "moe", "mlp")  # noqa: E731
                                 if x.layers[k])
    lines = [f"{name}: {kinds(a)} layers" + (f" (full model: {kinds(b)})" if has_full else ""),
             f"widths: hidden {a.hidden}, recurrent state {a.HV} x {a.V} x {a.K} ({a.family})"
             + (f", {a.experts} experts top-{a.top_k}" if a.experts else "")]
    for batch in batches:
        s, f = composition(cut, batch, context), composition(whole, batch, context)
        lines += ["", f"per decode step, batch {batch}, context {context} (fp32 recurrent state, bf16 weights and KV):",
                  "", "| component | full GB | full share | slice GB | slice share |" if has_full else
                  "| component | GB | share |", "|---|---|---|---|---|" if has_full else "|---|---|---|"]
        for k in COMPONENTS + ("total",):
            sh = (lambda d: f"{100 * d[f'share_{k}']:.1f}%") if k != "total" else (lambda d: "")
            cells = ([f"{f[k] / 1e9:.2f}", sh(f)] if has_full else []) + [f"{s[k] / 1e9:.2f}", sh(s)]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
    m = fit(cut)
    lines += ["", f"on one {GPU_BYTES / 1e9:.0f} GB card at --gpu-memory {GPU_SHARE} with {RESERVE_BYTES / 1e9:.0f} GB "
              f"kept for activations and graphs: weights {m['weights'] / 1e9:.1f} GB (full model "
              f"{fit(whole)['weights'] / 1e9:.1f} GB), cache {m['cache'] / 1e9:.1f} GB; requests it holds "
              f"({tokens} tokens each):", "", "| T (tokens verified a step) | stock | replayssm |", "|---|---|---|"]
    for T in (1, 2, 4, 8):
        lines.append(f"| {T} | {requests_held(cut, 'stock', T - 1, tokens)} | "
                     f"{requests_held(cut, 'replayssm', T - 1, tokens)} |")
    lines += ["", f"tokens per cache block (prefix caching's granularity in align mode, plain decoding): stock "
              f"{cache_block_tokens(cut, 'stock')}, replayssm {cache_block_tokens(cut, 'replayssm')} (records "
              f"beside the pages: {cache_block_tokens(cut, 'replayssm-side')})"]
    return "\n".join(lines)
