"""Training small hybrid models of the three families on the Python standard library's sources,
byte-level, for the demo, the tests and the precision study: `replayssm train`.

    corpus.py     the stdlib corpus, its held-out split and the facts a model card records
    tokenizer.py  the byte-level Hugging Face tokenizer (id = byte value, then pad/bos/eos)
    models.py     the models' configs (from the shipped tiny configs) and long-memory init
    loop.py       AdamW + warmup/cosine, random windows, held-out bits per byte, unigram baseline
    save.py       the model folder: weights, config, tokenizer, held-out bytes, card, loss plot
    command.py    the command's options
"""
