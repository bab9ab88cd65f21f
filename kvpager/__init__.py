"""kvpager: LLM serving on a paged KV cache, reached over NATS.

    from kvpager import LLM, SamplingParams          # offline, in this process
    from kvpager import Client                       # a running `kvpager serve`, over NATS

The repository's folders install under this one name: kvpager.engine (no NATS: the cache,
scheduler, model, offline LLM), kvpager.kernels, kvpager.schemas (the messages) and
kvpager.services (the NATS services, the HTTP gateway and `kvpager serve`). The names below
load on first use, so `import kvpager` stays light (the client needs no torch).
"""

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
    "Client",
    "SamplingParams",
    "StructuredOutputsParams",
    "CheckpointError",
    "ConfigError",
    "InvalidRequestError",
    "KvpagerError",
    "RequestTooLongError",
]

_LAZY = {"LLM": "kvpager.engine.llm", "Client": "kvpager.services.client"}


def __getattr__(name: str):
    # LLM pulls in torch and transformers, Client nats-py: each only when asked for
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvpager' has no attribute {name!r}")
