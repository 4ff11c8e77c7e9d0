"""vLLM's offline examples (examples/vllm/, only the import changed) run as a vLLM user runs
them, and tensor-parallel ranks start from an unguarded script, ``python -c`` and a notebook
cell alike (gloo ranks on the CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "vllm"
TIMEOUT_S = 180


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> Path:
    return tiny_model_factory("llama", seed=1)


def run_python(args: list[str], model: Path, cwd: Path, stdin: str | None = None, **env: str) -> str:
    """Run ``python *args`` as a user would (the repository importable), return its stdout; fail on a bad exit."""
    full_env = dict(os.environ, MODEL=str(model), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    full_env.update(env)
    done = subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, env=full_env,
                          cwd=cwd, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"exit {done.returncode}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    return done.stdout


def test_basic_example_unguarded_at_tensor_parallel_2(model, tmp_path):
    out = run_python([str(EXAMPLES / "basic.py")], model, tmp_path, TP="2")
    assert out.count("Prompt:") == 4 and out.count("Output:") == 4
    assert "Prompt:    'The capital of France is'" in out


def test_chat_example(model, tmp_path):
    out = run_python([str(EXAMPLES / "chat.py")], model, tmp_path)
    prompts = [line for line in out.splitlines() if line.startswith("Prompt: ")]
    assert len(prompts) == 6 and all("Write an essay" in p for p in prompts)
    assert "\\nuser: Write an essay about the importance of higher education.\\nassistant:'" in out  # its own template
    assert "assistant\\nHigher education is'" in out  # continue_final_message leaves the message open


def test_generate_sampling_example(model, tmp_path):
    out = run_python([str(EXAMPLES / "generate_sampling.py")], model, tmp_path)
    lines = out.splitlines()
    for name in ("greedy", "nucleus", "stop", "penalties", "to the end"):
        assert sum(line.startswith(f"{name}: ") for line in lines) == 1, name
    assert sum(line.startswith("n=2: ") for line in lines) == 2
    to_end = next(line for line in lines if line.startswith("to the end: "))
    assert to_end.endswith("tokens, length)") and int(to_end.rsplit("(", 1)[1].split()[0]) > 240  # 256 - the prompt
    assert sum(line.startswith("logprobs: ") and "rank=" in line for line in lines) == 4


_TP_CELL = textwrap.dedent("""
    import os
    from engine import LLM, SamplingParams
    llm = LLM(os.environ["MODEL"], tensor_parallel_size=2, swap_space=0)
    out = llm.generate(["Queues hold"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    print(HOW, out[0].outputs[0].token_ids, flush=True)
    llm.shutdown()
""")

# NOTE: one process for both, to start the interpreter once: the cell runs first as this
# ``python -c`` program's own code, then the way a notebook kernel runs a cell -- compiled
# under a made-up file name in a ``__main__`` module that is no file on disk (as ipykernel does).
_BOTH = textwrap.dedent("""
    import sys, types
    cell = sys.stdin.read()
    HOW = "python -c"
    exec(compile(cell, "<string>", "exec"))
    main = types.ModuleType("__main__")
    main.HOW = "notebook cell"
    sys.modules["__main__"] = main
    exec(compile(cell, "<ipython-input-1>", "exec"), main.__dict__)
""")


def test_tensor_parallel_starts_from_python_c_and_a_notebook_cell(model, tmp_path):
    out = run_python(["-c", _BOTH], model, tmp_path, stdin=_TP_CELL).splitlines()
    assert [line.split(" [")[0] for line in out] == ["python -c", "notebook cell"]
    assert out[0].split(" [")[1] == out[1].split(" [")[1] and len(out[0].split(",")) == 4
