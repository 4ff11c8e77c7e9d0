"""Programmatic dependent launch: which launches take it, that a kernel compiled with it waits
for the kernel before it, and (on a Hopper GPU) that a chain of such launches inside a CUDA
graph computes exactly what the same chain computes without it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sluiceway_kernels._common as common
from sluiceway_kernels._common import pdl_options

ROOT = Path(__file__).resolve().parents[2]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def test_no_launch_takes_it_unless_asked_and_able(monkeypatch):
    monkeypatch.setattr(common, "PDL", False)
    assert pdl_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(common, "PDL", True)
    # on the CPU (interpreted or not) there is nothing to launch early
    assert pdl_options(torch.device("cpu")) == {"PDL": False}
    if HOPPER:
        assert pdl_options(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert pdl_options(torch.device("cuda")) == {"PDL": False}


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the test below launches it")
@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None, reason="triton without its CUDA backend")
def test_compiled_with_it_a_kernel_waits_for_the_one_before_it(tmp_path):
    """rms_norm and argmax_logsumexp compiled for sm_90 as their launchers ask, with PDL: their PTX
    waits for the previous grid and releases the next (``compile_check`` fails a variant where
    either is missing; without PDL, one where either is there, which test_compile_check runs)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    for only in ("_rms_norm_kernel", "_argmax_lse"):
        run = subprocess.run(
            [sys.executable, "-m", "sluiceway_kernels.compile_check", "--quick", "--arch", "90", "--pdl", "--only", only,
             "--jobs", "1"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        lines = [line for line in run.stdout.splitlines() if line.startswith("ok ")]
        assert lines and all(only in line for line in lines), run.stdout
        assert all("'PDL': True" in line for line in lines), run.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a GPU of compute capability 9.0 or later")
def test_a_graph_of_dependent_launches_equals_one_without(monkeypatch):
    """A decode layer's chain at batch 1, 24 layers deep, in one CUDA graph: each kernel reads
    what the one before it wrote, so a launch that ran ahead of its wait would read stale rows.
    Bit for bit the same outputs with and without PDL."""
    from sluiceway_kernels.rms_norm import rms_norm
    from sluiceway_kernels.silu_mul import silu_and_mul
    from sluiceway_kernels.small_m_linear import small_m_linear

    torch.manual_seed(0)
    hidden, inner, layers = 1024, 2048, 24
    w_in = [torch.randn(2 * inner, hidden, device="cuda", dtype=torch.bfloat16) * 0.03 for _ in range(layers)]
    w_out = [torch.randn(hidden, inner, device="cuda", dtype=torch.bfloat16) * 0.03 for _ in range(layers)]
    norm = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    x0 = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)

    def chain(x):
        residual = x
        for i in range(layers):
            h, residual = rms_norm(x, norm, 1e-6, residual=residual)
            x = small_m_linear(silu_and_mul(small_m_linear(h, w_in[i])), w_out[i])
        return x, residual

    monkeypatch.setattr(common, "PDL", False)
    eager = chain(x0.clone())
    results = []
    for pdl in (False, True):
        monkeypatch.setattr(common, "PDL", pdl)
        x = x0.clone()
        chain(x)  # compile outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(x)
        replays = []
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            replays.append(tuple(t.clone() for t in out))
        results.append(replays)
    for replays in results:
        for replay in replays:
            for got, want in zip(replay, eager):
                assert torch.equal(got, want)
