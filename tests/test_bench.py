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


def test_sass_stalls_sums_a_source_level_profile(capsys, monkeypatch):
    """`benchmarks/tools/sass_stalls.py` on a synthetic ncu source-level export
    (tests/data/ncu_source_sass.csv: ncu's two header lines, ten SASS instructions, an empty
    sample cell, "Not Issued" stall columns that must not be counted) reproduces the totals
    worked out by hand: 150 samples, 15.0M executed, the stall reasons and the split."""
    import pathlib
    import runpy
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    prof = root / "tests/data/ncu_source_sass.csv"
    monkeypatch.setattr(sys, "argv", ["sass_stalls.py", str(prof), "--top", "3", "--split", "4,8"])
    runpy.run_path(str(root / "benchmarks/tools/sass_stalls.py"), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "10 instructions, 150 samples, 15.0M executed"
    # shares of the 150 samples; the Not Issued columns (1000x larger) are left out
    assert lines[1] == "by reason: long_sb 46.7%, barrier 16.7%, lg 13.3%, wait 12.0%, short_sb 11.3%"
    # the three instructions with the most samples, in index order, with their top two reasons
    top = [line.split() for line in lines[2:5]]
    assert [(int(r[0]), int(r[1]), r[2]) for r in top] == [(2, 40, "26.7%"), (3, 25, "16.7%"),
                                                            (5, 30, "20.0%")]
    assert lines[2].split("exec")[1].split()[:2] == ["1000000", "LDGSTS.E.BYPASS.128"]
    assert lines[2].rstrip().endswith("long_sb 40, wait 0")
    assert lines[3].rstrip().endswith("barrier 25, wait 0")
    parts = [line for line in lines if line.startswith("[")]
    assert parts == ["[    0,     4) samples     80 (53.3%),    4.0M executed",
                     "[    4,     8) samples     50 (33.3%),    9.0M executed",
                     "[    8,    10) samples     20 (13.3%),    2.0M executed"]
    assert len(lines) == 8
