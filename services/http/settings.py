"""The settings of `kvpager http` and `kvpager metrics` (also taken by `kvpager serve`, which
hands them to its gateway child); flags and `KVPAGER_*` variables as in services/settings.py."""

import argparse
import dataclasses
from dataclasses import dataclass

from schemas.errors import ConfigError
from services.settings import option


@dataclass(frozen=True)
class HttpSettings:
    """The HTTP side: the OpenAI-compatible gateway (`kvpager http`) and Prometheus metrics."""

    http_host: str = option("address the HTTP gateway and metrics listen on", default="127.0.0.1")
    http_port: int | None = option(
        "port of the OpenAI-compatible gateway (kvpager http: 8000 if unset; kvpager serve: "
        "no gateway if unset)",
        default=None,
    )
    metrics_port: int | None = option(
        "port of a Prometheus /metrics server without the gateway (kvpager serve)", default=None
    )
    served_model_name: str | None = option(
        "model name of the OpenAI API (default: the model folder's name)", default=None
    )
    default_max_tokens: int = option(
        "max_tokens of a chat completion that gives none (completions: 16)", default=1024
    )
    stats_timeout: float = option("seconds a scrape waits for every instance's stats", default=1.0)
    api_key: str | None = option(
        "API keys clients must send (Authorization: Bearer KEY) on /v1/* and /tokenize, "
        "/detokenize: comma-separated, or the flag repeated",
        default=None,
        secret=True,
        repeated=True,
    )
    allow_unknown_fields: bool = option(
        "log and ignore request fields the gateway does not know (vLLM's behaviour) instead of "
        "a 400 naming them",
        default=False,
    )

    def __post_init__(self) -> None:
        for name in ("http_port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 0 < port < 65536:
                raise ConfigError(f"{name}: {port} is not a TCP port")
        if self.default_max_tokens < 1:
            raise ConfigError("default_max_tokens: must be at least 1")
        if self.stats_timeout <= 0:
            raise ConfigError("stats_timeout: must be positive")
        if self.api_key is not None and not self.api_keys:
            raise ConfigError("api_key: give at least one non-empty key")

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys in `api_key`; none: the gateway is open."""
        keys = (key.strip() for key in (self.api_key or "").split(","))
        return tuple(key for key in keys if key)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "HttpSettings":
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in names}
        joined = {k: ",".join(v) for k, v in values.items() if isinstance(v, list)}
        return cls(**{**values, **joined})
