"""Benchmark drivers (GPU): decode kernel sweeps. Scripts, not tests: CI never times."""
