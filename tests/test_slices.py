"""The 120B-class slices (replayssm.bench.slices and their shipped configs): the full models'
widths and layer pattern, the memory they are sized for, and the step composition set beside
the full model's. Nothing here builds a 120B-wide model's weights (the meta device at most)."""
from __future__ import annotations

import json

import pytest

from replayssm.bench import slices as sl
from replayssm.shapes import MODEL_SHAPES

pytest.importorskip("transformers")

# The full models' numbers as published (sources in each config's `_source` entry):
# glennklockwood.com/garden/Nemotron-3 (pattern, widths, experts), colaberry.ai (88 layers,
# vocabulary, 8 KiB of KV a token), besthub.dev (32 query / 2 KV heads)
SUPER = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=2, head_dim=128, mamba_num_heads=128,
             mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, n_routed_experts=512,
             num_experts_per_tok=22, moe_latent_size=1024, moe_intermediate_size=2688,
             moe_shared_expert_intermediate_size=5376, n_shared_experts=1, vocab_size=131072)
SUPER_PATTERN = "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"
SUPER_PARAMS = 120.6e9           # total parameters (glennklockwood.com; "120.6B" in NVIDIA's report)
# github.com/Aphoh/slime scripts/models/qwen3.5-122B-A10B.sh, apxml.com/models/qwen35-122b-a10b,
# the GDN heads of SPEC.md section 8
QWEN = dict(hidden_size=3072, num_attention_heads=32, num_key_value_heads=2, head_dim=256, num_experts=256,
            num_experts_per_tok=8, moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
            linear_num_value_heads=64, linear_num_key_heads=16, linear_value_head_dim=128, linear_key_head_dim=128,
            linear_conv_kernel_dim=4, vocab_size=248320)
QWEN_PARAMS = 122.11e9           # llmgarage.ai (the text model's GGUF: 122.11B)


def test_slices_load_with_the_full_models_widths_and_pattern():
    from transformers import NemotronHConfig, Qwen3_5MoeTextConfig

    from replayssm.integrations import hf
    nem, qw = hf.config("nemotron3_super_slice"), hf.config("qwen3_5_122b_slice")
    assert isinstance(nem, NemotronHConfig) and isinstance(qw, Qwen3_5MoeTextConfig)
    for cfg, want in ((nem, SUPER), (qw, QWEN)):
        assert {k: getattr(cfg, k) for k in want} == want
    assert not nem.tie_word_embeddings and not qw.tie_word_embeddings and qw.attn_output_gate
    # the slice is a contiguous run of the full pattern, with its kinds in the full proportions
    full = sl.full("nemotron3_super_slice")["hybrid_override_pattern"]
    assert full == SUPER_PATTERN and (full.count("M"), full.count("E"), full.count("*")) == (40, 40, 8)
    assert nem.num_hidden_layers == 11 and nem.hybrid_override_pattern in full
    assert [nem.hybrid_override_pattern.count(c) * 8 for c in "ME*"] == [40, 40, 8]
    kinds = sl.full("qwen3_5_122b_slice")["layer_types"]
    assert kinds == (["linear_attention"] * 3 + ["full_attention"]) * 12
    assert qw.num_hidden_layers == 8 and qw.layer_types == kinds[:8]
    # the recurrent layers are the shapes the kernels are benchmarked at
    for name, shape in (("nemotron3_super_slice", "nemotron3-super"), ("qwen3_5_122b_slice", "qwen3.5-122b")):
        a = sl.anatomy(sl.sliced(name))
        assert (a.family, a.HV, a.Hk, a.V, a.K) == tuple(MODEL_SHAPES[shape])
    # the widths add up to the published totals (a wrong width would not), within 1%
    assert sl.anatomy(sl.full("nemotron3_super_slice")).weights() == pytest.approx(SUPER_PARAMS, rel=0.01)
    assert sl.anatomy(sl.full("qwen3_5_122b_slice")).weights() == pytest.approx(QWEN_PARAMS, rel=0.01)


@pytest.mark.parametrize("name", sl.SLICES)
def test_weight_count_is_the_transformers_models(name):
    # the matrices `anatomy` counts are every parameter of two or more dims of the model
    # transformers builds from the config (on the meta device: no memory)
    import torch

    from replayssm.integrations import hf
    model = hf.build(name, dtype=torch.bfloat16, device="meta")
    assert sum(p.numel() for p in model.parameters() if p.dim() >= 2) == sl.anatomy(sl.sliced(name)).weights()


@pytest.mark.parametrize("name", sl.SLICES)
def test_slices_fit_one_80gb_card_with_a_serving_batch(name):
    cfg = sl.sliced(name)
    m = sl.fit(cfg)
    assert 0 < m["weights"] < sl.GPU_BYTES * sl.GPU_SHARE - sl.RESERVE_BYTES
    # batch 256 in one wave in both engines at T = 1, 2, 4 (T - 1 drafts), and for the plugin at 8
    for T in (1, 2, 4):
        assert sl.requests_held(cfg, "stock", T - 1) >= 256
    for T in (1, 2, 4, 8):
        assert sl.requests_held(cfg, "replayssm", T - 1) >= 256
    # stock keeps a state block per verified token: its request grows with T, the plugin's by records only
    stock = [sl.request_bytes(cfg, "stock", d) for d in (0, 1, 3, 7)]
    plugin = [sl.request_bytes(cfg, "replayssm", d) for d in (0, 1, 3, 7)]
    assert stock == sorted(stock) and stock[3] > 6 * stock[0] and plugin[3] < 1.2 * plugin[0]
    # the full model on one card: no room at all
    assert sl.fit(sl.full(name))["cache"] < 0 and sl.requests_held(sl.full(name), "stock") == 0


TINY = dict(model_type="nemotron_h", hidden_size=8, hybrid_override_pattern="M*E", mamba_num_heads=2, mamba_head_dim=4,
            ssm_state_size=2, n_groups=1, conv_kernel=3, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=3, moe_shared_expert_intermediate_size=5,
            n_shared_experts=1, vocab_size=10)


def test_composition_by_hand():
    a = sl.anatomy(TINY)
    # Mamba-2: inner 2x4 = 8, conv dim 8 + 2x1x2 = 12; in_proj 8 x (2x8 + 2x2 + 2), conv 12 x 3, out_proj 8 x 8
    assert a.recurrent_weights == 8 * 22 + 12 * 3 + 64 == 276
    assert a.attention_weights == 8 * 8 + 2 * 8 * 4 + 8 * 8 == 192           # q, k and v, o
    assert a.moe_dense_weights == 8 * 4 + 2 * 8 * 5 and a.expert_weights == 2 * 8 * 3   # router, shared; one expert
    assert (a.state, a.conv, a.kv, a.embed) == (16, 24, 8, 80)
    assert a.weights() == 276 + 192 + 112 + 4 * 48 + 2 * 80
    # batch 2, context 3: fp32 state, bf16 conv state, weights and KV
    got = sl.composition(TINY, batch=2, context=3)
    assert got["recurrent"] == 1 * 2 * 2 * (16 * 4 + 24 * 2) == 448       # read and write, 2 requests
    assert got["attention"] == 1 * 2 * 3 * 8 * 2 == 96                    # K and V of 3 tokens, 2 requests
    assert got["experts"] == pytest.approx(3 * 48 * 2)                    # 4 (1 - (1 - 2/4)^2) = 3 experts
    assert got["dense"] == 2 * (276 + 192 + 112 + 80 + 2 * 8) == 1352     # + the head and 2 embedding rows
    assert got["total"] == pytest.approx(2184)
    assert sum(got[f"share_{k}"] for k in sl.COMPONENTS) == pytest.approx(1.0)
    assert sl.experts_touched(512, 22, 1) == pytest.approx(22) and sl.experts_touched(0, 0, 5) == 0


@pytest.mark.parametrize("name", sl.SLICES)
def test_slice_step_has_the_full_models_shares(name):
    # each per-layer component scales with the fraction of layers kept; only the output head's
    # share grows (it stays whole), so the other shares drop by at most what it gains
    for batch in (64, 256, 512):
        s, f = sl.composition(sl.sliced(name), batch, 2048), sl.composition(sl.full(name), batch, 2048)
        for k in ("recurrent", "attention", "experts"):
            assert s[f"share_{k}"] == pytest.approx(f[f"share_{k}"], rel=0.05)
        assert s["share_dense"] - f["share_dense"] < 0.03
    # and cutting experts instead would not: half the experts at batch 256 halve the expert bytes
    cfg = sl.sliced("qwen3_5_122b_slice")
    half = dict(cfg, num_experts=cfg["num_experts"] // 2)
    assert sl.composition(half, 256, 2048)["experts"] < 0.51 * sl.composition(cfg, 256, 2048)["experts"]


def test_serving_benchmark_serves_the_slices(tmp_path, capsys):
    from replayssm.bench import vllm_serving as vs
    assert set(sl.SLICES) <= set(vs.MODELS)
    nem = json.loads((vs.model_dir("nemotron3_super_slice", 0, tmp_path) / "config.json").read_text())
    assert nem["architectures"] == ["NemotronHForCausalLM"] and nem["hybrid_override_pattern"] == "EMEMEMEMEM*"
    assert nem["moe_latent_size"] == 1024 and not any(k.startswith("_") for k in nem)
    q = json.loads((vs.model_dir("qwen3_5_122b_slice", 4, tmp_path) / "config.json").read_text())
    assert q["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and q["model_type"] == "qwen3_5_moe"
    text = q["text_config"]
    assert text["model_type"] == "qwen3_5_moe_text" and text["num_hidden_layers"] == 4
    assert (text["num_experts"], text["linear_num_value_heads"], text["hidden_size"]) == (256, 64, 3072)
    assert q["vision_config"]["depth"] == 1 and q["tie_word_embeddings"] is False
    assert 3 < vs._vocab(q) < 248320
    # --composition: the table, without vLLM or a GPU
    assert vs.main(["--model", "nemotron3_super_slice", "--composition", "--batches", "256"]) == 0
    out = capsys.readouterr().out
    assert "| recurrent |" in out and "full model: 40 recurrent / 8 attention / 40 moe" in out
    assert "| 4 |" in out


def test_cache_block_tokens():
    """vLLM's block for a hybrid model holds one recurrent state page in bf16 K and V, in
    multiples of 16 tokens. Nemotron-3-Nano-4B: 976 tokens for stock's page (an H100 run's
    prefix cache hit 1,952 tokens of each 2,112-token prompt: two blocks) and 1,056 for the
    plugin's, whose records make the page 7.6% larger; Qwen3.5's stock state is bf16 (vLLM's
    `auto`) where the plugin keeps an fp32 checkpoint and fp32 records."""
    from replayssm.bench import slices as sl
    nano, qwen = sl.sliced("nemotron3_nano_4b"), sl.sliced("qwen3_5_4b")
    assert (sl.cache_block_tokens(nano, "stock"), sl.cache_block_tokens(nano, "replayssm")) == (976, 1056)
    assert (sl.cache_block_tokens(qwen, "stock"), sl.cache_block_tokens(qwen, "replayssm")) == (272, 640)
    # records beside the pages: NemotronH's blocks are stock's; Qwen3.5's fp32 checkpoint still
    # doubles stock's bf16 state
    assert (sl.cache_block_tokens(nano, "replayssm-side"), sl.cache_block_tokens(qwen, "replayssm-side")) == (976, 528)
    for cfg in (nano, qwen):
        for scheme in ("stock", "replayssm", "replayssm-side"):
            n = sl.cache_block_tokens(cfg, scheme)
            per_token = sl.anatomy(cfg).kv * 2
            assert n % 16 == 0 and n * per_token >= sl.state_page_bytes(cfg, scheme) > (n - 16) * per_token
    with pytest.raises(ValueError, match="scheme"):
        sl.cache_block_tokens(nano, "snapshot")
