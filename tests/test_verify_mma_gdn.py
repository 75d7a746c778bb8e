"""GDN's verify kernel with exact 16-bit tensor-core products (ops/gdn/verify_mma.py, config
`mma`), with the rounds harness of tests/test_verify_delta.py: many rounds of verify + commit
mixed with decode steps against the float64 reference, within 1.5x the conventional fp32
kernel's error (fp32 records and inputs: every operand split in three pieces), and bf16 records
of bf16 inputs (one piece each) at bf16 level and against the Triton kernel launch by launch.
Drafts past a row's count and poisoned drafts; the config key (GDN only, not with gluon). On the
CPU the kernel runs under the interpreter at small shapes; the `gpu` test takes the model shapes.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from replayssm.ops import gdn, kda  # noqa: E402
from replayssm.ops.gdn.verify import verify_config  # noqa: E402
from test_verify_delta import _REAL, DEV, _check_accuracy, _drive, _Run, gpu, needs_gpu  # noqa: E402

MMA = dict(mma=True, BV=16, num_warps=1)


def _show(what, err):
    print(f"{what}: verify out {err['out']:.3e} (conventional {err['conv_out']:.3e}), "
          f"state {err['state']:.3e} (conventional {err['conv_state']:.3e})")


@pytest.mark.interpret
@pytest.mark.parametrize("T, L, cursors", [(3, 4, (0, 3, 4)), (8, 8, (0, 7, 8, 3))], ids=["T3", "T8"])
def test_rounds_fp32(T, L, cursors):
    # fp32 records and inputs; cursors 0, L-1, L (flush and no flush in the first launch), two
    # value heads on one key head, random draft counts and acceptance, a padding row, an unused
    # slot, NaN past every cursor, a decode step after every third round
    run, err = _drive("gdn", 16, HV=2, Hk=1, V=16, K=32, L=L, T=T, cursors=cursors, seed=T, config=MMA)
    _show(f"fp32 T={T}", err)
    _check_accuracy(run, err)
    assert {f for _, f in run.seen} == {True, False}, run.seen


@pytest.mark.interpret
def test_rounds_odd_shape_two_v_blocks():
    # V = 20, K = 24 (masked lanes in both: tiles of 32, one K chunk of 32), three value heads
    # per key head, two V-blocks of 16 per head
    run, err = _drive("gdn", 10, HV=3, Hk=1, V=20, K=24, L=5, T=4, cursors=(5, 2), seed=1, config=MMA)
    _show("odd shape T=4", err)
    _check_accuracy(run, err)


@pytest.mark.interpret
@pytest.mark.parametrize("T, L, cursors", [(3, 4, (4, 1)), (8, 8, (8, 2))], ids=["T3", "T8"])
def test_rounds_bf16_records_bf16_inputs(T, L, cursors):
    # bf16 records of bf16 inputs (as a bf16 model's pool holds them): error at bf16 level
    run, err = _drive("gdn", 10, HV=2, Hk=1, V=16, K=64, L=L, T=T, cursors=cursors, seed=2 + T,
                      rec=torch.bfloat16, io=torch.bfloat16, config=MMA)
    _show(f"bf16 T={T}", err)
    assert run.problems == [], run.problems[:5]
    assert err["out"] < 5e-3 and err["state"] < 5e-3, err


def _launch(run, x, ids, nd, config):
    st = run.st
    out = torch.full((ids.numel(), run.T, run.HV, run.V), float("nan"), device=DEV)
    gdn.replay_verify(x["q"], x["k"], x["v"], x["a"], x["b"], run.A_log, run.dt_bias, None, st["ckpt"],
                      st["buf_ld"], st["buf_w"], st["buf_k"], st["cursor"], st["pending"], st["epoch"], ids, run.L,
                      num_drafts=nd, out=out, config=config, arrive=run.arrive)
    return out


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.interpret
@pytest.mark.parametrize("T", [3, 8])
def test_against_triton_kernel_bf16(T):
    # the same state and bf16 inputs (every operand one piece) through the FMA Triton kernel and
    # this one, fp32 outputs: the same numbers to fp32 rounding, the same books
    kw = dict(HV=4, Hk=2, V=16, K=32, L=8, T=T, cursors=(0, 7, 8, 5), rec=torch.bfloat16, io=torch.bfloat16)
    runs = [_Run("gdn", seed=9, **kw) for _ in range(2)]
    for run in runs:
        run._poison_past_cursor()
    ids = runs[0]._rows().int().to(DEV)
    x = runs[0]._inputs(ids.numel(), steps=T)
    nd = torch.randint(1, T + 1, (ids.numel(),), generator=torch.Generator().manual_seed(T)).int().to(DEV)
    ref, got = _launch(runs[0], x, ids, nd, {"gluon": False}), _launch(runs[1], x, ids, nd, MMA)
    live = torch.arange(T, device=DEV)[None, :] < nd[:, None]
    assert torch.equal(got[~live], torch.zeros_like(got[~live])) and torch.equal(ref.isnan(), got.isnan())
    assert _rel(got[live], ref[live]) < 1e-6, _rel(got[live], ref[live])
    a, b = runs[0].st, runs[1].st
    for name in ("cursor", "pending", "epoch"):
        assert torch.equal(a[name], b[name]), name
    assert _rel(b["ckpt"], a["ckpt"]) < 1e-6
    slots = ids[ids >= 0].long()
    for name in ("buf_ld", "buf_w", "buf_k"):
        for s in slots.tolist():
            end = int(a["cursor"][s]) + int(a["pending"][s])       # through the drafts' records
            ra, rb = a[name][s, :end].float(), b[name][s, :end].float()
            assert torch.allclose(rb, ra, rtol=1e-2, atol=1e-6), (name, s)


@pytest.mark.interpret
def test_drafts_past_count_and_poisoned_drafts():
    # NaN in every input of the drafts past a row's count: the same bits as clean inputs. NaN
    # in a verified draft's key: that row's earlier outputs the same bits, its own and later NaN
    T = 3
    kw = dict(HV=2, Hk=1, V=16, K=32, L=4, T=T, cursors=(4, 1, 0))
    runs = [_Run("gdn", seed=6, **kw) for _ in range(3)]
    ids = torch.tensor([int(runs[0].live[2]), int(runs[0].live[0]), -1, int(runs[0].live[1])],
                       dtype=torch.int32, device=DEV)
    nd = torch.tensor([2, 1, 3, 3], dtype=torch.int32, device=DEV)
    x = runs[0]._inputs(4, steps=T)
    past = {n: t.clone() for n, t in x.items()}
    for n, t in past.items():
        for i, c in enumerate(nd.tolist()):
            t[i, c:] = float("nan")
    poisoned = {n: t.clone() for n, t in x.items()}
    poisoned["k"][3, 1] = float("nan")
    outs = [_launch(run, inp, ids, nd, MMA) for run, inp in zip(runs, (x, past, poisoned))]
    assert torch.equal(outs[0], outs[1]) and torch.isfinite(outs[0]).all()
    for name, t in runs[0].st.items():
        assert torch.equal(t.view(torch.uint8), runs[1].st[name].view(torch.uint8)), name
    assert torch.equal(outs[2][:3], outs[0][:3]) and torch.equal(outs[2][3, 0], outs[0][3, 0])
    assert torch.isnan(outs[2][3, 1:]).all()


def test_config_key():
    # off by default; GDN only; a kernel of its own (not with kq; with gluon=True asked for, the
    # Gluon kernel's tensor-core products: test_verify_gluon_gdn.py); windows up to 32;
    # BV of at least 16; defaults BV = 64 (the largest of 64, 32, 16 dividing V) in 4 warps
    for gpu_ in (True, False):
        assert not verify_config("gdn", 128, 128, 4, gpu=gpu_, window=16, Lb=20)["mma"]
        c = verify_config("gdn", 128, 128, 4, {"mma": True}, gpu=gpu_, window=16, Lb=20)
        assert c["mma"] and not c["gluon"] and (c["BV"], c["num_warps"]) == (64, 4), c
    assert verify_config("gdn", 48, 128, 2, {"mma": True})["BV"] == 16
    for family, config, kw, match in (
            ("kda", {"mma": True}, {}, "GDN only"),
            ("gdn", {"mma": True, "kq": True}, {}, "not with kq"),
            ("gdn", {"mma": True}, dict(window=40, Lb=44), "window 40"),
            ("gdn", {"mma": True, "BV": 8}, {}, "BV=8"),
            ("gdn", {"mma": 1}, {}, "mma=1 must be a bool")):
        with pytest.raises(ValueError, match=match):
            verify_config(family, 128, 128, 4, config, gpu=True, **kw)


@pytest.mark.interpret
def test_kda_refuses():
    run = _Run("kda", HV=2, Hk=1, V=16, K=32, L=4, T=2, cursors=(1,), seed=0)
    st, x = run.st, run._inputs(1, steps=2)
    with pytest.raises(ValueError, match="GDN only"):
        kda.replay_verify(x["q"], x["k"], x["v"], x["a"], x["b"], run.A_log, run.dt_bias, None, st["ckpt"],
                          st["buf_ld"], st["buf_w"], st["buf_k"], st["cursor"], st["pending"], st["epoch"],
                          torch.tensor([int(run.live[0])], dtype=torch.int32, device=DEV), 4, config=MMA)


@gpu
@needs_gpu
@pytest.mark.parametrize("T", [2, 4, 8])
@pytest.mark.parametrize("rec", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["qwen3.5-4b", "qwen3.5-122b"])
def test_gpu_rounds_real_shapes(name, T, rec):
    # window 16, cursors 0, L-1, L and spread, 32 verify rounds with decode steps between, the
    # default program (BV = 64, 4 warps); bf16: records of bf16 inputs
    shape = _REAL["gdn"][name]
    kw = dict(rec=torch.bfloat16, io=torch.bfloat16) if rec == "bf16" else {}
    run, err = _drive("gdn", 32, **shape, L=16, T=T, cursors=(0, 15, 16, 4, 9, 12, 1, 16), seed=T,
                      config={"mma": True}, **kw)
    _show(f"{name} T={T} {rec}", err)
    assert {f for _, f in run.seen} == {True, False}, run.seen
    if rec == "fp32":
        _check_accuracy(run, err)
    else:
        assert run.problems == [], run.problems[:5]
        assert err["out"] < 1e-2 and err["state"] < 1e-2, (name, err)
