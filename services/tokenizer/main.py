"""Entry point of `kvpager tokenizer`."""

from transformers import AutoTokenizer

from engine.config import ModelConfig
from services.runtime import run_service, setup_logging
from services.settings import Settings
from services.tokenizer.service import TokenizerService


def run(settings: Settings) -> int:
    setup_logging(settings, "tokenizer")
    path = settings.model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    vocab_size = ModelConfig.from_path(path).vocab_size
    return run_service(
        "tokenizer", settings, lambda nc: TokenizerService(nc, settings, tokenizer, vocab_size)
    )
