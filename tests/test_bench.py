"""The decode benchmark's bookkeeping, on the CPU without timing or kernels: `--input-dtype`
reaches the token inputs and outputs of both schemes and every result row, while the layer
parameters and the state stay fp32 (the kernels themselves take bf16 token inputs in
tests/test_ops_*.py)."""
import functools

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


def test_verify_benchmark_variants_get_their_own_rows(monkeypatch):
    from replayssm.bench import verify

    times = iter([3.0, 2.0, 5.0])                  # conventional, replay, the good variant
    monkeypatch.setattr(verify, "graph_time_us", lambda fn, reps=20, warmup=2: (fn(), next(times))[1])
    rows = verify.measure("mamba2/4/2/16/32", 2, 4, 2, [2], rounds=1, reps=1, device="cpu", snapshot=False,
                          variants=[{"BV": 16, "num_warps": 1}, {"BV": 3}])
    plain = [r for r in rows if r["scheme"] == "replay" and "config" not in r]
    good = [r for r in rows if r.get("config") == {"BV": 16, "num_warps": 1}]
    bad = [r for r in rows if r.get("config") == {"BV": 3}]
    assert len(plain) == len(good) == len(bad) == 1
    assert "us_per_step" in good[0] and "BV" in bad[0]["error"]   # a refused config is a row, not a crash
    assert good[0]["ratio_vs_default"] == 2.5 and "ratio_vs_default" not in plain[0]


@pytest.mark.parametrize("shape", ["mamba2/4/2/16/32", "gdn/4/2/16/32", "kda/2/2/16/16"])
def test_verify_benchmark_low_precision_copy_variant(monkeypatch, shape):
    """A variant with `lp` runs the replay scheme on `lowp_verify` with that copy: the same
    cursors as the fp32 replay; Mamba-2's outputs within the copy's rounding of the fp32 ones
    (GDN/KDA's raw records are random, not the ones behind their `u`: there finite outputs)."""
    import functools

    from replayssm.bench import verify

    def case():
        torch.manual_seed(0)                             # (the checkpoint and records: global RNG)
        c = verify.Case(shape, 3, 4, 2, device="cpu", snapshot=False)
        c.accepted.fill_(2)
        return c

    a, b = case(), case()
    calls = []
    if a.family == "mamba2":
        lowp = a.ops.lowp_verify
        monkeypatch.setattr(a.ops, "lowp_verify", functools.wraps(lowp)(lambda *x, **k: calls.append(1) or lowp(*x, **k)))
    for _ in range(3):                                    # cursors 0..2 + 6: every row flushes once
        a.replay_step({"lp": "fp16"})
        b.replay_step()
        assert torch.equal(a.cursor, b.cursor)
        assert torch.isfinite(a.out.float()).all()
        if a.family == "mamba2":
            err = (a.out.float() - b.out.float()).abs().max() / b.out.float().abs().max()
            assert 0 < err < 5e-3, err                    # fp16 reads, not the fp32 checkpoint
    assert len(calls) == (3 if a.family == "mamba2" else 0)
    assert set(a.ckpt_lp) == {"fp16"} and a.ckpt_lp["fp16"]["data"].dtype == torch.float16
    HV, V, K = a.HV, a.V, a.K
    raw = 0 if a.family == "mamba2" else (4 + 2) * HV * (V * 2 + 4)          # bf16 v, fp32 beta
    assert a.memory_per_sequence("fp16")["replay"] == a.memory_per_sequence()["replay"] + HV * V * K * 2 + raw
    a.replay_step({"lp": "fp8_e4m3"})                     # a second copy beside the first
    assert set(a.ckpt_lp) == {"fp16", "fp8_e4m3"} and torch.isfinite(a.out.float()).all()


@pytest.mark.parametrize("shape", ["mamba2/4/2/16/32", "gdn/4/2/16/32", "kda/2/2/16/16"])
def test_verify_benchmark_times_the_fork_beside_ours(monkeypatch, shape):
    # with the fork's functions (here stand-ins that record their calls: its source is not in
    # this tree) each accepted count gets a `fork` row, run with that count, and the replay rows
    # their ratio to it; KDA, which the fork has no kernel for, gets none
    from types import SimpleNamespace

    from replayssm.bench import verify

    calls = []

    def fake(name):
        def run(*args, **kwargs):
            calls.append((name, [a.tolist() for a in args if isinstance(a, torch.Tensor) and a.dim() == 1]))
        return run
    fork = SimpleNamespace(**{f: fake(f) for f in ("m2_verify", "m2_commit", "gdn_verify", "gdn_commit")})
    times = iter([4.0, 1.0, 3.0, 2.0, 1.5])                 # conventional, replay at 1, 2, fork at 1, 2
    monkeypatch.setattr(verify, "graph_time_us", lambda fn, reps=20, warmup=2: (fn(), next(times))[1])
    rows = verify.measure(shape, 3, 4, 2, [1, 2], rounds=1, reps=1, device="cpu", snapshot=False, fork=fork)
    got = [(r["scheme"], r["accepted"]) for r in rows]
    if shape.startswith("kda"):
        assert got == [("conventional", 1), ("replay", 1), ("replay", 2)] and not calls
        return
    assert got == [("conventional", 1), ("replay", 1), ("replay", 2), ("fork", 1), ("fork", 2)]
    assert [r.get("ratio_vs_fork") for r in rows if r["scheme"] == "replay"] == [0.5, 2.0]
    commits = [c for c in calls if c[0].endswith("commit")]
    # one verify and one commit a timed step, the commit given that point's accepted counts
    assert len(commits) == 2 and [1, 1, 1] in commits[0][1] and [2, 2, 2] in commits[1][1]
    assert len(calls) == 4 and all(r["finite"] for r in rows)


# ----------------------------------------------------------------------------------------------
# bench precision: separate state precisions (issue 18)

PRECISION_FIELDS = {"shape", "family", "batch", "read_format", "hp_format", "scheme", "us_per_step",
                    "ratio_vs_fp32_read", "timing", "bytes_per_step", "tb_per_s", "finite"}
PRECISION_US = {"fp32": 8.0, "fp16": 4.0, "bf16": 4.0, "fp8_e4m3": 2.0, "nvfp4": 1.0}
CONV_LP_US = {"fp16": 9.0, "bf16": 10.0, "fp8_e4m3": 6.0}     # conventional, low-precision state (x 2: SR)


def _precision_rows(monkeypatch, shape, lp_formats, batch=2, window=3):
    """`precision.measure` at a tiny shape with the kernels interpreted and the timing stubbed:
    each "timing" runs its function once and returns a time set per read format, and records
    what one run did to the cursors, epochs, fp32 checkpoint and conventional states."""
    from replayssm.bench import precision

    cases, runs = [], []

    class Recorded(precision.PrecisionCase):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            cases.append(self)

    # per timing, in order: each read format's non-flush steps, conventional fp32, conventional
    # on each low-precision state (nearest, stochastic), each format's windows
    reads = ["fp32"] + list(lp_formats)
    conv_lp = [f for f in lp_formats if f in CONV_LP_US]
    us = ([PRECISION_US[f] for f in reads] + [12.0] + [m * CONV_LP_US[f] for f in conv_lp for m in (1, 2)]
          + [PRECISION_US[f] for f in reads])

    def snap(case):
        return (case.cursor.clone(), case.epoch.clone(), case.ckpt.clone(),
                {f: {k: t.clone() for k, t in p.items()} for f, p in case.state_lp.items()})

    def stub(fn, reps=20, warmup=2):
        (case,) = cases
        before = snap(case)
        fn()
        runs.append((before, snap(case)))
        return us[len(runs) - 1] * window      # the benchmark divides by the steps per graph

    monkeypatch.setattr(precision, "PrecisionCase", Recorded)
    monkeypatch.setattr(precision, "graph_time_us", stub)
    rows = precision.measure(shape, batch, window, lp_formats, 1, device="cpu")
    return rows, cases[0], runs


@pytest.mark.parametrize("shape, lp_formats", [("mamba2/4/2/16/32", ["fp16", "bf16", "fp8_e4m3", "nvfp4"]),
                                               ("gdn/4/2/16/32", ["fp8_e4m3", "nvfp4"]),
                                               ("kda/2/2/16/16", ["fp16"]),
                                               ("gdn/4/2/16/32", ["nvfp4"])])
def test_precision_benchmark_bookkeeping(monkeypatch, shape, lp_formats):
    from replayssm import formats

    window = 3
    rows, case, runs = _precision_rows(monkeypatch, shape, lp_formats, window=window)
    reads = ["fp32"] + lp_formats
    conv_lp = [f for f in lp_formats if f in CONV_LP_US]
    assert [(r["timing"], r["scheme"], r["read_format"]) for r in rows] == (
        [("non_flush", "replay", "fp32")] + [("non_flush", "separate", f) for f in lp_formats]
        + [("window", "conventional", "fp32")]
        + [("window", f"conventional-{f}{sr}", f) for f in conv_lp for sr in ("", "-sr")]
        + [("window", "replay", "fp32")] + [("window", "separate", f) for f in lp_formats])
    for r in rows:
        assert PRECISION_FIELDS <= set(r), PRECISION_FIELDS - set(r)
        lp_state = r["scheme"].startswith("conventional-")
        assert r["hp_format"] == (r["read_format"] if lp_state else "fp32")
        assert r["family"] == shape.split("/")[0] and r["batch"] == 2
        assert r["finite"]
    # the non-flush timings: L - 1 steps from cursor 0, no row flushes (epochs and the fp32
    # checkpoint untouched), every row ends at L - 1
    for (cur0, ep0, ck0, _), (cur1, ep1, ck1, _) in runs[:len(reads)]:
        assert torch.equal(ep1, ep0) and torch.equal(ck1, ck0)
        assert cur1.tolist() == [window - 1] * 2
    # conventional: its own state; each low-precision one rewrites its state in its format only
    n_conv = 1 + 2 * len(conv_lp)
    for i, (before, after) in enumerate(runs[len(reads):len(reads) + n_conv]):
        assert all(torch.equal(a, b) for a, b in zip(before[:3], after[:3]))
        changed = [f for f in before[3] if not all(torch.equal(before[3][f][k].view(torch.uint8),
                                                               after[3][f][k].view(torch.uint8))
                                                   for k in before[3][f])]
        assert changed == ([] if i == 0 else [conv_lp[(i - 1) // 2]]), (i, changed)
    # whole windows: staggered rows, each flushes once per window and comes back to its cursor
    for (cur0, ep0, ck0, _), (cur1, ep1, ck1, _) in runs[len(reads) + n_conv:]:
        assert cur0.tolist() == [0, 1] and torch.equal(cur1, cur0)
        assert torch.equal(ep1, ep0 + 1)
    assert not torch.equal(runs[-1][1][2], runs[-1][0][2])       # the flush wrote the fp32 checkpoint
    us = PRECISION_US
    nf = {r["read_format"]: r for r in rows if r["timing"] == "non_flush"}
    for f in reads:
        assert nf[f]["us_per_step"] == pytest.approx(us[f] * window / (window - 1))
        assert nf[f]["ratio_vs_fp32_read"] == pytest.approx(us["fp32"] / us[f])
        assert nf[f]["byte_bound"] == pytest.approx(4 / formats.bytes_per_element(f, case.K))
        assert 1 <= nf[f]["byte_bound_traffic"] <= nf[f]["byte_bound"] + 1e-9
    assert nf["fp32"]["byte_bound"] == 1.0 and nf.get("nvfp4", {"byte_bound": 64 / 9})["byte_bound"] == 64 / 9
    win = {r["scheme"] + r["read_format"]: r for r in rows if r["timing"] == "window"}
    assert win["conventionalfp32"]["us_per_step"] == 12.0
    assert win["conventionalfp32"]["bytes_per_step"] == 2 * 4 * case.HV * case.V * case.K * 2
    for f in lp_formats:
        r = win["separate" + f]
        assert r["ratio_vs_conventional"] == pytest.approx(12.0 / us[f])
        assert r["ratio_vs_fp32_read"] == pytest.approx(us["fp32"] / us[f])
        assert r["bytes_per_step"] < win["replayfp32"]["bytes_per_step"]
        if f in CONV_LP_US:
            assert r["ratio_vs_conventional_lp"] == pytest.approx(CONV_LP_US[f] / us[f])
        else:
            assert "ratio_vs_conventional_lp" not in r
    for f in conv_lp:
        for sr, m in (("", 1), ("-sr", 2)):
            r = win[f"conventional-{f}{sr}" + f]
            assert r["rounding"] == ("stochastic" if sr else "nearest")
            assert r["us_per_step"] == pytest.approx(m * CONV_LP_US[f])
            assert r["ratio_vs_conventional"] == pytest.approx(12.0 / (m * CONV_LP_US[f]))
            assert r["ratio_vs_fp32_read"] == pytest.approx(us["fp32"] / (m * CONV_LP_US[f]))
            assert r["bytes_per_step"] == 2 * formats.bytes_per_element(f, case.K) * case.HV * case.V * case.K * 2


def test_precision_benchmark_low_precision_checkpoints_decode_the_fp32_one():
    # each read format's checkpoint starts as the fp32 checkpoint rounded to nearest
    from replayssm import formats
    from replayssm.bench import precision

    case = precision.PrecisionCase("gdn/4/2/16/32", 3, 3, ["bf16", "nvfp4"], device="cpu")
    for f in ("bf16", "nvfp4"):
        assert torch.equal(formats.decode(case.ckpt_lp[f], f), formats.quantize(case.ckpt, f))
    # and the conventional low-precision state (nvfp4 has no such kernel) the conventional one
    assert list(case.state_lp) == ["bf16"]
    assert torch.equal(formats.decode(case.state_lp["bf16"], "bf16"), formats.quantize(case.state, "bf16"))
    assert case.buf_v.shape == (3, 4, 4, 16) and case.buf_v.dtype == torch.bfloat16


@pytest.mark.parametrize("argv, message", [
    (["--formats", "fp7"], "'fp7'"),
    (["--formats", "fp32,fp16"], "'fp32'"),
    (["--formats", ","], "none given"),
    (["--formats", "nvfp4", "--shapes", "mamba2/4/2/16/24"], "nvfp4 needs K divisible by 16"),
    (["--windows", "1"], "at least 2"),
    (["--configs", "[{"], "--configs must be a non-empty JSON list"),
    (["--configs", "[]"], "--configs must be a non-empty JSON list"),
    (["--configs", '{"BV": 16}'], "--configs must be a non-empty JSON list"),
    (["--configs", '[{"BK": 16}]'], "unknown keys ['BK']"),
    (["--configs", '[{"BV": 24}]'], "BV must be a power of two"),
    (["--configs", '[{"BV": 16, "num_warps": 3}]'], "num_warps must be one of"),
])
def test_precision_benchmark_refuses_bad_arguments(argv, message, capsys, monkeypatch):
    from replayssm.bench import precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)     # the arguments are checked first
    with pytest.raises(SystemExit) as exc:
        precision.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err, err
    assert "replayssm bench precision: error:" in err


def test_precision_benchmark_results_file(monkeypatch, tmp_path, capsys):
    # main's loop on stubbed points: provenance header, rows after every point, plot, table
    import json

    from replayssm.bench import precision

    points = []

    def fake(shape, batch, window, lp_formats, reps, **kw):
        points.append((shape, batch, window, tuple(lp_formats), kw["whole_window"]))
        return [dict(shape=shape, family="mamba2", batch=batch, window=window, timing="non_flush", scheme=s,
                     read_format=f, hp_format="fp32", us_per_step=t, ratio_vs_fp32_read=8.0 / t, byte_bound=b)
                for s, f, t, b in (("replay", "fp32", 8.0, 1.0), ("separate", "nvfp4", 2.0, 64 / 9))]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stub device")
    monkeypatch.setattr(precision, "copy_bandwidth_tbs", lambda: 1.0)
    monkeypatch.setattr(precision, "measure", fake)
    out = tmp_path / "p.json"
    precision.main(["--shapes", "nemotron3-super,qwen3.5-4b", "--batches", "64,256", "--formats", "nvfp4,nvfp4",
                    "--no-window", "--out", str(out)])
    assert points == [(s, b, 16, ("nvfp4",), False) for s in ("nemotron3-super", "qwen3.5-4b") for b in (64, 256)]
    doc = json.loads(out.read_text())
    assert {"benchmark", "device", "command", "git_commit", "date", "torch", "triton"} <= set(doc)
    assert doc["benchmark"] == "precision" and doc["formats"] == ["nvfp4"] and "left_out" not in doc
    assert len(doc["rows"]) == 8 and out.with_suffix(".png").exists()
    assert "nvfp4" in capsys.readouterr().out


def test_precision_benchmark_configs_repeat_the_non_flush_timings(monkeypatch):
    # `measure(configs=...)`: each low-precision format's non-flush steps again under each
    # launch config (the kernel launched with it), rows carrying it after the default rows, which
    # stay as without configs; a refused config is a row with an error, timed nothing
    from replayssm.bench import precision
    from replayssm.ops.utils.lowp import default_bv

    shape, lp_formats, window = "mamba2/4/2/16/32", ["fp16", "nvfp4"], 3
    cases, timed = [], []

    class Recorded(precision.PrecisionCase):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            cases.append(self)
            lowp = self.lowp

            @functools.wraps(lowp)
            def launch(*a, **kw):
                timed[-1]["configs"].append(kw.get("config"))
                return lowp(*a, **kw)
            self.lowp = launch

    def stub(fn, reps=20, warmup=2):
        (case,) = cases
        ep0 = case.epoch.clone()
        timed.append(dict(configs=[]))
        fn()
        timed[-1].update(out=case.out[:window - 1].clone(), flushed=not torch.equal(case.epoch, ep0),
                         cursor=case.cursor.tolist())
        return (5.0 + len(timed)) * (window - 1)     # the benchmark divides by the steps per graph

    monkeypatch.setattr(precision, "PrecisionCase", Recorded)
    monkeypatch.setattr(precision, "graph_time_us", stub)
    plain = precision.measure(shape, 2, window, lp_formats, 1, device="cpu", whole_window=False)
    n_plain = len(timed)
    cases.clear()
    timed.clear()
    configs = [{"BV": 16, "num_warps": 2}, {"BV": 3}, {"num_warps": 8}]
    rows = precision.measure(shape, 2, window, lp_formats, 1, device="cpu", whole_window=False, configs=configs)
    assert rows[:len(plain)] == plain and n_plain == 1 + len(lp_formats)
    tried = rows[len(plain):]
    assert [(r["read_format"], r["config"]) for r in tried] == [(f, c) for c in configs for f in lp_formats]
    assert all(r["timing"] == "non_flush" and r["scheme"] == "separate" and r["finite"] for r in tried)
    t_fp32 = plain[0]["us_per_step"]
    assert plain[0]["read_format"] == "fp32" and t_fp32 == 6.0
    good = [r for r in tried if r["config"] != {"BV": 3}]
    runs = timed[n_plain:]
    assert len(runs) == len(good) == 4                  # the refused config timed nothing
    defaults = {r["read_format"]: timed[i] for i, r in enumerate(plain)}     # this case's default runs
    for i, (r, run) in enumerate(zip(good, runs)):
        want = dict({"BV": default_bv(16), "num_warps": 4}, **r["config"])
        assert r["launch"] == want and "error" not in r
        # every step of the timing launched with the config; none flushed; the same outputs
        assert run["configs"] == [r["config"]] * (window - 1) and not run["flushed"]
        assert run["cursor"] == [window - 1] * 2
        assert torch.equal(run["out"], defaults[r["read_format"]]["out"])
        assert r["us_per_step"] == 5.0 + n_plain + 1 + i
        assert r["ratio_vs_fp32_read"] == pytest.approx(t_fp32 / r["us_per_step"])
        base = next(p for p in plain if p["read_format"] == r["read_format"])
        assert r["ratio_vs_default"] == pytest.approx(r["us_per_step"] / base["us_per_step"])
        for key in ("bytes_per_step", "byte_bound", "byte_bound_traffic", "shape", "batch", "window", "hp_format"):
            assert r[key] == base[key], key
    assert all(r["config"] == {"BV": 16, "num_warps": 2} for r in good[:2])     # one program per head
    bad = [r for r in tried if r["config"] == {"BV": 3}]
    assert len(bad) == 2 and all(r["us_per_step"] is None and "BV must be a power of two" in r["error"]
                                 for r in bad)
    text = precision.table(rows)
    assert text.count("failed") == 2 and "{'BV': 16, 'num_warps': 2}" in text


def test_precision_benchmark_configs_option(monkeypatch, tmp_path, capsys):
    # --configs reaches every point's measure and the results file
    import json

    from replayssm.bench import precision

    seen = []

    def fake(shape, batch, window, lp_formats, reps, **kw):
        seen.append(kw["configs"])
        base = dict(shape=shape, family="mamba2", batch=batch, window=window, timing="non_flush",
                    read_format="fp16", hp_format="fp32", byte_bound=2.0)
        rows = [dict(base, scheme="replay", read_format="fp32", us_per_step=8.0, ratio_vs_fp32_read=1.0,
                     byte_bound=1.0),
                dict(base, scheme="separate", us_per_step=4.0, ratio_vs_fp32_read=2.0)]
        if kw["configs"]:
            rows += [dict(base, scheme="separate", config=kw["configs"][0], launch=kw["configs"][0], us_per_step=2.0,
                          ratio_vs_fp32_read=4.0),
                     dict(base, scheme="separate", config=kw["configs"][1], us_per_step=None, error="ValueError('x')")]
        return rows
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stub device")
    monkeypatch.setattr(precision, "copy_bandwidth_tbs", lambda: 1.0)
    monkeypatch.setattr(precision, "measure", fake)
    out = tmp_path / "p.json"
    cfgs = [{"BV": 64, "num_warps": 4}, {"BV": 32, "num_warps": 8}]
    precision.main(["--shapes", "nemotron3-super,qwen3.5-4b", "--batches", "256", "--formats", "fp16",
                    "--no-window", "--configs", json.dumps(cfgs), "--out", str(out)])
    assert seen == [cfgs, cfgs]
    doc = json.loads(out.read_text())
    assert doc["configs"] == cfgs and len(doc["rows"]) == 8
    printed = capsys.readouterr().out
    assert "{'BV': 64, 'num_warps': 4}" in printed and "failed" in printed
    precision.main(["--shapes", "nemotron3-super", "--batches", "256", "--formats", "fp16", "--no-window",
                    "--out", str(out)])
    assert seen[-1] is None and "configs" not in json.loads(out.read_text())


def test_verify_star_windows_follow_the_traffic_model():
    from replayssm import shapes, traffic
    from replayssm.bench import verify
    for name in ("nemotron3-super", "qwen3.5-4b", "kimi-linear-48b"):
        sh = shapes.parse(name)
        for T in (1, 2, 4, 8):
            L = verify.star_window(name, T)
            assert max(T, 2) <= L <= 32
            r = traffic.record_bytes(sh.V, sh.K, decay_len=sh.K if sh.family == "kda" else 1)
            exact = traffic.l_star(sh.V, sh.K, r=r, T=T, A=(T + 1) / 2)
            assert L == min(32, max(T, 2, round(exact)))
    # KDA's decay vectors make its records dearer: a shorter window than GDN's at the same K, V
    assert verify.star_window("kimi-linear-48b", 4) < verify.star_window("qwen3.5-4b", 4)
    assert verify._windows("16,star,16", "nemotron3-super", 4) == [16, verify.star_window("nemotron3-super", 4)]
    with pytest.raises(SystemExit):
        verify.main(["--windows", "16,huge"])


def test_header_notes_a_tree_that_differs_from_its_commit(tmp_path, monkeypatch):
    # results record the commit and, where tracked files differ from it (a GPU machine's copy
    # of the tree can carry an older .git), a note naming them; REPLAYSSM_COMMIT overrides both
    import subprocess
    from replayssm.bench.common import header
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run(git + ["-C", str(tmp_path), "add", "a.py"], check=True)
    subprocess.run(git + ["-C", str(tmp_path), "commit", "-q", "-m", "a"], check=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REPLAYSSM_COMMIT", raising=False)
    clean = header("t")
    assert len(clean["git_commit"]) == 40 and "git_commit_note" not in clean
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "new.py").write_text("")                 # untracked files are not the commit's
    assert header("t")["git_commit_note"] == \
        "the tree that ran differs from this commit in 1 tracked file (a.py)"
    monkeypatch.setenv("REPLAYSSM_COMMIT", "abc1234")
    named = header("t")
    assert named["git_commit"] == "abc1234" and "git_commit_note" not in named
