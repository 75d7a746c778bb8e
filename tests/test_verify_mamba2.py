"""Mamba-2 speculative verification (`replayssm.ops.mamba2.replay_verify`) against the float64
conventional recurrence: rows at every kind of cursor in one launch (h = 0, L - 1, L; early
flush and none), per-row draft counts, padding rows, many verify rounds with random accepted
counts mixed with standard decode steps, poisoned outputs, poisoned draft inputs past each row's
count and NaN in the buffer past the cursor.

The yardstick (DESIGN.md, testing): the fp32 conventional kernel run token by token over the
same tokens, against the same float64 reference; the verify kernel must stay within 1.5x of its
error. Without CUDA the kernels run under TRITON_INTERPRET=1 at small shapes; the `gpu` tests
repeat the rounds at real model shapes.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from replayssm.ops.mamba2 import conventional_decode, replay_decode, replay_verify  # noqa: E402
from replayssm.reference import Mamba2Params, replay  # noqa: E402
from replayssm.testing import RelErr, make_inputs, make_params  # noqa: E402
from replayssm.testing.mamba2_harness import model_shape  # noqa: E402

from conftest import interpreter_windows  # noqa: E402

GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if GPU else "cpu")
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device")
NAN = float("nan")
# both errors sit at a few fp32 roundings (~1e-7): a ratio of two such numbers is noise, so an
# error below one unit of fp32 relative precision passes regardless
FLOOR = 2.0 ** -23
KEYS = ("x", "dt", "B", "C", "z")

SMALL = dict(HV=4, Hk=2, V=16, K=32)
ODD = dict(HV=6, Hk=2, V=12, K=24)        # V, K not powers of two, three heads per group


def _bits(t):
    """A tensor's bytes (NaN compares equal to the same NaN)."""
    return t.reshape(-1).view(torch.uint8)


def _layer(shape, seed):
    """Layer parameters as the kernels take them (fp32 on DEV) and their float64 reference."""
    p = make_params("mamba2", shape["HV"], shape["K"], seed=seed)
    A, dt_bias, D = (t.float() for t in (p.A, p.dt_bias, p.D))
    ref = Mamba2Params(A=A.double().to(DEV), dt_bias=dt_bias.double().to(DEV), D=D.double().to(DEV))
    return p, tuple(t.to(DEV) for t in (A, dt_bias, D)), ref


def _pool(shape, N, Lb, record_dtype):
    HV, Hk, V, K = shape["HV"], shape["Hk"], shape["V"], shape["K"]
    return dict(ckpt=torch.zeros(N, HV, V, K, device=DEV),
                buf_ld=torch.full((N, Lb, HV), NAN, device=DEV),
                buf_w=torch.full((N, Lb, HV, V), NAN, device=DEV, dtype=record_dtype),
                buf_k=torch.full((N, Lb, Hk, K), NAN, device=DEV, dtype=record_dtype),
                cursor=torch.zeros(N, dtype=torch.int32, device=DEV),
                pending=torch.zeros(N, dtype=torch.int32, device=DEV),
                epoch=torch.zeros(N, dtype=torch.int64, device=DEV),
                arrive=torch.zeros(N, dtype=torch.int32, device=DEV))


def _materialize(pool, ref, s):
    """Slot s's state in float64: its checkpoint and committed records folded (the buffer
    holds x; the values are dt x with dt = ld / A)."""
    h = int(pool["cursor"][s])
    ld = pool["buf_ld"][s, :h].double()
    w = ref.record_values(ld, pool["buf_w"][s, :h].double())
    return replay(pool["ckpt"][s].double(), ld, w, pool["buf_k"][s, :h].double())


def _strided(t, g):
    """`t` `[Bt, T, ...]` as a view with a last dim contiguous and batch and draft strides
    other than a contiguous tensor's (every other draft of a larger buffer)."""
    big = torch.randn(t.shape[0], 2 * t.shape[1], *t.shape[2:], generator=g).to(t.dtype)
    view = big.to(DEV)[:, ::2]
    view.copy_(t)
    return view


def _truth(ref, S, inp, rows, T):
    """Outputs `[Bt, T, HV, V]` and states after each token (float64) of the conventional
    recurrence from the states `S` (`[Bt, HV, V, K]`) of the given rows."""
    ys, Ss = [], []
    for t in range(T):
        y, S = ref.step(S, *(inp[k][rows, t].double() for k in KEYS))
        ys.append(y)
        Ss.append(S)
    return torch.stack(ys, 1), Ss


def _conventional(A, dt_bias, D, state, inp, sid, T):
    """The fp32 conventional kernel over the T tokens from `state` (modified: the state after
    the last token); returns the outputs `[Bt, T, HV, V]` and the states after each token."""
    ys, Ss = [], []
    for t in range(T):
        y = conventional_decode(*(inp[k][:, t].contiguous() for k in ("x", "dt", "B", "C")), A, dt_bias, D,
                                inp["z"][:, t].contiguous(), state, sid)
        ys.append(y)
        Ss.append(state.clone())
    return torch.stack(ys, 1), Ss


def _inputs(p, shape, Bt, T, g, bf16_values):
    inp = make_inputs(p, Bt, shape["V"], shape["K"], shape["Hk"], steps=T, generator=g)
    if bf16_values:
        # a bf16 model's activations passed as fp32: bf16 records then hold exact copies
        inp = {k: v.to(torch.bfloat16) for k, v in inp.items()}
    return {k: v.float().to(DEV) for k, v in inp.items()}


# ---------------------------------------------------------------------------------------------
# one launch: every kind of cursor


@pytest.mark.parametrize("T", [4, 6])      # the row-dot and the tensor-core kernel
def test_one_launch_every_cursor(T):
    # window 8, T = 4 or 6 (drafts past the counts below poisoned); slots at cursors 0, L - 1, L, 2, 5 with random records (NaN past the
    # cursor). Row draft counts make slot 4 (h = 5, n = 4) flush and slot 3 (h = 2, n = 3) not;
    # h = L - 1 and h = L flush with any count; slot 5 stays out of the batch; a padding row.
    shape, L = SMALL, 8
    HV, Hk, V, K = shape["HV"], shape["Hk"], shape["V"], shape["K"]
    N, Lb = 6, L + T
    g = torch.Generator().manual_seed(11)
    p, (A, dt_bias, D), ref = _layer(shape, 11)
    pool = _pool(shape, N, Lb, torch.float32)
    cursors = [0, L - 1, L, 2, 5, 3]
    S0 = {}
    for s, h in enumerate(cursors):
        pool["ckpt"][s] = 0.1 * torch.randn(HV, V, K, generator=g).to(DEV)
        rec = make_inputs(p, h, V, K, Hk, generator=g)
        pr = p.prepare(rec["x"], rec["dt"], rec["B"], rec["C"])
        pool["buf_ld"][s, :h] = pr["ld"].float().to(DEV)
        pool["buf_w"][s, :h] = pr["w"].float().to(DEV)
        pool["buf_k"][s, :h] = pr["k"].float().to(DEV)
        pool["cursor"][s] = h
        pool["epoch"][s] = 10 * s
        S0[s] = _materialize(pool, ref, s)
    before = {k: v.clone() for k, v in pool.items()}
    slots = [1, 0, -1, 2, 4, 3]
    nd = [4, 2, 3, 1, 4, 3]
    Bt = len(slots)
    sid = torch.tensor(slots, dtype=torch.int32, device=DEV)
    inp = _inputs(p, shape, Bt, T, g, False)
    live = [b for b, s in enumerate(slots) if s >= 0]
    for b in range(Bt):
        for k in KEYS:
            inp[k][b, nd[b]:] = NAN         # drafts past a row's count: poison, never read
    # a poisoned last draft of row 0 (its x): the drafts before it must not see it
    inp["x"][0, nd[0] - 1] = NAN
    sinp = {k: _strided(v, g) for k, v in inp.items()}
    assert sinp["x"].stride(1) == 2 * HV * V and not sinp["B"].is_contiguous()
    out = torch.full((Bt, T, HV, V), NAN, device=DEV)
    y = replay_verify(sinp["x"], sinp["dt"], sinp["B"], sinp["C"], A, dt_bias, D, sinp["z"], pool["ckpt"],
                      pool["buf_ld"], pool["buf_w"], pool["buf_k"], pool["cursor"], pool["pending"],
                      pool["epoch"], sid, L, num_drafts=torch.tensor(nd, dtype=torch.int32, device=DEV),
                      out=out, arrive=pool["arrive"])
    assert y is out
    assert (y[2] == 0).all(), "padding row not zero"

    ver, conv = RelErr(), RelErr()
    S = torch.stack([S0[slots[b]] for b in live])
    y_ref, _ = _truth(ref, S, inp, live, T)
    y_conv, _ = _conventional(A, dt_bias, D, S.float(), {k: v[live] for k, v in inp.items()},
                              torch.arange(len(live), dtype=torch.int32, device=DEV), T)
    for i, b in enumerate(live):
        s, n, h = slots[b], nd[b], cursors[slots[b]]
        flush = h + n > L
        assert (y[b, n:] == 0).all(), f"row {b}: outputs past its {n} drafts not zero"
        m = n - 1 if b == 0 else n
        assert torch.isfinite(y[b, :m]).all(), f"row {b}: a later draft reached an earlier output"
        ver.add(y[b, :m], y_ref[i, :m])
        conv.add(y_conv[i, :m], y_ref[i, :m])
        h1 = 0 if flush else h
        assert int(pool["cursor"][s]) == h1 and int(pool["pending"][s]) == n, f"slot {s}"
        assert int(pool["epoch"][s]) == 10 * s + flush, f"slot {s}: epoch"
        if flush:
            err = float((pool["ckpt"][s].double() - S0[s]).norm() / S0[s].norm())
            assert err < 1e-6, f"slot {s}: flushed checkpoint rel err {err:.2e} (fp32 fold of <= 8 records)"
        else:
            assert torch.equal(pool["ckpt"][s], before["ckpt"][s]), f"slot {s}: checkpoint written"
            for name in ("buf_ld", "buf_w", "buf_k"):
                assert torch.equal(pool[name][s, :h], before[name][s, :h]), f"slot {s}: committed {name}"
        # the drafts' records at h1..h1+n-1: x and B as given, ld = dt A
        pr = p.prepare(*(inp[k][b, :n].double().cpu() for k in ("x", "dt", "B", "C")))
        assert torch.equal(_bits(pool["buf_w"][s, h1:h1 + n]), _bits(inp["x"][b, :n]))
        assert torch.equal(pool["buf_k"][s, h1:h1 + n], inp["B"][b, :n])
        torch.testing.assert_close(pool["buf_ld"][s, h1:h1 + n].double().cpu(), pr["ld"], rtol=1e-6, atol=0)
        for name in ("buf_ld", "buf_w", "buf_k"):
            tail = pool[name][s, max(h1 + n, h):]
            assert torch.equal(tail.isnan(), before[name][s, max(h1 + n, h):].isnan()), f"slot {s}: {name} tail"
    assert ver.rel <= max(1.5 * conv.rel, FLOOR), (ver.rel, conv.rel)
    for name, t in pool.items():
        assert torch.equal(_bits(t[5]), _bits(before[name][5])), f"{name} of slot 5"
    assert (pool["arrive"] == 0).all()


# ---------------------------------------------------------------------------------------------
# many rounds: verify, accept, decode


def _rounds(shape, *, window, T, rounds, n_slots, seed, record_dtype=torch.float32,
            bf16_values=False, config=None):
    """`rounds` steps on `n_slots` slots (plus a spare that must stay untouched): mostly a
    verify of random per-row draft counts (drafts past each row's count NaN) followed by a
    random accepted count per row (commit emulated on the host: `cursor += a`, `pending = 0`),
    every fourth step a standard decode step; rows shuffled with one padding row. Before each
    step the buffer past every cursor is filled with NaN and the outputs with NaN. Returns
    relative errors against the float64 conventional recurrence over the accepted tokens:
    `verify` and `conventional` (outputs of live drafts), `state` and `conv_state` (each slot's
    materialised state after every step), plus the counts of `flushes` and `verifies`."""
    HV, V, K = shape["HV"], shape["V"], shape["K"]
    g = torch.Generator().manual_seed(seed)
    p, (A, dt_bias, D), ref = _layer(shape, seed)
    N, Lb = n_slots + 1, window + T
    pool = _pool(shape, N, Lb, record_dtype)
    pool["ckpt"][:n_slots] = (0.1 * torch.randn(n_slots, HV, V, K, generator=g)).to(DEV)
    spare = {k: v[n_slots].clone() for k, v in pool.items()}
    S64 = pool["ckpt"].double()
    conv_state = pool["ckpt"].clone()
    h_m, e_m = [0] * N, [0] * N
    err = {k: RelErr() for k in ("verify", "conventional", "state", "conv_state")}
    flushes = verifies = 0
    for r in range(rounds):
        for s in range(n_slots):
            for name in ("buf_ld", "buf_w", "buf_k"):
                pool[name][s, h_m[s]:] = NAN
        rows = list(range(n_slots)) + [-1]
        rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
        live = [b for b, s in enumerate(rows) if s >= 0]
        ls = [rows[b] for b in live]
        sid = torch.tensor(rows, dtype=torch.int32, device=DEV)
        if r % 4 == 3:
            inp = _inputs(p, shape, len(rows), 1, g, bf16_values)
            out = torch.full((len(rows), HV, V), NAN, device=DEV)
            step = {k: v[:, 0] for k, v in inp.items()}
            replay_decode(step["x"], step["dt"], step["B"], step["C"], A, dt_bias, D, step["z"], pool["ckpt"],
                          pool["buf_ld"], pool["buf_w"], pool["buf_k"], pool["cursor"], pool["epoch"], sid,
                          window, out=out, arrive=pool["arrive"])
            y_ref, Ss = _truth(ref, S64[ls], inp, live, 1)
            y_conv, _ = _conventional(A, dt_bias, D, conv_state, inp, sid, 1)
            err["verify"].add(out[live], y_ref[:, 0])
            err["conventional"].add(y_conv[live, 0], y_ref[:, 0])
            assert (out[[b for b in range(len(rows)) if rows[b] < 0]] == 0).all()
            S64[ls] = Ss[0]
            for s in ls:
                if h_m[s] + 1 >= window:
                    h_m[s], e_m[s] = 0, e_m[s] + 1
                else:
                    h_m[s] += 1
            pool["pending"][:n_slots] = 0
        else:
            verifies += 1
            nd = torch.randint(1, T + 1, (len(rows),), generator=g, dtype=torch.int32)
            inp = _inputs(p, shape, len(rows), T, g, bf16_values)
            y_ref, Ss = _truth(ref, S64[ls], inp, live, T)
            scratch = conv_state.clone()
            y_conv, Sc = _conventional(A, dt_bias, D, scratch, inp, sid, T)
            for b in range(len(rows)):
                for k in KEYS:
                    inp[k][b, int(nd[b]):] = NAN
            out = torch.full((len(rows), T, HV, V), NAN, device=DEV)
            replay_verify(inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, D, inp["z"], pool["ckpt"],
                          pool["buf_ld"], pool["buf_w"], pool["buf_k"], pool["cursor"], pool["pending"],
                          pool["epoch"], sid, window, num_drafts=nd.to(DEV), out=out, config=config,
                          arrive=pool["arrive"])
            for b in range(len(rows)):
                n = int(nd[b])
                assert (out[b, n:] == 0).all(), f"round {r}, row {b}: outputs past {n} drafts not zero"
                if rows[b] < 0:
                    assert (out[b] == 0).all(), f"round {r}: padding row not zero"
            acc = []
            for i, b in enumerate(live):
                s, n = rows[b], int(nd[b])
                err["verify"].add(out[b, :n], y_ref[i, :n])
                err["conventional"].add(y_conv[b, :n], y_ref[i, :n])
                flush = h_m[s] + n > window
                flushes += flush
                h1 = 0 if flush else h_m[s]
                e_m[s] += flush
                assert int(pool["cursor"][s]) == h1 and int(pool["pending"][s]) == n, f"round {r}, slot {s}"
                a = int(torch.randint(1, n + 1, (), generator=g))
                acc.append(a)
                h_m[s] = h1 + a
                S64[s] = Ss[a - 1][i]
                conv_state[s] = Sc[a - 1][s]
            # commit on the host
            idx = torch.tensor(ls, device=DEV)
            pool["cursor"][idx] += torch.tensor(acc, dtype=torch.int32, device=DEV)
            pool["pending"][idx] = 0
        assert pool["cursor"].tolist()[:n_slots] == h_m[:n_slots], f"round {r}: cursors"
        assert pool["epoch"].tolist()[:n_slots] == e_m[:n_slots], f"round {r}: epochs"
        assert (pool["arrive"] == 0).all(), f"round {r}: arrival counters not re-armed"
        for s in range(n_slots):
            err["state"].add(_materialize(pool, ref, s), S64[s])
            err["conv_state"].add(conv_state[s], S64[s])
    for k, v in pool.items():
        assert torch.equal(_bits(v[n_slots]), _bits(spare[k])), f"spare slot's {k}"
    res = {k: e.rel for k, e in err.items()}
    res.update(flushes=flushes, verifies=verifies)
    return res


def _check(res):
    assert res["verify"] <= max(1.5 * res["conventional"], FLOOR), res
    assert res["state"] <= max(1.5 * res["conv_state"], FLOOR), res
    # the yardstick itself is at fp32 rounding level
    assert res["conventional"] < 1e-5 and res["conv_state"] < 1e-5, res


@pytest.mark.interpret
def test_rounds_small():
    # 44 steps: 33 verify rounds per row (T = 4, window 8: early flushes at most cursors),
    # 11 decode steps. Interpreter, seed 0: outputs 1.17e-7 vs conventional 1.20e-7, states
    # 1.11e-7 vs 1.34e-7, 23 early flushes.
    # (22 steps in CI's subset: interpreter_windows)
    n = interpreter_windows(44)
    res = _rounds(SMALL, window=8, T=4, rounds=n, n_slots=3, seed=0)
    assert res["verifies"] >= 32 * n // 44 and res["flushes"] >= 10 * n // 44, res
    _check(res)


@pytest.mark.interpret
def test_rounds_small_tensor_core_kernel():
    # T = 6 (the Triton path's default from TC_MIN_T: the mma kernel), window 8, fp32 records
    # (split) on the even shape, bf16 records of bf16-valued inputs (no split) on the odd one
    # (half the rounds in CI's subset: interpreter_windows)
    n = interpreter_windows(24)
    res = _rounds(SMALL, window=8, T=6, rounds=n, n_slots=3, seed=2)
    assert res["verifies"] >= 16 * n // 24 and res["flushes"] >= 8 * n // 24, res
    _check(res)
    n = interpreter_windows(16)
    res = _rounds(ODD, window=6, T=5, rounds=n, n_slots=2, seed=3, record_dtype=torch.bfloat16,
                  bf16_values=True, config=dict(BV=16, num_warps=1))
    assert res["flushes"] >= 3 * n // 16, res
    _check(res)


@pytest.mark.interpret
@pytest.mark.slow       # configs no default selects (bf16 records, kq); the mma kernel's default runs in CI
def test_rounds_small_mma_kernel():
    # the exact 16-bit tensor-core kernel (config mma; with fp32 operands, every one split, it
    # runs in test_rounds_small_tensor_core_kernel as the default from TC_MIN_T): bf16 records
    # of bf16-valued inputs on the odd shape (masked lanes, the records' keys and values as
    # given) at T = 8
    res = _rounds(ODD, window=8, T=8, rounds=16, n_slots=2, seed=5, record_dtype=torch.bfloat16,
                  bf16_values=True, config=dict(mma=True, BV=16, num_warps=1))
    assert res["flushes"] >= 3, res
    _check(res)
    # the key products formed by the launch before (config kq)
    res = _rounds(SMALL, window=8, T=8, rounds=16, n_slots=2, seed=6, record_dtype=torch.bfloat16,
                  bf16_values=True, config=dict(mma=True, kq=True, BV=16, num_warps=1))
    assert res["flushes"] >= 3, res
    _check(res)


@pytest.mark.interpret
def test_rounds_odd_shape_bf16_records():
    # V = 12 and K = 24 (masked lanes in both), three heads per group, T = 3 (a padded draft
    # lane), bf16 records of bf16-valued inputs (exact copies), a window of 6. Interpreter,
    # seed 1: outputs 9.5e-8 vs conventional 1.2e-7, states 1.0e-7 vs 1.8e-7.
    n = interpreter_windows(20)                 # (10 in CI's subset)
    res = _rounds(ODD, window=6, T=3, rounds=n, n_slots=2, seed=1, record_dtype=torch.bfloat16,
                  bf16_values=True, config=dict(BV=8, num_warps=1))
    assert res["flushes"] >= 3 * n // 20, res
    _check(res)


def test_validation_names_the_argument():
    shape, L, T = SMALL, 4, 2
    g = torch.Generator().manual_seed(2)
    p, (A, dt_bias, D), ref = _layer(shape, 2)
    pool = _pool(shape, 2, L + T, torch.float32)
    inp = _inputs(p, shape, 1, T, g, False)
    sid = torch.zeros(1, dtype=torch.int32, device=DEV)
    state = [pool[k] for k in ("ckpt", "buf_ld", "buf_w", "buf_k", "cursor", "pending", "epoch")]

    def call(window=L, **kw):
        args = dict(inp, A=A, dt_bias=dt_bias, D=D)
        args.update(kw)
        return replay_verify(args["x"], args["dt"], args["B"], args["C"], args["A"], args["dt_bias"],
                             args["D"], args["z"], *state, sid, window,
                             **{k: v for k, v in kw.items() if k in ("num_drafts", "out", "config")})

    with pytest.raises(ValueError, match="x"):
        call(x=inp["x"][:, :, :, :-1])
    with pytest.raises(ValueError, match="dt"):
        call(dt=inp["dt"].double())
    with pytest.raises(ValueError, match="z"):
        call(z=inp["z"][:, :1])
    with pytest.raises(ValueError, match="Lb"):
        call(window=L + 1)
    with pytest.raises(ValueError, match="num_drafts"):
        call(num_drafts=torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match="num_drafts"):
        call(num_drafts=torch.tensor([1], dtype=torch.int64))
    with pytest.raises(ValueError, match="out"):
        call(out=torch.empty(1, T, shape["HV"], shape["V"] + 1, device=DEV))
    with pytest.raises(ValueError, match="BV"):
        call(config=dict(BV=12))
    with pytest.raises(ValueError, match="unknown"):
        call(config=dict(KS=2))
    assert pool["cursor"].tolist() == [0, 0] and pool["ckpt"].eq(0).all(), "a refused call wrote"


def test_custom_op_matches_the_function():
    # the registered op (the path torch.compile takes) and the function give identical results
    shape, L, T = SMALL, 4, 3
    g = torch.Generator().manual_seed(4)
    p, (A, dt_bias, D), ref = _layer(shape, 4)
    pools = [_pool(shape, 2, L + T, torch.float32) for _ in range(2)]
    for pool in pools:
        pool["ckpt"].fill_(0.25)
        pool["cursor"][1] = 3
        pool["buf_ld"][1, :3], pool["buf_w"][1, :3], pool["buf_k"][1, :3] = -0.1, 0.5, 0.5
    inp = _inputs(p, shape, 2, T, g, False)
    sid = torch.tensor([1, 0], dtype=torch.int32, device=DEV)
    outs = [torch.full((2, T, shape["HV"], shape["V"]), NAN, device=DEV) for _ in range(2)]
    names = ("ckpt", "buf_ld", "buf_w", "buf_k", "cursor", "pending", "epoch")
    replay_verify(inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, D, inp["z"],
                  *(pools[0][k] for k in names), sid, L, out=outs[0], arrive=pools[0]["arrive"])
    cfg = dict(BV=16, num_warps=1, num_stages=1)
    torch.ops.replayssm.mamba2_replay_verify(inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, D, inp["z"],
                                             *(pools[1][k] for k in names), pools[1]["arrive"], sid, None,
                                             outs[1], L, cfg["BV"], cfg["num_warps"], cfg["num_stages"])
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
    for k in names:
        assert torch.equal(pools[0][k].nan_to_num(7.0), pools[1][k].nan_to_num(7.0)), k
    assert pools[0]["cursor"].tolist() == [0, 0] and pools[0]["epoch"].tolist() == [0, 1]


# ---------------------------------------------------------------------------------------------
# real shapes on the GPU


@gpu
@needs_gpu
@pytest.mark.parametrize("name", ["nemotron3-super", "nemotron3-nano-4b"])
@pytest.mark.parametrize("T", [2, 4, 8])
def test_gpu_rounds_real_shapes(name, T):
    shape = model_shape(name)
    res = _rounds(shape, window=16, T=T, rounds=48, n_slots=12, seed=T)
    assert res["verifies"] >= 32 and res["flushes"] > 0, res
    _check(res)
    res = _rounds(shape, window=16, T=T, rounds=16, n_slots=6, seed=T + 1, record_dtype=torch.bfloat16,
                  bf16_values=True)
    _check(res)


@gpu
@needs_gpu
@pytest.mark.parametrize("name", ["nemotron3-super", "nemotron3-nano-4b"])
@pytest.mark.parametrize("T", [2, 4, 8])
@pytest.mark.parametrize("records", ["fp32", "bf16"])
def test_gpu_rounds_real_shapes_mma(name, T, records):
    # the exact tensor-core kernel at the model shapes, fp32 operands (all split) and bf16
    # records of bf16 inputs (as a bf16 model's pool holds them)
    shape = model_shape(name)
    bv = 64 if shape["V"] % 64 == 0 else 16
    cfg = dict(mma=True, BV=bv, num_warps=max(1, bv // 16), kq=records == "bf16")
    kw = dict(record_dtype=torch.bfloat16, bf16_values=True) if records == "bf16" else {}
    res = _rounds(shape, window=16, T=T, rounds=32, n_slots=8, seed=T + 7, config=cfg, **kw)
    assert res["verifies"] >= 16 and res["flushes"] > 0, res
    _check(res)


@pytest.mark.parametrize("T", [3, 5])
def test_absent_d_and_z(T):
    # D and z None (passed to the kernel as None; its heuristics drop them): the plain
    # recurrence's output y_t = S_t C_t from the checkpoint, at an empty and a partial buffer
    shape, L = SMALL, 4
    HV, Hk, V, K = shape["HV"], shape["Hk"], shape["V"], shape["K"]
    g = torch.Generator().manual_seed(5)
    p, (A, dt_bias, _), ref = _layer(shape, 5)
    pool = _pool(shape, 2, L + T, torch.float32)
    pool["ckpt"].copy_(0.1 * torch.randn(2, HV, V, K, generator=g))
    inp = _inputs(p, shape, 2, T, g, False)
    sid = torch.tensor([1, 0], dtype=torch.int32, device=DEV)
    y = replay_verify(inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, None, None, pool["ckpt"].clone(),
                      pool["buf_ld"], pool["buf_w"], pool["buf_k"], pool["cursor"], pool["pending"],
                      pool["epoch"], sid, L, arrive=pool["arrive"])
    G = HV // Hk
    for b in range(2):
        S = pool["ckpt"][int(sid[b])].double()
        for t in range(T):
            d = torch.nn.functional.softplus(inp["dt"][b, t].double() + dt_bias.double())
            kk = inp["B"][b, t].double().repeat_interleave(G, 0)
            S = torch.exp(d * A.double())[:, None, None] * S + (d[:, None] * inp["x"][b, t].double())[:, :, None] * kk[:, None, :]
            want = torch.einsum("hvk,hk->hv", S, inp["C"][b, t].double().repeat_interleave(G, 0))
            err = float((y[b, t].double() - want).norm() / want.norm())
            assert err < 1e-5, (b, t, err)
    assert pool["pending"].tolist() == [T, T]


@pytest.mark.interpret
def test_unvalidated_draft_counts_are_clamped():
    # validate=False takes the counts as a sampler hands them over: one above T and one below 0
    # verify as T and 0 drafts (the same bits everywhere), so no draft lands past the buffer
    shape, L, T = SMALL, 4, 3
    HV, V, K = shape["HV"], shape["V"], shape["K"]
    g = torch.Generator().manual_seed(5)
    p, (A, dt_bias, D), _ = _layer(shape, 5)
    inp = _inputs(p, shape, 3, T, g, False)
    sid = torch.tensor([1, -1, 0], dtype=torch.int32, device=DEV)
    res = []
    for counts in ([T, 1, 0], [T + 5, 1, -2]):
        pool = _pool(shape, 3, L + T, torch.float32)         # cursors 0: no record read yet
        pool["ckpt"].copy_(0.1 * torch.randn(3, HV, V, K, generator=torch.Generator().manual_seed(6)))
        y = replay_verify(inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, D, inp["z"], pool["ckpt"],
                          pool["buf_ld"], pool["buf_w"], pool["buf_k"], pool["cursor"], pool["pending"],
                          pool["epoch"], sid, L, num_drafts=torch.tensor(counts, dtype=torch.int32, device=DEV),
                          arrive=pool["arrive"], validate=False)
        res.append((y, pool))
    (y0, p0), (y1, p1) = res
    assert torch.equal(y0, y1) and torch.isfinite(y1).all()
    for k in p0:
        assert torch.equal(p0[k].view(torch.uint8), p1[k].view(torch.uint8)), k
    assert p1["pending"][[1, 0]].tolist() == [T, 0]
