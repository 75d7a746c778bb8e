"""Peers' kernels timed beside ours in one run: loaded at run time from a checked-out copy of
their source (a path the user gives), never a dependency, none of their code in this tree.

- `vllm_stand_ins`: the small stand-ins for vLLM's package modules that a kernel file of vLLM
  (or of a fork of it) imports only for logging, configuration and device queries, so that the
  file can be loaded without vLLM's start-up.
- `fork`: the public ReplaySSM fork's speculative verify kernels (github.com/Johnny-Liou/ReplaySSM),
  driven as vLLM drives them (`replayssm bench verify --fork-src DIR`).
"""
