"""`replayssm bench vllm` (replayssm.bench.vllm_serving): the pieces that run without vLLM (the
model folder, the prompts, the engines' switches, retry and failure log, argument checks)."""
from __future__ import annotations

import json

import pytest


def test_serving_benchmark_model_folder_and_prompts(tmp_path):
    # `replayssm bench vllm`'s pieces that run without vLLM: the dummy-weight model folder (the
    # shipped config cut to its first layers) and the prompts (repeating ones for n-gram drafts)
    from replayssm.bench import vllm_serving as vs
    cfg = json.loads((vs.model_dir("nemotron3_nano_4b", 6, tmp_path) / "config.json").read_text())
    assert cfg["architectures"] == ["NemotronHForCausalLM"] and cfg["num_hidden_layers"] == 6
    assert cfg["hybrid_override_pattern"] == "M-M-M-" and cfg["mamba_num_heads"] == 96
    whole = json.loads((vs.model_dir("nemotron3_nano_4b", 0, tmp_path) / "config.json").read_text())
    assert whole["num_hidden_layers"] == 42 and not any(k.startswith("_") for k in whole)
    with pytest.raises(ValueError, match="unknown model"):
        vs.model_dir("qwen3_next", 0, tmp_path)
    # NemotronH's MTP drafter: one attention layer beside the target's (dummy weights)
    mtp = json.loads((vs.model_dir("nemotron3_super_slice", 0, tmp_path / "m", mtp=True) / "config.json").read_text())
    assert (mtp["num_nextn_predict_layers"], mtp["mtp_hybrid_override_pattern"]) == (1, "*")
    assert "num_nextn_predict_layers" not in whole or not whole["num_nextn_predict_layers"]
    with pytest.raises(ValueError, match="NemotronH"):
        vs.model_dir("qwen3_5_4b", 0, tmp_path, mtp=True)
    assert vs._vocab(whole) == 131072
    # Qwen3.5-4B as vLLM serves it: the multimodal class around the shipped text config
    pytest.importorskip("transformers")
    q = json.loads((vs.model_dir("qwen3_5_4b", 8, tmp_path) / "config.json").read_text())
    assert q["architectures"] == ["Qwen3_5ForConditionalGeneration"] and q["model_type"] == "qwen3_5"
    text = q["text_config"]
    assert text["num_hidden_layers"] == 8 and text["layer_types"].count("linear_attention") == 6
    assert (text["linear_num_value_heads"], text["linear_value_head_dim"], text["hidden_size"]) == (32, 128, 2560)
    assert q["vision_config"]["out_hidden_size"] == 2560 and q["vision_config"]["depth"] == 1
    assert 3 < vs._vocab(q) == min(q["image_token_id"], q["video_token_id"], q["vision_start_token_id"]) < 248320
    three = json.loads((vs.model_dir("qwen3_5_4b", 3, tmp_path) / "config.json").read_text())["text_config"]
    assert three["layer_types"] == ["linear_attention"] * 3
    ps = vs.prompts(3, 20, 1000, repeat=True)
    assert len(ps) == 3 and all(len(p["prompt_token_ids"]) == 20 for p in ps)
    assert ps[0]["prompt_token_ids"][:7] == ps[0]["prompt_token_ids"][7:14]
    assert vs.prompts(2, 9, 50, repeat=False)[0]["prompt_token_ids"] != vs.prompts(2, 9, 50, repeat=True)[0]["prompt_token_ids"]
    # CUDA graphs at the timed batches and, with drafts, at their verify steps' token counts
    assert vs.capture_sizes([64, 256, 512], 3) == [64, 256, 512, 1024, 2048]
    assert vs.capture_sizes([64, 256], None) == [64, 256]


def test_serving_benchmark_engine_retry_and_failure_log(tmp_path, monkeypatch):
    # an engine that trips vLLM's start-up memory check runs once more; one that fails otherwise
    # leaves its whole output beside --out and its root cause (not the front end's last words)
    # in the rows
    import subprocess
    import types
    from replayssm.bench import vllm_serving as vs
    from replayssm.integrations.vllm._compat import START_UP_MEMORY_ERRORS
    calls, envs = [], []

    def run(outputs):
        def fake(cmd, **kw):
            calls.append(cmd)
            envs.append(kw.get("env") or {})
            out = outputs[min(len(calls), len(outputs)) - 1]
            return types.SimpleNamespace(returncode=0 if "RESULT" in out else 1, stdout=out, stderr="")
        return fake

    monkeypatch.setattr(vs.time, "sleep", lambda s: None)
    args = vs.parser().parse_args(["--batches", "8", "--out", str(tmp_path / "r.json")])
    ok = 'INFO Maximum concurrency for 1,032 tokens per request: 812.50x\nRESULT {"batch": 8, "tokens_per_s": 5.0}'
    monkeypatch.setattr(subprocess, "run", run([f"ValueError: {START_UP_MEMORY_ERRORS[2]}", ok]))
    rows = vs._run_engine(args, "stock", "none", tmp_path)
    assert len(calls) == 2 and rows[0]["tokens_per_s"] == 5.0 and rows[0]["max_concurrency"] == 812.5
    calls.clear()
    boom = "INFO start\n(EngineCore pid=7) ERROR Traceback (most recent call last):\nKeyError: 'x'\n" \
           "RuntimeError: Engine core initialization failed. See root cause above."
    monkeypatch.setattr(subprocess, "run", run([boom]))
    rows = vs._run_engine(args, "replayssm", "ngram", tmp_path)
    assert len(calls) == 1 and rows[0]["tokens_per_s"] is None
    assert rows[0]["error"].startswith("rc 1: (EngineCore pid=7) ERROR Traceback") and "KeyError" in rows[0]["error"]
    assert (tmp_path / "r.replayssm_ngram.log").read_text().startswith("INFO start")
    # each plugin scheme's engine gets its switches (stock none)
    monkeypatch.delenv("REPLAYSSM_VLLM_SPEC_BLOCKS", raising=False)
    monkeypatch.delenv("REPLAYSSM_VLLM_PREFIX_RECORDS", raising=False)
    monkeypatch.setattr(subprocess, "run", run([ok]))
    envs.clear()
    for scheme in ("replayssm-one-block", "replayssm", "stock", "replayssm-side"):
        vs._run_engine(args, scheme, "ngram", tmp_path)
    assert [(e["REPLAYSSM_VLLM"], e.get("REPLAYSSM_VLLM_SPEC_BLOCKS"), e.get("REPLAYSSM_VLLM_PREFIX_RECORDS"))
            for e in envs] == [("1", "one", "page"), ("1", "vllm", "page"), ("0", None, None), ("1", "one", "side")]
    # prefix caching and the shared prefix reach the worker's command line
    calls.clear()
    args = vs.parser().parse_args(["--batches", "8", "--prefix-caching", "--shared-prefix", "2048",
                                   "--out", str(tmp_path / "r.json")])
    vs._run_engine(args, "stock", "none", tmp_path)
    assert "--prefix-caching" in calls[0] and calls[0][calls[0].index("--shared-prefix") + 1] == "2048"
    worker = vs.parser().parse_args(calls[0][3:])
    assert worker.worker and worker.prefix_caching and worker.shared_prefix == [2048]
    # a sweep of prefix lengths: the worker gets them all; the block size vLLM chose reaches the
    # rows, and a failed engine leaves a row per (batch, prefix)
    calls.clear()
    args = vs.parser().parse_args(["--batches", "8,16", "--prefix-caching", "--shared-prefix", "1000,2048",
                                   "--out", str(tmp_path / "r.json")])
    two = ("INFO Setting attention block size to 976 tokens to ensure that attention page size is >= mamba page size.\n"
           'RESULT {"batch": 8, "shared_prefix": 1000, "tokens_per_s": 5.0}')
    monkeypatch.setattr(subprocess, "run", run([two]))
    rows = vs._run_engine(args, "stock", "none", tmp_path)
    assert calls[0][calls[0].index("--shared-prefix") + 1] == "1000,2048" and rows[0]["block_size"] == 976
    monkeypatch.setattr(subprocess, "run", run([boom]))
    rows = vs._run_engine(args, "stock", "none", tmp_path)
    assert [(r["batch"], r["shared_prefix"]) for r in rows] == [(8, 1000), (8, 2048), (16, 1000), (16, 2048)]
    # equal blocks asked of every engine: the worker gets them, and a row without vLLM's log line
    # (it kept the size asked for) carries that size
    calls.clear()
    args = vs.parser().parse_args(["--batches", "8", "--block-size", "1056", "--out", str(tmp_path / "r.json")])
    monkeypatch.setattr(subprocess, "run", run([ok]))
    rows = vs._run_engine(args, "stock", "none", tmp_path)
    assert vs.parser().parse_args(calls[0][3:]).block_size == 1056 and rows[0]["block_size"] == 1056
    # an engine killed at --timeout: the points it measured stay, the rest carry the error
    args = vs.parser().parse_args(["--batches", "8", "--shared-prefix", "1000,2048", "--timeout", "5",
                                   "--out", str(tmp_path / "r.json")])

    def slow(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"], output=two.encode(), stderr=b"INFO compiling")
    monkeypatch.setattr(subprocess, "run", slow)
    rows = vs._run_engine(args, "stock", "none", tmp_path)
    assert [r.get("tokens_per_s") for r in rows] == [5.0, None] and rows[0]["block_size"] == 976
    assert rows[1]["error"].startswith("rc -9") and "killed after 5 s" in rows[1]["error"]


def test_shared_prefix_prompts():
    from replayssm.bench import vllm_serving as vs
    a, b = vs.prompts(2, 5, 100, repeat=False), vs.prompts(2, 5, 100, repeat=False, seed=1)
    pa, pb = vs.with_prefix(a, 30, 100), vs.with_prefix(b, 30, 100)
    assert all(len(p["prompt_token_ids"]) == 35 for p in pa + pb)
    assert pa[0]["prompt_token_ids"][:30] == pa[1]["prompt_token_ids"][:30] == pb[0]["prompt_token_ids"][:30]
    assert pa[0]["prompt_token_ids"][30:] == a[0]["prompt_token_ids"] != pb[0]["prompt_token_ids"][30:]
    # a prefix of another length is another prefix from its first tokens (no cross hits)
    assert vs.with_prefix(a, 40, 100)[0]["prompt_token_ids"][:8] != pa[0]["prompt_token_ids"][:8]
    with pytest.raises(SystemExit):
        vs.parser().parse_args(["--shared-prefix", "1000,-5"])


def test_serving_benchmark_refuses_unknown_choices(capsys):
    from replayssm.bench import vllm_serving as vs
    for argv, what in ((["--schemes", "stock,fast"], "--schemes: unknown 'fast'"),
                       (["--speculative", "eagle"], "--speculative: unknown 'eagle'"),
                       (["--warmup", "-1"], "must be >= 0, got -1"),
                       # vLLM's own GDN prefill grid: 64 value heads x 1024 sequences > 65535
                       (["--model", "qwen3_5_122b_slice", "--batches", "256,1024"], "more than 1023 sequences"),
                       (["--prefix-caching", "--speculative", "none,ngram"], "not yet combine prefix caching"),
                       (["--model", "qwen3_5_4b", "--speculative", "mtp"], "the MTP drafter is NemotronH's")):
        with pytest.raises(SystemExit) as e:
            vs.main(argv)
        assert e.value.code == 2 and what in capsys.readouterr().err


def test_serving_benchmark_batch_limits_and_acceptance():
    from replayssm.bench import vllm_serving as vs
    assert vs.gdn_batch_limit("qwen3_5_4b") == 2047 and vs.gdn_batch_limit("nemotron3_super_slice") is None
    row = {"spec_decode_num_draft_tokens_delta": 400, "spec_decode_num_accepted_tokens_delta": 300}
    assert vs.acceptance(row) == 0.75 and vs.acceptance({"tokens_per_s": 1.0}) is None


def test_serving_benchmark_replot(tmp_path, capsys):
    """`--replot` draws a results file's plot (no vLLM, no GPU); a file with no timed rows is
    refused rather than drawn empty."""
    pytest.importorskip("matplotlib")
    from replayssm.bench import vllm_serving as vs
    rows = [dict(batch=b, scheme=s, speculative=sp, tokens_per_s=t, profiled=p)
            for b, s, sp, t, p in ((256, "stock", "ngram", 100.0, False), (512, "stock", "ngram", 90.0, False),
                                   (256, "replayssm-one-block", "ngram", 150.0, False),
                                   (512, "replayssm-one-block", "ngram", 200.0, False),
                                   (256, "replayssm", "none", 120.0, True))]
    src = tmp_path / "r.json"
    src.write_text(json.dumps({"vllm": "0.25.0", "model": "m", "device": "d", "git_commit": "abc", "rows": rows}))
    assert vs.main(["--replot", str(src)]) == 0
    png = tmp_path / "r.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "wrote" in capsys.readouterr().out
    src.write_text(json.dumps({"rows": [dict(rows[-1])]}))            # only a profiled row
    with pytest.raises(ValueError, match="no timed rows"):
        vs.main(["--replot", str(src)])


def test_serving_worker_prompt_sets(tmp_path, monkeypatch, capsys):
    """The worker's runs per (batch, prefix) on a stand-in of vLLM's `LLM`: behind a shared
    prefix the warm-up, the first-token run and (with prefix caching) the decode run each take
    their own prompts after the same prefix, so the decode run's prefill finds the cache as the
    first-token run found it; a row per point, with its prefix."""
    import sys
    import types
    from replayssm.bench import vllm_serving as vs
    seen, made = [], []

    class LLM:
        def __init__(self, **kw):
            made.append(kw)

        def generate(self, ps, sp, use_tqdm=False):
            seen.append((sp.max_tokens, [p["prompt_token_ids"] for p in ps]))
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[1] * sp.max_tokens)]) for _ in ps]

        def get_metrics(self):
            return []

    class SamplingParams:
        def __init__(self, max_tokens, **kw):
            self.max_tokens = max_tokens

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams))
    folder = vs.model_dir("nemotron3_nano_4b", 2, tmp_path)
    for caching in (True, False):
        seen.clear()
        args = vs.parser().parse_args(["--worker", "--model-dir", str(folder), "--batches", "2", "--prompt", "5",
                                       "--decode", "3", "--warmup", "4", "--speculative", "none",
                                       "--shared-prefix", "0,30", *(["--prefix-caching"] if caching else [])])
        assert vs.worker(args) == 0
        rows = [json.loads(x[len("RESULT "):]) for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT ")]
        assert [(r["batch"], r["shared_prefix"], r["decode_tokens"]) for r in rows] == [(2, 0, 6), (2, 30, 6)]
        assert [n for n, _ in seen] == [4, 1, 4] * 2                 # warm-up, first token, decode
        warm, first, full = (ids for _, ids in seen[3:])            # the point with a 30-token prefix
        assert {p[:30] for p in map(tuple, warm + first + full)} == {tuple(first[0][:30])}
        assert warm[0][30:] != first[0][30:]
        assert (full == first) is not caching                        # a third set only with caching on
        # no prefix: the warm-up is the timed set, unless caching is on (then all three differ)
        assert (seen[0][1] == seen[1][1]) is not caching and len(seen[0][1][0]) == 5
        assert (seen[2][1] == seen[1][1]) is not caching
    # the MTP drafter's config (no prompt lookup); CUDA graphs at its verify steps too
    args = vs.parser().parse_args(["--worker", "--model-dir", str(folder), "--batches", "2", "--prompt", "5",
                                   "--decode", "3", "--warmup", "0", "--speculative", "mtp", "--drafts", "3"])
    assert vs.worker(args) == 0
    assert made[-1]["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    assert made[-1]["compilation_config"]["cudagraph_capture_sizes"] == [2, 8]
