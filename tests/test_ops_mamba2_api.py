"""Mamba-2 kernels' API (replayssm.ops.mamba2): the custom ops under torch.compile and their
registration, and the validation at the Python boundary.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from torch._dynamo.backends.registry import lookup_backend  # noqa: E402

from replayssm.ops.mamba2 import conventional_decode, replay_decode  # noqa: E402
from replayssm.testing import make_inputs, make_params  # noqa: E402
from replayssm.testing.mamba2_harness import SMALL  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


# ----------------------------------------------------------------------------------------------
# The custom ops under torch.compile


def test_custom_ops_compile():
    HV, Hk, V, K = SMALL["HV"], SMALL["Hk"], SMALL["V"], SMALL["K"]
    L, N = 4, 3
    p = make_params("mamba2", HV, K, seed=7)
    A, dt_bias, D = (t.float().to(DEV) for t in (p.A, p.dt_bias, p.D))
    g = torch.Generator().manual_seed(7)
    pools = []
    for _ in range(2):
        pool = dict(ckpt=torch.zeros(N, HV, V, K), buf_ld=torch.zeros(N, L, HV),
                    buf_w=torch.zeros(N, L, HV, V), buf_k=torch.zeros(N, L, Hk, K),
                    cursor=torch.tensor([0, 3, 1], dtype=torch.int32),
                    epoch=torch.zeros(N, dtype=torch.int64), arrive=torch.zeros(N, dtype=torch.int32),
                    state=torch.zeros(N, HV, V, K))
        pools.append({k: v.to(DEV) for k, v in pool.items()})
    slot_ids = torch.tensor([2, -1, 0, 1], dtype=torch.int32, device=DEV)

    def step(inp, pool, out_r, out_c):
        replay_decode(inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, D, inp["z"],
                      pool["ckpt"], pool["buf_ld"], pool["buf_w"], pool["buf_k"], pool["cursor"],
                      pool["epoch"], slot_ids, L, out=out_r, arrive=pool["arrive"])
        # an eager step (window 1) on the same pool, output discarded
        replay_decode(inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, D, inp["z"],
                      pool["ckpt"], pool["buf_ld"], pool["buf_w"], pool["buf_k"], pool["cursor"],
                      pool["epoch"], slot_ids, 1, out=torch.empty_like(out_r), arrive=pool["arrive"],
                      validate=False)
        conventional_decode(inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, D, inp["z"],
                            pool["state"], slot_ids, out=out_c, validate=False)
        return out_r * 2, out_c * 2

    seen = set()

    def backend(gm, example_inputs):
        # the custom ops must appear in the traced graph (not be run eagerly by the tracer);
        # then aot_eager functionalises them through their fake implementations
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    for t in range(3):
        inp = {k: v.to(DEV) for k, v in make_inputs(p, 4, V, K, Hk, generator=g, dtype=torch.float32).items()}
        outs = [torch.empty(4, HV, V, device=DEV) for _ in range(4)]
        a = step(inp, pools[0], outs[0], outs[1])
        b = compiled(inp, pools[1], outs[2], outs[3])
        for u, v in zip(a + tuple(outs[:2]), b + tuple(outs[2:])):
            assert torch.equal(u, v)
        for k in pools[0]:
            assert torch.equal(pools[0][k], pools[1][k]), k
    assert {"replayssm.mamba2_replay_decode", "replayssm.mamba2_conventional_decode",
            "replayssm.mamba2_eager_decode"} <= seen, seen


def test_custom_op_registration():
    """Schema (declared mutations match the real ones) and fake-tensor implementations."""
    HV, Hk, V, K = SMALL["HV"], SMALL["Hk"], SMALL["V"], SMALL["K"]
    L, N, Bt = 4, 2, 3
    p = make_params("mamba2", HV, K, seed=8)
    A, dt_bias, D = (t.float().to(DEV) for t in (p.A, p.dt_bias, p.D))
    inp = {k: v.to(DEV) for k, v in make_inputs(p, Bt, V, K, Hk, dtype=torch.float32).items()}
    slot_ids = torch.tensor([1, -1, 0], dtype=torch.int32, device=DEV)
    tok = (inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, D, inp["z"])
    replay_args = tok + (torch.randn(N, HV, V, K, device=DEV), torch.zeros(N, L, HV, device=DEV),
                         torch.zeros(N, L, HV, V, device=DEV), torch.zeros(N, L, Hk, K, device=DEV),
                         torch.tensor([0, 3], dtype=torch.int32, device=DEV),
                         torch.zeros(N, dtype=torch.int64, device=DEV),
                         torch.zeros(N, dtype=torch.int32, device=DEV), slot_ids,
                         torch.empty(Bt, HV, V, device=DEV), L, 16, 4, 1, True, 0, 1, False,
                         False, False, False)
    conv_args = tok + (torch.randn(N, HV, V, K, device=DEV), slot_ids,
                       torch.empty(Bt, HV, V, device=DEV), 16, 4, 1, True)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.replayssm.mamba2_replay_decode.default, replay_args, test_utils=tests)
    torch.library.opcheck(torch.ops.replayssm.mamba2_conventional_decode.default, conv_args, test_utils=tests)
    # the eager step (window 1): the replay state, the conventional launch config; cursor 3
    # makes it fold records and hand the cursor back
    eager_args = replay_args[:17] + (32, 2, 1, False)
    torch.library.opcheck(torch.ops.replayssm.mamba2_eager_decode.default, eager_args, test_utils=tests)


# ----------------------------------------------------------------------------------------------
# Validation at the Python boundary


def _valid_call_args():
    HV, Hk, V, K = SMALL["HV"], SMALL["Hk"], SMALL["V"], SMALL["K"]
    Bt, N, Lb = 3, 4, 6
    f = dict(device=DEV)
    return dict(
        x=torch.zeros(Bt, HV, V, **f), dt=torch.zeros(Bt, HV, **f), B=torch.zeros(Bt, Hk, K, **f),
        C=torch.zeros(Bt, Hk, K, **f), A=-torch.ones(HV, **f), dt_bias=torch.zeros(HV, **f),
        D=torch.zeros(HV, **f), z=torch.zeros(Bt, HV, V, **f),
        ckpt=torch.zeros(N, HV, V, K, **f), buf_ld=torch.zeros(N, Lb, HV, **f),
        buf_w=torch.zeros(N, Lb, HV, V, **f), buf_k=torch.zeros(N, Lb, Hk, K, **f),
        cursor=torch.zeros(N, dtype=torch.int32, **f), epoch=torch.zeros(N, dtype=torch.int64, **f),
        slot_ids=torch.tensor([0, -1, 2], **f), window=4,
    )


def _t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=DEV)


# (argument replaced, new value, what the message must say after naming the argument)
REPLAY_ERRORS = [
    ("x", _t(3, 4 * 16), "expected"),
    ("x", _t(3, 4, 16, dtype=torch.float64), "dtype"),
    ("x", _t(3, 4, 32)[:, :, ::2], "contiguous"),
    ("dt", _t(3, 5), "shape"),
    ("B", _t(3, 3, 32), "groups do not divide"),
    ("B", _t(3, 2), "expected"),
    ("C", _t(3, 2, 16), "shape"),
    ("A", _t(5), "shape"),
    ("A", torch.zeros(4, device="meta"), "device"),
    ("dt_bias", _t(4, dtype=torch.int32), "dtype"),
    ("D", _t(4, 1), "shape"),
    ("z", _t(2, 4, 16), "shape"),
    ("ckpt", _t(4, 4, 16, 32, dtype=torch.bfloat16), "dtype"),
    ("ckpt", _t(4, 4, 32, 16), "shape"),
    ("ckpt", _t(4, 4, 32, 16).transpose(2, 3), "contiguous"),
    ("buf_ld", _t(4, 6, 4, dtype=torch.bfloat16), "dtype"),
    ("buf_ld", _t(4, 6), "expected"),
    ("buf_w", _t(4, 6, 4, 8), "shape"),
    ("buf_w", _t(4, 5, 4, 16), "shape"),
    ("buf_k", _t(4, 6, 4, 32), "shape"),
    ("buf_k", _t(4, 6, 2, 32, dtype=torch.float64), "dtype"),
    ("cursor", _t(4, dtype=torch.int64), "dtype"),
    ("epoch", _t(4, dtype=torch.int32), "dtype"),
    ("epoch", _t(3, dtype=torch.int64), "shape"),
    ("slot_ids", _t(3), "dtype"),
    ("slot_ids", _t(2, dtype=torch.int32), "shape"),
    ("slot_ids", torch.tensor([0, 4, -1], device=DEV), "out of range"),
    ("slot_ids", torch.tensor([2, -1, 2], device=DEV), "more than once"),
    ("window", 0, "int in"),
    ("window", 7, "int in"),
    ("window", 4.0, "int in"),
    ("window", True, "int in"),
    ("out", _t(3, 4, 16, dtype=torch.bfloat16), "dtype"),
    ("out", _t(3, 4, 8), "shape"),
    ("arrive", _t(4, dtype=torch.int64), "dtype"),
    ("config", dict(BV=12), "BV must be a power of two"),
    ("config", dict(num_warps=3), "num_warps"),
    ("config", dict(KS=3), "KS=3 must be a power of two"),
    ("config", dict(block=16), "unknown"),
    ("config", dict(rows=True, BV=32), "rows=True needs BV=32 <= V=16"),
    ("config", dict(warpsum=True, BV=2, num_warps=4), "warpsum=True needs"),
    ("config", dict(warpsum=True, KS=2), "warpsum=True needs"),
    ("config", dict(gluon=1), "gluon must be a bool"),
    ("config", dict(kq="yes"), "kq must be a bool"),
]


def _pattern(name, text):
    return rf"^{name}\b.*{text}"


@pytest.mark.parametrize("name, value, text", REPLAY_ERRORS,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(REPLAY_ERRORS)])
def test_replay_validation(name, value, text):
    args = _valid_call_args()
    args[name] = value
    before = args["ckpt"].clone()
    with pytest.raises(ValueError, match=_pattern(name, text)):
        replay_decode(**args)
    assert torch.equal(args["ckpt"], before)


def test_replay_valid_args_pass():
    # the baseline of the cases above is itself valid (and runs)
    args = _valid_call_args()
    y = replay_decode(**args)
    assert (y[1] == 0).all() and args["cursor"].tolist() == [1, 0, 1, 0]


CONV_ERRORS = [
    ("state", _t(4, 4, 16, 32, dtype=torch.float16), "dtype"),
    ("state", _t(4, 4, 16), "expected"),
    ("state", _t(4, 2, 16, 32), "shape"),
    ("slot_ids", torch.tensor([1, 1, -1], device=DEV), "more than once"),
    ("slot_ids", torch.tensor([0, 9, -1], device=DEV), "out of range"),
    ("x", _t(3, 4, 16, dtype=torch.int32), "dtype"),
    ("out", _t(3, 4, 16, dtype=torch.float16), "dtype"),
    ("config", dict(flush="ieee"), "unknown"),
    ("config", dict(BV=64), "must divide"),
    ("config", dict(perhead=1), "perhead must be a bool"),
]


@pytest.mark.parametrize("name, value, text", CONV_ERRORS,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(CONV_ERRORS)])
def test_conventional_validation(name, value, text):
    a = _valid_call_args()
    args = {k: a[k] for k in ("x", "dt", "B", "C", "A", "dt_bias", "D", "z", "slot_ids")}
    args["state"] = a["ckpt"]
    args[name] = value
    with pytest.raises(ValueError, match=_pattern(name, text)):
        conventional_decode(**args)
