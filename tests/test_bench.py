"""The decode benchmark's bookkeeping, on the CPU without timing or kernels: `--input-dtype`
reaches the token inputs and outputs of both schemes and every result row, while the layer
parameters and the state stay fp32 (the kernels themselves take bf16 token inputs in
tests/test_ops_*.py)."""
import pytest
import torch

from replayssm.bench import decode


@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", ["nemotron3-nano-30b", "qwen3.5-4b", "kimi-linear-48b"])
def test_measure_honours_input_dtype(monkeypatch, shape, input_dtype):
    cases = []

    class Recorded(decode.Case):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            cases.append(self)

    monkeypatch.setattr(decode, "Case", Recorded)
    monkeypatch.setattr(decode, "graph_time_us", lambda fn, reps=20, warmup=2: 1.0)  # no kernels
    rows = decode.measure(shape, 2, 2, "staggered", torch.bfloat16, 1, input_dtype=input_dtype, device="cpu")
    name = str(input_dtype).replace("torch.", "")
    assert [r["scheme"] for r in rows] == ["conventional", "replay"]
    assert all(r["input_dtype"] == name and r["record_dtype"] == "bfloat16" for r in rows)
    (case,) = cases
    for step in case.steps:                 # the same tensors feed both schemes
        assert step and all(t.dtype == input_dtype for t in step.values()), {k: t.dtype for k, t in step.items()}
    assert case.out.dtype == input_dtype
    params = [case.params.A, case.params.dt_bias, case.params.D] if case.family == "mamba2" else \
        [case.params.A_log, case.params.dt_bias]
    assert all(p.dtype == torch.float32 for p in params)
    assert case.state.dtype == case.ckpt.dtype == case.buf_ld.dtype == torch.float32
    assert case.buf_w.dtype == case.buf_k.dtype == torch.bfloat16


def test_input_dtype_option_defaults_to_bf16():
    with pytest.raises(SystemExit):         # only bfloat16 and float32
        decode.main(["--input-dtype", "float16"])
    assert decode.Case.__init__.__kwdefaults__["input_dtype"] is torch.bfloat16


@pytest.mark.parametrize("shape", ["mamba2/4/2/16/32", "gdn/4/2/16/32", "kda/2/2/16/16"])
def test_verify_benchmark_steps_run_every_scheme(monkeypatch, shape):
    # the verify benchmark's three steps run their kernels (interpreted on the CPU) with the
    # arguments the kernels take; time is stubbed, each step runs once per "timing"
    from replayssm.bench import verify

    monkeypatch.setattr(verify, "graph_time_us", lambda fn, reps=20, warmup=2: (fn(), 1.0)[1])
    rows = verify.measure(shape, 3, 4, 2, [1, 2], rounds=1, reps=1, device="cpu")
    assert [(r["scheme"], r["accepted"]) for r in rows] == [
        ("conventional", 1), ("replay", 1), ("replay", 2), ("snapshot", 1), ("snapshot", 2)]
    assert all(r["finite"] for r in rows)
    fam, HV, Hk, V, K = (int(x) if x.isdigit() else x for x in shape.split("/"))
    state = HV * V * K * 4
    mem = {r["scheme"]: r["bytes_per_sequence"] for r in rows}
    assert mem["snapshot"] == 3 * state and mem["conventional"] == state
    ld = (4 + 2) * HV * (K if fam == "kda" else 1) * 4
    assert mem["replay"] == state + ld + (4 + 2) * (HV * V + Hk * K) * 2     # bf16 records
    assert all(r["us_per_accepted_token"] == r["us_per_step"] / r["accepted"] for r in rows)
