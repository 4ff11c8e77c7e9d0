"""Kernel tests run compiled on a CUDA GPU, else on the CPU through the Triton interpreter."""

import os
import sys

import pytest
import torch

# NOTE: Triton picks compiled or interpreted for every @triton.jit function (its own
# tl.max, tl.randint, ... included) when the function is defined, so TRITON_INTERPRET must be
# set before triton is first imported. An earlier conftest that imports the engine imports
# triton too; the suite's root conftest should then set it (this one covers `pytest tests/kernels`).
_TRITON_IMPORTED_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") is None
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seeded_single_thread():
    # The interpreter's tensors are tiny: extra intra-op threads only spin, badly so on a busy
    # two-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _interpreter_ready():
    if _TRITON_IMPORTED_EARLY and not torch.cuda.is_available():
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set, so kernels cannot run on this "
            "CPU machine: set it before anything imports triton (tests/conftest.py), or run "
            "`TRITON_INTERPRET=1 pytest tests/kernels`"
        )


@pytest.fixture(params=[False, True], ids=["waits", "early"])
def early_reads(request, monkeypatch):
    """Decode attention with its first tile read after the PDL wait and before it
    (``paged_decode_attention.EARLY_READS``): a test taking this fixture runs both ways."""
    import importlib

    module = importlib.import_module("sluiceway_kernels.paged_decode_attention")  # the package re-exports a function of that name
    monkeypatch.setattr(module, "EARLY_READS", request.param)
    return request.param
