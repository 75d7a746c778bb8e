"""replayssm.bench.trace: GPU busy time per step from torch-profiler traces (synthetic traces,
the CPU)."""
from __future__ import annotations

import gzip
import json

import pytest

from replayssm.bench import trace


def _event(name, ts, dur, cat="kernel", tid=7):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def _write(path, events, gz=False):
    doc = {"traceEvents": events}
    if gz:
        with gzip.open(path, "wt") as f:
            json.dump(doc, f)
    else:
        path.write_text(json.dumps(doc))


def test_union_counts_overlaps_once():
    assert trace.union_length([]) == 0
    assert trace.union_length([(0, 10), (5, 15), (20, 25)]) == 20
    assert trace.union_length([(0, 10), (2, 3), (10, 12)]) == 12


def test_busy_idle_and_kernels_per_step(tmp_path):
    # two steps of 1000 us: each a GEMM (300 us), a replayssm verify (200 us) overlapping a copy
    # on another stream by 50 us, then the GPU idle; host events never count
    ev = []
    for s in range(2):
        t = 1000 * s
        ev += [_event("sm90_xmma_gemm_bf16", t, 300), _event("_replay_verify_kernel", t + 300, 200),
               _event("Memcpy DtoD", t + 450, 100, cat="gpu_memcpy", tid=9),
               {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": t, "dur": 900}]
    ev.append(_event("fused_moe_kernel", 1990, 10))          # the span ends at 2000
    (tmp_path / "w").mkdir()
    _write(tmp_path / "w" / "rank0.pt.trace.json.gz", ev, gz=True)
    got = trace.summarise(tmp_path, steps=2)
    assert got["step_ms"] == pytest.approx(1.0)
    assert got["gpu_busy_ms_per_step"] == pytest.approx((300 + 200 + 50 + 5) / 1e3)
    assert got["gpu_idle_share"] == pytest.approx(1 - 1110 / 2000)
    kinds = got["kinds_ms_per_step"]
    assert kinds["matrix products"] == pytest.approx(0.3) and kinds["replayssm"] == pytest.approx(0.2)
    assert kinds["memory"] == pytest.approx(0.1) and kinds["MoE"] == pytest.approx(0.005)
    top = got["top_kernels"]
    assert [k["name"] for k in top][:2] == ["sm90_xmma_gemm_bf16", "_replay_verify_kernel"]
    assert top[0]["calls_per_step"] == 1
    assert "1.00 ms a step, the GPU busy 0.56 ms" in trace.report(got)


def test_refuses_what_it_cannot_measure(tmp_path, capsys):
    with pytest.raises(FileNotFoundError):
        trace.summarise(tmp_path, steps=4)
    _write(tmp_path / "t.json", [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 5}])
    with pytest.raises(ValueError, match="no device events"):
        trace.summarise(tmp_path, steps=4)
    with pytest.raises(ValueError, match="steps"):
        trace.summarise(tmp_path / "t.json", steps=0)
    assert trace.main([str(tmp_path)]) == 2
    assert "no device events" in capsys.readouterr().err


def test_kinds():
    for ours in ("_replay_decode_kernel", "_gluon_verify_kernel", "_gluon_gdn_kernel", "_lowp_decode_kernel",
                 "_commit_kernel", "_verify_key_products_kernel"):
        assert trace.kind_of(ours) == "replayssm", ours
    assert trace.kind_of("_causal_conv1d_update_kernel") == "recurrent (vLLM)"
    assert trace.kind_of("selective_state_update_kernel") == "recurrent (vLLM)"
    assert trace.kind_of("flash_fwd_splitkv_kernel") == "attention"
    assert trace.kind_of("fused_moe_kernel") == "MoE"
    assert trace.kind_of("nvjet_tst_128x256") == "matrix products"
    assert trace.kind_of("elementwise_kernel") == "other"


def test_every_replayssm_kernel_is_named_ours():
    # the launchable kernels of replayssm/ops (functions ending in _kernel), as a trace names them
    import pathlib
    import re
    ops = pathlib.Path(trace.__file__).resolve().parents[1] / "ops"
    names = {m for f in ops.rglob("*.py") for m in re.findall(r"^def (_\w+_kernel)\(", f.read_text(), re.M)}
    assert len(names) > 10
    assert {n for n in names if trace.kind_of(n) != "replayssm"} == set()
