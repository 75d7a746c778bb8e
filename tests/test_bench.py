"""The decode benchmark's bookkeeping, on the CPU without timing or kernels: `--input-dtype`
reaches the token inputs and outputs of both schemes and every result row, while the layer
parameters and the state stay fp32 (the kernels themselves take bf16 token inputs in
tests/test_ops_*.py)."""
import pytest
import torch

from replayssm.bench import decode


@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", ["nemotron3-nano-30b", "qwen3.5-4b", "kimi-linear-48b"])
def test_measure_honours_input_dtype(monkeypatch, shape, input_dtype):
    cases = []

    class Recorded(decode.Case):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            cases.append(self)

    monkeypatch.setattr(decode, "Case", Recorded)
    monkeypatch.setattr(decode, "graph_time_us", lambda fn, reps=20, warmup=2: 1.0)  # no kernels
    rows = decode.measure(shape, 2, 2, "staggered", torch.bfloat16, 1, input_dtype=input_dtype, device="cpu")
    name = str(input_dtype).replace("torch.", "")
    assert [r["scheme"] for r in rows] == ["conventional", "replay"]
    assert all(r["input_dtype"] == name and r["record_dtype"] == "bfloat16" for r in rows)
    (case,) = cases
    for step in case.steps:                 # the same tensors feed both schemes
        assert step and all(t.dtype == input_dtype for t in step.values()), {k: t.dtype for k, t in step.items()}
    assert case.out.dtype == input_dtype
    params = [case.params.A, case.params.dt_bias, case.params.D] if case.family == "mamba2" else \
        [case.params.A_log, case.params.dt_bias]
    assert all(p.dtype == torch.float32 for p in params)
    assert case.state.dtype == case.ckpt.dtype == case.buf_ld.dtype == torch.float32
    assert case.buf_w.dtype == case.buf_k.dtype == torch.bfloat16


def test_input_dtype_option_defaults_to_bf16():
    with pytest.raises(SystemExit):         # only bfloat16 and float32
        decode.main(["--input-dtype", "float16"])
    assert decode.Case.__init__.__kwdefaults__["input_dtype"] is torch.bfloat16


@pytest.mark.parametrize("shape", ["mamba2/4/2/16/32", "gdn/4/2/16/32", "kda/2/2/16/16"])
def test_verify_benchmark_steps_run_every_scheme(monkeypatch, shape):
    # the verify benchmark's three steps run their kernels (interpreted on the CPU) with the
    # arguments the kernels take; time is stubbed, each step runs once per "timing"
    from replayssm.bench import verify

    monkeypatch.setattr(verify, "graph_time_us", lambda fn, reps=20, warmup=2: (fn(), 1.0)[1])
    rows = verify.measure(shape, 3, 4, 2, [1, 2], rounds=1, reps=1, device="cpu")
    assert [(r["scheme"], r["accepted"]) for r in rows] == [
        ("conventional", 1), ("replay", 1), ("replay", 2), ("snapshot", 1), ("snapshot", 2)]
    assert all(r["finite"] for r in rows)
    fam, HV, Hk, V, K = (int(x) if x.isdigit() else x for x in shape.split("/"))
    state = HV * V * K * 4
    mem = {r["scheme"]: r["bytes_per_sequence"] for r in rows}
    assert mem["snapshot"] == 3 * state and mem["conventional"] == state
    ld = (4 + 2) * HV * (K if fam == "kda" else 1) * 4
    assert mem["replay"] == state + ld + (4 + 2) * (HV * V + Hk * K) * 2     # bf16 records
    assert all(r["us_per_accepted_token"] == r["us_per_step"] / r["accepted"] for r in rows)


def test_model_benchmark_bookkeeping(monkeypatch, tmp_path):
    # the whole-model benchmark on a tiny config on the CPU: the stock prefill (in chunks), each
    # scheme continuing from the same cache, rows and the results file; timing stubbed (each
    # "timing" runs the step once), conventional 2 us and replay 1 us
    pytest.importorskip("transformers")
    import json

    from replayssm.bench import model as mb
    from replayssm.integrations import hf

    built = {}
    build = hf.build
    monkeypatch.setattr(hf, "build", lambda *a, **k: built.setdefault("m", build(*a, **k)))

    def stub(fn, reps=20, warmup=2):
        fn()
        return 2.0 if hf.replay_state(built["m"]).scheme == "conventional" else 1.0
    monkeypatch.setattr(mb, "eager_time_us", stub)
    out = tmp_path / "model.json"
    mb.main(["--device", "cpu", "--dtype", "float32", "--models", "tiny_nemotron_h", "--batches", "1,3",
             "--contexts", "5,9", "--prefill-tokens", "6", "--reps", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert {"benchmark", "device", "command", "git_commit", "date", "torch", "triton"} <= set(doc)
    assert doc["benchmark"] == "model" and "not measured" in doc["speculative"]
    rows = doc["rows"]
    assert [(r["context"], r["batch"], r["scheme"]) for r in rows] == [
        (c, b, s) for c in (5, 9) for b in (1, 3) for s in ("conventional", "replay")]
    for r in rows:
        assert r["model"] == "tiny_nemotron_h" and r["timing"] == "eager"
        assert r["us_per_step"] == (2.0 if r["scheme"] == "conventional" else 1.0)
        assert r["ratio_vs_conventional"] == (1.0 if r["scheme"] == "conventional" else 2.0)
        assert r["first_token_agreement"] == 1.0             # both schemes decode the same first token
    assert out.with_suffix(".png").exists()


def test_model_benchmark_prefill_in_chunks_equals_one_pass():
    pytest.importorskip("transformers")
    from replayssm.bench import model as mb
    from replayssm.integrations import hf

    for name in ("tiny_nemotron_h", "tiny_qwen3_5"):
        model = hf.build(name)
        _, whole = mb.prefill(model, 3, 9, prefill_tokens=1000)
        _, chunked = mb.prefill(model, 3, 9, prefill_tokens=6)              # 2 positions per forward
        ids = torch.randint(3, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
        assert torch.equal(whole, chunked), name
        assert torch.equal(whole[:, 0], model(ids).logits[:, -1].argmax(-1)), name


def test_model_benchmark_cli(monkeypatch, capsys):
    from replayssm import cli
    from replayssm.bench import model as mb

    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "model", "--help"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("usage: replayssm bench model ")
    with pytest.raises(SystemExit) as exc:
        mb.main(["--models", "llama-7b"])
    assert exc.value.code == 2 and "unknown model 'llama-7b'" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="replayssm bench model: error: .*CUDA") as exc:
        cli.main(["bench", "model"])
    assert "\n" not in str(exc.value)


def test_verify_benchmark_variants_get_their_own_rows(monkeypatch):
    from replayssm.bench import verify

    monkeypatch.setattr(verify, "graph_time_us", lambda fn, reps=20, warmup=2: (fn(), 1.0)[1])
    rows = verify.measure("mamba2/4/2/16/32", 2, 4, 2, [2], rounds=1, reps=1, device="cpu", snapshot=False,
                          variants=[{"BV": 16, "num_warps": 1}, {"BV": 3}])
    plain = [r for r in rows if r["scheme"] == "replay" and "config" not in r]
    good = [r for r in rows if r.get("config") == {"BV": 16, "num_warps": 1}]
    bad = [r for r in rows if r.get("config") == {"BV": 3}]
    assert len(plain) == len(good) == len(bad) == 1
    assert "us_per_step" in good[0] and "BV" in bad[0]["error"]   # a refused config is a row, not a crash
