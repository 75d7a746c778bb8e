"""Triton kernels, one sub-package per recurrence family (`mamba2`, `gdn`, `kda`).

Sub-packages are imported on demand: importing `replayssm.ops` does not import Triton.
"""
