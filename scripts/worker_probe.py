"""Where does the worker lose time against offline? Step time inside engine.step vs wall time."""
import json, sys, time
from engine import EngineArgs, LLMEngine
from bench.worker import make_prompts, run_offline, run_worker
from worker.logs import configure

configure("WARNING")
engine = LLMEngine(EngineArgs(model="llama3-8b", load_format="dummy", max_num_seqs=384))
stats = {"t": 0.0, "n": 0, "first": None, "last": None}
inner = engine.step
def timed_step():
    t0 = time.perf_counter()
    out = inner()
    t1 = time.perf_counter()
    stats["t"] += t1 - t0; stats["n"] += 1
    stats["first"] = stats["first"] or t0
    stats["last"] = t1
    return out
engine.step = timed_step
run_offline(engine, make_prompts(64, 512, engine.vocab_size, 7), 256)
rows = []
for name, fn in [("offline", lambda p: run_offline(engine, p, 256)),
                 ("worker", lambda p: run_worker(engine, "llama3-8b", p, 256, True)),
                 ("worker_si20ms", None), ("offline2", lambda p: run_offline(engine, p, 256))]:
    if fn is None:
        sys.setswitchinterval(0.02)
        fn = lambda p: run_worker(engine, "llama3-8b", p, 256, True)
    stats.update(t=0.0, n=0, first=None, last=None)
    w0 = time.perf_counter()
    r = fn(make_prompts(1024, 512, engine.vocab_size, len(rows) + 11))
    w1 = time.perf_counter()
    sys.setswitchinterval(0.005)
    rows.append((name, r["output_tok_s"], r["seconds"], stats["n"], stats["t"], stats["first"] - w0, w1 - stats["last"]))
    print(f"{name:14s} tok/s {r['output_tok_s']:8.1f} secs {r['seconds']:6.2f} steps {stats['n']:5d} in-step {stats['t']:6.2f}s "
          f"per-step {1000*stats['t']/stats['n']:.2f}ms first-step-after {stats['first']-w0:.2f}s tail {w1-stats['last']:.2f}s", flush=True)
engine.shutdown()
