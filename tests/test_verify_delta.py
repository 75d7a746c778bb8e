"""The GDN and KDA verify kernel (`replay_verify`) against the float64 conventional recurrence,
over many rounds of verify + commit mixed with plain decode steps; every test runs for both
families (KDA: channel-wise decay).

The yardstick (docs: verify contract) is the fp32 conventional kernel run token by token over the
same tokens (one state copy per draft), both measured against float64: the verify kernel's
outputs, and the state it materialises after each commit (checkpoint + committed records, folded
in float64), must stay within 1.5x of that kernel's error. Without CUDA the kernels run under
TRITON_INTERPRET=1 at small shapes; the `gpu` tests repeat the checks at real shapes.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


from replayssm.ops import gdn, kda  # noqa: E402
from replayssm.reference import GDNParams, KDAParams, replay  # noqa: E402
from replayssm.reference.common import l2norm  # noqa: E402
from replayssm.testing import make_inputs, make_params  # noqa: E402

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device")
OPS = {"gdn": gdn, "kda": kda}
# Both errors sit at a few fp32 units of rounding; below one fp32 ulp of relative precision a
# ratio of two such numbers is noise
FLOOR = 2.0 ** -23
SENT = 1.0e30


@pytest.fixture(params=["gdn", "kda"])
def family(request):
    return request.param


def _close(acc):
    return (acc[0] / acc[1]) ** 0.5 if acc[1] > 0 else float("nan")


class _Run:
    """One pool of kernel state, the fp32 conventional state and the float64 truth, driven
    through rounds of `verify` (random draft counts, random acceptance, commit emulated on the
    host) and plain `replay_decode` steps. Accumulates squared errors against the truth and
    collects bookkeeping and poison violations in `problems`."""

    def __init__(self, family, HV, Hk, V, K, L, T, cursors, *, rec=torch.float32, unused=1,
                 seed=0, config=None, io=torch.float32):
        g = torch.Generator().manual_seed(seed)
        self.g, self.family, self.ops, self.config, self.io = g, family, OPS[family], config, io
        self.HV, self.Hk, self.V, self.K, self.L, self.T = HV, Hk, V, K, L, T
        self.p32 = make_params(family, HV, K, dtype=torch.float32, seed=seed)
        P64 = GDNParams if family == "gdn" else KDAParams
        self.p64 = P64(A_log=self.p32.A_log.double().to(DEV), dt_bias=self.p32.dt_bias.double().to(DEV))
        self.A_log, self.dt_bias = self.p32.A_log.to(DEV), self.p32.dt_bias.to(DEV)
        live = len(cursors)
        self.N, self.Lb = live + unused, L + T
        perm = torch.randperm(self.N, generator=g)
        self.live, self.unused = perm[:live].sort().values, perm[live:]
        cur = torch.zeros(self.N, dtype=torch.int64)
        cur[self.live] = torch.tensor(cursors)
        # committed records before the first round, bf16-representable (every record dtype
        # starts from the same state), folded by the truth in float64
        N, Lb = self.N, self.Lb
        kd = (K,) if family == "kda" else ()
        C0 = 0.1 * torch.randn(N, HV, V, K, generator=g)
        a0 = 0.5 * torch.randn(N, Lb, HV, *kd, generator=g, dtype=torch.float64)
        A = torch.exp(self.p32.A_log.double())
        sp = torch.nn.functional.softplus(a0 + self.p32.dt_bias.double())
        ld0 = (-(A[:, None] if family == "kda" else A) * sp).float()
        w0 = (0.3 * torch.randn(N, Lb, HV, V, generator=g)).bfloat16().float()
        k0 = l2norm(torch.randn(N, Lb, Hk, K, generator=g, dtype=torch.float64)).bfloat16().float()
        self.S = C0.double().clone()
        for s in self.live.tolist():
            c = int(cur[s])
            self.S[s] = replay(C0[s].double(), ld0[s, :c].double(), w0[s, :c].double(), k0[s, :c].double())
        self.st = {"ckpt": C0.clone(), "buf_ld": ld0.clone(), "buf_w": w0.to(rec), "buf_k": k0.to(rec),
                   "cursor": cur.int(), "pending": torch.zeros(N, dtype=torch.int32),
                   "epoch": torch.zeros(N, dtype=torch.int64)}
        for s in self.unused.tolist():
            for name in ("ckpt", "buf_ld", "buf_w", "buf_k"):
                self.st[name][s] = SENT
            self.st["cursor"][s], self.st["pending"][s], self.st["epoch"][s] = 12345, 3, 777
        self.st = {n: t.to(DEV) for n, t in self.st.items()}
        self.frozen = {n: t[self.unused.to(DEV)].clone() for n, t in self.st.items()}
        self.conv = self.S.float().to(DEV)
        self.S = self.S.to(DEV)
        self.arrive = torch.zeros(N, dtype=torch.int32, device=DEV)
        self.cur, self.ep = cur.clone(), torch.zeros(N, dtype=torch.int64)
        self.acc = {key: [0.0, 0.0] for key in ("out", "conv_out", "state", "conv_state")}
        self.problems, self.seen, self.rounds = [], set(), 0

    def _add(self, key, x, ref):
        d = x.double() - ref
        self.acc[key][0] += float((d * d).sum())
        self.acc[key][1] += float((ref * ref).sum())

    def _rows(self, pad_rows=1):
        ids = torch.cat([self.live, torch.full((pad_rows,), -1, dtype=torch.int64)])
        return ids[torch.randperm(ids.numel(), generator=self.g)]

    def _poison_past_cursor(self):
        # records at or past the cursor are dead: NaN there must leave no trace
        for s in self.live.tolist():
            h = int(self.cur[s])
            for name in ("buf_ld", "buf_w", "buf_k"):
                self.st[name][s, h:] = float("nan")

    def _inputs(self, Bt, steps=None):
        x = make_inputs(self.p32, Bt, self.V, self.K, self.Hk, steps=steps, dtype=self.io, generator=self.g)
        return {n: t.to(DEV) for n, t in x.items()}

    def verify(self, n=None, strided=False):
        """One verify round (draft counts `n` `[live]`, default random 1..T), then a random
        acceptance committed on the host, then the materialised state checked."""
        T, L, st = self.T, self.L, self.st
        self._poison_past_cursor()
        ids = self._rows()
        Bt = ids.numel()
        rows = (ids >= 0).nonzero()[:, 0]
        slots = ids[rows]
        nd = torch.full((Bt,), T, dtype=torch.int32)
        nd[rows] = (torch.randint(1, T + 1, (rows.numel(),), generator=self.g).int() if n is None
                    else torch.as_tensor(n, dtype=torch.int32))
        acc = torch.ones(Bt, dtype=torch.int64)
        acc[rows] = (torch.rand(rows.numel(), generator=self.g) * nd[rows]).long() + 1
        x = self._inputs(Bt, steps=T)
        if strided:
            # views into one buffer with a padded draft stride and an extra batch stride
            x = {name: torch.cat([t, torch.zeros_like(t[:, :1])], 1)[:, :T] for name, t in x.items()}
        h0 = self.cur[slots]
        flush = h0 + nd[rows].long() > L
        for s, hh, f in zip(slots.tolist(), h0.tolist(), flush.tolist()):
            self.seen.add((hh, bool(f)))
        x64 = {name: t.double() for name, t in x.items()}
        # truth and the conventional kernel: token by token from the committed state
        S, C = self.S[slots.to(DEV)].clone(), self.conv.clone()
        ref = torch.zeros(rows.numel(), T, self.HV, self.V, dtype=torch.float64, device=DEV)
        S_acc, C_acc = S.clone(), None
        conv_out = torch.zeros_like(ref)
        rows_d = rows.to(DEV)
        C_acc = self.conv.clone()
        for t in range(T):
            live_t = nd[rows] > t
            o_t, S = self.p64.step(S, **{name: v[rows_d, t] for name, v in x64.items()})
            ref[:, t] = torch.where(live_t.to(DEV)[:, None, None], o_t, 0.)
            take = (acc[rows] == t + 1).to(DEV)
            S_acc[take] = S[take]
            sid = torch.where(nd > t, ids, -1).int().to(DEV)
            oc = self.ops.conventional_decode(*(x[name][:, t].contiguous() for name in ("q", "k", "v", "a", "b")),
                                              self.A_log, self.dt_bias, None, C, sid)
            conv_out[:, t] = torch.where(live_t.to(DEV)[:, None, None], oc[rows_d].double(), 0.)
            took = slots[acc[rows] == t + 1].to(DEV)
            C_acc[took] = C[took]
        out = torch.full((Bt, T, self.HV, self.V), float("nan"), device=DEV, dtype=self.io)
        self.ops.replay_verify(x["q"], x["k"], x["v"], x["a"], x["b"], self.A_log, self.dt_bias, None,
                               st["ckpt"], st["buf_ld"], st["buf_w"], st["buf_k"], st["cursor"],
                               st["pending"], st["epoch"], ids.int().to(DEV), L, num_drafts=nd.to(DEV),
                               out=out, config=self.config, arrive=self.arrive)
        self._check_out(out, ids, nd)
        live_mask = (torch.arange(T)[None, :] < nd[rows][:, None]).to(DEV)
        self._add("out", out[rows_d].double()[live_mask], ref[live_mask])
        self._add("conv_out", conv_out[live_mask], ref[live_mask])
        # bookkeeping, then the commit on the host
        hp = torch.where(flush, 0, h0)
        self.ep[slots] += flush.long()
        self._check_books(f"verify {self.rounds}", pending=dict(zip(slots.tolist(), nd[rows].tolist())),
                          cur={s: int(c) for s, c in zip(slots.tolist(), hp.tolist())})
        self.cur[slots] = hp + acc[rows]
        st["cursor"][slots.to(DEV)] = self.cur[slots].int().to(DEV)
        st["pending"][slots.to(DEV)] = 0
        self.S[slots.to(DEV)] = S_acc
        self.conv = C_acc
        self._check_state(slots)
        self.rounds += 1

    def decode(self):
        """One plain `replay_decode` step of every live slot."""
        st, L = self.st, self.L
        self._poison_past_cursor()
        ids = self._rows()
        rows = (ids >= 0).nonzero()[:, 0]
        slots = ids[rows]
        x = self._inputs(ids.numel())
        rows_d, slots_d = rows.to(DEV), slots.to(DEV)
        o_ref, S = self.p64.step(self.S[slots_d], **{n: t[rows_d].double() for n, t in x.items()})
        self.S[slots_d] = S
        sid = ids.int().to(DEV)
        oc = self.ops.conventional_decode(x["q"], x["k"], x["v"], x["a"], x["b"], self.A_log, self.dt_bias,
                                          None, self.conv, sid)
        out = torch.full((ids.numel(), self.HV, self.V), float("nan"), device=DEV, dtype=self.io)
        self.ops.replay_decode(x["q"], x["k"], x["v"], x["a"], x["b"], self.A_log, self.dt_bias, None,
                               st["ckpt"], st["buf_ld"], st["buf_w"], st["buf_k"], st["cursor"],
                               st["epoch"], sid, L, out=out, arrive=self.arrive)
        if bool(torch.isnan(out).any()) or bool((out[(ids < 0).to(DEV)] != 0).any()):
            self.problems.append(f"decode {self.rounds}: output unwritten or padding not zero")
        self._add("out", out[rows_d], o_ref)
        self._add("conv_out", oc[rows_d], o_ref)
        h = self.cur[slots]
        f = h + 1 >= L
        self.ep[slots] += f.long()
        self.cur[slots] = torch.where(f, 0, h + 1)
        self._check_books(f"decode {self.rounds}")
        self._check_state(slots)

    def _check_out(self, out, ids, nd):
        T = out.shape[1]
        dead = (torch.arange(T)[None, :] >= nd[:, None]) | (ids < 0)[:, None]
        dead = dead.to(DEV)
        if bool(torch.isnan(out[~dead]).any()):
            self.problems.append(f"verify {self.rounds}: outputs left unwritten (NaN)")
        if bool((out[dead] != 0).any()):
            self.problems.append(f"verify {self.rounds}: drafts past n or padding rows not zero")

    def _check_books(self, what, pending=None, cur=None):
        c, e = self.st["cursor"].cpu(), self.st["epoch"].cpu()
        want = self.cur.clone()
        for s, h in (cur or {}).items():
            want[s] = h
        lv = self.live
        if not torch.equal(c[lv].long(), want[lv]) or not torch.equal(e[lv], self.ep[lv]):
            self.problems.append(f"{what}: cursor {c[lv].tolist()} epoch {e[lv].tolist()}, expected "
                                 f"{want[lv].tolist()} {self.ep[lv].tolist()}")
        if pending is not None:
            p = self.st["pending"].cpu()
            if any(int(p[s]) != n for s, n in pending.items()):
                self.problems.append(f"{what}: pending {p.tolist()}, expected {pending}")
        if bool((self.arrive != 0).any()):
            self.problems.append(f"{what}: arrive counters not re-armed")

    def _check_state(self, slots):
        st = self.st
        for s in slots.tolist():
            h = int(self.cur[s])
            rec = [st[name][s, :h].double() for name in ("buf_ld", "buf_w", "buf_k")]
            M = replay(st["ckpt"][s].double(), *rec)
            self._add("state", M, self.S[s])
            self._add("conv_state", self.conv[s], self.S[s])

    def finish(self) -> dict:
        for name, t in self.st.items():
            now = t[self.unused.to(DEV)]
            if not torch.equal(now.view(torch.uint8) if t.dtype.is_floating_point else now,
                               self.frozen[name].view(torch.uint8) if t.dtype.is_floating_point
                               else self.frozen[name]):
                self.problems.append(f"unused slot's {name} changed")
        return {key: _close(a) for key, a in self.acc.items()}


def _drive(family, rounds, decode_every=3, **kw):
    run = _Run(family, **kw)
    for r in range(rounds):
        run.verify()
        if r % decode_every == decode_every - 1:
            run.decode()
    return run, run.finish()


def _check_accuracy(run, err, floor=FLOOR):
    assert run.problems == [], run.problems[:5]
    assert err["out"] <= max(1.5 * err["conv_out"], floor), err
    assert err["state"] <= max(1.5 * err["conv_state"], floor), err
    # the yardstick itself is at fp32 rounding level
    assert err["conv_out"] < 1e-5 and err["conv_state"] < 1e-5, err


@pytest.mark.interpret
def test_rounds_cursors_flush_and_partial_drafts(family):
    # 3 slots starting at cursors 0, L-1 and L (window 4, T = 3: flush and no flush in the
    # first launch), two value heads on one key head, random draft counts and acceptance, a padding row, an unused slot, NaN past
    # every cursor, 32 verify rounds with a decode step after every third
    run, err = _drive(family, 32, HV=2, Hk=1, V=16, K=32, L=4, T=3, cursors=(0, 3, 4), seed=0)
    _check_accuracy(run, err)
    for h in (0, 3, 4):
        assert any(c == h for c, _ in run.seen), run.seen
    assert {f for _, f in run.seen} == {True, False}


@pytest.mark.interpret
def test_rounds_odd_sizes_three_heads_per_key_head(family):
    # V = 20, K = 24 (tiles padded to 32), HG = 3, two V-blocks per head (BV = 16)
    run, err = _drive(family, 12, HV=3, Hk=1, V=20, K=24, L=5, T=4, cursors=(5, 2), seed=1,
                      config={"BV": 16, "num_warps": 1})
    _check_accuracy(run, err)


@pytest.mark.interpret
def test_bf16_records_error_at_bf16_level_not_growing(family):
    # bf16 records (the stored u and k rounded): error at bf16 level; the second half of the
    # rounds no worse than 1.5x the first
    run = _Run(family, HV=2, Hk=1, V=16, K=32, L=4, T=3, cursors=(4, 1), rec=torch.bfloat16, seed=2)
    halves = []
    for half in range(2):
        for r in range(6):
            run.verify()
        halves.append(_close(run.acc["out"]))
    err = run.finish()
    assert run.problems == [], run.problems[:5]
    assert 1e-5 < err["out"] < 5e-3 and err["state"] < 5e-3, err
    assert halves[1] < 1.5 * halves[0] + 1e-4, halves


@pytest.mark.interpret
def test_strided_inputs_and_default_draft_count_match(family):
    # q, k, v, a, b as views with a padded draft stride and num_drafts=None (every row T drafts):
    # the same bits as contiguous inputs with num_drafts all T
    runs = [_Run(family, HV=2, Hk=1, V=16, K=32, L=4, T=2, cursors=(3, 0), seed=3) for _ in range(2)]
    T, ops = 2, OPS[family]
    x = runs[0]._inputs(3, steps=T)
    xs = {n: torch.cat([t, t[:, :1]], 1)[:, :T] for n, t in x.items()}
    assert not xs["q"].is_contiguous()
    ids = torch.tensor([runs[0].live[1], -1, runs[0].live[0]], dtype=torch.int32, device=DEV)
    outs = []
    for run, inp, nd in ((runs[0], x, torch.full((3,), T, dtype=torch.int32, device=DEV)), (runs[1], xs, None)):
        st = run.st
        outs.append(ops.replay_verify(inp["q"], inp["k"], inp["v"], inp["a"], inp["b"], run.A_log, run.dt_bias,
                                      None, st["ckpt"], st["buf_ld"], st["buf_w"], st["buf_k"], st["cursor"],
                                      st["pending"], st["epoch"], ids, 4, num_drafts=nd, arrive=run.arrive))
    assert torch.equal(outs[0], outs[1])
    for n in runs[0].st:
        assert torch.equal(runs[0].st[n].view(torch.uint8), runs[1].st[n].view(torch.uint8)), n
    assert runs[1].st["pending"][ids[[0, 2]].long()].tolist() == [T, T]


def _args(family, T=2, Bt=3, N=4, L=4):
    p = make_params(family, 4, 32, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    x = {n: t.to(DEV) for n, t in make_inputs(p, Bt, 16, 32, 2, steps=T, dtype=torch.float32, generator=g).items()}
    kd = (32,) if family == "kda" else ()
    st = {"ckpt": torch.zeros(N, 4, 16, 32, device=DEV), "buf_ld": torch.zeros(N, L + T, 4, *kd, device=DEV),
          "buf_w": torch.zeros(N, L + T, 4, 16, device=DEV), "buf_k": torch.zeros(N, L + T, 2, 32, device=DEV),
          "cursor": torch.tensor([1, 0, 4, 2], dtype=torch.int32, device=DEV),
          "pending": torch.zeros(N, dtype=torch.int32, device=DEV),
          "epoch": torch.zeros(N, dtype=torch.int64, device=DEV)}
    return dict(x, A_log=p.A_log.to(DEV), dt_bias=p.dt_bias.to(DEV), scale=None, **st,
                slot_ids=torch.tensor([2, -1, 0], dtype=torch.int32, device=DEV), window=L)


def _bad_cases():
    def set_(key, fn):
        return lambda kw: kw.__setitem__(key, fn(kw[key]))
    return [
        ("q rank", set_("q", lambda t: t[:, 0]), "q must be"),
        ("T too large", None, "T=9"),
        ("k shape", set_("k", lambda t: t[:, :1]), "k has shape"),
        ("v drafts", set_("v", lambda t: t[:, :1]), "v must be"),
        ("a shape", set_("a", lambda t: t[..., :1]), "a has shape"),
        ("b shape", set_("b", lambda t: t[:, None]), "b has shape"),
        ("q stride", set_("q", lambda t: t.transpose(2, 3).contiguous().transpose(2, 3)),
         "q must have a contiguous last dim"),
        ("pending dtype", set_("pending", lambda t: t.long()), "pending has dtype"),
        ("capacity", set_("buf_w", lambda t: t[:, :5]), "buf_ld has shape"),
        ("capacity below window + T", lambda kw: [kw.__setitem__(n, kw[n][:, :5].contiguous()) for n in ("buf_ld", "buf_w", "buf_k")],
         "Lb=5 must be at least"),
        ("num_drafts dtype", lambda kw: kw.__setitem__("num_drafts", torch.ones(3, dtype=torch.int64, device=DEV)),
         "num_drafts has dtype"),
        ("num_drafts value", lambda kw: kw.__setitem__("num_drafts", torch.tensor([1, 3, 2], dtype=torch.int32,
                                                                                  device=DEV)),
         r"num_drafts\[1\]=3"),
        ("cursor past window", lambda kw: kw["cursor"].__setitem__(0, 5), r"cursor\[0\]=5"),
        ("out shape", lambda kw: kw.__setitem__("out", torch.empty(3, 4, 16, device=DEV)), "out has shape"),
        ("slot twice", set_("slot_ids", lambda t: torch.tensor([2, 2, -1], dtype=torch.int32, device=DEV)),
         "repeats"),
        ("config key", lambda kw: kw.__setitem__("config", {"BC": 2}), "unknown keys"),
        ("config KS", lambda kw: kw.__setitem__("config", {"KS": 3}), "KS=3"),
        ("config BV", lambda kw: kw.__setitem__("config", {"BV": 12}), "BV=12"),
    ]


@pytest.mark.parametrize("name,mutate,match", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_verify_value_errors_launch_nothing(family, name, mutate, match):
    kw = _args(family, T=9 if name == "T too large" else 2)
    if mutate is not None:
        mutate(kw)
    before = {n: kw[n].clone() for n in ("ckpt", "buf_ld", "buf_w", "buf_k", "cursor", "pending", "epoch")}
    with pytest.raises(ValueError, match=match):
        OPS[family].replay_verify(**kw)
    for n, t in before.items():
        assert torch.equal(kw[n], t), n


@pytest.mark.interpret
def test_custom_op_schema_and_fake(family):
    kw = _args(family)
    arrive = torch.zeros(4, dtype=torch.int32, device=DEV)
    o = torch.empty_like(kw["v"])
    nd = torch.tensor([2, 2, 1], dtype=torch.int32, device=DEV)
    args = tuple(kw[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias")) + (0.2,) + tuple(
        kw[n] for n in ("ckpt", "buf_ld", "buf_w", "buf_k", "cursor", "pending", "epoch")) + (
        arrive, kw["slot_ids"], nd, 4, o, True, 16, 2, 1, 8)
    torch.library.opcheck(getattr(torch.ops.replayssm, f"{family}_replay_verify").default, args,
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------
# real shapes on the GPU

_REAL = {"gdn": {"qwen3.5-4b": dict(HV=32, Hk=16, V=128, K=128), "qwen3.5-122b": dict(HV=64, Hk=16, V=128, K=128)},
         "kda": {"kimi-linear": dict(HV=32, Hk=32, V=128, K=128)}}


@gpu
@needs_gpu
@pytest.mark.parametrize("T", [2, 4, 8])
@pytest.mark.parametrize("rec", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_real_shapes(family, T, rec):
    # window 16, cursors 0, L-1, L and spread, 32 verify rounds with decode steps between
    for name, shape in _REAL[family].items():
        run, err = _drive(family, 32, **shape, L=16, T=T, cursors=(0, 15, 16, 4, 9, 12, 1, 16), seed=T,
                          rec=rec)
        if rec == torch.float32:
            _check_accuracy(run, err)
        else:
            assert run.problems == [], run.problems[:5]
            assert err["out"] < 1e-2 and err["state"] < 1e-2, (name, err)


@pytest.mark.interpret
def test_unvalidated_draft_counts_are_clamped(family):
    # validate=False takes the counts as a sampler hands them over: one above T and one below 0
    # verify as T and 0 drafts (the same bits everywhere), so no draft lands past the buffer
    T, ops = 3, OPS[family]
    runs = [_Run(family, HV=2, Hk=1, V=16, K=32, L=4, T=T, cursors=(1, 0), seed=4) for _ in range(2)]
    x = runs[0]._inputs(3, steps=T)
    ids = torch.tensor([runs[0].live[1], -1, runs[0].live[0]], dtype=torch.int32, device=DEV)
    outs = []
    for run, counts in ((runs[0], [T, 1, 0]), (runs[1], [T + 5, 1, -2])):
        st = run.st
        outs.append(ops.replay_verify(x["q"], x["k"], x["v"], x["a"], x["b"], run.A_log, run.dt_bias, None,
                                      st["ckpt"], st["buf_ld"], st["buf_w"], st["buf_k"], st["cursor"],
                                      st["pending"], st["epoch"], ids, 4,
                                      num_drafts=torch.tensor(counts, dtype=torch.int32, device=DEV),
                                      arrive=run.arrive, validate=False))
    assert torch.equal(outs[0], outs[1]) and torch.isfinite(outs[1]).all()
    for n in runs[0].st:
        assert torch.equal(runs[0].st[n].view(torch.uint8), runs[1].st[n].view(torch.uint8)), n
    assert runs[1].st["pending"][ids[[0, 2]].long()].tolist() == [T, 0]
