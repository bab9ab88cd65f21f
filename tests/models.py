"""Tiny seeded checkpoints for tests: random Llama / Qwen2 weights, a trained BPE tokenizer.

Weights use a large init std (0.25) so top-1 logit margins stay far above float noise and greedy
parity with transformers is a sharp test rather than a coin toss between near-ties.
"""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "A scheduler batches many requests continuously, step after step.",
    "naïve café déjà vu — 日本語のテキスト, emoji 🎉🚀, Ελληνικά, русский текст.",
    "Once upon a time there was a small language model that liked numbers 0123456789.",
    "def add(a, b):\n    return a + b\n",
] * 20
VOCAB_SIZE = 384


def train_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    return fast


def _common(tokenizer: PreTrainedTokenizerFast) -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=1024,
        initializer_range=0.25,
        rms_norm_eps=1e-6,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """Llama with GQA 2:1, separate lm_head, llama3 rope scaling."""
    tokenizer = train_tokenizer(path)
    config = LlamaConfig(
        **_common(tokenizer),
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        tie_word_embeddings=False,
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def build_qwen2(path: Path, seed: int = 1, **overrides) -> Path:
    """Qwen2 with q/k/v bias, GQA 4:1, tied embeddings, head_dim 16."""
    tokenizer = train_tokenizer(path)
    config = Qwen2Config(
        **_common(tokenizer),
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        use_sliding_window=False,
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # HF initialises biases to zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.25)
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_truncated(source: Path, path: Path, num_layers: int = 1) -> Path:
    """A Llama checkpoint's first `num_layers` layers, embeddings and head: a draft model of
    the same vocabulary and head shapes (speculative decoding's tests)."""
    model = LlamaForCausalLM.from_pretrained(source)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    model.save_pretrained(path, safe_serialization=True)
    return path
