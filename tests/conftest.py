"""Test-wide settings: CPU, f32 matmuls at full precision, strict dtype promotion, one xdist worker per core."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One worker per core: a second torch (OpenMP) or BLAS thread per worker, or per process it starts, only
    # waits for a busy core.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Mixed dtypes must be cast on purpose: an implicit int/float or f32/bf16 promotion raises.
jax.config.update("jax_numpy_dtype_promotion", "strict")

MAX_WORKERS = 4  # each worker holds its own JAX, torch and copies of the default model (a few GB)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per core, up to MAX_WORKERS, on the CPU; no workers when
    JAX may use a GPU, whose memory each process would preallocate. PYTEST_XDIST_AUTO_NUM_WORKERS wins."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    if os.environ["JAX_PLATFORMS"] != "cpu":
        return 0
    return min(len(os.sched_getaffinity(0)), MAX_WORKERS)


@pytest.fixture
def interpret_on_the_cpu(request):
    """For the kernel tests' modules (`pytestmark = pytest.mark.usefixtures("interpret_on_the_cpu")`): tests
    of a class whose INTERPRET is True, and module-level tests, run on the CPU device, also on a GPU host.
    There Mosaic GPU's interpreter, run from a GPU executable, loses its shared state between its
    io_callbacks (AssertionError in gpu_callbacks._get_shared_memory)."""
    if not getattr(request.instance, "INTERPRET", True):
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield
