"""The pool's speculative operations at their boundary: per-row draft counts, the commit's
refusals (nothing changes before the error), `out=` of verify, and memory per sequence. On the
reference (any device); the kernels' side is tests/test_pool_kernels.py and the verify tests."""
import pytest
import torch

from replayssm import SlotPool
from replayssm.testing import make_inputs, make_params

from conftest import rel_err

HV, HK, V, K, N, L, T = 4, 2, 8, 16, 4, 6, 3


def _pool(family, **kw):
    params = make_params(family, HV, K, seed=3)
    return params, SlotPool(params, N, V, K, HK, window=L, max_draft=T, dtype=torch.float64,
                            backend="reference", **kw)


def _snapshot(pool):
    return [t.clone() for t in (pool.ckpt["data"], *pool.buf.values(), pool.cursor, pool.pending, pool.epoch)]


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_rows_with_fewer_drafts_verify_only_theirs(family):
    # one launch with per-row counts equals each row verified alone with its own T; outputs
    # past a row's count are zero, its pending count is its own
    params, pool = _pool(family)
    _, alone = _pool(family)
    g = torch.Generator().manual_seed(1)
    init = 0.1 * torch.randn(N, HV, V, K, generator=g, dtype=torch.float64)
    ids = torch.tensor([2, 0, -1, 3])
    for p in (pool, alone):
        p.load(torch.arange(N), init)
        # cursors 0, 2, 4, 5: rows 3 and 2 early-flush with 3 and 2 drafts (h + n > L)
        for h, s in ((2, 1), (4, 2), (5, 3)):
            for _ in range(h):
                p.decode(torch.tensor([s]), **make_inputs(params, 1, V, K, HK, generator=torch.Generator().manual_seed(h)))
    x = make_inputs(params, 4, V, K, HK, steps=T, generator=g)
    n = torch.tensor([1, 3, 2, 2])
    y = pool.verify(ids, num_drafts=n, **x)
    for b, s in enumerate(ids.tolist()):
        if s < 0:
            assert torch.equal(y[b], torch.zeros_like(y[b]))
            continue
        nb = int(n[b])
        yb = alone.verify(ids[b:b + 1], **{k: v[b:b + 1, :nb] for k, v in x.items()})
        assert rel_err(y[b, :nb], yb[0]) < 1e-12
        assert torch.equal(y[b, nb:], torch.zeros_like(y[b, nb:]))
        assert int(pool.pending[s]) == nb
    assert torch.equal(pool.cursor, alone.cursor) and torch.equal(pool.epoch, alone.epoch)
    pool.commit(ids, torch.tensor([1, 2, 1, 2]))
    # slot 2 kept its 4 records (4 + 1 <= L) and gains 1; slot 0 starts at 0; slot 3 early-
    # flushed (5 + 2 > L) and keeps 2 drafts; slot 1 is not in the call
    assert pool.cursor.tolist() == [2, 2, 5, 2]
    assert int(pool.epoch[3]) == int(alone.epoch[3]) and int(pool.epoch[3]) >= 2
    assert int(pool.pending.abs().sum()) == 0


@pytest.mark.parametrize("bad, needle", [
    (dict(num_drafts=torch.tensor([0, 1])), "num_drafts holds 0"),
    (dict(num_drafts=torch.tensor([1, T + 1])), f"num_drafts holds {T + 1}"),
    (dict(num_drafts=torch.tensor([1])), "num_drafts must be a tensor of shape"),
    (dict(num_drafts=torch.tensor([1.0, 1.0])), "num_drafts must be an int32/int64"),
    (dict(out=torch.zeros(2, T, HV, V)), "out must be a torch.float64 tensor"),
    (dict(out=torch.zeros(2, T + 1, HV, V, dtype=torch.float64)), "out must be a torch.float64 tensor"),
])
def test_verify_refuses_bad_arguments_before_anything_changes(bad, needle):
    params, pool = _pool("gdn")
    x = make_inputs(params, 2, V, K, HK, steps=T)
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=needle):
        pool.verify(torch.tensor([0, 1]), **x, **bad)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(pool)))


def test_verify_refuses_more_tokens_than_max_draft():
    params, pool = _pool("mamba2")
    x = make_inputs(params, 2, V, K, HK, steps=T + 1)
    with pytest.raises(ValueError, match="max_draft"):
        pool.verify(torch.tensor([0, 1]), **x)


@pytest.mark.parametrize("case", ["no-verify", "zero", "above-drafts", "after-decode"])
def test_commit_refusals_change_nothing(case):
    params, pool = _pool("kda")
    ids = torch.tensor([0, 1])
    if case != "no-verify":
        pool.verify(ids, num_drafts=torch.tensor([2, 1]), **make_inputs(params, 2, V, K, HK, steps=T))
    if case == "after-decode":
        pool.decode(ids, **make_inputs(params, 2, V, K, HK))      # drafts discarded: nothing pending
    acc = {"no-verify": [1, 1], "zero": [0, 1], "above-drafts": [2, 2], "after-decode": [1, 1]}[case]
    needle = {"no-verify": "no pending", "zero": "outside 1..2", "above-drafts": "outside 1..1",
              "after-decode": "no pending"}[case]
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=needle):
        pool.commit(ids, torch.tensor(acc))
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(pool)))


def test_unvalidated_commit_clamps_to_the_drafts_written():
    params, pool = _pool("mamba2")
    ids = torch.tensor([0, 1, -1])
    pool.verify(ids, num_drafts=torch.tensor([2, 3, 1]), **make_inputs(params, 3, V, K, HK, steps=T))
    pool.commit(ids, torch.tensor([9, -4, 5]), validate=False)
    assert pool.cursor[:2].tolist() == [2, 0] and int(pool.pending.abs().sum()) == 0


def test_verify_writes_out():
    params, pool = _pool("gdn")
    x = make_inputs(params, 2, V, K, HK, steps=T)
    out = torch.full((2, T, HV, V), float("nan"), dtype=torch.float64)
    y = pool.verify(torch.tensor([0, -1]), out=out, **x)
    assert y is out and torch.isfinite(out).all() and torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("family", ["mamba2", "kda"])
def test_memory_per_sequence(family):
    params = make_params(family, HV, K)
    pool = SlotPool(params, N, V, K, HK, window=L, max_draft=T, record_dtype=torch.bfloat16)
    mem = pool.memory_per_sequence()
    state = HV * V * K * 4
    ld = (L + T) * HV * (K if family == "kda" else 1) * 4
    records = (L + T) * (HV * V + HK * K) * 2
    assert mem["snapshot"] == (T + 1) * state
    assert mem["replay"] == state + ld + records + 4 + 4 + 8


def test_commit_kernel_moves_cursors_only():
    # the device commit (interpreted on the CPU): accepted counts clamped to 0..pending,
    # padding rows and slots outside the call untouched, pending cleared
    from replayssm.ops.utils.commit import commit

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cursor = torch.tensor([3, 0, 7, 2, 5], dtype=torch.int32, device=dev)
    pending = torch.tensor([2, 4, 1, 3, 0], dtype=torch.int32, device=dev)
    slot_ids = torch.tensor([1, -1, 0, 2, 4], dtype=torch.int32, device=dev)
    accepted = torch.tensor([4, 3, 1, 9, 2], dtype=torch.int32, device=dev)
    commit(cursor, pending, slot_ids, accepted)
    assert cursor.tolist() == [4, 4, 8, 2, 5]
    assert pending.tolist() == [0, 0, 0, 3, 0]
    # counters strided by a page (vLLM's blocks: [N, 2] cursor and pending side by side)
    pages = torch.tensor([[3, 2, -5], [0, 4, -5], [7, 1, -5], [2, 3, -5], [5, 0, -5]], dtype=torch.int32, device=dev)
    commit(pages[:, 0], pages[:, 1], slot_ids, accepted)
    assert pages.tolist() == [[4, 0, -5], [4, 0, -5], [8, 0, -5], [2, 3, -5], [5, 0, -5]]


def test_clear_pending_kernel_zeroes_the_rows_slots_only():
    # a decode's clearing of uncommitted drafts (interpreted on the CPU): the rows' slots zeroed,
    # padding rows (any negative id) and slots outside the call untouched
    from replayssm.ops.utils.commit import clear_pending

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for dtype in (torch.int32, torch.int64):
        pending = torch.tensor([2, 4, 1, 3, 5], dtype=torch.int32, device=dev)
        clear_pending(pending, torch.tensor([3, -1, 0, -7], dtype=dtype, device=dev))
        assert pending.tolist() == [0, 4, 1, 0, 5]
        clear_pending(pending, torch.zeros(0, dtype=dtype, device=dev))
        assert pending.tolist() == [0, 4, 1, 0, 5]
    pages = torch.tensor([[9, 2], [9, 4], [9, 1], [9, 3]], dtype=torch.int32, device=dev)      # strided by the page
    clear_pending(pages[:, 1], torch.tensor([3, -1, 0], dtype=torch.int32, device=dev))
    assert pages.tolist() == [[9, 0], [9, 4], [9, 1], [9, 0]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_decode_verify_commit_in_one_cuda_graph(family):
    # a serving step as an engine captures it: decode for some rows, verify + commit for others,
    # validate=False with preallocated outputs; graph replay equals the same calls run eagerly
    HV_, HK_, V_, K_, N_, L_, T_ = 16, 4, 64, 128, 16, 16, 4
    params = make_params(family, HV_, K_, seed=5)
    pools = [SlotPool(params, N_, V_, K_, HK_, window=L_, max_draft=T_, device="cuda", backend="triton",
                      eager_max_batch=0) for _ in range(2)]
    g = torch.Generator(device="cuda").manual_seed(0)
    init = 0.1 * torch.randn(N_, HV_, V_, K_, device="cuda", generator=g)
    dec_ids = torch.arange(0, 8, device="cuda", dtype=torch.int32)
    ver_ids = torch.arange(8, 16, device="cuda", dtype=torch.int32)
    for p in pools:
        p.load(torch.arange(N_, device="cuda"), init)
    x1 = {k: v.float() for k, v in make_inputs(params, 8, V_, K_, HK_, device="cuda", dtype=torch.float32,
                                                 generator=g).items()}
    xT = {k: v.float() for k, v in make_inputs(params, 8, V_, K_, HK_, steps=T_, device="cuda",
                                                 dtype=torch.float32, generator=g).items()}
    nd = torch.randint(1, T_ + 1, (8,), device="cuda", generator=g, dtype=torch.int32)
    acc = torch.minimum(torch.randint(1, T_ + 1, (8,), device="cuda", generator=g, dtype=torch.int32), nd)
    outs = [(torch.empty(8, HV_, V_, device="cuda"), torch.empty(8, T_, HV_, V_, device="cuda")) for _ in pools]

    def step(p, o):
        p.decode(dec_ids, out=o[0], validate=False, **x1)
        p.verify(ver_ids, num_drafts=nd, out=o[1], validate=False, **xT)
        p.commit(ver_ids, acc, validate=False)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(pools[0], outs[0])                 # warm-up (compiles), then reset state
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(pools[0], outs[0])
    for p in pools:
        p.load(torch.arange(N_, device="cuda"), init)
    e0 = [p.epoch.clone() for p in pools]
    for _ in range(2 * L_ + 2):                  # every row flushes at least once
        graph.replay()
        step(pools[1], outs[1])
        torch.cuda.synchronize()
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        assert torch.equal(pools[0].cursor, pools[1].cursor)
        assert torch.equal(pools[0].epoch - e0[0], pools[1].epoch - e0[1])
    assert int((pools[1].epoch - e0[1]).min()) > 0          # every row flushed (verify rows early)
    all_ids = torch.arange(N_, device="cuda")
    assert torch.equal(pools[0].materialize(all_ids), pools[1].materialize(all_ids))


# ------------------------------------------------------------------ draft counts on every backend

DEV = "cuda" if torch.cuda.is_available() else "cpu"    # of the triton backend (CPU: interpreted)
# inputs that reach the output outside the recurrence (Mamba-2's skip term and gate) and inside it
UNVERIFIED = {"mamba2": ("x", "z", "dt"), "gdn": ("v", "q", "a"), "kda": ("v", "q", "a")}


def _pair(family):
    """The same layer on both backends: a float64 reference pool and an fp32 triton pool."""
    params = make_params(family, HV, K, seed=3)
    ref = SlotPool(params, N, V, K, HK, window=L, max_draft=T, dtype=torch.float64, backend="reference")
    fast = SlotPool(params, N, V, K, HK, window=L, max_draft=T, backend="triton", device=DEV)
    init = 0.1 * torch.randn(N, HV, V, K, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for p in (ref, fast):
        p.load(torch.arange(N, device=p.device), init.to(p.device))
        # cursors 0, 2, 4, 5 (slots 0..3): rows at 4 and 5 flush early with 2 and 1 drafts
        for s, h in ((1, 2), (2, 4), (3, 5)):
            for i in range(h):
                x = make_inputs(params, 1, V, K, HK, generator=torch.Generator().manual_seed(10 * s + i))
                p.decode(torch.tensor([s], device=p.device), **{k: v.to(p.device, p.dtype) for k, v in x.items()})
    return params, ref, fast


def _on(pool, x):
    return {k: v.to(pool.device, pool.dtype) for k, v in x.items()}


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_outputs_past_num_drafts_are_zero_whatever_those_tokens_hold(family, value):
    # an engine's unused draft positions can hold anything: the outputs past each row's count
    # are exact zeros and the rest equal a clean call's, on the reference path (which applied
    # Mamba-2's skip term and gate to every token and then masked: NaN * 0) and the kernels
    params, ref, fast = _pair(family)
    clean = {k: v for k, v in make_inputs(params, N, V, K, HK, steps=T,
                                          generator=torch.Generator().manual_seed(5)).items()}
    n = torch.tensor([1, T, 2, 1])
    dirty = {k: v.clone() for k, v in clean.items()}
    for b, nb in enumerate(n.tolist()):
        for field in UNVERIFIED[family]:
            dirty[field][b, nb:] = float(value)
    ids = torch.tensor([0, 1, 2, 3])
    outs = {}
    for name, pool in (("reference", ref), ("triton", fast)):
        snap = [t.clone() for t in (*pool.ckpt.values(), *pool.buf.values(), pool.cursor, pool.epoch)]
        d = pool.device
        y_clean = pool.verify(ids.to(d), num_drafts=n.to(d), **_on(pool, clean))
        for t, s in zip((*pool.ckpt.values(), *pool.buf.values(), pool.cursor, pool.epoch), snap):
            t.copy_(s)                                            # the same state for the dirty call
        y = pool.verify(ids.to(d), num_drafts=n.to(d), **_on(pool, dirty))
        for b, nb in enumerate(n.tolist()):
            assert torch.equal(y[b, nb:], torch.zeros_like(y[b, nb:])), (name, b)
            assert torch.equal(y[b, :nb], y_clean[b, :nb]), (name, b)
        outs[name] = y
    assert rel_err(outs["triton"].double().cpu(), outs["reference"]) < 1e-5


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_unvalidated_draft_counts_are_clamped_to_0_T_on_every_backend(family):
    # validate=False takes counts as an engine hands them: each backend clamps them to 0..T
    # (docs/state-layout.md), so no row's pending count passes the drafts it wrote and a row
    # with 0 (or fewer) verifies nothing; both backends end in the same state
    params, ref, fast = _pair(family)
    x = make_inputs(params, N, V, K, HK, steps=T, generator=torch.Generator().manual_seed(6))
    ids = torch.tensor([0, 1, 2, 3])
    n = torch.tensor([T + 2, 0, -3, T])
    acc = torch.tensor([T + 5, 2, 1, 1])
    ys = {}
    for name, pool in (("reference", ref), ("triton", fast)):
        d = pool.device
        ys[name] = pool.verify(ids.to(d), num_drafts=n.to(d, torch.int32), validate=False, **_on(pool, x))
        assert pool.pending.tolist() == [T, 0, 0, T], name
        assert torch.equal(ys[name][1:3], torch.zeros_like(ys[name][1:3])), name
        pool.commit(ids.to(d), acc.to(d, torch.int32), validate=False)
        # slot 0 keeps its T drafts; slots 1, 2 had nothing pending; slot 3 (cursor 5) flushed early
        assert pool.cursor.tolist() == [T, 2, 4, 1], name
        assert int(pool.pending.abs().sum()) == 0, name
    assert rel_err(ys["triton"].double().cpu(), ys["reference"]) < 1e-5
    assert torch.equal(ref.epoch.cpu(), fast.epoch.cpu())
    all_ids = torch.arange(N)
    assert rel_err(fast.materialize(all_ids.to(DEV)).double().cpu(), ref.materialize(all_ids)) < 1e-5
