"""The structured-outputs bench's pair of runs compares like with like (CPU, tiny model)."""

from __future__ import annotations

import random

from bench import structured
from bench.run import Workload, run_requests
from engine import LLM
from engine.models.tiny import build_tiny_model


def test_the_unconstrained_run_finds_nothing_of_the_constrained_run_in_the_prefix_cache(tmp_path):
    """The unconstrained run of a pair computes every prompt token, as the constrained run did
    (on the H200 a run fed the same prompts again read twice as fast from the cache alone)."""
    llm = LLM(str(build_tiny_model(tmp_path / "tiny", arch="llama", seed=3)), device="cpu", swap_space=0, block_size=8,
              max_num_batched_tokens=64, max_num_seqs=8)
    try:
        rng = random.Random(0)
        workload = Workload([[rng.randrange(5, 250) for _ in range(32)] for _ in range(4)], [6] * 4)
        engine_stats = llm.llm_engine.scheduler.bm.prefix_stats
        hits = []

        def run(w: Workload, params: list) -> dict:
            before = engine_stats.hit_tokens
            result = run_requests(llm, w, params=params)
            hits.append(engine_stats.hit_tokens - before)
            return result

        opts = {"structured_distinct": 2, "structured_string_len": 40}
        pair = structured.paired_runs(llm, workload, run, opts)
        assert hits == [0, 0]
        assert pair["unconstrained"]["output_tokens"] == pair["constrained"]["output_tokens"]
    finally:
        llm.shutdown()
