"""transformers hybrid models on ReplaySSM state (replayssm.integrations.hf), CPU, fp32,
tiny random-weight models of every supported class."""
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from replayssm.integrations import hf  # noqa: E402
from replayssm.pool import SlotPool  # noqa: E402

transformers.logging.set_verbosity_error()

TINY = [n for n in hf.config_names() if n.startswith("tiny_")]
# one per recurrence family (and Qwen3-Next's fused projections) for the costlier checks
FAMILIES = ["tiny_nemotron_h", "tiny_qwen3_5", "tiny_qwen3_next", "tiny_kimi_linear"]
# fp32 against stock fp32: the pools reorder the same arithmetic (window replay instead of
# read-update-write); measured at most 2.6e-6 relative (KDA) over 64 steps
LOGIT_RTOL = 1e-5
VOCAB = 64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: intra-op threads only contend (20x slower linears on 2 busy cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(name, seed=0, **kw):
    m = hf.build(name, seed=seed, **kw)
    m.generation_config.eos_token_id = None          # fixed-length outputs unless a test sets EOS
    return m


def _prompt(n, seed=1, batch=1):
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, n, **kw):
    return model.generate(ids, max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                          output_logits=True, **kw)


class _Count:
    """Counts pool decode / verify calls, so a test can fail when the pools are bypassed."""

    def __init__(self, monkeypatch):
        self.n = {"decode": 0, "verify": 0}
        for op in self.n:
            orig = getattr(SlotPool, op)

            def wrap(pool, *a, _op=op, _orig=orig, **k):
                self.n[_op] += 1
                return _orig(pool, *a, **k)
            monkeypatch.setattr(SlotPool, op, wrap)


def _noisy_copy(name, scale):
    """A draft that agrees with the target on part of the tokens: the same weights, a
    perturbed output head."""
    d = _model(name)
    with torch.no_grad():
        w = d.get_output_embeddings().weight
        w.add_(scale * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(7)))
    return d


@pytest.mark.parametrize("name", TINY)
def test_greedy_matches_stock(name, monkeypatch):
    model = _model(name)
    ids = _prompt(10)
    ref = _greedy(model, ids, 64)
    count = _Count(monkeypatch)
    hf.enable(model)
    got = _greedy(model, ids, 64)
    assert count.n["decode"] > 0
    assert torch.equal(got.sequences, ref.sequences)
    lr, lg = torch.stack(ref.logits), torch.stack(got.logits)
    assert ((lg - lr).norm() / lr.norm()).item() < LOGIT_RTOL


@pytest.mark.parametrize("name", FAMILIES)
def test_speculative_greedy_equals_greedy(name, monkeypatch):
    target = _model(name)
    ids = _prompt(10)
    ref = _greedy(target, ids, 40).sequences
    hf.enable(target, max_draft=4)
    count = _Count(monkeypatch)
    out, stats = hf.speculative_generate(target, ids, draft=_noisy_copy(name, 0.6), num_draft=4,
                                         max_new_tokens=40, return_stats=True)
    assert torch.equal(out, ref)
    # drafts were both accepted and rejected: rollback ran in the pools and the conv history
    assert 0 < stats["accepted"] < stats["proposed"]
    assert count.n["verify"] > 0
    lookup = hf.speculative_generate(target, ids, num_draft=3, max_new_tokens=40)
    assert torch.equal(lookup, ref)


@pytest.mark.parametrize("name", ["tiny_nemotron_h", "tiny_qwen3_5", "tiny_kimi_linear"])
def test_draft_proposals_see_stock_logits(name):
    """A draft proposes by verifying `[last]`, `[last, d1]`, ... from its committed state: every
    step's logits are stock's for the same tokens. (A first step that committed `last` fed it
    twice to the next: logits off by several units, drafts that the target mostly rejected.)"""
    from replayssm.integrations.hf.speculative import _Runner
    d = _model(name)
    ids = _prompt(10)
    ref = _greedy(d, ids, 5)
    hf.enable(d, max_draft=4)
    seen = []

    def pick(logits):
        seen.append(logits)
        return logits.argmax(-1), None
    r = _Runner(d, torch.ones_like(ids))
    with torch.no_grad():
        last = r.prefill(ids).argmax(-1)
        drafts, _ = r.propose(last, 4, pick)
    r.release()
    assert [int(last)] + drafts[0].tolist() == ref.sequences[0, 10:].tolist()
    for got, want in zip(seen, ref.logits[1:]):
        assert ((got - want).norm() / want.norm()).item() < LOGIT_RTOL
    # one draft a round: its one-token verify stays pending until the commit
    target = _model(name)
    want = _greedy(target, ids, 12).sequences
    hf.enable(target, max_draft=4)
    assert torch.equal(hf.speculative_generate(target, ids, draft=d, num_draft=1, max_new_tokens=12), want)


def test_prompt_lookup_proposes_only_after_a_long_enough_match():
    from replayssm.integrations.hf.speculative import _lookup
    assert _lookup([1, 2, 3, 9, 1, 2, 3], 2, 3, 3) == ([9, 1], True)
    assert _lookup([1, 2, 3, 9, 5, 2, 3], 2, 3, 3) == ([3, 3], False)
    assert _lookup([1, 2, 3, 9, 5, 2, 3], 2, 3, 2) == ([9, 5], True)
    target = _model("tiny_qwen3_5")
    ids = _prompt(10)
    ref = _greedy(target, ids, 24).sequences
    hf.enable(target, max_draft=4)
    # no 10-token repeat in these 34 tokens: every round a plain step, nothing proposed
    out, st = hf.speculative_generate(target, ids, num_draft=4, max_new_tokens=24, ngram=10, min_ngram=10,
                                      return_stats=True)
    assert torch.equal(out, ref) and st == {"rounds": 23, "proposed": 0, "accepted": 0}
    # down to 1-token matches (the default): rounds after a token seen before propose, the others
    # are plain steps
    out, st = hf.speculative_generate(target, ids, num_draft=4, max_new_tokens=24, return_stats=True)
    assert torch.equal(out, ref) and 0 < st["proposed"] < 4 * st["rounds"] and st["proposed"] % 4 == 0
    with pytest.raises(ValueError, match="min_ngram"):
        hf.speculative_generate(target, ids, num_draft=4, ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="vocabulary"):
        hf.speculative_generate(target, ids, draft=_model("tiny_qwen3_5", vocab_size=VOCAB + 1), num_draft=4)


def _padded(lengths, seed=3):
    L = max(lengths)
    ids = torch.zeros(len(lengths), L, dtype=torch.long)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, L - n:] = _prompt(n, seed=seed + b)[0]
        mask[b, L - n:] = 1
    return ids, mask


@pytest.mark.parametrize("name", FAMILIES)
def test_batched_padding_equals_per_sequence(name):
    model = hf.enable(_model(name), max_draft=4)
    lengths = [10, 6, 3]
    ids, mask = _padded(lengths)
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    spec = hf.speculative_generate(model, ids, attention_mask=mask, draft=_noisy_copy(name, 0.6),
                                   num_draft=4, max_new_tokens=24)
    for b, n in enumerate(lengths):
        single = model.generate(ids[b:b + 1, -n:], max_new_tokens=24, do_sample=False)
        assert torch.equal(batched[b, -24:], single[0, -24:]), b
        assert torch.equal(spec[b, -24:], single[0, -24:]), b


def test_finished_rows_free_their_slots():
    name = "tiny_qwen3_5"
    model = hf.enable(_model(name), max_draft=4, num_slots=4)
    ids, mask = _padded([8, 5])
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    eos = int(plain[0, ids.shape[1] + 4])              # row 0 stops after its fifth token
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)
    state = hf.replay_state(model)
    freed = []
    orig = state.free
    state.free = lambda slots: (freed.append(slots.tolist()), orig(slots))
    out = hf.speculative_generate(model, ids, attention_mask=mask, num_draft=3, max_new_tokens=20,
                                  eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out[:, :ref.shape[1]], ref)
    assert (out[:, ref.shape[1]:] == 0).all()
    assert len(freed[0]) == 1 and len(freed) >= 2     # row 0 freed alone, before the end
    assert sorted(state.free_slots) == list(range(state.num_slots))


def test_generate_frees_finished_rows_at_once():
    # stock generate on an enabled model: a row that emits EOS gives its slot back at once (its
    # later tokens are padding the pools skip); tokens equal stock transformers'
    import gc
    name = "tiny_qwen3_5"
    model = _model(name)
    ids, mask = _padded([8, 5])
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    eos = int(plain[0, ids.shape[1] + 4])              # row 0 stops after its fifth token
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)
    hf.enable(model, num_slots=4)
    state = hf.replay_state(model)
    freed, steps = [], []
    orig = state.free
    state.free = lambda slots: (freed.append((len(steps), slots.tolist())), orig(slots))
    layer = next(iter(state.layers.values()))
    dec = layer.pool.decode
    layer.pool.decode = lambda *a, **k: (steps.append(1), dec(*a, **k))[1]
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)
    assert torch.equal(out, ref)
    first_eos = ref[0, ids.shape[1]:].tolist().index(eos)
    assert len(freed[0][1]) == 1 and freed[0][0] <= first_eos + 1 < len(steps)   # row 0 alone, early
    gc.collect()
    assert sorted(state.free_slots) == list(range(state.num_slots))
    hf.disable(model)
    assert "generate" not in vars(model)


def test_disable_restores_stock(monkeypatch):
    model = _model("tiny_nemotron_h")
    ids = _prompt(10)
    ref = _greedy(model, ids, 16)
    hf.enable(model)
    assert any("forward" in vars(m) for m in model.modules())
    hf.disable(model)
    assert not hf.is_enabled(model)
    assert not any("forward" in vars(m) for m in model.modules())
    count = _Count(monkeypatch)
    got = _greedy(model, ids, 16)
    assert count.n["decode"] == 0
    assert torch.equal(got.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, ref.logits))


def test_unsupported_models_raise():
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(hf.UnsupportedModelError, match="LlamaForCausalLM"):
        hf.enable(llama)
    mamba1 = transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=32, hidden_size=16, state_size=4, num_hidden_layers=1))
    with pytest.raises(hf.UnsupportedModelError, match="MambaMixer"):
        hf.enable(mamba1)
    with pytest.raises(ValueError, match="not enabled"):
        hf.speculative_generate(llama, torch.ones(1, 2, dtype=torch.long))


def test_speculative_sampling_keeps_target_distribution():
    """Joint law of the first three sampled tokens: exact (enumerated with the target) against
    4000 speculative samples with a draft of another seed (q far from p)."""
    V, n = 8, 4000
    # Mamba-2: the stock GDN/KDA chunked prefill costs seconds at batch 4000 on the CPU
    target = _model("tiny_nemotron_h", seed=0, vocab_size=V)
    draft = _model("tiny_nemotron_h", seed=5, vocab_size=V)
    prompt = torch.tensor([[3, 5, 1, 6, 2]])
    with torch.no_grad():
        # every continuation t1 t2 of the prompt in one batch: p(t1), p(t2|t1), p(t3|t1,t2)
        pre = torch.cartesian_prod(torch.arange(V), torch.arange(V))
        full = torch.cat([prompt.expand(V * V, -1), pre], dim=1)
        logits = target(full).logits.float()
    p1 = logits[0, prompt.shape[1] - 1].softmax(-1)
    p2 = logits[::V, prompt.shape[1]].softmax(-1)                  # [t1, t2]
    p3 = logits[:, prompt.shape[1] + 1].softmax(-1).reshape(V, V, V)
    exact = p1[:, None, None] * p2[:, :, None] * p3                 # [t1, t2, t3]
    hf.enable(target, max_draft=2)
    out, stats = hf.speculative_generate(target, prompt.expand(n, -1), draft=draft, num_draft=2, max_new_tokens=3,
                                         do_sample=True, generator=torch.Generator().manual_seed(0),
                                         return_stats=True)
    toks = out[:, -3:]
    assert 0 < stats["accepted"] < stats["proposed"]
    emp = torch.zeros(V, V, V, dtype=torch.float64)
    emp.index_put_(tuple(toks.T), torch.ones(n, dtype=torch.float64), accumulate=True)
    emp /= n

    def tv(a, b):
        return 0.5 * (a - b).abs().sum().item()

    # sampling noise of an 8-cell marginal at n = 4000: TV about 0.015
    for dims in ((1, 2), (0, 2), (0, 1)):
        assert tv(emp.sum(dims), exact.double().sum(dims)) < 0.05, dims
    assert tv(emp.sum(2), exact.double().sum(2)) < 0.08                 # (t1, t2): 64 cells
    # the test can fail: the draft's own law is far from the empirical one
    with torch.no_grad():
        q2 = draft(full[::V, :-1]).logits[:, -1].float().softmax(-1)
    assert tv(emp.sum((0, 2)), (p1[:, None] * q2).double().sum(0)) > 0.1


# --- the conventional scheme (the model benchmark's baseline) ----------------------------------

RECURRENT_FAMILIES = ["tiny_nemotron_h", "tiny_qwen3_5", "tiny_kimi_linear"]


class _CountConventional:
    def __init__(self, monkeypatch):
        from replayssm.integrations.hf.conventional import ConventionalPool
        self.n = 0
        orig = ConventionalPool.decode

        def wrap(pool, *a, **k):
            self.n += 1
            return orig(pool, *a, **k)
        monkeypatch.setattr(ConventionalPool, "decode", wrap)


@pytest.mark.parametrize("name", RECURRENT_FAMILIES)
def test_conventional_scheme_matches_stock(name, monkeypatch):
    model = _model(name)
    ids, mask = _padded([10, 6])
    ref = _greedy(model, ids, 64, attention_mask=mask)
    conv, replay = _CountConventional(monkeypatch), _Count(monkeypatch)
    hf.enable(model, scheme="conventional")
    assert hf.replay_state(model).scheme == "conventional"
    got = _greedy(model, ids, 64, attention_mask=mask)
    assert conv.n >= 63 and replay.n["decode"] == 0          # the conventional state, not the pools
    assert torch.equal(got.sequences, ref.sequences)
    lr, lg = torch.stack(ref.logits), torch.stack(got.logits)
    assert ((lg - lr).norm() / lr.norm()).item() < LOGIT_RTOL


@pytest.mark.interpret
@pytest.mark.parametrize("name", RECURRENT_FAMILIES)
def test_conventional_scheme_on_the_kernels(name, monkeypatch):
    # the tuned conventional kernels (interpreted on the CPU) in place of the reference step
    import importlib
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")
    calls = []
    family = {"tiny_nemotron_h": "mamba2", "tiny_qwen3_5": "gdn", "tiny_kimi_linear": "kda"}[name]
    ops = importlib.import_module(f"replayssm.ops.{family}")
    orig = ops.conventional_decode
    monkeypatch.setattr(ops, "conventional_decode", lambda *a, **k: (calls.append(1), orig(*a, **k))[1])
    model = _model(name)
    ids, mask = _padded([10, 6])
    ref = _greedy(model, ids, 6, attention_mask=mask)
    hf.enable(model, scheme="conventional", backend="triton")
    got = _greedy(model, ids, 6, attention_mask=mask)
    assert len(calls) > 0
    assert torch.equal(got.sequences, ref.sequences)
    lr, lg = torch.stack(ref.logits), torch.stack(got.logits)
    assert ((lg - lr).norm() / lr.norm()).item() < LOGIT_RTOL


def test_conventional_scheme_refuses_speculation():
    model = hf.enable(_model("tiny_qwen3_5"), scheme="conventional")
    with pytest.raises(ValueError, match="conventional scheme"):
        hf.speculative_generate(model, _prompt(6), num_draft=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="scheme must be one of"):
        hf.enable(model, scheme="snapshots")


@pytest.mark.parametrize("scheme", ["replay", "conventional"])
def test_attach_cache_continues_a_stock_prefill(scheme):
    """The model benchmark's path: a stock prefill into a static cache, then each scheme
    continues from it (explicit cache positions, no attention mask) as stock decoding does."""
    from transformers import StaticCache
    model = _model("tiny_nemotron_h")
    ids = _prompt(10, batch=2)

    def decode(cache, steps=8):
        tok, out = None, []
        for i in range(steps):
            if tok is None:
                logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            else:
                logits = model(input_ids=tok, past_key_values=cache, cache_position=torch.tensor([9 + i]),
                               use_cache=True, logits_to_keep=1).logits
            tok = logits[:, -1:].argmax(-1)
            out.append(tok)
        return torch.cat(out, dim=1)

    ref = decode(StaticCache(config=model.config, max_cache_len=24))
    cache = StaticCache(config=model.config, max_cache_len=24)
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)     # stock prefill
    hf.enable(model, scheme=scheme)
    hf.attach_cache(model, cache)
    tok = ref[:, :1]
    for i in range(1, 8):
        logits = model(input_ids=tok, past_key_values=cache, cache_position=torch.tensor([9 + i]),
                       use_cache=True, logits_to_keep=1).logits
        tok = logits[:, -1:].argmax(-1)
        assert torch.equal(tok, ref[:, i:i + 1]), i
    with pytest.raises(ValueError, match="no recurrent state"):
        hf.attach_cache(model, StaticCache(config=model.config, max_cache_len=24))


# --- the snapshot scheme (speculative generation's baseline) -----------------------------------

class _CountSnapshot:
    def __init__(self, monkeypatch):
        from replayssm.integrations.hf.snapshot import SnapshotPool
        self.n = {"verify": 0, "commit": 0}
        for op in self.n:
            orig = getattr(SnapshotPool, op)

            def wrap(pool, *a, _op=op, _orig=orig, **k):
                self.n[_op] += 1
                return _orig(pool, *a, **k)
            monkeypatch.setattr(SnapshotPool, op, wrap)


@pytest.mark.parametrize("name", RECURRENT_FAMILIES)
def test_snapshot_scheme_greedy_and_speculative_equal_stock(name, monkeypatch):
    model = _model(name)
    ids, mask = _padded([10, 6])
    ref = _greedy(model, ids, 24, attention_mask=mask)
    count, replay = _CountSnapshot(monkeypatch), _Count(monkeypatch)
    hf.enable(model, scheme="snapshot", max_draft=4)
    assert hf.replay_state(model).scheme == "snapshot"
    got = _greedy(model, ids, 24, attention_mask=mask)
    assert torch.equal(got.sequences, ref.sequences)
    lr, lg = torch.stack(ref.logits), torch.stack(got.logits)
    assert ((lg - lr).norm() / lr.norm()).item() < LOGIT_RTOL
    n_greedy = dict(count.n)
    out, stats = hf.speculative_generate(model, ids, attention_mask=mask, draft=_noisy_copy(name, 0.6),
                                         num_draft=4, max_new_tokens=24, return_stats=True)
    assert torch.equal(out, ref.sequences)
    assert 0 < stats["accepted"] < stats["proposed"]          # rollback ran
    assert count.n["verify"] > n_greedy["verify"] and replay.n["verify"] == replay.n["decode"] == 0
    assert hf.replay_state(model).layers and all(
        layer.pool.memory_per_sequence()["snapshot"] == 5 * layer.pool.HV * layer.pool.V * layer.pool.K * 4
        for layer in hf.replay_state(model).layers.values())


@pytest.mark.interpret
def test_snapshot_scheme_on_the_kernels(monkeypatch):
    # the snapshot kernels (interpreted) in place of the reference steps, speculative greedy
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")
    from replayssm.ops import mamba2
    calls = []
    orig = mamba2.snapshot_verify
    monkeypatch.setattr(mamba2, "snapshot_verify", lambda *a, **k: (calls.append(1), orig(*a, **k))[1])
    model = _model("tiny_nemotron_h")
    ids = _prompt(8)
    ref = _greedy(model, ids, 8).sequences
    hf.enable(model, scheme="snapshot", max_draft=3, backend="triton")
    out = hf.speculative_generate(model, ids, num_draft=3, max_new_tokens=8)
    assert len(calls) > 0
    assert torch.equal(out, ref)


# --- precision options (issue 18): a low-precision checkpoint copy, a narrow checkpoint -------

# fp16 reads against fp32 reads, 32 greedy tokens (two flushes): measured 6.2e-6 (NemotronH) and
# 2.0e-6 (Qwen3.5) relative; fp16 rounds the state to 4.9e-4
LP_FP16_RTOL = 1e-4


@pytest.mark.parametrize("name", ["tiny_nemotron_h", "tiny_qwen3_5"])
def test_lp_read_generates_close_to_fp32(name):
    model = _model(name)
    ids = _prompt(10)
    hf.enable(model)
    ref = _greedy(model, ids, 32)
    hf.enable(model, lp_format="fp16")
    state = hf.replay_state(model)
    assert all(layer.pool.lp_format == "fp16" and layer.pool.hp_format is None for layer in state.layers.values())
    got = _greedy(model, ids, 32)
    assert torch.equal(got.sequences, ref.sequences)
    lr, lg = torch.stack(ref.logits), torch.stack(got.logits)
    rel = ((lg - lr).norm() / lr.norm()).item()
    assert 0 < rel < LP_FP16_RTOL                        # the copy is read, and it is close
    # a grown pool keeps the options and goes on counting checkpoint writes (the rounding streams)
    layer = next(iter(state.layers.values()))
    layer.pool.epoch[0] = 5
    live = int(0 not in state.free_slots)               # a live slot is loaded again: one more write
    state._grow(2 * state.num_slots)
    assert layer.pool.lp_format == "fp16" and int(layer.pool.epoch[0]) == 5 + live


def test_stochastic_checkpoint_follows_its_seed():
    model = _model("tiny_nemotron_h")
    ids = _prompt(10)

    def logits(seed):
        hf.enable(model, hp_format="bf16", hp_rounding="stochastic", seed=seed)
        assert all(layer.pool.seed == seed for layer in hf.replay_state(model).layers.values())
        return torch.stack(_greedy(model, ids, 20).logits)

    a, b = logits(1), logits(1)
    assert torch.equal(a, b)
    assert not torch.equal(a, logits(2))


def test_precision_options_refused_before_anything_changes():
    model = _model("tiny_qwen3_5")                       # key head dim 8: no NVFP4
    ids = _prompt(8)
    fresh = _model("tiny_qwen3_5")
    hf.enable(model, window=8, max_draft=4)
    state = hf.replay_state(model)
    forwards = {id(m): vars(m)["forward"] for m in model.modules() if "forward" in vars(m)}
    before = _greedy(model, ids, 12)
    bad = [(dict(lp_format="fp12"), "lp_format"), (dict(hp_format="int8"), "hp_format"),
           (dict(hp_format="fp16", hp_rounding="down"), "hp_rounding"),
           (dict(hp_rounding="stochastic"), "hp_rounding='stochastic' needs"),
           (dict(scheme="conventional", lp_format="fp16"), "lp_format='fp16' applies to scheme 'replay'"),
           (dict(scheme="snapshot", hp_rounding="nearest"), "hp_rounding"),
           (dict(scheme="conventional", eager_max_batch=0), "eager_max_batch"),
           (dict(lp_format="nvfp4"), "nvfp4 needs a head_k_dim divisible by 16"),
           (dict(seed=-1), "seed"), (dict(eager_max_batch=-2), "eager_max_batch"),
           (dict(lp_format="fp16", record_dtype=torch.int8), "record_dtype"),      # the pools' own check
           (dict(window=0), "window must be an integer >= 1, got 0"), (dict(max_draft=True), "max_draft")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            hf.enable(model, **kw)
        with pytest.raises(ValueError, match=msg):
            hf.enable(fresh, **kw)
    assert hf.replay_state(model) is state
    assert {id(m): vars(m)["forward"] for m in model.modules() if "forward" in vars(m)} == forwards
    after = _greedy(model, ids, 12)
    assert all(torch.equal(a, b) for a, b in zip(after.logits, before.logits))
    assert not hf.is_enabled(fresh) and not any("forward" in vars(m) for m in fresh.modules())


def test_a_name_where_a_model_goes_is_refused_in_one_line():
    with pytest.raises(TypeError, match="model must be a loaded transformers model .* got str 'nemotron'"):
        hf.enable("nemotron")
    with pytest.raises(TypeError, match="a model name is a string, one of .*tiny_qwen3_5.* got NoneType"):
        hf.build(None)
    model = hf.enable(_model("tiny_qwen3_5"), window=8, max_draft=4)
    with pytest.raises(TypeError, match=r"draft must be a loaded causal LM .*draft=hf.build\('tiny_qwen3_5'\)"):
        hf.speculative_generate(model, _prompt(8), draft="tiny_qwen3_5", num_draft=2, max_new_tokens=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["tiny_nemotron_h", "tiny_qwen3_5", "tiny_kimi_linear"])
def test_gpu_greedy_and_speculative_match_stock(name, monkeypatch):
    # on the kernels (pools, the fused short convolution, the grouped-query attention): fp32
    # greedy tokens equal stock transformers', speculative ones equal greedy ones
    model = _model(name).cuda()
    ids = _prompt(10, batch=3).cuda()
    ref = _greedy(model, ids, 32)
    hf.use_gqa_attention(model)
    hf.enable(model, max_draft=4)
    count = _Count(monkeypatch)
    got = _greedy(model, ids, 32)
    assert count.n["decode"] > 0
    assert torch.equal(got.sequences, ref.sequences)
    lr, lg = torch.stack(ref.logits), torch.stack(got.logits)
    assert ((lg - lr).norm() / lr.norm()).item() < 1e-4
    out = hf.speculative_generate(model, ids[:1], draft=_noisy_copy(name, 0.6).cuda(), num_draft=4,
                                  max_new_tokens=32)
    assert torch.equal(out, ref.sequences[:1])
    assert count.n["verify"] > 0
