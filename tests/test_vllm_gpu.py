"""The vLLM plugin's GPU checks with vLLM 0.25.0 (skipped where vLLM, CUDA or the tiny models
are absent; docs/vllm.md says how they run on the H200), and the CPU tests of the
tools they use (`replayssm.integrations.vllm.check`).

Tiny random-weight models (`../shared/vllm/make_models.py`, the folder in
`REPLAYSSM_VLLM_MODELS`): greedy tokens with the plugin against stock vLLM, eager and with CUDA
graphs, on requests of different lengths arriving together; speculative decoding (n-gram,
and NemotronH's multi-token-prediction drafter) against plain decoding. And the wheel: built
from this tree and installed offline beside that vLLM, with its entry point and `vllm` extra.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from replayssm.integrations.vllm.check import (near_tie_divergences, python_requests, tiny_qwen3_5, trained_qwen3_5,
                                               with_mtp_layer)


def test_near_tie_divergences():
    ref = [[5, 6, 7], [1, 2, 3]]
    top2 = [[[[5, -1.0], [9, -3.0]], [[6, -1.0], [8, -1.05]], [[7, -0.5], [4, -2.0]]],
            [[[1, -0.2], [3, -2.5]], [[2, -0.1], [4, -3.0]], [[3, -1.0], [0, -1.01]]]]
    assert near_tie_divergences(ref, top2, ref, 0.1) == []
    # leaving at a near-tie for the runner-up, anything after it not compared
    assert near_tie_divergences(ref, top2, [[5, 8, 0], [1, 2, 0]], 0.1) == []
    assert near_tie_divergences(ref, top2, [[5, 8, 0], [1, 2, 3]], 0.01)[0].startswith("request 0 step 1")
    bad = near_tie_divergences(ref, top2, [[5, 6, 7], [4, 2, 3]], 0.1)       # a clear choice
    assert len(bad) == 1 and bad[0].startswith("request 1 step 0: token 4 where the reference took 1")
    assert near_tie_divergences(ref, top2, [[5, 9, 7], [1, 2, 3]], 0.1)        # not the runner-up
    assert near_tie_divergences(ref, top2, [[5, 6], [1, 2, 3]], 0.1) == ["request 0: 2 tokens against 3"]
    assert near_tie_divergences(ref, top2, ref[:1], 0.1) == ["1 requests against the reference's 2"]


def test_with_mtp_layer(tmp_path):
    """The MTP copy: the target's weights and files unchanged, one attention layer's weights
    under `mtp.layers.0.` at the config's shapes, the config asking for it; only NemotronH."""
    safetensors = pytest.importorskip("safetensors.torch")
    src = tmp_path / "src"
    src.mkdir()
    cfg = {"model_type": "nemotron_h", "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 8, "num_nextn_predict_layers": 0}
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "tokenizer.json").write_text("{}")
    base = {"lm_head.weight": torch.randn(32, 16).to(torch.bfloat16), "backbone.norm_f.weight": torch.ones(16)}
    safetensors.save_file(base, src / "model.safetensors")
    with_mtp_layer(src, tmp_path / "dst")
    got = safetensors.load_file(tmp_path / "dst" / "model.safetensors")
    assert all(torch.equal(got[k], v) for k, v in base.items())
    mtp = {k[len("mtp.layers.0."):]: v for k, v in got.items() if k.startswith("mtp.layers.0.")}
    assert {k: tuple(v.shape) for k, v in mtp.items()} == {
        "eh_proj.weight": (16, 32), "mixer.q_proj.weight": (32, 16), "mixer.k_proj.weight": (16, 16),
        "mixer.v_proj.weight": (16, 16), "mixer.o_proj.weight": (16, 32), "enorm.weight": (16,),
        "hnorm.weight": (16,), "norm.weight": (16,), "final_layernorm.weight": (16,)}
    assert all(v.dtype == torch.bfloat16 for v in mtp.values()) and mtp["mixer.q_proj.weight"].std() > 0
    new = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert (new["num_nextn_predict_layers"], new["mtp_hybrid_override_pattern"]) == (1, "*")
    assert (tmp_path / "dst" / "tokenizer.json").exists()
    (src / "config.json").write_text(json.dumps(dict(cfg, model_type="qwen3_next")))
    with pytest.raises(ValueError, match="NemotronH"):
        with_mtp_layer(src, tmp_path / "other")


def test_tiny_qwen3_5(tmp_path):
    """The tiny Qwen3.5: the class vLLM serves Qwen3.5 with, three GDN layers and one attention
    layer, dense MLPs, the multimodal token ids inside the vocabulary, the tokenizer copied."""
    pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.torch")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "config.json").write_text("{}")
    tiny_qwen3_5(tmp_path / "q", tok)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    text = cfg["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert max(cfg[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                "vision_end_token_id")) < text["vocab_size"]
    names = list(safetensors.load_file(tmp_path / "q" / "model.safetensors"))
    assert any(".linear_attn." in n for n in names) and not any(".experts." in n for n in names)
    assert (tmp_path / "q" / "tokenizer.json").read_text() == "{}"      # only the tokenizer's files copied


def test_trained_qwen3_5_as_vllm_serves_it(tmp_path):
    """A trained byte-level Qwen3.5 (here a fresh 2-layer draft) converted to the class vLLM
    serves: the same logits from the same weights, the multimodal ids on unused vocabulary
    rows, the tokenizer and held-out text beside it."""
    pytest.importorskip("transformers")
    from transformers import Qwen3_5ForConditionalGeneration

    from replayssm.train import models, tokenizer
    src = tmp_path / "src"
    causal = models.build("gdn", draft=True, seed=0).eval().to(torch.bfloat16).float()
    causal.save_pretrained(src)
    tokenizer.save(src)
    (src / "heldout.bin").write_bytes(b"def f(x):\n    return x + 1\n" * 8)
    trained_qwen3_5(src, tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    ids = [cfg[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")]
    assert min(ids) > 258 and max(ids) < cfg["text_config"]["vocab_size"]
    served = Qwen3_5ForConditionalGeneration.from_pretrained(str(tmp_path / "q"), dtype=torch.float32).eval()
    x = torch.tensor([list(b"import os\nprint(os.sep)")])
    with torch.no_grad():
        # (the multimodal class computes its rotary positions otherwise: fp32 noise of 1e-4)
        assert torch.allclose(served(input_ids=x).logits, causal(input_ids=x).logits, atol=1e-3)
    prompts, budgets = python_requests(tmp_path / "q")
    assert len(prompts) == len(budgets) == 12
    held = (src / "heldout.bin").read_bytes()
    assert all(bytes(p["prompt_token_ids"]) in held for p in prompts)


MODELS = os.environ.get("REPLAYSSM_VLLM_MODELS", "")       # make_models.py's output folder


def _run_engine(cmd, env, **kw):
    """`cmd` (a process that starts a vLLM engine) run to its end."""
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, **kw)
    from replayssm.integrations.vllm._compat import START_UP_MEMORY_ERRORS
    if r.returncode != 0 and any(m in r.stdout + r.stderr for m in START_UP_MEMORY_ERRORS):
        # engines started side by side (pytest-xdist) can trip vLLM's start-up memory checks
        # when another one takes or frees memory meanwhile: once more
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, **kw)
    return r


def _generate_lines(path, mode, enabled, extra="{}", **switches) -> dict:
    """What `check.py` printed: its `TOKENS`, `TOP2`, `CACHE` and `SPEC` lines, parsed."""
    env = dict(os.environ, REPLAYSSM_VLLM="1" if enabled else "0", **switches)
    cmd = [sys.executable, "-m", "replayssm.integrations.vllm.check", str(path), mode, extra]
    r = _run_engine(cmd, env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {x.split(" ", 1)[0]: json.loads(x.split(" ", 1)[1]) for x in r.stdout.splitlines()
            if x.startswith(("TOKENS ", "TOP2 ", "CACHE ", "SPEC "))}


def _generate(path, mode, enabled, extra="{}", **switches):
    got = _generate_lines(path, mode, enabled, extra, **switches)
    return got["TOKENS"], got.get("TOP2")


# Qwen3-Next runs in bf16: vLLM 0.25.0's chunked GDN prefill refuses fp32 ("does not support
# float32"), and in bf16 the random tiny model's greedy tokens flip with any rounding
# difference (on the H200 stock's own tokens change in 4 of 12 requests when its SSM state
# goes from bf16 to fp32). Its runs are compared at near-ties instead: a request may leave the
# reference's tokens only where the reference's top two tokens lie within this many nats.
NEAR_TIE_NATS = 0.1


# fp32 runs of a trained model: replay and stock sum the recurrence in different orders, so
# their logits differ by fp32 rounding (about 1e-6 relative); a greedy token may differ only
# where the reference's top two lie closer than this
NEAR_TIE_NATS_FP32 = 1e-3


def _equal_or_near_ties(model, run, reference, nats=None):
    """Assert `run`'s greedy tokens equal `reference`'s (NemotronH) or leave them only at
    near-ties of `nats` (Qwen3-Next: `NEAR_TIE_NATS`; the reference's run carrying `TOP2`);
    prints what it saw."""
    (got, _), (ref, top2) = run, reference
    if nats is None and not model.startswith("qwen"):
        assert got == ref
        return
    bad = near_tie_divergences(ref, top2, got, NEAR_TIE_NATS if nats is None else nats)
    gaps = sorted(abs(s[0][1] - s[1][1]) for req in top2 for s in req)
    left = sum(a != b for a, b in zip(ref, got))
    print(f"{left} of {len(ref)} requests leave the reference; the reference's top-2 gap over its "
          f"{len(gaps)} steps: min {gaps[0]:.4f}, median {gaps[len(gaps) // 2]:.4f} nats")
    assert not bad, bad


def _top2(model) -> dict:
    """The switch that has the reference run of a Qwen model print its top two tokens."""
    return {"REPLAYSSM_VLLM_CHECK_TOP2": "1"} if model.startswith("qwen") else {}


def _needs_vllm():
    pytest.importorskip("vllm", reason="vLLM 0.25.0 is installed only on the GPU machine")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not MODELS:
        pytest.skip("set REPLAYSSM_VLLM_MODELS to make_models.py's output folder")


def _model(name, tmp_path):
    """The model folder `name`: make_models.py's under MODELS, or `qwen3_5_tiny`, built here. A
    folder without weights fails here, not deep inside vLLM's start-up (a carried copy lost them)."""
    if name != "qwen3_5_tiny":
        d = os.path.join(MODELS, name)
        if not any(f.endswith(".safetensors") for f in os.listdir(d)):
            pytest.fail(f"{d} holds no *.safetensors: rebuild it with make_models.py")
        return d
    d = tmp_path / name
    if not d.exists():
        pytest.importorskip("transformers")
        tiny_qwen3_5(d, os.path.join(MODELS, "qwen3_next_tiny"))
    return d


def _kwargs(name, **more) -> str:
    """The LLM keyword arguments for `name` as the JSON `check.py` takes: Qwen's GDN prefill on
    Triton (the Hopper default, FlashInfer, is not in the offline bring-up), Qwen3.5's vision
    tower left out."""
    kw = {"gdn_prefill_backend": "triton"} if name.startswith("qwen") else {}
    if name == "qwen3_5_tiny":
        kw["language_model_only"] = True
    return json.dumps(dict(kw, **more))


@pytest.mark.gpu
@pytest.mark.parametrize("model,mode", [("nemotron_h_tiny", "eager"), ("nemotron_h_tiny", "graph"),
                                        ("qwen3_next_tiny", "eager"), ("qwen3_next_tiny", "graph"),
                                        ("qwen3_5_tiny", "graph")])
def test_vllm_greedy_equals_stock(model, mode, tmp_path):
    """Greedy tokens with the plugin equal stock vLLM's, token for token, on requests of
    different lengths that arrive together and finish at different steps (Qwen models in bf16
    at near-ties, `NEAR_TIE_NATS`)."""
    _needs_vllm()
    path, extra = _model(model, tmp_path), _kwargs(model)
    _equal_or_near_ties(model, _generate(path, mode, True, extra), _generate(path, mode, False, extra, **_top2(model)))


@pytest.mark.gpu
@pytest.mark.parametrize("model,blocks", [("nemotron_h_tiny", "vllm"), ("nemotron_h_tiny", "one"),
                                          ("qwen3_next_tiny", "vllm"), ("qwen3_next_tiny", "one"),
                                          ("qwen3_5_tiny", "one")])
def test_vllm_ngram_speculative_equals_plain(model, blocks, tmp_path):
    """n-gram speculative decoding with the plugin gives the tokens of plain decoding, with
    vLLM's state blocks per request and with one (`REPLAYSSM_VLLM_SPEC_BLOCKS`); Qwen models at
    near-ties, as above (the verify kernel also rounds otherwise than decode)."""
    _needs_vllm()
    path = _model(model, tmp_path)
    spec = _kwargs(model, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                              "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    _equal_or_near_ties(model, _generate(path, "graph", True, spec, REPLAYSSM_VLLM_SPEC_BLOCKS=blocks),
                        _generate(path, "graph", True, _kwargs(model), **_top2(model)))


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["nemotron_h_tiny", "qwen3_next_tiny"])
def test_vllm_ngram_gpu_in_waves_equals_plain(model, tmp_path):
    """vLLM's GPU n-gram drafter (`ngram_gpu`, asynchronous scheduling on) over 48 requests with
    repeating prompts, 12 at a time (`check.wave_requests`): requests join and prefill while
    others verify drafts, rows finish at different steps, blocks are reused by later requests;
    the plugin's tokens equal its plain decoding's (Qwen at near-ties). On the Nemotron-3-Super
    slice at batch 3000 (two waves) the plugin accepted 54% of the drafts where stock accepted
    81%: this is the small form of that run."""
    _needs_vllm()
    path, work = _model(model, tmp_path), {"REPLAYSSM_VLLM_CHECK_WORKLOAD": "waves"}
    spec = _kwargs(model, max_num_seqs=12, speculative_config={
        "method": "ngram_gpu", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    _equal_or_near_ties(model, _generate(path, "graph", True, spec, **work),
                        _generate(path, "graph", True, _kwargs(model, max_num_seqs=12), **work, **_top2(model)))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["trained-nemotron-h", "trained-qwen3-5"])
def test_vllm_trained_model_on_python(name, tmp_path):
    """The shipped trained models in vLLM, on Python prompts from their held-out text
    (`check.python_requests`), CUDA graphs: greedy tokens with the plugin equal stock vLLM's,
    and with n-gram speculation (3 drafts) too; prints the drafts vLLM counted accepted. The
    NemotronH runs in fp32 (near-ties of `NEAR_TIE_NATS_FP32`: a trained model's logits, unlike
    the random tiny model's, may hold close pairs), the Qwen3.5 in bf16 (near-ties, as above)."""
    _needs_vllm()
    from replayssm.integrations import hf
    if name not in hf.trained_names():
        pytest.skip(f"{name} is not shipped")
    qwen = name == "trained-qwen3-5"
    path = tmp_path / "q" if qwen else hf.trained_path(name)
    if qwen:
        trained_qwen3_5(hf.trained_path(name), path)
    kind = "qwen3_5_tiny" if qwen else "nemotron_h_tiny"        # the suite's rules for the family
    more = {} if qwen else {"dtype": "float32"}
    work = {"REPLAYSSM_VLLM_CHECK_WORKLOAD": "python"}
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    stock = _generate(path, "graph", False, _kwargs(kind, **more), **work, REPLAYSSM_VLLM_CHECK_TOP2="1")
    nats = None if qwen else NEAR_TIE_NATS_FP32
    plain = _generate_lines(path, "graph", True, _kwargs(kind, **more), **work)
    drafted = _generate_lines(path, "graph", True, _kwargs(kind, speculative_config=spec, **more), **work)
    print("draft counters:", drafted["SPEC"])
    _equal_or_near_ties(kind, (plain["TOKENS"], None), stock, nats)
    _equal_or_near_ties(kind, (drafted["TOKENS"], None), stock, nats)


@pytest.mark.gpu
@pytest.mark.parametrize("model,mode", [("nemotron_h_tiny", "eager"), ("nemotron_h_tiny", "graph"),
                                        ("qwen3_next_tiny", "eager"), ("qwen3_next_tiny", "graph"),
                                        ("qwen3_5_tiny", "graph")])
def test_vllm_prefix_caching_equals_no_caching(model, mode, tmp_path):
    """Prefix caching of the plugin's state (`mamba_cache_mode="align"`): two waves of requests
    sharing prefixes of varied lengths (`check.prefix_waves`), the second hitting the cache the
    first filled, give the tokens of the same requests without prefix caching. A hit prefills
    only the rest of its prompt, in other chunks than the full prefill, so a request may leave
    the reference at a near-tie (`NEAR_TIE_NATS`), NemotronH's too."""
    _prefix_case(model, mode, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("model,mode", [("nemotron_h_tiny", "eager"), ("nemotron_h_tiny", "graph"),
                                        ("qwen3_next_tiny", "eager"), ("qwen3_next_tiny", "graph")])
def test_vllm_prefix_caching_with_ngram_equals_no_caching(model, mode, tmp_path):
    """Prefix caching with n-gram speculation (`REPLAYSSM_VLLM_PREFIX_SPEC=1`, the plugin's
    step-end commit and boundary copy, `prefix.declare_postprocess`), eager and with CUDA graphs:
    the prefix waves' tokens equal those without prefix caching and without drafts (near-ties
    allowed, as above), with cache hits."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    _prefix_case(model, mode, tmp_path, speculative_config=spec)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_vllm_prefix_caching_all_mode_equals_no_caching(mode, tmp_path):
    """Prefix caching in vLLM's `all` mode (`REPLAYSSM_VLLM_PREFIX_ALL=1`, NemotronH: a state
    in every block, the page moved to the next block where a decode step starts one): the
    prefix waves' tokens equal those without prefix caching (near-ties allowed), with hits."""
    _prefix_case("nemotron_h_tiny", mode, tmp_path, cache_mode="all")


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["nemotron_h_tiny", "qwen3_next_tiny"])
def test_vllm_prefix_caching_side_records_equals_no_caching(model, tmp_path):
    """Prefix caching with the records outside vLLM's pages (`REPLAYSSM_VLLM_PREFIX_RECORDS=side`:
    stock's page, so stock's cache blocks; vLLM's block copy patched to carry the records), CUDA
    graphs: the prefix waves' tokens equal those without prefix caching (near-ties allowed),
    with hits."""
    _prefix_case(model, "graph", tmp_path, records="side")


def _prefix_case(model, mode, tmp_path, cache_mode="align", records="page", **more):
    """The prefix waves with prefix caching in `cache_mode` (and `more` LLM arguments: drafts
    switch the experimental path on) against the plugin without prefix caching: cache hits, and
    tokens equal but at near-ties."""
    _needs_vllm()
    path, work = _model(model, tmp_path), {"REPLAYSSM_VLLM_CHECK_WORKLOAD": "prefix"}
    switch = {"REPLAYSSM_VLLM_PREFIX_SPEC": "1"} if more.get("speculative_config") else {}
    if cache_mode == "all":
        switch["REPLAYSSM_VLLM_PREFIX_ALL"] = "1"
    switch["REPLAYSSM_VLLM_PREFIX_RECORDS"] = records
    on = _generate_lines(path, mode, True, _kwargs(model, enable_prefix_caching=True, mamba_cache_mode=cache_mode,
                                                   **more), **switch, **work)
    off = _generate_lines(path, mode, True, _kwargs(model, enable_prefix_caching=False),
                          REPLAYSSM_VLLM_CHECK_TOP2="1", **work)
    print("prefix cache:", on["CACHE"])
    assert (on["CACHE"].get("prefix_cache_hits") or 0) > 0, on["CACHE"]     # the second wave hit the cache
    bad = near_tie_divergences(off["TOKENS"], off["TOP2"], on["TOKENS"], NEAR_TIE_NATS)
    left = sum(a != b for a, b in zip(off["TOKENS"], on["TOKENS"]))
    print(f"{left} of {len(off['TOKENS'])} requests leave the tokens without prefix caching")
    assert not bad, bad


@pytest.mark.gpu
def test_vllm_mtp_speculative_equals_plain(tmp_path):
    """NemotronH with a multi-token-prediction drafter of random weights (vLLM's `mtp` method,
    3 drafts, asynchronous scheduling on, the accepted counts corrected on the device): its
    drafts are mostly rejected, so rows accept different counts each step, and the plugin's
    tokens must equal plain decoding's."""
    _needs_vllm()
    pytest.importorskip("safetensors")
    model = tmp_path / "nemotron_h_tiny_mtp"
    with_mtp_layer(os.path.join(MODELS, "nemotron_h_tiny"), model)
    spec = '{"speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}'
    _equal_or_near_ties("nemotron_h_tiny", _generate(model, "graph", True, spec), _generate(model, "graph", True))


_INSTALLED_CHECK = r"""
import importlib.metadata as md, json, sys
from packaging.requirements import Requirement
import replayssm
dist = md.distribution("replayssm")
eps = [(e.name, e.value) for e in dist.entry_points if e.group == "vllm.general_plugins"]
extra = [Requirement(r) for r in dist.requires or [] if "extra" in r and Requirement(r).marker.evaluate({"extra": "vllm"})]
unmet = [f"{r.name}{r.specifier}" for r in extra if not r.specifier.contains(md.version(r.name), prereleases=True)]
print(json.dumps({"file": replayssm.__file__, "eps": eps, "extra": [f"{r.name}{r.specifier}" for r in extra],
                  "unmet": unmet}))
"""


@pytest.mark.gpu
def test_wheel_installs_beside_vllm(tmp_path):
    """`pip install replayssm[vllm]` offline beside the vLLM there (the GPU machine has no
    network): the wheel built from this tree, installed without dependencies into a folder
    of its own, declares the `vllm.general_plugins` entry point, imports from there (not from
    the tree), and its `vllm` extra's requirements are met by the installed vLLM."""
    pytest.importorskip("vllm", reason="vLLM 0.25.0 is installed only on the GPU machine")
    import shutil
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # built from a copy of what the wheel takes: setuptools keeps a build/ folder in the source
    # tree, whose stale files would land in the wheel
    src = tmp_path / "src"
    shutil.copytree(os.path.join(repo, "replayssm"), src / "replayssm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(repo, f), src / f)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "w"), str(src)],
                   check=True, cwd=tmp_path)
    wheel = next((tmp_path / "w").glob("replayssm-*.whl"))
    subprocess.run(pip + ["install", "--no-deps", "--no-index", "--target", str(tmp_path / "site"), str(wheel)],
                   check=True, cwd=tmp_path)
    # the installed copy first; the tree itself off the path
    path = [str(tmp_path / "site")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                       if p and os.path.abspath(p) != repo]
    r = subprocess.run([sys.executable, "-c", _INSTALLED_CHECK], capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    print(got)
    assert got["file"].startswith(str(tmp_path / "site"))
    assert got["eps"] == [["replayssm", "replayssm.integrations.vllm:register"]]
    assert got["extra"] == ["vllm==0.25.0"] and got["unmet"] == []


_FRONT_END = r"""
import json, sys, torch
from vllm.engine.arg_utils import EngineArgs
from vllm.plugins import load_general_plugins
load_general_plugins()                    # vLLM's plugins, replayssm's register() among them
from replayssm.integrations import vllm as plugin
EngineArgs(model=sys.argv[1], max_model_len=512).create_engine_config()   # what LLM() does before its engine starts
print("FRONT " + json.dumps({"cuda": torch.cuda.is_initialized(), "registered": plugin.status()["registered"]}))
"""


@pytest.mark.gpu
def test_plugin_leaves_cuda_uninitialised_in_the_front_end():
    """vLLM's front-end with the plugin on, as stock: once its plugins are loaded and the
    engine's config made, CUDA is not initialised (vLLM would otherwise spawn its workers,
    which fails in a script without an `if __name__ == "__main__":` guard)."""
    _needs_vllm()
    got = {}
    for on in ("1", "0"):
        r = subprocess.run([sys.executable, "-c", _FRONT_END, os.path.join(MODELS, "nemotron_h_tiny")],
                           env=dict(os.environ, REPLAYSSM_VLLM=on), capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        got[on] = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("FRONT "))[6:])
    assert got["0"] == {"cuda": False, "registered": False}
    assert got["1"] == {"cuda": False, "registered": True}


_NO_GUARD = """\
import json, os, sys
from vllm import LLM, SamplingParams
share = float(os.environ.get("REPLAYSSM_VLLM_CHECK_GPU_MEMORY", "0.3"))
llm = LLM(model=sys.argv[1], gpu_memory_utilization=share, max_model_len=512, max_num_seqs=16, seed=0)
outs = llm.generate([{"prompt_token_ids": list(range(10, 14 + 3 * i))} for i in range(8)],
                    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


@pytest.mark.gpu
def test_offline_script_without_main_guard_runs_with_the_plugin(tmp_path):
    """A user's offline script as stock vLLM runs it, with no `if __name__ == "__main__":`
    guard: with the plugin on it starts (vLLM keeps forking its engine process), the plugin
    is active there (its state blocks give the KV cache another size than stock's), and its
    greedy tokens equal stock's (CUDA graphs)."""
    _needs_vllm()
    script = tmp_path / "offline.py"
    script.write_text(_NO_GUARD)
    runs = {}
    for on in ("1", "0"):
        r = _run_engine([sys.executable, str(script), os.path.join(MODELS, "nemotron_h_tiny")],
                        env=dict(os.environ, REPLAYSSM_VLLM=on), cwd=tmp_path)
        text = r.stdout + r.stderr
        assert r.returncode == 0, text[-4000:]
        assert "CUDA is initialized" not in text and "bootstrapping phase" not in text
        size = [x.split("GPU KV cache size:")[1].strip() for x in text.splitlines() if "GPU KV cache size:" in x]
        runs[on] = (json.loads(next(x for x in r.stdout.splitlines() if x.startswith("TOKENS "))[7:]), size)
    assert runs["1"][0] == runs["0"][0]
    assert runs["1"][1] and runs["1"][1] != runs["0"][1]
