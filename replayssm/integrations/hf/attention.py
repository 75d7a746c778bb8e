"""Grouped-query attention over a static cache without copying the cache.

transformers' SDPA path expands every key/value head to the query heads it serves
(`repeat_kv`) whenever a mask is passed, and a static cache always passes one in decoding:
each attention layer then writes `num_key_value_groups` copies of its whole cache per step
before reading them again. At batch 256 and 2K positions that copy is most of a 4B hybrid
model's decode step (measured on an H200: two thirds of Nemotron-3-Nano-4B's), which hides the
recurrent layers that this library speeds up. A serving engine's attention reads each key/value
head once; so does this one.

The query heads of one key/value head become extra query rows of that head: `[B, Hq, T, D]`
is viewed as `[B, Hk, G * T, D]` (rows ordered head-in-group, then token), the mask's row of
token `t` serves all `G` rows of `t`, and SDPA runs with `Hk` heads. The result is the same
attention (each row's softmax is over the same keys with the same mask); only the kernel's
summation order may differ.

    hf.use_gqa_attention(model)          # the model's attention layers run this from now on
"""
from __future__ import annotations

import torch

NAME = "replayssm_gqa"


def gqa_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                          is_causal=None, **kwargs):
    """transformers' attention-interface signature; `(output [B, T, Hq, D], None)`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, tokens, dim = query.shape
    mask = attention_mask
    # the stock path where the fold does not apply: no grouping, training-time options, or a
    # causal prefill without a mask (SDPA's is_causal would align the folded rows wrongly)
    if (groups == 1 or dropout or kwargs.get("position_bias") is not None or kwargs.get("output_attentions")
            or (mask is None and tokens > 1) or (mask is not None and (mask.dim() != 4 or mask.shape[1] != 1))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    kv_heads = key.shape[1]
    q = query.reshape(batch, kv_heads, groups * tokens, dim)
    if mask is not None and tokens > 1:
        mb, _, _, positions = mask.shape
        mask = mask[:, :, None].expand(mb, 1, groups, tokens, positions).reshape(mb, 1, groups * tokens, positions)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, tokens, dim).transpose(1, 2).contiguous(), None


def use_gqa_attention(model) -> None:
    """Run `model`'s attention layers on `gqa_attention_forward` (registered with transformers'
    attention and mask interfaces under `NAME`; masks built as for SDPA). Undo with
    `model.set_attn_implementation("sdpa")`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(NAME, gqa_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
