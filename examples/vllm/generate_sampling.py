# `LLM.generate` with the sampling variants vLLM scripts use; only the import line differs
# from vLLM's.
import os

from engine import LLM, SamplingParams

llm = LLM(model=os.environ.get("MODEL", "Qwen/Qwen2.5-0.5B-Instruct"), max_model_len=256,
          trust_remote_code=True, disable_log_stats=True, enable_chunked_prefill=True, seed=0)
prompt = "The capital of France is"

variants = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=16),
    "nucleus": SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=16, seed=1),
    "n=2": SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=2),
    "stop": SamplingParams(temperature=0.0, max_tokens=32, stop=["."], include_stop_str_in_output=True),
    "penalties": SamplingParams(temperature=0.7, presence_penalty=0.5, repetition_penalty=1.2, max_tokens=16, seed=3),
    "to the end": SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
}
for name, params in variants.items():
    output = llm.generate(prompt, params, use_tqdm=False)[0]
    for completion in output.outputs:
        print(f"{name}: {completion.text!r} ({len(completion.token_ids)} tokens, {completion.finish_reason})")

output = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2), lora_request=None)[0]
for token, step in zip(output.outputs[0].token_ids, output.outputs[0].logprobs):
    chosen = step[token]
    print(f"logprobs: {chosen.decoded_token!r} logprob={chosen.logprob:.3f} rank={chosen.rank}")
