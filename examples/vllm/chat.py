# vLLM's chat example as its users write it; only the import line differs from vLLM's.
import os

from engine import LLM, SamplingParams

llm = LLM(model=os.environ.get("MODEL", "Qwen/Qwen2.5-0.5B-Instruct"))
sampling_params = SamplingParams(temperature=0.5, max_tokens=32)


def print_outputs(outputs):
    print("\nGenerated Outputs:\n" + "-" * 80)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}\n")
        print(f"Generated text: {output.outputs[0].text!r}")
        print("-" * 80)


conversation = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": [{"type": "text", "text": "Write an essay about the importance of higher education."}]},
]
outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
print_outputs(outputs)

# several conversations at once
conversations = [conversation for _ in range(3)]
outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
print_outputs(outputs)

# a template of one's own, extra template variables, and continuing the assistant's message
chat_template = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
outputs = llm.chat(conversation, sampling_params, use_tqdm=False, chat_template=chat_template,
                   chat_template_kwargs={"enable_thinking": False})
print_outputs(outputs)
outputs = llm.chat(conversation + [{"role": "assistant", "content": "Higher education is"}], sampling_params,
                   use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
print_outputs(outputs)
