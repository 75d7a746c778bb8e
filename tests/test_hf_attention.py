"""The grouped-query attention fold (integrations/hf/attention.py) against transformers' SDPA path."""
import pytest
import torch

pytest.importorskip("transformers")

from replayssm.integrations import hf  # noqa: E402
from replayssm.integrations.hf import attention as gqa  # noqa: E402


class _Layer(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _inputs(batch, kv_heads, groups, tokens, positions, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, kv_heads * groups, dim, generator=g).transpose(1, 2)   # as the layers pass it
    k = torch.randn(batch, kv_heads, positions, dim, generator=g)
    v = torch.randn(batch, kv_heads, positions, dim, generator=g)
    # causal over a static cache with `positions - tokens` cached, row 0 left-padded by 3
    pos = torch.arange(positions)
    rows = (positions - tokens) + torch.arange(tokens)
    mask = (pos[None, :] <= rows[:, None])[None, None].expand(batch, 1, tokens, positions).clone()
    mask[0, :, :, :3] = False
    return q, k, v, mask


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("groups", [2, 4])
def test_fold_equals_sdpa_and_copies_no_cache(monkeypatch, tokens, groups):
    from transformers.integrations import sdpa_attention
    q, k, v, mask = _inputs(3, 2, groups, tokens, 11, 16)
    layer = _Layer(groups)
    want, _ = sdpa_attention.sdpa_attention_forward(layer, q, k, v, mask, scaling=0.25)

    def no_copy(*a, **kw):
        raise AssertionError("the fold expanded the key/value cache")
    monkeypatch.setattr(sdpa_attention, "repeat_kv", no_copy)
    got, _ = gqa.gqa_attention_forward(layer, q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape == (3, tokens, 2 * groups, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if tokens == 1:                 # decoding without a mask (a cache that allows the skip)
        got, _ = gqa.gqa_attention_forward(layer, q, k, v, None, scaling=0.25)
        monkeypatch.undo()
        want, _ = sdpa_attention.sdpa_attention_forward(layer, q, k, v, None, scaling=0.25)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_stock_path_where_the_fold_does_not_apply():
    # a causal prefill without a mask and ungrouped heads take transformers' own path (same bits)
    from transformers.integrations import sdpa_attention
    for groups, tokens, use_mask in ((2, 5, False), (1, 1, True)):
        q, k, v, mask = _inputs(2, 2, groups, tokens, 5 if not use_mask else 7, 8, seed=1)
        layer = _Layer(groups)
        m = mask if use_mask else None
        want, _ = sdpa_attention.sdpa_attention_forward(layer, q, k, v, m)
        got, _ = gqa.gqa_attention_forward(layer, q, k, v, m)
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["tiny_nemotron_h", "tiny_qwen3_5"])
def test_model_generates_the_same_tokens(name):
    # batched greedy generation with left padding, the stock attention against the fold
    model = hf.build(name, dtype=torch.float32, seed=0)
    ids = torch.randint(3, model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    stock = model.generate(ids, **kw)
    hf.use_gqa_attention(model)
    assert model.config._attn_implementation == gqa.NAME
    folded = model.generate(ids, **kw)
    assert torch.equal(stock.sequences, folded.sequences)
    for a, b in zip(stock.logits, folded.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
