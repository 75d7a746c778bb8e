"""`register()` in vLLM's front-end process: it must import nothing of vLLM (whose model runner's
module chain initialises CUDA, after which vLLM spawns its workers instead of forking them, and a
user's script without an `if __name__ == "__main__":` guard fails at engine start), and still
patch every class once vLLM imports its module, before or after `register()`.

On the CPU against a stand-in vLLM tree (the modules the plugin patches, with the classes and
methods it touches; the model runner's module marks that it ran, as the real one's import chain
initialises CUDA), in a fresh interpreter per case. test_vllm_gpu.py checks the real vLLM on the
GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYER = '''
class {name}:
    def get_state_shape(self):
        return "stock"

    def get_state_dtype(self):
        return "stock"

    def get_kv_cache_spec(self, vllm_config):
        return None

    def {forward}(self, *args):
        return "stock"
'''

MODEL = '''
class {name}:
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        return "stock"

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        return "stock"

    @classmethod
    def get_mamba_state_copy_func(cls):
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec
        return get_conv_copy_spec, get_temporal_copy_spec
'''

RUNNER = '''
import builtins
builtins.REPLAYSSM_TEST_RUNNER_IMPORTED = True      # the real chain initialises CUDA here


class GPUModelRunner:
    def initialize_kv_cache_tensors(self, *args):
        return "stock"
'''

FILES = {
    "vllm/model_executor/layers/mamba/mamba_mixer2.py": LAYER.format(name="MambaMixer2", forward="conv_ssm_forward"),
    "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py":
        LAYER.format(name="QwenGatedDeltaNetAttention", forward="_forward_core"),
    "vllm/model_executor/models/nemotron_h.py": MODEL.format(name="NemotronHForCausalLM"),
    "vllm/model_executor/models/qwen3_next.py": MODEL.format(name="Qwen3NextForCausalLM"),
    "vllm/model_executor/models/qwen3_5.py": MODEL.format(name="Qwen3_5ForConditionalGeneration"),
    "vllm/v1/worker/gpu_model_runner.py": RUNNER,
    # the symbols the patched methods read at run time
    "vllm/forward_context.py": "def get_forward_context():\n    return None\n",
    "vllm/model_executor/layers/mamba/ops/causal_conv1d.py": "def causal_conv1d_update(*args):\n    return None\n",
    "vllm/model_executor/layers/mamba/mamba_utils.py": (
        "def is_conv_state_dim_first():\n    return True\n\n\nclass MambaStateShapeCalculator:\n"
        "    @staticmethod\n    def extra_groups_for_head_shards(ngroups, tp_size):\n        return 0\n\n\n"
        "def get_conv_copy_spec(*args):\n    return None\n\n\ndef get_temporal_copy_spec(*args):\n"
        "    return None\n"),
    "vllm/v1/attention/backends/utils.py": "NULL_BLOCK_ID = 0\n\n\ndef compute_causal_conv1d_metadata(*args):\n"
                                           "    return None\n",
}

# what vLLM imports, as the front-end (the model class, to size its blocks) and a worker do
IMPORTS = {
    "front": ["vllm.model_executor.models.nemotron_h", "vllm.model_executor.models.qwen3_5"],
    "worker": ["vllm.model_executor.layers.mamba.mamba_mixer2",
               "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
               "vllm.model_executor.models.qwen3_next", "vllm.v1.worker.gpu_model_runner"],
}

SCRIPT = '''
import builtins, importlib, json, sys
import torch
sys.path.insert(0, {tree!r})
from replayssm.integrations.vllm import _compat
_compat.vllm_version = lambda: "0.25.0"             # the stand-in tree has no distribution
from replayssm.integrations import vllm as plugin
before = {before!r}
for m in before:
    importlib.import_module(m)
loaded = set(sys.modules)
ok = plugin.register({{"REPLAYSSM_VLLM": "1"}})
after_register = dict(runner=getattr(builtins, "REPLAYSSM_TEST_RUNNER_IMPORTED", False),
                      vllm=sorted(m for m in set(sys.modules) - loaded if m.split(".")[0] == "vllm"),
                      cuda=torch.cuda.is_initialized())
print("FRONT " + json.dumps(after_register), flush=True)
plugin.register({{"REPLAYSSM_VLLM": "1"}})          # vLLM may call it again: nothing twice
import importlib.util
importlib.util.find_spec("vllm.v1.worker.gpu_model_runner")   # a lookup, no import: nothing taken
for m in {front!r} + {worker!r}:
    importlib.import_module(m)

def patched(fn):
    return getattr(fn, "_replayssm_original", None) is not None

mods = sys.modules
L = mods["vllm.model_executor.layers.mamba.mamba_mixer2"].MambaMixer2
G = mods["vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"].QwenGatedDeltaNetAttention
R = mods["vllm.v1.worker.gpu_model_runner"].GPUModelRunner
models = [mods["vllm.model_executor.models." + m].__dict__[c] for m, c in
          (("nemotron_h", "NemotronHForCausalLM"), ("qwen3_next", "Qwen3NextForCausalLM"),
           ("qwen3_5", "Qwen3_5ForConditionalGeneration"))]
print("RESULT " + json.dumps(dict(
    registered=ok,
    layers=[patched(c.__dict__[n]) for c in (L, G) for n in ("get_state_shape", "get_state_dtype",
                                                             "get_kv_cache_spec")],
    forwards=[patched(L.conv_ssm_forward), patched(G._forward_core)],
    once=[getattr(L.conv_ssm_forward, "_replayssm_original").__name__, L.get_state_shape.__name__],
    runner=patched(R.initialize_kv_cache_tensors),
    symbols=[getattr(_compat.load(), name) is not None for name in _compat._SYMBOLS],
    models=[patched(c.__dict__[n].__func__) for c in models for n in ("get_mamba_state_shape_from_config",
                                                                       "get_mamba_state_dtype_from_config",
                                                                       "get_mamba_state_copy_func")],
    copies=[[f.__name__ for f in c.get_mamba_state_copy_func()] for c in models])))
'''


def _tree(tmp_path):
    for rel, text in FILES.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for d in [p for p in tmp_path.rglob("*") if p.is_dir()]:
        (d / "__init__.py").touch()
    return str(tmp_path)


@pytest.mark.parametrize("before", [[], ["vllm.model_executor.layers.mamba.mamba_mixer2"]],
                         ids=["front-end", "layer-imported-first"])
def test_register_imports_nothing_of_vllm_and_patches_on_import(tmp_path, before):
    script = SCRIPT.format(tree=_tree(tmp_path), before=before, **IMPORTS)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in r.stdout.splitlines()
             if line.startswith(("FRONT ", "RESULT "))}
    assert "FRONT" in lines, r.stderr[-3000:]
    # the front-end: no vLLM module imported by register(), the runner's chain never run, CUDA untouched
    assert lines["FRONT"] == {"runner": False, "vllm": [], "cuda": False}
    assert r.returncode == 0, r.stderr[-3000:]
    got = lines["RESULT"]
    assert got["registered"] is True
    assert all(got["layers"]) and all(got["forwards"]) and got["runner"] and all(got["models"])
    assert got["symbols"] and all(got["symbols"])            # every run-time symbol resolves
    # prefix caching's copy between blocks: vLLM's conv copy, then a whole-slot copy of the running
    # block per replayssm tensor
    assert got["copies"] == [["get_conv_copy_spec"] + ["replayssm_committed_temporal_copy"] * 5] * 3
    # patched once: the original under the patch is vLLM's own method, not an earlier patch
    assert got["once"][0] == "conv_ssm_forward"
