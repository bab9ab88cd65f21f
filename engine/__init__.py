"""kvpager's engine: paged KV cache, scheduler, model and the offline `LLM` API (no NATS)."""

from engine.errors import (
    CheckpointError,
    ConfigError,
    InvalidRequestError,
    KvpagerError,
    RequestTooLongError,
)
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "CheckpointError",
    "ConfigError",
    "InvalidRequestError",
    "KvpagerError",
    "RequestTooLongError",
]


def __getattr__(name: str):
    # Importing LLM pulls in torch and transformers; keep `import engine` light for schemas.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
