"""The slot pool on its Triton backend (interpreted on the CPU) against the same pool on the
reference: decode, verify (per-row draft counts) and commit through the kernels, against the
reference on the same layout, with padding rows and rows at different window positions."""
import pytest
import torch

from replayssm import SlotPool
from replayssm.testing import make_inputs, make_params

from conftest import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HV, HK, V, K, N, L, T = 4, 2, 16, 32, 4, 4, 2


@pytest.mark.parametrize("eager", [0, 3], ids=["windowed", "eager-up-to-3-rows"])
@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_triton_pool_matches_reference_pool(family, eager):
    # eager=3: batches of 3 rows take the eager step (window 1), batches of 4 the window, so
    # slots move between the two with records pending
    params = make_params(family, HV, K, seed=2)
    kw = dict(window=L, max_draft=T, dtype=torch.float32, device=DEV, eager_max_batch=eager)
    fast = SlotPool(params, N, V, K, HK, backend="triton", **kw)
    ref = SlotPool(params, N, V, K, HK, backend="reference", **kw)
    assert fast.backend == "triton" and ref.backend == "reference"
    g = torch.Generator().manual_seed(0)
    init = 0.1 * torch.randn(N, HV, V, K, generator=g)
    for p in (fast, ref):
        p.load(torch.arange(N, device=DEV), init.to(DEV))
    errs, sizes = [], set()
    for step in range(14):
        rows = [(step + i) % N for i in range(3) if (step + i) % 5 != 4] + [-1]
        ids = torch.tensor(rows, device=DEV)
        if step % 5 == 3:
            x = {k: v.to(DEV) for k, v in make_inputs(params, len(rows), V, K, HK, steps=T,
                                                        dtype=torch.float32, generator=g).items()}
            # rows carry different draft counts; each accepts some of its own
            nd = torch.tensor([1 + (r + step) % T for r in rows], device=DEV)
            outs = [p.verify(ids, num_drafts=nd, **x) for p in (fast, ref)]
            for p in (fast, ref):
                p.commit(ids, torch.tensor([1 + (r % int(n)) for r, n in zip(rows, nd)], device=DEV))
        else:
            x = {k: v.to(DEV) for k, v in make_inputs(params, len(rows), V, K, HK, dtype=torch.float32,
                                                        generator=g).items()}
            outs = [p.decode(ids, **x) for p in (fast, ref)]
            sizes.add(len(rows))
        assert torch.equal(outs[0][-1], torch.zeros_like(outs[0][-1]))      # padding row
        errs.append(rel_err(outs[0], outs[1]))
        assert torch.equal(fast.cursor, ref.cursor) and torch.equal(fast.epoch, ref.epoch)
    all_ids = torch.arange(N, device=DEV)
    assert max(errs) < 1e-5, errs
    assert rel_err(fast.materialize(all_ids), ref.materialize(all_ids)) < 1e-5
    assert int(ref.epoch.sum()) > 0          # flushes happened
    if eager:
        assert min(sizes) <= eager < max(sizes)  # both kinds of step ran


def test_triton_decode_discards_uncommitted_drafts_of_its_rows_only():
    # verify two slots, decode one of them (and a padding row): its drafts are gone (an
    # unvalidated commit then moves nothing), the other slot's stay committable
    params = make_params("gdn", HV, K, seed=4)
    pool = SlotPool(params, N, V, K, HK, window=L, max_draft=T, dtype=torch.float32, device=DEV,
                    backend="triton", eager_max_batch=0)
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor([1, 2], device=DEV)
    pool.verify(ids, **{k: v.to(DEV) for k, v in make_inputs(params, 2, V, K, HK, steps=T, dtype=torch.float32,
                                                             generator=g).items()})
    assert pool.pending.tolist() == [0, T, T, 0]
    pool.decode(torch.tensor([2, -1], device=DEV),
                **{k: v.to(DEV) for k, v in make_inputs(params, 2, V, K, HK, dtype=torch.float32, generator=g).items()})
    assert pool.pending.tolist() == [0, T, 0, 0]
    cursor = pool.cursor.clone()
    pool.commit(ids, torch.tensor([T, T], device=DEV), validate=False)
    assert pool.cursor.tolist() == [cursor[0], cursor[1] + T, cursor[2], cursor[3]]
