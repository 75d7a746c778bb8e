"""The layer-level precision study (`replayssm study precision`) at a tiny shape on the CPU."""
from __future__ import annotations

import json
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from replayssm import cli
from replayssm.bench import precision_engine as E
from replayssm.bench import precision_study as P
from replayssm.testing import make_params

GPU = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device")

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
    assert doc["benchmark"] == "precision_study" and doc["tokens"] == 6 and doc["loop"] == "token"
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


# ----------------------------------------------------------------------------------------------
# the batched engine a window at a time (precision_engine.WindowLoop)

def _key(r):
    return {k: v for k, v in r.items() if k != "loop"}


@pytest.mark.parametrize("shape", SHAPES)
def test_window_loop_equals_the_token_loop(shape):
    """The window function (eager on the CPU) against one step per token, every design: the
    same rows bit for bit (the same inputs, arithmetic and streams; the token index a tensor in
    one, an int in the other), full windows and a last partial one (18 tokens, window 4)."""
    kw = dict(layers=2, tokens=18, batch=2, window=4, engine="batched")
    by_token, by_window = P.run(shape, loop="token", **kw), P.run(shape, loop="window", **kw)
    assert {r["loop"] for r in by_token} == {"token"} and {r["loop"] for r in by_window} == {"window"}
    assert [_key(r) for r in by_window] == [_key(r) for r in by_token]
    # the rows are not trivially equal: the designs differ after the first flush
    assert len({r["rel_error"] for r in by_window if r["tokens"] == 18}) > 10


def test_window_loop_on_the_kernels_equals_the_token_loop():
    """As above with the conventional low-precision designs on `conventional_decode_lp`, its
    `step` a device tensor in the window function."""
    kw = dict(layers=1, tokens=12, batch=2, window=4, engine="batched", kernels=True,
              designs=["conventional-lowp"], lp_formats=["bf16"])
    by_token, by_window = P.run(SHAPES[0], loop="token", **kw), P.run(SHAPES[0], loop="window", **kw)
    assert [_key(r) for r in by_window] == [_key(r) for r in by_token]
    last = {r["rounding"]: r["rel_error"] for r in by_window if r["tokens"] == 12}
    assert last["nearest"] != last["stochastic"]


class _NoHostReads(TorchDispatchMode):
    """Records the operators a CUDA-graph capture refuses or would freeze: reads of a device
    value by the host (`.item()`, `bool(t)`, data-dependent shapes) and tensors made from
    Python data (copied from host memory)."""
    BANNED = ("_local_scalar_dense", "lift_fresh", "nonzero", "masked_select", "unique", "item", "is_nonzero")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(b in str(func) for b in self.BANNED):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_window_function_reads_nothing_back_on_the_host():
    """The window function of every design makes no host read and no tensor from Python data
    (what a CUDA-graph capture refuses), stochastic roundings at the flush and at every
    conventional step included; the guard does catch both."""
    shape = P.shp.parse(SHAPES[1])
    vars_ = P.variants()
    eng = E.BatchedEngine(vars_, shape, 2, 4, "cpu", 0, 0)
    p64 = make_params(shape.family, shape.HV, shape.K, dtype=torch.float64, seed=E.layer_seed(0, 0))
    S64 = torch.zeros(2, shape.HV, shape.V, shape.K, dtype=torch.float64)
    loop = E.WindowLoop(eng, p64, S64, 8)
    feed = E.StudyInputs(p64, 2, shape, 16, torch.Generator().manual_seed(1), "cpu")
    guard = _NoHostReads()
    with guard:
        for t0 in (0, 8):
            loop.run(t0, feed.take(t0, 8))
    assert guard.seen == []
    with guard:
        torch.tensor([1]) + torch.ones(2).sum().item()
    assert guard.seen == ["aten.lift_fresh.default", "aten._local_scalar_dense.default"], guard.seen


def test_inputs_are_the_same_whatever_the_steps():
    """`StudyInputs` gives every loop the same numbers: tokens taken one by one, or 7 at a time
    across the 256-token chunks, or all at once; out of order is refused."""
    shape = P.shp.parse("gdn/2/1/8/16")
    p64 = make_params("gdn", 2, 16, dtype=torch.float64)

    def feed():
        return E.StudyInputs(p64, 1, shape, 600, torch.Generator().manual_seed(5), "cpu")

    ones = feed()
    singles = [ones.take(t, 1) for t in range(600)]
    by_one = {k: torch.cat([p[k] for p in singles], 1) for k in ("q", "a")}
    sevens = feed()
    parts = [sevens.take(t, min(7, 600 - t)) for t in range(0, 600, 7)]
    assert all(torch.equal(torch.cat([p[k] for p in parts], 1), by_one[k]) for k in by_one)
    once = feed().take(0, 600)
    assert torch.equal(once["a"], by_one["a"]) and once["a"].shape[1] == 600
    with pytest.raises(ValueError, match="order"):
        feed().take(300, 1)


def test_loop_choices():
    assert P.resolve_loop("batched", "cpu") == "window" and P.resolve_loop("pool", "cpu") == "token"
    assert P.resolve_loop("batched", "cuda") == "graph"
    for engine, device, loop in (("pool", "cpu", "window"), ("batched", "cpu", "graph"), ("batched", "cpu", "x")):
        with pytest.raises(ValueError, match="loop"):
            P.resolve_loop(engine, device, loop)
    with pytest.raises(SystemExit):
        cli.main(["study", "precision", "--engine", "batched", "--loop", "graph", "--device", "cpu"])


@gpu
@needs_gpu
@pytest.mark.parametrize("shape", ["mamba2/8/2/32/64", "gdn/8/4/32/64"])
def test_gpu_graph_loop_equals_the_eager_loops(shape, monkeypatch):
    """On CUDA (the conventional low-precision designs on the kernels): the graph loop, which
    replays every full window but the first (5 windows of 16 tokens and 4 more: 4 replays), gives
    the eager window function's rows bit for bit, and the token loop's within 1e-3 of each error
    (the same arithmetic; the bound leaves room for a library's other reduction order)."""
    replays = []
    real = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: (replays.append(1), real(self))[1])
    kw = dict(layers=2, tokens=84, batch=2, window=16, engine="batched", device="cuda")
    rows, secs = {}, {}
    for loop in ("graph", "window", "token"):
        started = time.perf_counter()
        rows[loop] = P.run(shape, loop=loop, **kw)
        secs[loop] = time.perf_counter() - started
    print(f"{shape}: ms per token (84 tokens, first windows' compilation included): "
          + ", ".join(f"{k} {1e3 * v / 84:.2f}" for k, v in secs.items()))
    assert len(replays) == 4
    graph, eager, token = rows["graph"], rows["window"], rows["token"]
    assert [_key(r) for r in graph] == [_key(r) for r in eager]
    for a, b in zip(token, eager):
        assert [a[k] for k in ("design", "read_format", "rounding", "tokens")] == \
            [b[k] for k in ("design", "read_format", "rounding", "tokens")]
        assert abs(a["rel_error"] - b["rel_error"]) <= 1e-3 * a["rel_error"], (a, b["rel_error"])
