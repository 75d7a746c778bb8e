"""Pieces every family's kernels share: launch tables, the cursor hand-off, checkpoint tiles,
Gluon helpers."""
