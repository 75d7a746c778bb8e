"""ReplaySSM: cache SSM inputs, not state."""
__version__ = "0.1.0"
