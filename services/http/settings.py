"""The settings of `kvpager http` and `kvpager metrics` (also taken by `kvpager serve`, which
hands them to its gateway child); flags and `KVPAGER_*` variables as in services/settings.py."""

import argparse
import dataclasses
from dataclasses import dataclass

from kvpager.schemas.errors import ConfigError
from kvpager.services.options import option


@dataclass(frozen=True)
class HttpSettings:
    """The HTTP side: the OpenAI-compatible gateway (`kvpager http`) and Prometheus metrics."""

    http_host: str = option(
        "address the HTTP gateway and metrics listen on", default="127.0.0.1", aliases=("--host",)
    )
    http_port: int | None = option(
        "port of the OpenAI-compatible gateway (kvpager serve: --no-http for none)",
        default=8000,
        aliases=("--port",),
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
    enable_auto_tool_choice: bool = option(
        'serve tool_choice "auto": the model decides, its calls parsed by --tool-call-parser '
        "(vLLM's flag)",
        default=False,
    )
    tool_call_parser: str | None = option(
        "format of the model's tool calls: hermes (<tool_call>{json}</tool_call>, Qwen, SmolLM)",
        default=None,
    )
    allowed_origins: str | None = option(
        "origins browsers may call the gateway from (CORS), comma-separated or the flag "
        'repeated; "*": any (vLLM\'s flag); default: none (no CORS headers)',
        default=None,
        repeated=True,
    )
    allowed_hosts: str | None = option(
        "Host header values the gateway answers, comma-separated (a name, an address, "
        "*.domain or *); others get a 400 (DNS rebinding); default: any",
        default=None,
        repeated=True,
    )
    http_header_timeout: float = option(
        "seconds a connection has to send a request's head (and then its body)", default=10.0
    )
    http_keep_alive_timeout: float = option(
        "seconds an idle keep-alive connection stays open", default=5.0
    )
    http_max_concurrency: int = option(
        "most requests in flight at once (not connections); past it, 503", default=1024
    )
    http_max_connections: int = option(
        "most open TCP connections; past it, a new one closes the connection idle longest "
        "(refused only when all have requests in flight); above --http-max-concurrency",
        default=4096,
    )
    sse_keepalive: float = option(
        "seconds an OpenAI-style event stream (chat, completions, responses) may stay silent "
        "before it gets an SSE comment (`: keepalive`), for proxies that close silent "
        "streams; 0: never, as vLLM (vllm bench serve 0.32 loses the next event after a "
        "comment). The Messages API always pings, as Anthropic's does",
        default=0.0,
    )
    stream_buffer_events: int = option(
        "events one stream may have waiting for a client that does not read; past it, the "
        "client is cut off and the request aborted",
        default=1024,
    )

    responses_store: str = option(
        "where stored responses live: memory (this gateway's) or nats (JetStream's key-value "
        "store: shared by every gateway, kept across restarts)",
        default="memory",
    )
    responses_max_stored: int = option(
        "most responses the gateway keeps for GET /v1/responses/{id} and previous_response_id "
        "(the oldest go first)",
        default=10000,
    )
    responses_max_bytes: int = option(
        "most bytes of stored responses (their JSON, conversations included)",
        default=256 * 1024 * 1024,
    )
    responses_max_stored_per_key: int | None = option(
        "most stored responses of one API key (its oldest go first); default: "
        "--responses-max-stored",
        default=None,
    )
    responses_ttl: float = option("seconds a stored response is kept", default=3600.0)

    def __post_init__(self) -> None:
        for name in ("http_port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 0 < port < 65536:
                raise ConfigError(f"{name}: {port} is not a TCP port")
        if self.default_max_tokens < 1:
            raise ConfigError("default_max_tokens: must be at least 1")
        if self.stats_timeout <= 0:
            raise ConfigError("stats_timeout: must be positive")
        if self.tool_call_parser not in (None, "hermes"):
            raise ConfigError(f"tool_call_parser: {self.tool_call_parser!r}: only hermes")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("enable_auto_tool_choice: needs --tool-call-parser")
        if self.api_key is not None and not self.api_keys:
            raise ConfigError("api_key: give at least one non-empty key")
        for name in ("http_header_timeout", "http_keep_alive_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive")
        if self.sse_keepalive < 0:
            raise ConfigError("sse_keepalive: must be >= 0 (0: never)")
        for name in ("http_max_concurrency", "stream_buffer_events"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be at least 1")
        for name in ("responses_max_stored", "responses_max_bytes", "responses_max_stored_per_key"):
            if (getattr(self, name) or 1) < 1:
                raise ConfigError(f"{name}: must be at least 1")
        if self.responses_store not in ("memory", "nats"):
            raise ConfigError(f"responses_store: {self.responses_store!r}: memory or nats")
        if self.responses_ttl <= 0:
            raise ConfigError("responses_ttl: must be positive")
        if self.http_max_connections <= self.http_max_concurrency:
            raise ConfigError(
                f"http_max_connections: {self.http_max_connections} must be above "
                f"http_max_concurrency {self.http_max_concurrency} (requests need connections)"
            )

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys in `api_key`; none: the gateway is open."""
        keys = (key.strip() for key in (self.api_key or "").split(","))
        return tuple(key for key in keys if key)

    @property
    def origins(self) -> tuple[str, ...]:
        """The origins in `allowed_origins`; none: no CORS."""
        names = (name.strip() for name in (self.allowed_origins or "").split(","))
        return tuple(name for name in names if name)

    @property
    def hosts(self) -> tuple[str, ...]:
        """The names in `allowed_hosts`, lower case; none: any Host is answered."""
        names = (name.strip().lower() for name in (self.allowed_hosts or "").split(","))
        return tuple(name for name in names if name)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "HttpSettings":
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in names}
        joined = {k: ",".join(v) for k, v in values.items() if isinstance(v, list)}
        return cls(**{**values, **joined})
