"""Every bad input named by the pool's contract raises ValueError naming the value, and leaves
the pool exactly as it was."""
import pytest
import torch

from replayssm import SlotPool
from replayssm.testing import make_inputs, make_params

HV, HK, V, K, N, L, T = 4, 2, 8, 16, 4, 4, 2


def make_pool(family="gdn", **kw):
    pool = SlotPool(make_params(family, HV, K), N, V, K, HK, window=L, max_draft=T, dtype=torch.float64, **kw)
    g = torch.Generator().manual_seed(0)
    pool.load(torch.arange(N), torch.randn(N, HV, V, K, generator=g, dtype=torch.float64))
    ids = torch.tensor([0, 1])
    pool.decode(ids, **make_inputs(pool.params, 2, V, K, HK, generator=g))
    pool.verify(ids, **make_inputs(pool.params, 2, V, K, HK, steps=T, generator=g))   # pending drafts
    return pool


def snapshot(pool):
    ts = list(pool.ckpt.values()) + list(pool.buf.values()) + [pool.cursor, pool.pending, pool.epoch]
    return [t.clone() for t in ts]


def unchanged(pool, snap):
    return all(torch.equal(a, b) for a, b in zip(snapshot(pool), snap))


def inputs(pool, b=2, steps=None):
    return make_inputs(pool.params, b, V, K, HK, steps=steps)


CASES = {
    "slot out of range": (lambda p: p.decode(torch.tensor([0, N]), **inputs(p)), str(N)),
    "slot ids not a tensor": (lambda p: p.decode([0, 1], **inputs(p)), "list"),
    "slot ids float": (lambda p: p.decode(torch.tensor([0.0, 1.0]), **inputs(p)), "float"),
    "slot ids 2-D": (lambda p: p.decode(torch.tensor([[0, 1]]), **inputs(p)), "(1, 2)"),
    "duplicate slot": (lambda p: p.decode(torch.tensor([2, 2]), **inputs(p)), "2"),
    "wrong shape": (lambda p: p.decode(torch.tensor([0, 1]), **dict(inputs(p), v=torch.zeros(2, HV, V + 1, dtype=torch.float64))), "(2, 4, 9)"),
    "wrong batch": (lambda p: p.decode(torch.tensor([0, 1]), **inputs(p, b=3)), "(3"),
    "integer input": (lambda p: p.decode(torch.tensor([0, 1]), **dict(inputs(p), a=torch.zeros(2, HV, dtype=torch.int64))), "int64"),
    "missing input": (lambda p: p.decode(torch.tensor([0, 1]), **{k: v for k, v in inputs(p).items() if k != "q"}), "'q'"),
    "unknown input": (lambda p: p.decode(torch.tensor([0, 1]), **dict(inputs(p), x=torch.zeros(2))), "'x'"),
    "wrong device": (lambda p: p.decode(torch.tensor([0, 1], device="meta"), **inputs(p)), "meta"),
    "input on wrong device": (lambda p: p.decode(torch.tensor([0, 1]), **dict(inputs(p), b=torch.zeros(2, HV, device="meta"))), "meta"),
    "T above max_draft": (lambda p: p.verify(torch.tensor([2, 3]), **inputs(p, steps=T + 1)), f"T={T + 1}"),
    "verify tokens differ": (lambda p: p.verify(torch.tensor([2, 3]), **dict(inputs(p, steps=2), b=torch.zeros(2, 1, HV, dtype=torch.float64))), "1 tokens"),
    "accepted zero": (lambda p: p.commit(torch.tensor([0, 1]), torch.tensor([0, 1])), "accepted 0"),
    "accepted above T": (lambda p: p.commit(torch.tensor([0, 1]), torch.tensor([1, T + 1])), f"accepted {T + 1}"),
    "accepted wrong shape": (lambda p: p.commit(torch.tensor([0, 1]), torch.tensor([1])), "(1,)"),
    "accepted float": (lambda p: p.commit(torch.tensor([0, 1]), torch.tensor([1.0, 1.0])), "float"),
    "commit without verify": (lambda p: p.commit(torch.tensor([2]), torch.tensor([1])), "slot 2"),
    "load wrong shape": (lambda p: p.load(torch.tensor([2]), torch.zeros(1, HV, V, K + 1)), "17"),
    "materialize out of range": (lambda p: p.materialize(torch.tensor([-1, 7])), "7"),
    "reset out of range": (lambda p: p.reset(torch.tensor([9])), "9"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_and_changes_nothing(case):
    pool = make_pool()
    before = snapshot(pool)
    fn, needle = CASES[case]
    with pytest.raises(ValueError) as err:
        fn(pool)
    assert needle in str(err.value), str(err.value)
    assert unchanged(pool, before)


@pytest.mark.parametrize("kw,needle", [
    (dict(window=2, max_draft=3), "window 2"),
    (dict(window=0), "window"),
    (dict(max_draft=0), "max_draft"),
    (dict(hp_format="fp7"), "fp7"),
    (dict(lp_format="int4"), "int4"),
    (dict(hp_rounding="up"), "up"),
    (dict(dtype=torch.float16), "float16"),
    (dict(eager_max_batch=-1), "eager_max_batch"),
    (dict(eager_max_batch=True), "eager_max_batch"),
])
def test_bad_construction(kw, needle):
    args = dict(window=L, max_draft=T)
    args.update(kw)
    with pytest.raises(ValueError) as err:
        SlotPool(make_params("mamba2", HV, K), N, V, K, HK, **args)
    assert needle in str(err.value)


def test_bad_group_count():
    with pytest.raises(ValueError, match="3"):
        SlotPool(make_params("mamba2", HV, K), N, V, K, 3)


@pytest.mark.parametrize("family, params, needle", [
    ("kda", lambda: make_params("kda", HV, 2 * K), f"[{HV}, {K}] for {HV} heads (head_k_dim {K}), got [{HV}, {2 * K}]"),
    ("mamba2", lambda: type(make_params("mamba2", HV, K))(A=-torch.ones(HV), dt_bias=torch.zeros(HV + 1)),
     f"params.dt_bias must have shape [{HV}] for {HV} heads, got [{HV + 1}]"),
    ("mamba2", lambda: type(make_params("mamba2", HV, K))(A=-torch.ones(HV), dt_bias=torch.zeros(HV),
                                                           D=torch.ones(HV, 2)), "params.D must have shape"),
])
def test_params_that_do_not_fit_the_shape_are_refused_at_construction(family, params, needle):
    # (before: accepted, then a shape error inside the first step's arithmetic)
    with pytest.raises(ValueError) as err:
        SlotPool(params(), N, V, K, HK)
    assert needle in str(err.value)


def test_a_cuda_device_without_cuda_is_a_value_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="device 'cuda' is not usable here"):
        SlotPool(make_params("gdn", HV, K), N, V, K, HK, device="cuda")


def test_nvfp4_needs_k_multiple_of_16():
    with pytest.raises(ValueError, match="24"):
        SlotPool(make_params("gdn", HV, 24), N, V, 24, HK, lp_format="nvfp4")


def test_padding_rows_defined_and_untouched():
    pool = make_pool("mamba2")
    before = snapshot(pool)
    out = pool.decode(torch.tensor([-1, -1]), **make_inputs(pool.params, 2, V, K, HK))
    assert torch.equal(out, torch.zeros_like(out))
    assert unchanged(pool, before)


def test_uncommitted_drafts_are_discarded_by_decode():
    """A decode after a verify without commit behaves as if the drafts never happened."""
    pool = make_pool("gdn")
    ref = make_pool("gdn")
    for p in (pool, ref):
        p.commit(torch.tensor([0, 1]), torch.tensor([1, 1]))
    g = torch.Generator().manual_seed(5)
    pool.verify(torch.tensor([0]), **make_inputs(pool.params, 1, V, K, HK, steps=T, generator=g))
    x = make_inputs(pool.params, 1, V, K, HK, generator=g)
    assert torch.allclose(pool.decode(torch.tensor([0]), **x), ref.decode(torch.tensor([0]), **x), rtol=1e-12, atol=0)
    assert int(pool.pending[0]) == 0


def test_mamba2_params_need_nonzero_A():
    """Mamba-2 records keep x and recover dt as ld / A: a head with A = 0 is refused up front."""
    from replayssm.reference import Mamba2Params

    with pytest.raises(ValueError, match="A must be nonzero"):
        Mamba2Params(A=torch.tensor([-1.0, 0.0]), dt_bias=torch.zeros(2))
    Mamba2Params(A=torch.tensor([-1.0, -0.5]), dt_bias=torch.zeros(2))
