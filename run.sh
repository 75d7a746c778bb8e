#!/usr/bin/env bash
# Set-up and entry point. Creates ./.venv on first use (torch, triton and test tools), then:
#   ./run.sh demo [args]    the main job: conventional vs ReplaySSM decoding, side by side
#   ./run.sh test [args]    the test suite (pytest)
#   ./run.sh <cmd> [args]   any other `replayssm` sub-command (traffic, bench, ...)
set -euo pipefail
cd "$(dirname "$0")"
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  # system site-packages: a machine that already has torch (e.g. a CUDA build) keeps it
  python3 -m venv --system-site-packages .venv
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
if ! "$PY" -c "import replayssm, triton, pytest, hypothesis, matplotlib" 2>/dev/null; then
  "$PY" -m pip install -q -e ".[test,bench]"
fi
cmd="${1:-demo}"
[ $# -gt 0 ] && shift
case "$cmd" in
  test) exec "$PY" -m pytest "$@" ;;
  *) exec "$PY" -m replayssm.cli "$cmd" "$@" ;;
esac
