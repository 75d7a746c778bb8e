"""The layer-level precision study (`replayssm study precision`) at a tiny shape on the CPU."""
from __future__ import annotations

import json

import pytest
import torch

from replayssm import cli
from replayssm.bench import precision_study as P

SHAPES = ("mamba2/4/2/16/32", "gdn/4/2/16/32")
TOKENS = 64


@pytest.fixture(scope="module")
def rows():
    # window 4: sixteen flushes in 64 tokens, so the shared checkpoint's rounding feeds back.
    # One thread: tiny per-step tensors, where intra-op threads only contend (as in the demo).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {s: P.run(s, layers=2, tokens=TOKENS, batch=2, window=4) for s in SHAPES}
    finally:
        torch.set_num_threads(threads)


def _by(rows, **want):
    return [r for r in rows if all(r[k] == v for k, v in want.items())]


def test_rows_have_the_fields_and_every_design_ran(rows):
    expected = {tuple(v[k] for k in ("design", "read_format", "hp_format", "rounding")) for v in P.variants()}
    assert {v["design"] for v in P.variants()} == set(P.DESIGNS)
    for shape, rs in rows.items():
        for r in rs:
            for f in ("design", "family", "read_format", "hp_format", "rounding", "tokens", "rel_error",
                      "first_nonfinite"):
                assert f in r, f
        got = {(r["design"], r["read_format"], r["hp_format"], r["rounding"]) for r in rs}
        assert got == expected
        assert sorted({r["tokens"] for r in rs}) == P.checkpoints(TOKENS) == [1, 2, 4, 8, 16, 32, 64]
        # every variant ran every token: finite errors everywhere at this size
        assert all(r["rel_error"] is not None and r["first_nonfinite"] is None for r in rs)
        assert {r["family"] for r in rs} == {shape.split("/")[0]}


def test_fp32_recurrences_stay_below_the_shared_nvfp4_checkpoint(rows):
    for rs in rows.values():
        for t in (32, 64):
            shared = [r["rel_error"] for r in _by(rs, design="shared", read_format="nvfp4", tokens=t)]
            sep = _by(rs, design="separate", read_format="nvfp4", tokens=t)[0]["rel_error"]
            conv = _by(rs, design="conventional-fp32", tokens=t)[0]["rel_error"]
            assert len(shared) == 2          # round-to-nearest and stochastic
            assert sep < min(shared), (t, sep, shared)
            assert conv < 1e-5 < sep         # fp32 rounding only; the nvfp4 reads cost more
        # before the first flush every pool computes from fp32 records alone
        early = [r["rel_error"] for r in rs if r["tokens"] <= 4 and not r["design"].startswith("conventional")]
        assert max(early) < 1e-5


def test_conventional_lowp_rounds_every_step(rows):
    for rs in rows.values():
        conv_bf16 = _by(rs, design="conventional-lowp", read_format="bf16", rounding="nearest", tokens=2)[0]
        conv_fp16 = _by(rs, design="conventional-lowp", read_format="fp16", rounding="nearest", tokens=2)[0]
        # from the first stored state on: bf16 (8 bits) is coarser than fp16 (11 bits)
        assert 1e-5 < conv_fp16["rel_error"] < conv_bf16["rel_error"] < 1e-2


def test_batched_engine_matches_the_pools(rows):
    # the same mathematics in one tensor: round-to-nearest designs agree to fp32 rounding's
    # effect on the roundings, stochastic ones (other random numbers) statistically
    shape = SHAPES[1]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fast = P.run(shape, layers=2, tokens=TOKENS, batch=2, window=4, engine="batched")
    finally:
        torch.set_num_threads(threads)
    assert len(fast) == len(rows[shape])
    for a, b in zip(rows[shape], fast):
        assert [a[k] for k in ("design", "read_format", "rounding", "tokens")] == \
            [b[k] for k in ("design", "read_format", "rounding", "tokens")]
        if a["tokens"] < 16:
            continue
        tol = 0.01 if a["rounding"] == "nearest" else 0.3
        assert abs(b["rel_error"] / a["rel_error"] - 1) < tol, (a, b["rel_error"])
    assert {r["engine"] for r in fast} == {"batched"}


def test_nonfinite_outputs_are_found():
    rel = torch.tensor([[1e-3, 2e-3, float("inf"), float("nan")]], dtype=torch.float64)
    shape = P.shp.parse("gdn/4/2/16/32")
    rs = P._rows(shape, P.variants(["conventional-fp32"]), rel, {})
    assert {r["first_nonfinite"] for r in rs} == {3}
    assert [r["rel_error"] for r in rs] == [1e-3, 2e-3, None]


def test_cli_writes_json_and_plot(tmp_path, capsys):
    out = tmp_path / "study.json"
    cli.main(["study", "precision", "--shapes", "gdn/2/1/16/32", "--layers", "1", "--tokens", "6",
              "--window", "2", "--formats", "nvfp4", "--designs", "shared,separate", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "precision_study" and doc["tokens"] == 6
    assert {r["design"] for r in doc["rows"]} == {"shared", "separate"}
    assert (tmp_path / "study.png").stat().st_size > 0
    assert "separate" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["study", "precision", "--designs", "nonsense"])


def test_time_budget_ends_the_rows_at_the_tokens_run():
    # out of time after the first 256-token block: the rows stop at 256 tokens, finite
    rows = P.run("gdn/2/1/8/16", layers=1, tokens=10 ** 6, batch=1, designs=["conventional-fp32"],
                  lp_formats=["bf16"], engine="batched", time_budget=1e-9)
    assert max(r["tokens"] for r in rows) == 256
    assert all(r["rel_error"] is not None and r["rel_error"] < 1e-5 for r in rows)
