"""`replayssm train`: its options and what it runs."""
from __future__ import annotations

import argparse
import shlex

from . import models
from ..argtypes import positive_float as _positive_float
from ..argtypes import positive_int as _positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", required=True, choices=sorted(models.FAMILIES),
                   help="mamba2: NemotronH (Mamba-2 + attention); gdn: Qwen3.5 (Gated DeltaNet + "
                        "attention); kda: Kimi Linear (KDA + MLA)")
    p.add_argument("--draft", action="store_true", help="the family's draft model (2 layers, half width)")
    p.add_argument("--out", required=True, help="the model folder to write")
    p.add_argument("--steps", type=_positive_int, default=2000, help="optimizer steps (default %(default)s)")
    p.add_argument("--batch", type=_positive_int, default=16, help="windows per step (default %(default)s)")
    p.add_argument("--context", type=_positive_int, default=2048, help="bytes per window (default %(default)s)")
    p.add_argument("--lr", type=_positive_float, default=2e-3, help="peak learning rate (default %(default)s)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 5%% of --steps)")
    p.add_argument("--seed", type=int, default=0, help="weights and sampling follow it (default %(default)s)")
    p.add_argument("--eval-every", type=_positive_int, default=250,
                   help="held-out evaluation interval in steps; also at the end (default %(default)s)")
    p.add_argument("--eval-bytes", type=_positive_int, default=1 << 18,
                   help="held-out bytes scored (default %(default)s)")
    p.add_argument("--heldout-every", type=_positive_int, default=20,
                   help="every Nth stdlib file is held out (default %(default)s)")
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="the saved weights' type (default %(default)s)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda where available)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run(args, argv: list) -> int:
    from . import corpus, loop, save

    if args.device is not None and args.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise SystemExit(f"replayssm: error: --device {args.device}: CUDA is not available on this machine")
    try:
        data = corpus.load(heldout_every=args.heldout_every)
    except ValueError as e:
        raise SystemExit(f"replayssm: error: {e}") from None
    s = loop.Settings(family=args.family, draft=args.draft, steps=args.steps, batch=args.batch,
                      context=args.context, lr=args.lr, warmup=args.warmup, seed=args.seed,
                      eval_every=args.eval_every, eval_bytes=args.eval_bytes,
                      heldout_every=args.heldout_every, save_dtype=args.save_dtype, device=args.device,
                      progress=args.progress, command="replayssm " + " ".join(shlex.quote(a) for a in argv))
    try:
        model, record = loop.train(s, data)
    except ValueError as e:
        raise SystemExit(f"replayssm: error: {e}") from None
    paths = save.save(model, record, data.heldout, args.out)
    print(f"{record['model']}: {record['parameters']:,} parameters, {s.steps} steps in {record['seconds']} s; "
          f"bits per byte: train {record['train_bpb']:.4f}, held-out {record['heldout_bpb']:.4f}, "
          f"unigram {record['unigram_bpb']:.4f}")
    print(f"wrote {args.out}: " + ", ".join(sorted({p.rsplit('/', 1)[-1] for p in paths})))
    return 0
