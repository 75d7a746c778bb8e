"""The Gluon kernels (GPU only) compile for sm_90 with the installed Triton, on a machine
without a GPU: Gluon's API has changed between Triton releases (3.6 on the H200 machine, newer
here), and the kernels cannot run on the CPU interpreter, so this is the CPU-side check that
they still build. Each compile runs `benchmarks/tools/regcount.py` in a process of its own,
without the interpreter switch (`TRITON_INTERPRET=1`) that the test run sets. Their results
are tested on the GPU (`-k gluon` in test_ops_mamba2.py and test_ops_delta.py)."""
import os
import pathlib
import subprocess
import sys

import pytest

from replayssm.ops.mamba2.gluon_decode import HAVE_GLUON

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("args", [
    ["mamba2-gluon", "inputs=bf16", "recmask=0"],                           # Nemotron-3-Super's table config
    ["mamba2-gluon", "recmask=1", "BV=16", "num_warps=1"],                  # Nano-4B's program size, fp32 inputs
    ["gdn-gluon", "inputs=bf16", "recmask=0"],                              # Qwen3.5-4B's table config
], ids=["mamba2-super", "mamba2-one-warp", "gdn"])
def test_gluon_kernels_compile_for_sm90(args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tools" / "regcount.py"), *args], env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode and ("ptxas" in r.stderr or "cuobjdump" in r.stderr) and "No such file" in r.stderr:
        pytest.skip("no CUDA toolchain bundled with this Triton")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "registers" in r.stdout and "registers ?" not in r.stdout, r.stdout
