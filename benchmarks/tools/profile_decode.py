"""Run one window of the replay and conventional kernels for a shape, for a profiler (ncu);
an optional third argument is a JSON replay config (overrides of the table's), an optional
fourth the token inputs' dtype (bfloat16, the default, or float32).

    ncu --clock-control none -k regex:decode_kernel --launch-skip 8 --launch-count 2 \
        python benchmarks/tools/profile_decode.py nemotron3-super 256 '{"warpsum": true}'
"""
import json
import sys

import torch

from replayssm.bench.decode import Case

shape = sys.argv[1] if len(sys.argv) > 1 else "nemotron3-super"
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 256
config = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
input_dtype = getattr(torch, sys.argv[4]) if len(sys.argv) > 4 else torch.bfloat16
case = Case(shape, batch, 16, input_dtype=input_dtype)
for _ in range(2):
    case.replay_window(config)
    case.conventional_window()
torch.cuda.synchronize()
print("ok", shape, batch)
