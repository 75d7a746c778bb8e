"""The tools' own tests (run with the suite: pyproject's testpaths).

The Gluon kernels (GPU only) compile for sm_90 with the installed Triton, on a machine without
a GPU: Gluon's API has changed between Triton releases (3.6 on the H200 machine, newer here),
and the kernels cannot run on the CPU interpreter, so this is the CPU-side check that they
still build. Each compile runs `regcount.py` in a process of its own, without the interpreter
switch (`TRITON_INTERPRET=1`) that the test run sets. Their results are tested on the GPU
(`-k gluon` in tests/test_ops_mamba2.py and tests/test_ops_delta.py). This module imports
nothing of the package, so that collecting it never defines kernels before that switch is set.
"""
import importlib.util
import os
import pathlib
import runpy
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
HAVE_GLUON = importlib.util.find_spec("triton") is not None and \
    importlib.util.find_spec("triton.experimental.gluon") is not None


@pytest.mark.skipif(not HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("args", [
    ["mamba2-gluon", "inputs=bf16", "recmask=0"],                           # Nemotron-3-Super's table config
    ["mamba2-gluon", "model=nano", "recmask=1"],                           # Nano-4B's one-warp programs, fp32 inputs
    ["mamba2-gluon", "model=nano", "inputs=bf16", "recmask=0", "kq=1"],     # the groups' key products loaded
    ["gdn-gluon", "inputs=bf16", "recmask=0"],                              # Qwen3.5-4B's table config
    ["kda-gluon", "inputs=bf16", "BV=128", "num_warps=8", "BC=4"],          # Kimi Linear's table config
], ids=["mamba2-super", "mamba2-one-warp", "mamba2-kq", "gdn", "kda"])
def test_gluon_kernels_compile_for_sm90(args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, str(HERE / "regcount.py"), *args], env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode and ("ptxas" in r.stderr or "cuobjdump" in r.stderr) and "No such file" in r.stderr:
        pytest.skip("no CUDA toolchain bundled with this Triton")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "registers" in r.stdout and "registers ?" not in r.stdout, r.stdout


_PROBE = """
import sys
sys.path[:0] = [{tools!r}, {tests!r}]
import regcount
from triton.experimental.gluon._runtime import GluonASTSource
import test_gluon_lowp as t
for LP, (data, scale) in {{1: ("*i16", "*fp32"), 3: ("*u8", "*fp32"), 4: ("*i32", "*u8")}}.items():
    ptr = dict(lp_data=data, lp_scale=scale, lp_tscale="*fp32", eye="*fp32", out="*fp32")
    sig, const = regcount.signature(t._probe_kernel, ptr, dict(V=64, K=128, BV=64, LP=LP, NW=4))
    regcount.compile_kernel(t._probe_kernel, sig, const, 4, GluonASTSource)
    print("compiled", LP)
"""


@pytest.mark.skipif(not HAVE_GLUON, reason="this Triton has no Gluon")
def test_gpu_tests_probe_kernel_compiles_for_sm90():
    # A Gluon kernel defined in a GPU test runs nowhere but on a GPU: compiled here, a change of
    # the helpers it calls shows on the CPU (a missing argument once went unseen until a GPU ran it)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    code = _PROBE.format(tools=str(HERE), tests=str(ROOT / "tests"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if r.returncode and ("ptxas" in r.stderr or "cuobjdump" in r.stderr) and "No such file" in r.stderr:
        pytest.skip("no CUDA toolchain bundled with this Triton")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("compiled")] == \
        ["compiled 1", "compiled 3", "compiled 4"], r.stdout


def test_sass_stalls_sums_a_source_level_profile(capsys, monkeypatch):
    """`sass_stalls.py` on a synthetic ncu source-level export (data/ncu_source_sass.csv: ncu's two header lines, ten SASS instructions, an empty
    sample cell, "Not Issued" stall columns that must not be counted) reproduces the totals
    worked out by hand: 150 samples, 15.0M executed, the stall reasons and the split."""
    prof = HERE / "data" / "ncu_source_sass.csv"
    monkeypatch.setattr(sys, "argv", ["sass_stalls.py", str(prof), "--top", "3", "--split", "4,8"])
    runpy.run_path(str(HERE / "sass_stalls.py"), run_name="__main__")
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


def test_results_doc_matches_the_result_files():
    """docs/results.md and docs/results/ are what `results_doc.py` writes from the JSON files that
    benchmarks/results/README.md indexes (regenerate it with `python
    benchmarks/tools/results_doc.py`), and the index names every JSON file of the folder."""
    tool = runpy.run_path(str(HERE / "results_doc.py"))
    results = ROOT / "benchmarks" / "results"
    indexed = {n for _, names in tool["indexed_files"]((results / "README.md").read_text()) for n in names}
    assert indexed == {p.name for p in results.glob("*.json")}
    pages = tool["render"](results)
    assert "results.md" in pages and len(pages) > 1
    assert tool["stale_pages"](pages, ROOT / "docs") == [], \
        "docs/results.md or docs/results/ is stale: run python benchmarks/tools/results_doc.py"


def test_results_doc_help_and_unknown_arguments_write_nothing(capsys, monkeypatch):
    tool = runpy.run_path(str(HERE / "results_doc.py"))
    monkeypatch.setitem(tool["main"].__globals__, "render", lambda *a: pytest.fail("rendered"))
    assert tool["main"](["--help"]) == 0 and "--check" in capsys.readouterr().out
    assert tool["main"](["--chek"]) == 2 and "unknown arguments ['--chek']" in capsys.readouterr().err


def test_compile_check_compiles_what_a_test_launches():
    # the commit kernel's test: one launch, recorded under the interpreter and compiled for sm_90a
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, str(HERE / "compile_check.py"), "tests/test_pool_verify.py",
                        "-k", "commit_kernel"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "ok   replayssm.ops.utils.commit._commit_kernel" in r.stdout
    assert "0 of 1 launches failed" in r.stdout


_FAKE_SSU = '''import functools, json, os
import torch
from packaging import version
import vllm.envs as envs
from vllm import _custom_ops as ops
from vllm.logger import init_logger
from vllm.model_executor.layers.mamba.ops.triton_helpers import fast_exp
from vllm.platforms import current_platform
from vllm.triton_utils import HAS_TRITON, tl, triton
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID
logger = init_logger(__name__)
def selective_state_update(*args, null_block_id=NULL_BLOCK_ID, **kwargs):
    logger.info_once("config from %s", envs.VLLM_TUNED_CONFIG_FOLDER)
    return (current_platform.is_xpu(), HAS_TRITON, fast_exp.__name__, null_block_id)
'''


def test_vllm_ssu_loads_the_kernel_module_with_its_imports_stood_in(tmp_path):
    # a stand-in of vLLM 0.25.0's mamba_ssm.py with the same package imports: the loader's
    # stand-ins cover them, and the module's function comes back
    ops = tmp_path / "vllm" / "model_executor" / "layers" / "mamba" / "ops"
    ops.mkdir(parents=True)
    (ops / "mamba_ssm.py").write_text(_FAKE_SSU)
    (ops / "triton_helpers.py").write_text("from vllm.triton_utils import tl, triton\n\n"
                                           "def fast_exp(x):\n    return x\n")
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import vllm_ssu; "
            f"print(vllm_ssu.load_ssu({str(tmp_path)!r})())")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "(False, True, 'fast_exp', 0)"


def test_cursor_steps_says_it_needs_a_gpu():
    # the per-cursor timing tool (GPU only) refuses a machine without CUDA with a clear error
    # rather than a traceback; elsewhere (the H200) it is run by hand
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(HERE / "cursor_steps.py"), "kimi-linear-48b", "--batch", "4"],
                       env=env, capture_output=True, text=True, timeout=300)
    if "needs a CUDA device" not in r.stderr and r.returncode == 0:
        pytest.skip("a CUDA device is present: the tool ran")
    assert r.returncode != 0 and "needs a CUDA device" in r.stderr, r.stderr[-2000:]


def _fork_tools():
    # imported when a test runs, not at collection (the modules import the package's kernels)
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import fork_verify

    from replayssm.bench.peers import fork
    return fork, fork_verify


def test_fork_verify_lays_out_tokens_rings_and_flags_as_the_fork_does():
    """fork_verify.py's bridges to the public fork's layouts, without the fork's source: the
    packed token channels (x | B | C, q | k | v, row b's token t at b * T + t), the ring length
    vLLM allocates, the flush flag its commit sets, and records written into a ring that wraps
    read back and folded to the state our linear buffer holds."""
    import torch
    from replayssm import shapes
    from replayssm.reference import replay
    from replayssm.testing import make_inputs, make_params

    fp, fv = _fork_tools()
    for window, T in [(16, 2), (16, 8), (8, 8), (15, 1), (16, 16), (5, 3)]:
        buf = fp.fork_buffer_len(window, T)
        assert buf & (buf - 1) == 0 and window + T <= buf < 2 * (window + T), (window, T, buf)
    assert [fp.fork_buffer_len(16, T) for T in (1, 2, 4, 8)] == [32, 32, 32, 32]
    wp = torch.arange(17, dtype=torch.int32)
    assert fp.fork_flush_flags(wp, 16, 4).tolist() == [int(h + 4 > 16) for h in range(17)]
    hs = fv.history_lengths(16, 16, 4)
    assert sum(h + 4 > 16 for h in hs) == 8 and min(hs) >= 0 and max(hs) == 16

    g = torch.Generator().manual_seed(0)
    Bt, T, HV, V, Hk, K = 2, 3, 4, 5, 2, 6
    x, B, C = torch.randn(Bt, T, HV, V, generator=g), torch.randn(Bt, T, Hk, K, generator=g), \
        torch.randn(Bt, T, Hk, K, generator=g)
    co = fp.pack_tokens(x, B, C)
    assert co.shape == (Bt * T, HV * V + 2 * Hk * K)
    b, t, h, d, grp, n = 1, 2, 3, 4, 1, 5
    assert co[b * T + t, h * V + d] == x[b, t, h, d]
    assert co[b * T + t, HV * V + grp * K + n] == B[b, t, grp, n]
    assert co[b * T + t, HV * V + Hk * K + grp * K + n] == C[b, t, grp, n]

    window, T, origin, hist = 8, 4, 13, 7           # a ring of 16: positions 13, 14, 15, 0, 1, 2, 3
    sid = torch.tensor([1], dtype=torch.int32)
    for fam in ("mamba2", "gdn"):
        sh = shapes.Shape(fam, 4, 2, 8, 16)
        p = make_params(fam, sh.HV, sh.K, dtype=torch.float32, seed=1)
        refp = make_params(fam, sh.HV, sh.K, dtype=torch.float32, seed=1)
        for name in ("A", "dt_bias", "D", "A_log"):
            if getattr(refp, name, None) is not None:
                setattr(refp, name, getattr(refp, name).double())
        fk = fp.make_fork(None, sh, p, 2, 1, window, T, sid, torch.float32, torch.float32, False, "cpu")
        fk.set_cursors(torch.tensor([0, hist], dtype=torch.int32), torch.tensor([0, origin], dtype=torch.int32))
        assert fk.buf == 16 and fk.is_flush.tolist() == [0, 1]
        C0 = 0.1 * torch.randn(sh.HV, sh.V, sh.K, generator=g, dtype=torch.float64)
        fk.ckpt[1] = C0.float()
        tok = make_inputs(refp, hist, sh.V, sh.K, sh.Hk, gate=False, generator=g)
        tok = {k: v.float().double() for k, v in tok.items()}
        if fam == "mamba2":
            fk.set_history(1, tok["x"], tok["dt"], tok["B"])
            # ours: ld = A softplus(dt + dt_bias), the values dt x, the keys B
            ld = refp.prepare(tok["x"], tok["dt"], tok["B"], tok["C"])["ld"]
            w, k = refp.record_values(ld, tok["x"]), tok["B"]
            assert torch.equal(fk.post_conv[1, 2, :sh.HV * sh.V], tok["x"][5].flatten().float())
            assert torch.equal(fk.dt_cache[1, :, 0], tok["dt"][3].float())
            written = fk.post_conv[1].abs().sum(1) > 0
        else:
            ld, w = -0.1 * torch.rand(hist, sh.HV, generator=g, dtype=torch.float64), tok["v"]
            k = tok["k"] / tok["k"].norm(dim=-1, keepdim=True)
            fk.set_history(1, ld.float(), w.float(), k.float())
            assert torch.equal(fk.d_cache[1, 3, 15], w[2, 3].float())
            assert torch.equal(fk.k_cache[1, 1, 1], k[4, 1].float())
            written = fk.k_cache[1, 0].abs().sum(1) > 0
            ld, w, k = ld.float().double(), w.float().double(), k.float().double()
        assert written.nonzero().flatten().tolist() == [0, 1, 2, 3, 13, 14, 15], fam
        rl, rw, rk = fk.history(1, refp)
        torch.testing.assert_close(rl, ld, rtol=1e-6, atol=0)
        torch.testing.assert_close(rw, w, rtol=1e-6, atol=0)
        assert torch.equal(rk, k)
        S = replay(C0.float().double(), ld, w, k)
        torch.testing.assert_close(fk.materialize(1, refp), S, rtol=1e-6, atol=1e-12)


def test_fork_verify_names_the_fork_files_it_lacks(tmp_path):
    # a checkout without the fork's kernel files is refused with their names, not a traceback
    fp, fv = _fork_tools()
    with pytest.raises(SystemExit, match="selective_state_update_replayssm_spec.py"):
        fp.load_fork(str(tmp_path))
