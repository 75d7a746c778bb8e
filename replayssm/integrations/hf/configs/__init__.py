"""Shipped model configurations (JSON beside this file) and random-weight models built from
them: `nemotron3_nano_4b` and `qwen3_5_4b` (the real architectures; sources in each file's
`_source` entry), `nemotron3_super_slice` and `qwen3_5_122b_slice` (120B-class models at full
width with fewer layers, for the serving benchmark: `replayssm.bench.slices`; too large to build
here but on the meta device) and `tiny_<model_type>` for CPU tests.

The trained models (`trained_names()`: a main model and a draft per family, byte-level, trained
by `replayssm train`; each folder's README.md is its card) load by name through the same `build`:

    model = build("tiny_qwen3_5", dtype=torch.float32, seed=0)
    model = build("trained-qwen3-5")                  # trained weights; seed does not apply
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

_DIR = Path(__file__).parent
TRAINED_DIR = _DIR.parent / "trained"


def config_names() -> list:
    return sorted(p.stem for p in _DIR.glob("*.json"))


def trained_names() -> list:
    return sorted(p.name for p in TRAINED_DIR.glob("trained-*") if (p / "config.json").exists())


def trained_path(name: str) -> Path:
    """The folder of a shipped trained model (weights, config, tokenizer, card)."""
    path = TRAINED_DIR / name
    if not (path / "config.json").exists():
        raise ValueError(f"unknown trained model {name!r}; shipped: {trained_names()}")
    return path


def _check_name(name) -> None:
    if not isinstance(name, str):
        raise TypeError(f"a model name is a string, one of {config_names() + trained_names()}; got "
                        f"{type(name).__name__} {name!r:.60}")


def config(name: str, **overrides):
    """The transformers config of `name` (one of `config_names()` or `trained_names()`), with
    `overrides`; keys starting with `_` (notes, sources) are dropped."""
    _check_name(name)
    if name.startswith("trained-"):
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(str(trained_path(name)), **overrides)
    path = _DIR / f"{name}.json"
    if not path.exists():
        raise ValueError(f"unknown config {name!r}; shipped: {config_names()}")
    from transformers import AutoConfig
    values = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    values.update(overrides)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def build(name: str, *, dtype: torch.dtype = torch.float32, seed: int = 0, device=None, **overrides):
    """A causal LM of config `name` with random weights (seeded), in eval mode; for a name of
    `trained_names()`, the trained weights (`overrides` apply to its config)."""
    _check_name(name)
    from transformers import AutoModelForCausalLM
    if name.startswith("trained-"):
        path = trained_path(name)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **overrides)
        return model.to(device if device is not None else "cpu").eval()
    cfg = config(name, **overrides)
    device = torch.device(device) if device is not None else torch.device("cpu")
    # built where it runs: a 4B model's random initialisation on the host takes a minute
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()
