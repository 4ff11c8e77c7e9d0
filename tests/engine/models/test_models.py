"""Our models over a real paged cache (torch backend, CPU, float32) against HF transformers."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
import transformers

from engine.executor import distributed
from engine.runner.attention import get_attention_backend
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.embedding import ParallelLMHead
from engine.layers.rotary import inverse_frequencies, rope_settings
from engine.models.loader import load_model
from sluiceway_kernels._common import interpreting
from engine.models.shape import ModelShape

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
ATOL = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@functools.lru_cache(maxsize=None)
def _hf_model(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(path, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return _hf_model(str(path))(torch.tensor([tokens])).logits[0]  # (L, vocab)


def prompt(length: int, seed: int, vocab_size: int = 300) -> list[int]:
    return torch.randint(3, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def ours(path, **kw):
    model, config = load_model(str(path), dtype="float32", device="cpu", **kw)
    return model, config


@pytest.mark.parametrize("arch", ARCHS)
def test_whole_prompt_matches_hf(tiny_model_factory, arch, make_paged_cache):
    path = tiny_model_factory(arch)
    model, config = ours(path)
    tokens = prompt(23, seed=1)
    (logits,) = make_paged_cache(config).step(model, [("a", tokens, 0)])
    assert logits.dtype == torch.float32 and logits.shape == (23, config.vocab_size)
    torch.testing.assert_close(logits, hf_logits(path, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_varlen_batch_matches_each_prompt(tiny_model_factory, arch, make_paged_cache):
    path = tiny_model_factory(arch)
    model, config = ours(path)
    a, b = prompt(9, seed=2), prompt(17, seed=3)
    out_a, out_b = make_paged_cache(config).step(model, [("a", a, 0), ("b", b, 0)])
    torch.testing.assert_close(out_a, hf_logits(path, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(out_b, hf_logits(path, b), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_prefix_then_chunk_then_decode(tiny_model_factory, arch, make_paged_cache):
    """Chunked prefill over the paged cache and decode steps give the whole prompt's logits."""
    path = tiny_model_factory(arch)
    model, config = ours(path)
    a, b = prompt(22, seed=4), prompt(13, seed=5)
    cache = make_paged_cache(config)
    cache.step(model, [("a", a[:10], 0)])  # the prefix of a, alone
    chunk_a, whole_b = cache.step(model, [("a", a[:19], 10), ("b", b, 0)])  # a's next chunk beside b's prefill
    b_next = b + [a[0]]
    last_a, last_b = cache.step(model, [("a", a[:20], 19), ("b", b_next, 13)])  # a decode-only step
    torch.testing.assert_close(chunk_a, hf_logits(path, a[:19])[10:], atol=ATOL, rtol=0)
    torch.testing.assert_close(whole_b, hf_logits(path, b), atol=ATOL, rtol=0)
    torch.testing.assert_close(last_a, hf_logits(path, a[:20])[19:], atol=ATOL, rtol=0)
    torch.testing.assert_close(last_b, hf_logits(path, b_next)[13:], atol=ATOL, rtol=0)


def test_single_kv_head_matches_hf(tiny_model_factory, make_paged_cache):
    path = tiny_model_factory("llama", num_key_value_heads=1)
    model, config = ours(path)
    assert config.num_key_value_heads == 1
    tokens = prompt(15, seed=6)
    (logits,) = make_paged_cache(config).step(model, [("a", tokens, 0)])
    torch.testing.assert_close(logits, hf_logits(path, tokens), atol=ATOL, rtol=0)


def test_llama3_rope_scaling_matches_hf(tiny_model_factory, make_paged_cache):
    path = tiny_model_factory("llama", rope_scaling=LLAMA3_ROPE, seed=1)
    model, config = ours(path)
    theta, scaling = rope_settings(config)
    assert scaling["rope_type"] == "llama3"
    plain = inverse_frequencies(ModelShape.from_hf_config(config).head_dim, theta, {})
    scaled = inverse_frequencies(ModelShape.from_hf_config(config).head_dim, theta, scaling)
    assert (scaled < plain).any() and (scaled == plain).any()  # some frequencies slowed, some kept
    tokens = prompt(40, seed=7)
    (logits,) = make_paged_cache(config).step(model, [("a", tokens, 0)])
    torch.testing.assert_close(logits, hf_logits(path, tokens), atol=ATOL, rtol=0)


def test_llama3_inverse_frequencies_match_hf(tiny_model_factory):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.AutoConfig.from_pretrained(str(tiny_model_factory("llama", rope_scaling=LLAMA3_ROPE, seed=1)))
    theta, scaling = rope_settings(config)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(inverse_frequencies(ModelShape.from_hf_config(config).head_dim, theta, scaling), expected)


def test_unsupported_rope_type_is_rejected():
    with pytest.raises(ValueError, match="yarn"):
        inverse_frequencies(16, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def test_tied_embeddings_without_lm_head_in_checkpoint(tiny_model_factory, make_paged_cache, tmp_path):
    """A tied checkpoint (Qwen2.5-0.5B style) stores no lm_head; the head reuses the embedding."""
    from safetensors.torch import load_file, save_file

    source = tiny_model_factory("qwen2")
    for f in source.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=True)))

    model, config = ours(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tokens = prompt(11, seed=8)
    (logits,) = make_paged_cache(config).step(model, [("a", tokens, 0)])
    torch.testing.assert_close(logits, hf_logits(tmp_path, tokens), atol=ATOL, rtol=0)


@pytest.mark.skipif(not interpreting(), reason="runs the Triton kernels through the CPU interpreter")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_matches_torch_backend(tiny_model_factory, make_paged_cache, arch):
    model, config = ours(tiny_model_factory(arch))
    a, b = prompt(10, seed=9), prompt(23, seed=10)
    steps = [[("a", a[:6], 0), ("b", b, 0)], [("a", a, 6)], [("a", a + b[:1], 10), ("b", b + a[:1], 23)]]
    by_backend = []
    for backend in ("torch", "triton"):
        cache = make_paged_cache(config, backend=backend)
        by_backend.append([out for step in steps for out in cache.step(model, step)])
    for ref, got in zip(*by_backend):
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_attention_backend_choice(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert get_attention_backend("auto", "cpu").name == "torch"
    assert get_attention_backend("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_attention_backend("triton", "cpu")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        get_attention_backend("flash", "cpu")


def test_tensor_parallel_state_defaults_and_validation():
    assert (distributed.tp_rank(), distributed.tp_size()) == (0, 1)
    x = torch.ones(2, 3)
    assert distributed.all_reduce(x) is x and distributed.all_gather_last_dim(x) is x
    distributed.init_tensor_parallel(0, 1, backend="gloo")
    try:
        assert (distributed.tp_rank(), distributed.tp_size()) == (0, 1)
        with pytest.raises(RuntimeError, match="already set"):
            distributed.init_tensor_parallel(0, 1, backend="gloo")
    finally:
        distributed.destroy_tensor_parallel()
    with pytest.raises(ValueError, match="rank must be in"):
        distributed.init_tensor_parallel(2, 2, backend="gloo")


@pytest.mark.parametrize("tp,num_kv_heads", [(2, 4), (2, 1), (4, 2)])
def test_qkv_shards_cover_the_checkpoint(monkeypatch, tp, num_kv_heads):
    """Every rank's q/k/v shard is the right slice; KV heads replicate when fewer than ranks."""
    heads, head_dim, hidden = 4, 2, 8
    full = {s: torch.randn(n * head_dim, hidden) for s, n in (("q", heads), ("k", num_kv_heads), ("v", num_kv_heads))}
    per_rank = []
    for rank in range(tp):
        monkeypatch.setattr(distributed, "_group", distributed._TPGroup(rank, tp, "gloo"))
        layer = QKVParallelLinear(hidden, head_dim, heads, num_kv_heads)
        for shard_id, weight in full.items():
            layer.weight.weight_loader(layer.weight, weight, shard_id)
        per_rank.append(layer.split(layer.weight.data.T))
    q = torch.cat([r[0] for r in per_rank], dim=-1).T
    torch.testing.assert_close(q, full["q"])
    kv_per_rank = max(1, num_kv_heads // tp) * head_dim
    for rank, (_, k, v) in enumerate(per_rank):
        head = rank * num_kv_heads // tp  # the KV head this rank holds (first of its group)
        torch.testing.assert_close(k.T, full["k"][head * head_dim: head * head_dim + kv_per_rank])
        torch.testing.assert_close(v.T, full["v"][head * head_dim: head * head_dim + kv_per_rank])


def test_merged_row_and_vocab_shards(monkeypatch):
    gate, up, down, emb = torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 6), torch.randn(5, 4)
    merged, rows, vocab = [], [], []
    for rank in range(2):
        monkeypatch.setattr(distributed, "_group", distributed._TPGroup(rank, 2, "gloo"))
        m, r, h = MergedColumnParallelLinear(4, [6, 6]), RowParallelLinear(6, 4), ParallelLMHead(5, 4)
        m.weight.weight_loader(m.weight, gate, 0)
        m.weight.weight_loader(m.weight, up, 1)
        r.weight.weight_loader(r.weight, down)
        h.weight.weight_loader(h.weight, emb)
        merged.append(m.weight.data)
        rows.append(r.weight.data)
        vocab.append(h.weight.data)
    torch.testing.assert_close(merged[0], torch.cat([gate[:3], up[:3]]))
    torch.testing.assert_close(merged[1], torch.cat([gate[3:], up[3:]]))
    torch.testing.assert_close(torch.cat(rows, dim=1), down)
    torch.testing.assert_close(torch.cat(vocab)[:5], emb)  # 3 rows per rank, the last one padding
    assert vocab[1][2].abs().sum() == 0


def test_indivisible_heads_give_a_clear_error(monkeypatch):
    monkeypatch.setattr(distributed, "_group", distributed._TPGroup(0, 2, "gloo"))
    with pytest.raises(ValueError, match="num_attention_heads=3 is not divisible by tensor_parallel_size=2"):
        QKVParallelLinear(12, 4, 3, 3)
    monkeypatch.setattr(distributed, "_group", distributed._TPGroup(0, 4, "gloo"))
    with pytest.raises(ValueError, match="multiple of num_key_value_heads=3"):
        QKVParallelLinear(48, 4, 12, 3)
