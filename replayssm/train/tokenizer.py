"""A byte-level tokenizer as a Hugging Face `tokenizer.json`: token id = byte value for the 256
bytes, then three specials. transformers and vLLM load it from the model folder, so a model
trained on it needs nothing downloaded.

Built as a BPE model with the 256 byte symbols of GPT-2's byte-to-unicode map as its vocabulary
and no merges, behind a `ByteLevel` pre-tokenizer (bytes to those symbols, no regex split: with
no merges a split changes nothing) and a `ByteLevel` decoder (symbols back to bytes, then UTF-8).
"""
from __future__ import annotations

import json
from pathlib import Path

N_BYTES = 256
SPECIALS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>"}
PAD_ID, BOS_ID, EOS_ID = N_BYTES, N_BYTES + 1, N_BYTES + 2
VOCAB = N_BYTES + len(SPECIALS)


def byte_symbols() -> list:
    """GPT-2's printable stand-in for each byte, indexed by byte value (what `ByteLevel`
    pre-tokenization emits; the same table as `tokenizers`' own)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    sym, extra = {}, 0
    for b in range(N_BYTES):
        if b in keep:
            sym[b] = chr(b)
        else:
            sym[b] = chr(N_BYTES + extra)
            extra += 1
    return [sym[b] for b in range(N_BYTES)]


def build(model_max_length: int = 1 << 17):
    """The tokenizer as a transformers `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # specials after the bytes so that a byte's id is its value
    tok.add_special_tokens([SPECIALS["pad"], SPECIALS["bos"], SPECIALS["eos"]])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS["bos"],
                                 eos_token=SPECIALS["eos"], pad_token=SPECIALS["pad"],
                                 model_max_length=model_max_length, clean_up_tokenization_spaces=False)
    ids = hf.convert_tokens_to_ids(list(SPECIALS.values()))
    if ids != [PAD_ID, BOS_ID, EOS_ID] or len(hf) != VOCAB:
        raise RuntimeError(f"byte tokenizer: specials at {ids}, {len(hf)} tokens; "
                           f"expected {[PAD_ID, BOS_ID, EOS_ID]} and {VOCAB}")
    return hf


def save(folder, model_max_length: int = 1 << 17) -> list:
    """Write the tokenizer's files into `folder`; returns their paths."""
    folder = Path(folder)
    paths = [Path(p) for p in build(model_max_length).save_pretrained(str(folder))]
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    # transformers 5 names its class TokenizersBackend, which transformers 4 (and the vLLM
    # releases pinned to it) cannot resolve; both resolve PreTrainedTokenizerFast
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    special = folder / "special_tokens_map.json"
    special.write_text(json.dumps({f"{k}_token": v for k, v in SPECIALS.items()}, indent=2) + "\n")
    return sorted({str(p) for p in paths} | {str(special)})
