"""The command line: the main job runs on the CPU and prints what the README promises."""
import pytest
import torch

from replayssm import cli


def test_demo_prints_each_family(capsys):
    assert cli.main(["demo", "--steps", "20", "--heads", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for fam in ("mamba2", "gdn", "kda"):
        row = next(line for line in out.splitlines() if line.startswith(fam))
        fields = row.split()
        worst, conv_b, rep_b, lstar = float(fields[3]), float(fields[6]), float(fields[7]), float(fields[9])
        assert worst < 1e-5                 # fp32 replay vs fp32 conventional
        assert rep_b < conv_b               # replay moves fewer state bytes per token
        assert lstar > 1


def test_traffic_table_has_paper_figures(capsys):
    assert cli.main(["traffic"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("nemotron3-super"))
    fields = row.split()
    assert fields[4] == "84.5" and fields[5] == "12.9" and fields[6] == "23.7"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_bench_needs_cuda():
    with pytest.raises(SystemExit, match="CUDA"):
        cli.main(["bench", "decode", "--shapes", "nemotron3-super"])
