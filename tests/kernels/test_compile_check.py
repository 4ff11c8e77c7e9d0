"""The interpreter forgives what the compiler rejects: compile the launchers' kernels for sm_90."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel tests compile everything anyway")
@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None, reason="triton without its CUDA backend"
)
def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    run = subprocess.run(
        [sys.executable, "-m", "kernels.compile_check", "--quick", "--quiet", "--arch", "90"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
