"""`replayssm tune` without a GPU: its candidates, how it turns timings into table entries, and
installing those entries where the kernels and the pool read them."""
import json

import pytest
import torch

from replayssm import SlotPool, shapes
from replayssm.bench import tune
from replayssm.ops import gdn, mamba2, tuned
from replayssm.testing import make_params


def test_candidates_fit_the_shape():
    s = shapes.parse("mamba2/6/3/24/48")
    conv = tune.conventional_candidates(s)
    assert conv and all((s.HG * s.V) % c["BV"] == 0 for c in conv)       # blocks within a group
    assert {c["num_warps"] for c in conv} == {1, 2, 4, 8}
    assert all(c["BV"] <= 2 * s.V or c["BV"] == 16 for c in tune.windowed_candidates(s))
    with pytest.raises(ValueError, match="family/HV/Hk/V/K"):
        shapes.parse("mamba2/6/4/24/48")                                  # 4 does not divide 6


def test_choose_keeps_the_eager_step_up_to_the_first_window_win():
    s = shapes.parse("gdn/6/2/40/24")
    c = lambda bv, us: ({"BV": bv, "num_warps": 1}, us)                   # noqa: E731
    per_batch = [(1, c(8, 3.0), c(8, 2.9), None), (4, c(16, 5.0), c(8, 4.8), c(16, 5.5)),
                 (16, c(32, 9.0), c(8, 9.5), c(32, 7.0)), (64, c(32, 30.0), c(8, 31.0), c(64, 20.0))]
    e = tune.choose(s, "gdn/6/2/40/24", per_batch, window=16, record_dtype=torch.bfloat16,
                    input_dtype=torch.bfloat16)
    assert e["eager_max_batch"] == 4
    assert [b for b, _ in e["eager"]] == [1, 4]
    assert e["replay"] == [[16, {"BV": 32, "num_warps": 1}], [1 << 30, {"BV": 64, "num_warps": 1}]]
    assert e["conventional"][-1][0] == 1 << 30


def test_installed_entries_reach_the_kernels_and_the_pool(tmp_path):
    entry = {"family": "mamba2", "HV": 10, "Hk": 5, "V": 12, "K": 20, "eager_max_batch": 3,
             "eager": [[1, {"BV": 4, "num_warps": 1}], [3, {"BV": 8, "num_warps": 2}]],
             "replay": [[1 << 30, {"BV": 16, "num_warps": 1, "recmask": False}]],
             "conventional": [[1 << 30, {"BV": 8, "num_warps": 1}]]}
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"tuned": entry}))
    tuned.install(path)
    assert mamba2.eager_max_batch(10, 12, 20, 5) == 3
    assert mamba2.configs.conventional_config(10, 12, 20, 5, batch=7)["BV"] == 8
    pool = SlotPool(make_params("mamba2", 10, 20), 4, 12, 20, 5)
    assert pool.eager_max_batch == 3
    # GDN: an empty eager list means never the eager step
    tuned.install({"family": "gdn", "HV": 6, "Hk": 3, "V": 40, "K": 56, "eager": [],
                   "replay": [[1 << 30, {"BV": 16, "num_warps": 1}]], "conventional": []})
    assert gdn.eager_max_batch(6, 40, 56, 3) == 0
    with pytest.raises(ValueError, match="tuned entry"):
        tuned.install({"family": "gdn"})
