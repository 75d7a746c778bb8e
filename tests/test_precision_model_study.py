"""The model-level precision study (replayssm.bench.precision_model_study): KL divergence of a
tiny hybrid model's next-token distributions against the fp32 replay state, CPU, reference pools."""
import json

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from replayssm.bench import precision_model_study as pms  # noqa: E402

transformers.logging.set_verbosity_error()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: intra-op threads only contend on 2 busy cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _by(rows, **match):
    return [r for r in rows if all(r[k] == v for k, v in match.items())]


def test_every_design_at_a_tiny_nemotron_h():
    rows = pms.run("tiny_nemotron_h", tokens=24, prefill=8, backend="reference")
    variants = pms.variants()
    steps = pms.checkpoints(24)
    assert len(rows) == len(variants) * len(steps)
    for v in variants:
        got = _by(rows, **v)
        assert [r["tokens"] for r in got] == steps, v
        assert all(r["kl"] is not None and r["kl"] >= 0 and r["first_nonfinite"] is None for r in got), v
        assert all(r["family"] == "mamba2" and r["model"] == "tiny_nemotron_h" for r in got)
    # the reference's own design, run again: exactly the reference
    assert all(r["kl"] == 0 and r["kl_at"] == 0 and r["top1_agree"] == 1 for r in _by(rows, design="replay-fp32"))
    nvfp4 = _by(rows, design="shared", read_format="nvfp4", rounding="nearest")
    fp16 = _by(rows, design="separate", read_format="fp16")
    conv = _by(rows, design="conventional-fp32")
    assert all(r["kl"] > 0 for r in nvfp4 + fp16)
    # fp32 reordered (the conventional recurrence) stays below an fp16 read, which stays far
    # below a shared NVFP4 checkpoint (measured means: 3.3e-14, 1.1e-10, 1.1e-5)

    def mean(rs):
        return sum(r["kl"] for r in rs) / len(rs)
    assert mean(conv) < 0.1 * mean(fp16)
    assert mean(fp16) < 1e-3 * mean(nvfp4)
    # the replay designs stayed on the window (eager step off) and conventional-lowp is window 1
    assert {r["window"] for r in rows} == {16}
    assert pms.enable_options(_by(rows, design="conventional-lowp")[0], 16)["window"] == 1


def test_gdn_skips_nvfp4_and_keeps_to_the_time_budget():
    skipped = []
    rows = pms.run("tiny_qwen3_5", tokens=40, prefill=6, designs=("replay-fp32", "separate"),
                   lp_formats=("fp16", "nvfp4"), backend="reference", time_budget=1e-9, skipped=skipped)
    assert skipped and skipped[0]["format"] == "nvfp4" and "8" in skipped[0]["why"]
    assert {(r["design"], r["read_format"]) for r in rows} == {("replay-fp32", "fp32"), ("separate", "fp16")}
    assert max(r["tokens"] for r in rows) == 16          # the budget stopped the reference at its first check
    assert all(r["family"] == "gdn" for r in rows)
    assert _by(rows, design="separate", tokens=16)[0]["kl"] > 0


def test_kl_after_the_pass_equals_kl_per_step():
    g = torch.Generator().manual_seed(0)
    ref, got = torch.randn(7, 3, 11, generator=g), torch.randn(7, 3, 11, generator=g)
    got[4, 1] = float("nan")
    kl, agree = pms._compare(ref, got, chunk=70)          # chunks of 2 steps
    for t in range(7):
        want = pms.kl_div(ref[t], got[t]).mean()
        assert torch.equal(kl[t], want) or (kl[t].isnan() and want.isnan())
        assert agree[t] == (got[t].argmax(-1) == ref[t].argmax(-1)).double().mean()
    assert kl[4].isnan() and kl[:4].isfinite().all() and kl[5:].isfinite().all()


def test_cli_writes_json_and_plot(tmp_path):
    from replayssm import cli
    out = tmp_path / "pm.json"
    cli.main(["study", "precision-model", "--models", "tiny_nemotron_h", "--tokens", "6", "--prefill", "4",
              "--designs", "replay-fp32,shared", "--formats", "nvfp4", "--device", "cpu", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "precision_model_study"
    assert {r["design"] for r in doc["rows"]} == {"replay-fp32", "shared"}
    assert {"design", "family", "read_format", "hp_format", "rounding", "tokens", "kl"} <= set(doc["rows"][0])
    assert out.with_suffix(".png").stat().st_size > 0
    with pytest.raises(SystemExit):
        cli.main(["study", "precision-model", "--designs", "shared,bogus"])


def test_parts_side_by_side_merge_into_one_study(tmp_path, capsys, monkeypatch):
    # runs side by side, each a share of the variants, merged into one study (one commit named
    # for both: a checkout with local changes would otherwise give each part a note of its own)
    from replayssm import cli
    monkeypatch.setenv("REPLAYSSM_COMMIT", "0123abc")
    common = ["study", "precision-model", "--models", "tiny_nemotron_h", "--tokens", "4", "--prefill", "2",
              "--formats", "fp16", "--device", "cpu", "--no-plot"]
    cli.main(common + ["--designs", "separate", "--out", str(tmp_path / "a.json")])
    cli.main(common + ["--designs", "shared", "--out", str(tmp_path / "b.json")])
    out = tmp_path / "m.json"
    cli.main(["study", "precision-model", "--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
              "--out", str(out)])
    doc = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert [(r["design"], r["rounding"]) for r in doc["rows"] if r["tokens"] == 4] == \
        [("separate", "nearest"), ("shared", "nearest"), ("shared", "stochastic")]
    assert [p["steps"] for p in doc["parts"]] == [4, 4] and len(doc["parts"][1]["variants"]) == 2
    assert all(p["command"] and p["date"] and p["device"] for p in doc["parts"])     # each part's provenance
    assert "git_commit_note" not in doc                                   # one tree ran both
    assert doc["slow_read_warnings"] == []                                # the CPU: no GPU read speed to warn of
    two = [json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json")]
    two[0]["slow_read_warnings"], two[1]["slow_read_warnings"] = ["w1", "w2"], ["w2", "w3"]
    assert pms.merge(two)["slow_read_warnings"] == ["w1", "w2", "w3"]    # each part's, once
    assert "shared" in capsys.readouterr().out.splitlines()[-1]
    # parts of different studies are refused
    cli.main(common[:-1] + ["--designs", "shared", "--window", "4", "--out", str(tmp_path / "c.json")])
    with pytest.raises(ValueError, match="window"):
        pms.merge([json.loads((tmp_path / n).read_text()) for n in ("a.json", "c.json")])


def test_cli_variants_pick_design_format_pairs(tmp_path, capsys):
    from replayssm import cli
    out = tmp_path / "v.json"
    cli.main(["study", "precision-model", "--models", "tiny_qwen3_5", "--tokens", "4", "--prefill", "2",
              "--variants", "replay-fp32,separate:fp8_e4m3,conventional-lowp:bf16", "--device", "cpu",
              "--backend", "reference", "--no-plot", "--out", str(out)])
    got = {(r["design"], r["read_format"], r["rounding"]) for r in json.loads(out.read_text())["rows"]}
    assert got == {("replay-fp32", "fp32", "nearest"), ("separate", "fp8_e4m3", "nearest"),
                   ("conventional-lowp", "bf16", "nearest"), ("conventional-lowp", "bf16", "stochastic")}
    for bad in ("separate", "shared:fp12", "bogus:fp16", ","):
        with pytest.raises(SystemExit):
            cli.main(["study", "precision-model", "--variants", bad, "--out", str(out)])
    assert "DESIGN:FORMAT" in capsys.readouterr().err


def test_cli_config_overrides(tmp_path, capsys):
    # the tiny NemotronH with the full models' time-step range: recorded, and a key its config
    # lacks refused before anything runs
    from replayssm import cli
    out = tmp_path / "pm.json"
    cli.main(["study", "precision-model", "--models", "tiny_nemotron_h", "--tokens", "4", "--prefill", "2",
              "--designs", "separate", "--formats", "fp16", "--device", "cpu", "--no-plot", "--out", str(out),
              "--config", "time_step_min=0.001", "--config", "time_step_max=0.1"])
    doc = json.loads(out.read_text())
    assert doc["config_overrides"] == {"time_step_min": 0.001, "time_step_max": 0.1}
    assert doc["device"].startswith("CPU: ") and len(doc["device"]) > len("CPU: ")     # the machine, named
    for bad in (["--config", "time_step_minimum=0.001"], ["--config", "novalue"]):
        with pytest.raises(SystemExit):
            cli.main(["study", "precision-model", "--models", "tiny_nemotron_h", "--out", str(out)] + bad)
    assert "time_step_minimum" in capsys.readouterr().err
    assert pms._override("a=[1, 2]") == ("a", [1, 2]) and pms._override("b=fast") == ("b", "fast")


def test_overrides_reach_the_model():
    # a shorter memory (larger steps) changes what an fp16 read costs: the override is built in
    kw = dict(tokens=8, prefill=4, designs=("separate",), lp_formats=("fp16",), backend="reference")
    base = pms.run("tiny_nemotron_h", **kw)
    long = pms.run("tiny_nemotron_h", overrides={"time_step_min": 0.001, "time_step_max": 0.1}, **kw)
    assert [r["kl"] for r in base] != [r["kl"] for r in long]


@pytest.mark.interpret
@pytest.mark.slow          # 30 s of interpreter: the kernels are checked against the reference elsewhere
def test_kernels_give_the_reference_kl():
    # the GPU path (interpreted): the precision kernels under the integration, window 4 so that
    # five steps cross a flush; the kernels' rounding streams are the reference's
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")
    kw = dict(tokens=5, prefill=4, window=4, designs=("separate", "conventional-lowp"), lp_formats=("bf16", "nvfp4"))
    got = pms.run("tiny_nemotron_h", backend="triton", **kw)
    ref = pms.run("tiny_nemotron_h", backend="reference", **kw)
    assert {r["backend"] for r in got} == {"triton"} and {r["backend"] for r in ref} == {"reference"}
    assert len(got) == len(ref) == 4 * len(pms.checkpoints(5))      # separate x 2, bf16 state RN, SR
    for a, b in zip(got, ref):
        assert (a["design"], a["read_format"], a["rounding"], a["tokens"]) == \
            (b["design"], b["read_format"], b["rounding"], b["tokens"])
        assert b["kl"] > 0 and abs(a["kl"] - b["kl"]) <= 0.05 * b["kl"], (a, b)


def _passes(name, device, tokens=10, prefill=6, graphs=False, **enable):
    """Logits of the dynamic-cache pass and of the static-cache pass of one enabled design."""
    from replayssm.bench import forced
    from replayssm.integrations import hf
    model = hf.build(name, seed=0, device=device)
    ids = torch.randint(3, model.config.vocab_size, (2, prefill + tokens), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    static = forced.StaticPass(model, ids, prefill, graphs=graphs)
    static.prefill_cache()
    hf.enable(model, window=4, max_draft=1, eager_max_batch=0, num_slots=2, **enable)
    got = [x.clone() for x in static.steps(tokens)]
    hf.enable(model, window=4, max_draft=1, eager_max_batch=0, num_slots=2, **enable)
    ref = [x.clone() for x in forced.DynamicPass(model, ids, prefill).steps(tokens)]
    return torch.stack(got), torch.stack(ref), static.timing


@pytest.mark.parametrize("name", ["tiny_nemotron_h", "tiny_qwen3_5"])
def test_static_cache_pass_equals_the_dynamic_one(name):
    # one stock prefill into a static cache, then the enabled design seeded from it, against the
    # enabled model's own prefill and steps on the dynamic cache: the same logits at every step
    # (10 steps of window 4: flushes included)
    got, ref, timing = _passes(name, "cpu", backend="reference")
    assert timing.startswith("eager: static cache")
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5), (got - ref).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny_nemotron_h", "tiny_qwen3_5"])
@pytest.mark.parametrize("enable", [{}, {"lp_format": "fp8_e4m3"}, {"hp_format": "bf16", "hp_rounding": "stochastic"}],
                         ids=["replay", "separate-fp8", "shared-bf16-sr"])
def test_graph_replayed_pass_equals_the_eager_one(name, enable):
    # the study's CUDA-graph steps (captured on the second step, replayed after) against eager
    # steps of the same design: flushes and stochastic-rounding streams follow the device state
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    got, ref, timing = _passes(name, "cuda", tokens=40, graphs=True, **enable)
    assert timing == "cuda_graph", timing
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5), (got - ref).abs().max()


def _lockstep(name, device, graphs, tokens=12, prefill=6, least_keys=1024):
    """Logits of three designs' passes, each alone and then side by side (`forced.Lockstep`)."""
    from replayssm.bench import forced
    from replayssm.integrations import hf
    ids = torch.randint(3, 64, (2, prefill + tokens), generator=torch.Generator().manual_seed(2)).to(device)
    designs = [{}, {"lp_format": "fp16"}, {"hp_format": "bf16", "hp_rounding": "stochastic"}]

    def prepared(opts):
        model = hf.build(name, seed=0, device=device)
        p = forced.StaticPass(model, ids, prefill, graphs=graphs)
        p.prefill_cache()
        hf.enable(model, window=4, max_draft=1, eager_max_batch=0, num_slots=2, seed=0, **opts)
        return p
    alone = [torch.stack([x.clone() for x in prepared(o).steps(tokens)]) for o in designs]
    lock = forced.Lockstep([prepared(o) for o in designs], graphs=graphs, least_keys=least_keys)
    together = torch.stack([x.clone() for x in lock.steps(tokens)])
    return together, alone, lock.timing


def test_copies_side_by_side_step_as_each_alone():
    # every copy keeps its own cache, pools and rounding stream: stepped together, each copy's
    # logits are those of its pass alone (12 steps of window 4: flushes included), but for the
    # rounding of attention over the keys written so far rather than the whole static cache
    # attention reads 8, then 16, then all 18 cache positions: the prefix grows under the pass
    together, alone, timing = _lockstep("tiny_qwen3_5", "cpu", graphs=False, least_keys=8)
    assert timing.startswith("eager") and together.shape[1] == 3
    for i, a in enumerate(alone):
        assert torch.allclose(together[:, i], a, rtol=1e-5, atol=1e-5), (i, (together[:, i] - a).abs().max())
    assert (alone[0] - alone[2]).abs().max() > 1e-4     # the designs differ by more than the tolerance


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny_nemotron_h", "tiny_qwen3_5"])
def test_copies_in_one_graph_step_as_each_alone(name):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    together, alone, timing = _lockstep(name, "cuda", graphs=True, tokens=40, least_keys=16)   # 3 graphs
    assert timing.startswith("cuda_graph"), timing
    for i, a in enumerate(alone):
        assert torch.allclose(together[:, i], a, rtol=1e-5, atol=1e-5), (i, (together[:, i] - a).abs().max())


def test_prefix_attention_equals_sdpa_over_the_whole_cache():
    # one decoded token, grouped query heads, over the written prefix of a static cache: stock
    # SDPA over every position (unwritten ones masked) gives the same output
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from replayssm.bench import forced
    g = torch.Generator().manual_seed(3)
    B, H, kv, D, S, pos = 2, 4, 2, 8, 64, 20
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(B, kv, S, D, generator=g), torch.randn(B, kv, S, D, generator=g)
    mask = (torch.arange(S) <= pos).expand(B, 1, 1, S)

    class Attn(torch.nn.Module):
        num_key_value_groups = H // kv
    m = Attn()
    want, _ = sdpa_attention_forward(m, q, k, v, mask, scaling=0.3)
    m.prefix_keys = forced.prefix_length(pos + 1, S, least=32)
    assert m.prefix_keys == 32
    got, _ = forced._prefix_attention(m, q, k, v, mask, scaling=0.3)
    assert got.shape == want.shape == (B, 1, H, D)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    k[:, :, pos + 1:] = 1e4          # what the step does not read cannot move it
    got2, _ = forced._prefix_attention(m, q, k, v, mask, scaling=0.3)
    assert torch.allclose(got2, got, rtol=1e-5, atol=1e-6)
    assert [forced.prefix_length(n, 131136) for n in (1, 1024, 1025, 131072, 131073)] == \
        [1024, 1024, 2048, 131072, 131136]
