"""The README's quick-start code runs as printed (on the CPU), so that the first thing a user
copies keeps working when the API moves."""
from __future__ import annotations

import pathlib
import re

import pytest

README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()


def _block(heading: str) -> str:
    found = re.findall(rf"### {re.escape(heading)}\n\n```python\n(.*?)```", README, re.S)
    assert len(found) == 1, f"README: one python block under '### {heading}' expected, found {len(found)}"
    return found[0]


def test_pool_quick_start_runs():
    ns: dict = {}
    exec(compile(_block("The pool"), "README.md (The pool)", "exec"), ns)
    pool, slots = ns["pool"], ns["slots"]
    assert tuple(ns["o"].shape) == (3, 4, 4, 128)                    # verify: [rows, T, HV, V]
    assert tuple(ns["state"].shape) == (3, 4, 128, 128)
    # one decode, then verify of 4 with 2 and 4 accepted: the cursors the README's comments say
    assert pool.cursor[slots[:2].long()].tolist() == [3, 5]


def test_transformers_quick_start_runs():
    pytest.importorskip("transformers")
    ns: dict = {}                 # the block makes its own prompt: nothing defined beforehand
    code = _block("transformers").replace("max_new_tokens=64", "max_new_tokens=8")   # CI's time
    exec(compile(code, "README.md (transformers)", "exec"), ns)
    prompt = ns["input_ids"].shape[1]
    assert prompt > 8 and ns["out"].shape == (1, prompt + 8)
