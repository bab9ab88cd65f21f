"""Service settings: command-line flags over `KVPAGER_*` environment variables over defaults.

Flags and variables come from services/options.py; the request caps and grammar limits are
`RequestCaps` (services/caps.py), a part of `Settings`. Every service takes the same
`Settings`, so a launcher can pass one set of flags (or one environment) to all three
processes.
"""

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_type_hints

from kvpager.engine.router.routing import ROLES, ROUTERS, RouterConfig
from kvpager.schemas.errors import ConfigError
from kvpager.services import options
from kvpager.services.caps import RequestCaps
from kvpager.services.options import ENV_PREFIX, ByteSize, base_type, from_env, option

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class Settings(RequestCaps):
    nats_url: str = option(
        "NATS server URL; several, comma-separated, for the nodes of a cluster",
        default="nats://127.0.0.1:4222",
    )
    prefix: str = option("subject prefix of the public API", default="llm")
    instance: str = option("name of this scheduler/executor pair", default="default")
    model: str = option("checkpoint folder or known model name", default=DEFAULT_MODEL)
    tokenizer: str | None = option(
        "tokenizer folder, when not the model's (vLLM's --tokenizer)", default=None
    )
    chat_template: str | None = option(
        "chat template: a Jinja file, or the template itself (default: the tokenizer's)",
        default=None,
    )
    dtype: str = option("float32 | bfloat16 | float16 | auto", default="auto")
    kv_cache_dtype: str = option(
        "KV cache dtype: auto (the model's) | fp8 (= fp8_e4m3) | fp8_e5m2 | bfloat16 | float16; "
        "fp8 halves a bf16 cache, scales from the checkpoint else 1.0",
        default="auto",
    )
    device: str = option("cpu | cuda | cuda:N | auto", default="auto")
    attention_backend: str = option("torch | cpu | triton | auto", default="auto")
    kv_layout: str = option(
        "order of values in a KV block: auto (AMX tiles where the cpu backend takes them, a "
        "bf16 model on an AMX or AVX512-BF16 CPU) | token-major",
        default="auto",
    )
    enforce_eager: bool = option(
        "no decode graphs: every step runs its kernels from Python (vLLM's --enforce-eager)",
        default=False,
    )
    block_size: int = option("tokens per KV block", default=16)
    num_blocks: int | None = option("KV blocks (default: what fits)", default=None)
    kv_cache_memory: int | None = option("bytes for the KV cache", default=None)
    gpu_memory_utilization: float | None = option(
        "fraction of the device's memory for weights plus KV cache (on CPU: of the host's "
        "RAM); the KV cache gets what the weights leave (default: 0.9 on CUDA; on CPU a 2 GiB "
        "cache); --kv-cache-memory and --num-blocks win over it",
        default=None,
    )
    swap_space: int | None = option(
        "bytes of host memory for swapped-out blocks (default: a quarter of the KV cache on "
        "CPU, none on CUDA)",
        default=None,
    )
    kv_disk_dir: str | None = option(
        "folder of a disk tier under the CPU pool: prefix blocks leaving it are kept there "
        "(default: off)",
        default=None,
    )
    kv_disk_bytes: ByteSize = option(
        "most bytes of the disk tier's files, e.g. 4GiB (least recently used go first)",
        default=ByteSize(0),
    )
    kv_disk_key_file: str | None = option(
        "the disk tier's HMAC key file (created once, 0600; instances sharing a folder share "
        "it; default: <cache dir>/nats/kv-disk.key)",
        default=None,
    )
    max_num_seqs: int = option("most requests running at once", default=256)
    max_num_batched_tokens: int = option("token budget of one step", default=2048)
    max_model_len: int | None = option("prompt + output limit (default: the model's)", default=None)
    max_waiting: int = option("waiting-queue bound; past it, 'overloaded'", default=1024)
    enable_prefix_caching: bool = option("share full prompt blocks", default=True)
    enable_chunked_prefill: bool = option("split long prompts across steps", default=True)
    long_prefill_token_threshold: int = option(
        "most tokens of one prompt's prefill a step, and past which a prompt is long "
        "(0: the whole budget)",
        default=512,
    )
    max_num_partial_prefills: int = option(
        "most prompts whose prefill spans steps at once (vLLM's)", default=4
    )
    max_long_partial_prefills: int = option(
        "of those, most long ones: a long prompt waits for the one before it, a short one "
        "starts beside it (vLLM's)",
        default=1,
    )
    reserve_prompt_blocks: bool = option(
        "start a prompt only when its whole prompt's blocks are free beside the running "
        "requests' (no preempting them to finish it)",
        default=False,
    )
    preemption_mode: str = option("auto | recompute | swap", default="auto")
    max_pinned_fraction: float = option(
        "most of the device's KV blocks that requests' `cache` may pin at once (0: no pins)",
        default=0.5,
    )
    max_pinned_blocks_per_key: int = option(
        "most KV blocks one key (cache_salt: the gateway's per API key) may pin; a request "
        "over it runs unpinned (0: no bound but --max-pinned-fraction)",
        default=0,
    )
    plan_ahead: int = option("steps planned ahead of the executor (0: lockstep)", default=1)
    seed: int = option("seed of unseeded sampling", default=0)
    speculative_config: str | None = option(
        'speculative decoding as JSON, vLLM\'s fields: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1} or '
        '{"method": "suffix", "suffix_decoding_max_tree_depth": 24, '
        '"suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 1.0, '
        '"suffix_decoding_min_token_prob": 0.1} or {"model": DRAFT_PATH, '
        '"num_speculative_tokens": 4} (a draft model); off above "max_num_seqs_to_speculate": 8 '
        'running, and per request under "min_acceptance_rate": 0.1 (default: off)',
        default=None,
    )
    tensor_parallel_size: int = option(
        "ranks sharing the model, one process and device each (torchrun: WORLD_SIZE)", default=1
    )
    tensor_parallel_timeout: float = option(
        "seconds a tensor-parallel rank waits on another before the executor fails", default=10.0
    )
    piece_tokens: int = option("most token ids in one internal message", default=65536)
    step_timeout: float = option("seconds the scheduler waits for one step", default=300.0)
    finish_timeout: float = option("seconds a stream waits for an abort to land", default=10.0)
    drain_timeout: float = option("seconds to finish streams on shutdown", default=10.0)
    check_invariants: bool = option("check block accounting after every step", default=False)
    kv_transfer: str = option(
        "how KV blocks move between executors (drain): auto (NIXL when installed, else "
        "NATS) | nixl | nats",
        default="auto",
    )
    role: str = option(
        "what this instance does under disaggregation: prefill (computes prompts and first "
        "tokens, then hands each stream with its KV blocks to a decode instance) | decode | both",
        default="both",
    )
    log_level: str = option("debug | info | warning | error", default="info")
    log_json: bool | None = option("JSON log lines (default: when not a tty)", default=None)
    nats_token: str | None = option("NATS authentication token", default=None, secret=True)
    nats_user: str | None = option("NATS user name (with a password)", default=None)
    nats_password: str | None = option(
        "NATS password (prefer the env variable)", default=None, secret=True
    )
    nats_creds: str | None = option("NATS credentials file (JWT + nkey; needs nkeys)", default=None)
    nats_nkey: str | None = option("NATS nkey seed file (needs the nkeys package)", default=None)
    nats_tls_ca: str | None = option(
        "CA file to verify the NATS server's certificate", default=None
    )
    nats_tls_cert: str | None = option("client certificate file (TLS client auth)", default=None)
    nats_tls_key: str | None = option("client private key file (TLS client auth)", default=None)
    nats_inbox_prefix: str | None = option("reply subjects' prefix (default _INBOX)", default=None)
    nats_identity: str | None = option(
        "kvpager identity file: NATS user, password and inbox prefix (`kvpager credentials "
        "add`); client commands use the local default one when given no credentials",
        default=None,
    )
    heartbeat_interval: float = option("seconds between liveness pings and keepalives", default=1.0)
    liveness_timeout: float = option("seconds before a silent peer counts as gone", default=10.0)
    router: str = option(
        "how tokenizers pick an instance: kv | least-loaded | round-robin", default="kv"
    )
    router_overlap_weight: float = option(
        "kv router: weight of a block to prefill against a block in use (Dynamo's cost)",
        default=RouterConfig.overlap_weight,
    )
    router_disk_hit_cost: float = option(
        "kv router: a block on an instance's disk tier, as a fraction of a block to prefill",
        default=RouterConfig.disk_hit_cost,
    )
    migration_limit: int = option(
        "times a stream moves to another instance after its own failed, then an error", default=3
    )
    journal_dir: str | None = option(
        "folder of the in-flight journals and the poison list (set by `kvpager serve` for its "
        "children: services/inflight.py); unset: no journal",
        default=None,
    )

    def __post_init__(self) -> None:
        for name in ("prefix", "instance"):
            value = getattr(self, name)
            if not value or any(c in value for c in " \t*>") or value.startswith("."):
                raise ConfigError(f"{name}: {value!r} is not a valid NATS subject token")
        if "." in self.instance:
            raise ConfigError("instance: must be a single subject token (no dots)")
        if not self.nats_servers:
            raise ConfigError("nats_url: give at least one NATS server URL")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_waiting",
            "piece_tokens",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be at least 1")
        if self.tensor_parallel_size < 1:
            raise ConfigError("tensor_parallel_size: must be at least 1")
        timeouts = ("step_timeout", "finish_timeout", "drain_timeout", "tensor_parallel_timeout")
        for name in (*timeouts, "heartbeat_interval", "liveness_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive")
        self._check_routing()
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ConfigError("max_pinned_fraction: must be in [0, 1]")
        if self.max_pinned_blocks_per_key < 0:
            raise ConfigError("max_pinned_blocks_per_key: must be at least 0")
        utilization = self.gpu_memory_utilization
        if utilization is not None and not 0.0 < utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization: {utilization} is not in (0, 1]")
        self._check_caps()
        self._check_nats_auth()
        from kvpager.engine.model_config import check_kv_cache_dtype  # the engine's own rule

        check_kv_cache_dtype(self.kv_cache_dtype)  # here, before any service starts
        from kvpager.engine.config import SpeculativeConfig

        SpeculativeConfig.parse(self.speculative_config)  # a bad field, before any starts

    def _check_routing(self) -> None:
        """The router's, migration's and disaggregation's settings."""
        if self.router not in ROUTERS:
            raise ConfigError(f"router: {self.router!r} is not kv, least-loaded or round-robin")
        if self.router_overlap_weight < 0:
            raise ConfigError("router_overlap_weight: must be at least 0")
        if not 0.0 <= self.router_disk_hit_cost <= 1.0:
            raise ConfigError("router_disk_hit_cost: must be in [0, 1]")
        if self.migration_limit < 0:
            raise ConfigError("migration_limit: must be at least 0")
        if self.kv_transfer not in ("auto", "nixl", "nats"):
            raise ConfigError(f"kv_transfer: {self.kv_transfer!r} is not auto, nixl or nats")
        if self.role not in ROLES:
            raise ConfigError(f"role: {self.role!r} is not prefill, decode or both")

    def _check_nats_auth(self) -> None:
        if (self.nats_user is None) != (self.nats_password is None):
            raise ConfigError("nats_user and nats_password: give both or neither")
        methods = [self.nats_token, self.nats_user, self.nats_creds, self.nats_nkey]
        if sum(method is not None for method in [*methods, self.nats_identity]) > 1:
            raise ConfigError(
                "NATS auth: give one of token, user/password, creds, nkey or identity"
            )
        if (self.nats_tls_cert is None) != (self.nats_tls_key is None):
            raise ConfigError("nats_tls_cert and nats_tls_key: give both or neither")

    @property
    def has_nats_auth(self) -> bool:
        """Credentials are configured (else: anonymous, or the local identity for clients)."""
        methods = (self.nats_token, self.nats_user, self.nats_creds, self.nats_nkey)
        return any(method is not None for method in (*methods, self.nats_identity))

    @property
    def nats_servers(self) -> list[str]:
        """The URLs in `nats_url` (a cluster's nodes: clients fail over between them)."""
        return [url.strip() for url in self.nats_url.split(",") if url.strip()]

    def model_path(self) -> Path:
        """A checkpoint folder as given, or a known model name fetched and converted."""
        path = Path(self.model).expanduser()
        if path.is_dir():
            return path
        from kvpager.engine.download import resolve_model  # network and conversion: only by name

        return resolve_model(self.model, progress=False)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Settings":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


def add_arguments(
    parser: argparse.ArgumentParser, cls: type = Settings, names: tuple[str, ...] | None = None
) -> None:
    """One flag per setting of `cls` (only `names` if given); defaults from `KVPAGER_<NAME>`."""
    options.add_arguments(parser, cls, names)


# What a client command needs to reach the API: the server, the prefix, auth and TLS.
CONNECTION_FIELDS = (
    "nats_url",
    "prefix",
    "nats_token",
    "nats_user",
    "nats_password",
    "nats_creds",
    "nats_nkey",
    "nats_tls_ca",
    "nats_tls_cert",
    "nats_tls_key",
    "nats_inbox_prefix",
    "nats_identity",
)


@dataclass(frozen=True)
class ServeSettings:
    """What only `kvpager serve` needs: the embedded nats-server and the start-up wait."""

    nats_port: int = option("port of the embedded nats-server (loopback)", default=4222)
    nats_config: str | None = option(
        "nats-server config file for the embedded server", default=None
    )
    nats_server_cert: str | None = option("TLS certificate of the embedded server", default=None)
    nats_server_key: str | None = option("TLS private key of the embedded server", default=None)
    nats_insecure: bool = option(
        "embedded server without authentication: every local process may read every stream "
        "and reach the internal subjects",
        default=False,
    )
    http: bool = option(
        "start the OpenAI-compatible gateway (--http-port, on 8000 by default); --no-http: "
        "the NATS API alone",
        default=True,
    )
    ready_timeout: float = option("seconds to wait for the services to answer", default=600.0)
    replicas: int = option("scheduler-and-executor instances to start", default=1)
    prefill_replicas: int = option(
        "disaggregation: prefill instances to start (with --decode-replicas; replaces --replicas)",
        default=0,
    )
    decode_replicas: int = option("disaggregation: decode instances to start", default=0)

    def __post_init__(self) -> None:
        if not 0 < self.nats_port < 65536:
            raise ConfigError(f"nats_port: {self.nats_port} is not a TCP port")
        if (self.nats_server_cert is None) != (self.nats_server_key is None):
            raise ConfigError("nats_server_cert and nats_server_key: give both or neither")
        if self.ready_timeout <= 0:
            raise ConfigError("ready_timeout: must be positive")
        if self.replicas < 1:
            raise ConfigError("replicas: must be at least 1")
        if min(self.prefill_replicas, self.decode_replicas) < 0:
            raise ConfigError("prefill_replicas, decode_replicas: must be at least 0")
        if bool(self.prefill_replicas) != bool(self.decode_replicas):
            raise ConfigError("prefill_replicas and decode_replicas: give both, or neither")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServeSettings":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


def configured(name: str) -> Any:
    """`KVPAGER_<NAME>` as the type of the `Settings` field `name`, or None when unset."""
    kind = base_type(get_type_hints(Settings)[name])
    return from_env(ENV_PREFIX + name.upper(), kind, None)
