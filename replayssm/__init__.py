"""ReplaySSM: cache SSM inputs, not state.

The public API: `SlotPool`, one layer's recurrent state for many sequences, and the families'
parameter classes `Mamba2Params`, `GDNParams`, `KDAParams`; `replayssm.formats` (number
formats), `replayssm.shapes` (model shapes), `replayssm.traffic` (the traffic model),
`replayssm.reference` (the mathematics), `replayssm.ops.<family>` (the kernels).
"""
from .pool import SlotPool, SlowReadWarning
from .reference import GDNParams, KDAParams, Mamba2Params

__version__ = "0.1.0"
__all__ = ["SlotPool", "SlowReadWarning", "Mamba2Params", "GDNParams", "KDAParams"]
