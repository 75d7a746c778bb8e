"""One table of the recurrent layers' shapes of the models in SPEC section 8, for every module
(traffic model, kernels' tables, benchmarks, tests).

Vocabulary, the same in every family: `HV` value heads, `Hk` key heads (Mamba-2 groups, GDN/KDA
key/query heads), `HG = HV // Hk` value heads per key head, `V` the value dim of a head's
`[V, K]` state (Mamba-2's head dim P), `K` the key dim (Mamba-2's state dim N).
"""
from __future__ import annotations

from typing import NamedTuple


class Shape(NamedTuple):
    """A recurrent layer's shape: `family` ("mamba2", "gdn", "kda"), `HV`, `Hk`, `V`, `K`."""

    family: str
    HV: int
    Hk: int
    V: int
    K: int

    @property
    def HG(self) -> int:
        """Value heads per key head."""
        return self.HV // self.Hk


MODEL_SHAPES = {
    "nemotron3-nano-4b": Shape("mamba2", 96, 8, 80, 128),
    "nemotron3-super": Shape("mamba2", 128, 8, 64, 128),
    "nemotron3-nano-30b": Shape("mamba2", 64, 8, 64, 128),
    "qwen3.5-4b": Shape("gdn", 32, 16, 128, 128),
    "qwen3.5-122b": Shape("gdn", 64, 16, 128, 128),
    "qwen3-next-80b": Shape("gdn", 32, 16, 128, 128),
    "kimi-linear-48b": Shape("kda", 32, 32, 128, 128),
}


def shape(name: str) -> Shape:
    """The shape of a model's recurrent layers by name; ValueError naming the known ones."""
    try:
        return MODEL_SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; expected one of {sorted(MODEL_SHAPES)}") from None


def of_family(family: str) -> dict:
    """`{name: Shape}` of one family's models."""
    return {n: s for n, s in MODEL_SHAPES.items() if s.family == family}


def parse(spec: str) -> Shape:
    """A model's name, or `family/HV/Hk/V/K` for a shape of one's own (e.g. `mamba2/112/8/64/128`:
    112 heads of 64 x 128 in 8 groups)."""
    if spec in MODEL_SHAPES:
        return MODEL_SHAPES[spec]
    parts = spec.split("/")
    if len(parts) == 5 and parts[0] in ("mamba2", "gdn", "kda"):
        try:
            HV, Hk, V, K = (int(p) for p in parts[1:])
        except ValueError:
            HV = 0
        if HV > 0 and Hk > 0 and V > 0 and K > 0 and HV % Hk == 0:
            return Shape(parts[0], HV, Hk, V, K)
    raise ValueError(f"shape {spec!r}: expected one of {sorted(MODEL_SHAPES)} or family/HV/Hk/V/K "
                     "with family mamba2, gdn or kda and Hk dividing HV (e.g. mamba2/112/8/64/128)")
