"""Shapes in no launch table (head dims that are not powers of two, head groupings other than
the tuned models'): the pool's kernels take configs derived from the dimensions, the eager
step at small batches and the window at large ones, and match the reference pool."""
import pytest
import torch

from replayssm import SlotPool
from replayssm.ops import gdn, kda, mamba2
from replayssm.testing import make_inputs, make_params

from conftest import ci_subset, rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (family, HV, Hk, V, K): HG = 2, 3 and 1; V and K not powers of two
SHAPES = [("mamba2", 6, 3, 24, 48), ("gdn", 6, 2, 40, 24), ("kda", 4, 4, 24, 40)]
EAGER = {"mamba2": mamba2.eager_max_batch, "gdn": gdn.eager_max_batch, "kda": kda.eager_max_batch}


def test_untuned_model_sized_shapes_take_the_eager_step_at_small_batches():
    """The eager step's reach follows the state a step moves (about 32 MiB on the H200, as for
    every tuned shape); states far below a layer's keep the window."""
    assert mamba2.eager_max_batch(112, 64, 128, 8) == 8         # 3.7 MB a row
    assert mamba2.eager_max_batch(80, 96, 128, 8) == 8
    assert gdn.eager_max_batch(24, 128, 128, 8) == 16           # 1.6 MB a row
    assert kda.eager_max_batch(16, 128, 128, 16) == 32          # 1 MB a row
    assert all(EAGER[f](HV, V, K, Hk) == 0 for f, HV, Hk, V, K in SHAPES)


@pytest.mark.parametrize("family,HV,Hk,V,K", SHAPES, ids=[s[0] for s in SHAPES])
def test_untuned_shape_matches_reference(family, HV, Hk, V, K):
    params = make_params(family, HV, K, seed=5)
    N, L = 12, 4
    # batches of 3 take the eager step with its derived configs, batches of 10 the window
    kw = dict(window=L, max_draft=2, dtype=torch.float32, device=DEV, eager_max_batch=8)
    fast = SlotPool(params, N, V, K, Hk, backend="triton", **kw)
    ref = SlotPool(params, N, V, K, Hk, backend="reference", **kw)
    g = torch.Generator().manual_seed(0)
    init = 0.1 * torch.randn(N, HV, V, K, generator=g)
    for p in (fast, ref):
        p.load(torch.arange(N, device=DEV), init.to(DEV))
    # 3 windows of steps (2 in CI's subset: up to 4 s a step of 10 rows on the interpreter; the
    # 8 steps still take the eager step folding pending records (steps 3 and 6) and window
    # steps that flush (5 and 7))
    steps = 2 * L if ci_subset() and DEV == "cpu" else 3 * L
    errs = []
    for step in range(steps):
        B = 3 if step % 3 == 0 else 10
        rows = [(step + 5 * i) % N for i in range(B - 1)] + [-1]
        ids = torch.tensor(rows, device=DEV)
        x = {k: v.to(DEV) for k, v in make_inputs(params, B, V, K, Hk, dtype=torch.float32,
                                                    generator=g).items()}
        outs = [p.decode(ids, **x) for p in (fast, ref)]
        errs.append(rel_err(outs[0], outs[1]))
        assert torch.equal(outs[0][-1], torch.zeros_like(outs[0][-1]))
        assert torch.equal(fast.cursor, ref.cursor) and torch.equal(fast.epoch, ref.epoch)
    assert max(errs) < 1e-5, errs
    all_ids = torch.arange(N, device=DEV)
    assert rel_err(fast.materialize(all_ids), ref.materialize(all_ids)) < 1e-5
    assert int(fast.cursor.max()) > 0      # the window ran (the eager step leaves cursors at 0)
