"""Stand-ins for the vLLM package modules that vLLM's Triton kernel files import for logging,
configuration and device queries only, and the loading of such a file from a source tree
(`import vllm` would need vLLM's whole start-up, and vLLM is no dependency of this project)."""
from __future__ import annotations

import importlib.util
import logging
import os
import sys
import types

import torch

# the stand-ins are packages, so that the loaded files can be registered beneath them
PACKAGES = ("vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.mamba",
            "vllm.model_executor.layers.mamba.ops", "vllm.model_executor.layers.fla",
            "vllm.model_executor.layers.fla.ops", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends")


def module(name: str, **attrs) -> types.ModuleType:
    """Register an empty package module `name` with `attrs` in `sys.modules`."""
    m = types.ModuleType(name)
    m.__path__ = []
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


class _Logger(logging.LoggerAdapter):
    def info_once(self, msg, *a, **k):
        self.info(msg, *a)

    def warning_once(self, msg, *a, **k):
        self.warning(msg, *a)


class _Platform:
    """What the kernel files ask of vLLM's `current_platform`."""

    @staticmethod
    def is_xpu():
        return False

    @staticmethod
    def get_device_name():
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"

    @staticmethod
    def is_device_capability_family(family: int) -> bool:
        # launch tables ask whether the card is of a family (100: Blackwell)
        major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 0
        return major == family // 10


def install() -> None:
    """Register the stand-ins (again: a real vLLM imported before is shadowed for this process)."""
    import triton
    import triton.language as tl

    for pkg in PACKAGES:
        module(pkg)
    module("vllm.envs", VLLM_TUNED_CONFIG_FOLDER=None)
    module("vllm._custom_ops")
    module("vllm.logger", init_logger=lambda name: _Logger(logging.getLogger(name), {}))
    module("vllm.platforms", current_platform=_Platform())
    module("vllm.triton_utils", HAS_TRITON=True, tl=tl, triton=triton)
    module("vllm.v1.attention.backends.utils", NULL_BLOCK_ID=0)


def load(src: str, rel: str) -> types.ModuleType:
    """The file `rel` (a path under `src`, e.g. `vllm/model_executor/...py`) loaded as the module
    its path names, over the stand-ins (`install` first)."""
    name = rel[:-3].replace("/", ".")
    spec = importlib.util.spec_from_file_location(name, os.path.join(src, rel))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
