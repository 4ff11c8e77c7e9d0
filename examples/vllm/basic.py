# A vLLM offline script as its users write it, top level and unguarded; only the import
# line differs from vLLM's (`from vllm import LLM, SamplingParams`).
import os

from engine import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(model=os.environ.get("MODEL", "Qwen/Qwen2.5-0.5B-Instruct"),
          tensor_parallel_size=int(os.environ.get("TP", "1")))
outputs = llm.generate(prompts, sampling_params)

print("\nGenerated Outputs:\n" + "-" * 60)
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt:    {prompt!r}")
    print(f"Output:    {generated_text!r}")
    print("-" * 60)
