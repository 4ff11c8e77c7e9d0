"""Finding checkpoints (folders, the HF cache, presets), loading them, and their errors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.loader import load_hf_config, load_model, resolve_dtype, resolve_model_path
from engine.models.presets import PRESETS, preset_config

# small enough to build on CPU in well under a second, whatever the preset
SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=512)


def copy_checkpoint(source: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file():
            shutil.copy(f, dest / f.name)
    return dest


def edit_config(folder: Path, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, **fields)))


def params_of(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same_params(a, b) -> None:
    pa, pb = params_of(a), params_of(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], atol=0, rtol=0, msg=name)


def make_hf_cache(hf_home: Path, repo_id: str, source: Path, commit: str = "0123456789abcdef" * 2 + "01234567") -> Path:
    """Lay ``source`` out as huggingface_hub's cache does: blobs, a snapshot of links, refs/main."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in source.iterdir():
        if f.is_file():
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copy(f, repo / "blobs" / digest)
            os.symlink(Path("..") / ".." / "blobs" / digest, snapshot / f.name)
    return snapshot


@pytest.fixture
def offline_hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf_home"
    home.mkdir()
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_sharded_checkpoint_with_index(tiny_model_factory, tmp_path):
    source = tiny_model_factory("qwen3")
    sharded = copy_checkpoint(source, tmp_path / "sharded")
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in files.items():
        save_file({k: tensors[k] for k in keys}, sharded / file, metadata={"format": "pt"})
    weight_map = {k: file for file, keys in files.items() for k in keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    whole, _ = load_model(str(source), device="cpu")
    split, _ = load_model(str(sharded), device="cpu")
    assert_same_params(whole, split)


def test_index_naming_a_missing_shard_is_reported(tiny_model_factory, tmp_path):
    folder = copy_checkpoint(tiny_model_factory("llama"), tmp_path / "m")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="gone.safetensors"):
        load_model(str(folder), device="cpu")


def test_hub_id_resolves_from_the_offline_cache(tiny_model_factory, offline_hf_home):
    source = tiny_model_factory("llama")
    snapshot = make_hf_cache(offline_hf_home, "acme/tiny-llama", source)
    assert resolve_model_path("acme/tiny-llama") == snapshot
    from_cache, config = load_model("acme/tiny-llama", device="cpu")
    from_folder, _ = load_model(str(source), device="cpu")
    assert config.architectures == ["LlamaForCausalLM"]
    assert_same_params(from_cache, from_folder)


def test_uncached_hub_id_offline_names_the_id_and_cache(offline_hf_home):
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_path("acme/not-downloaded")
    assert "acme/not-downloaded" in str(err.value)
    assert str(offline_hf_home) in str(err.value) and "HF_HUB_OFFLINE" in str(err.value)


def test_missing_paths_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path("./relative/nowhere")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_folder_without_weights(tiny_model_factory, tmp_path):
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(tiny_model_factory("llama") / "config.json", folder / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(str(folder), device="cpu")
    model, _ = load_model(str(folder), load_format="dummy", device="cpu")  # the config alone is enough
    assert model.lm_head.weight.shape[0] == 384


def test_unknown_architecture(tiny_model_factory, tmp_path):
    folder = copy_checkpoint(tiny_model_factory("llama"), tmp_path / "m")
    edit_config(folder, architectures=["FooForCausalLM"])
    with pytest.raises(ValueError, match="architecture 'FooForCausalLM' is not supported; supported: LlamaForCausalLM"):
        load_model(str(folder), device="cpu")


def test_checkpoint_and_model_must_match(tiny_model_factory, tmp_path):
    folder = copy_checkpoint(tiny_model_factory("llama"), tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    missing = tensors.pop("model.layers.1.mlp.down_proj.weight")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no weights for model.layers.1.mlp.down_proj.weight"):
        load_model(str(folder), device="cpu")
    tensors["model.layers.1.mlp.down_proj.weight"] = missing
    tensors["model.layers.1.mlp.extra.weight"] = missing.clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.layers.1.mlp.extra.weight' in model.safetensors has no parameter"):
        load_model(str(folder), device="cpu")


def test_sliding_window_needs_a_short_enough_max_model_len(tiny_model_factory):
    path = str(tiny_model_factory("mistral"))
    with pytest.raises(ValueError, match="sliding_window=16.*max_model_len <= 16"):
        load_model(path, device="cpu", hf_overrides={"sliding_window": 16})
    load_model(path, device="cpu", hf_overrides={"sliding_window": 16}, max_model_len=16)


def test_dtypes(tiny_model_factory):
    path = str(tiny_model_factory("llama"))
    model, config = load_model(path, dtype="bfloat16", device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.float32
    assert model.compute_logits(torch.zeros(1, config.hidden_size, dtype=torch.bfloat16)).dtype == torch.float32
    model, _ = load_model(path, dtype=torch.float16, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        load_model(path, dtype="int8", device="cpu")


def test_auto_dtype_follows_the_device_and_config():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    bf16_config, fp32_config, fp16_config = (preset_config("qwen3-0.6b", dtype=d) for d in ("bfloat16", "float32", "float16"))
    assert resolve_dtype("auto", bf16_config, cpu) == torch.float32
    assert resolve_dtype("auto", bf16_config, cuda) == torch.bfloat16
    assert resolve_dtype("auto", fp32_config, cuda) == torch.bfloat16
    assert resolve_dtype("auto", fp16_config, cuda) == torch.float16
    assert resolve_dtype("half", fp32_config, cpu) == torch.float16
    assert resolve_dtype("float32", bf16_config, cuda) == torch.float32


def test_preset_configs_hold_the_published_values():
    expected = {  # hidden, intermediate, layers, heads, kv heads, vocab, max positions, tied
        "llama3-8b": (4096, 14336, 32, 32, 8, 128256, 131072, False),
        "llama3-70b": (8192, 28672, 80, 64, 8, 128256, 131072, False),
        "llama3.1-405b": (16384, 53248, 126, 128, 8, 128256, 131072, False),
        "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936, 32768, True),
        "qwen3-0.6b": (1024, 3072, 28, 16, 8, 151936, 40960, True),
    }
    assert set(expected) == set(PRESETS)
    for name, values in expected.items():
        c = preset_config(name)
        got = (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
               c.num_key_value_heads, c.vocab_size, c.max_position_embeddings, c.tie_word_embeddings)
        assert got == values, name
    llama = load_hf_config("llama3-8b")
    from engine.layers.rotary import rope_settings

    theta, scaling = rope_settings(llama)
    assert theta == 500000.0 and scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    assert scaling["original_max_position_embeddings"] == 8192
    assert preset_config("qwen3-0.6b").head_dim == 128
    assert rope_settings(preset_config("qwen2.5-0.5b")) == (1000000.0, {})


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dummy_presets_build_and_run_at_a_small_size(name, make_paged_cache):
    model, config = load_model(name, load_format="dummy", device="cpu", hf_overrides=SMALL)
    assert type(model).__name__ == config.architectures[0]
    (logits,) = make_paged_cache(config).step(model, [("a", list(range(1, 10)), 0)])
    assert logits.shape == (9, 512) and torch.isfinite(logits).all()


def test_dummy_weights_are_seeded():
    a, _ = load_model("qwen2.5-0.5b", load_format="dummy", device="cpu", hf_overrides=SMALL, seed=1)
    b, _ = load_model("qwen2.5-0.5b", load_format="dummy", device="cpu", hf_overrides=SMALL, seed=1)
    c, _ = load_model("qwen2.5-0.5b", load_format="dummy", device="cpu", hf_overrides=SMALL, seed=2)
    assert_same_params(a, b)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_preset_needs_dummy_weights():
    with pytest.raises(ValueError, match="preset 'llama3-8b' has no weights; pass load_format='dummy'"):
        load_model("llama3-8b", load_format="auto", device="cpu")
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("llama3-9b")
