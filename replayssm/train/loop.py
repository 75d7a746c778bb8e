"""The training loop, the held-out evaluation in bits per byte, and the model folder it writes."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..bench.common import cpu_name
from . import corpus as corpus_mod
from . import models

LN2 = math.log(2.0)
# the held-out windows whose score is also recorded apart: a CPU test reloads the shipped weights
# and reproduces it in seconds, where the whole held-out split would take minutes
HEAD_WINDOWS = 2


@dataclass
class Settings:
    family: str = "mamba2"
    draft: bool = False
    steps: int = 2000
    batch: int = 16
    context: int = 2048
    lr: float = 2e-3
    warmup: int | None = None           # default: 5% of the steps
    min_lr_ratio: float = 0.1           # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.1
    seed: int = 0
    eval_every: int = 250
    eval_bytes: int = 1 << 18           # held-out bytes scored (the first ones of the split)
    heldout_every: int = 20
    save_dtype: str = "bfloat16"
    device: str | None = None
    progress: bool = True
    command: str = ""
    corpus_root: str | None = None      # the stdlib when None; tests pass a small folder
    extra: dict = field(default_factory=dict)   # config overrides (tests shrink the model)


def lr_at(step: int, s: Settings) -> float:
    """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""
    warm = s.warmup if s.warmup is not None else max(1, s.steps // 20)
    if step < warm:
        return s.lr * (step + 1) / warm
    frac = (step - warm) / max(1, s.steps - warm)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def sample_batch(data: torch.Tensor, batch: int, context: int, gen: torch.Generator) -> torch.Tensor:
    """`[batch, context + 1]` int64 windows at random offsets of `data` (uint8 bytes)."""
    if data.numel() < context + 1:
        raise ValueError(f"training split has {data.numel()} bytes, fewer than context + 1 = {context + 1}")
    starts = torch.randint(0, data.numel() - context, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(context + 1)
    return data[idx].long()


def eval_windows(data: torch.Tensor, context: int) -> torch.Tensor:
    """`data` cut into `[n, context + 1]` windows overlapping by one byte, so that every byte after
    the first is a target exactly once (a tail shorter than a window is dropped)."""
    n = (data.numel() - 1) // context
    if n < 1:
        raise ValueError(f"{data.numel()} held-out bytes: fewer than context + 1 = {context + 1}")
    idx = torch.arange(n)[:, None] * context + torch.arange(context + 1)
    return data[idx].long()


def _autocast(device: torch.device):
    # bf16 autocast on CUDA (the models' matmuls in bf16, the recurrences as transformers casts
    # them); fp32 on the CPU, where bf16 is slow and the tests want exact reproducibility
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" \
        else torch.autocast("cpu", enabled=False)


def _loss(model, windows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=windows[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


@torch.no_grad()
def heldout_bpb(model, windows: torch.Tensor, batch: int, device: torch.device, fp32: bool = False) -> float:
    """Mean bits per byte over every target of `windows` (equal-length windows, so the mean of
    the batches' means weighted by their size is the mean over targets). `fp32`: no autocast,
    for the recorded figure that a CPU test reproduces from the saved folder."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with (torch.autocast(device.type, enabled=False) if fp32 else _autocast(device)):
        for i in range(0, windows.shape[0], batch):
            w = windows[i:i + batch].to(device)
            total += _loss(model, w).item() * w.shape[0]
            count += w.shape[0]
    model.train(was_training)
    return total / count / LN2


def unigram_bpb(train: torch.Tensor, targets: torch.Tensor) -> float:
    """Bits per byte of the byte-frequency model of `train` (add-one smoothed) on `targets`."""
    counts = torch.bincount(train.long(), minlength=256).double() + 1
    logp = counts.log() - counts.sum().log()
    return float(-logp[targets.reshape(-1).long()].mean() / LN2)


def _param_groups(model, weight_decay: float):
    # decay matrices only: norms, biases and the recurrences' A_log / dt_bias / D keep their scale
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def _round_to(model, dtype: torch.dtype):
    """The weights as they will be saved (rounded to `dtype`), kept in fp32 for evaluation."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())


def train(s: Settings, data: corpus_mod.Corpus | None = None):
    """Train one model; returns (model, record). `record` holds the corpus facts, the settings,
    the loss curve and the final train / held-out bits per byte of the weights as saved."""
    from tqdm.auto import tqdm

    device = torch.device(s.device) if s.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if data is None:
        data = corpus_mod.load(s.corpus_root, heldout_every=s.heldout_every)
    train_t = torch.frombuffer(bytearray(data.train), dtype=torch.uint8)
    held_t = torch.frombuffer(bytearray(data.heldout[:s.eval_bytes]), dtype=torch.uint8)
    held_w = eval_windows(held_t, s.context)
    baseline = unigram_bpb(train_t, held_w[:, 1:])

    model = models.build(s.family, s.draft, seed=s.seed, **s.extra).to(device)
    opt = torch.optim.AdamW(_param_groups(model, s.weight_decay), lr=s.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(s.seed)
    curve, evals = [], []
    t0 = time.time()
    bar = tqdm(range(s.steps), disable=not s.progress, desc=models.model_name(s.family, s.draft), unit="step")
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s)
        x = sample_batch(train_t, s.batch, s.context, gen).to(device)
        with _autocast(device):
            loss = _loss(model, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bpb = loss.item() / LN2
        curve.append(bpb)
        if (step + 1) % s.eval_every == 0 and step + 1 < s.steps:
            evals.append((step + 1, heldout_bpb(model, held_w, s.batch, device)))
            bar.set_postfix(train=f"{bpb:.3f}", heldout=f"{evals[-1][1]:.3f}", unigram=f"{baseline:.3f}")
        else:
            bar.set_postfix(train=f"{bpb:.3f}")
    seconds = time.time() - t0
    _round_to(model, getattr(torch, s.save_dtype))
    final = heldout_bpb(model, held_w, s.batch, device, fp32=True)
    head = heldout_bpb(model, held_w[:HEAD_WINDOWS], s.batch, device, fp32=True)
    evals.append((s.steps, final))
    tail = curve[-max(1, min(50, len(curve) // 10)):]
    record = {
        "model": models.model_name(s.family, s.draft), "family": s.family, "draft": s.draft,
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus": data.facts, "settings": {k: v for k, v in vars(s).items() if k not in ("progress", "extra")},
        "config_overrides": s.extra, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU: {cpu_name()}",
        "torch": torch.__version__, "seconds": round(seconds, 1),
        "train_bpb": sum(tail) / len(tail), "heldout_bpb": final, "unigram_bpb": baseline,
        "heldout_head_bpb": head,
        "eval": {"bytes": int(held_w.shape[0] * s.context + 1), "context": s.context,
                 "head_windows": min(HEAD_WINDOWS, int(held_w.shape[0])),
                 "file": "heldout.bin", "weights_dtype": s.save_dtype, "compute_dtype": "float32"},
        "curve": curve, "heldout_curve": evals,
    }
    return model, record
