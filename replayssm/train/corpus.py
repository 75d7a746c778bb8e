"""The training text: the Python standard library's sources of the running interpreter, a
corpus every machine has, so that nothing is downloaded and anyone can rebuild it (its
Python version and SHA-256 go into each model card)."""
from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# third-party code installed beside the stdlib is not the stdlib, and differs between machines
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# the test suites hold deliberately odd files (bad encodings, syntax errors) and triple the size
_TEST_DIRS = {"test", "tests", "idle_test"}
# files are joined with a blank line so that no file's last line runs into the next one's first
SEPARATOR = b"\n\n"


@dataclass
class Corpus:
    """The two splits as bytes and the facts a model card records."""
    train: bytes
    heldout: bytes
    facts: dict


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None, *, with_tests: bool = False) -> list:
    """The `.py` files under `root` (default: the stdlib), sorted by their path relative to it
    (POSIX form, so the order is the same on every file system)."""
    root = Path(root) if root is not None else stdlib_root()
    skip = _SKIP_DIRS if with_tests else _SKIP_DIRS | _TEST_DIRS
    files = [p for p in root.rglob("*.py")
             if p.is_file() and not skip & set(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load(root: Path | None = None, *, heldout_every: int = 20, with_tests: bool = False) -> Corpus:
    """Every `heldout_every`-th file (by sorted position, starting at the first) is held out;
    whole files, so no held-out text also appears in training."""
    if heldout_every < 2:
        raise ValueError(f"heldout_every must be at least 2, got {heldout_every}")
    root = Path(root) if root is not None else stdlib_root()
    files = source_files(root, with_tests=with_tests)
    if len(files) < heldout_every:
        raise ValueError(f"{root}: {len(files)} .py files, fewer than heldout_every={heldout_every}")
    train, held = [], []
    whole = hashlib.sha256()
    for i, p in enumerate(files):
        data = p.read_bytes()
        (held if i % heldout_every == 0 else train).append(data)
        # hashed file by file with its path: a renamed or moved file changes the hash too
        whole.update(p.relative_to(root).as_posix().encode() + b"\0" + data + b"\0")
    train_b, held_b = SEPARATOR.join(train), SEPARATOR.join(held)
    facts = {
        "source": "the Python standard library's .py files" + ("" if with_tests else " (test directories excluded)"),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "files": len(files), "bytes": sum(len(b) for b in train) + sum(len(b) for b in held),
        "sha256": whole.hexdigest(),
        "heldout_every": heldout_every,
        "train_files": len(train), "train_bytes": len(train_b),
        "train_sha256": hashlib.sha256(train_b).hexdigest(),
        "heldout_files": len(held), "heldout_bytes": len(held_b),
        "heldout_sha256": hashlib.sha256(held_b).hexdigest(),
    }
    return Corpus(train_b, held_b, facts)
