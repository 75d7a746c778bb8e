"""The slot pool: `SlotPool` (pool.py) holds one layer's ReplaySSM state for many sequences in
a `Layout` (layout.py), validates every call at one place (validate.py) and runs each
operation on the kernels registered for it (backends.py) or on the reference."""
from .layout import Layout
from .pool import SlotPool, SlowReadWarning

__all__ = ["SlotPool", "Layout", "SlowReadWarning"]
