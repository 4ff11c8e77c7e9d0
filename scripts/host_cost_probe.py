"""Host cost of one eager forward on this CPU, every kernel launch stubbed out.

A 32-layer Llama of tiny width (so torch's own work is small) runs the Triton attention
backend and the Triton norm and SiLU launchers under ``TRITON_INTERPRET=1``, with each Triton
launch replaced by a counter and, with ``--stub-linear``, each matmul by an empty tensor: what
is left is our launchers' Python (argument checks, grids, metadata) and the model's module
plumbing: the host time an eager prompt step pays on top of Triton's and cuBLAS's own launch
costs, which need a GPU to see.

    python scripts/host_cost_probe.py --tokens 256 --stub-linear [--repo PATH] [--profile]

``--repo`` times another checkout (an A/B on one machine, interleaved by the caller).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
parser = argparse.ArgumentParser()
parser.add_argument("--tokens", type=int, default=256)
parser.add_argument("--layers", type=int, default=32)
parser.add_argument("--iters", type=int, default=30)
parser.add_argument("--stub-linear", action="store_true", help="matmuls return empty tensors")
parser.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
parser.add_argument("--profile", action="store_true", help="then print the top 25 functions by own time")
args = parser.parse_args()
sys.path.insert(0, args.repo)

import torch  # noqa: E402
import transformers  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

import engine.layers.activation as activation  # noqa: E402
import engine.layers.layernorm as layernorm  # noqa: E402
from engine.models.llama import LlamaForCausalLM  # noqa: E402
from engine.runner.attention.metadata import AttentionMetadata, ForwardContext  # noqa: E402
from engine.runner.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from sluiceway_kernels.rms_norm import rms_norm  # noqa: E402
from sluiceway_kernels.silu_mul import silu_and_mul  # noqa: E402

launches = [0]


def counted_launch(self, *_args, **_kwargs):
    launches[0] += 1


interpreter.InterpretedFunction.run = counted_launch
layernorm.rms_norm_ref = rms_norm  # the Triton launchers on CPU too (the layers pick them on CUDA)
activation.silu_and_mul_ref = silu_and_mul
if args.stub_linear:
    import engine.layers.linear as linear

    class _NoMatmul:
        @staticmethod
        def linear(x, w, b=None):
            return x.new_empty(x.shape[0], w.shape[0])

    linear.F = _NoMatmul

config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                                  num_hidden_layers=args.layers, vocab_size=512, max_position_embeddings=8192)
model = LlamaForCausalLM(config, dtype=torch.float32)
tokens, block = args.tokens, 16
blocks = -(-tokens // block)
caches = [(torch.zeros(blocks, block, 2, 32), torch.zeros(blocks, block, 2, 32)) for _ in range(args.layers)]
meta = AttentionMetadata(
    slot_mapping=torch.arange(tokens), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
    context_lens=torch.tensor([tokens], dtype=torch.int32), query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
    max_query_len=tokens, max_context_len=tokens, decode_only=False)
ids, positions = torch.zeros(tokens, dtype=torch.long), torch.arange(tokens)


def forward() -> None:
    with torch.inference_mode():
        model(ids, positions, ForwardContext(meta, caches, TritonAttentionBackend()))


for _ in range(3):
    forward()
launches[0] = 0
start = time.perf_counter()
for _ in range(args.iters):
    forward()
seconds = (time.perf_counter() - start) / args.iters
print(f"forward host {1e3 * seconds:.2f} ms, {launches[0] / args.iters:.0f} Triton launches "
      f"({args.layers} layers, {tokens} tokens{', matmuls stubbed' if args.stub_linear else ''})")
if args.profile:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(10):
        forward()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
