#!/usr/bin/env bash
# Set-up and entry point. Creates ./.venv on first use (torch, triton and test tools), then:
#   ./run.sh demo [args]            the main job: conventional vs ReplaySSM decoding, side by side
#   ./run.sh test [pytest args]     the test suite (pytest, one worker per core)
#   ./run.sh <cmd> [args]           any other `replayssm` sub-command (traffic, bench, ...)
#
# The venv is isolated from the system's site-packages, so the tests run with the pinned
# pytest/hypothesis of pyproject.toml's `test` extra and no plugins the system happens to have.
# REPLAYSSM_SYSTEM_TORCH=1 (read only when .venv is created) makes it see the system
# site-packages instead, so a machine that already has a CUDA build of torch reuses it rather
# than installing torch into the venv; system pytest plugins are then visible too.
# To switch an existing .venv between the two, remove .venv and run again.
set -euo pipefail
cd "$(dirname "$0")"
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  if ! command -v python3 >/dev/null 2>&1; then
    echo "run.sh: python3 not found on PATH; replayssm needs Python >= 3.10" >&2
    exit 1
  fi
  if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "run.sh: python3 is $(python3 -c 'import platform; print(platform.python_version())')" \
         "($(command -v python3)); replayssm needs Python >= 3.10" >&2
    exit 1
  fi
  venv_args=()
  if [ "${REPLAYSSM_SYSTEM_TORCH:-0}" = 1 ]; then
    venv_args=(--system-site-packages)
  fi
  # a half-made venv (e.g. no ensurepip) would pass the -x test above on the next run
  if ! python3 -m venv ${venv_args[@]+"${venv_args[@]}"} .venv; then
    rm -rf .venv
    echo "run.sh: 'python3 -m venv .venv' failed (on Debian/Ubuntu: install python3-venv)" >&2
    exit 1
  fi
  # marks a venv that sees the system on purpose, so that the note below is for old ones only
  [ ${#venv_args[@]} -eq 0 ] || : > .venv/.replayssm-system-torch
elif [ ! -e .venv/.replayssm-system-torch ] \
     && grep -qs '^include-system-site-packages *= *true' .venv/pyvenv.cfg; then
  echo "run.sh: note: .venv sees the system site-packages (made by an older run.sh);" \
       "remove .venv for an isolated one" >&2
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
if ! "$PY" -c "import replayssm, triton, pytest, xdist, hypothesis, matplotlib, transformers, tqdm" 2>/dev/null; then
  "$PY" -m pip install -q -e ".[test,bench]"
fi
cmd="${1:-demo}"
[ $# -gt 0 ] && shift
case "$cmd" in
  # the suite spread over the machine's cores (pytest-xdist; an idle worker takes tests queued
  # for the other, so that the minute-long interpreter cases do not leave one core waiting at
  # the end); `-n 0` after `test` runs it in one process
  test) exec "$PY" -m pytest -n auto --dist worksteal "$@" ;;
  *) exec "$PY" -m replayssm.cli "$cmd" "$@" ;;
esac
