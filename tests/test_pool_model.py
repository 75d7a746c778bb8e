"""Model-based tests of the slot pool: random sequences of decode / verify / commit / reset
over many windows, several slots and padding rows, checked step by step against the
conventional recurrence applied to the accepted tokens only (float64)."""
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replayssm.reference.schemes import snapshot_commit, snapshot_verify
from replayssm import SlotPool
from replayssm.testing import make_inputs, make_params

from conftest import rel_err

HV, HK, V, K = 4, 2, 8, 16
N, USED = 6, 4          # slots 4 and 5 are never addressed
L, T = 4, 3
TOL = 1e-12
SENTINEL = 7.25


def _fill_unused(pool):
    tensors = list(pool.ckpt.values()) + list((pool.ckpt_lp or {}).values()) + list(pool.buf.values())
    for t in tensors:
        t[USED:] = SENTINEL if t.is_floating_point() else 3
    snap = [t[USED:].clone() for t in tensors] + [pool.cursor[USED:].clone(), pool.epoch[USED:].clone()]
    return tensors, snap


def _check_unused(pool, tensors, snap):
    now = [t[USED:] for t in tensors] + [pool.cursor[USED:], pool.epoch[USED:]]
    for a, b in zip(now, snap):
        assert torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point else a,
                           b.view(torch.uint8) if b.dtype.is_floating_point else b)


class HypothesisDraws:
    def __init__(self, data):
        self.data = data

    def integer(self, lo, hi, label):
        return self.data.draw(st.integers(lo, hi), label=label)

    def choice(self, options, label):
        return self.data.draw(st.sampled_from(options), label=label)

    def rows(self):
        return self.data.draw(st.lists(st.sampled_from(list(range(USED)) + [-1]), min_size=1, max_size=5,
                                       unique_by=lambda x: x if x >= 0 else object()), label="rows")


class RandomDraws:
    def __init__(self, seed):
        self.rng = random.Random(seed)

    def integer(self, lo, hi, label):
        return self.rng.randint(lo, hi)

    def choice(self, options, label):
        return self.rng.choice(options)

    def rows(self):
        rows = self.rng.sample(range(USED), self.rng.randint(1, USED))
        rows.insert(self.rng.randint(0, len(rows)), -1)
        return rows


def run_model(family, draw, n_ops=None, gate=True):
    params = make_params(family, HV, K, seed=draw.integer(0, 1000, "pseed"))
    pool = SlotPool(params, N, V, K, HK, window=L, max_draft=T, dtype=torch.float64)
    tensors, snap = _fill_unused(pool)
    # slots start from a loaded random state (as after prefill), one from zero
    g = torch.Generator().manual_seed(draw.integer(0, 2**31 - 1, "gseed"))
    init = torch.randn(USED, HV, V, K, generator=g, dtype=torch.float64) * 0.1
    init[1] = 0
    pool.load(torch.arange(USED), init)
    oracle = {s: init[s:s + 1].clone() for s in range(USED)}
    n_tokens = {s: 0 for s in range(USED)}
    flushes = {"decode": 0, "verify": 0}

    n_ops = n_ops or draw.integer(20, 40, "n_ops")
    for _ in range(n_ops):
        op = draw.choice(["decode", "decode", "verify", "reset"], "op")
        rows = draw.rows()
        slot_ids = torch.tensor(rows, dtype=torch.int64)
        epoch0 = pool.epoch.clone()
        if op == "reset":
            pool.reset(slot_ids)
            for s in rows:
                if s >= 0:
                    oracle[s] = torch.zeros(1, HV, V, K, dtype=torch.float64)
            continue
        if op == "decode":
            inp = make_inputs(pool.params, len(rows), V, K, HK, gate=gate, generator=g)
            out = pool.decode(slot_ids, **inp)
            for b, s in enumerate(rows):
                if s < 0:
                    assert torch.all(out[b] == 0)
                    continue
                y, oracle[s] = pool.params.step(oracle[s], **{k: v[b:b + 1] for k, v in inp.items()})
                assert rel_err(out[b], y[0]) < TOL
                n_tokens[s] += 1
        else:
            steps = draw.integer(1, T, "T")
            inp = make_inputs(pool.params, len(rows), V, K, HK, steps=steps, gate=gate, generator=g)
            out = pool.verify(slot_ids, **inp)
            acc = torch.tensor([draw.integer(1, steps, "a") for _ in rows])
            pool.commit(slot_ids, acc)
            for b, s in enumerate(rows):
                if s < 0:
                    assert torch.all(out[b] == 0)
                    continue
                Y, snaps = snapshot_verify(pool.params, oracle[s], **{k: v[b:b + 1] for k, v in inp.items()})
                assert rel_err(out[b], Y[0]) < TOL
                oracle[s] = snapshot_commit(snaps, acc[b:b + 1])
                n_tokens[s] += int(acc[b])
        flushes[op] += int((pool.epoch - epoch0).sum())
        # the materialised state equals the conventional one for every used slot
        got = pool.materialize(torch.arange(USED))
        for s in range(USED):
            assert rel_err(got[s], oracle[s][0]) < TOL, (s, rel_err(got[s], oracle[s][0]))
        assert int(pool.cursor[:USED].max()) <= L
        _check_unused(pool, tensors, snap)
    return n_tokens, flushes


SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                    derandomize=True)


@SETTINGS
@given(data=st.data())
def test_model_mamba2(data):
    run_model("mamba2", HypothesisDraws(data))


@SETTINGS
@given(data=st.data())
def test_model_gdn(data):
    run_model("gdn", HypothesisDraws(data))


@SETTINGS
@given(data=st.data())
def test_model_kda(data):
    run_model("kda", HypothesisDraws(data))


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
@pytest.mark.parametrize("gate", [True, False])
def test_model_long_run(family, gate):
    """A fixed long run: every used slot goes through at least 3 windows, and flushes happen
    both in decode and in verify (the early-flush rule)."""
    n_tokens, flushes = run_model(family, RandomDraws({"mamba2": 1, "gdn": 2, "kda": 3}[family] * 10 + gate), n_ops=60, gate=gate)
    assert min(n_tokens.values()) >= 3 * L, n_tokens
    assert flushes["decode"] > 0 and flushes["verify"] > 0, flushes


def test_mamba2_bf16_records_exact_on_bf16_inputs():
    """Mamba-2 records keep `x` and `B` as given (dt x is formed when a record is read): on
    inputs that are bf16 values, a pool with bf16 records gives exactly the outputs and states
    of one with float64 records, through decode, verify (early flushes) and commit. Records of
    `dt x` would be rounded in bf16 and differ at about 1e-3."""
    params = make_params("mamba2", HV, K, seed=4)
    pools = [SlotPool(params, N, V, K, HK, window=L, max_draft=T, dtype=torch.float64, record_dtype=rd)
             for rd in (torch.float64, torch.bfloat16)]
    g = torch.Generator().manual_seed(5)
    ids = torch.tensor([0, 2, -1, 1])
    state0 = torch.randn(N, HV, V, K, generator=g, dtype=torch.float64)
    for pool in pools:
        pool.load(torch.arange(N), state0)

    def bf16_values(x):
        return {k: v.to(torch.bfloat16).double() for k, v in x.items()}

    for step in range(3 * L):
        if step % 3 == 2:
            x = bf16_values(make_inputs(params, 4, V, K, HK, steps=T, generator=g))
            accepted = torch.randint(1, T + 1, (4,), generator=g)
            ys = [pool.verify(ids, **x) for pool in pools]
            for pool in pools:
                pool.commit(ids, accepted)
        else:
            x = bf16_values(make_inputs(params, 4, V, K, HK, generator=g))
            ys = [pool.decode(ids, **x) for pool in pools]
        assert torch.equal(ys[0], ys[1]), f"step {step}: outputs differ by {rel_err(ys[1], ys[0]):.2e}"
    states = [pool.materialize(ids) for pool in pools]
    assert torch.equal(states[0], states[1])
    assert pools[1].buf["w"].dtype == torch.bfloat16
