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
