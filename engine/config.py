"""Frozen configuration of the engine's parts, each checked once at construction."""

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvpager.engine.model_config import ModelConfig, check_kv_cache_dtype
from kvpager.schemas.errors import ConfigError

SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")
_SPECULATIVE_FLOATS = (
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
    "min_acceptance_rate",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's names. `method` "ngram" (prompt lookup) proposes up to
    `num_speculative_tokens` tokens a step from the longest suffix n-gram (`prompt_lookup_max`
    down to `prompt_lookup_min` tokens) found earlier in the sequence; "suffix" (suffix
    decoding, Arctic Inference's) proposes the most frequent continuation of the longest
    suffix (up to `suffix_decoding_max_tree_depth` tokens) found in the sequence or in the
    outputs of the last `suffix_decoding_max_cached_requests` requests, as long as its
    estimated probability stays at least `suffix_decoding_min_token_prob` and its length at
    most `suffix_decoding_max_spec_factor` x the match length; "draft_model" (given a `model`
    path alone, as vLLM infers it) runs that smaller model of the same vocabulary and head
    shapes as a second decoder whose K/V sits in extra layer slots of the same paged blocks
    (engine/worker/spec_decode/draft_model.py), proposing its next k tokens.

    Switching off: speculation steps aside for a step when more than
    `max_num_seqs_to_speculate` sequences run (vLLM's `disable_by_batch_size` is read as this),
    and for a request's next 64 tokens when fewer than `min_acceptance_rate` of its last 32
    proposed tokens were accepted (engine/sched/lookahead.py)."""

    method: str = "ngram"
    model: str | None = None  # the draft model's path, for "draft_model"
    # None: 4 for ngram, the tree depth for suffix (vLLM's defaults)
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # Measured on SmolLM2 (CPU, benchmarks/spec_decode.py) is left to the lead; 8 is cautious.
    max_num_seqs_to_speculate: int = 8
    min_acceptance_rate: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_config.method: {self.method!r} is not supported; supported: "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError("speculative_config.model: give it for method draft_model only")
        self._check_suffix()
        if self.num_speculative_tokens is None:
            default = 4 if self.method == "ngram" else self.suffix_decoding_max_tree_depth
            object.__setattr__(self, "num_speculative_tokens", min(default, 32))
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ConfigError("speculative_config.num_speculative_tokens: must be in [1, 32]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ConfigError(
                "speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64"
            )
        if self.max_num_seqs_to_speculate < 1:
            raise ConfigError("speculative_config.max_num_seqs_to_speculate: must be >= 1")
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ConfigError("speculative_config.min_acceptance_rate: must be in [0, 1]")

    def _check_suffix(self) -> None:
        prefix = "speculative_config.suffix_decoding_"
        if not 1 <= self.suffix_decoding_max_tree_depth <= 256:
            raise ConfigError(f"{prefix}max_tree_depth: must be in [1, 256]")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ConfigError(f"{prefix}max_cached_requests: must be >= 0 (0: no global cache)")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ConfigError(f"{prefix}max_spec_factor: must be > 0")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ConfigError(f"{prefix}min_token_prob: must be in [0, 1]")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a SpeculativeConfig, a dict of its fields, a JSON object, or None (off)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config: not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config: give an object of its fields")
        if "model" in value and "method" not in value:  # vLLM infers the method
            value = {**value, "method": "draft_model"}
        if value.get("method", "ngram") not in SPECULATIVE_METHODS:
            cls(method=str(value["method"]))  # raises, naming what is supported
        value = _read_disable_by_batch_size(dict(value))
        names = {spec.name for spec in fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ConfigError(
                f"speculative_config: unknown fields {unknown}; known {sorted(names)}"
            )
        _check_types(value)
        return cls(**value)

    def to_json(self) -> str:
        return json.dumps({spec.name: getattr(self, spec.name) for spec in fields(self)})


def _read_disable_by_batch_size(value: dict) -> dict:
    """vLLM's `disable_by_batch_size` (off when more requests run) is our
    `max_num_seqs_to_speculate`; both given must agree."""
    if "disable_by_batch_size" not in value:
        return value
    size = value.pop("disable_by_batch_size")
    if value.setdefault("max_num_seqs_to_speculate", size) != size:
        raise ConfigError(
            "speculative_config: disable_by_batch_size and max_num_seqs_to_speculate differ"
        )
    return value


def _check_types(value: dict) -> None:
    floats = [k for k in _SPECULATIVE_FLOATS if k in value]
    not_numbers = [k for k in floats if type(value[k]) not in (int, float)]
    if not_numbers:
        raise ConfigError(f"speculative_config: {not_numbers} must be numbers")
    if value.get("model") is not None and type(value["model"]) is not str:
        raise ConfigError("speculative_config: model must be a path")
    ints = [k for k, v in value.items() if k not in ("method", "model") and k not in floats]
    ints = [k for k in ints if type(value[k]) is not int]
    if ints:
        raise ConfigError(f"speculative_config: {ints} must be integers")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry: `num_blocks` blocks of `block_size` token slots each."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    num_cpu_blocks: int = 0
    # the device cache lives in host memory (a CPU executor): swapping a block out is a
    # memcpy, far cheaper than recomputing its tokens, so "auto" preemption swaps
    swap_is_cheap: bool = False
    # the executor keeps prefix blocks leaving the CPU pool on disk (kv_disk_dir)
    enable_disk: bool = False
    # per KV group (engine/kv/kv_groups.py): its layers' span, 0 = full, w > 0 a sliding
    # window, -C chunks of C tokens; empty or one entry: one group, every block holding every
    # layer
    group_windows: tuple[int, ...] = ()
    # pinned prompt-cache blocks (GenerateRequest.cache, engine/kv/pins.py): at most this
    # fraction of the device blocks, and at most this many per key (cache_salt; 0: no bound
    # per key but the fraction)
    max_pinned_fraction: float = 0.5
    max_pinned_blocks_per_key: int = 0
    # recurrent layers (Mamba2): per-sequence state slots beside the blocks
    # (engine/kv/state_slots.py); 0: the model has none
    num_state_slots: int = 0
    # the state rows past those holding prefix snapshots (engine/kv/state_snapshots.py)
    num_snapshot_slots: int = 0
    state_slot_bytes: int = 0  # one state row's bytes (stats)
    # host rows of the state (engine/kv/host_states.py): for swapped-out sequences, and for
    # snapshots of prefix blocks on the CPU and disk tiers
    num_host_state_slots: int = 0
    num_host_snapshot_slots: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ConfigError("max_pinned_fraction: must be in [0, 1]")
        if self.max_pinned_blocks_per_key < 0:
            raise ConfigError("max_pinned_blocks_per_key: must be >= 0 (0: no bound per key)")
        for window in self.group_windows:
            if window < 0 and -window % self.block_size:
                # a chunk ending inside a block would leave that block half-needed
                raise ConfigError(
                    f"group_windows: the attention chunk size {-window} is not a multiple of "
                    f"block_size {self.block_size}; choose a block size that divides it"
                )
        if self.enable_disk and any(self.group_windows):
            # the disk index follows one full-attention table; a window's hits skip blocks
            raise ConfigError("kv_disk_dir: the disk tier serves full-attention models only")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size: must be a power of two, got {self.block_size}")
        if self.num_blocks < 1:
            raise ConfigError(f"num_blocks: must be at least 1, got {self.num_blocks}")
        if self.num_cpu_blocks < 0:
            raise ConfigError("swap_space: must be >= 0")

    @property
    def num_slots(self) -> int:
        return self.block_size * self.num_blocks

    @property
    def max_pinned_blocks(self) -> int:
        return int(self.num_blocks * self.max_pinned_fraction)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits for one step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"  # "auto" | "recompute" | "swap"
    max_waiting: int = 100_000
    vocab_size: int = 0  # the executor's; 0: token ids are not checked
    # a prefill chunk's most tokens a step, and the length past which a prompt's remaining
    # prefill counts as long (vLLM's); 0: the whole budget, no prompt long
    long_prefill_token_threshold: int = 0
    # prompts whose prefill spans steps at once (vLLM's); a prompt finishing in its first
    # chunk never counts, so with the threshold off (chunks of the whole budget) 1 is FCFS
    max_num_partial_prefills: int = 1
    # of those, most that are long: a long prompt waits for the one before it (FCFS, first
    # finished first) while shorter prompts still start beside it (vLLM's)
    max_long_partial_prefills: int = 1
    # admit a prompt only while the blocks its whole prompt, the prompts still prefilling and
    # one block per running request need are free now (evictable cached blocks count), so
    # finishing it does not preempt (and recompute) the requests already running; off as in
    # vLLM (python -m benchmarks.engine.kv_pressure: no preemptions, but later first tokens)
    reserve_prompt_blocks: bool = False
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs: must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens: must be at least 1")
        if self.max_model_len < 2:
            raise ConfigError("max_model_len: must be at least 2")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "max_num_batched_tokens: must be >= max_model_len without chunked prefill"
            )
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold: must be >= 0 (0: off)")
        check_partial_prefills(self.max_num_partial_prefills, self.max_long_partial_prefills)
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise ConfigError("preemption_mode: must be 'auto', 'recompute' or 'swap'")


def check_partial_prefills(max_num: int, max_long: int) -> None:
    if max_num < 1:
        raise ConfigError("max_num_partial_prefills: must be at least 1")
    if not 1 <= max_long <= max_num:
        raise ConfigError(
            "max_long_partial_prefills: must be at least 1 and at most max_num_partial_prefills"
        )


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_tensor_parallel(size: int, timeout_s: float) -> None:
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"tensor_parallel_size: must be an integer >= 1, got {size!r}")
    if timeout_s <= 0:
        raise ConfigError("tensor_parallel_timeout: must be positive")


def _check_disk(config: "ExecutorConfig | EngineConfig") -> None:
    # a plain int (a flag's ByteSize would not encode for tensor-parallel ranks)
    object.__setattr__(config, "kv_disk_bytes", int(config.kv_disk_bytes))
    folder, num_bytes = config.kv_disk_dir, config.kv_disk_bytes
    if folder is None:
        return
    if not folder:
        raise ConfigError("kv_disk_dir: give a folder (or leave it unset: no disk tier)")
    if num_bytes <= 0:
        raise ConfigError("kv_disk_bytes: give the disk tier's size, e.g. 4GiB")
    if config.tensor_parallel_size > 1:
        # each rank would read its own shard's files: which loaded must agree across ranks
        raise ConfigError("kv_disk_dir: not supported with tensor_parallel_size > 1 yet")


@dataclass(frozen=True)
class ExecutorConfig:
    model_path: Path
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes; used when num_blocks is None
    # share of the device's memory (CPU: RAM) for weights + KV; None: 0.9 on CUDA, and on
    # CPU the default cache size (engine/memory.py); used when kv_cache_memory is None
    gpu_memory_utilization: float | None = None
    # bytes of host memory for swapped-out and evicted blocks; None: a quarter of the KV
    # cache's size on CPU (swapping there is a memcpy), none on CUDA
    swap_space: int | None = None
    max_num_seqs: int = 256
    max_model_len: int = 4096
    attention_backend: str = "auto"
    # the order of values inside a cache block: "auto" (the AMX tile layout where the cpu
    # backend can use it, kernels/cpu_tiles.py) or "token-major" (always)
    kv_layout: str = "auto"
    seed: int = 0
    # "auto": the model's dtype. "fp8" (= "fp8_e4m3") / "fp8_e5m2": one byte a value, with
    # per-layer scales, on every backend. "bfloat16" / "float16" halve a float32 model's K/V
    # memory (cpu/torch backends); compute stays in the model's dtype either way
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    # seconds any rank waits in a collective (a step, a keepalive) before the group fails
    tensor_parallel_timeout: float = 10.0
    # the proposer's n-gram sizes; also as JSON (how tensor-parallel ranks receive it)
    speculative_config: SpeculativeConfig | dict | str | None = None
    # a disk tier under the CPU pool: prefix blocks leaving it are kept in this folder, at
    # most `kv_disk_bytes` of files (least recently used go first); None: off
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 0
    # the disk files' MAC key (created once); None: <cache dir>/nats/kv-disk.key
    kv_disk_key_file: str | None = None
    # seconds a step waits for one request's grammar to compile; past it, that request fails
    grammar_compile_timeout: float = 10.0
    # the tokenizer's folder when not the model's (--tokenizer): grammars compile against it
    tokenizer: str | None = None
    # no decode graphs on CPU (engine/worker/decode_graphs.py): every step runs eagerly
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        _check_tensor_parallel(self.tensor_parallel_size, self.tensor_parallel_timeout)
        _check_disk(self)
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
        )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError("num_blocks: must be at least 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError("kv_cache_memory: must be positive")
        if self.swap_space is not None and not 0 <= self.swap_space <= host_memory_bytes():
            raise ConfigError(
                f"swap_space: {self.swap_space} bytes is not in [0, host memory "
                f"{host_memory_bytes()}]"
            )
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization: must be in (0, 1]")
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_kv_layout(self.kv_layout)


def check_kv_layout(kv_layout: str) -> None:
    if kv_layout not in KV_LAYOUTS:
        raise ConfigError(f"kv_layout: {kv_layout!r} is not one of {', '.join(KV_LAYOUTS)}")


KV_LAYOUTS = ("auto", "token-major")


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of one engine, built once: from the offline `LLM`'s arguments, or from the
    services' Settings (same names). The executor's part is fixed when the model is known; the
    scheduler's when the executor has said what it holds (`ExecutorReady`)."""

    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    kv_layout: str = "auto"  # "token-major": never the AMX tile layout
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None  # None: 0.9 on CUDA (engine/memory.py)
    swap_space: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's, at most 8192
    max_waiting: int = 100_000
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # vLLM's: 0 is off offline; `kvpager serve`: 512
    max_num_partial_prefills: int = 1  # SchedulerConfig's; `kvpager serve`: 4
    max_long_partial_prefills: int = 1
    reserve_prompt_blocks: bool = False
    preemption_mode: str = "auto"
    seed: int = 0
    plan_ahead: int = 1  # steps planned beyond the one the executor runs (0: lockstep)
    tensor_parallel_size: int = 1  # ranks (processes, one device each) sharing the model
    tensor_parallel_timeout: float = 10.0
    # speculative decoding (None: off): a SpeculativeConfig, its fields as a dict, or JSON
    speculative_config: SpeculativeConfig | dict | str | None = None
    kv_disk_dir: str | None = None  # a disk tier under the CPU pool (None: off)
    kv_disk_bytes: int = 0  # its bound, in bytes of files
    kv_disk_key_file: str | None = None  # its files' MAC key (None: in the cache dir)
    # special-token text in chat messages becomes real tokens (off: refused, engine/frontend)
    allow_special_tokens_in_content: bool = False
    grammar_compile_timeout: float = 10.0  # seconds one grammar may take to compile
    tokenizer: str | None = None  # a tokenizer folder other than the model's (vLLM's)
    enforce_eager: bool = False  # vLLM's: no decode graphs (CPU: engine/worker/decode_graphs.py)
    # pinned prompt-cache blocks (GenerateRequest.cache): CacheConfig's bounds
    max_pinned_fraction: float = 0.5
    max_pinned_blocks_per_key: int = 0

    def __post_init__(self) -> None:
        _check_disk(self)
        if self.plan_ahead < 0:
            raise ConfigError("plan_ahead: must be >= 0")
        if self.grammar_compile_timeout <= 0:
            raise ConfigError("grammar_compile_timeout: must be positive")
        # normalised once, here: every reader sees a SpeculativeConfig or None
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
        )
        _check_tensor_parallel(self.tensor_parallel_size, self.tensor_parallel_timeout)
        check_partial_prefills(self.max_num_partial_prefills, self.max_long_partial_prefills)
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_kv_layout(self.kv_layout)

    @classmethod
    def pick(cls, source: Any) -> "EngineConfig":
        """The fields `source` (e.g. the services' Settings) has under the same names."""
        names = [spec.name for spec in fields(cls) if hasattr(source, spec.name)]
        return cls(**{name: getattr(source, name) for name in names})

    def model_len(self, model_config: ModelConfig) -> int:
        """The configured limit, or the model's (at most 8192). Sliding windows do not cap it:
        every attention kernel masks each layer's window."""
        return self.max_model_len or min(model_config.max_position_embeddings, 8192)

    def executor_config(self, model_path: Path, model_config: ModelConfig) -> ExecutorConfig:
        names = {spec.name for spec in fields(ExecutorConfig)} & {
            spec.name for spec in fields(self)
        }
        values = {name: getattr(self, name) for name in names}
        values["max_model_len"] = self.model_len(model_config)
        model_config.check_tensor_parallel(self.tensor_parallel_size)
        return ExecutorConfig(model_path=model_path, **values)

    def scheduler_config(
        self, max_num_seqs: int, max_model_len: int, vocab_size: int = 0
    ) -> SchedulerConfig:
        """Limits for an executor that holds `max_num_seqs` rows of `max_model_len` tokens."""
        return SchedulerConfig(
            vocab_size=vocab_size,
            max_num_seqs=min(self.max_num_seqs, max_num_seqs),
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
            max_waiting=self.max_waiting,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_long_partial_prefills=self.max_long_partial_prefills,
            reserve_prompt_blocks=self.reserve_prompt_blocks,
            speculative_config=self.speculative_config,
        )
