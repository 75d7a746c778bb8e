"""The model folder: safetensors + config.json, the byte tokenizer's files, the held-out bytes
it was scored on, `training.json` (the full record), a model card and the loss curve."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from . import tokenizer


def card(record: dict) -> str:
    c, s = record["corpus"], record["settings"]
    kind = "draft model" if record["draft"] else "model"
    again = record["eval"].get("rescored")
    # a model trained on fused kernels: its figures are those of a scoring run without them
    again = "" if not again else (f" Trained on flash-linear-attention's kernels (held-out {again['trained_with']:.4f} "
                                  f"there); scored again with {again['by']}.")
    return f"""# {record['model']}

A small hybrid {kind} of the `{record['family']}` family ({record['parameters']:,} parameters),
trained by `replayssm train` on bytes of Python source, for ReplaySSM's demo, tests and
precision study. Byte-level vocabulary: token id = byte value, then `<pad>` `<s>` `</s>`
(256-258); the tokenizer files are in this folder.

## Corpus

{c['source']} of {c['implementation']} {c['python']}: {c['files']} files, {c['bytes']:,} bytes,
sorted by path, joined with a blank line; SHA-256 (paths and contents) `{c['sha256']}`.
Every {c['heldout_every']}th file is held out: {c['train_files']} training files
({c['train_bytes']:,} bytes), {c['heldout_files']} held-out files ({c['heldout_bytes']:,} bytes).

## Training

{s['steps']} steps of {s['batch']} windows of {s['context']} bytes, AdamW (lr {s['lr']}, warmup then
cosine decay), seed {s['seed']}, on {record['device']} in {record['seconds']} s.

| bits per byte | |
|---|---|
| training (mean of the last steps) | {record['train_bpb']:.4f} |
| held-out ({record['eval']['bytes']:,} bytes, `heldout.bin`) | {record['heldout_bpb']:.4f} |
| byte-frequency (unigram) model on the same bytes | {record['unigram_bpb']:.4f} |

The held-out figure is of the weights as saved ({record['eval']['weights_dtype']}) computed in
float32, over `heldout.bin` cut into windows of {record['eval']['context']} bytes overlapping by one.{again}

    {record['settings']['command']}
"""


def plot(record: dict, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(record["curve"]) + 1), record["curve"], lw=0.6, alpha=0.6, label="training batch")
    if record["heldout_curve"]:
        xs, ys = zip(*record["heldout_curve"])
        ax.plot(xs, ys, "o-", label="held-out")
    ax.axhline(record["unigram_bpb"], ls="--", color="gray", label="unigram (byte frequency)")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_title(record["model"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def save(model, record: dict, heldout: bytes, out) -> list:
    """Write the folder `out`; returns the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, record["eval"]["weights_dtype"])
    model.to(dtype=dtype).save_pretrained(str(out))
    model.float()
    paths = sorted(str(p) for p in out.glob("*.safetensors")) + [str(out / "config.json")]
    paths += tokenizer.save(out)
    (out / "heldout.bin").write_bytes(heldout[:record["eval"]["bytes"]])
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "README.md").write_text(card(record))
    paths += [str(out / n) for n in ("heldout.bin", "training.json", "README.md")]
    png = plot(record, out / "loss.png")
    if png is not None:
        paths.append(str(png))
    return paths


def score(folder, *, batch: int = 8, head: bool = False, device="cpu") -> float:
    """Held-out bits per byte of the saved folder, loaded with stock transformers classes in
    float32, on its `heldout.bin` as `training.json` describes: the figure its card records
    (`heldout_bpb`), or with `head` that of the first windows only (`heldout_head_bpb`)."""
    from transformers import AutoModelForCausalLM

    from .loop import eval_windows, heldout_bpb
    folder, device = Path(folder), torch.device(device)
    record = json.loads((folder / "training.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(device)
    data = torch.frombuffer(bytearray((folder / "heldout.bin").read_bytes()), dtype=torch.uint8)
    windows = eval_windows(data, record["eval"]["context"])
    if head:
        windows = windows[:record["eval"]["head_windows"]]
    return heldout_bpb(model, windows, batch, device, fp32=True)


def rescore(folder, *, device="cpu") -> dict:
    """Score the saved folder again (`score`, whole and head) in this process and write the
    figures into its `training.json` and card. For models trained with fused kernels
    (flash-linear-attention's, whose fp32 products may run on TF32 tensor cores): rescored in a
    process without them, the recorded figures are those of transformers' PyTorch paths, which
    a CPU reproduces. Returns the updated record."""
    folder = Path(folder)
    record = json.loads((folder / "training.json").read_text())
    before = record["heldout_bpb"]
    record["heldout_bpb"] = score(folder, device=device)
    record["heldout_head_bpb"] = score(folder, head=True, device=device)
    record["eval"]["rescored"] = {"trained_with": before, "by": "transformers' PyTorch paths, float32"}
    (folder / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    (folder / "README.md").write_text(card(record))
    return record
