"""Scheduler-only replay of the swap workload (no model): steps, batch and tokens per mode."""
import random, time
from engine.core.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.config import SchedulerConfig
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence

def sim(mode, blocks=10240, cpu=16384):
    bm = BlockManager(16, blocks, cpu if mode == "swap" else 0, True)
    s = Scheduler(SchedulerConfig(256, 8192, 4096, mode), bm)
    rng = random.Random(0)
    for i in range(256):
        toks = [rng.randrange(10, 120000) for _ in range(2048)]
        s.add(Sequence(f"r{i}", 0, toks, 2048, SamplingParams(max_tokens=512, ignore_eos=True), arrival_order=i))
    steps = 0; tokens = 0; decode_rows = 0; swapped_blocks = 0; batch = []
    while s.has_unfinished():
        out = s.schedule(); steps += 1
        swapped_blocks += len(out.blocks_to_swap_in) + len(out.blocks_to_swap_out)
        nb = 0
        s.update_from_output(out)
        for it in out.scheduled:
            seq = it.seq
            tokens += it.num_new_tokens
            if it.samples:
                seq.token_ids.append(7); nb += 1
                if seq.num_output_tokens >= 512:
                    s.finish(seq)
        s.commit_filled_blocks(out)
        batch.append(len(out.scheduled))
    print(mode, "steps", steps, "computed tokens", tokens, "mean batch", sum(batch)/len(batch), "swap blocks", swapped_blocks, "preempt", s.stats.num_preemptions)
for m in ("swap", "recompute"):
    t=time.time(); sim(m); print(time.time()-t)
