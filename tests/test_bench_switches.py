"""The benchmarks' experimental-switch variants (replayssm.bench.switches): the registry matches
the modules, a switch is set around its variant's step alone and restored, bad ones are refused."""
import functools
import importlib
import inspect

import pytest
import torch

from replayssm import cli
from replayssm.bench import switches


@pytest.mark.parametrize("name", sorted(switches.SWITCHES))
def test_each_switch_names_a_module_attribute_its_variable_sets(name):
    module, attr, env, check = switches.SWITCHES[name]
    mod = importlib.import_module(module)
    assert hasattr(mod, attr)
    assert f'"{env}"' in inspect.getsource(mod)           # the variable the module reads at import
    check(getattr(mod, attr))                              # the value it holds now is a valid one


def test_applied_sets_then_restores_also_when_the_block_raises():
    from replayssm.ops.gdn import gluon_verify_host as gv
    from replayssm.ops.mamba2 import gluon_verify as mv

    before = (gv.LEAN, gv.ROWS, mv.KEYS_GLOBAL)
    with switches.applied({"gdn_verify_lean": not before[0], "gdn_verify_rows": 2}):
        assert (gv.LEAN, gv.ROWS) == (not before[0], 2)
        assert mv.KEYS_GLOBAL == before[2]                 # the others untouched
    assert (gv.LEAN, gv.ROWS, mv.KEYS_GLOBAL) == before
    with pytest.raises(RuntimeError):
        with switches.applied({"mamba2_verify_keys_global": True}):
            assert mv.KEYS_GLOBAL is True
            raise RuntimeError
    assert (gv.LEAN, gv.ROWS, mv.KEYS_GLOBAL) == before


@pytest.mark.parametrize("bad, message", [
    ({"gdn_verify_leen": True}, "unknown switch 'gdn_verify_leen'"),
    ({"gdn_verify_lean": 1}, "REPLAYSSM_GLUON_VERIFY_LEAN): 1 is not a bool"),
    ({"gdn_verify_rows": 4}, "4 is not one of [1, 2]"),
    ({"lp_heads": True}, "True is not one of [1, 2, 4]"),
    ([], "must be an object"),
])
def test_bad_switches_are_refused_before_any_is_set(bad, message):
    from replayssm.ops.gdn import gluon_verify_host as gv

    lean = gv.LEAN
    arg = {"gdn_verify_lean": not lean, **bad} if isinstance(bad, dict) else bad   # a good one first
    with pytest.raises(ValueError) as e:
        with switches.applied(arg):
            pass
    assert message in str(e.value)
    assert gv.LEAN == lean


def test_split_leaves_the_launch_config_without_its_switches():
    assert switches.split(None) == (None, {})
    assert switches.split({"BV": 32}) == ({"BV": 32}, {})
    assert switches.split({"switches": {"lp_rows": 2}}) == (None, {"lp_rows": 2})
    assert switches.split({"mma": True, "switches": {}}) == ({"mma": True}, {})


def test_verify_benchmark_sets_a_variants_switches_during_its_step_alone(monkeypatch):
    from replayssm.bench import verify
    from replayssm.ops.gdn import gluon_verify_host as gv

    torch.manual_seed(0)
    a = verify.Case("gdn/4/2/16/32", 3, 4, 2, device="cpu", snapshot=False)
    torch.manual_seed(0)
    b = verify.Case("gdn/4/2/16/32", 3, 4, 2, device="cpu", snapshot=False)
    seen, real = [], a.ops.replay_verify

    @functools.wraps(real)                                 # (call_accepting reads its signature)
    def spy(*args, **kw):
        seen.append((gv.LEAN, kw.get("config")))
        return real(*args, **kw)
    monkeypatch.setattr(a.ops, "replay_verify", spy)
    lean = gv.LEAN
    a.replay_step({"switches": {"gdn_verify_lean": not lean}, "BV": 16})
    a.replay_step()
    assert seen == [(not lean, {"BV": 16}), (lean, None)]  # the kernels never see the key
    assert gv.LEAN == lean
    b.replay_step({"BV": 16})
    b.replay_step()
    assert torch.equal(a.out, b.out) and torch.equal(a.cursor, b.cursor)   # (the CPU runs no Gluon)


def test_precision_benchmark_sets_a_configs_switches_during_its_steps(monkeypatch):
    from replayssm.bench import precision
    from replayssm.ops.utils import gluon_lowp

    case = precision.PrecisionCase("gdn/4/2/16/32", 3, 3, ["fp16"], device="cpu")
    seen, real = [], case.lowp

    @functools.wraps(real)
    def spy(*args, **kw):
        seen.append((gluon_lowp.READ_MMA, gluon_lowp.ROWS, kw.get("config")))
        return real(*args, **kw)
    case.lowp = spy
    before = (gluon_lowp.READ_MMA, gluon_lowp.ROWS)
    case.non_flush_steps("fp16", {"switches": {"lp_read_mma": True, "lp_rows": 4}})
    assert seen == [(True, 4, None)] * 2                    # window 3: two non-flush steps
    assert (gluon_lowp.READ_MMA, gluon_lowp.ROWS) == before


@pytest.mark.parametrize("argv, message", [
    (["bench", "verify", "--variants", '[{"switches": {"lean": true}}]'], "unknown switch 'lean'"),
    (["bench", "verify", "--variants", '[{"switches": {"gdn_verify_rows": 3}}]'], "3 is not one of [1, 2]"),
    (["bench", "precision", "--configs", '[{"switches": {"lp_heads": 3}}]'], "3 is not one of [1, 2, 4]"),
    (["bench", "precision", "--configs", '[{"switches": true}]'], "must be an object"),
])
def test_benchmarks_refuse_bad_switches_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_summary_gives_each_variants_span_against_the_default(tmp_path, capsys):
    import json

    doc = {"device": "NVIDIA H100 80GB HBM3", "rows": [
        {"shape": "qwen3.5-4b", "scheme": "replay", "accepted": 1, "us_per_step": 10.0},
        {"shape": "qwen3.5-4b", "scheme": "replay", "accepted": 1, "config": {"switches": {"gdn_verify_lean": True}},
         "us_per_step": 9.0, "ratio_vs_default": 0.9},
        {"shape": "qwen3.5-4b", "scheme": "replay", "accepted": 8, "config": {"switches": {"gdn_verify_lean": True}},
         "us_per_step": 11.0, "ratio_vs_default": 1.1},
        {"shape": "qwen3.5-4b", "scheme": "replay", "accepted": 8, "config": {"BV": 3}, "error": "BV"},
        {"shape": "nemotron3-super", "read_format": "fp8_e4m3", "config": {"switches": {"lp_rows": 2}},
         "us_per_step": None}]}
    path = tmp_path / "v.json"
    path.write_text(json.dumps(doc))
    assert switches.main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4                                  # a header and three variants
    lean = next(x for x in lines if "gdn_verify_lean" in x)
    assert "0.900-1.100x" in lean and "H100" in lean
    assert "(1 of 1 rows failed)" in next(x for x in lines if "'BV': 3" in x)
    rows2 = next(x for x in lines if "lp_rows" in x)
    assert "fp8_e4m3" in rows2 and "(1 of 1 rows failed)" in rows2
    with pytest.raises(SystemExit):
        switches.main([str(tmp_path / "missing.json")])


def test_the_switch_tests_launch_spy_records_then_launches(monkeypatch):
    # conftest.spy_launches, which the switches' GPU tests use to assert a switch reached its kernel
    import types

    from conftest import spy_launches

    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw)) or "ran"
    mod = types.SimpleNamespace(k=Kernel())
    seen = []
    spy_launches(monkeypatch, mod, "k", lambda kw: seen.append(kw["KG"]))
    assert mod.k[(2, 3)](1, KG=True) == "ran"
    assert seen == [True] and calls == [((2, 3), (1,), {"KG": True})]
