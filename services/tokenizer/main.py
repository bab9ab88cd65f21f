"""Entry point of `kvpager tokenizer`."""

import dataclasses
from pathlib import Path

from kvpager.engine.config import EngineConfig
from kvpager.engine.frontend.tokenizer_files import load_tokenizer
from kvpager.engine.model_config import ModelConfig
from kvpager.services.runtime import run_service, setup_logging
from kvpager.services.settings import Settings
from kvpager.services.tokenizer.service import TokenizerService


def run(settings: Settings) -> int:
    setup_logging(settings, "tokenizer")
    path = settings.model_path()
    tokenizer = load_tokenizer(path, settings.tokenizer, settings.chat_template)
    vocab_size = ModelConfig.from_path(path).vocab_size
    settings = with_prompt_cap(settings, path)
    return run_service(
        "tokenizer", settings, lambda nc: TokenizerService(nc, settings, tokenizer, vocab_size)
    )


def with_prompt_cap(settings: Settings, path: Path) -> Settings:
    """`--max-prompt-tokens`, by default the context length the executor will have: a longer
    prompt is refused here, before it is routed or sent anywhere."""
    if settings.max_prompt_tokens is not None:
        return settings
    context_len = EngineConfig.pick(settings).model_len(ModelConfig.from_path(path))
    return dataclasses.replace(settings, max_prompt_tokens=context_len)
