"""Separate precisions (SPEC section 5) through the slot pool."""
import pytest
import torch

from replayssm import formats
from replayssm.reference.schemes import shared_lowp_step
from replayssm import SlotPool
from replayssm.testing import make_inputs, make_params

from conftest import rel_err

HV, HK, V, K, N, L, T = 4, 2, 8, 32, 3, 4, 3
LP_FORMATS = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4"]


def drive(pool, n_ops=24, seed=0):
    """A fixed mixture of decode and verify/commit on slots 0..N-1; returns outputs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.arange(N)
    init = torch.randn(N, HV, V, K, generator=g, dtype=torch.float64) * 0.3
    pool.load(ids, init.to(pool.dtype))
    outs, ckpts = [], []
    for i in range(n_ops):
        if i % 3 == 2:
            steps = 1 + i % T
            x = make_inputs(pool.params, N, V, K, HK, steps=steps, generator=g, dtype=pool.dtype)
            outs.append(pool.verify(ids, **x).flatten(0, 1))
            pool.commit(ids, torch.tensor([(i + s) % steps + 1 for s in range(N)]))
        else:
            x = make_inputs(pool.params, N, V, K, HK, generator=g, dtype=pool.dtype)
            outs.append(pool.decode(ids, **x))
        ckpts.append(pool.ckpt["data"].clone())
    return torch.cat(outs), ckpts, pool.materialize(ids)


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_hp_path_independent_of_lp_format(family):
    """With an fp32 high-precision checkpoint, its values after every step are bit-identical
    whatever the low-precision format (GDN/KDA refold u from the raw inputs along C_HP)."""
    params = make_params(family, HV, K, seed=3)
    runs = {}
    for lp in LP_FORMATS:
        pool = SlotPool(params, N, V, K, HK, window=L, max_draft=T, dtype=torch.float32, lp_format=lp)
        runs[lp] = drive(pool)
    base_out, base_ckpts, base_state = runs["fp16"]
    for lp, (out, ckpts, state) in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(ckpts, base_ckpts)), lp
        assert torch.equal(state, base_state), lp
    # outputs do depend on the LP format (they read C_LP): the test is not vacuous
    assert not torch.equal(runs["nvfp4"][0], base_out)
    # and one checkpoint only (no LP) gives the same HP path up to fp32 rounding of the
    # (differently ordered) draft solve
    pool = SlotPool(params, N, V, K, HK, window=L, max_draft=T, dtype=torch.float32)
    _, ckpts, state = drive(pool)
    assert rel_err(state, base_state) < 1e-5


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
@pytest.mark.parametrize("lp", LP_FORMATS)
def test_lp_reads_only_touch_outputs(family, lp):
    """float64 HP path + LP reads: the materialised state equals the exact (no-LP) run to
    1e-12, while outputs carry only the LP rounding error of the step that read it."""
    params = make_params(family, HV, K, seed=4)
    exact = SlotPool(params, N, V, K, HK, window=L, max_draft=T, dtype=torch.float64)
    two = SlotPool(params, N, V, K, HK, window=L, max_draft=T, dtype=torch.float64, lp_format=lp)
    out_e, _, state_e = drive(exact, n_ops=30)
    out_2, _, state_2 = drive(two, n_ops=30)
    assert rel_err(state_2, state_e) < 1e-12
    # per-format output bound: a few units of the format's relative precision
    bound = {"fp16": 2e-3, "bf16": 2e-2, "fp8_e4m3": 0.2, "fp8_e5m2": 0.4, "nvfp4": 0.6}[lp]
    err = rel_err(out_2, out_e)
    assert 0 < err < bound, err


def test_stochastic_hp_checkpoint_reproducible_from_seed():
    params = make_params("gdn", HV, K, seed=5)

    def run(seed):
        pool = SlotPool(params, N, V, K, HK, window=L, max_draft=T, dtype=torch.float32,
                        hp_format="bf16", seed=seed, layer=0)
        out, _, state = drive(pool)
        return pool.ckpt["data"].clone(), state

    a, b, c = run(11), run(11), run(12)
    assert a[0].dtype == torch.bfloat16
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    # stochastic rounding of the checkpoint is close to the fp32 run
    pool = SlotPool(params, N, V, K, HK, window=L, max_draft=T, dtype=torch.float32)
    _, _, ref = drive(pool)
    assert rel_err(a[1], ref) < 2e-2


def test_stochastic_hp_is_unbiased_through_the_pool():
    """Loading one state into many slots and flushing: the mean of the SR-written bf16
    checkpoints approaches the exact state (slots draw independent streams)."""
    params = make_params("mamba2", 1, 16, seed=6)
    n = 512
    pool = SlotPool(params, n, 4, 16, 1, window=1, dtype=torch.float64, hp_format="bf16")
    exact = SlotPool(params, 1, 4, 16, 1, window=1, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    # on the bf16 grid, so that loading it is exact and only the flush rounds stochastically
    S0 = formats.quantize(torch.randn(1, 1, 4, 16, generator=g, dtype=torch.float64), "bf16")
    x = make_inputs(params, 1, 4, 16, 1, generator=g, gate=False)
    exact.load(torch.tensor([0]), S0)
    exact.decode(torch.tensor([0]), **x)                         # window 1: every step flushes
    pool.load(torch.arange(n), S0.expand(n, -1, -1, -1).contiguous())
    pool.decode(torch.arange(n), **{k: v.expand(n, *v.shape[1:]).contiguous() for k, v in x.items()})
    target = exact.ckpt["data"][0]
    got = pool.ckpt["data"].double()
    ulp = formats.quantize(target.abs() * (1 + 2 ** -7), "bf16") - formats.quantize(target.abs(), "bf16")
    ulp = torch.clamp(ulp.abs(), min=target.abs() * 2 ** -8)
    # per element: mean of n draws of an SR variable with variance <= ulp^2/4, within 6 sigma
    assert torch.all((got.mean(0) - target).abs() <= 6 * ulp / (2 * n ** 0.5) + 1e-30)
    assert (got.std(0) > 0).any()


def test_shared_lowp_baseline():
    """The naive scheme: the stored state is the quantised conventional state, every step."""
    params = make_params("gdn", HV, K, seed=7)
    g = torch.Generator().manual_seed(1)
    S = torch.randn(2, HV, V, K, generator=g, dtype=torch.float64)
    x = make_inputs(params, 2, V, K, HK, generator=g)
    y, Sq = shared_lowp_step(params, S, "fp8_e4m3", **x)
    y_ref, S_ref = params.step(S, **x)
    assert torch.equal(y, y_ref)
    assert torch.equal(Sq, formats.quantize(S_ref, "fp8_e4m3"))
    assert not torch.equal(Sq, S_ref)


def test_shared_lowp_pool_drifts_more_than_two_precisions():
    """One nvfp4 checkpoint carrying the recurrence (naive) drifts further from the exact
    state than nvfp4 reads with an fp32 recurrence, whose HP path stays exact."""
    params = make_params("mamba2", HV, K, seed=8)
    exact = SlotPool(params, N, V, K, HK, window=L, max_draft=T, dtype=torch.float64)
    naive = SlotPool(params, N, V, K, HK, window=L, max_draft=T, dtype=torch.float64,
                     hp_format="nvfp4", hp_rounding="nearest")
    two = SlotPool(params, N, V, K, HK, window=L, max_draft=T, dtype=torch.float64, lp_format="nvfp4")
    _, _, s_e = drive(exact, n_ops=40)
    out_n, _, s_n = drive(naive, n_ops=40)
    out_t, _, s_t = drive(two, n_ops=40)
    assert rel_err(s_t, s_e) < 1e-12 < rel_err(s_n, s_e)


# ------------------------------------------------------------------ copies read slower than fp32

def test_no_copy_reads_slower_than_fp32_today():
    # no (family, format) pair measures slower than fp32 reads today (pool/backends.py cites
    # the runs), so none has an entry
    from replayssm.pool import backends
    assert backends.slow_lp_read("mamba2", "fp8_e4m3") is None and backends.slow_lp_read("gdn", "fp16") is None
    assert backends.slow_lp_read("gdn", "fp8_e4m3") is None and backends.slow_lp_read("kda", "fp8_e4m3") is None
    assert backends.slow_lp_read("gdn", None) is None and backends.slow_lp_read("kda", "nvfp4") is None


def test_slow_read_message_names_the_measurement(monkeypatch):
    # an entry's message: the family, format, each shape's ratio, the card and the file
    from replayssm.pool import backends
    monkeypatch.setitem(backends.SLOW_LP_READS, ("kda", "nvfp4"),
                        ("NVIDIA H100 80GB HBM3", "results/x.json", [("kimi-linear-48b", 0.22)]))
    text = backends.slow_lp_read("kda", "nvfp4")
    assert "kda" in text and "nvfp4" in text and "kimi-linear-48b 0.22x" in text
    assert "NVIDIA H100 80GB HBM3" in text and "results/x.json" in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pool_warns_where_its_copy_reads_slower_than_fp32(monkeypatch):
    import warnings

    from replayssm import SlotPool, SlowReadWarning
    from replayssm.pool import backends
    from replayssm.testing import make_params
    params = make_params("gdn", 8, 128)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowReadWarning)
        SlotPool(make_params("kda", 8, 128), 4, 128, 128, 2, device="cuda", lp_format="nvfp4")
    monkeypatch.setitem(backends.SLOW_LP_READS, ("kda", "nvfp4"),
                        ("NVIDIA H100 80GB HBM3", "results/x.json", [("kimi-linear-48b", 0.22)]))
    with pytest.warns(SlowReadWarning, match="kimi-linear-48b 0.22x"):
        SlotPool(make_params("kda", 8, 128), 4, 128, 128, 2, device="cuda", lp_format="nvfp4")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowReadWarning)
        SlotPool(params, 4, 128, 128, 2, device="cuda", lp_format="fp16")
        SlotPool(params, 4, 128, 128, 2, device="cuda", lp_format="fp8_e4m3")
        SlotPool(params, 4, 128, 128, 2, device="cuda", lp_format="nvfp4")
        SlotPool(make_params("mamba2", 8, 128), 4, 64, 128, 2, device="cuda", lp_format="fp8_e4m3")


def test_pool_off_the_gpu_does_not_warn_of_gpu_read_speed():
    import warnings

    from replayssm import SlotPool, SlowReadWarning
    from replayssm.testing import make_params
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowReadWarning)
        SlotPool(make_params("gdn", 4, 16), 2, 8, 16, 2, lp_format="fp8_e4m3", backend="reference")


def test_studies_record_slow_read_warnings():
    # what a pool warns of while a study runs is kept in the study's document, once each;
    # other warnings pass through
    import warnings

    from replayssm import SlowReadWarning
    from replayssm.bench.common import recording_slow_reads
    doc = {}
    with pytest.warns(UserWarning, match="unrelated"):
        with recording_slow_reads(doc):
            warnings.warn("a gdn pool reads its nvfp4 copy slower", SlowReadWarning)
            warnings.warn("a gdn pool reads its nvfp4 copy slower", SlowReadWarning)
            warnings.warn("unrelated", UserWarning)
    with recording_slow_reads(doc):
        warnings.warn("a kda pool reads its nvfp4 copy slower", SlowReadWarning)
    assert doc["slow_read_warnings"] == ["a gdn pool reads its nvfp4 copy slower",
                                         "a kda pool reads its nvfp4 copy slower"]
    with recording_slow_reads(empty := {}):
        pass
    assert empty["slow_read_warnings"] == []
