"""Tiny random-weight checkpoints with a real tokenizer, built locally.

No machine here reaches a model hub, so the demo and the tests build their models: a
byte-level BPE tokenizer trained on a small built-in corpus (with a chat template) and a
real HF architecture (Llama, Mistral, Qwen2, Qwen3) at toy sizes, saved as ``config.json``
+ safetensors exactly as a hub checkpoint is laid out.
"""

from __future__ import annotations

import json
from pathlib import Path

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Paris is the capital of France.",
    "Queues hold jobs; workers drain queues and write results back.",
    "A paged cache splits keys and values into fixed-size blocks.",
    "Grade the following answer on a scale from one to ten.",
    "Continuous batching lets requests join and leave at every step.",
    "Zürich, São Paulo, Kraków, Reykjavík and Tōkyō are cities.",
    "数据 队列 模型 推理 服务 東京 日本語のテキスト",
    "Emoji travel in four bytes: 🚀 🌍 ✨ 🎉 and so do some symbols: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828",
    "def add(a, b):\n    return a + b\n",
    "Hello, world! Hello again, world. Goodbye for now.",
]

# NOTE: Hermes-style tools, as Qwen2.5's template shows them: the tools in a system turn, each
# call of an assistant message as a <tool_call> block of its name and arguments (an object:
# the renderer parses OpenAI's JSON string). Without tools or tool calls, plain ChatML. A tool
# is shown by its name and description alone: this tokenizer spends a token on nearly every
# character of JSON, and a schema would fill the 512-token context.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}{% set f = t['function'] %}"
    "{{ f['name'] ~ (': ' ~ f['description'] if f['description'] else '') }}\n{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def build_tokenizer(path: str | Path, vocab_size: int = 384):
    """Train a byte-level BPE tokenizer on the built-in corpus and save it to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def build_tiny_model(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    num_key_value_heads: int | None = None,
    dtype: str = "float32",
    std: float = 0.15,
    **overrides,
) -> Path:
    """Write a tiny random checkpoint of ``arch`` (llama, mistral, qwen2, qwen3) to ``path``.

    Weights are drawn with a large ``std`` so that logits are well separated and greedy
    decoding has no near-ties between implementations.
    """
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    sizes = dict(_SIZES, vocab_size=len(tok), **overrides)
    if num_key_value_heads is not None:
        sizes["num_key_value_heads"] = num_key_value_heads
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    common = dict(eos_token_id=eos, bos_token_id=None, pad_token_id=tok.pad_token_id,
                  tie_word_embeddings=False, rms_norm_eps=1e-6)
    if arch == "llama":
        config = transformers.LlamaConfig(**sizes, **common, rope_theta=10000.0)
    elif arch == "mistral":
        config = transformers.MistralConfig(**sizes, **common, rope_theta=10000.0, sliding_window=None)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**sizes, **common, rope_theta=10000.0, use_sliding_window=False)
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**sizes, **common, rope_theta=10000.0,
                                          head_dim=sizes["hidden_size"] // sizes["num_attention_heads"])
    else:
        raise ValueError(f"arch must be one of llama, mistral, qwen2, qwen3; got {arch!r}")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, std)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(path), safe_serialization=True)
    gen = {"eos_token_id": eos}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path
