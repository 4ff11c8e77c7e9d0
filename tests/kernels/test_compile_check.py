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
@pytest.mark.timeout(600)  # 74 s alone on the 2-core CI machine, 139 s beside the suite's other process
def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    run = subprocess.run(
        [sys.executable, "-m", "sluiceway_kernels.compile_check", "--quick", "--quiet", "--arch", "90"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert run.returncode == 0, run.stdout + run.stderr



@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None, reason="triton without its CUDA backend"
)
def test_step_shapes_reuse_one_compiled_variant():
    """Batch size, block-table width, split count and where a step's int32 metadata sits in its
    packed buffer change every step; none may pick a new kernel variant, or a long run compiles
    kernels in the middle of serving (one GPU run compiled 13 and lost seconds to it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "sluiceway_kernels.compile_check", "--step-shapes"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "_decode_kernel" in run.stdout and "_prefill_kernel" in run.stdout, run.stdout
