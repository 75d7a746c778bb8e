import os

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter; the switch is read when kernels are
# defined, so it is set before any test module imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """`||out - ref|| / ||ref||` in float64 (0 when both are zero)."""
    out, ref = out.double(), ref.double()
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else num


@pytest.fixture
def rel():
    return rel_err
