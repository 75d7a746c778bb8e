"""The whole-model benchmark's bookkeeping (`replayssm bench model`), on the CPU with tiny
transformers models and the timing stubbed: rows, schemes, the results file, the command line,
and memory handed back between schemes."""
import pytest
import torch


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
             "--contexts", "5,9", "--prefill-tokens", "6", "--reps", "1", "--spec-batches", "2",
             "--drafts", "3", "--accepted", "2", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert {"benchmark", "device", "command", "git_commit", "date", "torch", "triton"} <= set(doc)
    assert doc["benchmark"] == "model" and "T = 3 tokens per round, 2 kept" in doc["speculative"]
    spec = doc["speculative_rows"]
    assert [(r["context"], r["batch"], r["scheme"]) for r in spec] == [
        (c, 2, s) for c in (5, 9) for s in ("snapshot", "replay")]
    for r in spec:
        assert r["T"] == 3 and r["accepted"] == 2 and r["us_per_round"] == 1.0
        assert r["tokens_per_s"] == 2 * 2 / 1.0 * 1e6 and r["ratio_vs_snapshot"] == 1.0
        assert r["verify_agreement"] == 1.0                  # both schemes verify to the same tokens
    hf.enable(built["m"], scheme="conventional")
    state = sum(layer.pool.memory_per_sequence()["conventional"] for layer in hf.replay_state(built["m"]).layers.values())
    assert spec[0]["bytes_per_sequence"] == 4 * state                   # T + 1 states per sequence
    assert spec[1]["bytes_per_sequence"] > state                        # a checkpoint plus records
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


def test_model_benchmark_short_prefill_fills_the_rest_of_the_context():
    # `real`: the first positions prefilled through the model (their keys/values and recurrent
    # states equal a prefill of those tokens alone), the rest of the context random keys/values,
    # and the attention layers' length at the whole context
    pytest.importorskip("transformers")
    from transformers.cache_utils import StaticLayer

    from replayssm.bench import model as mb
    from replayssm.integrations import hf
    model = hf.build("tiny_qwen3_5")
    short, _ = mb.prefill(model, 2, 9, real=4, steps=3)
    alone, first = mb.prefill(model, 2, 4, steps=8)
    layers = [(a, b) for a, b in zip(short.layers, alone.layers) if isinstance(a, StaticLayer)]
    assert layers
    for a, b in layers:
        assert torch.equal(a.keys[:, :, :4], b.keys[:, :, :4]) and torch.equal(a.values[:, :, :4], b.values[:, :, :4])
        assert int(a.cumulative_length) == 9
        filled = a.keys[:, :, 4:9]
        assert filled.abs().sum() > 0 and filled.std() > 0.2 * a.keys[:, :, :4].std()
        assert a.keys[:, :, 9:].abs().sum() == 0                  # the decode steps' room untouched
    with pytest.raises(ValueError, match="real must be >= 0"):
        mb.prefill(model, 2, 9, real=-1)


def test_model_benchmark_no_recurrence_skips_the_state_step():
    # the floor scheme: the recurrent pools' decode never runs (their state untouched), the
    # model still steps; its row carries no token agreement
    pytest.importorskip("transformers")
    from replayssm.bench import model as mb
    from replayssm.integrations import hf
    model = hf.build("tiny_nemotron_h")
    rows = mb.measure("tiny_nemotron_h", [2], [5], ("conventional", "replay", "no-recurrence"), device="cpu",
                      dtype=torch.float32, reps=1, graphs=False, model=model)
    by = {r["scheme"]: r for r in rows}
    assert set(by) == {"conventional", "replay", "no-recurrence"} and by["no-recurrence"]["us_per_step"] > 0
    assert "first_token_agreement" not in by["no-recurrence"] and by["replay"]["first_token_agreement"] == 1.0
    hf.enable(model, scheme="replay", num_slots=2)
    cache, first = mb.prefill(model, 2, 5, steps=4)
    hf.attach_cache(model, cache)
    state = hf.replay_state(model)
    mb._skip_recurrence(state, 2, first.device)
    before = [layer.pool.cursor.clone() for layer in state.layers.values()]
    model(input_ids=first, past_key_values=cache, cache_position=torch.tensor([5]), use_cache=True)
    assert all(torch.equal(b, layer.pool.cursor) for b, layer in zip(before, state.layers.values()))
    hf.disable(model)
    # the floor of a speculative round: the recurrent layers' verify and commit skipped too
    hf.enable(model, scheme="replay", num_slots=2, max_draft=3)
    cache, first = mb.prefill(model, 2, 5, steps=6)
    hf.attach_cache(model, cache)
    state = hf.replay_state(model)
    mb._skip_recurrence(state, 2, first.device, T=3)
    before = [(layer.pool.cursor.clone(), layer.pool.pending.clone()) for layer in state.layers.values()]
    state.verifying = True
    logits = model(input_ids=first.expand(2, 3), past_key_values=cache, cache_position=torch.arange(5, 8),
                   use_cache=True).logits
    state.verifying = False
    state.commit(cache._replayssm_binding, torch.full((2,), 2, dtype=torch.int32))
    assert logits.shape[:2] == (2, 3) and torch.isfinite(logits).all()
    assert all(torch.equal(c, layer.pool.cursor) and torch.equal(p, layer.pool.pending)
               for (c, p), layer in zip(before, state.layers.values()))
    hf.disable(model)
    spec = mb.measure_speculative("tiny_nemotron_h", [2], [5], T=3, accepted=2, device="cpu", dtype=torch.float32,
                                  reps=1, graphs=False, model=model, schemes=("snapshot", "no-recurrence"))
    assert spec[1]["scheme"] == "no-recurrence" and spec[1]["us_per_round"] > 0
    assert spec[1]["verify_agreement"] is None and spec[1]["bytes_per_sequence"] is None


def test_model_benchmark_low_precision_read_schemes(monkeypatch):
    # replay-FMT: the replay scheme with a low-precision copy of the checkpoint that non-flush
    # steps read (the pools built with that lp_format), the row naming the format
    pytest.importorskip("transformers")
    from replayssm.bench import model as mb
    from replayssm.integrations import hf
    model = hf.build("tiny_nemotron_h")
    seen = []
    enable = hf.enable

    def spy(m, **kw):
        enable(m, **kw)
        seen.append({getattr(layer.pool, "lp_format", "n/a") for layer in hf.replay_state(m).layers.values()})
    monkeypatch.setattr(hf, "enable", spy)
    rows = mb.measure("tiny_nemotron_h", [2], [5], ("conventional", "replay", "replay-fp16", "replay-fp8"),
                      device="cpu", dtype=torch.float32, reps=1, graphs=False, model=model)
    assert [r["scheme"] for r in rows] == ["conventional", "replay", "replay-fp16", "replay-fp8"]
    assert [r["lp_format"] for r in rows] == [None, None, "fp16", "fp8_e4m3"]
    assert seen == [{"n/a"}, {None}, {"fp16"}, {"fp8_e4m3"}]
    assert all(r["us_per_step"] > 0 and 0 <= r["first_token_agreement"] <= 1 for r in rows)
    assert rows[1]["first_token_agreement"] == 1.0          # fp32 reads: the conventional tokens
    seen.clear()
    spec = mb.measure_speculative("tiny_nemotron_h", [2], [5], T=3, accepted=2, device="cpu", dtype=torch.float32,
                                  reps=1, graphs=False, model=model, schemes=("snapshot", "replay-bf16"))
    assert [(r["scheme"], r["lp_format"]) for r in spec] == [("snapshot", None), ("replay-bf16", "bf16")]
    assert seen[1] == {"bf16"} and spec[1]["ratio_vs_snapshot"] > 0 and spec[1]["verify_agreement"] is not None
    with pytest.raises(ValueError, match="snapshot first"):
        mb.measure_speculative("tiny_nemotron_h", [2], [5], device="cpu", model=model, schemes=("replay",))


def test_model_benchmark_frees_each_scheme_before_the_next(monkeypatch):
    # every scheme's pools must be gone when the next scheme allocates its own: on the H200 the
    # snapshot scheme's T + 1 states, still referenced, left no room for the replay pools
    pytest.importorskip("transformers")
    import gc
    import weakref
    from replayssm.bench import model as mb
    from replayssm.integrations import hf
    model = hf.build("tiny_nemotron_h")
    enable, earlier, alive = hf.enable, [], []

    def spy(m, **kw):
        gc.collect()
        alive.append(sum(r() is not None for r in earlier))
        enable(m, **kw)
        earlier.extend(weakref.ref(layer.pool) for layer in hf.replay_state(m).layers.values())
    monkeypatch.setattr(hf, "enable", spy)
    mb.measure_speculative("tiny_nemotron_h", [2], [5], T=3, accepted=2, device="cpu", dtype=torch.float32,
                           reps=1, graphs=False, model=model, schemes=("snapshot", "replay", "replay-fp16"))
    mb.measure("tiny_nemotron_h", [2], [5], ("conventional", "replay"), device="cpu", dtype=torch.float32,
               reps=1, graphs=False, model=model)
    assert len(alive) == 5 and alive == [0] * 5


def test_model_benchmark_scheme_without_room_gets_a_skipped_row(monkeypatch):
    pytest.importorskip("transformers")
    from replayssm.bench import model as mb
    from replayssm.integrations import hf
    model = hf.build("tiny_nemotron_h")
    enable = hf.enable

    def no_room(m, **kw):
        if kw.get("lp_format") == "fp16":
            raise torch.OutOfMemoryError("no room")
        enable(m, **kw)
    monkeypatch.setattr(hf, "enable", no_room)
    rows = mb.measure("tiny_nemotron_h", [2], [5], ("conventional", "replay-fp16", "replay"), device="cpu",
                      dtype=torch.float32, reps=1, graphs=False, model=model)
    assert [r["us_per_step"] is None for r in rows] == [False, True, False]
    assert rows[1]["timing"].startswith("skipped: the replay-fp16 scheme's state") and rows[2]["ratio_vs_conventional"]


def test_model_benchmark_cli(monkeypatch, capsys):
    from replayssm import cli
    from replayssm.bench import model as mb

    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "model", "--help"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("usage: replayssm bench model ")
    with pytest.raises(SystemExit) as exc:
        mb.main(["--models", "llama-7b"])
    assert exc.value.code == 2 and "unknown model 'llama-7b'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        mb.main(["--spec-schemes", "snapshot,replay-fp4"])
    assert exc.value.code == 2 and "unknown speculative scheme 'replay-fp4'" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="replayssm bench model: error: .*CUDA") as exc:
        cli.main(["bench", "model"])
    assert "\n" not in str(exc.value)


def test_model_benchmark_batches_zero_and_spec_contexts(monkeypatch, tmp_path, capsys):
    # `--batches 0` leaves the decode rows out, `--spec-batches 0` the speculative ones (as the
    # help says), and `--spec-contexts` gives the speculative rows their own contexts
    pytest.importorskip("transformers")
    import json

    from replayssm.bench import model as mb
    monkeypatch.setattr(mb, "eager_time_us", lambda fn, reps=20, warmup=2: (fn(), 1.0)[1])
    out = tmp_path / "model.json"
    common = ["--device", "cpu", "--dtype", "float32", "--models", "tiny_nemotron_h", "--contexts", "9",
              "--reps", "1", "--drafts", "2", "--accepted", "1", "--out", str(out)]
    mb.main(common + ["--batches", "0", "--spec-batches", "2", "--spec-contexts", "5"])
    doc = json.loads(out.read_text())
    assert doc["rows"] == [] and not out.with_suffix(".png").exists()
    assert [(r["context"], r["batch"]) for r in doc["speculative_rows"]] == [(5, 2), (5, 2)]
    mb.main(common + ["--batches", "1", "--spec-batches", "0"])
    doc = json.loads(out.read_text())
    assert [(r["context"], r["batch"]) for r in doc["rows"]] == [(9, 1), (9, 1)]
    assert doc["speculative_rows"] == [] and doc["speculative"] == "not measured"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        mb.main(common + ["--batches", "0", "--spec-batches", "0"])
    assert exc.value.code == 2 and "nothing to measure" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mb.main(common + ["--batches", "0,64"])


def _forward_fails_above(model, tokens: int, calls: list):
    """Make `model`'s forward raise CUDA's out-of-memory error on more than `tokens` tokens a
    forward, as transformers' torch scans do at serving batches; `calls` records the sizes."""
    forward = model.forward

    def guarded(*args, input_ids=None, **kwargs):
        calls.append(input_ids.shape[1])
        if input_ids.shape[1] > tokens:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 768.00 GiB")
        return forward(*args, input_ids=input_ids, **kwargs)
    model.forward = guarded


def test_model_benchmark_prefill_out_of_memory_retries_with_fewer_tokens():
    # a prefill forward that runs out of memory is retried from a fresh cache with half the
    # tokens a forward, down to what fits: the same cache as a prefill at that size
    pytest.importorskip("transformers")
    from transformers.cache_utils import StaticLayer

    from replayssm.bench import model as mb
    from replayssm.integrations import hf
    model = hf.build("tiny_nemotron_h")
    want, want_first = mb.prefill(model, 3, 9, prefill_tokens=6)           # 2 positions a forward
    calls = []
    _forward_fails_above(model, 2, calls)
    got, first = mb.prefill(model, 3, 9, prefill_tokens=1000)
    assert calls[:3] == [9, 4, 2] and got._replayssm_prefill_tokens == 2
    assert torch.equal(first, want_first)
    layers = [(a, b) for a, b in zip(got.layers, want.layers) if isinstance(a, StaticLayer)]
    assert layers and all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in layers)


def test_model_benchmark_point_whose_prefill_cannot_fit_is_skipped_with_its_reason(monkeypatch, tmp_path):
    # a point whose stock prefill fails even at one token a forward is a row that says so,
    # decode and speculative alike, and the run goes on to write its results
    pytest.importorskip("transformers")
    import json

    from replayssm.bench import model as mb
    from replayssm.integrations import hf
    build = hf.build

    def failing(*a, **k):
        m = build(*a, **k)
        _forward_fails_above(m, 0, [])
        return m
    monkeypatch.setattr(hf, "build", failing)
    out = tmp_path / "model.json"
    mb.main(["--device", "cpu", "--dtype", "float32", "--models", "tiny_qwen3_5", "--batches", "2",
             "--contexts", "5", "--reps", "1", "--spec-batches", "2", "--drafts", "2", "--accepted", "1",
             "--out", str(out)])
    doc = json.loads(out.read_text())
    rows = doc["rows"] + doc["speculative_rows"]
    assert len(rows) == 4
    assert all(r["timing"] == mb.PREFILL_OOM and r.get("us_per_step", r.get("us_per_round")) is None for r in rows)
