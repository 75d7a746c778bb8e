"""The copy pools' experimental verify switches beside the paths they would replace, on the GPU
with bf16 records (the serving configuration; test_verify_lp.py's GPU cases take fp32 records,
whose keys are three bf16 pieces where these are one): `REPLAYSSM_GLUON_LP_REFOLD_MMA` (GDN: an
early flush's refold on the tensor cores) against the sequential refold, `REPLAYSSM_GLUON_LP_KDA`
(KDA pools on the Gluon verify kernel) against the Triton kernel. Both runs take the same
rounds (the same seeds); each run's own checks (`_scenario`: cursors as the reference pool's,
the copy the round-to-nearest encoding of the fp32 checkpoint bit for bit, padding rows and
drafts past each count zero, NaN past every cursor) and the two runs' checkpoints and outputs
within fp32 rounding of each other."""
import pytest
import torch

from test_verify_lp import GPU_SHAPES, SHAPES, _scenario  # noqa: E402

from conftest import rel_err

GPU = torch.cuda.is_available()


def _runs(family, lp, T, window, rounds, switch, monkeypatch, launches):
    """Two runs of the same rounds, `switch` (a verify_lp attribute) off then on."""
    from replayssm.ops.gdn import verify_lp as vlp

    monkeypatch.setitem(SHAPES, family, GPU_SHAPES[family])
    runs = []
    for on in (False, True):
        monkeypatch.setattr(vlp, switch, on)
        launches.clear()
        pools, log, dec = _scenario(family, lp, T=T, window=window, rounds=rounds, std=False,
                                    record_dtype=torch.bfloat16)
        runs.append((pools[0], log, dec, list(launches)))
    return runs


def _close(off, on):
    (p0, log0, dec0, _), (p1, log1, dec1, _) = off, on
    assert rel_err(p1.ckpt["data"], p0.ckpt["data"]) < 1e-6
    for e0, e1 in zip(log0, log1):
        assert torch.equal(e0["flush"], e1["flush"])
        assert rel_err(e1["outs"][0][e1["live"]], e0["outs"][0][e0["live"]]) < 1e-5
    for d0, d1 in zip(dec0, dec1):
        assert rel_err(d1[0], d0[0]) < 1e-5
    assert sum(int(e["flush"].sum()) for e in log0) >= 4, "too few early flushes"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("T,window", [(4, 8), (8, 16)])
@pytest.mark.parametrize("lp", ["fp16", "bf16"])
@pytest.mark.parametrize("family, switch", [("gdn", "REFOLD_MMA"), ("kda", "GLUON_LP_KDA")],
                         ids=["gdn-refold-mma", "kda-on-gluon"])
def test_copy_pool_switch_matches_its_default_bf16_records_gpu(family, switch, lp, T, window, monkeypatch):
    from replayssm.ops.gdn import gluon_verify_host as gv

    seen, constexprs = [], gv.gluon_verify_constexprs

    def spy(*a, **k):
        d = constexprs(*a, **k)
        if d["LPT"]:                             # the copy pool's Gluon launches
            seen.append((d["RFM"], d["IS_KDA"]))
        return d
    monkeypatch.setattr(gv, "gluon_verify_constexprs", spy)
    off, on = _runs(family, lp, T, window, 8, switch, monkeypatch, seen)
    if family == "gdn":                          # the Gluon kernel both times, the refold's form switched
        assert off[3] and {x[0] for x in off[3]} == {False} and on[3] and {x[0] for x in on[3]} == {True}
    else:                                        # the Triton kernel, then the Gluon one every round
        assert not off[3] and on[3] == [(False, True)] * 8, (off[3], on[3])
    _close(off, on)
