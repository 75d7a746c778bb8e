import inspect
import os

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter; the switch is read when kernels are
# defined, so it is set before any test module imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _speed_up_interpreter():
    """Test speed only. The CPU interpreter re-patches `triton.language` on every call of a
    nested @jit function (tl.sum, tl.cumsum, tl.sigmoid ...), which is most of its run time.
    While the enclosing launch's patch is active the re-patch is a no-op, so skip it then."""
    try:
        import triton.language as tl
        import triton.runtime.interpreter as interp
        orig = interp._patch_lang
    except (ImportError, AttributeError):
        return
    if getattr(orig, "_replayssm_fast", False):
        return

    class _Noop:
        def restore(self):
            pass

    def fast(fn):
        langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        if langs and all(not tl.core.is_builtin(getattr(m, "load", None)) for m in langs):
            return _Noop()
        return orig(fn)

    fast._replayssm_fast = True
    interp._patch_lang = fast


if os.environ.get("TRITON_INTERPRET") == "1":
    _speed_up_interpreter()


def pytest_configure(config):
    # under pytest-xdist the workers share the cores (the interpreter's numpy work is small)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // workers)))


def ci_subset() -> bool:
    """Whether this run is CI's representative subset (CI=true, REPLAYSSM_SLOW unset)."""
    return os.environ.get("CI", "").lower() in ("1", "true") and os.environ.get("REPLAYSSM_SLOW") != "1"


def interpreter_windows(n: int, ci_divisor: int = 2) -> int:
    """Windows for a long-horizon accuracy case on the CPU interpreter: `n`, or `n / ci_divisor`
    in CI's subset (still a dozen flushes per slot or more; the GPU cases run `n` at the real
    shapes), where each such case took over a minute of CI's 20."""
    return n // ci_divisor if ci_subset() and not torch.cuda.is_available() else n


def pytest_collection_modifyitems(config, items):
    # CI (CI=true, a 2-core machine) runs a representative subset of the interpreter cases:
    # those marked `slow` (more formats, roundings or shapes of a check already run) are
    # skipped there unless REPLAYSSM_SLOW=1
    if not ci_subset():
        return
    skip = pytest.mark.skip(reason="slow interpreter case: CI runs the representative subset (REPLAYSSM_SLOW=1 runs it)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """`||out - ref|| / ||ref||` in float64 (0 when both are zero)."""
    out, ref = out.double(), ref.double()
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else num


@pytest.fixture
def rel():
    return rel_err


def spy_launches(monkeypatch, module, name: str, record) -> None:
    """Wrap the kernel `module.<name>` (launched as `kernel[grid](...)`) so that each launch first
    calls `record(kwargs)`: what a switch's GPU test asserts reached the kernel."""
    kernel = getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                record(kw)
                return kernel[grid](*args, **kw)
            return launch
    monkeypatch.setattr(module, name, Spy())
