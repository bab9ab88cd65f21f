"""kvpager's engine: paged KV cache, scheduler, model and the offline `LLM` API (no NATS)."""

from kvpager.schemas.errors import (
    CheckpointError,
    ConfigError,
    InvalidRequestError,
    KvpagerError,
    RequestTooLongError,
)
from kvpager.schemas.sampling import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "CheckpointError",
    "ConfigError",
    "InvalidRequestError",
    "KvpagerError",
    "RequestTooLongError",
]


def __getattr__(name: str):
    # Importing LLM pulls in torch and transformers; keep `import engine` light.
    if name == "LLM":
        from kvpager.engine.llm import LLM

        return LLM
    raise AttributeError(name)
