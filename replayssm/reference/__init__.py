"""The mathematics of SPEC.md in plain PyTorch: the oracle of every test and the CPU path."""
from .common import apply, expand_heads, l2norm, replay
from .gdn import GDNParams
from .kda import KDAParams
from .mamba2 import Mamba2Params

__all__ = ["Mamba2Params", "GDNParams", "KDAParams", "apply", "replay", "expand_heads", "l2norm"]
