"""The snapshot baseline of speculative verification (every family): `snapshot_verify` writes
one state per draft token, `snapshot_commit` keeps the accepted one.

Many rounds of random draft and accepted counts, checked after every round against the float64
conventional recurrence over the accepted tokens only (`reference.schemes.snapshot_verify` on
float64 copies), within 1.5x the error of the fp32 conventional kernel run token by token on the
same inputs; which state slots a call may write is checked bit-wise. Without CUDA the kernels run
under TRITON_INTERPRET=1 at small shapes; the `gpu` tests repeat the checks at real shapes.
"""
import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


from replayssm.ops import gdn, kda, mamba2  # noqa: E402
from replayssm.ops.utils.snapshot import snapshot_commit  # noqa: E402
from replayssm.reference import schemes  # noqa: E402
from replayssm.shapes import shape as model_shape  # noqa: E402
from replayssm.testing import make_inputs, make_params  # noqa: E402

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device")
OPS = {"mamba2": mamba2, "gdn": gdn, "kda": kda}


def _double(p):
    """The fp32 parameters as float64: the reference sees exactly the kernels' values."""
    return dataclasses.replace(p, **{f.name: getattr(p, f.name).double() for f in dataclasses.fields(p)
                                     if isinstance(getattr(p, f.name), torch.Tensor)})


def _verify(family, p, inp, states, base, ids, nd, out=None, config=None, validate=True):
    if family == "mamba2":
        return mamba2.snapshot_verify(inp["x"], inp["dt"], inp["B"], inp["C"], p.A, p.dt_bias, p.D,
                                      inp.get("z"), states, base, ids, nd, out=out, config=config,
                                      validate=validate)
    return OPS[family].snapshot_verify(inp["q"], inp["k"], inp["v"], inp["a"], inp["b"], p.A_log,
                                       p.dt_bias, None, states, base, ids, nd, out=out, config=config,
                                       validate=validate)


def _conventional(family, p, tok, state, ids):
    if family == "mamba2":
        return mamba2.conventional_decode(tok["x"], tok["dt"], tok["B"], tok["C"], p.A, p.dt_bias, p.D,
                                          tok.get("z"), state, ids, validate=False)
    return OPS[family].conventional_decode(tok["q"], tok["k"], tok["v"], tok["a"], tok["b"], p.A_log,
                                           p.dt_bias, None, state, ids, validate=False)


def _bits(t):
    return t.view(torch.int32)


def run_rounds(family, HV, Hk, V, K, T, T1, *, rounds=32, live=2, pads=1, N=5, config=None,
               with_D=True, gate=True, device=DEV, seed=0):
    """`rounds` verify + commit rounds on `live` of `N` slots (slot N-1 never addressed), rows
    shuffled every round with `pads` padding rows; asserts the bookkeeping and which slots
    changed, and returns the relative errors against float64 accumulated over all rounds:
    `out`, `state` (the snapshot kernel's) and `conv_out`, `conv_state` (the fp32 conventional
    kernel's, token by token)."""
    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    p32 = make_params(family, HV, K, dtype=torch.float32, seed=seed, with_D=with_D)
    p64 = _double(p32)
    p32 = dataclasses.replace(p32, **{f.name: getattr(p32, f.name).to(dev) for f in dataclasses.fields(p32)
                                      if isinstance(getattr(p32, f.name), torch.Tensor)})
    S0 = 0.5 * torch.randn(N, HV, V, K, generator=g)
    # every slot but the current one poisoned: a read of a wrong slot cannot pass unseen
    states = torch.full((N, T1, HV, V, K), float("nan"))
    base_h = torch.randint(0, T1, (N,), generator=g, dtype=torch.int32)
    states[torch.arange(N), base_h.long()] = S0
    states, base = states.to(dev), base_h.clone().to(dev)      # a copy: the host model is separate
    S64, conv = S0.double(), S0.clone().to(dev)
    err = {key: [0.0, 0.0] for key in ("out", "state", "conv_out", "conv_state")}
    Bt = live + pads
    for r in range(rounds):
        slots = torch.randperm(N - 1, generator=g)[:live]
        ids_h = torch.cat([slots, torch.full((pads,), -1, dtype=torch.long)])
        ids_h = ids_h[torch.randperm(Bt, generator=g)].to(torch.int32)
        m_live = ids_h >= 0
        n_h = torch.randint(1, T + 1, (Bt,), generator=g, dtype=torch.int32)
        if r % 8 == 7:
            n_h[:] = T            # num_drafts=None: every row verifies T drafts
        acc_h = (torch.rand(Bt, generator=g) * n_h).long().to(torch.int32) + 1
        acc_h[~m_live] = T1 + 3   # a padding row's count must be ignored by the commit
        inp = make_inputs(p32, Bt, V, K, Hk, steps=T, gate=gate, dtype=torch.float32, generator=g)
        inp64 = {name: t.double()[m_live] for name, t in inp.items()}
        inp = {name: t.to(dev) for name, t in inp.items()}
        ids, nd = ids_h.to(dev), (None if r % 8 == 7 else n_h.to(dev))

        before = states.clone()
        out = torch.full((Bt, T, HV, V), float("nan"), device=dev)
        res = _verify(family, p32, inp, states, base, ids, nd, out=out, config=config)
        assert res is out
        out_h, after = out.cpu(), states.cpu()

        # bit-wise: only slots base + 1 .. base + n of the live rows' sequences changed
        written = torch.zeros(N, T1, dtype=torch.bool)
        for b in range(Bt):
            if ids_h[b] >= 0:
                s = int(ids_h[b])
                written[s, (int(base_h[s]) + 1 + torch.arange(int(n_h[b]))) % T1] = True
        assert torch.equal(_bits(after[~written]), _bits(before.cpu()[~written])), "a slot not written to changed"
        assert torch.equal(_bits(after[slots, base_h[slots].long()]), _bits(before.cpu()[slots, base_h[slots].long()]))
        m_t = torch.arange(T)[None, :] < n_h[:, None]                       # [Bt, T] drafts run
        m_out = m_t & m_live[:, None]
        assert bool((out_h[~m_out] == 0).all()), "padding rows and drafts past n must be exactly 0"
        assert bool(torch.isfinite(out_h[m_out]).all()) and bool(torch.isfinite(after[written]).all())

        # float64 oracle and the fp32 conventional kernel, token by token
        Y64, snaps64 = schemes.snapshot_verify(p64, S64[slots_of(ids_h)], **inp64)
        conv_snaps, conv_out = [], []
        for t in range(T):
            conv_out.append(_conventional(family, p32, {name: x[:, t] for name, x in inp.items()}, conv, ids).cpu())
            conv_snaps.append(conv.cpu().clone())
        conv_out = torch.stack(conv_out, 1)[m_live]
        m_l = m_t[m_live]
        _acc(err["out"], out_h[m_live][m_l], Y64[m_l])
        _acc(err["conv_out"], conv_out[m_l], Y64[m_l])

        snapshot_commit(base, ids, acc_h.to(dev), T1)
        live_slots = slots_of(ids_h)
        a_live = acc_h[m_live].long()
        base_h[live_slots] = ((base_h[live_slots].long() + a_live) % T1).to(torch.int32)
        assert torch.equal(base.cpu(), base_h), (base.cpu(), base_h)
        S64[live_slots] = schemes.snapshot_commit(snaps64, a_live)
        conv[live_slots] = torch.stack([conv_snaps[int(a) - 1][int(s)] for s, a in zip(live_slots, a_live)]).to(dev)
        st = states.cpu()
        _acc(err["state"], st[live_slots, base_h[live_slots].long()], S64[live_slots])
        _acc(err["conv_state"], conv.cpu()[live_slots], S64[live_slots])
    return {key: (num / den) ** 0.5 for key, (num, den) in err.items()}


def slots_of(ids):
    return ids[ids >= 0].long()


def _acc(e, x, ref):
    e[0] += (x.double() - ref).pow(2).sum().item()
    e[1] += ref.pow(2).sum().item()


def _check(res):
    # same arithmetic as the conventional kernel: its error is the yardstick
    assert 0 < res["conv_out"] and 0 < res["conv_state"], res
    assert res["out"] <= 1.5 * res["conv_out"], res
    assert res["state"] <= 1.5 * res["conv_state"], res


CASES = {
    "mamba2-small": ("mamba2", dict(HV=4, Hk=2, V=16, K=32, T=3, T1=4)),
    # a block of 8 rows spans two heads of 12 (the per-head scalars), K padded, no D, no gate
    "mamba2-odd": ("mamba2", dict(HV=2, Hk=1, V=12, K=24, T=3, T1=5, with_D=False, gate=False,
                                  config={"BV": 8, "perhead": True, "num_warps": 2})),
    "gdn-small": ("gdn", dict(HV=4, Hk=2, V=16, K=32, T=3, T1=4)),
    # two masked value blocks per head, K padded, three value heads on one key head
    "gdn-odd": ("gdn", dict(HV=3, Hk=1, V=24, K=20, T=3, T1=5, config={"BV": 16})),
    "kda-small": ("kda", dict(HV=4, Hk=2, V=16, K=32, T=3, T1=4)),
    "kda-odd": ("kda", dict(HV=3, Hk=1, V=24, K=20, T=3, T1=5, config={"BV": 16})),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rounds_match_conventional_recurrence_over_accepted_tokens(case):
    family, kw = CASES[case]
    _check(run_rounds(family, **kw))


# ---------------------------------------------------------------------------------------------
# validation


def _setup(family, Bt=3, N=4, T=2, T1=3):
    HV, Hk, V, K = 2, 1, 8, 16
    p = make_params(family, HV, K, dtype=torch.float32)
    inp = make_inputs(p, Bt, V, K, Hk, steps=T, dtype=torch.float32)
    st = {"states": torch.zeros(N, T1, HV, V, K), "base": torch.zeros(N, dtype=torch.int32),
          "ids": torch.tensor([2, -1, 0], dtype=torch.int32)[:Bt],
          "nd": torch.full((Bt,), T, dtype=torch.int32), "out": None, "config": None}
    return p, inp, st


def _bad_cases():
    def inp(name, fn):
        return lambda p, x, st: x.__setitem__(name, fn(x[name]))

    def st(name, val):
        return lambda p, x, s: s.__setitem__(name, val(s) if callable(val) else val)

    first = {"mamba2": "x", "gdn": "q", "kda": "q"}
    return [
        ("states dtype", lambda f: st("states", lambda s: s["states"].double()), "states"),
        ("states 4-d", lambda f: st("states", lambda s: s["states"][:, 0]), "states"),
        ("T1 < T + 1", lambda f: st("states", lambda s: s["states"][:, :2].contiguous()), "states"),
        ("base dtype", lambda f: st("base", lambda s: s["base"].long()), "base"),
        ("base value", lambda f: st("base", lambda s: s["base"] + 3), "base"),
        ("num_drafts shape", lambda f: st("nd", lambda s: s["nd"][:2]), "num_drafts"),
        ("num_drafts value", lambda f: st("nd", lambda s: s["nd"] * 0), "num_drafts"),
        ("num_drafts above T", lambda f: st("nd", lambda s: s["nd"] + 1), "num_drafts"),
        ("slot repeated", lambda f: st("ids", lambda s: torch.tensor([2, 2, 0], dtype=torch.int32)), "slot_ids"),
        ("slot out of range", lambda f: st("ids", lambda s: torch.tensor([4, -1, 0], dtype=torch.int32)), "slot_ids"),
        ("out shape", lambda f: st("out", lambda s: torch.zeros(3, 2, 2, 4)), "out"),
        ("config key", lambda f: st("config", {"KS": 2}), "config"),
        ("token input one token", lambda f: inp(first[f], lambda t: t[:, 0]), None),
        ("T mismatch", lambda f: inp({"mamba2": "dt", "gdn": "v", "kda": "a"}[f], lambda t: t[:, :1]), None),
    ]


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
@pytest.mark.parametrize("name, mutate, match", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_value_errors_name_the_argument(family, name, mutate, match):
    p, x, st = _setup(family)
    mutate(family)(p, x, st)
    if match is None:       # a token input of the wrong shape: the message names it
        match = {"token input one token": {"mamba2": "x", "gdn": "q", "kda": "q"},
                 "T mismatch": {"mamba2": "dt", "gdn": "v", "kda": "a"}}[name][family]
    before = st["states"].clone()
    with pytest.raises(ValueError, match=f"^{match}"):
        _verify(family, p, x, st["states"], st["base"], st["ids"], st["nd"], out=st["out"], config=st["config"])
    assert torch.equal(st["states"], before)


@pytest.mark.parametrize("mutate, match", [
    (lambda b, i, a: (b.long(), i, a), "base"),
    (lambda b, i, a: (b, i, a.long()), "accepted"),
    (lambda b, i, a: (b, i, a[:2]), "accepted"),
    (lambda b, i, a: (b, i.float(), a), "slot_ids"),
    (lambda b, i, a: (b, i, a * 0), "accepted"),
])
def test_commit_value_errors(mutate, match):
    base, ids, acc = mutate(torch.zeros(4, dtype=torch.int32), torch.tensor([1, -1, 3], dtype=torch.int32),
                            torch.tensor([1, 0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=f"^{match}"):
        snapshot_commit(base, ids, acc, 3)
    with pytest.raises(ValueError, match="^T1"):
        snapshot_commit(torch.zeros(4, dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                        torch.tensor([1], dtype=torch.int32), 1)


def test_commit_moves_live_rows_only_modulo_T1():
    base = torch.tensor([0, 3, 1, 2], dtype=torch.int32, device=DEV)
    ids = torch.tensor([1, -1, 3, 0], dtype=torch.int32, device=DEV)
    acc = torch.tensor([2, 9, 2, 1], dtype=torch.int32, device=DEV)
    assert snapshot_commit(base, ids, acc, 4) is base
    assert base.tolist() == [1, 1, 1, 0]


# ---------------------------------------------------------------------------------------------
# real shapes on the GPU


@gpu
@needs_gpu
@pytest.mark.parametrize("name", ["nemotron3-super", "qwen3.5-4b", "kimi-linear-48b"])
def test_gpu_real_shapes_T8(name):
    s = model_shape(name)
    _check(run_rounds(s.family, HV=s.HV, Hk=s.Hk, V=s.V, K=s.K, T=8, T1=9, rounds=32, live=6, pads=2,
                      N=8, device="cuda"))


@gpu
@needs_gpu
@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_gpu_cuda_graph_capture_of_verify_and_commit_matches_eager(family):
    HV, Hk, V, K, T, T1, N = 8, 4, 64, 128, 4, 5, 6
    p = make_params(family, HV, K, dtype=torch.float32, device="cuda")
    g = torch.Generator().manual_seed(1)
    xs = [{n: t.cuda() for n, t in make_inputs(p, 4, V, K, Hk, steps=T, dtype=torch.bfloat16, generator=g).items()}
          for _ in range(4)]
    ids = torch.tensor([3, -1, 0, 5], dtype=torch.int32, device="cuda")
    nd = torch.tensor([4, 1, 2, 3], dtype=torch.int32, device="cuda")
    acc = torch.tensor([2, 1, 1, 3], dtype=torch.int32, device="cuda")

    def pool():
        return torch.randn(N, T1, HV, V, K, generator=torch.Generator().manual_seed(2)).cuda(), \
            torch.arange(N, dtype=torch.int32, device="cuda") % T1

    def run(st, x, o):
        _verify(family, p, x, st[0], st[1], ids, nd, out=o, validate=False)
        snapshot_commit(st[1], ids, acc, T1, validate=False)

    x_static = {n: t.clone() for n, t in xs[0].items()}
    out = torch.empty(4, T, HV, V, device="cuda", dtype=torch.bfloat16)
    run(pool(), x_static, out)          # compile outside the capture
    torch.cuda.synchronize()
    eager, graphed = pool(), pool()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(graphed, x_static, out)
    for x in xs:
        o = torch.empty_like(out)
        run(eager, x, o)
        for n in x_static:
            x_static[n].copy_(x[n])
        graph.replay()
        assert torch.equal(o, out)
    torch.cuda.synchronize()
    assert torch.equal(eager[0], graphed[0]) and torch.equal(eager[1], graphed[1])
